"""The one-pass summary as two Triton kernels: every number of a tensor's summary from one read of it.

:func:`summarize_tensors` reads each of a list of tensors once (one layer output; or a step's parameters,
found through a table of their addresses) and writes, for each, the summary row of
:mod:`actviz.summaries.one_pass` and its strided sample:

1. :func:`_tile_partials`, one program per tile of :data:`TILE` elements of one tensor: counts (int32),
   sums of powers of ``z - shift`` in float64 (``z``: the values with NaN and ±Inf replaced by 0;
   ``shift``: the tensor's first element of ``z``, so that a large offset cancels nothing), finite
   bounds in the input's precision, and, for the outlier numbers only, the third and fourth powers,
   ``max |x|`` and the count of ``|x| >= 6``; the tile's elements at the sample's stride are written to
   the sample on the way;
2. :func:`_combine_tiles`, one program per tensor: the tiles' partials added up into the row.

Two launches per call, whatever the tensors' number and size (and, for several, one copy of their
addresses from pinned memory); no host sync. Triton compiles them for
CUDA; with ``TRITON_INTERPRET=1`` in the environment before this module is imported, Triton runs them on
CPU tensors, which is how the test suite checks their numbers against float64 on a machine without a GPU.

Example:
    The tables of two parameters of 40,000 and 10 elements, sampled at strides 3 and 1: two tiles of the
    first (the second tile from element 32,768), one of the second; rows of 6, then the samples:

    >>> segments, tiles, total = _tables_for((40_000, 10), (3, 1), 6, True, torch.device("cpu"))
    >>> tiles.view(-1, 2).tolist(), segments[:8].tolist(), total
    ([[0, 0], [0, 32768], [1, 0]], [0, 40000, 3, 12, 0, 10, 1, 13346], 13356)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "PARTIALS", "TILE", "summarize_tensors"]

#: Elements one program reads per loop turn: with 8 warps, 4 an thread, so that ten accumulators stay in registers.
BLOCK = 1024
#: Elements of one tile: one program's share of a tensor.
TILE = 32 * BLOCK
#: Numbers a tile leaves: nonzero, finite nonzero, Σy, Σy², Σy³, Σy⁴ (y = z - shift), min, max, max|x|, outliers,
#: and the count beyond a unit bound (saturation). The kernels get it as their constant ``WIDE`` (a kernel reads
#: no module global but a ``tl.constexpr``).
PARTIALS = 11


@triton.jit
def _segment_base(values, addresses, segment, LISTED: tl.constexpr):
    """Where a segment's elements are: its own tensor's address (several tensors), or ``values`` (one)."""
    if LISTED:
        return tl.load(addresses + segment).to(tl.pointer_type(values.dtype.element_ty))
    return values


@triton.jit
def _tile_partials(values, addresses, segments, tiles, partials, sample, outlier_threshold,
                   channel_counts, channels, spatial, channels_last, centre, bound,
                   strengths, strength_channels, strength_spatial, strength_last,
                   BLOCK: tl.constexpr, TURNS: tl.constexpr, LISTED: tl.constexpr, OUTLIERS: tl.constexpr,
                   NARROW: tl.constexpr, UNITS: tl.constexpr, BINS: tl.constexpr, WIDE: tl.constexpr,
                   STRENGTH: tl.constexpr):
    tile = tl.program_id(0)
    segment = tl.load(tiles + tile * 2)
    start = tl.load(tiles + tile * 2 + 1)
    first = tl.load(segments + segment * 4)
    stop = tl.load(segments + segment * 4 + 1)
    stride = tl.load(segments + segment * 4 + 2)
    sample_start = tl.load(segments + segment * 4 + 3)
    base = _segment_base(values, addresses, segment, LISTED)
    head = tl.load(base + first).to(tl.float64)
    shift = tl.where(tl.abs(head) < float("inf"), head, 0.0)  # NaN < inf is false
    # Counts in int32 and bounds in the input's precision (NARROW: float32 for 16- and 32-bit inputs, exact),
    # sums of powers in float64.
    nonzero = tl.zeros((BLOCK,), tl.int32)
    finite_nonzero = tl.zeros((BLOCK,), tl.int32)
    s1 = tl.zeros((BLOCK,), tl.float64)
    s2 = tl.zeros((BLOCK,), tl.float64)
    s3 = tl.zeros((BLOCK,), tl.float64)
    s4 = tl.zeros((BLOCK,), tl.float64)
    low = tl.full((BLOCK,), float("inf"), NARROW)
    high = tl.full((BLOCK,), float("-inf"), NARROW)
    largest = tl.zeros((BLOCK,), NARROW)
    outliers = tl.zeros((BLOCK,), tl.int32)
    beyond = tl.zeros((BLOCK,), tl.int32)  # UNITS == 2: elements farther than bound from centre (saturated)
    alive = tl.zeros((BINS,), tl.int32)  # UNITS == 1: non-zero elements per channel, the last bin for the rest
    for turn in range(TURNS):
        offsets = start + turn * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < stop
        raw = tl.load(base + offsets, mask=inside, other=0.0)
        x = raw.to(NARROW)
        magnitude = tl.abs(x)
        finite = magnitude < float("inf")
        z = tl.where(finite, x, 0.0)
        y = tl.where(inside, z.to(tl.float64) - shift, 0.0)
        squared = y * y
        nonzero += (x != 0.0).to(tl.int32)  # NaN != 0
        finite_nonzero += (z != 0.0).to(tl.int32)
        s1 += y
        s2 += squared
        low = tl.minimum(low, tl.where(finite & inside, x, float("inf")))
        high = tl.maximum(high, tl.where(finite & inside, x, float("-inf")))
        if OUTLIERS:
            s3 += squared * y
            s4 += squared * squared
            largest = tl.maximum(largest, tl.where(magnitude == magnitude, magnitude, 0.0))  # NaN left out
            outliers += (magnitude >= outlier_threshold).to(tl.int32)
        position = offsets - first
        if UNITS == 1:
            channel = tl.where(channels_last != 0, position % channels, (position // spatial) % channels)
            alive += tl.histogram(tl.where(inside & (x != 0.0), channel, BINS - 1).to(tl.int32), BINS)  # NaN != 0: alive
        if UNITS == 2:
            beyond += (inside & (tl.abs(x - centre) > bound)).to(tl.int32)
        taken = inside & (position % stride == 0)
        tl.store(sample + sample_start + position // stride, x.to(tl.float64), mask=taken)  # x: raw, exactly
        if STRENGTH:  # Σ|x| per channel of sample 0, its first strength_channels * strength_spatial elements
            strength_head = strength_channels * strength_spatial  # not `head`: a loop-carried name keeps its type
            block_start = start + turn * BLOCK - first
            if block_start < strength_head:
                in_head = inside & (position < strength_head)
                value = tl.where(in_head & finite, magnitude, 0.0).to(tl.float64)
                if strength_last != 0:  # channels-last: channel = position % channels, each block touches all
                    tl.atomic_add(strengths + position % strength_channels, value, mask=in_head)
                else:
                    lowest = block_start // strength_spatial
                    spans = (BLOCK - 1) // strength_spatial + 2  # the most channels one block touches
                    if spans <= 4:  # long channels: a sum per channel, one atomic add each
                        owner = position // strength_spatial
                        for k in range(0, spans):
                            part = tl.sum(tl.where(owner == lowest + k, value, 0.0), 0)
                            tl.atomic_add(strengths + lowest + k, part, mask=lowest + k < strength_channels)
                    else:  # short channels: an add per element, at most strength_spatial to one address a block
                        tl.atomic_add(strengths + position // strength_spatial, value, mask=in_head)
    if UNITS == 1:
        bins = tl.arange(0, BINS)
        tl.atomic_add(channel_counts + bins, alive, mask=bins < channels)
    row = partials + tile * WIDE
    tl.store(row + 10, tl.sum(beyond, 0).to(tl.float64))
    tl.store(row + 0, tl.sum(nonzero, 0).to(tl.float64))
    tl.store(row + 1, tl.sum(finite_nonzero, 0).to(tl.float64))
    tl.store(row + 2, tl.sum(s1, 0))
    tl.store(row + 3, tl.sum(s2, 0))
    tl.store(row + 4, tl.sum(s3, 0))
    tl.store(row + 5, tl.sum(s4, 0))
    tl.store(row + 6, tl.min(low, 0).to(tl.float64))
    tl.store(row + 7, tl.max(high, 0).to(tl.float64))
    tl.store(row + 8, tl.max(largest, 0).to(tl.float64))
    tl.store(row + 9, tl.sum(outliers, 0).to(tl.float64))


@triton.jit
def _combine_tiles(values, addresses, segments, partials, rows, channel_counts, channels,
                   strengths, strength_channels, strength_spatial, strength_start,
                   WIDTH: tl.constexpr, ROW: tl.constexpr, LISTED: tl.constexpr, OUTLIERS: tl.constexpr,
                   UNITS: tl.constexpr, WIDE: tl.constexpr, STRENGTH: tl.constexpr):
    segment = tl.program_id(0)
    first = tl.load(segments + segment * 4)
    stop = tl.load(segments + segment * 4 + 1)
    tile_first = tl.load(segments + 4 * tl.num_programs(0) + segment)
    tile_stop = tl.load(segments + 4 * tl.num_programs(0) + segment + 1)
    base = _segment_base(values, addresses, segment, LISTED)
    head = tl.load(base + first).to(tl.float64)
    shift = tl.where(tl.abs(head) < float("inf"), head, 0.0)
    count = (stop - first).to(tl.float64)
    totals = tl.zeros((WIDTH,), tl.float64)
    low = tl.full((WIDTH,), float("inf"), tl.float64)
    high = tl.full((WIDTH,), float("-inf"), tl.float64)
    largest = tl.zeros((WIDTH,), tl.float64)
    columns = tl.arange(0, WIDTH)
    summed = (columns < 6) | (columns >= 9)
    for tile in range(tile_first, tile_stop):
        row = tl.load(partials + tile * WIDE + columns, mask=columns < WIDE, other=0.0)
        totals += tl.where(summed, row, 0.0)
        low = tl.minimum(low, tl.where(columns == 6, row, float("inf")))
        high = tl.maximum(high, tl.where(columns == 7, row, float("-inf")))
        largest = tl.maximum(largest, tl.where(columns == 8, row, 0.0))
    nonzero = tl.sum(tl.where(columns == 0, totals, 0.0), 0)
    finite_nonzero = tl.sum(tl.where(columns == 1, totals, 0.0), 0)
    s1 = tl.sum(tl.where(columns == 2, totals, 0.0), 0)
    s2 = tl.sum(tl.where(columns == 3, totals, 0.0), 0)
    s3 = tl.sum(tl.where(columns == 4, totals, 0.0), 0)
    s4 = tl.sum(tl.where(columns == 5, totals, 0.0), 0)
    outliers = tl.sum(tl.where(columns == 9, totals, 0.0), 0)
    beyond = tl.sum(tl.where(columns == 10, totals, 0.0), 0)
    offset = s1 / count  # the mean of z, less the shift
    centred_squares = tl.maximum(s2 - count * offset * offset, 0.0)
    centred_fourths = s4 - 4.0 * offset * s3 + 6.0 * offset * offset * s2 - 3.0 * count * offset * offset * offset * offset
    out = rows + segment * ROW
    tl.store(out + 0, nonzero)
    tl.store(out + 1, finite_nonzero)
    tl.store(out + 2, shift + offset)
    tl.store(out + 3, centred_squares / count)
    tl.store(out + 4, tl.min(low, 0))
    tl.store(out + 5, tl.max(high, 0))
    if OUTLIERS:
        tl.store(out + 6, tl.max(largest, 0))
        tl.store(out + 7, outliers)
        tl.store(out + 8, centred_squares)
        tl.store(out + 9, tl.maximum(centred_fourths, 0.0))
    if UNITS == 1:  # the fraction of channels with no non-zero element
        dead = tl.zeros((WIDTH,), tl.float64)
        for start in range(0, channels, WIDTH):
            counts = tl.load(channel_counts + start + columns, mask=start + columns < channels, other=1)
            dead += tl.where(counts == 0, 1.0, 0.0)
        tl.store(out + ROW - 1, tl.sum(dead, 0) / channels)
    if UNITS == 2:  # the fraction of elements farther than the bound from the centre
        tl.store(out + ROW - 1, beyond / count)
    if STRENGTH:  # each channel's mean |x| over sample 0, after the samples
        for begin in range(0, strength_channels, WIDTH):
            inside = begin + columns < strength_channels
            sums = tl.load(strengths + begin + columns, mask=inside, other=0.0)
            tl.store(rows + strength_start + begin + columns, sums / strength_spatial, mask=inside)


_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}


def _tables_for(sizes: tuple[int, ...], strides: tuple[int, ...], row: int, listed: bool,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The segment table (each segment's first element, end, sample stride and sample start, then each
    segment's first tile, and the tile count) and the tile table (each tile's segment and first element),
    on ``device``, made once per set of sizes: a model's tensors have the same sizes every step. Listed
    segments each start at 0 of their own tensor; otherwise they lie end to end in one."""
    key = (sizes, strides, row, listed, device)
    found = _tables.get(key)
    if found is None:
        if len(_tables) > 256:  # ever new sizes: keep a few
            _tables.clear()
        segment_rows, tile_rows, first_tiles = [], [], [0]
        first, sample_start = 0, len(sizes) * row
        for segment, (size, stride) in enumerate(zip(sizes, strides)):
            first = 0 if listed else first
            segment_rows.append([first, first + size, stride, sample_start])
            tile_rows += [[segment, start] for start in range(first, first + size, TILE)]
            first_tiles.append(len(tile_rows))
            first += size
            sample_start += -(-size // stride)
        segments = torch.tensor([value for entry in segment_rows for value in entry] + first_tiles, dtype=torch.int64)
        tiles = torch.tensor(tile_rows, dtype=torch.int64).view(-1)
        found = _tables[key] = (segments.to(device), tiles.to(device), sample_start)
    return found


def _addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's address, on their device: from pinned memory without a wait on CUDA."""
    device = tensors[0].device
    pinned = device.type == "cuda"
    addresses = torch.tensor([tensor.data_ptr() for tensor in tensors], dtype=torch.int64, pin_memory=pinned)
    return addresses.to(device, non_blocking=True) if pinned else addresses


def summarize_tensors(tensors: list[torch.Tensor], strides: tuple[int, ...], row: int, outlier_threshold: float,
                      outliers: bool = False, units: tuple[float, ...] = (), channels: tuple[int, ...] = ()) -> torch.Tensor:
    """Rows and samples of ``tensors`` (1-D, contiguous, non-empty, one device and dtype), in two launches.

    Returns one float64 tensor: a row of ``row`` numbers per tensor (see :mod:`actviz.summaries.one_pass`),
    then each tensor's sample, ``tensor[::stride]``. Several tensors are read where they are, through a table
    of their addresses: no copy end to end. ``units``, for one tensor: ``(1, channels, spatial, channels_last)``
    for the fraction of channels with no non-zero element, ``(2, centre, bound)`` for the fraction farther than
    ``bound`` from ``centre``, in the row's last place. ``channels``, for one tensor: ``(channels, spatial,
    channels_last)`` adds each channel's mean ``|x|`` over sample 0 after the samples
    (:func:`~actviz.summaries.one_pass.channel_strength`).
    """
    first = tensors[0]
    listed = len(tensors) > 1
    sizes = tuple(tensor.numel() for tensor in tensors)
    segments, tiles, total = _tables_for(sizes, strides, row, listed, first.device)
    addresses = _addresses(tensors) if listed else segments  # unread with one tensor
    tile_count = tiles.numel() // 2
    partials = torch.empty(tile_count * PARTIALS, dtype=torch.float64, device=first.device)
    strength_channels, strength_spatial, strength_last = channels if channels else (1, 1, 0)
    out = torch.empty(total + (strength_channels if channels else 0), dtype=torch.float64, device=first.device)
    strengths = torch.zeros(strength_channels, dtype=torch.float64, device=first.device) if channels else partials
    kind = int(units[0]) if units else 0
    unit_channels = int(units[1]) if kind == 1 else 1
    counts = torch.zeros(unit_channels, dtype=torch.int32, device=first.device) if kind == 1 else partials
    narrow = tl.float64 if first.dtype == torch.float64 else tl.float32
    _tile_partials[(tile_count,)](
        first, addresses, segments, tiles, partials, out, outlier_threshold, counts, unit_channels,
        int(units[2]) if kind == 1 else 1, int(units[3]) if kind == 1 else 0,
        float(units[1]) if kind == 2 else 0.0, float(units[2]) if kind == 2 else 0.0,
        strengths, strength_channels, strength_spatial, strength_last,
        BLOCK=BLOCK, TURNS=TILE // BLOCK, LISTED=listed, OUTLIERS=outliers, NARROW=narrow, UNITS=kind,
        BINS=triton.next_power_of_2(unit_channels + 1) if kind == 1 else 2, WIDE=PARTIALS, STRENGTH=bool(channels),
        num_warps=8)
    _combine_tiles[(len(sizes),)](first, addresses, segments, partials, out, counts, unit_channels,
                                  strengths, strength_channels, strength_spatial, total,
                                  WIDTH=16, ROW=row, LISTED=listed, OUTLIERS=outliers, UNITS=kind, WIDE=PARTIALS,
                                  STRENGTH=bool(channels))
    return out
