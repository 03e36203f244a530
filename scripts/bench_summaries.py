#!/usr/bin/env python
"""The three summary paths on this machine: fused (compiled), the CPU NumPy shortcut and eager torch.

Every measurement takes the paths in turn, one call (or one step) each, in one process,
and reports medians, so that a noisy machine slows all of them alike. The path is chosen
through the environment (``ACTVIZ_FUSED``, ``ACTVIZ_CPU_SHORTCUTS``), read at every call.

Usage::

    python scripts/bench_summaries.py sizes        # summarize() of one float32 tensor, per size (--dtype)
    python scripts/bench_summaries.py step         # logging steps of a small CNN (every=1), per path
    python scripts/bench_summaries.py first-step   # the first fused logging step's extra seconds, cold and warm
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

import actviz
from actviz.summaries.one_tensor import summarize

PATHS = {
    "fused": {"ACTVIZ_FUSED": "1", "ACTVIZ_CPU_SHORTCUTS": "1"},
    "numpy": {"ACTVIZ_FUSED": "0", "ACTVIZ_CPU_SHORTCUTS": "1"},
    "eager": {"ACTVIZ_FUSED": "0", "ACTVIZ_CPU_SHORTCUTS": "0"},
}


def cnn() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    blocks += [nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128 * 64, 10)]
    return nn.Sequential(*blocks)


def train_step(model: nn.Module, viz: actviz.Watcher | None = None) -> float:
    start = time.perf_counter()
    model(torch.randn(64, 3, 32, 32)).square().mean().backward()
    if viz is not None:
        viz.flush()
    return time.perf_counter() - start


def sizes(reps: int, dtype: torch.dtype) -> None:
    """summarize() per size, each call on the next tensor of a pool of 64 MB or more: out of cache, as in training."""
    print(f"| {dtype} elements | fused | NumPy shortcut | eager torch |\n|---|---|---|---|")
    for numel in (10**3, 10**4, 10**5, 10**6, 10**7):
        count = max(2, min(64, (64 << 20) // (dtype.itemsize * numel)))
        pool = [torch.randn(numel).to(dtype) for _ in range(count)]
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        tensors = itertools.cycle(pool)
        for rep in range(reps + 2):  # the first two: compiling and warming up
            for path, env in PATHS.items():
                os.environ.update(env)
                tensor = next(tensors)
                start = time.perf_counter()
                summarize(tensor)
                if rep >= 2:
                    times[path].append(time.perf_counter() - start)
        cells = " | ".join(f"{statistics.median(times[path]) * 1e3:.3f} ms" for path in PATHS)
        print(f"| {numel:.0e} | {cells} |", flush=True)


def step(steps: int) -> None:
    """Logging steps (every=1) of a watched CNN on each path, and steps of a bare copy, in turn."""
    model, bare = cnn(), cnn()
    times: dict[str, list[float]] = {path: [] for path in ["bare", *PATHS]}
    with actviz.watch(model, tempfile.mkdtemp(), every=1) as viz:
        for index in range(steps + 2):  # the first two: compiling and warming up
            for path in times:
                os.environ.update(PATHS.get(path, {}))
                elapsed = train_step(bare) if path == "bare" else train_step(model, viz)
                if index >= 2:
                    times[path].append(elapsed)
    for path, values in times.items():
        print(f"{path}: median {statistics.median(values) * 1e3:.1f} ms over {len(values)} steps", flush=True)


def first_step() -> None:
    """Child process: warm every other part on the eager path, then time the fused logging steps."""
    model = cnn()
    with actviz.watch(model, tempfile.mkdtemp(), every=1) as viz:
        os.environ.update(PATHS["numpy"])
        warm = [train_step(model, viz) for _ in range(3)]
        os.environ.update(PATHS["fused"])
        first, *later = [train_step(model, viz) for _ in range(4)]
    steady = statistics.median(later)
    then = ", ".join(f"{elapsed:.3f}" for elapsed in later)
    print(f"NumPy logging step {warm[-1]:.3f} s; fused: first {first:.3f} s, then {then} s;", end=" ")
    print(f"extra {first - steady:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["sizes", "step", "first-step", "first-step-child"])
    parser.add_argument("--reps", type=int, default=30, help="calls (sizes) or steps (step) per path")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch.set_num_threads")
    parser.add_argument("--dtype", default="float32", help="sizes: the tensors' dtype (bfloat16: no NumPy shortcut)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs", flush=True)
    if args.what == "sizes":
        sizes(args.reps, getattr(torch, args.dtype))
    elif args.what == "step":
        step(args.reps)
    elif args.what == "first-step-child":
        first_step()
    else:  # a fresh Inductor cache, then the same cache in a second process
        with tempfile.TemporaryDirectory() as cache:
            for label in ("cold", "warm"):
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                print(label, end=": ", flush=True)
                subprocess.run([sys.executable, __file__, "first-step-child"], env=env, check=True)


if __name__ == "__main__":
    main()
