"""The training thread's CPU time of a step on the accelerator code path, bare, watched but idle, and logging.

A proxy for a GPU's host, measured on a CPU: the micro ResNet-50 of ``count_host_instructions.py`` (ResNet-50's 107
layers and 161 parameters at 4 to 32 channels, batch 1, 33x33) makes the device's work nearly free, so the
training thread's CPU time is what the host spends issuing the step (Python, dispatch, garbage collection). With
``ACTVIZ_CPU_SHORTCUTS=0`` actviz takes the code path CUDA tensors take.

Three copies of the model (same weights, same batch) take one step each in turn, the order rotating: bare,
watched with ``every=10**9`` (every measured step logs nothing) and watched with ``every=1`` (every step logs,
pictures included). A step is ``zero_grad``, forward, cross-entropy, backward, ``SGD(foreach=True).step()`` and,
when watched, ``viz.flush()``; its time is ``time.thread_time`` of the training thread (the writer thread's work
and the wait for it are left out). The idle and logging steps' extra is taken over the bare step of the same turn,
so a machine that slows down slows all three alike. The writer thread's CPU time over the measured steps is
printed per logging step. Instructions are steadier than times: see ``count_host_instructions.py``.

Usage: ``python scripts/bench_host_time.py [--steps 30]``; about a minute on a 2-core machine.
Prints the medians over the measured turns (and their 10th to 90th percentiles).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings

import torch
from count_host_instructions import micro_resnet50
from torch import nn

import actviz


def writer_cpu_seconds() -> float:
    """CPU seconds of actviz's writer threads so far (steps that log nothing give them no work)."""
    return sum(time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) for thread in threading.enumerate()
               if thread.name == "actviz-writer" and thread.ident is not None)


def percentiles(values: list[float]) -> str:
    deciles = statistics.quantiles(values, n=10)
    return f"[{deciles[0]:+.1f} to {deciles[-1]:+.1f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="measured steps of each copy (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps of each copy (default 3)")
    args = parser.parse_args()
    os.environ["ACTVIZ_CPU_SHORTCUTS"] = "0"  # read at every call
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)

    inputs, labels = torch.randn(1, 3, 33, 33), torch.randint(0, 10, (1,))
    models = {"bare": micro_resnet50()}
    models["idle"], models["logging"] = copy.deepcopy(models["bare"]), copy.deepcopy(models["bare"])
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True) for name, model in models.items()}
    watchers = {"idle": actviz.watch(models["idle"], tempfile.mkdtemp(), every=10**9),
                "logging": actviz.watch(models["logging"], tempfile.mkdtemp(), every=1, image_every=1)}

    def step(name: str) -> float:
        started = time.thread_time()
        optimizers[name].zero_grad(set_to_none=True)
        nn.functional.cross_entropy(models[name](inputs), labels).backward()
        optimizers[name].step()
        if name in watchers:
            watchers[name].flush()
        return 1e3 * (time.thread_time() - started)

    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in names}
    writer_seconds = 0.0
    try:
        for turn in range(args.warmup + args.steps):
            if turn == args.warmup:
                writer_seconds = -writer_cpu_seconds()
            order = names[turn % 3:] + names[:turn % 3]
            measured = {name: step(name) for name in order}
            if turn >= args.warmup:
                for name in names:
                    times[name].append(measured[name])
        writer_seconds += writer_cpu_seconds()
    finally:
        for viz in watchers.values():
            viz.close()

    bare = times["bare"]
    print(f"micro ResNet-50, accelerator code path, torch {torch.__version__}, {args.steps} steps each")
    print(f"bare step {statistics.median(bare):.1f} ms {percentiles(bare).replace('+', '')}")
    for name in ("idle", "logging"):
        extra = [watched - plain for watched, plain in zip(times[name], bare)]
        share = [watched / plain - 1 for watched, plain in zip(times[name], bare)]
        print(f"{name} step {statistics.median(extra):+.1f} ms {percentiles(extra)}, "
              f"{statistics.median(share):+.2f} of a bare step")
    print(f"writer thread {1e3 * writer_seconds / args.steps:.1f} ms of CPU per logging step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
