"""The report's one forward pass: a hook per selected layer, doing the watcher's per-layer work.

Each hook hands the layer's output to :func:`actviz.capture.layer_outputs.reduce_output`, the
function the watcher's hooks call, so a report's statistics and pictures are the
watcher's. The report adds two numbers of its own: the count of dead channels and the
share of the output a ReLU sets to zero (:func:`relu_zero_fraction`). Every
output is reduced inside its hook, before the next layer runs, so the in-place ReLU after
a conv cannot change what is recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from ..capture.layer_outputs import batch_dim_of, output_tensors, reduce_output
from ..options import DEFAULT_MAX_CHANNELS, CaptureOptions
from ..common.owned_hooks import HookHandles
from ..common.pixels import PaletteImage
from ..selection import layer_display_name
from ..summaries.header import Reduction
from ..summaries.one_tensor import finish
from .results import LayerRecord

__all__ = ["capture_layers", "dead_channels", "relu_zero_fraction"]


def dead_channels(tensor: torch.Tensor) -> tuple[int, int | None]:
    """``(channels, channels with no positive value)``; channels are dim 1 of 4-D+ outputs, else the last dim.

    A 2-D output (a ``Linear``'s) has one value per channel, which says nothing about
    being dead: its count is ``None``.

    Example:
        >>> out = torch.stack([torch.ones(2, 2), -torch.ones(2, 2), torch.zeros(2, 2)]).unsqueeze(0)
        >>> dead_channels(out), dead_channels(torch.randn(1, 10))
        ((3, 2), (10, None))
    """
    if tensor.dim() < 2 or tensor.numel() == 0 or tensor.is_complex():
        return 0, None
    if tensor.dim() == 2:
        return tensor.shape[1], None
    channel_dim = 1 if tensor.dim() >= 4 else tensor.dim() - 1
    per_channel = tensor.detach().transpose(0, channel_dim).reshape(tensor.shape[channel_dim], -1)
    peak = torch.nan_to_num(per_channel.float(), nan=0.0).amax(dim=1)
    return per_channel.shape[0], int((peak <= 0).sum())


def relu_zero_fraction(tensor: torch.Tensor) -> float:
    """The share of ``tensor``'s elements at or below zero: its zero fraction after a ReLU.

    A conv output recorded before its ReLU has almost no exact zeros, so its own zero
    fraction reads 0 whatever the ReLU then does; this is the share that ReLU zeroes. For
    an output that has been through a ReLU it is the zero fraction itself. NaN is neither
    (a ReLU keeps it); an empty or complex tensor gives NaN.

    Example:
        >>> relu_zero_fraction(torch.tensor([-2.0, 0.0, 1.0, 3.0])), relu_zero_fraction(torch.ones(0))
        (0.5, nan)
    """
    if tensor.numel() == 0 or tensor.is_complex():
        return math.nan
    return int((tensor.detach() <= 0).sum()) / tensor.numel()


@dataclass
class _Reduced:
    """One layer's output, reduced in its hook; :meth:`record` finishes it on the host."""

    module: nn.Module
    shape: tuple[int, ...]
    channels: int
    dead: int | None
    relu_zeros: float
    reduction: Reduction
    picture: tuple[Callable[[torch.Tensor], torch.Tensor | PaletteImage], torch.Tensor] | None  # (draw, source)

    def record(self, name: str, options: CaptureOptions) -> LayerRecord:
        self.reduction.receive({id(tensor): tensor.cpu() for tensor in self.reduction.device_tensors()})
        grid = None if self.picture is None else self.picture[0](self.picture[1].cpu())
        grid = grid.rgb() if isinstance(grid, PaletteImage) else grid  # a heat map: the record keeps RGB
        four_d = len(self.shape) == 4
        shown = min(self.channels, options.max_channels) if four_d else (0 if grid is None else self.channels)
        return LayerRecord(
            name=layer_display_name(name),
            type=type(self.module).__name__,
            shape=self.shape,
            summary=finish(self.reduction, options.bins),
            channels=self.channels,
            dead_channels=self.dead,
            grid=grid,
            shown_channels=shown,
            relu_zero_fraction=self.relu_zeros,
        )


@torch.no_grad()
def capture_layers(
    model: nn.Module,
    batch: torch.Tensor,
    layers: Sequence[tuple[str, nn.Module]],
    max_channels: int = DEFAULT_MAX_CHANNELS,
    on_layer: Callable[[], None] | None = None,
) -> tuple[list[LayerRecord], Any]:
    """Run ``model`` once on ``batch`` and record every layer in ``layers``.

    Hooks are attached for this one call and removed in ``finally``. Only the first
    sample of the batch is drawn; the statistics cover the whole output. A module called
    twice (ResNet's shared ReLU) keeps its first call.

    Args:
        model: The model, in the mode you want (``eval()`` for a report).
        batch: Its input.
        layers: ``(name, module)`` pairs, for example from :func:`actviz.selection.select_layers`.
        max_channels: Most channels in one grid (the strongest, by mean |activation|).
        on_layer: Called after each layer is recorded (a progress bar's ``update``).

    Returns:
        ``(records in layer order, the model's output)``. A layer the forward pass did not reach has no record.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True))
        >>> records, _ = capture_layers(net, torch.randn(1, 3, 8, 8), [("0", net[0])])
        >>> records[0].shape, records[0].grid.shape
        ((1, 4, 6, 6), torch.Size([1, 78, 78]))
    """
    options = CaptureOptions(max_channels=max_channels)  # the watcher's defaults otherwise
    reduced: dict[str, _Reduced] = {}

    def hook(name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        tensor = next((t for _, t in output_tensors(output, "first")), None)
        if name in reduced or tensor is None:
            return
        reduction, picture = reduce_output(tensor, options, batch_dim=batch_dim_of(module))
        assert reduction is not None  # stats=True
        reduced[name] = _Reduced(module, tuple(tensor.shape), *dead_channels(tensor), relu_zero_fraction(tensor),
                                 reduction, picture)
        if on_layer is not None:
            on_layer()

    with HookHandles() as handles:
        for name, module in layers:
            handles.add("forward", module.register_forward_hook(partial(hook, name)))
        output = model(batch)
    return [reduced[name].record(name, options) for name, _ in layers if name in reduced], output
