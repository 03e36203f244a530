"""Extra peak memory and writer-thread CPU of a logging step with pictures on: GPT-2 small, random init, on the CPU.

GPT-2 small (transformers ``GPT2LMHeadModel(GPT2Config())``) takes training steps (forward and backward at
batch 1 x 1,024 tokens) watched with ``every=2`` and pictures on: step 0 warms up, step 1 logs nothing (the bare
step), step 2 logs. Peak memory is the process's peak resident set (``VmHWM``), reset before each step through
``/proc/self/clear_refs``; every allocation of 64 KiB or more gets its own mapping (``MALLOC_MMAP_THRESHOLD_``,
set by re-running this script), given back when freed, so the peak is what was live, allocations inside ops
included. The writer thread's CPU time comes from ``/proc/self/task/<id>/stat``: in that run (where
every large allocation is a fresh mapping, so page faults add to it) and, in a second process with
malloc's defaults, per logging step over four more logging steps (the median is what a run sees).

Usage: ``python scripts/bench_gpt2_memory.py [--tokens 1024]`` (Linux; about two minutes).
Prints: the bare step's peak, the logging step's extra peak (MB and % of the bare peak), writer-thread CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Any


def peak_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def thread_cpu_seconds(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def watched_gpt2(tokens: int) -> tuple[Any, Any, Any]:
    """GPT-2 small (random init, training mode), a batch of ``tokens`` ids, and its watcher (every=2, pictures on)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    import actviz

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).train()
    ids = torch.randint(0, 50257, (1, tokens))
    return model, ids, actviz.watch(model, tempfile.mkdtemp(), every=2, image_every=2)


def train_step(model: Any, ids: Any, viz: Any) -> None:
    model(ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    viz.flush()


def writer_thread() -> threading.Thread | None:
    return next((thread for thread in threading.enumerate() if thread.name == "actviz-writer"), None)


def measure(tokens: int) -> None:
    model, ids, viz = watched_gpt2(tokens)

    def step() -> int:
        reset_peak()
        train_step(model, ids, viz)
        return peak_bytes()

    step()  # step 0: logs, and warms up
    bare = step()  # step 1: nothing logged
    writer = writer_thread()
    assert writer is not None
    cpu_before = thread_cpu_seconds(writer.native_id)
    logging = step()  # step 2: logs, pictures on
    writer_cpu = thread_cpu_seconds(writer.native_id) - cpu_before
    viz.close()
    extra = logging - bare
    print(f"gpt2-small {tokens} tokens: bare step peak {bare / 1e6:.0f} MB, logging step extra peak "
          f"{extra / 1e6:+.1f} MB ({100 * extra / bare:+.2f} %), writer-thread CPU {writer_cpu:.2f} s")


def measure_writer(tokens: int, logging_steps: int = 4) -> None:
    """The writer thread's CPU per logging step, with malloc's defaults, after two warm-up steps."""
    import statistics

    model, ids, viz = watched_gpt2(tokens)
    seconds = []
    with viz:
        for step in range(2 + 2 * logging_steps):
            writer = writer_thread()
            before = thread_cpu_seconds(writer.native_id) if writer is not None else 0.0
            train_step(model, ids, viz)
            if step >= 2 and step % 2 == 0:
                seconds.append(thread_cpu_seconds(writer.native_id) - before)  # type: ignore[union-attr]
    print(f"gpt2-small {tokens} tokens, malloc defaults: writer-thread CPU per logging step, median "
          f"{statistics.median(seconds):.2f} s of {', '.join(f'{value:.2f}' for value in seconds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--writer", action="store_true", help=argparse.SUPPRESS)  # the second process
    args = parser.parse_args()
    if args.writer:
        measure_writer(args.tokens)
    elif os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        code = subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env, check=False).returncode
        code = code or subprocess.run([sys.executable, __file__, *sys.argv[1:], "--writer"], check=False).returncode
        sys.exit(code)
    else:
        measure(args.tokens)


if __name__ == "__main__":
    main()
