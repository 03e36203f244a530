"""Which ops a GPT-2 logging step adds, by name and owner, and how their bytes grow with the context length.

GPT-2 small (transformers' ``GPT2LMHeadModel`` from its config, random init, ``sdpa`` attention) takes one training
step (zero_grad, forward with the loss, backward, ``SGD(foreach=True)`` step, ``viz.flush()``) on the CPU on the
accelerator code path (``ACTVIZ_CPU_SHORTCUTS=0``): bare, then watched with ``every=1, image_every=1`` (everything on,
the transformer statistics included), each counted after one warm-up step by :class:`step_ops.StepOps`. An op is
actviz's when an actviz frame other than the attention mode's ``__torch_function__`` is on the stack; the ones whose
stack also holds that ``__torch_function__`` (actviz's forward hooks, run while the mode watches the forward) are
listed apart: a meter that stops at the innermost actviz frame counts them as the model's.

For each context length (``--tokens``) it prints the model's ops bare and logging by name where they differ, and
actviz's ops by name: count and bytes. With three or more lengths it fits each of actviz's op names' bytes as
``a + b*T + c*T**2`` and prints the fit at ``--project`` lengths: a term in ``T**2`` is a materialized
``T x T`` matrix.

Usage::

    python scripts/count_transformer_ops.py                                    # T = 1,024 (about a minute)
    python scripts/count_transformer_ops.py --tokens 256,512,1024 --project 1024,4096,16384 --json ops.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import warnings

os.environ.setdefault("ACTVIZ_CPU_SHORTCUTS", "0")
import torch

import actviz
from count_device_ops import watched_bytes  # its siblings in scripts/
from step_ops import StepOps


def gpt2(tokens: int, layers: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_positions=max(1024, tokens))
    model = GPT2LMHeadModel(config).train()
    return model, torch.randint(0, config.vocab_size, (1, tokens))


def step(model: torch.nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer, viz: object) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    if viz is not None:
        viz.flush()


def count(tokens: int, layers: int) -> tuple[dict[str, StepOps], int]:
    """One counted step of a bare and of a logging copy (fresh models, same weights) at ``tokens``, and the bytes
    the logging copy watches (each watched layer's first output and its gradient, each parameter and its gradient)."""
    found, watched = {}, 0
    for case in ("bare", "logging"):
        model, ids = gpt2(tokens, layers)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9, foreach=True)
        viz = actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=1) if case == "logging" else None
        try:
            step(model, ids, optimizer, viz)
            if viz is not None:
                watched = watched_bytes(viz, lambda: step(model, ids, optimizer, viz))  # noqa: B023 - called here
            with StepOps() as ops:
                step(model, ids, optimizer, viz)
        finally:
            if viz is not None:
                viz.close()
        found[case] = ops
    return found, watched


def actviz_rows(ops: StepOps) -> dict[tuple[str, bool], list[int]]:
    """``{(op name, via the attention mode): [count, bytes]}`` of actviz's ops."""
    rows: dict[tuple[str, bool], list[int]] = collections.defaultdict(lambda: [0, 0])
    for op in ops.ops:
        if op.owner == "actviz":
            rows[(op.name, op.via_mode)][0] += 1
            rows[(op.name, op.via_mode)][1] += op.read + op.written
    return dict(rows)


def fit_quadratic(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares ``(a, b, c)`` of ``y = a + b*t + c*t**2`` through ``(t, y)`` points (three or more).

    Example:
        >>> [round(v, 6) for v in fit_quadratic([(1, 6), (2, 17), (3, 34)])]  # 1 + 2t + 3t²
        [1.0, 2.0, 3.0]
    """
    t = torch.tensor([p[0] for p in points], dtype=torch.float64)
    y = torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(t), t, t * t], dim=1)
    solution = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
    return tuple(float(v) for v in solution)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--tokens", default="1024", help="context lengths, comma-separated (default 1024)")
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (default 12: GPT-2 small)")
    parser.add_argument("--project", default="1024,4096,16384", help="lengths to project the fit to")
    parser.add_argument("--json", help="write the counts here")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    lengths = [int(t) for t in args.tokens.split(",")]
    results: dict[int, dict[str, object]] = {}
    for tokens in lengths:
        counted, watched = count(tokens, args.layers)
        bare, logging_step = counted["bare"], counted["logging"]
        model_bare, model_logging = bare.by_name("model"), logging_step.by_name("model")
        rows = actviz_rows(logging_step)
        n_bare, n_logging = sum(v[0] for v in model_bare.values()), sum(v[0] for v in model_logging.values())
        via = sum(v[0] for (name, mode), v in rows.items() if mode)
        print(f"== GPT-2, {args.layers} layers, 1 x {tokens} tokens, float32, torch {torch.__version__}")
        print(f"model ops: bare {n_bare:,}, logging {n_logging:,}; model bytes bare "
              f"{sum(v[1] for v in model_bare.values()) / 2**30:.2f} GiB, logging "
              f"{sum(v[1] for v in model_logging.values()) / 2**30:.2f} GiB")
        for name in sorted(set(model_bare) | set(model_logging)):
            if model_bare.get(name, [0])[0] != model_logging.get(name, [0])[0]:
                print(f"  model op differs: {name} bare {model_bare.get(name, [0])[0]}, logging "
                      f"{model_logging.get(name, [0])[0]}")
        total = sum(v[0] for v in rows.values())
        moved = sum(v[1] for v in rows.values())
        print(f"actviz ops: {total:,} moving {moved / 2**30:.3f} GiB for {watched / 2**30:.3f} GiB watched "
              f"(x{moved / watched:.2f}); {via:,} of them in forward hooks under the attention mode (a meter "
              "stopping at its __torch_function__ counts them as the model's)")
        print(f"  {'op':44s} {'via mode':>8s} {'count':>6s} {'MiB':>9s}")
        for (name, mode), (n, b) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:44s} {'yes' if mode else '':>8s} {n:6d} {b / 2**20:9.2f}")
        results[tokens] = {"model_ops_bare": n_bare, "model_ops_logging": n_logging,
                           "model_bytes_bare": sum(v[1] for v in model_bare.values()), "watched_bytes": watched,
                           "actviz": {f"{name}|{'mode' if mode else ''}": v for (name, mode), v in rows.items()}}
    if len(lengths) >= 3:
        projected = [int(t) for t in args.project.split(",")]
        names = sorted({key for r in results.values() for key in r["actviz"]})
        print(f"== actviz's bytes per op name, fitted as a + b*T + c*T^2 over T = {lengths}, projected (MiB)")
        print(f"  {'op|via mode':50s} {'c (B/T^2)':>10s} " + " ".join(f"{f'T={t}':>10s}" for t in projected))
        sums = {t: 0.0 for t in projected}
        for key in names:
            a, b, c = fit_quadratic([(t, results[t]["actviz"].get(key, [0, 0])[1]) for t in lengths])
            values = {t: a + b * t + c * t * t for t in projected}
            for t in projected:
                sums[t] += values[t]
            print(f"  {key:50s} {c:10.3f} " + " ".join(f"{values[t] / 2**20:10.1f}" for t in projected))
        a, b, c = fit_quadratic([(t, results[t]["model_bytes_bare"]) for t in lengths])
        print(f"  {'all of actviz':50s} {'':10s} " + " ".join(f"{sums[t] / 2**20:10.1f}" for t in projected))
        print(f"  {'the bare step (model), for scale':50s} {c:10.3f} " + " ".join(
            f"{(a + b * t + c * t * t) / 2**20:10.1f}" for t in projected))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
