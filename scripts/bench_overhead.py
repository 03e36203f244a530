#!/usr/bin/env python
"""Overhead of actviz against the bare training step and the common alternatives.

Each case runs two copies of one model (same weights, same batches) in turns, A (bare)
and B (monitored), the order within a pair swapping each time; its cost is the ratio B/A
of each pair (median, min, max) and of the summed times. Timing is ``time.perf_counter``
around forward, backward and optimizer step (``torch.cuda.synchronize`` on cuda). The
cases are the table :data:`CASES`: a setup function each, returning what to run after
each step and how to clean up, and an environment. "amortised" is measured over whole
periods of ``every=100`` or computed from idle and logging in one place (:func:`amortised`).
The setups are in ``bench_cases.py``, the models in ``bench_models.py``; histograms, the idle hook and memory in ``bench_micro.py``.

Usage::

    python scripts/bench_overhead.py                 # full run, a few minutes on 2 cores
    python scripts/bench_overhead.py --quick         # under a minute
    python scripts/bench_overhead.py --models cnn --cases actviz_idle,actviz_logging --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from bench_cases import DEFAULT_EVERY, Setup, actviz_case, amortised_case, ignite_case, tutorial_case, wandb_case
from bench_micro import histogram_benchmark, idle_hook_cost, idle_share, memory_benchmark, micro_markdown
from bench_models import MODELS, Trainer, build_model
from torch import nn

import actviz
from actviz.options import cpu_shortcuts
from actviz.output.tensorboard import use_fast_crc

DEVICE = torch.device("cpu")  # --device sets it


@dataclass(frozen=True)
class Case:
    """One row of the benchmark: its setup, and the environment it runs in."""

    setup: Callable[[nn.Module, Path], Setup]
    env: dict[str, str] = field(default_factory=dict)  # set for the case's duration
    whole_periods: bool = False  # measured over whole periods of DEFAULT_EVERY steps, else computed
    needs: str | None = None  # a package the case is skipped without
    probe: bool = False  # pass extras=[actviz.Probe(sample 0 of the first batch)] to the setup
    compiled: bool = False  # both copies torch.compile'd (Inductor), timed once compiled


#: The cases, in the order of the table. A variant is one more line (another env, another setup).
CASES: dict[str, Case] = {
    "bare": Case(lambda model, log_dir: Setup("B is a second bare copy: the ratio is the noise floor")),
    "actviz_idle": Case(partial(actviz_case, every=10**9)),
    "actviz_logging": Case(partial(actviz_case, every=1)),
    # The eager summaries beside the fused ones (ACTVIZ_FUSED=0 does nothing where it is not read).
    "actviz_logging_eager": Case(partial(actviz_case, every=1), env={"ACTVIZ_FUSED": "0"}),
    "actviz_amortised": Case(amortised_case, whole_periods=True),
    # A fixed probe: one extra forward per image step, feature maps drawn from it.
    "actviz_logging_probe": Case(partial(actviz_case, every=1), probe=True),
    # Both copies compiled: a step that logs nothing runs the compiled graph untouched.
    "compiled_bare": Case(lambda model, log_dir: Setup("both compiled: the noise floor"), compiled=True),
    "compiled_actviz_idle": Case(partial(actviz_case, every=10**9), compiled=True),
    "tutorial": Case(tutorial_case),
    "ignite": Case(ignite_case),
    "wandb_all_1": Case(partial(wandb_case, log_freq=1), needs="wandb"),
    "wandb_all_default": Case(partial(wandb_case, log_freq=1000), needs="wandb"),
}


# -- measurement -----------------------------------------------------------------------------


def measure_pairs(bare: Trainer, watched: Trainer, batches: Callable[[int], Any], warmup: int, steps: int,
                  budget_s: float, setup: Setup) -> dict[str, Any]:
    """Warm both up, then alternate A B B A A B ... for ``steps`` pairs (or until ``budget_s`` runs out)."""
    watched.after_step, watched.after_backward = setup.after_step, setup.after_backward
    for i in range(warmup):
        bare.step(batches(i))
        watched.step(batches(i))
    if setup.before_measure is not None:
        setup.before_measure()
    gc.collect()
    times: dict[Trainer, list[float]] = {bare: [], watched: []}
    deadline = time.perf_counter() + budget_s
    for i in range(steps):
        # Whichever runs second gets the other's cache and thread state; swapping cancels that bias.
        for trainer in (bare, watched) if i % 2 == 0 else (watched, bare):
            times[trainer].append(trainer.step(batches(warmup + i)))
        if time.perf_counter() > deadline and len(times[bare]) >= 5:
            break
    ratios = [b / a for a, b in zip(times[bare], times[watched])]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "total_ratio": sum(times[watched]) / sum(times[bare]), "pairs": len(ratios),
            "bare_ms_median": 1e3 * statistics.median(times[bare]),
            "watched_ms_median": 1e3 * statistics.median(times[watched]), "ratios": ratios}


def run_case(model_name: str, name: str, steps: int, warmup: int, budget_s: float, tmp: Path,
             skip_wandb: bool = False) -> dict[str, Any]:
    case = CASES[name]
    if case.needs == "wandb" and skip_wandb:
        return {"status": "skipped", "reason": "--no-wandb"}
    if case.needs and importlib.util.find_spec(case.needs) is None:
        return {"status": "skipped", "reason": f"{case.needs} is not installed (pip install actviz[bench])"}
    if case.whole_periods:
        if steps < DEFAULT_EVERY:
            return {"status": "ok", "method": "computed", "note": "too few steps for a whole period: computed "
                    "from the idle and logging cases as (99 * idle + logging) / 100 of summed-time ratios"}
        steps, budget_s = DEFAULT_EVERY * (steps // DEFAULT_EVERY), math.inf
    model, batches, _ = build_model(model_name, DEVICE)
    bare, watched = Trainer(model, DEVICE), Trainer(copy.deepcopy(model), DEVICE)
    if case.compiled:
        bare.model, watched.model = torch.compile(bare.model), torch.compile(watched.model)
    extra = {"extras": [actviz.Probe(batches(0)[0][:1])]} if case.probe else {}
    setup = Setup("")
    with mock.patch.dict(os.environ, case.env):  # restored afterwards
        try:
            setup = case.setup(watched.model, tmp / f"{model_name}-{name}", **extra)
            result = measure_pairs(bare, watched, batches, warmup, steps, budget_s, setup)
        finally:
            for function in setup.cleanup:
                with contextlib.suppress(Exception):
                    function()
    return {"status": "ok", "note": setup.note, **result}


def amortised(cases: dict[str, dict[str, Any]]) -> None:
    """The one place "amortised" is computed: ``(99 * idle + logging) / 100`` of the summed-time ratios."""
    result, idle, logging_ = (cases.get(name) for name in ("actviz_amortised", "actviz_idle", "actviz_logging"))
    if not (result and result["status"] == "ok" and idle and logging_ and "total_ratio" in idle
            and "total_ratio" in logging_):
        return
    result["computed"] = ((DEFAULT_EVERY - 1) * idle["total_ratio"] + logging_["total_ratio"]) / DEFAULT_EVERY
    if result.get("method") == "computed":
        result["total_ratio"] = result["computed"]
    else:
        result["method"] = "measured"


# -- report ----------------------------------------------------------------------------------


def _cell(result: dict[str, Any] | None) -> str:
    if result is None or result["status"] != "ok":
        return "not run" if result is None else result["status"]
    if result.get("method") == "computed":
        return f"computed {result['total_ratio']:.3f}" if "total_ratio" in result else "not computed"
    if result.get("method") == "measured":
        return f"Σ {result['total_ratio']:.3f} over {result['pairs']} steps (computed {result['computed']:.3f})"
    return f"{result['median']:.3f} [{result['min']:.2f}–{result['max']:.2f}]"


def markdown(report: dict[str, Any]) -> str:
    meta, models = report["meta"], report["models"]
    lines = [f"`{meta['command']}` — torch {meta['torch']}, {meta['threads']} threads, {meta['cpu_count']} CPUs, "
             f"load average at start {meta['load_start']}, at end {meta.get('load_end')}, "
             f"CPU shortcuts {'on' if meta.get('cpu_shortcuts') else 'off'}", "",
             "Ratios to the bare training step (median [min–max] of per-pair ratios; Σ = ratio of summed times).", "",
             "| case | " + " | ".join(f"{m} ({models[m]['bare_ms']:.1f} ms/step)" for m in models) + " |",
             "|---|" + "---|" * len(models)]
    lines += [f"| {case} | " + " | ".join(_cell(models[m]["cases"].get(case)) for m in models) + " |" for case in CASES]
    lines += micro_markdown(report)
    lines += ["", "| bar | target | measured | met |", "|---|---|---|---|"]
    lines += [f"| {name} | {bar['target']} | {bar['measured']} | {'yes' if bar['met'] else 'NO'} |"
              for name, bar in report["bars"].items()]
    return "\n".join(lines)


def _worst(report: dict[str, Any], case: str, key: str, models: tuple[str, ...] = ()) -> float | None:
    """The largest ``key`` of ``case`` over the models (or ``models``) where it ran."""
    values = [r["cases"][case][key] for m, r in report["models"].items() if (not models or m in models)
              and r["cases"].get(case, {}).get("status") == "ok" and key in r["cases"][case]]
    return max(values) if values else None


def _hook_share(report: dict[str, Any]) -> float | None:
    bare_ms = [r["bare_ms"] for r in report["models"].values() if math.isfinite(r.get("bare_ms", math.nan))]
    return 1 + idle_share(report["idle_hook"], min(bare_ms)) if report.get("idle_hook") and bare_ms else None


#: Each target, written once: (name, comparison, target, unit, digits, how to read the measured value).
BARS: list[tuple[str, str, float, str, int, Callable[[dict[str, Any]], float | None]]] = [
    ("non-logging step (median, worst model)", "≤", 1.01, "", 3, lambda r: _worst(r, "actviz_idle", "median")),
    ("non-logging step, hook cost measured directly (fastest model)", "≤", 1.01, "", 4, _hook_share),
    ("amortised at every=100 (Σ, worst model)", "≤", 1.02, "", 3, lambda r: _worst(r, "actviz_amortised", "total_ratio")),
    ("logging step, everything on, cnn (median)", "≤", 1.3, "", 3, lambda r: _worst(r, "actviz_logging", "median", ("cnn",))),
    ("histogram speed-up at 1e6", "≥", 3.0, "×", 1,
     lambda r: next((row["speedup"] for row in r.get("histogram", []) if row["numel"] == 10**6), None)),
    ("memory: live tensor growth", "≈", 0.0, " MB", 2, lambda r: r["memory"]["live_tensor_mb_growth"] if r.get("memory") else None),
]


def evaluate_bars(report: dict[str, Any]) -> dict[str, Any]:
    bars = {}
    for name, comparison, target, unit, digits, read in BARS:
        value = read(report)
        if value is not None:
            met = {"≤": value <= target, "≥": value >= target, "≈": abs(value - target) < 1.0}[comparison]
            sign = "+" if comparison == "≈" else ""
            bars[name] = {"target": f"{comparison} {target:g}{unit}", "measured": f"{value:{sign}.{digits}f}{unit}",
                          "met": met}
    return bars


def _load() -> str:
    with contextlib.suppress(OSError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="few steps, cnn only unless --models; under a minute")
    add("--models", default=None, help=f"comma-separated subset of {','.join(MODELS)}")
    add("--cases", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    add("--steps", type=int, default=None, help="measured pairs per case")
    add("--warmup", type=int, default=None, help="warm-up steps per side")
    add("--budget", type=float, default=None, help="seconds per case before stopping early")
    add("--device", default="cpu", help="where the models run: cpu or cuda")
    add("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch.set_num_threads")
    add("--memory-steps", type=int, default=None, help="watched steps for the memory check")
    add("--amortised-steps", type=int, default=None,
        help="steps for the measured amortised case (whole periods of 100; below 100 it is computed)")
    add("--no-histogram", action="store_true", help="skip the histogram micro-benchmark")
    add("--no-memory", action="store_true", help="skip the memory check")
    add("--memory-model", default=None, choices=MODELS, help="model of the memory check (default: first of --models)")
    add("--no-wandb", action="store_true", help="report the wandb cases as skipped")
    add("--json", default="bench_overhead.json", help="where to write the JSON report")
    add("--markdown", default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)

    global DEVICE
    DEVICE, quick = torch.device(args.device), args.quick
    models = args.models.split(",") if args.models else (["cnn"] if quick else MODELS)
    cases = args.cases.split(",") if args.cases else list(CASES)
    for kind, names, known in (("model", models, MODELS), ("case", cases, list(CASES))):
        for name in names:
            if name not in known:
                parser.error(f"unknown {kind} {name!r}; choose from {', '.join(known)}")
    steps = args.steps or (8 if quick else 60)
    warmup = args.warmup if args.warmup is not None else (2 if quick else 5)
    budget = args.budget or (3.0 if quick else 30.0)
    memory_steps = args.memory_steps or (50 if quick else 1000)
    amortised_steps = args.amortised_steps if args.amortised_steps is not None else (0 if quick else 200)

    torch.set_num_threads(args.threads)
    # actviz's fast TensorBoard checksum is process-wide (actviz.output.tensorboard.use_fast_crc): switch it on
    # before any case, so that every SummaryWriter-based case, tutorial and ignite too, gets it.
    fast_crc = use_fast_crc()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_MODE", "offline")
    command = "python scripts/bench_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report: dict[str, Any] = {"meta": {
        "command": command.strip(), "torch": torch.__version__, "actviz": actviz.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "threads": args.threads, "device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else str(DEVICE),
        "quick": quick, "steps": steps, "amortised_steps": amortised_steps, "warmup": warmup, "budget_s": budget,
        "load_start": _load(), "wandb": importlib.util.find_spec("wandb") is not None, "fast_crc": fast_crc,
        "cpu_shortcuts": cpu_shortcuts(),
    }, "models": {}}
    started = time.perf_counter()

    def say(what: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {what} ...", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="actviz-bench-") as tmp_name:
        tmp = Path(tmp_name)
        os.environ.setdefault("WANDB_DIR", tmp_name)
        for model_name in models:
            entry: dict[str, Any] = {"description": build_model(model_name, torch.device("cpu"))[2], "cases": {}}
            for case in cases:
                say(f"{model_name}/{case}")
                case_steps = amortised_steps if CASES[case].whole_periods else steps
                entry["cases"][case] = run_case(model_name, case, case_steps, warmup, budget, tmp, args.no_wandb)
            amortised(entry["cases"])
            bare_ms = [r["bare_ms_median"] for r in entry["cases"].values() if "bare_ms_median" in r]
            entry["bare_ms"] = statistics.median(bare_ms) if bare_ms else math.nan
            report["models"][model_name] = entry
        report["idle_hook"] = idle_hook_cost(tmp, quick)
        if not args.no_histogram:
            say("histogram micro-benchmark")
            report["histogram"] = histogram_benchmark([10**4, 10**5, 10**6] + ([] if quick else [10**7]), tmp, quick)
        if not args.no_memory:
            say(f"memory over {memory_steps} steps")
            report["memory"] = memory_benchmark(args.memory_model or models[0], memory_steps, 10, tmp, DEVICE)
    report["meta"]["load_end"] = _load()
    report["meta"]["seconds"] = time.perf_counter() - started
    report["bars"] = evaluate_bars(report)
    table = markdown(report)
    print(table)
    Path(args.json).write_text(json.dumps(report, indent=1, allow_nan=True))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    print(f"\nwrote {args.json} in {report['meta']['seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
