"""What a layer's output becomes: its tensors, and the device halves of their summaries and pictures.

:func:`reduce_output` is the per-layer work that the watcher's hooks and
:func:`actviz.report` share.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn

from ._internals import batch_and_instance_norm_types
from .options import CaptureOptions
from .rendering import picture_source
from .summaries import Reduction, reduce_tensor
from .transfer import Draw

__all__ = ["PER_CHANNEL_AFFINE", "batch_dim_of", "output_tensors", "reduce_output"]


def output_tensors(output: Any, mode: Literal["first", "all"] = "first") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(suffix, tensor)`` for the tensors in a module's output.

    A plain tensor yields ``("", tensor)``. Tuples, lists and dicts are searched depth
    first: ``mode="first"`` yields only the first tensor, with suffix ``""``;
    ``mode="all"`` yields each one with its path as suffix, such as ``"/0"``,
    ``"/1.0"`` or ``"/attn"``.

    Example:
        >>> out = torch.zeros(2), (torch.ones(1), torch.ones(3))   # like nn.LSTM's (output, (h, c))
        >>> [(s, t.numel()) for s, t in output_tensors(out, "all")]
        [('/0', 2), ('/1.0', 1), ('/1.1', 3)]
        >>> [(s, t.numel()) for s, t in output_tensors(out)]
        [('', 2)]
    """
    if isinstance(output, torch.Tensor):
        yield "", output
        return
    found = _walk(output, ())
    if mode == "first":
        for _, tensor in found:
            yield "", tensor
            return
    else:
        for path, tensor in found:
            yield "/" + ".".join(path), tensor


def _walk(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _walk(item, (*path, str(index)))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, (*path, str(key)))


def reduce_output(
    tensor: torch.Tensor, options: CaptureOptions, *, stats: bool = True, draw: bool = True, batch_dim: int = 0
) -> tuple[Reduction | None, tuple[Draw, torch.Tensor] | None]:
    """The per-layer work on one output tensor, shared by the watcher's hooks and :func:`actviz.report`.

    Returns the device half of its summary (``None`` unless ``stats``) and of its picture
    (``None`` unless ``draw`` and the tensor is 3-D or 4-D): see
    :func:`~actviz.summaries.reduce_tensor` and :func:`~actviz.rendering.picture_source`.
    :func:`~actviz.summaries.finish` and ``draw(source)`` complete them on the host.
    """
    reduction = reduce_tensor(tensor, options.histogram_sample_size) if stats else None
    picture = picture_source(tensor, options.max_channels, batch_dim) if draw else None
    return reduction, picture


#: Layers that map each channel of each sample through an affine function (BatchNorm in training
#: and eval, InstanceNorm, GroupNorm). With every channel normalised on its own, their grid is
#: their input's grid again, pixel for pixel (inverted where the weight is negative).
PER_CHANNEL_AFFINE: tuple[type[nn.Module], ...] = (*batch_and_instance_norm_types(), nn.GroupNorm)


def batch_dim_of(module: nn.Module) -> int:
    # nn.LSTM, nn.GRU, nn.MultiheadAttention and nn.Transformer* put time first unless batch_first=True.
    return 1 if getattr(module, "batch_first", True) is False else 0
