"""What actviz's transformer statistics cost on a 12-layer GPT-2 with tiny widths, on the accelerator code path.

The method of scripts/bench_host_time.py and scripts/count_device_ops.py, on a GPT-2 (12 layers, 2 heads, width 32, 64 tokens,
batch 1, Hugging Face ``sdpa`` attention) whose device work is nearly free, so the training thread's CPU time is host
overhead. Three copies take training steps in turns: bare, watched without the transformer statistics (a ``statistics=`` list without them) and watched with
the statistics on (every=1: every step logs; images off). Printed: the training thread's CPU time of a bare step, the
extra of a logging step with and without the statistics (median and p10-p90 over rounds), a step that does not log
(every=10**9) against bare, and the kernel-launching aten ops of one logging step, counted with a TorchDispatchMode.

Run from outside the project's root:  ACTVIZ_CPU_SHORTCUTS=0 python scripts/transformer_costs.py [--rounds 20]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("ACTVIZ_CPU_SHORTCUTS", "0")
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import actviz


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.kernels += not func.is_view
        return func(*args, **(kwargs or {}))


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=12, n_head=2, n_embd=32, vocab_size=64, n_positions=64, bos_token_id=0,
                        eos_token_id=0, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    bare = gpt2()
    models = {"bare": bare, "off": copy.deepcopy(bare), "on": copy.deepcopy(bare), "quiet": copy.deepcopy(bare)}
    watchers = {
        "off": actviz.watch(models["off"], tempfile.mkdtemp(), every=1, image_every=False,
            statistics=["moments", "dead_channels", "saturation"]),
        "on": actviz.watch(models["on"], tempfile.mkdtemp(), every=1, image_every=False),
        "quiet": actviz.watch(models["quiet"], tempfile.mkdtemp(), every=10**9, image_every=False),
    }
    watchers["quiet"].set_step(1)  # step 0 would log
    ids = torch.randint(0, 64, (1, 64))
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True) for name, model in models.items()}

    def step(name: str) -> float:
        model, optimizer = models[name], optimizers[name]
        start = time.thread_time()
        optimizer.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        if name in watchers:
            watchers[name].flush()
        return (time.thread_time() - start) * 1e3

    for _ in range(3):
        for name in models:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in models}
    for index in range(args.rounds):
        names = list(models) if index % 2 == 0 else list(reversed(models))
        found = {name: step(name) for name in names}
        for name in models:
            times[name].append(found[name] - (found["bare"] if name != "bare" else 0.0))
    kernels = {}
    for name in models:
        with Count() as count:
            step(name)
        kernels[name] = count.kernels
    for viz in watchers.values():
        viz.close()

    def spread(values: list[float]) -> str:
        values = sorted(values)
        return f"{statistics.median(values):+.1f} ms [{values[len(values) // 10]:+.1f} to {values[(9 * len(values)) // 10]:+.1f}]"

    print(f"host: bare step {statistics.median(times['bare']):.1f} ms; logging step, statistics off {spread(times['off'])}, "
          f"on {spread(times['on'])}; a step that does not log {spread(times['quiet'])} ({args.rounds} rounds)")
    print(f"kernel ops: bare {kernels['bare']}, logging step off {kernels['off']}, on {kernels['on']} "
          f"(+{kernels['on'] - kernels['off']} for 12 attention calls, {len(watchers['on'].layer_names)} layers and the "
          f"logits), a step that does not log {kernels['quiet']}")


if __name__ == "__main__":
    main()
