#!/usr/bin/env python
"""The first steps of a torch.compile'd model, compile included: bare against watched by actviz.

Each run is a fresh Python process with its own empty Inductor cache, so both sides pay the
whole cold compile, as a new job does. The runs alternate, bare then watched, ``--repeats``
times. A run trains ``--steps`` steps (default 13) of the model compiled with ``--backend``
(default Inductor), watched with ``every=--every`` (default 4, so steps 0, 4, 8 and 12 log);
its time runs from the first forward to the end of the last step, ``viz.close()`` included.
It also counts the graphs Dynamo made and its recompiles.

Usage::

    python scripts/bench_compile.py                        # small CNN, Inductor, 3 pairs
    python scripts/bench_compile.py --model resnet18 --backend aot_eager --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ["cnn", "alexnet", "transformer", "resnet18"]


def one_run(model_name: str, backend: str, steps: int, every: int, watched: bool) -> dict[str, float]:
    """Train ``steps`` compiled steps in this process; the seconds taken and Dynamo's counts."""
    import torch
    import torch._dynamo
    from bench_models import Trainer, build_model

    import actviz

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    device = torch.device("cpu")
    if model_name == "resnet18":
        import torchvision

        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=10)
        data = [(torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))) for _ in range(4)]
        batches = lambda i: data[i % 4]  # noqa: E731
    else:
        model, batches, _ = build_model(model_name, device)
    trainer = Trainer(torch.compile(model, backend=backend), device)
    start = time.perf_counter()
    viz = actviz.watch(trainer.model, tempfile.mkdtemp(prefix="actviz-bench-compile-"), every=every) if watched else None
    step_times = [trainer.step(batches(step)) for step in range(steps)]
    if viz is not None:
        viz.close()
    counters = torch._dynamo.utils.counters
    return {"seconds": time.perf_counter() - start, "first_step_s": step_times[0],
            "later_steps_s": sum(step_times[1:]), "graphs": counters["stats"]["unique_graphs"],
            "recompiles": sum(counters["recompiles"].values())}


def spawn(args: argparse.Namespace, watched: bool) -> dict[str, float]:
    """One run in a fresh process with an empty Inductor cache."""
    with tempfile.TemporaryDirectory(prefix="actviz-inductor-cache-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
        command = [sys.executable, __file__, "--child", "watched" if watched else "bare", "--model", args.model,
                   "--backend", args.backend, "--steps", str(args.steps), "--every", str(args.every)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the {'watched' if watched else 'bare'} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=MODELS)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor, aot_eager, eager)")
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="bare/watched pairs, each run a fresh process")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take before it fails")
    parser.add_argument("--json", default=None, help="also write the runs and ratios here")
    parser.add_argument("--child", choices=["bare", "watched"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_run(args.model, args.backend, args.steps, args.every, args.child == "watched")))
        return 0

    runs: dict[str, list[dict[str, float]]] = {"bare": [], "watched": []}
    for repeat in range(args.repeats):
        for side in ("bare", "watched") if repeat % 2 == 0 else ("watched", "bare"):
            runs[side].append(spawn(args, side == "watched"))
            print(f"{side}: {runs[side][-1]}", file=sys.stderr, flush=True)
    median = {side: {key: statistics.median(run[key] for run in rows) for key in rows[0]} for side, rows in runs.items()}
    ratio = median["watched"]["seconds"] / median["bare"]["seconds"]
    print(f"{args.model}, backend {args.backend}, {args.steps} steps, every={args.every}, {args.repeats} pairs "
          f"(medians): bare {median['bare']['seconds']:.1f} s ({median['bare']['graphs']:.0f} graphs), "
          f"watched {median['watched']['seconds']:.1f} s ({median['watched']['graphs']:.0f} graphs, "
          f"{median['watched']['recompiles']:.0f} recompiles): ratio {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "median": median, "ratio": ratio},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
