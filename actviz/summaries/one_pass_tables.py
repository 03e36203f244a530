"""The tables the one-pass kernels (:mod:`actviz.summaries.one_pass_triton`) read, worked out on the host.

The kernels read tensors in tiles of :data:`TILE` elements, one program each, and need no 64-bit division:
the host works out each tile's int64 places once per set of sizes (:func:`tables_for`), keeps them and the
listed tensors' addresses (:func:`addresses_of`) on the device, and gives the kernels a magic number for each
32-bit division they do (:func:`divider`). While a CUDA graph is captured nothing is copied from the host
(:class:`CaptureNeedsTables`): tables made on an earlier step are read, and kept for as long as the process runs.

Example:
    The tables of two parameters of 40,000 and 10 elements, sampled at strides 3 and 1: each segment's size,
    sample stride and sample start, then each one's first tile; two tiles of the first (the second's first
    sampled element 1 past its start, the sample's 10,923rd), one of the second:

    >>> segments, tiles, total = tables_for((40_000, 10), (3, 1), 6, torch.device("cpu"))
    >>> segments.tolist(), tiles.view(-1, 5)[:, :3].tolist(), total
    ([40000, 3, 12, 10, 1, 13346, 0, 2, 3], [[0, 0, 0], [0, 1, 10923], [1, 0, 0]], 13356)
"""

from __future__ import annotations

import torch
import triton

__all__ = ["BLOCK", "MAX_BINS", "TILE", "CaptureNeedsTables", "addresses_of", "divider", "tables_for", "takes_units",
           "unit_bins"]

#: Elements one program reads per loop turn: with 4 warps, 8 a thread (16 bytes of bfloat16, two loads of float32).
BLOCK = 1024
#: Elements of one tile: one program's share of a tensor (at most 32 turns: the packed counts' 10 bits each).
TILE = 32 * BLOCK
#: The most histogram bins a tile counts its channels in (16 KiB of shared memory, 32 registers a thread); a
#: layout that needs more (over 4,096 channels, channels-last or of under 9 elements each) takes the eager body.
MAX_BINS = 4096


def divider(divisor: int) -> tuple[int, int]:
    """``(magic, shift)`` with ``n // divisor == umulhi(2 * n, magic) >> shift`` for ``0 <= n < 2**31``: a magic
    under ``2**32`` (Granlund and Montgomery, 1994, theorem 4.2, with 31-bit numerators), handed to the kernel as
    the int32 of its bits, so that every divisor compiles to the same variant.

    Example:
        >>> magic, shift = divider(49)
        >>> all(((2 * n * (magic % 2**32)) >> 32) >> shift == n // 49 for n in (0, 48, 49, 2**31 - 1))
        True
    """
    shift = (divisor - 1).bit_length()  # ceil(log2 divisor)
    magic = (1 << (31 + shift)) // divisor + 1
    return magic - (1 << 32) if magic >= 1 << 31 else magic, shift


_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}
_addresses_kept: dict[tuple, torch.Tensor] = {}
_captured: list[torch.Tensor] = []  # device tables a captured CUDA graph reads: kept for the process's life


class CaptureNeedsTables(RuntimeError):
    """A CUDA graph is being captured and the kernels' tables for these tensors are not on the device yet: copying
    them there would put a host buffer's address into the graph, so the caller takes the eager body."""


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, without a host sync on CUDA: from pinned memory, asynchronously; never while a
    CUDA graph is being captured (:class:`CaptureNeedsTables`)."""
    if device.type != "cuda":
        return host.to(device)
    if _capturing(device):
        raise CaptureNeedsTables("the one-pass kernels' tables are made on a step before a CUDA graph captures one")
    return host.pin_memory().to(device, non_blocking=True)


def _kept(table: torch.Tensor) -> torch.Tensor:
    """``table``, kept alive for good if a CUDA graph being captured will read it (a cache may drop it later)."""
    if _capturing(table.device) and not any(table is kept for kept in _captured):
        _captured.append(table)
    return table


def tables_for(sizes: tuple[int, ...], strides: tuple[int, ...], row: int, device: torch.device,
                layout: tuple[int, int] = (1, 1)) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The segment table (each segment's size, sample stride and sample start, then each segment's first tile,
    and the tile count) and the tile table (each tile's segment, the offset in the tile of its first sampled
    element and that element's place in the sample, and, for ``layout = (spatial, channels)``, the tile's first
    element's place in its row of ``spatial`` elements and its channel), on ``device``, made once per set of
    sizes: a model's tensors have the same sizes every step. Each segment starts at element 0 of its own tensor."""
    key = (sizes, strides, row, device, layout)
    found = _tables.get(key)
    if found is None:
        if len(_tables) > 256:  # ever new sizes: keep a few
            _tables.clear()
        spatial, channels = layout
        segment_rows, tile_rows, first_tiles = [], [], [0]
        sample_start = len(sizes) * row
        for segment, (size, stride) in enumerate(zip(sizes, strides)):
            segment_rows += [size, stride, sample_start]
            starts = torch.arange(0, size, TILE, dtype=torch.int64)
            taken = (starts + stride - 1) // stride
            tile_rows.append(torch.stack([torch.full_like(starts, segment), taken * stride - starts, taken,
                                          starts % spatial, starts // spatial % channels], dim=1))
            first_tiles.append(first_tiles[-1] + starts.numel())
            sample_start += -(-size // stride)
        segments = torch.tensor(segment_rows + first_tiles, dtype=torch.int64)
        tiles = torch.cat(tile_rows).view(-1)
        found = _tables[key] = (_on_device(segments, device), _on_device(tiles, device), sample_start)
    return (_kept(found[0]), _kept(found[1]), found[2])


def addresses_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's address, on their device, kept per set of addresses: a step's parameters and gradients lie
    at the same addresses every step, so that a later step (and a CUDA graph captured after a first step) copies
    nothing."""
    key = (tensors[0].device, *(tensor.data_ptr() for tensor in tensors))
    found = _addresses_kept.get(key)
    if found is None:
        if len(_addresses_kept) > 64:  # ever new addresses: keep a few
            _addresses_kept.clear()
        host = torch.tensor(key[1:], dtype=torch.int64)
        found = _addresses_kept[key] = _on_device(host, tensors[0].device)
    return _kept(found)


def takes_units(units: tuple[float, ...], size: int) -> bool:
    """Whether the kernels count ``units`` (see :func:`~actviz.summaries.one_pass_triton.summarize_tensors`) of a
    tensor of ``size`` elements: a saturation count always; dead channels where a tile's channels fit
    :data:`MAX_BINS` histogram bins (channels-last: a bin per channel).

    Example:
        >>> takes_units((1, 256, 3136, 0), 16 * 256 * 3136), takes_units((1, 40_000, 1, 0), 40_000)
        (True, False)
        >>> takes_units((1, 5000, 49, 0), 16 * 5000 * 49), takes_units((1, 5000, 49, 1), 16 * 5000 * 49)
        (True, False)
    """
    if not units or int(units[0]) != 1:
        return True
    spatial = 1 if int(units[3]) else int(units[2])  # channels-last: a channel's run is one element
    return unit_bins(int(units[1]), spatial, size) is not None


def unit_bins(channels: int, spatial: int, size: int) -> tuple[int, bool] | None:
    """``(bins, row_mode)`` for dead channels: a bin per channel, or, with fewer bins, one per row of ``spatial``
    elements that a tile spans (row mode); ``None`` where neither fits :data:`MAX_BINS` or 32-bit offsets."""
    if spatial >= 2**30 or channels >= 2**30 or size >= 2**62:
        return None
    rows = (TILE - 1) // spatial + 2  # the most rows one tile touches
    by_channel, by_row = triton.next_power_of_2(channels), triton.next_power_of_2(rows)
    bins, row_mode = (by_row, True) if by_row < by_channel else (by_channel, False)
    return (max(bins, 64), row_mode) if bins <= MAX_BINS else None  # 64 at least: fewer variants to compile
