"""Heat maps' colours and sizes, and their sources bounded on the device.

:func:`heatmap_source` is what :func:`actviz.pictures.rendering.picture_source` keeps of a 2-D matrix.
A matrix within ``MAX_HEATMAP_SIDE`` (512) on both sides is kept as its 256 colour levels, one
byte per value, computed on the device. A larger one (a language model's 1,024 tokens, or its
vocabulary-sized logits) is area-averaged on the device to the size the picture has, with the
whole matrix's min and max behind it, which normalise it on the host, so that colours keep
their meaning. The picture is drawn on the host as palette indices
(:class:`~actviz.common.pixels.PaletteImage`) and PNG-encoded as such: no RGB is made on the way.
:func:`actviz.pictures.rendering.heatmap` is the same two halves in one call.

The 512-pixel bound holds the writer thread's work: a GPT-2-small logging step draws 76 heat
maps of 1,024 tokens, whose pixels (noise-like at the start of training) zlib encodes at about
60 MB/s. At 1,024 pixels a side, drawn in RGB, such a step took 3.4 s of the writer thread's
CPU; at 512, as palette indices, 0.3 s (docs/performance.md, "Memory").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from ..common.pixels import PaletteImage, to_uint8

__all__ = ["HEATMAP_COLOURS", "MAX_HEATMAP_SIDE", "MIN_HEATMAP_SIDE", "heatmap_source"]

MIN_HEATMAP_SIDE = 64  # heat maps are enlarged until their shorter side reaches this, within MAX_HEATMAP_SIDE
MAX_HEATMAP_SIDE = 512

# matplotlib's viridis at nine evenly spaced points: dark blue (low) to yellow (high).
_VIRIDIS = ((68, 1, 84), (71, 44, 122), (59, 81, 139), (44, 113, 142), (33, 144, 141), (39, 173, 129),
            (92, 200, 99), (170, 220, 50), (253, 231, 37))


def _normalize(values: torch.Tensor, dims: tuple[int, ...], sync: bool = True) -> torch.Tensor:
    """Map the finite values to [0, 1] over ``dims``; constants go to 0, NaN to 0, ±Inf to 1 and 0."""
    if sync and values.device.type == "cpu":  # reading a flag costs nothing here; on an accelerator it would sync
        low, high = values.amin(dim=dims, keepdim=True), values.amax(dim=dims, keepdim=True)
        span = high - low
        if bool(torch.isfinite(span).all()):  # NaN or ±Inf anywhere would make some span non-finite
            # Where span is 0 the numerator is 0 too, so dividing by 1 leaves the constant at 0.
            return (values - low).div_(span.masked_fill_(span == 0, 1.0)).clamp_(0.0, 1.0)
    finite = torch.isfinite(values)
    low = torch.where(finite, values, math.inf).amin(dim=dims, keepdim=True)
    high = torch.where(finite, values, -math.inf).amax(dim=dims, keepdim=True)
    span = high - low
    scaled = (values - low) / torch.where(span > 0, span, torch.ones_like(span))
    scaled = torch.where(span > 0, scaled, torch.zeros_like(scaled))
    return torch.nan_to_num(scaled, nan=0.0, posinf=1.0, neginf=0.0).clamp_(0.0, 1.0)


def _viridis_table() -> torch.Tensor:
    """``(256, 3)`` ``uint8`` colours: viridis interpolated linearly between its nine points."""
    palette = torch.tensor(_VIRIDIS, dtype=torch.float64)
    position = torch.linspace(0, len(_VIRIDIS) - 1, 256, dtype=torch.float64)
    lower = position.floor().long().clamp_(max=len(_VIRIDIS) - 2)
    fraction = (position - lower).unsqueeze(-1)
    colours = palette[lower] * (1 - fraction) + palette[lower + 1] * fraction
    return colours.round_().to(torch.uint8)


_VIRIDIS_TABLE = _viridis_table()
#: Every colour a heat map can have: ``(256, 3)`` ``uint8``, level by level: a heat map's palette
#: (:class:`~actviz.common.pixels.PaletteImage`), whose indices are its levels.
HEATMAP_COLOURS = _VIRIDIS_TABLE


def _viridis(values: torch.Tensor) -> torch.Tensor:
    """Map ``(H, W)`` values in [0, 1] to an ``(H, W, 3)`` ``uint8`` RGB image, 256 levels."""
    table = _VIRIDIS_TABLE.to(values.device)
    levels = values.mul(255).round_().to(torch.long)
    return table[levels]


def _heatmap_size(rows: int, columns: int) -> tuple[int, int]:
    """The picture's ``(height, width)`` for a ``(rows, columns)`` matrix."""
    shortest, longest = min(rows, columns), max(rows, columns)
    if longest > MAX_HEATMAP_SIDE:
        pooled = _pooled_size(rows, columns)
        short = min(pooled)
        short *= math.ceil(MIN_HEATMAP_SIDE / short)  # a few rows beside a vocabulary: each a band, not a pixel
        return (short, MAX_HEATMAP_SIDE) if rows <= columns else (MAX_HEATMAP_SIDE, short)
    factor = max(1, min(math.ceil(MIN_HEATMAP_SIDE / shortest), MAX_HEATMAP_SIDE // longest))
    return rows * factor, columns * factor


def _pooled_size(rows: int, columns: int) -> tuple[int, int]:
    """What a matrix with a side over ``MAX_HEATMAP_SIDE`` is area-averaged to on the device: that side to
    ``MAX_HEATMAP_SIDE``; the other in proportion, but never under ``MIN_HEATMAP_SIDE`` (or its own length, if
    shorter), so that a 20 x 18,328 output (a language model's decoder: 20 tokens, a vocabulary) keeps its 20
    rows instead of becoming 1 x 512 pixels."""
    shortest, longest = min(rows, columns), max(rows, columns)
    short = min(shortest, max(round(shortest * MAX_HEATMAP_SIDE / longest), MIN_HEATMAP_SIDE))
    return (short, MAX_HEATMAP_SIDE) if rows <= columns else (MAX_HEATMAP_SIDE, short)




def heatmap_source(matrix: torch.Tensor) -> tuple[Callable[[torch.Tensor], PaletteImage], torch.Tensor]:
    """``(draw, source)`` of a ``(rows, columns)`` matrix: a few kernel ops, no host sync, no copy of a large one.

    ``source``: the colour levels, one byte per value, of a matrix within ``MAX_HEATMAP_SIDE`` (normalised
    over the whole); past it, the area average at the picture's size, and the whole's min and max, which
    the host turns into levels (a few kernels on the device, whatever the size).

    Example:
        >>> draw, source = heatmap_source(torch.randn(100, 300))
        >>> source.dtype, tuple(source.shape), draw(source).shape
        (torch.uint8, (100, 300), (3, 100, 300))
        >>> draw, source = heatmap_source(torch.randn(100, 768))  # area-averaged to 67 x 512, with min and max
        >>> source.dtype, tuple(source.shape), draw(source).shape
        (torch.float32, (34306,), (3, 67, 512))
    """
    rows, columns = matrix.shape
    if max(rows, columns) <= MAX_HEATMAP_SIDE:
        return _levels_heatmap, to_uint8(_normalize(matrix.float(), dims=(0, 1), sync=False))
    size = _pooled_size(rows, columns)
    pooled = F.adaptive_avg_pool2d(matrix[None].float(), size)  # what F.interpolate(mode="area") does
    low, high = torch.aminmax(matrix)
    return (partial(_pooled_heatmap, size, _heatmap_size(rows, columns)),
            torch.cat([pooled.view(-1), torch.stack([low, high]).float()]))


def _levels_heatmap(levels: torch.Tensor) -> PaletteImage:
    """The heat map of a matrix whose colour levels :func:`heatmap_source` computed: enlarged by a whole factor
    until its shorter side reaches ``MIN_HEATMAP_SIDE`` (within ``MAX_HEATMAP_SIDE``), kept as palette indices."""
    rows, columns = levels.shape
    height, width = _heatmap_size(rows, columns)
    factor = height // rows
    if factor > 1:
        levels = levels[:, None, :, None].expand(rows, factor, columns, factor).reshape(height, width)
    return PaletteImage(levels, HEATMAP_COLOURS)


def _pooled_heatmap(size: tuple[int, int], picture: tuple[int, int], source: torch.Tensor) -> PaletteImage:
    """The heat map of a matrix that :func:`heatmap_source` pooled to ``size``, normalised by the whole's bounds,
    its shorter side enlarged by a whole factor to the ``picture``'s."""
    values, (low, high) = source[:-2].view(size), source[-2:].tolist()
    if not (math.isfinite(low) and math.isfinite(high)):  # NaN or Inf in the whole: its own bounds
        levels = to_uint8(_normalize(values, dims=(0, 1)))
    else:
        span = high - low
        levels = to_uint8(((values - low) / span).clamp_(0.0, 1.0)) if span > 0 else torch.zeros(size, dtype=torch.uint8)
    for dim in (0, 1):
        if picture[dim] > size[dim]:
            levels = levels.repeat_interleave(picture[dim] // size[dim], dim=dim)
    return PaletteImage(levels, HEATMAP_COLOURS)
