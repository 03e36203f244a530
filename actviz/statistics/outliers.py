"""Outliers and low-precision headroom of a layer's output: the per-layer statistic :class:`Outliers`.

Per watched layer, from every element of its output ``x`` (``n`` elements):

* ``max_abs``: ``max |x|``;
* ``kurtosis``: the fourth standardised moment ``(Σ(x-μ)⁴ / n) / (Σ(x-μ)² / n)²``: 3 for a
  Gaussian, 1.8 for a uniform distribution, large when a few elements dwarf the rest
  (NaN for a constant output);
* ``outlier_fraction``: the fraction with ``|x| >= 6`` (LLM.int8's outlier features);
* ``headroom_bits``: for float16, bfloat16 and float8 outputs, ``log2(dtype max / max |x|)``:
  how many doublings are left before the output overflows its dtype (negative: it did).

:func:`outlier_vector` does the device half in about ten kernels and no host sync; it
also takes the median ``|x|`` of the histogram's strided sample, for the
massive-activation alert (:mod:`actviz.diagnosis.transformer_alerts`). :func:`outlier_numbers`
finishes it on the host.

:class:`Outliers` runs them on every watched layer's floating outputs. It is on by default for models with
an attention module (``watch(transformer_stats=None)``; ``True`` turns it on for any model, ``False`` off),
or wherever ``watch(statistics=[..., "outliers"])`` names it: kurtosis of a CNN's activations, say. Cost:
10 kernels per tensor (11 for 16-bit outputs), no sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..summaries.one_tensor import flat_view, local_shard, sample_stride, wide_dtype
from ..summaries.piecewise import PIECE
from ..transformers.attention import attention_modules
from .layer_statistic import LayerStatistic

__all__ = ["LOW_PRECISION", "OUTLIER_THRESHOLD", "Outliers", "on_for_transformers", "outlier_numbers", "outlier_vector"]

#: ``|x|`` at or above this counts as an outlier (Dettmers et al. 2022, LLM.int8()).
OUTLIER_THRESHOLD = 6.0
#: Output dtypes that get ``headroom_bits``.
LOW_PRECISION = tuple(
    dtype for dtype in (torch.float16, torch.bfloat16, getattr(torch, "float8_e4m3fn", None),
                        getattr(torch, "float8_e5m2", None), getattr(torch, "float8_e4m3fnuz", None),
                        getattr(torch, "float8_e5m2fnuz", None)) if dtype is not None
)


@torch.no_grad()
def outlier_vector(tensor: torch.Tensor, sample_size: int | None) -> torch.Tensor:
    """``[max|x|, count(|x| >= 6), Σ(x-μ)², Σ(x-μ)⁴, median |x| of the strided sample]`` on the device.

    Sums in float64 (float32 on MPS); the sample is the one the histogram is counted on
    (:func:`~actviz.summaries.one_tensor.sample_stride`).

    Example:
        >>> [round(v, 4) for v in outlier_vector(torch.tensor([1.0, -7.0, 2.0, 0.0]), None).tolist()]
        [7.0, 1.0, 50.0, 1394.0, 1.0]
    """
    values = flat_view(local_shard(tensor))
    wide = wide_dtype(values.device)
    stride = sample_stride(values.numel(), sample_size)
    if values.numel() > PIECE:  # a vocabulary's logits: whole-size temporaries would add several times its size
        return _outlier_vector_in_pieces(values, stride, wide)
    if values.dtype not in (torch.float32, torch.float64):
        values = values.float()  # 16-bit and float8: moments in float32 at least
    magnitude = values.abs()
    centred = values - values.mean(dtype=wide)
    # Σ(x-μ)² and Σ((x-μ)²)² in one op: a 4th power in float64 is slow on a CPU.
    squares, fourths = torch._foreach_powsum([centred, centred.square()], 2, dtype=wide)
    return torch.stack([
        magnitude.amax(), (magnitude >= OUTLIER_THRESHOLD).sum(), squares, fourths, magnitude[::stride].median(),
    ]).to(wide)


def _outlier_vector_in_pieces(values: torch.Tensor, stride: int, wide: torch.dtype) -> torch.Tensor:
    """:func:`outlier_vector` of a large 1-D tensor, :data:`PIECE` elements at a time: extra memory about a piece's."""
    pieces = values.split(PIECE)
    mean = torch.stack([piece.sum(dtype=wide) for piece in pieces]).sum() / values.numel()
    found = []
    for piece in pieces:
        piece = piece.float() if piece.dtype not in (torch.float32, torch.float64) else piece
        magnitude = piece.abs()
        centred = piece - mean.to(piece.dtype)
        squares, fourths = torch._foreach_powsum([centred, centred.square()], 2, dtype=wide)
        found.append(torch.stack([magnitude.amax().to(wide), (magnitude >= OUTLIER_THRESHOLD).sum().to(wide),
                                  squares, fourths]))
    parts = torch.stack(found)
    sample = values[::stride].float().abs()
    return torch.stack([parts[:, 0].amax(), *parts[:, 1:].sum(0), sample.median().to(wide)])


def outlier_numbers(vector: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
    """The host half: ``max_abs``, ``kurtosis``, ``outlier_fraction``, ``headroom_bits`` (low precision
    only, left out for an all-zero output) and ``median_abs`` (for the alert; not a tag).

    Example:
        >>> numbers = outlier_numbers([7.0, 1.0, 50.0, 1394.0, 1.0], 4, torch.float16)
        >>> round(numbers["kurtosis"], 4), numbers["outlier_fraction"], round(numbers["headroom_bits"], 3)
        (2.2304, 0.25, 13.192)
    """
    max_abs, outliers, squares, fourths, median_abs = vector
    kurtosis = numel * fourths / (squares * squares) if squares > 0 else math.nan
    numbers = {"max_abs": max_abs, "kurtosis": kurtosis, "outlier_fraction": outliers / numel if numel else math.nan,
               "median_abs": median_abs}
    if dtype in LOW_PRECISION and max_abs > 0:
        numbers["headroom_bits"] = math.log2(torch.finfo(dtype).max / max_abs) if math.isfinite(max_abs) else -math.inf
    return numbers


def on_for_transformers(model: nn.Module, options: Any) -> bool:
    """The default of the outlier and logit statistics: ``watch(transformer_stats=...)`` if given, else whether
    ``model`` has an attention module (:func:`~actviz.transformers.attention.attention_modules`)."""
    wanted = getattr(options, "transformer_stats", None)
    return bool(attention_modules(model)) if wanted is None else bool(wanted)


class Outliers(LayerStatistic):
    """``activation_stats/{layer}/max_abs``, ``/kurtosis``, ``/outlier_fraction`` and ``/headroom_bits`` (see the
    module docstring); ``median_abs`` is kept for the massive-activation alert, not written.

    Example:
        >>> numbers = Outliers().device(torch.tensor([1.0, -7.0, 2.0, 0.0]), nn.Identity(), None).tolist()
        >>> sorted(Outliers().host(numbers, 4, torch.float32))
        ['kurtosis', 'max_abs', 'median_abs', 'outlier_fraction']
    """

    name = "outliers"
    names = ("max_abs", "kurtosis", "outlier_fraction", "headroom_bits", "median_abs")
    written = ("max_abs", "kurtosis", "outlier_fraction", "headroom_bits")
    cost = "10 kernels per floating output (11 for 16-bit ones); no sync"

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        return on_for_transformers(model, options)

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return None
        return outlier_vector(tensor, getattr(options, "histogram_sample_size", None))

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return outlier_numbers(numbers, numel, dtype)
