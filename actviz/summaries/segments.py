"""One reduction of many consecutive segments of a flat tensor: a constant number of ops, no sync.

:func:`reduce_segments` writes one ``(k, len(FIELDS))`` header matrix (:mod:`actviz.summaries.header`)
for ``k`` segments: counts, mean and centred variance of ``z`` (NaN and ±Inf replaced by 0) in the
wide dtype, and exact min and max of the finite values (``+inf``/``-inf`` where there are none).
The sums are one ``torch.segment_reduce`` of four rows end to end and the bounds one each
(``index_add_`` and ``scatter_reduce_`` where a device lacks it), over offsets made once on the
host for each set of sizes. :mod:`actviz.summaries.small_tensors` runs it on a step's small
tensors, on the host or on their device.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

__all__ = ["SEGMENT_REDUCE_DEVICES", "reduce_segments"]

#: Device types with ``torch.segment_reduce``: one reduction per segment there (CUB on CUDA), not atomics per element.
SEGMENT_REDUCE_DEVICES = frozenset({"cpu", "cuda"})

_layouts: dict[tuple[torch.device, torch.dtype, tuple[int, ...]], tuple[torch.Tensor, ...]] = {}
_layouts_changing = threading.Lock()  # the training thread and the writer thread both add layouts


def _layout(sizes: tuple[int, ...], device: torch.device, wide: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Segment ids (one per element), each segment's first position, the segments' offsets, those of the four
    columns' segments end to end, and ``1 / sizes`` on ``device``: made on the host once per set of sizes, as a
    run's steps repeat them."""
    key = (device, wide, sizes)
    found = _layouts.get(key)
    if found is None:
        # NumPy on the host: no aten op, so nothing a device (or an op counter) could mistake for a sync
        segment = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        total = int(offsets[-1])
        columns = np.concatenate([*(offsets[:-1] + column * total for column in range(4)), [4 * total]])
        found = (
            *(torch.from_numpy(array).to(device, non_blocking=True) for array in (segment, offsets[:-1], offsets, columns)),
            torch.from_numpy(1.0 / np.asarray(sizes, dtype=np.float64)).to(device=device, dtype=wide, non_blocking=True),
        )
        with _layouts_changing:
            if len(_layouts) >= 16:  # a run whose sizes change every step: keep the latest few
                del _layouts[next(iter(_layouts))]
            _layouts[key] = found
    return found


def _segment_sums(columns: torch.Tensor, segment: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``(4, k)`` sums of each row of ``columns`` (``(4, n)``, contiguous) over the segments: one op.

    ``offsets`` are those of the four rows' segments end to end (:func:`_layout`); devices without
    ``segment_reduce`` add each element into its segment instead (``index_add``)."""
    if columns.device.type in SEGMENT_REDUCE_DEVICES:
        return torch.segment_reduce(columns.view(-1), "sum", offsets=offsets, unsafe=True).view(4, -1)
    return torch.zeros((4, offsets.numel() // 4), dtype=columns.dtype, device=columns.device).index_add_(1, segment, columns)


def _segment_bound(values: torch.Tensor, segment: torch.Tensor, offsets: torch.Tensor, how: str) -> torch.Tensor:
    """Each segment's ``"min"`` or ``"max"`` of ``values`` (1-D, no NaN): one op."""
    if values.device.type in SEGMENT_REDUCE_DEVICES:
        return torch.segment_reduce(values, how, offsets=offsets, unsafe=True)
    start = torch.full((offsets.numel() - 1,), math.inf if how == "min" else -math.inf, dtype=values.dtype, device=values.device)
    return start.scatter_reduce_(0, segment, values, "a" + how)


def reduce_segments(flat: torch.Tensor, sizes: tuple[int, ...], wide: torch.dtype = torch.float64) -> torch.Tensor:
    """The ``(len(sizes), len(FIELDS))`` header, in ``wide``, of consecutive segments of ``flat`` (a floating 1-D tensor).

    A constant number of ops for any number of segments, none of them syncing. Every size must be > 0.
    Counts and bounds are taken in ``flat``'s own dtype (exact); the moments in ``wide``, about each
    segment's first element of ``z`` in one pass: that element is one of the segment's values, so
    ``(first - mean)**2 <= size * variance`` and the shift costs at most ``size`` ulps of the
    variance, however large the offset. The sums are one ``segment_reduce`` of four rows end to end
    (each segment reduced by one thread block on CUDA, with no atomic per element), the bounds one each.

    Example:
        >>> reduce_segments(torch.tensor([0.0, 2.0, float("nan"), -1.0, 5.0]), (4, 1)).tolist()
        [[3.0, 2.0, 0.25, 1.1875, -1.0, 2.0], [1.0, 1.0, 5.0, 0.0, 5.0, 5.0]]
    """
    segment, starts, offsets, column_offsets, reciprocal = _layout(sizes, flat.device, wide)
    # Few and small temporaries: a step's scratch is these rows, one gather and one filled copy of flat.
    columns = torch.empty((4, flat.numel()), dtype=wide, device=flat.device)  # non-zero, finite non-zero, d, d * d
    torch.ne(flat, 0, out=columns[0])  # NaN and ±Inf count as non-zero
    shifted = columns[2]
    shifted.copy_(flat).nan_to_num_(0.0, 0.0, 0.0)  # z
    torch.ne(shifted, 0, out=columns[1])
    first = shifted.index_select(0, starts)
    shifted.sub_(first.index_select(0, segment))  # d: z less its segment's first
    torch.mul(shifted, shifted, out=columns[3])
    sums = _segment_sums(columns, segment, column_offsets)
    shift = sums[2] * reciprocal  # mean of d
    variance = torch.addcmul(sums[3] * reciprocal, shift, shift, value=-1).clamp_min_(0)
    filled = torch.nan_to_num(flat, math.inf, math.inf, math.inf)  # the finite values, +inf for the others
    low = _segment_bound(filled, segment, offsets, "min")
    torch.nan_to_num(flat, -math.inf, -math.inf, -math.inf, out=filled)  # the same buffer, -inf for the others
    high = _segment_bound(filled, segment, offsets, "max")
    return torch.stack([sums[0], sums[1], first + shift, variance, low.to(wide), high.to(wide)], 1)
