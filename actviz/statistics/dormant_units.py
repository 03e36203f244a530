"""Dormant units (Sokar et al. 2023, "The dormant neuron phenomenon in deep reinforcement learning"): the
per-layer statistic :class:`DormantUnits`.

A unit (a channel) of an activation's output is τ-dormant when its mean ``|x|`` over the whole batch, divided by
the mean of that over all the layer's units, is at most τ: ``s_i = m_i / mean_j(m_j) <= τ``, where ``m_i`` is the
mean of ``|x|`` over every sample and position of channel ``i``. Written per layer, at τ = 0.025 and τ = 0.1
(:data:`TAUS`):

* ``activation_stats/dormant_fraction_0.025@{layer}`` and ``dormant_fraction_0.1@``: the fraction of its units;
* ``activation_stats/dormant_count_0.025@{layer}`` and ``dormant_count_0.1@``: how many;
* the text ``activation_stats/dormant_units@{layer}``: their indices, on steps where some unit is 0.1-dormant.

The channels of a 4-D output (and of a 3-D one after a 1-D convolution-family layer) are its dimension 1; those of
a ``(batch, positions, features)`` sequence and of a 2-D ``(batch, features)`` output its last dimension. A channel
with NaN or ±Inf is left out (neither counted nor in the layer's mean); a layer whose units are all zero has
every unit dormant.

The scores come from the whole batch: sample 0 alone calls a channel dormant that is quiet on it and busy on the
others. The device half is one reduction per output, ``torch.linalg.vector_norm(x, 1, dims)`` (one read of the
output, no copy of it, no sync): the per-channel sums of ``|x|``, copied to the host with the step's other numbers;
the host half divides and counts. It runs on ReLU-family, GELU, SiLU, Mish, Hardswish, ELU, CELU, SELU, Softplus and
LeakyReLU outputs, watched or not (one not watched counts its first call of a logging step). Off by default:
``statistics=["default", "dormant_units"]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..common.distributed_types import is_dtensor
from .layer_statistic import LayerStatistic
from .unit_counts import _sequence, channel_abs_sums

__all__ = ["ACTIVATIONS", "TAUS", "DormantUnits", "channel_dim", "dormant_values"]

#: The thresholds τ of the fraction of the layer's mean activation: Sokar et al. use 0.025 and 0.1.
TAUS = (0.025, 0.1)

#: The activation modules whose outputs' units are scored.
ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish, nn.ELU, nn.CELU, nn.SELU, nn.Softplus,
)


def channel_dim(tensor: torch.Tensor, module: nn.Module) -> int | None:
    """The dimension of ``tensor`` (``module``'s output) that holds its units, or ``None`` for a 0-D or 1-D one.

    Example:
        >>> channel_dim(torch.ones(2, 8, 4, 4), nn.ReLU()), channel_dim(torch.ones(2, 5, 8), nn.GELU())
        (1, 2)
        >>> channel_dim(torch.ones(2, 8), nn.SiLU()), channel_dim(torch.ones(8), nn.SiLU())
        (1, None)
    """
    if tensor.dim() < 2:
        return None
    return tensor.dim() - 1 if tensor.dim() == 2 or _sequence(tensor, module) else 1


def dormant_values(sums: list[float], numel: int) -> dict[str, Any]:
    """The host half: per-channel sums of ``|x|`` over a batch of ``numel`` elements -> the dormant fraction and
    count at each τ of :data:`TAUS`, and the indices (``dormant_units_{τ}``, tuples, not written as scalars).

    Example:
        >>> values = dormant_values([8.0, 0.04, 0.3, 7.66], 8)  # 4 channels of 2 elements: means 4, 0.02, 0.15, 3.83
        >>> values["dormant_count_0.025"], values["dormant_fraction_0.1"], values["dormant_units_0.1"]  # mean 2
        (1.0, 0.5, (1, 2))
    """
    channels = len(sums)
    per_channel = numel / channels
    means = [total / per_channel for total in sums]
    finite = [index for index, mean in enumerate(means) if math.isfinite(mean)]
    values: dict[str, Any] = {}
    if not finite:
        return values
    layer_mean = math.fsum(means[index] for index in finite) / len(finite)
    for tau in TAUS:
        dormant = tuple(index for index in finite if means[index] <= tau * layer_mean)
        values[f"dormant_fraction_{tau}"] = len(dormant) / len(finite)
        values[f"dormant_count_{tau}"] = float(len(dormant))
        values[f"dormant_units_{tau}"] = dormant
    return values


def _indices(units: tuple[int, ...]) -> str:
    return ", ".join(map(str, units)) if units else "none"


class DormantUnits(LayerStatistic):
    """``activation_stats/dormant_fraction_0.025@{layer}``, ``dormant_fraction_0.1@``, ``dormant_count_0.025@``,
    ``dormant_count_0.1@`` and the text ``activation_stats/dormant_units@{layer}`` (see the module docstring).

    Example:
        >>> batch = torch.ones(4, 3, 2, 2); batch[:, 1] = 0.001   # channel 1 quiet on every sample
        >>> sums = DormantUnits().device(batch, nn.ReLU(), None).tolist()
        >>> DormantUnits().host(sums, batch.numel(), batch.dtype)["dormant_units_0.025"]
        (1,)
    """

    name = "dormant_units"
    names = tuple(f"dormant_{kind}_{tau}" for tau in TAUS for kind in ("fraction", "count"))
    written = names
    cost = ("1 kernel per activation output (vector_norm of order 1 over every dim but the units': one read, no "
            "copy), a float per unit copied with the step's numbers; no sync")
    unwatched_layers = True  # a conv → BN → ReLU network's ReLUs, which the default layers leave out

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        return False

    def applies_to(self, module: nn.Module) -> bool:
        return isinstance(module, ACTIVATIONS)

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return None
        values = tensor.detach()
        values = values.to_local() if is_dtensor(values) else values
        channel = channel_dim(values, module)
        if channel is None:
            return None
        dims = [dim for dim in range(values.dim()) if dim != channel]
        return channel_abs_sums(tensor, values, dims)  # a ReLU's dead-channel count read them already: no second read

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, Any]:
        return dormant_values(numbers, numel)

    def texts(self, values: dict[str, dict[str, Any]]) -> dict[str, str]:
        last = TAUS[-1]
        return {self.tag(layer, "dormant_units"): "; ".join(f"τ = {tau}: {_indices(found[f'dormant_units_{tau}'])}"
                                                           for tau in TAUS)
                for layer, found in values.items() if found.get(f"dormant_units_{last}")}

