"""The parts of scripts/bench_overhead.py that are not A/B pairs: histograms, the idle hook, memory, and their lines of the report."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_models import Trainer, build_model
from torch import nn

import actviz
from actviz.common.results import StepResults, Summary
from actviz.output.tensorboard import TensorBoardSink
from actviz.summaries.one_tensor import summarize


def histogram_benchmark(sizes: list[int], tmp: Path, quick: bool) -> list[dict[str, Any]]:
    """Time actviz's summary (+ writing it) against SummaryWriter.add_histogram, on random float32 tensors."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp / "histogram-bench"))
    sink = TensorBoardSink(writer, owns_writer=False)
    rows = []
    try:
        for size in sizes:
            tensor = torch.randn(size, generator=torch.Generator().manual_seed(size))
            repeats = max(2, min(10, int(2e6 // size))) if quick else max(3, min(50, int(2e7 // size)))
            functions = {  # actviz: summarize, then one histogram through the sink's real write path
                "actviz_s": lambda tensor=tensor: sink.write(StepResults(0, weights={"a": Summary.from_vector(summarize(tensor).tolist())})),
                "summarize_s": lambda tensor=tensor: summarize(tensor).tolist(),
                "add_histogram_s": lambda tensor=tensor: writer.add_histogram("bench/add_histogram", tensor, 0),
            }
            timings = {}
            for label, function in functions.items():
                function()  # warm
                samples = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    function()
                    samples.append(time.perf_counter() - start)
                timings[label] = statistics.median(samples)
            rows.append({"numel": size, **timings, "speedup": timings["add_histogram_s"] / timings["actviz_s"],
                         "repeats": repeats})
    finally:
        writer.close()
    return rows


def idle_hook_cost(tmp: Path, quick: bool) -> dict[str, Any]:
    """Microseconds a step that logs nothing spends in actviz, measured directly.

    The A/B ratios of ``actviz_idle`` can't resolve less than about 1 % (see the ``bare``
    row). Here a one-layer model, whose forward costs a few microseconds, runs blocks of
    forwards bare and watched (``every=10**9``, step 0 already logged) in turn; the
    difference of the per-forward medians is the root pre-hook's whole cost per step.
    """
    bare, watched = nn.Linear(4, 4), nn.Linear(4, 4)
    viz = actviz.watch(watched, tmp / "idle-hook", every=10**9)
    inputs = torch.randn(1, 4)
    watched(inputs).sum().backward()  # step 0 logs; every later forward is a step that logs nothing
    block, blocks = (200, 20) if quick else (2000, 50)
    per_forward: dict[str, list[float]] = {"bare": [], "watched": []}
    try:
        for _ in range(blocks):
            for label, net in (("bare", bare), ("watched", watched)):
                start = time.perf_counter()
                for _ in range(block):
                    net(inputs)
                per_forward[label].append((time.perf_counter() - start) / block)
    finally:
        viz.close()
    bare_us, watched_us = (statistics.median(per_forward[label]) * 1e6 for label in ("bare", "watched"))
    return {"bare_forward_us": bare_us, "watched_forward_us": watched_us, "hook_us": watched_us - bare_us,
            "forwards": block * blocks}


def idle_share(hook: dict[str, Any], bare_ms: float) -> float:
    """The idle hook's cost as a fraction of a bare step of ``bare_ms`` milliseconds."""
    return max(0.0, hook["hook_us"]) / (1e3 * bare_ms)


def _rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live_tensors() -> tuple[int, int]:
    count = size = 0
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):  # some objects raise on isinstance or have no storage
            # Plain tensors and parameters: torch.compile's fake tensors hold no memory (and symbolic sizes).
            if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
                count, size = count + 1, size + obj.untyped_storage().nbytes()
    return count, size


def memory_benchmark(model_name: str, steps: int, every: int, tmp: Path, device: torch.device) -> dict[str, Any]:
    """RSS, live tensors and Python-heap allocations before and after ``steps`` watched steps."""
    import tracemalloc

    model, batches, _ = build_model(model_name, device)
    trainer = Trainer(model, device)
    with actviz.watch(trainer.model, tmp / "memory", every=every) as viz:
        for i in range(2 * every):  # warm up allocator and writer
            trainer.step(batches(i))
        viz.flush()
        gc.collect()
        tracemalloc.start()
        before = (_rss_bytes(), _live_tensors(), tracemalloc.get_traced_memory()[0])
        for i in range(steps):
            trainer.step(batches(i))
        viz.flush()
        gc.collect()
        after = (_rss_bytes(), _live_tensors(), tracemalloc.get_traced_memory()[0])
        tracemalloc.stop()
    events = sum(path.stat().st_size for path in (tmp / "memory").rglob("*") if path.is_file())
    return {
        "model": model_name, "steps": steps, "every": every,
        "rss_before_mb": before[0] / 2**20, "rss_after_mb": after[0] / 2**20, "rss_growth_mb": (after[0] - before[0]) / 2**20,
        "live_tensors_before": before[1][0], "live_tensors_after": after[1][0],
        "live_tensor_mb_growth": (after[1][1] - before[1][1]) / 2**20,
        "python_heap_growth_kb": (after[2] - before[2]) / 2**10, "event_file_mb": events / 2**20,
        "note": "CPU: torch allocations counted as live tensor objects and their storage bytes (gc); "
        "Python heap by tracemalloc; RSS includes allocator caching",
    }


def micro_markdown(report: dict[str, Any]) -> list[str]:
    """The markdown lines of the idle hook's cost, the histogram table and the memory check, when they ran."""
    lines, hook, models = [], report.get("idle_hook"), report["models"]
    if hook:
        shares = ", ".join(f"{1 + idle_share(hook, models[m]['bare_ms']):.4f} ({m})" for m in models)
        lines += ["", f"Step that logs nothing, measured directly: actviz's root pre-hook costs {hook['hook_us']:.1f} µs "
                  f"per forward ({hook['bare_forward_us']:.1f} µs bare, {hook['watched_forward_us']:.1f} µs watched, "
                  f"{hook['forwards']} forwards each); against the bare steps above that is {shares}."]
    if report.get("histogram"):
        lines += ["", "| elements | actviz summary + write | summarize only | add_histogram | speed-up |", "|---|---|---|---|---|"]
        lines += [f"| {r['numel']:.0e} | {1e3 * r['actviz_s']:.2f} ms | {1e3 * r['summarize_s']:.2f} ms "
                  f"| {1e3 * r['add_histogram_s']:.2f} ms | {r['speedup']:.1f}× |" for r in report["histogram"]]
    mem = report.get("memory")
    if mem:
        lines += ["", f"Memory over {mem['steps']} watched steps ({mem['model']}, every={mem['every']}): RSS "
                  f"{mem['rss_before_mb']:.1f} → {mem['rss_after_mb']:.1f} MB ({mem['rss_growth_mb']:+.1f} MB), "
                  f"live tensors {mem['live_tensors_before']} → {mem['live_tensors_after']} "
                  f"({mem['live_tensor_mb_growth']:+.2f} MB), Python heap {mem['python_heap_growth_kb']:+.0f} kB, "
                  f"event file {mem['event_file_mb']:.1f} MB."]
    return lines
