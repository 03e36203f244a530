"""The kurtosis of gradients: :class:`GradientKurtosis` (of each output gradient) and :class:`WeightGradKurtosis`
(of each parameter gradient), the two statistics that show a statistic's target.

Each is one class on the statistics route: it declares its target (``"output_gradient"``,
``"parameter_gradient"``) and the one-pass fields it reads (:data:`~actviz.summaries.one_pass.OUTLIER_FIELDS`), and
capture runs it on that target's tensors as it runs a layer output's statistics; nothing else names it.

``kurtosis`` is the fourth standardised moment ``(Σ(z-μ)⁴ / n) / (Σ(z-μ)² / n)²`` of ``z``, the gradient with NaN
and ±Inf replaced by 0, about its mean ``μ`` (as :mod:`actviz.statistics.outliers` takes it of an output): 3 for a
Gaussian, large when a few elements dwarf the rest, NaN for a constant gradient. Written as
``gradient_stats/kurtosis@{layer}`` and ``weight_grad_stats/kurtosis@{param}``; off by default
(``statistics=["default", "gradient_kurtosis", "weight_grad_kurtosis"]``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..summaries.one_pass import OUTLIER_FIELDS
from ..summaries.one_tensor import flat_view, local_shard
from ..summaries.outlier_moments import outlier_moments
from .layer_statistic import LayerStatistic

__all__ = ["GradientKurtosis", "WeightGradKurtosis"]


class _Kurtosis(LayerStatistic):
    """The kurtosis of each tensor of its target: two sums on the device, a ratio on the host."""

    names = ("kurtosis",)
    summary_fields = OUTLIER_FIELDS
    cost = "none beyond the summary's one read where the one-pass op summarizes it; 4 kernels otherwise; no sync"

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        return False

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return None
        return outlier_moments(flat_view(local_shard(tensor.detach())))[2:4]  # Σ(z-μ)², Σ(z-μ)⁴

    def from_summary(self, fields: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return fields[2:4]

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        squares, fourths = numbers
        return {"kurtosis": numel * fourths / (squares * squares) if squares > 0 else math.nan}


class GradientKurtosis(_Kurtosis):
    """``gradient_stats/kurtosis@{layer}``: the kurtosis of the gradient with respect to each watched output.

    Example:
        >>> numbers = GradientKurtosis().device(torch.tensor([1.0, -7.0, 2.0, 0.0]), nn.Identity(), None).tolist()
        >>> round(GradientKurtosis().host(numbers, 4, torch.float32)["kurtosis"], 4)
        2.2304
    """

    name = "gradient_kurtosis"
    target = "output_gradient"


class WeightGradKurtosis(_Kurtosis):
    """``weight_grad_stats/kurtosis@{param}``: the kurtosis of each watched parameter's gradient, as applied.

    Example:
        >>> numbers = WeightGradKurtosis().device(torch.ones(3), nn.Identity(), None).tolist()
        >>> WeightGradKurtosis().host(numbers, 3, torch.float32)
        {'kurtosis': nan}
    """

    name = "weight_grad_kurtosis"
    target = "parameter_gradient"
