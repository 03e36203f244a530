"""Small tensors of one step reduced together: one copy each in its hook, a constant number of ops at the step's end.

A tensor no larger than its histogram sample is kept whole as its sample anyway. On the
accelerator path its hook makes one copy of it (:meth:`SmallTensors.add`, one op) instead of
reducing it there (five or more ops, and Python, per tensor: a micro ResNet-50 has over 200
such tensors per logging step). When the step ends, :meth:`SmallTensors.reduce` reduces every
copy of a device in about 23 ops, whatever their number: one ``cat``, then segment sums and
bounds (``torch.segment_reduce``; ``index_add_`` and ``scatter_reduce_`` where a device lacks it)
over offsets made once on the host for the step's sizes. It writes one ``(k, len(FIELDS))`` header matrix
(:mod:`actviz.summaries.header`): counts, mean and centred variance of ``z`` (NaN and ±Inf
replaced by 0) in float64 (float32 on MPS), and exact min and max of the finite values
(``+inf``/``-inf`` where there are none). Each tensor's sample is its slice of the ``cat``.
Nothing is read on the host: no sync.

Example:
    >>> from actviz.summaries.one_tensor import finish
    >>> small = SmallTensors(cpu_shortcut=False)
    >>> first, second = small.add(torch.tensor([1.0, float("nan"), 3.0])), small.add(torch.tensor([-2.0, 0.0]))
    >>> small.reduce()
    >>> summary = finish(first)
    >>> summary.nonfinite, summary.min, summary.max, summary.sum
    (1, 1.0, 3.0, 4.0)
    >>> finish(second).zeros, finish(second).min
    (1, -2.0)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from .._internals import flatten_copy
from .header import Reduction, wide_dtype

__all__ = ["CHUNK", "SEGMENT_REDUCE_DEVICES", "SMALL_MAX", "SmallTensors", "reduce_segments"]

#: Most elements of a tensor batched here (with ``sample_size=None`` every tensor would be "small").
SMALL_MAX = 1 << 16
#: Most elements reduced together: the reduction's scratch (about 64 bytes an element) stays under 64 MB.
CHUNK = 1 << 20

#: Device types with ``torch.segment_reduce``: one reduction per segment there (CUB on CUDA), not atomics per element.
SEGMENT_REDUCE_DEVICES = frozenset({"cpu", "cuda"})

_layouts: dict[tuple[torch.device, torch.dtype, tuple[int, ...]], tuple[torch.Tensor, ...]] = {}


def _layout(sizes: tuple[int, ...], device: torch.device, wide: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Segment ids (one per element), each segment's first position, the segments' offsets, those of the four
    columns' segments end to end, and ``1 / sizes`` on ``device``: made on the host once per set of sizes, as a
    run's steps repeat them."""
    key = (device, wide, sizes)
    found = _layouts.get(key)
    if found is None:
        if len(_layouts) > 16:  # a run whose sizes change every step: keep a few
            _layouts.clear()
        # NumPy on the host: no aten op, so nothing a device (or an op counter) could mistake for a sync
        segment = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        total = int(offsets[-1])
        columns = np.concatenate([*(offsets[:-1] + column * total for column in range(4)), [4 * total]])
        found = _layouts[key] = (
            *(torch.from_numpy(array).to(device, non_blocking=True) for array in (segment, offsets[:-1], offsets, columns)),
            torch.from_numpy(1.0 / np.asarray(sizes, dtype=np.float64)).to(device=device, dtype=wide, non_blocking=True),
        )
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


class _Batch:
    """One device's copies (at most :data:`CHUNK` elements) and their sizes, then their header and sample."""

    __slots__ = ("copies", "header", "reductions", "sample", "sizes", "starts", "stop")

    def __init__(self) -> None:
        self.copies: list[torch.Tensor] = []
        self.reductions: list[Reduction] = []  # the ones made at once (SmallTensors.add): completed by reduce
        self.sizes: list[int] = []
        self.starts: list[int] = []  # each size's start in the sample: laid out by reduce
        self.stop = 0
        self.header: torch.Tensor | None = None  # (len(sizes), len(FIELDS)), once reduced
        self.sample: torch.Tensor | None = None  # every copy end to end, once reduced

    def reduce(self) -> None:
        flat = flatten_copy(self.copies)  # one copy of them all, their sample; mixed dtypes promote
        with torch.no_grad():
            self.header = reduce_segments(flat, tuple(self.sizes), wide_dtype(flat.device))
        self.sample, self.copies = flat, []
        self.starts = [0, *itertools.accumulate(self.sizes)]
        for reduction in self.reductions:
            reduction.header, reduction.sample = self.header, flat

    def reduction(self, index: int) -> Reduction:
        start, stop = self.starts[index], self.starts[index + 1]
        return Reduction(stop - start, 1, self.header, index, self.sample, start, stop)


class SmallTensors:
    """One step's small floating tensors, per device, until :meth:`reduce` reduces them all together.

    A tensor added is a *row*, an ``int``: :meth:`reduction` makes its
    :class:`~actviz.summaries.header.Reduction` when it is wanted, on the writer thread (no
    object per tensor on the training thread); :meth:`add` makes it at once.

    Args:
        cpu_shortcut: CPU tensors take the CPU shortcut instead (``ACTVIZ_CPU_SHORTCUTS``, read once per step).
    """

    __slots__ = ("_batches", "_cpu_shortcut", "_full", "_reduced", "_row_batch", "_row_index")

    def __init__(self, cpu_shortcut: bool) -> None:
        self._cpu_shortcut = cpu_shortcut
        self._batches: dict[torch.device, _Batch] = {}
        self._full: list[_Batch] = []  # batches that reached CHUNK elements: the reduction's memory stays bounded
        self._reduced: list[_Batch] = []
        self._row_batch: list[_Batch] = []  # per row: its batch and its index there (ints: nothing to collect)
        self._row_index: list[int] = []

    def whole_copy(self, tensor: torch.Tensor, sample_size: int | None) -> torch.Tensor | None:
        """A contiguous copy, off autograd's tape, of a plain floating tensor (no DTensor, nested or subclass)
        that its sample covers whole and that :meth:`takes`, for :meth:`add_copy`; ``None`` if ``tensor`` is not one.

        The fast path of a layer output or its gradient: a few attribute reads, then one copy.
        """
        numel = tensor.numel()  # one call, takes(), for what the parameters' plan asks too: the two never differ
        if (type(tensor) is not torch.Tensor or numel == 0 or (sample_size is not None and numel > sample_size)
                or not self.takes(tensor)):
            return None
        return (tensor.detach() if tensor.requires_grad else tensor).clone(memory_format=torch.contiguous_format)

    def takes(self, values: torch.Tensor) -> bool:
        """Whether ``values`` (its sample whole) is batched: a floating tensor not on the CPU shortcut."""
        return values.numel() <= SMALL_MAX and values.is_floating_point() and not (self._cpu_shortcut and values.is_cpu)

    def add_row(self, values: torch.Tensor) -> int:
        """Keep a copy of ``values`` (floating, any shape), made now: a later in-place op cannot change it.
        Its row, completed by :meth:`reduce`."""
        return self.add_copy(values.clone(memory_format=torch.contiguous_format))

    def add_copy(self, copy: torch.Tensor) -> int:
        """Keep ``copy``, a contiguous floating tensor of at most :data:`SMALL_MAX` elements that nothing else
        changes (:meth:`whole_copy`). Its row, completed by :meth:`reduce`."""
        numel = copy.numel()
        batch = self._batches.get(copy.device)
        if batch is None or batch.stop + numel > CHUNK:  # the first of its device, or the open batch is full
            batch = self._batch_for(copy.device, numel)
        batch.copies.append(copy)
        self._row_index.append(len(batch.sizes))
        self._row_batch.append(batch)
        batch.sizes.append(numel)
        batch.stop += numel
        return len(self._row_index) - 1

    def add(self, values: torch.Tensor, copied: bool = False) -> Reduction:
        """:meth:`add_row` (:meth:`add_copy` if ``copied``, from :meth:`whole_copy`), and its :class:`Reduction` at once,
        completed by :meth:`reduce`."""
        row = self.add_copy(values) if copied else self.add_row(values)
        batch, index = self._row_batch[row], self._row_index[row]
        reduction = Reduction(batch.sizes[index], 1, None, index, None, batch.stop - batch.sizes[index], batch.stop)
        batch.reductions.append(reduction)
        return reduction

    def add_segments(self, flat: torch.Tensor, sizes: Sequence[int]) -> list[int]:
        """Keep ``flat``, a new 1-D floating copy of many tensors end to end (``sizes`` elements each, every one > 0):
        one row per tensor, completed by :meth:`reduce`. Many parameters take one copy this way.

        Example:
            >>> from actviz.summaries.one_tensor import finish
            >>> small = SmallTensors(cpu_shortcut=False)
            >>> first, second = small.add_segments(torch.tensor([1.0, 2.0, -4.0]), (2, 1))
            >>> small.reduce()
            >>> finish(small.reduction(first)).sum, finish(small.reduction(second)).min
            (3.0, -4.0)
        """
        rows: list[int] = []
        start = offset = 0
        while start < len(sizes):  # pieces of at most CHUNK elements, or one tensor
            stop, total = start + 1, sizes[start]
            while stop < len(sizes) and total + sizes[stop] <= CHUNK:
                total += sizes[stop]
                stop += 1
            batch = self._batch_for(flat.device, total)
            first, count = len(self._row_index), len(batch.sizes)
            self._row_index.extend(range(count, count + stop - start))
            self._row_batch.extend([batch] * (stop - start))
            batch.sizes.extend(sizes[start:stop])
            batch.stop += total
            rows.extend(range(first, len(self._row_index)))
            batch.copies.append(flat.narrow(0, offset, total) if total < flat.numel() else flat)
            start, offset = stop, offset + total
        return rows

    def _batch_for(self, device: torch.device, numel: int) -> _Batch:
        """The device's open batch, or a new one if ``numel`` more elements would pass :data:`CHUNK`."""
        batch = self._batches.get(device)
        if batch is None or (batch.stop and batch.stop + numel > CHUNK):
            if batch is not None:
                self._full.append(batch)
            batch = self._batches[device] = _Batch()
        return batch

    def reduce(self) -> None:
        """Reduce every tensor added since the last call: per device (and :data:`CHUNK`) one ``cat`` and
        :func:`reduce_segments`."""
        batches = [*self._full, *self._batches.values()]
        self._batches, self._full = {}, []
        for batch in batches:
            batch.reduce()
        self._reduced.extend(batches)

    def reduction(self, row: int) -> Reduction:
        """The :class:`Reduction` of ``row``: complete once reduced (on the host after :meth:`receive`)."""
        return self._row_batch[row].reduction(self._row_index[row])

    def row_sample(self, row: int) -> torch.Tensor:
        """The copy of ``row``, flat: its slice of its batch's sample, once reduced (on the host after :meth:`receive`)."""
        reduction = self.reduction(row)  # its slice, where its summary says (on the writer thread: one object is fine)
        return reduction.sample[reduction.start : reduction.stop]

    def device_tensors(self) -> list[torch.Tensor]:
        """Every reduced batch's header and sample: what goes to the host for the rows."""
        return [tensor for batch in self._reduced for tensor in (batch.header, batch.sample) if tensor is not None]

    def receive(self, host: dict[int, torch.Tensor]) -> None:
        """Replace the reduced batches' tensors by their host copies, found by ``id`` of the device tensor."""
        for batch in self._reduced:
            batch.header, batch.sample = host.get(id(batch.header), batch.header), host.get(id(batch.sample), batch.sample)
