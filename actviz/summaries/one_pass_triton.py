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
  works out (:func:`_divider`), never a 64-bit division.
* **Loads.** Whole turns of :data:`BLOCK` elements are read unmasked from a 16-byte aligned address (the last,
  partial turn masked), so that each thread reads 16 bytes at a time, through a 3-stage ``cp.async`` pipeline.
* **Counts.** Five per-lane counts share one int32 (6 bits each: at most 32 turns a tile).
* **Atomics.** None in the main loop. A channel with a non-zero element gets a plain store of 1 (every writer
  writes the same 1); channel strengths are summed per block in registers, one relaxed float64 atomic per
  channel and tile.

Two launches per call, whatever the tensors' number and size; no host sync, and nothing a captured CUDA graph
would read after it is gone. Triton compiles them for CUDA; with ``TRITON_INTERPRET=1`` in the environment
before this module is imported, Triton runs them on CPU tensors, which is how the test suite checks their
numbers against float64 on a machine without a GPU.

Example:
    The tables of two parameters of 40,000 and 10 elements, sampled at strides 3 and 1: two tiles of the
    first, one of the second; each segment's size, sample stride and sample start, then each one's first tile:

    >>> segments, tiles, total = _tables_for((40_000, 10), (3, 1), 6, torch.device("cpu"))
    >>> tiles.tolist(), segments.tolist(), total
    ([0, 0, 1], [40000, 3, 12, 10, 1, 13346, 0, 2, 3], 13356)
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "MAX_BINS", "PARTIALS", "TILE", "summarize_tensors", "takes_units"]

#: Elements one program reads per loop turn: with 4 warps, 8 a thread (16 bytes of bfloat16, two loads of float32).
BLOCK = 1024
#: Elements of one tile: one program's share of a tensor (at most 32 turns: the packed counts' 6 bits each).
TILE = 32 * BLOCK
#: Numbers a tile leaves: nonzero, finite nonzero, Σy, Σy², Σy³, Σy⁴ (y = z - shift), min, max, max|x|, outliers,
#: the count beyond a unit bound (saturation), and the tensor's shift. The kernels get it as their constant ``WIDE`` (a kernel reads
#: no module global but a ``tl.constexpr``).
PARTIALS = 12
#: The most histogram bins a tile counts its channels in (16 KiB of shared memory, 32 registers a thread); a
#: layout that needs more (over 4,096 channels and under 9 elements a channel) takes the eager body.
MAX_BINS = 4096
_TILES_A_TURN = 64  # tiles the combine adds per turn
_STAGES = 3  # turns in flight in the main loop (cp.async on sm_80 and later)


def _divider(divisor: int) -> tuple[int, int]:
    """``(magic, shift)`` with ``n // divisor == umulhi(2 * n, magic) >> shift`` for ``0 <= n < 2**31``: a magic
    under ``2**32`` (Granlund and Montgomery, 1994, theorem 4.2, with 31-bit numerators), handed to the kernel as
    the int32 of its bits, so that every divisor compiles to the same variant.

    Example:
        >>> magic, shift = _divider(49)
        >>> all(((2 * n * (magic % 2**32)) >> 32) >> shift == n // 49 for n in (0, 48, 49, 2**31 - 1))
        True
    """
    shift = (divisor - 1).bit_length()  # ceil(log2 divisor)
    magic = (1 << (31 + shift)) // divisor + 1
    return magic - (1 << 32) if magic >= 1 << 31 else magic, shift


@triton.jit
def _quotient(n, magic, shift):
    """``n // divisor`` of int32 ``n`` in ``[0, 2**31)`` by :func:`_divider`'s numbers: two integer instructions."""
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
          packed, s1, s2, s3, s4, low, high, alive,
          first_row, row_magic, row_shift, bin_base, wrap, wrap_magic, wrap_shift,
          BLOCK: tl.constexpr, MASKED: tl.constexpr, OUTLIERS: tl.constexpr, NARROW: tl.constexpr,
          UNITS: tl.constexpr, BINS: tl.constexpr):
    """One turn of :data:`BLOCK` elements from ``offset`` (32-bit, within the tile) into the accumulators."""
    lanes = offset + tl.arange(0, BLOCK)
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
    s1 += y
    s2 += squared
    low = tl.minimum(low, tl.where(finite, x, float("inf")))
    high = tl.maximum(high, tl.where(finite, x, float("-inf")))
    # Five counts in one int32, 6 bits each: nonzero (NaN != 0), finite nonzero, outliers, infinities, saturated.
    counts = (x != 0.0).to(tl.int32) + ((z != 0.0).to(tl.int32) << 6)
    if OUTLIERS:
        s3 += squared * y
        s4 += squared * squared
        counts += ((magnitude >= outlier_threshold).to(tl.int32) << 12) + ((magnitude == float("inf")).to(tl.int32) << 18)
    if UNITS == 2:
        far = tl.abs(x - centre) > bound
        if MASKED:
            far = far & inside
        counts += far.to(tl.int32) << 24
    packed += counts
    if UNITS == 1:  # the element's channel: (its row of `spatial` elements, from the tile's first) mod channels
        row = _quotient(first_row + lanes, row_magic, row_shift)
        spot = bin_base + row
        spot = spot - _quotient(spot, wrap_magic, wrap_shift) * wrap
        live = x != 0.0  # NaN != 0: alive
        if MASKED:
            live = live & inside
        alive += tl.histogram(spot, BINS, mask=live)
    return packed, s1, s2, s3, s4, low, high, alive


@triton.jit(do_not_specialize=["outlier_threshold", "channels", "spatial", "row_magic", "row_shift", "row_mode", "wrap",
                               "wrap_magic", "wrap_shift", "centre", "bound", "strength_channels", "strength_spatial",
                               "segment_count"])
def _tile_partials(values, addresses, segments, tiles, partials, sample, outlier_threshold,
                   channel_counts, channels, spatial, row_magic, row_shift, row_mode, wrap, wrap_magic, wrap_shift,
                   centre, bound, strengths, strength_channels, strength_spatial, segment_count,
                   BLOCK: tl.constexpr, LISTED: tl.constexpr, ALIGNED: tl.constexpr, OUTLIERS: tl.constexpr,
                   NARROW: tl.constexpr, UNITS: tl.constexpr, BINS: tl.constexpr, WIDE: tl.constexpr,
                   STRENGTH: tl.constexpr, STRENGTH_LAST: tl.constexpr, TILE: tl.constexpr,
                   STAGES: tl.constexpr):
    tile = tl.program_id(0)
    segment = tl.load(tiles + tile)
    size = tl.load(segments + segment * 3)
    stride = tl.load(segments + segment * 3 + 1)
    sample_start = tl.load(segments + segment * 3 + 2)
    first_tile = tl.load(segments + segment_count * 3 + segment)
    tile_start = (tile - first_tile).to(tl.int64) * TILE  # int64 once; every offset below is 32-bit
    length = tl.minimum(size - tile_start, TILE).to(tl.int32)
    base = _segment_base(values, addresses, segment, LISTED, ALIGNED)
    tile_base = base + tile_start
    head = tl.load(base).to(tl.float64)
    shift = tl.where(tl.abs(head) < float("inf"), head, 0.0)
    packed = tl.zeros((BLOCK,), tl.int32)
    s1 = tl.zeros((BLOCK,), tl.float64)
    s2 = tl.zeros((BLOCK,), tl.float64)
    s3 = tl.zeros((BLOCK,), tl.float64)
    s4 = tl.zeros((BLOCK,), tl.float64)
    low = tl.full((BLOCK,), float("inf"), NARROW)
    high = tl.full((BLOCK,), float("-inf"), NARROW)
    alive = tl.zeros((BINS,), tl.int32)  # UNITS == 1: non-zero elements per bin (a channel, or a row of the tile)
    # UNITS == 1: element i of the tile lies in row (first_row + i) // spatial counted from the tile's first row
    # (tile_row); its bin is (bin_base + that) mod wrap: its channel (wrap = channels), or, in row_mode, where a
    # tile spans fewer rows than there are channels, the row itself (the host passes a wrap past any row).
    first_row = 0
    bin_base = 0
    channel_first = 0
    if UNITS == 1:
        tile_row = tile_start // spatial
        first_row = (tile_start - tile_row * spatial).to(tl.int32)
        channel_first = (tile_row % channels).to(tl.int32)
        bin_base = tl.where(row_mode != 0, 0, channel_first)
    whole = length // BLOCK * BLOCK
    for offset in tl.range(0, whole, BLOCK, num_stages=STAGES):
        packed, s1, s2, s3, s4, low, high, alive = _turn(
            tile_base, offset, length, shift, outlier_threshold, centre, bound, packed, s1, s2, s3, s4, low, high, alive,
            first_row, row_magic, row_shift, bin_base, wrap, wrap_magic, wrap_shift,
            BLOCK, False, OUTLIERS, NARROW, UNITS, BINS)
    if whole < length:
        packed, s1, s2, s3, s4, low, high, alive = _turn(
            tile_base, whole, length, shift, outlier_threshold, centre, bound, packed, s1, s2, s3, s4, low, high, alive,
            first_row, row_magic, row_shift, bin_base, wrap, wrap_magic, wrap_shift,
            BLOCK, True, OUTLIERS, NARROW, UNITS, BINS)
    # The sample: the tile's elements at positions k * stride, 32-bit offsets from the first of them.
    first_taken = (tile_start + stride - 1) // stride
    lead = (first_taken * stride - tile_start).to(tl.int32)
    taken = tl.where(lead < length, (length - 1 - lead) // stride.to(tl.int32) + 1, 0)
    sample_base = sample + sample_start + first_taken
    for begin in range(0, taken, BLOCK):
        picks = begin + tl.arange(0, BLOCK)
        chosen = picks < taken
        raw = tl.load(tile_base + lead + picks * stride.to(tl.int32), mask=chosen)
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
    tl.store(row + 0, tl.sum(packed & 63, 0).to(tl.float64))
    tl.store(row + 1, tl.sum((packed >> 6) & 63, 0).to(tl.float64))
    tl.store(row + 2, tl.sum(s1, 0))
    tl.store(row + 3, tl.sum(s2, 0))
    tl.store(row + 4, tl.sum(s3, 0))
    tl.store(row + 5, tl.sum(s4, 0))
    lowest = tl.min(low, 0).to(tl.float64)
    highest = tl.max(high, 0).to(tl.float64)
    tl.store(row + 6, lowest)
    tl.store(row + 7, highest)
    infinities = tl.sum((packed >> 18) & 63, 0)
    largest = tl.maximum(tl.maximum(-lowest, highest), 0.0)  # max |x| of the finite elements (0 if none)
    tl.store(row + 8, tl.where(infinities > 0, float("inf"), largest))
    tl.store(row + 9, tl.sum((packed >> 12) & 63, 0).to(tl.float64))
    tl.store(row + 10, tl.sum((packed >> 24) & 63, 0).to(tl.float64))
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
        if LAST:  # (positions, channels) in memory: blocks of 16 positions by 64 channels
            row_first = lead // width
            row_stop = (lead + stop - 1) // width + 1
            for column in range(0, width, 64):
                picked = column + tl.arange(0, 64)
                sums = tl.zeros((16, 64), tl.float64)
                for block_row in range(row_first, row_stop, 16):
                    rows = block_row + tl.arange(0, 16)
                    at = rows[:, None] * width + picked[None, :] - lead
                    inside = (at >= 0) & (at < stop) & (picked[None, :] < width)
                    x = tl.abs(tl.load(tile_base + at, mask=inside, other=0.0).to(tl.float32))
                    sums += tl.where(x < float("inf"), x, 0.0).to(tl.float64)
                tl.atomic_add(strengths + picked, tl.sum(sums, 0), mask=picked < width, sem="relaxed")
        else:  # (channels, positions) in memory: blocks of 16 channels by 64 positions
            channel_first = lead // span
            channel_stop = (lead + stop - 1) // span + 1
            for block_channel in range(channel_first, channel_stop, 16):
                picked = block_channel + tl.arange(0, 16)
                sums = tl.zeros((16, 64), tl.float64)
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


_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}
_addresses_kept: dict[tuple, torch.Tensor] = {}
_captured: list[torch.Tensor] = []  # host tables a captured CUDA graph copies from: kept for the process's life


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, without a host sync on CUDA: from pinned memory, asynchronously. While a CUDA graph
    is being captured the graph will replay that copy, so its pinned source is kept for good."""
    if device.type != "cuda":
        return host.to(device)
    pinned = host.pin_memory()
    if torch.cuda.is_current_stream_capturing():
        _captured.append(pinned)
    return pinned.to(device, non_blocking=True)


def _tables_for(sizes: tuple[int, ...], strides: tuple[int, ...], row: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The segment table (each segment's size, sample stride and sample start, then each segment's first tile,
    and the tile count) and the tile table (each tile's segment), on ``device``, made once per set of sizes: a
    model's tensors have the same sizes every step. Each segment starts at element 0 of its own tensor."""
    key = (sizes, strides, row, device)
    found = _tables.get(key)
    if found is None:
        if len(_tables) > 256:  # ever new sizes: keep a few
            _tables.clear()
        segment_rows, tile_segments, first_tiles = [], [], [0]
        sample_start = len(sizes) * row
        for segment, (size, stride) in enumerate(zip(sizes, strides)):
            segment_rows += [size, stride, sample_start]
            tile_segments += [segment] * -(-size // TILE)
            first_tiles.append(len(tile_segments))
            sample_start += -(-size // stride)
        segments = torch.tensor(segment_rows + first_tiles, dtype=torch.int64)
        tiles = torch.tensor(tile_segments, dtype=torch.int32)
        found = _tables[key] = (_on_device(segments, device), _on_device(tiles, device), sample_start)
    return found


def _addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
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
    return found


def takes_units(units: tuple[float, ...], size: int) -> bool:
    """Whether the kernels count ``units`` (see :func:`summarize_tensors`) of a tensor of ``size`` elements: a
    saturation count always; dead channels where a tile's channels fit :data:`MAX_BINS` histogram bins.

    Example:
        >>> takes_units((1, 256, 3136, 0), 16 * 256 * 3136), takes_units((1, 40_000, 1, 0), 40_000)
        (True, False)
    """
    if not units or int(units[0]) != 1:
        return True
    return _unit_bins(int(units[1]), int(units[2]), size) is not None


def _unit_bins(channels: int, spatial: int, size: int) -> tuple[int, bool] | None:
    """``(bins, row_mode)`` for dead channels: a bin per channel, or, with fewer bins, one per row of ``spatial``
    elements that a tile spans (row mode); ``None`` where neither fits :data:`MAX_BINS` or 32-bit offsets."""
    if spatial >= 2**30 or channels >= 2**30 or size >= 2**62:
        return None
    rows = (TILE - 1) // spatial + 2  # the most rows one tile touches
    by_channel, by_row = triton.next_power_of_2(channels), triton.next_power_of_2(rows)
    bins, row_mode = (by_row, True) if by_row < by_channel else (by_channel, False)
    return (max(bins, 64), row_mode) if bins <= MAX_BINS else None  # 64 at least: fewer variants to compile


def _guard(device: torch.device) -> contextlib.AbstractContextManager:
    """The tensor's own device for a launch: Triton launches on the current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def summarize_tensors(tensors: list[torch.Tensor], strides: tuple[int, ...], row: int, outlier_threshold: float,
                      outliers: bool = False, units: tuple[float, ...] = (), channels: tuple[int, ...] = ()) -> torch.Tensor:
    """Rows and samples of ``tensors`` (1-D, contiguous, non-empty, one device and dtype), in two launches.

    Returns one float64 tensor: a row of ``row`` numbers per tensor (see :mod:`actviz.summaries.one_pass`),
    then each tensor's sample, ``tensor[::stride]``. Several tensors are read where they are, through a table
    of their addresses: no copy end to end. ``units``, for one tensor: ``(1, channels, spatial, channels_last)``
    for the fraction of channels with no non-zero element (where :func:`takes_units`), ``(2, centre, bound)`` for
    the fraction farther than ``bound`` from ``centre``, in the row's last place. ``channels``, for one tensor:
    ``(channels, spatial, channels_last)`` adds each channel's mean ``|x|`` over sample 0 after the samples
    (:func:`~actviz.summaries.one_pass.channel_strength`). The kernels run on the tensors' own device.
    """
    first = tensors[0]
    device = first.device
    listed = len(tensors) > 1
    sizes = tuple(tensor.numel() for tensor in tensors)
    segments, tiles, total = _tables_for(sizes, strides, row, device)
    addresses = _addresses(tensors) if listed else segments  # unread with one tensor
    aligned = all(tensor.data_ptr() % 16 == 0 for tensor in tensors)
    tile_count = tiles.numel()
    strength_channels, strength_spatial, strength_last = channels if channels else (1, 1, 0)
    kind = int(units[0]) if units else 0
    unit_channels, spatial, row_mode, bins = 1, 1, False, 64
    if kind == 1:  # channels-last: a channel is a run of 1 element, every `channels` elements
        unit_channels, spatial = int(units[1]), 1 if int(units[3]) else int(units[2])
        found = _unit_bins(unit_channels, spatial, sizes[0])
        if found is None:
            raise ValueError(f"dead channels of {unit_channels} channels of {spatial} elements need over {MAX_BINS} "
                             "bins a tile; the eager body counts them (see takes_units)")
        bins, row_mode = found
    row_magic, row_shift = _divider(spatial)
    wrap = (1 << 30) if row_mode else unit_channels
    wrap_magic, wrap_shift = _divider(wrap)
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
            BLOCK=BLOCK, LISTED=listed, ALIGNED=aligned, OUTLIERS=outliers, NARROW=narrow, UNITS=kind, BINS=bins,
            WIDE=PARTIALS, STRENGTH=bool(channels), STRENGTH_LAST=bool(strength_last), TILE=TILE,
            STAGES=_STAGES, num_warps=4)
        _combine_tiles[(len(sizes),)](segments, partials, out, counts, unit_channels,
                                      strengths, strength_channels, strength_spatial, total, len(sizes),
                                      ROW=row, OUTLIERS=outliers, UNITS=kind, WIDE=PARTIALS, STRENGTH=bool(channels),
                                      TILES=_TILES_A_TURN, num_warps=4)
    return out
