"""Heat map sources bounded on the device: what :func:`actviz.rendering.picture_source` keeps of a 2-D matrix.

A matrix within ``MAX_HEATMAP_SIDE`` on both sides is kept as its 256 colour levels, one
byte per value, computed on the device exactly as :func:`~actviz.rendering.heatmap` computes
them on the host (the pictures are pixel-identical). A larger one (a language model's
vocabulary-sized logits) is area-averaged on the device to the size the picture has,
with the whole matrix's min and max behind it, so that colours keep their meaning.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from .rendering import _VIRIDIS_TABLE, MAX_HEATMAP_SIDE, _heatmap_size, _normalize, _viridis

__all__ = ["heatmap_source"]


def heatmap_source(matrix: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """``(draw, source)`` of a ``(rows, columns)`` matrix: a few kernel ops, no host sync, no copy of a large one.

    Example:
        >>> draw, source = heatmap_source(torch.randn(100, 768))
        >>> source.dtype, tuple(draw(source).shape)
        (torch.uint8, (3, 100, 768))
    """
    rows, columns = matrix.shape
    if max(rows, columns) <= MAX_HEATMAP_SIDE:
        return _levels_heatmap, _normalize(matrix.float(), dims=(0, 1), sync=False).mul_(255).round_().byte()
    size = _heatmap_size(rows, columns)
    pooled = F.adaptive_avg_pool2d(matrix[None].float(), size)  # what F.interpolate(mode="area") does
    low, high = torch.aminmax(matrix)
    return partial(_pooled_heatmap, size), torch.cat([pooled.view(-1), torch.stack([low, high]).float()])


def _levels_heatmap(levels: torch.Tensor) -> torch.Tensor:
    """:func:`heatmap` of a matrix whose colour levels :func:`picture_source` computed on the device."""
    rows, columns = levels.shape
    size = _heatmap_size(rows, columns)  # a whole-factor enlargement within the bound
    factor = size[0] // rows
    colours = _VIRIDIS_TABLE[levels.long()][:, None, :, None, :].expand(rows, factor, columns, factor, 3)
    return colours.reshape(size[0], size[1], 3).permute(2, 0, 1)


def _pooled_heatmap(size: tuple[int, int], source: torch.Tensor) -> torch.Tensor:
    """:func:`heatmap` of a matrix that :func:`picture_source` pooled to ``size``, normalised by the whole's bounds."""
    values, (low, high) = source[:-2].view(size), source[-2:].tolist()
    if not (math.isfinite(low) and math.isfinite(high)):  # NaN or Inf in the whole: its own bounds
        return _viridis(_normalize(values, dims=(0, 1))).permute(2, 0, 1)
    span = high - low
    return _viridis(((values - low) / span).clamp_(0.0, 1.0) if span > 0 else values * 0).permute(2, 0, 1)
