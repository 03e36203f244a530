"""Outliers and low-precision headroom of a layer's output: the per-layer statistic :class:`Outliers`.

Per watched layer, from every element of its output ``x`` (``n`` elements):

* ``max_abs``: ``max |x|`` (NaN left out; ±Inf counts);
* ``kurtosis``: the fourth standardised moment ``(Σ(z-μ)⁴ / n) / (Σ(z-μ)² / n)²`` of ``z``, the
  output with NaN and ±Inf replaced by 0, about its mean ``μ``: 3 for a
  Gaussian, 1.8 for a uniform distribution, large when a few elements dwarf the rest
  (NaN for a constant output);
* ``outlier_fraction``: the fraction with ``|x| >= 6`` (LLM.int8's outlier features);
* ``headroom_bits``: for float16, bfloat16 and float8 outputs, ``log2(dtype max / max |x|)``:
  how many doublings are left before the output overflows its dtype (negative: it did).

The device half comes with the layer's summary: where the one-pass op summarizes the output
(:mod:`actviz.summaries.one_pass`), the same read adds these numbers to its row, and
:meth:`Outliers.from_summary` adds the median ``|x|`` of the histogram's strided sample, for the
massive-activation alert (:mod:`actviz.diagnosis.transformer_alerts`): three small kernels on the sample.
An output small enough to be batched with the step's others takes :func:`outlier_vector`, about ten
kernels on that small tensor. No host sync either way; :func:`outlier_numbers` finishes it on the host.

:class:`Outliers` runs them on every watched layer's floating outputs. It is on by default for models with
an attention module (``watch(statistics=None)``; naming ``"outliers"`` turns it on for any model, a list without it off),
or wherever ``watch(statistics=[..., "outliers"])`` names it: kurtosis of a CNN's activations, say.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..summaries.one_tensor import flat_view, local_shard, sample_stride
from ..summaries.one_pass import OUTLIER_FIELDS
from ..summaries.outlier_moments import OUTLIER_THRESHOLD, outlier_moments
from ..transformers.attention import attention_modules
from .layer_statistic import LayerStatistic

__all__ = ["LOW_PRECISION", "OUTLIER_THRESHOLD", "Outliers", "on_for_transformers", "outlier_numbers", "outlier_vector"]

#: Output dtypes that get ``headroom_bits``.
LOW_PRECISION = tuple(
    dtype for dtype in (torch.float16, torch.bfloat16, getattr(torch, "float8_e4m3fn", None),
                        getattr(torch, "float8_e5m2", None), getattr(torch, "float8_e4m3fnuz", None),
                        getattr(torch, "float8_e5m2fnuz", None)) if dtype is not None
)


@torch.no_grad()
def outlier_vector(tensor: torch.Tensor, sample_size: int | None) -> torch.Tensor:
    """``[max|x|, count(|x| >= 6), Σ(z-μ)², Σ(z-μ)⁴, median |x| of the strided sample]`` on the device
    (:func:`~actviz.summaries.outlier_moments.outlier_moments`, then the median).

    Sums in float64 (float32 on MPS); the sample is the one the histogram is counted on
    (:func:`~actviz.summaries.one_tensor.sample_stride`).

    Example:
        >>> [round(v, 4) for v in outlier_vector(torch.tensor([1.0, -7.0, 2.0, 0.0]), None).tolist()]
        [7.0, 1.0, 50.0, 1394.0, 1.0]
    """
    values = flat_view(local_shard(tensor))
    stride = sample_stride(values.numel(), sample_size)
    moments = outlier_moments(values)
    return torch.cat([moments, values[::stride].float().abs().median().to(moments.dtype).view(1)])


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
    """The default of the outlier and logit statistics: ``CaptureOptions.transformer_stats`` (``statistics=[..., "transformer"]``) if set, else whether
    ``model`` has an attention module (:func:`~actviz.transformers.attention.attention_modules`)."""
    wanted = getattr(options, "transformer_stats", None)
    return bool(attention_modules(model)) if wanted is None else bool(wanted)


class Outliers(LayerStatistic):
    """``activation_stats/max_abs@{layer}``, ``kurtosis@``, ``outlier_fraction@`` and ``headroom_bits@`` (see the
    module docstring); ``median_abs`` is kept for the massive-activation alert, not written.

    Example:
        >>> numbers = Outliers().device(torch.tensor([1.0, -7.0, 2.0, 0.0]), nn.Identity(), None).tolist()
        >>> sorted(Outliers().host(numbers, 4, torch.float32))
        ['kurtosis', 'max_abs', 'median_abs', 'outlier_fraction']
    """

    name = "outliers"
    names = ("max_abs", "kurtosis", "outlier_fraction", "headroom_bits", "median_abs")
    written = ("max_abs", "kurtosis", "outlier_fraction", "headroom_bits")
    cost = ("none beyond the summary's one read where the one-pass op summarizes the output, and 3 small kernels on "
            "its sample for the median; 10 kernels per small output batched with others; no sync")
    summary_fields = OUTLIER_FIELDS

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        return on_for_transformers(model, options)

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return None
        return outlier_vector(tensor, getattr(options, "histogram_sample_size", None))

    def from_summary(self, fields: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return torch.cat([fields, sample.abs().median().view(1)])

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return outlier_numbers(numbers, numel, dtype)
