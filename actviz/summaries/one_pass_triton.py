"""The one-pass summary as two Triton kernels: every number of a tensor's summary from one read of it.

:func:`summarize_tensors` reads each of a list of tensors once (one layer output; or a step's parameters,
found through a table of their addresses) and writes, for each, the summary row of
:mod:`actviz.summaries.one_pass` and its strided sample:

1. :func:`_tile_partials`, one program per tile of :data:`TILE` elements of one tensor: counts, sums of powers
   of ``z - shift`` in float64 (``z``: the values with NaN and ±Inf replaced by 0; ``shift``: the tensor's first
   element of ``z``, so that a large offset cancels nothing), finite bounds in the input's precision, and, for
   the outlier numbers only, the third and fourth powers and the count of ``|x| >= 6``; then the tile's
   elements at the sample's stride, its channels' unit counts and its share of the channel strengths;
2. :func:`_combine_tiles`, one program per tensor: the tiles' partials added up into the row, 64 tiles a turn.

How it reaches bandwidth on a GPU (``tests/test_kernel_compile.py`` compiles every variant for sm_80 and sm_90
and checks registers, spills, shared memory, the main loop's divisions and the atomics):

* **Offsets.** A program's tile starts at an int64 element (``tile * TILE``), computed once; inside the tile
  every offset is 32-bit. A channel index is a 32-bit quotient by a multiply-high with a magic number the host
  works out (:func:`~actviz.summaries.one_pass_tables.divider`), never a 64-bit division.
* **Loads.** Whole turns of :data:`BLOCK` elements are read unmasked from a 16-byte aligned address (the last,
  partial turn masked), so that each thread reads 16 bytes at a time, through a 3-stage ``cp.async`` pipeline.
* **Registers.** Each thread adds up its 16 bytes of a turn before they reach its accumulators (a row's worth
  each), and five counts share two int32s (10 bits each): 48 to 128 registers, no spills.
* **Atomics.** None in the main loop. A channel with a non-zero element gets a plain store of 1 (every writer
  writes the same 1); channel strengths are summed per block in registers, one relaxed float64 atomic per
  channel and tile.

Two launches per call, whatever the tensors' number and size, on the tensors' own device; no host sync. The
tables of sizes and addresses are made once and kept on the device: a CUDA graph captured after a first step
reads them and copies nothing from the host (during a capture that would need a copy, the op takes its eager
body; :mod:`~actviz.summaries.one_pass_tables`). Triton compiles them for CUDA; with ``TRITON_INTERPRET=1`` in the environment
before this module is imported, Triton runs them on CPU tensors, which is how the test suite checks their
numbers against float64 on a machine without a GPU.

Example:
    >>> PARTIALS, BLOCK, TILE  # numbers a tile leaves; elements a program reads a turn; elements of a tile
    (12, 1024, 32768)
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .one_pass_tables import BLOCK, MAX_BINS, TILE, addresses_of, divider, tables_for, unit_bins

__all__ = ["PARTIALS", "summarize_tensors"]

#: Numbers a tile leaves: nonzero, finite nonzero, Σy, Σy², Σy³, Σy⁴ (y = z - shift), min, max, max|x|, outliers,
#: the count beyond a unit bound (saturation), and the tensor's shift. The kernels get it as their constant ``WIDE``
#: (a kernel reads no module global but a ``tl.constexpr``).
PARTIALS = 12

_TILES_A_TURN = 64  # tiles the combine adds per turn
_STAGES = 3  # turns in flight in the main loop (cp.async on sm_80 and later)


@triton.jit
def _quotient(n, magic, shift):
    """``n // divisor`` of int32 ``n`` in ``[0, 2**31)``, by the numbers of
    :func:`~actviz.summaries.one_pass_tables.divider`: three integer instructions."""
    return (tl.umulhi(n.to(tl.uint32) << 1, magic.to(tl.uint32)) >> shift).to(tl.int32)


@triton.jit
def _segment_base(values, addresses, segment, LISTED: tl.constexpr, ALIGNED: tl.constexpr):
    """Where a segment's elements are: its own tensor's address (several tensors), or ``values`` (one)."""
    if LISTED:
        base = tl.load(addresses + segment).to(tl.pointer_type(values.dtype.element_ty))
        if ALIGNED:  # every listed address is a multiple of 16 (checked on the host)
            base = tl.multiple_of(base, 16)
        return base
    return values


@triton.jit
def _turn(tile_base, offset, length, shift, outlier_threshold, centre, bound,
          packed, rare, s1, s2, s3, s4, low, high, alive,
          first_row, row_magic, row_shift, bin_base, wrap, wrap_magic, wrap_shift,
          BLOCK: tl.constexpr, VECTOR: tl.constexpr, MASKED: tl.constexpr, OUTLIERS: tl.constexpr,
          NARROW: tl.constexpr, UNITS: tl.constexpr, BINS: tl.constexpr):
    """One turn of :data:`BLOCK` elements from ``offset`` (32-bit, within the tile) into the accumulators: rows of
    ``VECTOR`` elements (16 bytes), each a thread's, added up in the thread before they reach the accumulators
    (a row's worth each), so that the accumulators take a register or two a thread whatever the dtype."""
    lanes = offset + tl.arange(0, BLOCK // VECTOR)[:, None] * VECTOR + tl.arange(0, VECTOR)[None, :]
    if MASKED:
        inside = lanes < length
        x = tl.load(tile_base + lanes, mask=inside, other=0.0).to(NARROW)
    else:
        x = tl.load(tile_base + lanes).to(NARROW)
    magnitude = tl.abs(x)
    finite = magnitude < float("inf")  # NaN < inf is false
    z = tl.where(finite, x, 0.0)
    y = z.to(tl.float64) - shift
    if MASKED:
        y = tl.where(inside, y, 0.0)
        finite = finite & inside
    squared = y * y
    s1 += tl.sum(y, 1)
    s2 += tl.sum(squared, 1)
    low = tl.minimum(low, tl.min(tl.where(finite, x, float("inf")), 1))
    high = tl.maximum(high, tl.max(tl.where(finite, x, float("-inf")), 1))
    # Five counts in two int32s, 10 bits each (a row counts at most 32 turns of 8): nonzero (NaN != 0), finite
    # nonzero and outliers; infinities and saturated elements.
    counts = (x != 0.0).to(tl.int32) + ((z != 0.0).to(tl.int32) << 10)
    if OUTLIERS:
        s3 += tl.sum(squared * y, 1)
        s4 += tl.sum(squared * squared, 1)
        counts += (magnitude >= outlier_threshold).to(tl.int32) << 20
        rare += tl.sum((magnitude == float("inf")).to(tl.int32), 1)
    if UNITS == 2:
        far = tl.abs(x - centre) > bound
        if MASKED:
            far = far & inside
        rare += tl.sum(far.to(tl.int32), 1) << 10
    packed += tl.sum(counts, 1)
    if UNITS == 1:  # the element's channel: (its row of `spatial` elements, from the tile's first) mod channels
        row = _quotient(first_row + lanes, row_magic, row_shift)
        spot = bin_base + row
        spot = spot - _quotient(spot, wrap_magic, wrap_shift) * wrap
        live = x != 0.0  # NaN != 0: alive
        if MASKED:
            live = live & inside
        alive += tl.histogram(tl.reshape(spot, (BLOCK,)), BINS, mask=tl.reshape(live, (BLOCK,)))
    return packed, rare, s1, s2, s3, s4, low, high, alive


@triton.jit(do_not_specialize=["outlier_threshold", "channels", "spatial", "row_magic", "row_shift", "row_mode", "wrap",
                               "wrap_magic", "wrap_shift", "centre", "bound", "strength_channels", "strength_spatial",
                               "segment_count"])
def _tile_partials(values, addresses, segments, tiles, partials, sample, outlier_threshold,
                   channel_counts, channels, spatial, row_magic, row_shift, row_mode, wrap, wrap_magic, wrap_shift,
                   centre, bound, strengths, strength_channels, strength_spatial, segment_count,
                   BLOCK: tl.constexpr, VECTOR: tl.constexpr, LISTED: tl.constexpr, ALIGNED: tl.constexpr, OUTLIERS: tl.constexpr,
                   NARROW: tl.constexpr, UNITS: tl.constexpr, BINS: tl.constexpr, WIDE: tl.constexpr,
                   STRENGTH: tl.constexpr, STRENGTH_LAST: tl.constexpr, TILE: tl.constexpr,
                   STAGES: tl.constexpr):
    tile = tl.program_id(0)
    entry = tiles + tile * 5  # segment, first sampled element's offset, its place in the sample, first row, channel
    segment = tl.load(entry)
    size = tl.load(segments + segment * 3)
    stride = tl.load(segments + segment * 3 + 1).to(tl.int32)
    sample_start = tl.load(segments + segment * 3 + 2)
    first_tile = tl.load(segments + segment_count * 3 + segment)
    tile_start = (tile - first_tile).to(tl.int64) * TILE  # int64 once; every offset below is 32-bit
    length = tl.minimum(size - tile_start, TILE).to(tl.int32)
    base = _segment_base(values, addresses, segment, LISTED, ALIGNED)
    tile_base = base + tile_start
    head = tl.load(base).to(tl.float64)
    shift = tl.where(tl.abs(head) < float("inf"), head, 0.0)
    ROWS: tl.constexpr = BLOCK // VECTOR
    packed = tl.zeros((ROWS,), tl.int32)  # per row of VECTOR elements, 10-bit counts (see _turn)
    rare = tl.zeros((ROWS,), tl.int32)
    s1 = tl.zeros((ROWS,), tl.float64)
    s2 = tl.zeros((ROWS,), tl.float64)
    s3 = tl.zeros((ROWS,), tl.float64)
    s4 = tl.zeros((ROWS,), tl.float64)
    low = tl.full((ROWS,), float("inf"), NARROW)
    high = tl.full((ROWS,), float("-inf"), NARROW)
    alive = tl.zeros((BINS,), tl.int32)  # UNITS == 1: non-zero elements per bin (a channel, or a row of the tile)
    # UNITS == 1: element i of the tile lies in row (first_row + i) // spatial counted from the tile's first row;
    # its bin is (bin_base + that) mod wrap: its channel (wrap = channels), or, in row_mode, where a tile spans
    # fewer rows than there are channels, the row itself (the host passes a wrap past any row). The host works
    # out each tile's first row and channel (no 64-bit division on the GPU).
    first_row = tl.load(entry + 3).to(tl.int32)
    channel_first = tl.load(entry + 4).to(tl.int32)
    bin_base = tl.where(row_mode != 0, 0, channel_first)
    whole = length // BLOCK * BLOCK
    for offset in tl.range(0, whole, BLOCK, num_stages=STAGES):
        packed, rare, s1, s2, s3, s4, low, high, alive = _turn(
            tile_base, offset, length, shift, outlier_threshold, centre, bound, packed, rare, s1, s2, s3, s4, low, high, alive,
            first_row, row_magic, row_shift, bin_base, wrap, wrap_magic, wrap_shift,
            BLOCK, VECTOR, False, OUTLIERS, NARROW, UNITS, BINS)
    if whole < length:
        packed, rare, s1, s2, s3, s4, low, high, alive = _turn(
            tile_base, whole, length, shift, outlier_threshold, centre, bound, packed, rare, s1, s2, s3, s4, low, high, alive,
            first_row, row_magic, row_shift, bin_base, wrap, wrap_magic, wrap_shift,
            BLOCK, VECTOR, True, OUTLIERS, NARROW, UNITS, BINS)
    # The sample: the tile's elements at positions k * stride, 32-bit offsets from the first of them.
    lead = tl.load(entry + 1).to(tl.int32)
    taken = tl.where(lead < length, (length - 1 - lead) // stride + 1, 0)
    sample_base = sample + sample_start + tl.load(entry + 2)
    for begin in range(0, taken, BLOCK):
        picks = begin + tl.arange(0, BLOCK)
        chosen = picks < taken
        raw = tl.load(tile_base + lead + picks * stride, mask=chosen)
        tl.store(sample_base + picks, raw.to(NARROW).to(tl.float64), mask=chosen)  # x: raw, exactly
    if UNITS == 1:  # a plain store of 1 for each channel with a non-zero element: every writer writes the same
        bins = tl.arange(0, BINS)
        if row_mode:
            rows = (first_row + length - 1) // spatial.to(tl.int32) + 1
            channel = (channel_first + bins) % channels.to(tl.int32)
            tl.store(channel_counts + channel, tl.full((BINS,), 1, tl.int32), mask=(alive > 0) & (bins < rows))
        else:
            tl.store(channel_counts + bins, tl.full((BINS,), 1, tl.int32), mask=(alive > 0) & (bins < channels))
    if STRENGTH:  # Σ|x| per channel of sample 0, its first strength_channels * strength_spatial elements
        _strength_sums(tile_base, tile_start, length, strengths, strength_channels, strength_spatial, STRENGTH_LAST)
    row = partials + tile * WIDE
    tl.store(row + 0, tl.sum(packed & 1023, 0).to(tl.float64))
    tl.store(row + 1, tl.sum((packed >> 10) & 1023, 0).to(tl.float64))
    tl.store(row + 2, tl.sum(s1, 0))
    tl.store(row + 3, tl.sum(s2, 0))
    tl.store(row + 4, tl.sum(s3, 0))
    tl.store(row + 5, tl.sum(s4, 0))
    lowest = tl.min(low, 0).to(tl.float64)
    highest = tl.max(high, 0).to(tl.float64)
    tl.store(row + 6, lowest)
    tl.store(row + 7, highest)
    infinities = tl.sum(rare & 1023, 0)
    largest = tl.maximum(tl.maximum(-lowest, highest), 0.0)  # max |x| of the finite elements (0 if none)
    tl.store(row + 8, tl.where(infinities > 0, float("inf"), largest))
    tl.store(row + 9, tl.sum((packed >> 20) & 1023, 0).to(tl.float64))
    tl.store(row + 10, tl.sum((rare >> 10) & 1023, 0).to(tl.float64))
    tl.store(row + 11, shift)


@triton.jit
def _strength_sums(tile_base, tile_start, length, strengths, channels, spatial, LAST: tl.constexpr):
    """The tile's share of Σ|x| (finite) per channel of sample 0: summed in registers over (channels, positions)
    blocks of the tile, then one relaxed float64 atomic add per channel."""
    head = channels * spatial
    if tile_start < head:
        stop = tl.minimum(head - tile_start, length.to(tl.int64)).to(tl.int32)  # the tile's part of sample 0
        lead = tile_start.to(tl.int32)  # tile_start < head < 2**31 (checked on the host)
        width = channels.to(tl.int32)
        span = spatial.to(tl.int32)
        if LAST:  # (positions, channels) in memory: blocks of 8 positions by 64 channels
            row_first = lead // width
            row_stop = (lead + stop - 1) // width + 1
            for column in range(0, width, 64):
                picked = column + tl.arange(0, 64)
                sums = tl.zeros((8, 64), tl.float64)
                for block_row in range(row_first, row_stop, 8):
                    rows = block_row + tl.arange(0, 8)
                    at = rows[:, None] * width + picked[None, :] - lead
                    inside = (at >= 0) & (at < stop) & (picked[None, :] < width)
                    x = tl.abs(tl.load(tile_base + at, mask=inside, other=0.0).to(tl.float32))
                    sums += tl.where(x < float("inf"), x, 0.0).to(tl.float64)
                tl.atomic_add(strengths + picked, tl.sum(sums, 0), mask=picked < width, sem="relaxed")
        else:  # (channels, positions) in memory: blocks of 8 channels by 64 positions
            channel_first = lead // span
            channel_stop = (lead + stop - 1) // span + 1
            for block_channel in range(channel_first, channel_stop, 8):
                picked = block_channel + tl.arange(0, 8)
                sums = tl.zeros((8, 64), tl.float64)
                for position in range(0, span, 64):
                    positions = position + tl.arange(0, 64)
                    at = picked[:, None] * span + positions[None, :] - lead
                    inside = (at >= 0) & (at < stop) & (positions[None, :] < span)
                    x = tl.abs(tl.load(tile_base + at, mask=inside, other=0.0).to(tl.float32))
                    sums += tl.where(x < float("inf"), x, 0.0).to(tl.float64)
                tl.atomic_add(strengths + picked, tl.sum(sums, 1), mask=picked < channel_stop, sem="relaxed")


@triton.jit(do_not_specialize=["channels", "strength_channels", "strength_spatial", "strength_start", "segment_count"])
def _combine_tiles(segments, partials, rows, channel_counts, channels,
                   strengths, strength_channels, strength_spatial, strength_start, segment_count,
                   ROW: tl.constexpr, OUTLIERS: tl.constexpr, UNITS: tl.constexpr, WIDE: tl.constexpr,
                   STRENGTH: tl.constexpr, TILES: tl.constexpr):
    segment = tl.program_id(0)
    count = tl.load(segments + segment * 3).to(tl.float64)
    tile_first = tl.load(segments + segment_count * 3 + segment)
    tile_count = (tl.load(segments + segment_count * 3 + segment + 1) - tile_first).to(tl.int32)
    table = partials + tile_first * WIDE
    columns = tl.arange(0, 16)[None, :]
    summed = (columns < 6) | (columns == 9) | (columns == 10)
    totals = tl.zeros((TILES, 16), tl.float64)
    low = tl.full((TILES, 16), float("inf"), tl.float64)
    high = tl.full((TILES, 16), float("-inf"), tl.float64)
    for begin in range(0, tile_count, TILES):  # TILES tiles' partials a turn, one row of 16 each
        picked = begin + tl.arange(0, TILES)[:, None]
        present = picked < tile_count
        entries = tl.load(table + picked * WIDE + columns, mask=present & (columns < WIDE), other=0.0)
        totals += tl.where(summed, entries, 0.0)
        low = tl.minimum(low, tl.where(present & (columns == 6), entries, float("inf")))
        high = tl.maximum(high, tl.where(present & ((columns == 7) | (columns == 8)), entries, float("-inf")))
    totals = tl.sum(totals, 0)
    lows = tl.min(low, 0)
    highs = tl.max(high, 0)
    single = tl.arange(0, 16)
    nonzero = tl.sum(tl.where(single == 0, totals, 0.0), 0)
    finite_nonzero = tl.sum(tl.where(single == 1, totals, 0.0), 0)
    s1 = tl.sum(tl.where(single == 2, totals, 0.0), 0)
    s2 = tl.sum(tl.where(single == 3, totals, 0.0), 0)
    s3 = tl.sum(tl.where(single == 4, totals, 0.0), 0)
    s4 = tl.sum(tl.where(single == 5, totals, 0.0), 0)
    outliers = tl.sum(tl.where(single == 9, totals, 0.0), 0)
    beyond = tl.sum(tl.where(single == 10, totals, 0.0), 0)
    shift = tl.load(table + 11)
    offset = s1 / count  # the mean of z, less the shift
    centred_squares = tl.maximum(s2 - count * offset * offset, 0.0)
    centred_fourths = s4 - 4.0 * offset * s3 + 6.0 * offset * offset * s2 - 3.0 * count * offset * offset * offset * offset
    out = rows + segment * ROW
    tl.store(out + 0, nonzero)
    tl.store(out + 1, finite_nonzero)
    tl.store(out + 2, shift + offset)
    tl.store(out + 3, centred_squares / count)
    tl.store(out + 4, tl.min(tl.where(single == 6, lows, float("inf")), 0))
    tl.store(out + 5, tl.max(tl.where(single == 7, highs, float("-inf")), 0))
    if OUTLIERS:
        tl.store(out + 6, tl.max(tl.where(single == 8, highs, float("-inf")), 0))
        tl.store(out + 7, outliers)
        tl.store(out + 8, centred_squares)
        tl.store(out + 9, tl.maximum(centred_fourths, 0.0))
    if UNITS == 1:  # the fraction of channels with no non-zero element
        dead = tl.zeros((1024,), tl.int32)
        for start in range(0, channels, 1024):
            picked = start + tl.arange(0, 1024)
            counts = tl.load(channel_counts + picked, mask=picked < channels, other=1)
            dead += (counts == 0).to(tl.int32)
        tl.store(out + ROW - 1, tl.sum(dead, 0).to(tl.float64) / channels)
    if UNITS == 2:  # the fraction of elements farther than the bound from the centre
        tl.store(out + ROW - 1, beyond / count)
    if STRENGTH:  # each channel's mean |x| over sample 0, after the samples
        for begin in range(0, strength_channels, 1024):
            picked = begin + tl.arange(0, 1024)
            inside = picked < strength_channels
            sums = tl.load(strengths + picked, mask=inside, other=0.0)
            tl.store(rows + strength_start + picked, sums / strength_spatial, mask=inside)


def _guard(device: torch.device) -> contextlib.AbstractContextManager:
    """The tensor's own device for a launch: Triton launches on the current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def summarize_tensors(tensors: list[torch.Tensor], strides: tuple[int, ...], row: int, outlier_threshold: float,
                      outliers: bool = False, units: tuple[float, ...] = (), channels: tuple[int, ...] = ()) -> torch.Tensor:
    """Rows and samples of ``tensors`` (1-D, contiguous, non-empty, one device and dtype), in two launches.

    Returns one float64 tensor: a row of ``row`` numbers per tensor (see :mod:`actviz.summaries.one_pass`),
    then each tensor's sample, ``tensor[::stride]``. Several tensors are read where they are, through a table
    of their addresses: no copy end to end. ``units``, for one tensor: ``(1, channels, spatial, channels_last)``
    for the fraction of channels with no non-zero element (where :func:`~actviz.summaries.one_pass_tables.takes_units`), ``(2, centre, bound)`` for
    the fraction farther than ``bound`` from ``centre``, in the row's last place. ``channels``, for one tensor:
    ``(channels, spatial, channels_last)`` adds each channel's mean ``|x|`` over sample 0 after the samples
    (:func:`~actviz.summaries.one_pass.channel_strength`). The kernels run on the tensors' own device.
    """
    first = tensors[0]
    device = first.device
    listed = len(tensors) > 1
    sizes = tuple(tensor.numel() for tensor in tensors)
    strength_channels, strength_spatial, strength_last = channels if channels else (1, 1, 0)
    kind = int(units[0]) if units else 0
    unit_channels, spatial, row_mode, bins = 1, 1, False, 64
    if kind == 1:  # channels-last: a channel is a run of 1 element, every `channels` elements
        unit_channels, spatial = int(units[1]), 1 if int(units[3]) else int(units[2])
        found = unit_bins(unit_channels, spatial, sizes[0])
        if found is None:
            raise ValueError(f"dead channels of {unit_channels} channels of {spatial} elements need over {MAX_BINS} "
                             "bins a tile; the eager body counts them (see takes_units)")
        bins, row_mode = found
    segments, tiles, total = tables_for(sizes, strides, row, device, (spatial, unit_channels))
    addresses = addresses_of(tensors) if listed else segments  # unread with one tensor
    aligned = listed and all(tensor.data_ptr() % 16 == 0 for tensor in tensors)  # one tensor: the JIT checks it
    tile_count = tiles.numel() // 5
    row_magic, row_shift = divider(spatial)
    wrap = (1 << 30) if row_mode else unit_channels
    wrap_magic, wrap_shift = divider(wrap)
    with _guard(device):
        partials = torch.empty(tile_count * PARTIALS, dtype=torch.float64, device=device)
        out = torch.empty(total + (strength_channels if channels else 0), dtype=torch.float64, device=device)
        strengths = torch.zeros(strength_channels, dtype=torch.float64, device=device) if channels else partials
        counts = torch.zeros(unit_channels, dtype=torch.int32, device=device) if kind == 1 else tiles
        narrow = tl.float64 if first.dtype == torch.float64 else tl.float32
        _tile_partials[(tile_count,)](
            first, addresses, segments, tiles, partials, out, outlier_threshold, counts, unit_channels, spatial,
            row_magic, row_shift, int(row_mode), wrap, wrap_magic, wrap_shift,
            float(units[1]) if kind == 2 else 0.0, float(units[2]) if kind == 2 else 0.0,
            strengths, strength_channels, strength_spatial, len(sizes),
            BLOCK=BLOCK, VECTOR=16 // first.element_size(), LISTED=listed, ALIGNED=aligned, OUTLIERS=outliers, NARROW=narrow, UNITS=kind, BINS=bins,
            WIDE=PARTIALS, STRENGTH=bool(channels), STRENGTH_LAST=bool(strength_last), TILE=TILE,
            STAGES=_STAGES, num_warps=4, maxnreg=128 if bins < 2048 else 192)  # caps ptxas does not spill under
        _combine_tiles[(len(sizes),)](segments, partials, out, counts, unit_channels,
                                      strengths, strength_channels, strength_spatial, total, len(sizes),
                                      ROW=row, OUTLIERS=outliers, UNITS=kind, WIDE=PARTIALS, STRENGTH=bool(channels),
                                      TILES=_TILES_A_TURN, num_warps=4)
    return out
