"""Which ops a GPT-2 logging step adds, by name and owner, and how their bytes grow with the context length.

GPT-2 small (transformers' ``GPT2LMHeadModel`` from its config, random init, ``sdpa`` attention) takes one training
step (zero_grad, forward with the loss, backward, ``SGD(foreach=True)`` step, ``viz.flush()``) on the CPU on the
accelerator code path (``ACTVIZ_CPU_SHORTCUTS=0``): bare, then watched with ``every=1, image_every=1`` (everything on,
the transformer statistics included), each counted after one warm-up step by :class:`step_ops.StepOps`. An op is
actviz's when an actviz frame other than the attention mode's ``__torch_function__`` is on the stack; the ones whose
stack also holds that ``__torch_function__`` (actviz's forward hooks, run while the mode watches the forward) are
listed apart: a meter that stops at the innermost actviz frame counts them as the model's.

For each context length (``--tokens``) it prints the model's ops bare and logging by name where they differ, and
actviz's ops by name: count and bytes. With three or more lengths it sums actviz's bytes by what they are for
(:data:`GROUPS`), says whether each grows no faster than linearly in T (no ``T x T`` matrix: each doubling adds no
more than the one before), and bounds them at the ``--project`` lengths by the line through the last two.

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


#: actviz's ops by what they are for: (label, op names, under the attention mode or not).
GROUPS = [
    ("forward hooks: the one-pass summary of each watched output", {"actviz.summarize.default"}, True),
    ("forward hooks: the heat map of sample 0 (aminmax, adaptive_avg_pool2d)",
     {"aten.aminmax.default", "aten._adaptive_avg_pool2d.default"}, True),
    ("forward hooks: the outliers' median |x|, packing", None, True),
    ("gradients and parameters: the one-pass summary", {"actviz.summarize.default"}, False),
    ("attention statistics", {"aten.baddbmm.default", "aten.where.self", "aten._softmax.default", "aten.xlogy.Tensor",
                              "aten.gt.Scalar", "aten.sum.dim_IntList", "aten.amax.default"}, False),
    ("logit statistics (actviz::logit_rows)", {"actviz.logit_rows.default"}, False),
    ("the step's one copy to the host, and the rest", None, False),
]


def group_of(name: str, via_mode: bool) -> str:
    """The :data:`GROUPS` label of one of actviz's ops (the catch-all of its side where no set names it).

    Example:
        >>> group_of("aten.aminmax.default", True), group_of("aten.cat.default", False)
        ('forward hooks: the heat map of sample 0 (aminmax, adaptive_avg_pool2d)', "the step's one copy to the host, and the rest")
    """
    for label, names, mode in GROUPS:
        if mode == via_mode and names is not None and name in names:
            return label
    return next(label for label, names, mode in GROUPS if mode == via_mode and names is None)


def linear_bound(points: list[tuple[float, float]], at: float) -> float:
    """The line through the last two ``(T, bytes)`` points, at ``at``: an upper bound beyond them for bytes that
    grow no faster than linearly (each step adds no more than the one before; checked by :func:`grows_linearly`).

    Example:
        >>> linear_bound([(256, 1.0), (512, 1.8), (1024, 3.0)], 4096)  # slope 1.2 / 512 from 1,024
        10.2
    """
    (t1, y1), (t2, y2) = points[-2], points[-1]
    return y2 + (y2 - y1) / (t2 - t1) * (at - t2)


def grows_linearly(points: list[tuple[float, float]], slack: float = 1.01) -> bool:
    """Whether each slope between successive points is at most the one before (within ``slack``).

    Example:
        >>> grows_linearly([(256, 1.0), (512, 2.0), (1024, 4.0)]), grows_linearly([(256, 1.0), (512, 2.0), (1024, 5.0)])
        (True, False)
    """
    slopes = [(y2 - y1) / (t2 - t1) for (t1, y1), (t2, y2) in zip(points, points[1:])]
    return all(later <= earlier * slack + 1e-9 for earlier, later in zip(slopes, slopes[1:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--tokens", default="1024", help="context lengths, comma-separated (default 1024)")
    parser.add_argument("--layers", type=int, default=12, help="transformer blocks (default 12: GPT-2 small)")
    parser.add_argument("--project", default="1024,4096,16384", help="lengths to bound the bytes at")
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
        print(f"== actviz's bytes by what they are for (GiB), measured at T = {lengths}; beyond, the line through the "
              "last two (a bound where the bytes grow no faster than linearly)")
        print(f"  {'':72s} {'ops':>5s} " + " ".join(f"{f'T={t}':>9s}" for t in lengths + projected) + "  linear?")
        totals = collections.Counter()
        for label, _, _ in GROUPS:
            points = []
            for t in lengths:
                found = [v for key, v in results[t]["actviz"].items()
                         if group_of(key.split("|")[0], key.endswith("|mode")) == label]
                points.append((t, sum(v[1] for v in found) / 2**30))
            count_ops = sum(v[0] for key, v in results[lengths[-1]]["actviz"].items()
                            if group_of(key.split("|")[0], key.endswith("|mode")) == label)
            values = [y for _, y in points] + [linear_bound(points, t) for t in projected]
            for t, v in zip(lengths + projected, values):
                totals[t] += v
            print(f"  {label:72s} {count_ops:5d} " + " ".join(f"{v:9.2f}" for v in values) +
                  f"  {'yes' if grows_linearly(points) else 'NO: faster'}")
        print(f"  {'all of actviz':72s} {'':5s} " + " ".join(f"{totals[t]:9.2f}" for t in lengths + projected))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
