"""The norms before and after clipping of a stats step, on the host: ``gradient_clipping/*``.

A stats step whose gradients an optimizer applies takes, in the same optimizer step pre-hook, a copy of
its row of :class:`~actviz.diagnosis.step_norms.StepNorms`' ring: ``(2, n)``, each trainable parameter's
gradient norm at the end of the last backward pass (before clipping) and now (after it). It goes to the
host with the step's one copy; :func:`finish_clip_norms` writes, on the writer thread:

* ``gradient_clipping/pre_clip_norm``: the global L2 norm before clipping, what ``clip_grad_norm_`` returns;
* ``gradient_clipping/post_clip_norm``: the global norm the optimizer applies (``weight_grads/*`` show those
  gradients);
* ``gradient_clipping/coefficient``: after / before: 1 when clipping did not act, ``max_norm / norm`` when
  ``clip_grad_norm_`` did;
* ``gradient_clipping/share@{layer}``: each layer's part of the squared norm before clipping (they sum to 1);
* the text ``gradient_clipping/top_layers``: the 3 layers with the largest shares.

With ``Options(grad_scaler=...)`` the norms before clipping come divided by the loss scale
(:mod:`actviz.diagnosis.step_norms`), and the norms after it, read while the gradients still carry it, are divided here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..common.results import StepResults
from ..tags import CLIP_NORMS, CLIP_SHARE, CLIP_TOP_LAYERS, GRAD_SCALE

__all__ = ["TOP_LAYERS", "finish_clip_norms"]

#: Layers named in ``gradient_clipping/top_layers``.
TOP_LAYERS = 3


def finish_clip_norms(results: StepResults, host: list[torch.Tensor], layer_of: Sequence[int],
                      layer_names: Sequence[str], scaled_after: bool) -> None:
    """Add ``gradient_clipping/*`` to ``results`` from ``host[0]``, the step's ``(2, n)`` row of norms.

    ``scaled_after``: the norms after clipping carry the loss scale written as ``amp/grad_scale``.

    Example:
        >>> results = StepResults(5)
        >>> row = torch.tensor([[3.0, 4.0], [0.6, 0.8]])  # before: norm 5; clipped to 1
        >>> finish_clip_norms(results, [row], [0, 1], ["fc1", "fc2"], False)
        >>> {tag: round(value, 4) for tag, value in results.scalars.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'gradient_clipping/pre_clip_norm': 5.0, 'gradient_clipping/post_clip_norm': 1.0,
         'gradient_clipping/coefficient': 0.2, 'gradient_clipping/share@fc1': 0.36, 'gradient_clipping/share@fc2': 0.64}
        >>> results.texts["gradient_clipping/top_layers"]
        'fc2 64%, fc1 36% of the squared gradient norm before clipping'
    """
    row = host[0].to(torch.float64)
    scale = results.scalars.get(GRAD_SCALE, 1.0)
    before, after = row[0], row[1]
    if scaled_after and scale not in (0.0, 1.0):
        after = after / scale
    squares = torch.zeros(len(layer_names), dtype=torch.float64)
    squares.index_add_(0, torch.tensor(list(layer_of), dtype=torch.long), before.square())
    total_square = float(squares.sum())
    pre, post = math.sqrt(total_square), float(after.square().sum().sqrt())
    coefficient = post / pre if pre > 0 else (1.0 if post == 0 else math.nan)
    pre_tag, post_tag, coefficient_tag = CLIP_NORMS
    results.scalars[pre_tag] = pre
    if not math.isnan(post):  # an update by hand: no optimizer step to read what it applied
        results.scalars[post_tag] = post
        results.scalars[coefficient_tag] = coefficient
    if not (total_square > 0 and math.isfinite(total_square)):
        return
    shares = (squares / total_square).tolist()
    held = set(layer_of)  # the layers that hold a trainable parameter
    for index, (name, share) in enumerate(zip(layer_names, shares)):
        if index in held:
            results.scalars[CLIP_SHARE.format(layer=name)] = share
    top = sorted(((share, name) for index, (name, share) in enumerate(zip(layer_names, shares)) if index in held), key=lambda item: -item[0])[:TOP_LAYERS]
    results.texts[CLIP_TOP_LAYERS] = (", ".join(f"{name} {share:.0%}" for share, name in top)
                                      + " of the squared gradient norm before clipping")
