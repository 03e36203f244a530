#!/usr/bin/env python
"""Wall time, host time and peak memory of a real training step on a CUDA GPU: bare, watched but idle, and logging.

Three copies of one model (same weights, same batch) train in turns, the order rotating each round:

- ``bare``: no actviz;
- ``idle``: ``actviz.watch(model, every=10**6)``, so every measured step is one that logs nothing;
- ``logging``: ``actviz.watch(model, every=1)``, so every step logs (everything on, pictures included).

A step is ``zero_grad``, the forward under ``torch.autocast(bfloat16)`` (``--amp off``: float32), cross-entropy,
backward and ``SGD(momentum=0.9, foreach=True).step()``. Measured per step:

- *host*: the training thread's CPU time (``time.thread_time``) from the step's start to just before
  ``torch.cuda.synchronize()``: what the host spends issuing the step, which a GPU hides while it is shorter
  than the device's work;
- *wall*: ``time.perf_counter`` around the whole step, the synchronize included;
- *peak*: ``torch.cuda.max_memory_allocated`` during the step, over its value at the step's start.

After each logging step, outside the timed region, ``viz.flush()`` waits for the writer thread (its time is
printed as ``writer``): at ``every=1`` nothing else would let it keep up, and at the ``every=100`` of a real run it
has a hundred steps to do that work.

The summaries are eager unless ``ACTVIZ_FUSED=1`` (compiled), as in a user's process.

Usage, on a machine with a CUDA GPU::

    python scripts/bench_gpu_step.py                          # ResNet-50, batch 64, 224x224, bf16
    ACTVIZ_FUSED=1 python scripts/bench_gpu_step.py --rounds 30   # the compiled summaries
    python scripts/bench_gpu_step.py --model micro            # bench_host_time.py's micro ResNet-50: host-bound steps
    python scripts/bench_gpu_step.py --model gpt2             # GPT-2 small at 1 x 1,024 tokens (needs transformers)
    python scripts/bench_gpu_step.py --profile prof.txt       # also: a logging step's syncs and kernel launches

The last line is the figure: medians over the rounds, and the logging step's wall time over the bare step's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable

import torch
from torch import nn

import actviz
from actviz.summaries.fused import use_fused
from count_host_instructions import micro_resnet50  # its sibling here: bench_host_time.py's model


def build(name: str, batch: int, device: torch.device) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The model (random init) on ``device`` and its loss on one fixed batch."""
    torch.manual_seed(0)
    if name == "gpt2":  # GPT-2 small from transformers, on 1,024 tokens
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config())
        tokens = torch.randint(0, model.config.vocab_size, (batch, 1024), device=device)
        return model.to(device).train(), lambda m: m(tokens, labels=tokens).loss
    if name == "micro":
        model, size, classes = micro_resnet50(), 33, 10
    else:
        import torchvision

        model, size, classes = torchvision.models.get_model(name, weights=None), 224, 1000
    inputs = torch.randn(batch, 3, size, size, device=device)
    targets = torch.randint(0, classes, (batch,), device=device)
    return model.to(device).train(), lambda m: nn.functional.cross_entropy(m(inputs), targets)


def profile_logging_step(step: Callable[[], object], path: str) -> None:
    """One logging step under ``torch.cuda.set_sync_debug_mode("warn")``, then one under ``torch.profiler``."""
    sites: collections.Counter[str] = collections.Counter()

    def record(*args: object, **kwargs: object) -> None:  # where in actviz the host waited, if it was in actviz
        frames = [frame for frame in traceback.extract_stack() if f"{os.sep}actviz{os.sep}" in frame.filename]
        sites[f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "outside actviz"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()  # its own synchronize() and flush() count "outside actviz"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step()
    table = profile.key_averages()
    launches = sum(event.count for event in table if event.key in ("cudaLaunchKernel", "cuLaunchKernel"))
    with open(path, "w") as out:
        out.write(table.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70) + "\n")
        out.write(table.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70) + "\n")
    in_actviz = sum(count for site, count in sites.items() if site != "outside actviz")
    print(f"one logging step: {in_actviz} host syncs in actviz {dict(sites.most_common(5))}, "
          f"{launches} kernel launches (tables in {path})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50",
                        help="a torchvision model name (default resnet50), 'micro' or 'gpt2' (transformers)")
    parser.add_argument("--batch", type=int, default=None, help="default 64 (micro and gpt2: 1)")
    parser.add_argument("--amp", choices=["on", "off"], default=None, help="bf16 autocast (default on; micro: off)")
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds of one step per copy")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before measuring (the compile happens here)")
    parser.add_argument("--profile", metavar="FILE", help="also profile one logging step: its host syncs (and where in "
                        "actviz they come from) and kernel launches, printed; torch.profiler's tables written to FILE")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only checks this script: no memory figures")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False); --device cpu checks the script alone")
    micro = args.model == "micro"
    batch = args.batch or (1 if micro or args.model == "gpt2" else 64)
    amp = (args.amp or ("off" if micro else "on")) == "on"
    warnings.filterwarnings("ignore")

    bare, compute_loss = build(args.model, batch, device)
    copies = {"bare": bare, "idle": copy.deepcopy(bare), "logging": copy.deepcopy(bare)}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9, foreach=True) for k, m in copies.items()}
    folder = tempfile.mkdtemp(prefix="actviz-gpu-")
    watchers = {"idle": actviz.watch(copies["idle"], os.path.join(folder, "idle"), every=10**6),
                "logging": actviz.watch(copies["logging"], os.path.join(folder, "logging"), every=1)}

    def step(kind: str) -> tuple[float, float, float, float]:
        model, optimizer = copies[kind], optimizers[kind]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        at_start = torch.cuda.memory_allocated() if cuda else 0
        wall, host = time.perf_counter(), time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            loss = compute_loss(model)
        loss.backward()
        optimizer.step()
        host = time.thread_time() - host
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - wall
        peak = torch.cuda.max_memory_allocated() - at_start if cuda else 0
        writer = time.perf_counter()
        if kind in watchers:
            watchers[kind].flush()
        writer = time.perf_counter() - writer
        return wall * 1e3, host * 1e3, peak / 2**20, writer * 1e3

    kinds = list(copies)
    for _ in range(args.warmup):
        for kind in kinds:
            step(kind)
    results: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in kinds}
    for i in range(args.rounds):
        order = kinds[i % 3:] + kinds[:i % 3]
        for kind in order:
            results[kind].append(step(kind))
    if args.profile and cuda:
        profile_logging_step(lambda: step("logging"), args.profile)
    for viz in watchers.values():
        viz.close()

    def median(kind: str, column: int) -> float:
        return statistics.median(r[column] for r in results[kind])

    fused = use_fused()
    what = (f"{args.model}, batch {batch}, {'bf16 autocast' if amp else 'float32'}, "
            f"{'fused' if fused else 'eager'} summaries, {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}, "
            f"{args.rounds} rounds")
    bare_wall, bare_host = median("bare", 0), median("bare", 1)
    for kind in kinds:
        print(f"  {kind:8s} wall {median(kind, 0):7.2f} ms  host {median(kind, 1):7.2f} ms  "
              f"peak {median(kind, 2):8.1f} MiB  writer {median(kind, 3):7.2f} ms", file=sys.stderr)
    print(f"{what}: bare {bare_wall:.2f} ms wall ({bare_host:.2f} ms host); "
          f"idle {median('idle', 0) - bare_wall:+.2f} ms wall ({median('idle', 1) - bare_host:+.2f} host); "
          f"logging {median('logging', 0) - bare_wall:+.2f} ms wall ({median('logging', 1) - bare_host:+.2f} host), "
          f"{median('logging', 0) / bare_wall:.2f}x the bare step, peak memory "
          f"{median('logging', 2) - median('bare', 2):+.0f} MiB; the writer then took {median('logging', 3):.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
