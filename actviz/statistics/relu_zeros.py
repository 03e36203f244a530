"""The zero fraction of the ReLUs a watcher does not watch: what a dead ReLU shows, drawn by default.

The default layers leave a conv → BN → ReLU network's ReLUs out (their grid would repeat the layer before,
thresholded), so the fraction of values a ReLU sets to zero, the first sign of dying units, had no card. On
every ReLU-family module that is not watched, :class:`ReluZeros` counts it on its first call of a logging step
and writes it as the watched layers' zero fraction is written, ``activation_stats/zero_fraction@{relu}``; the
actviz tab's zero-fraction view (and the flow pictures, where on) then has a row for it.

It counts every value of an output of up to :data:`EXACT_MAX` values (4 MB of float32), and above that an
evenly strided sample of about :data:`ZERO_SAMPLE` of them (the histograms' sample stride, which shares no
factor with common feature-map sizes): two kernels where the values lie, ``eq`` and ``mean``, and no sync. The
sample's fraction is within half a percentage point of the whole output's (two standard errors at 45,000 values
or more). A watched ReLU's zero fraction comes from its summary, as every watched layer's does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..summaries.one_tensor import flat_view, sample_stride
from .layer_statistic import LayerStatistic
from .unit_counts import is_relu_family

__all__ = ["EXACT_MAX", "ZERO_SAMPLE", "ReluZeros"]

#: Outputs of up to this many values are counted whole.
EXACT_MAX = 1 << 20
#: Values of a larger output counted, about: an evenly strided sample.
ZERO_SAMPLE = 1 << 16


class ReluZeros(LayerStatistic):
    """``zero_fraction`` of an unwatched ReLU-family module's output: exact, or from an evenly strided sample.

    Example:
        >>> relu_output = torch.relu(torch.linspace(-1, 1, 200_001))   # half of it at or below 0
        >>> round(ReluZeros().device(relu_output, nn.ReLU(), None).item(), 3)
        0.5
    """

    name, names = "relu_zeros", ("zero_fraction",)
    cost = ("2 kernels per ReLU-family module that is not watched, reading its output once up to 1,048,576 values, "
            "about 65,536 of them above; no sync")
    unwatched_layers = True  # the ReLUs the default layers leave out
    watched_layers = False  # a watched ReLU's summary gives its exact zero fraction already

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        return True

    def applies_to(self, module: nn.Module) -> bool:
        return is_relu_family(module)

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        if not tensor.is_floating_point() or tensor.numel() == 0 or type(tensor) is not torch.Tensor:
            return None
        values = flat_view(tensor.detach())
        if values.numel() > EXACT_MAX:
            values = values[:: sample_stride(values.numel(), ZERO_SAMPLE)]
        return torch.mean(values.eq(0), dtype=torch.float32)

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return {"zero_fraction": numbers[0]}
