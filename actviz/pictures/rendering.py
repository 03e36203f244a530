"""Rendering: pure functions that turn one sample's activations into a picture.

The public functions take a tensor and return a new ``uint8`` image tensor shaped
``(channels, height, width)``; inputs are never modified. A picture is made in two
halves. :func:`picture_source` runs in the hook, on the tensor's device: it copies what
the picture shows, no more (a few kernel ops, no host sync). The rest (normalisation,
colours, resizing, ``make_grid``'s layout) runs on the writer thread.
:func:`feature_map_grid` and :func:`heatmap` are the two halves in one call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from .heatmap_sources import (  # noqa: F401 - the heat map's sides are read from this module too
    MAX_HEATMAP_SIDE,
    MIN_HEATMAP_SIDE,
    _normalize,
    _viridis,
    heatmap_source,
)
from ..options import DEFAULT_MAX_CHANNELS
from ..common.pixels import PaletteImage, to_uint8

__all__ = [
    "DEFAULT_MAX_CHANNELS", "Picture", "draw_first_grid", "feature_map_grid", "grid_layout", "heatmap", "picture_source",
    "select_channels", "tile_size",
]

#: Tiles smaller than this (longest side, pixels) are enlarged by a whole factor.
MIN_TILE = 32
#: Tiles larger than this are shrunk by area averaging.
MAX_TILE = 128
GRID_PADDING = 2


class Picture(NamedTuple):
    """One picture on its way from the step that made it to the writer thread, where ``draw(*sources)`` gives its pixels.

    Every picture a step writes travels as one: a layer's feature map or heat map, the probe's, Grad-CAM's,
    the attention maps'.

    Attributes:
        tag: A layer's name, written as ``feature_maps/{tag}``; with ``full_tag``, the whole tag
            (``probe/input``, ``gradcam/features.10``).
        draw: Turns the sources, once on the host, into a ``uint8`` image (or a
            :class:`~actviz.common.pixels.PaletteImage`).
        sources: What it is drawn from: tensors on their device (a summary's whole copy may be one).
        full_tag: ``tag`` is the whole tag.

    Example:
        >>> picture = Picture("conv1", draw_grid, (torch.rand(3, 4, 4),))
        >>> tuple(picture.draw(*picture.sources).shape), picture.full_tag
        ((1, 70, 70), False)
    """

    tag: str
    draw: Callable[..., Any]
    sources: tuple[torch.Tensor, ...]
    full_tag: bool = False


def tile_size(height: int, width: int, min_tile: int = MIN_TILE, max_tile: int = MAX_TILE) -> tuple[int, int]:
    """Size a ``height × width`` feature map is drawn at in a grid.

    Small maps are enlarged by the smallest whole factor that makes their longest
    side at least ``min_tile`` (so pixels stay sharp squares); large maps are shrunk
    so their longest side is ``max_tile``.

    Example:
        >>> tile_size(13, 13), tile_size(56, 56), tile_size(224, 224), tile_size(4, 8)
        ((39, 39), (56, 56), (128, 128), (16, 32))
    """
    longest = max(height, width)
    if longest < min_tile:
        factor = math.ceil(min_tile / longest)
        return height * factor, width * factor
    if longest > max_tile:
        scale = max_tile / longest
        return max(1, round(height * scale)), max(1, round(width * scale))
    return height, width


def grid_layout(channels: int, tile_height: int, tile_width: int, padding: int = GRID_PADDING) -> tuple[int, int]:
    """``(height, width)`` of the grid :func:`feature_map_grid` draws for ``channels`` tiles.

    The grid has ``ceil(sqrt(channels))`` columns, as ``torchvision.utils.make_grid`` lays it out;
    like ``make_grid``, a single tile is returned as it is, without a border.

    Example:
        >>> grid_layout(64, 52, 52)   # 8 x 8 tiles of 52 px with 2 px gaps
        (434, 434)
        >>> grid_layout(5, 10, 10)    # 3 columns, 2 rows
        (26, 38)
    """
    if channels == 1:
        return tile_height, tile_width
    columns = min(channels, math.ceil(math.sqrt(channels)))
    rows = math.ceil(channels / columns)
    return rows * (tile_height + padding) + padding, columns * (tile_width + padding) + padding


def select_channels(fmap: torch.Tensor, max_channels: int, strengths: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the channels to draw: all, or the ``max_channels`` strongest by mean |activation|, in channel order.

    ``strengths``: each channel's mean |activation|, where the summary's one read gave them
    (:func:`~actviz.summaries.one_pass.channel_strength`); otherwise they are taken of ``fmap`` here.

    Example:
        >>> fmap = torch.stack([torch.full((2, 2), v) for v in (0.1, -5.0, 0.2, 3.0)])
        >>> select_channels(fmap, 2).tolist()
        [1, 3]
    """
    channels = fmap.shape[0]
    if channels <= max_channels:
        return torch.arange(channels, device=fmap.device)
    if strengths is None:
        strengths = torch.nan_to_num(fmap.abs(), nan=0.0, posinf=0.0).mean(dim=(1, 2))
    return strengths.topk(max_channels).indices.sort().values


def _resize(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Resize ``(N, C, H, W)``: whole-factor nearest when enlarging, area averaging when shrinking."""
    height, width = images.shape[-2:]
    if (height, width) == size:
        return images
    if size[0] % height == 0 and size[1] % width == 0:
        # A whole-factor enlargement repeats each pixel, as nearest interpolation does, in one copy.
        count, channels = images.shape[:2]
        rows, columns = size[0] // height, size[1] // width
        repeated = images[:, :, :, None, :, None].expand(count, channels, height, rows, width, columns)
        return repeated.reshape(count, channels, *size)
    mode = "nearest" if size[0] >= height and size[1] >= width else "area"
    return F.interpolate(images, size=size, mode=mode)


@torch.no_grad()
def feature_map_grid(
    fmap: torch.Tensor,
    max_channels: int = DEFAULT_MAX_CHANNELS,
    min_tile: int = MIN_TILE,
    max_tile: int = MAX_TILE,
    padding: int = GRID_PADDING,
) -> torch.Tensor:
    """Tile the channels of one sample's feature map into a grayscale grid.

    Each channel is normalised on its own to [0, 1] (a constant channel is black),
    resized with :func:`tile_size`, and laid out by ``torchvision.utils.make_grid`` with
    ``ceil(sqrt(k))`` columns and white gaps. When there are more than
    ``max_channels`` channels, the strongest by mean absolute activation are kept,
    in channel order.

    Args:
        fmap: A ``(C, H, W)`` tensor of any real dtype; NaN is drawn black.
        max_channels: Most channels to draw.
        min_tile: Smallest longest-side of a tile, in pixels.
        max_tile: Largest longest-side of a tile, in pixels.
        padding: Gap between tiles, in pixels.

    Returns:
        A ``(1, height, width)`` ``uint8`` tensor; its size is :func:`grid_layout` of the tile size.

    Example:
        >>> feature_map_grid(torch.randn(16, 7, 7)).shape   # 4 x 4 tiles of 35 px
        torch.Size([1, 150, 150])
    """
    if not isinstance(fmap, torch.Tensor):
        raise TypeError(f"fmap must be a torch.Tensor, got {type(fmap).__name__}")
    if fmap.dim() != 3 or fmap.numel() == 0:
        raise ValueError(f"fmap must be a non-empty (C, H, W) tensor, got shape {tuple(fmap.shape)}")
    if max_channels <= 0:
        raise ValueError(f"max_channels must be positive, got {max_channels}")
    return draw_grid(grid_channels(fmap.detach(), max_channels), min_tile, max_tile, padding)


def grid_channels(fmap: torch.Tensor, max_channels: int, copied: bool = False,
                  strengths: torch.Tensor | None = None) -> torch.Tensor:
    """The device half of :func:`feature_map_grid`: a copy of the channels to draw, in their dtype
    (``fmap`` itself if it is a copy already, ``copied``, and has no more than ``max_channels``), picked by
    ``strengths`` where given (:func:`select_channels`)."""
    if fmap.shape[0] > max_channels:
        return fmap.index_select(0, select_channels(fmap, max_channels, strengths))
    return fmap if copied else fmap.clone()


@torch.no_grad()
def draw_grid(
    channels: torch.Tensor, min_tile: int = MIN_TILE, max_tile: int = MAX_TILE, padding: int = GRID_PADDING
) -> torch.Tensor:
    """The host half of :func:`feature_map_grid`: every channel of a ``(C, H, W)`` tensor, tiled."""
    from torchvision.utils import make_grid  # here, so that watch() without pictures never imports torchvision

    values = channels.float()
    size = tile_size(*values.shape[-2:], min_tile=min_tile, max_tile=max_tile)
    tiles = _normalize(values, dims=(1, 2)).unsqueeze(1)
    if size[0] >= tiles.shape[-2] and size[1] >= tiles.shape[-1]:
        # Nearest enlarging only repeats pixels, so quantize first and move a quarter of the bytes.
        tiles = _resize(to_uint8(tiles), size)
    else:
        tiles = to_uint8(_resize(tiles, size))
    columns = math.ceil(math.sqrt(tiles.shape[0]))
    grid = make_grid(tiles, nrow=columns, padding=padding, pad_value=255)
    return grid[:1].contiguous()


def draw_first_grid(shape: tuple[int, ...], copy: torch.Tensor) -> torch.Tensor:
    """:func:`draw_grid` of the first sample of an ``(N, *shape)`` tensor, from a contiguous copy of it, of any shape
    (on the host).

    How a watcher draws a small output from its summary's copy, with no picture source of its own.

    Example:
        >>> fmap = torch.randn(2, 3, 5, 5)
        >>> torch.equal(draw_first_grid((3, 5, 5), fmap.reshape(-1)), draw_grid(fmap[0]))
        True
    """
    return draw_grid(copy.reshape(-1)[: math.prod(shape)].view(shape))


def picture_source(
    tensor: torch.Tensor, max_channels: int, batch_dim: int = 0, copied: bool = False,
    strengths: torch.Tensor | None = None,
) -> tuple[Callable[[torch.Tensor], torch.Tensor | PaletteImage], torch.Tensor] | None:
    """How to draw one layer output, split at the host: ``(draw, source)``, or ``None`` for no picture.

    ``source`` is a copy on the tensor's device of what the picture shows, no more: the chosen
    channels of sample 0 (4-D), or the colour levels of sample 0's matrix (3-D), one byte per value;
    when a side is over ``MAX_HEATMAP_SIDE`` (a language model's hidden states or logits), its area
    average at the picture's size and the whole's min and max (:func:`~actviz.pictures.heatmap_sources.heatmap_source`).
    ``draw(source)`` is :func:`feature_map_grid` of sample 0, or its :func:`heatmap` as a
    :class:`~actviz.common.pixels.PaletteImage` (the same pixels, a byte each). With ``copied``, ``tensor``
    is a private copy off autograd's tape (a watcher's :func:`~actviz.summaries.one_tensor.start_summary` copy):
    a grid of all its channels is a view of it, no second copy. ``strengths``, where the summary's read gave them,
    pick a 4-D output's channels (:func:`select_channels`) without a read of their own.

    Example:
        >>> draw, source = picture_source(torch.randn(2, 100, 5, 5), max_channels=64)
        >>> tuple(source.shape), tuple(draw(source).shape)
        ((64, 5, 5), (1, 298, 298))
        >>> draw, source = picture_source(torch.randn(1, 64, 5000), max_channels=64)
        >>> tuple(source.shape), tuple(draw(source).shape)  # area-averaged to 64 x 512, with min and max
        ((32770,), (3, 64, 512))
    """
    if tensor.numel() == 0 or tensor.dim() not in (3, 4) or tensor.is_complex():
        return None
    values = tensor if copied else tensor.detach()
    if tensor.dim() == 4:
        return draw_grid, grid_channels(values[0], max_channels, copied, strengths)
    return heatmap_source(values.select(batch_dim, 0))


@torch.no_grad()
def heatmap(matrix: torch.Tensor) -> torch.Tensor:
    """Draw a 2-D tensor (for example one sample's ``(C, L)`` or ``(T, D)`` activations) as a heat map.

    Values are normalised over the whole matrix and coloured with viridis (dark blue
    low, yellow high). Rows stay rows. The picture is enlarged by a whole factor
    until its shorter side is at least 64 px, or its longer side is area-averaged to 512 px (normalised by
    the whole matrix's min and max) and its shorter side kept at 64 px or more: a 20 x 18,328 matrix (a
    language model's 20 tokens over its vocabulary) is 80 x 512, each row a band 4 px high.

    Args:
        matrix: A non-empty ``(rows, columns)`` tensor of any real dtype.

    Returns:
        A ``(3, height, width)`` ``uint8`` tensor, stored channels-last (as a PNG wants).

    Example:
        >>> heatmap(torch.randn(10, 32)).shape
        torch.Size([3, 70, 224])
    """
    if not isinstance(matrix, torch.Tensor):
        raise TypeError(f"matrix must be a torch.Tensor, got {type(matrix).__name__}")
    if matrix.dim() != 2 or matrix.numel() == 0:
        raise ValueError(f"matrix must be a non-empty 2-D tensor, got shape {tuple(matrix.shape)}")
    draw, source = heatmap_source(matrix.detach())  # the watcher's two halves, in one call
    return draw(source).rgb()
