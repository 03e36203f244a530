"""Two counts the health rules need, made on the device in the layer's hook: dead channels and saturation.

* :class:`DeadChannels`, on ReLU-family outputs with channels (3-D and up): the fraction of channels
  that are zero for the whole batch; on every ReLU-family module of the model, watched or not (one
  not watched counts its first call of a logging step, reading its output once: the per-channel sums of ``|x|``,
  ``eq``, ``mean``; :mod:`~actviz.statistics.dormant_units` reuses those sums).
  The channels of a 4-D output are its dimension 1; those of a 3-D output its last dimension, the features
  of a ``(batch, positions, features)`` sequence (a transformer's MLP, an RNN's), except after a 1-D
  convolution-family sibling (``Conv1d``, ``BatchNorm1d``... then ReLU: ``(batch, channels, length)``);
* :class:`Saturation`, on Tanh and Sigmoid outputs: the fraction within :data:`SATURATION_MARGIN` of a
  bound; on every Tanh and Sigmoid module of the model, watched or not (one not watched counts its first
  call of a logging step, reading its output once: ``abs``, ``gt``, ``mean``).

Where the one-pass op summarizes the output (:mod:`actviz.summaries.one_pass`), the same read counts them
(``summary_units``, ``from_summary``: no extra kernel); an output small enough to be batched with the step's
others, or one on the CPU shortcut, takes three kernels (``amax`` over every dim but the channels', ``eq``,
``mean``), or three or four for a saturation.

Both are on by default wherever alerts are (``watch(alerts=False)`` turns them off), and write no tag:
their values, ``results.layer_values["dead_channels"][layer]["dead_channel_fraction"]`` and
``["saturation"][layer]["saturated_fraction"]``, are what :class:`~actviz.diagnosis.alerts.HealthMonitor` reads.
Every other layer costs nothing on a step: which layers they apply to is found once per watcher.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..common._internals import tensor_version
from ..common.distributed_types import is_dtensor
from ..summaries.one_pass import UNIT_FIELDS, channel_layout
from .layer_statistic import LayerStatistic

__all__ = ["ONE_D_CHANNELS", "SATURATION_MARGIN", "DeadChannels", "Saturation", "channel_abs_sums", "is_relu_family",
           "note_layouts"]

#: Distance from a Tanh's (±1) or Sigmoid's (0, 1) bound counted as saturated: the slope there is
#: below 0.06 (Tanh) or 0.03 (Sigmoid), under a sixteenth of its slope at 0.
SATURATION_MARGIN = 0.03


def is_relu_family(module: nn.Module) -> bool:
    """ReLU, ReLU6, or LeakyReLU with slope 0: outputs exactly zero for every negative input.

    Example:
        >>> is_relu_family(nn.ReLU()), is_relu_family(nn.LeakyReLU(0.0)), is_relu_family(nn.LeakyReLU())
        (True, True, False)
    """
    if isinstance(module, nn.LeakyReLU):
        return module.negative_slope == 0
    return isinstance(module, (nn.ReLU, nn.ReLU6))


def _values(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor detached (a DTensor's local shard: no collective on one rank), or ``None`` if not counted."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    values = tensor.detach()
    return values.to_local() if is_dtensor(values) else values


#: The last output's per-channel sums of ``|x|``: (the output, weakly; its version; the dims summed; the sums).
_last_sums: tuple[Any, int, tuple[int, ...], torch.Tensor] | None = None


def channel_abs_sums(tensor: torch.Tensor, values: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """The sums of ``|values|`` over ``dims`` (float32, one read), ``values`` being ``tensor`` detached: made once per
    output, so that the dead-channel count and the dormant units (:mod:`actviz.statistics.dormant_units`) of one
    ReLU share one read of it. Hooks run on the training thread, one output at a time: one is kept, weakly.

    Example:
        >>> relu_output = torch.relu(torch.randn(2, 3, 4, 4))
        >>> first = channel_abs_sums(relu_output, relu_output, [0, 2, 3])
        >>> channel_abs_sums(relu_output, relu_output, [0, 2, 3]) is first
        True
    """
    global _last_sums
    key = tuple(dims)
    last = _last_sums
    if last is not None and last[0]() is tensor and last[1] == tensor_version(tensor) and last[2] == key:
        return last[3]
    sums = torch.linalg.vector_norm(values, 1, dim=dims, dtype=torch.float32)
    _last_sums = (weakref.ref(tensor), tensor_version(tensor), key, sums)
    return sums


#: Layers whose 3-D output is ``(batch, channels, length)``: a ReLU right after one of them reads dimension 1.
ONE_D_CHANNELS: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.ConvTranspose1d, nn.BatchNorm1d, nn.InstanceNorm1d, nn.MaxPool1d, nn.AvgPool1d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d,
)
#: ReLU-family modules whose 3-D outputs are ``(batch, channels, length)`` (:func:`note_layouts`).
_CHANNELS_FIRST: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def note_layouts(model: nn.Module) -> None:
    """Note the ReLU-family modules of ``model`` registered right after a 1-D convolution-family sibling
    (:data:`ONE_D_CHANNELS`): their 3-D outputs have their channels in dimension 1, where other 3-D outputs are
    ``(batch, positions, features)``.

    Example:
        >>> cnn, mlp = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU()), nn.Sequential(nn.Linear(2, 4), nn.ReLU())
        >>> note_layouts(cnn); note_layouts(mlp)
        >>> _sequence(torch.ones(2, 4, 5), cnn[1]), _sequence(torch.ones(2, 5, 4), mlp[1])
        (False, True)
    """
    for parent in model.modules():
        before = None
        for child in parent.children():
            if is_relu_family(child) and isinstance(before, ONE_D_CHANNELS):
                _CHANNELS_FIRST.add(child)
            before = child


def _sequence(tensor: torch.Tensor, module: nn.Module) -> bool:
    """Whether ``tensor``, ``module``'s output, is ``(batch, positions, features)``: 3-D, not after a 1-D conv."""
    return tensor.dim() == 3 and module not in _CHANNELS_FIRST


class DeadChannels(LayerStatistic):
    """``dead_channel_fraction``: the fraction of a ReLU's channels that are zero for the whole batch.

    Example:
        >>> batch = torch.zeros(2, 4, 3, 3); batch[:, 0] = 1.0   # channel 0 alive, three dead
        >>> DeadChannels().device(batch, nn.ReLU(), None).item()
        0.75
        >>> tokens = torch.zeros(2, 5, 4); tokens[..., 0] = 1.0   # (batch, positions, features): feature 0 alive
        >>> DeadChannels().device(tokens, nn.ReLU(), None).item()
        0.75
    """

    name, names = "dead_channels", ("dead_channel_fraction",)
    written = ()  # for the dead-units alert alone: no card
    cost = ("none beyond the summary's one read where the one-pass op summarizes the output; 3 kernels per "
            "ReLU-family output of 3 or more dimensions otherwise; no sync")
    summary_fields = UNIT_FIELDS
    unwatched_layers = True  # a conv → BN → ReLU network's ReLUs, which the default layers leave out

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        note_layouts(model)
        return bool(getattr(options, "unit_counts", True))  # with the alerts

    def applies_to(self, module: nn.Module) -> bool:
        return is_relu_family(module)

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        values = _values(tensor)
        if values is None or values.dim() < 3:
            return None
        channel = values.dim() - 1 if _sequence(values, module) else 1
        dims = [dim for dim in range(values.dim()) if dim != channel]
        # A ReLU's output is >= 0: a channel is all zero where its sum of |x| is 0 (the read dormant units share).
        return torch.mean(channel_abs_sums(tensor, values, dims).eq(0), dtype=torch.float32)

    def summary_units(self, tensor: torch.Tensor, module: nn.Module) -> tuple[float, ...] | None:
        if not tensor.is_floating_point() or is_dtensor(tensor):
            return None
        layout = channel_layout(tensor, sequence=_sequence(tensor, module))
        return (1, *layout) if layout is not None else None

    def from_summary(self, fields: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return fields

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return {"dead_channel_fraction": numbers[0]}


class Saturation(LayerStatistic):
    """``saturated_fraction``: the fraction of a Tanh's or Sigmoid's outputs within :data:`SATURATION_MARGIN` of a bound.

    Example:
        >>> Saturation().device(torch.tensor([0.999, -0.999, 0.0, 0.5]), nn.Tanh(), None).item()
        0.5
    """

    name, names = "saturation", ("saturated_fraction",)
    written = ()  # for the saturation alert alone: no card
    cost = ("none beyond the summary's one read where the one-pass op summarizes the output; 3 kernels per Tanh "
            "output, 4 per Sigmoid output otherwise; no sync")
    summary_fields = UNIT_FIELDS
    unwatched_layers = True  # a generator's final Tanh, a gate's Sigmoid: modules the default layers leave out

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        return bool(getattr(options, "unit_counts", True))  # with the alerts

    def applies_to(self, module: nn.Module) -> bool:
        return isinstance(module, (nn.Tanh, nn.Sigmoid))

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        values = _values(tensor)
        if values is None:
            return None
        if isinstance(module, nn.Tanh):
            return torch.mean(values.abs().gt(1 - SATURATION_MARGIN), dtype=torch.float32)
        distance = (values - 0.5).abs()
        return torch.mean(distance.gt(0.5 - SATURATION_MARGIN), dtype=torch.float32)

    def summary_units(self, tensor: torch.Tensor, module: nn.Module) -> tuple[float, ...] | None:
        if not tensor.is_floating_point() or is_dtensor(tensor):
            return None
        return (2, 0.0, 1 - SATURATION_MARGIN) if isinstance(module, nn.Tanh) else (2, 0.5, 0.5 - SATURATION_MARGIN)

    def from_summary(self, fields: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return fields

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return {"saturated_fraction": numbers[0]}
