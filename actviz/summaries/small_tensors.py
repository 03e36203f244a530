"""Small tensors of one step, reduced together: many parameters copied end to end, and merged rows.

A tensor no larger than its histogram sample is kept whole as its sample anyway. Many
parameters of a device are copied end to end in one op (:meth:`SmallTensors.add_segments`, from
:func:`~actviz.summaries.many_tensors.reduce_tensors`) instead of being reduced one by one there
(five or more ops, and Python, per tensor). When the step ends, :meth:`SmallTensors.pack` lays
each batch's copies out as one flat tensor: their samples, which go to the host with the step.
The host has every value then, so the writer thread reduces them there
(:meth:`SmallTensors.receive`), off the training thread and with no kernel on the device. Where
the device needs the headers (``merge_ranks`` merges them across ranks, and a layer output's
whole copy joins here, :meth:`SmallTensors.add`), :meth:`SmallTensors.reduce` makes them on the
device instead, in about 23 ops and no sync. (A layer output or gradient copied whole in a hook
is otherwise summarized on the host by itself: :class:`~actviz.summaries.one_tensor.PendingSummary`.)

Either way :func:`~actviz.summaries.segments.reduce_segments` does it: segment sums and bounds (``torch.segment_reduce``;
``index_add_`` and ``scatter_reduce_`` where a device lacks it) over offsets made once for the
step's sizes. It writes one ``(k, len(FIELDS))`` header matrix (:mod:`actviz.summaries.header`):
counts, mean and centred variance of ``z`` (NaN and ±Inf replaced by 0) in float64 (float32 on
an MPS device), and exact min and max of the finite values (``+inf``/``-inf`` where there are
none). Each tensor's sample is its slice of the ``cat``.

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
from collections.abc import Sequence

import torch

from ..common._internals import flatten_copy
from .header import Reduction, wide_dtype
from .segments import reduce_segments

__all__ = ["CHUNK", "SMALL_MAX", "SmallTensors"]

#: Most elements of a tensor batched here (with ``sample_size=None`` every tensor would be "small").
SMALL_MAX = 1 << 16
#: Most elements reduced together: the reduction's scratch (about 64 bytes an element) stays under 64 MB.
CHUNK = 1 << 20

class _Batch:
    """One device's copies (at most :data:`CHUNK` elements) and their sizes, then their sample and header."""

    __slots__ = ("copies", "header", "reductions", "sample", "sizes", "starts", "stop")

    def __init__(self) -> None:
        self.copies: list[torch.Tensor] = []
        self.reductions: list[Reduction] = []  # the ones made at once (SmallTensors.add): completed with the batch
        self.sizes: list[int] = []
        self.starts: list[int] = []  # each size's start in the sample: laid out by pack
        self.stop = 0
        self.header: torch.Tensor | None = None  # (len(sizes), len(FIELDS)): made on the device (reduce) or the host (receive)
        self.sample: torch.Tensor | None = None  # every copy end to end, once packed

    def pack(self) -> None:
        """Copy the copies end to end into one flat tensor: their samples, and all the host needs to reduce them."""
        self.sample, self.copies = flatten_copy(self.copies), []  # mixed dtypes promote
        self.starts = [0, *itertools.accumulate(self.sizes)]
        for reduction in self.reductions:
            reduction.sample = self.sample

    def reduce(self) -> None:
        """:meth:`pack`, then the header on the sample's device."""
        self.pack()
        assert self.sample is not None
        with torch.no_grad():
            self.header = reduce_segments(self.sample, tuple(self.sizes), wide_dtype(self.sample.device))
        for reduction in self.reductions:
            reduction.header = self.header

    def receive(self, host: dict[int, torch.Tensor]) -> None:
        """Take the host copies of the sample and header; a batch only packed gets its header now, on the host."""
        self.sample = host.get(id(self.sample), self.sample)
        if self.header is None and self.sample is not None:
            self.header = reduce_segments(self.sample, tuple(self.sizes), wide_dtype(self.sample.device))
        else:
            self.header = host.get(id(self.header), self.header)
        for reduction in self.reductions:
            reduction.header, reduction.sample = self.header, self.sample

    def reduction(self, index: int) -> Reduction:
        start, stop = self.starts[index], self.starts[index + 1]
        return Reduction(stop - start, 1, self.header, index, self.sample, start, stop)


class SmallTensors:
    """One step's small floating tensors, per device, until they are reduced all together: on their device
    (:meth:`reduce`), or on the host once packed and received (:meth:`pack`, :meth:`receive`), as a watcher's step does.

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

    def takes(self, values: torch.Tensor) -> bool:
        """Whether ``values`` (its sample whole) is batched: a floating tensor not on the CPU shortcut."""
        return values.numel() <= SMALL_MAX and values.is_floating_point() and not (self._cpu_shortcut and values.is_cpu)

    def joins(self, values: torch.Tensor) -> bool:
        """Whether ``values`` can be added to an open batch of its device at no cost: :meth:`takes` it, and the batch
        holds copies of its dtype already (a cat over one more input is the same op; another dtype would promote)."""
        batch = self._batches.get(values.device)
        return self.takes(values) and batch is not None and bool(batch.copies) and batch.copies[0].dtype == values.dtype

    def add_copy(self, copy: torch.Tensor) -> int:
        """Keep ``copy``, a contiguous floating tensor of at most :data:`SMALL_MAX` elements that nothing else
        changes. Its row, completed when reduced."""
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
        """Keep a copy of ``values`` (floating, any shape; ``values`` itself if ``copied``: a contiguous copy nothing
        else changes), made now, and its :class:`Reduction` at once, completed when reduced (:meth:`completed`)."""
        return self.completed(self.add_copy(values if copied else values.clone(memory_format=torch.contiguous_format)))

    def completed(self, row: int) -> Reduction:
        """A :class:`Reduction` of ``row`` made now, completed when its batch is reduced (:meth:`reduce`, :meth:`receive`)."""
        batch, index = self._row_batch[row], self._row_index[row]
        start = batch.stop - batch.sizes[index] if index == len(batch.sizes) - 1 else sum(batch.sizes[:index])
        reduction = Reduction(batch.sizes[index], 1, None, index, None, start, start + batch.sizes[index])
        batch.reductions.append(reduction)
        return reduction

    def add_segments(self, flat: torch.Tensor, sizes: Sequence[int]) -> list[int]:
        """Keep ``flat``, a new 1-D floating copy of many tensors end to end (``sizes`` elements each, every one > 0):
        one row per tensor, completed when reduced. Many parameters take one copy this way.

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

    def pack(self) -> None:
        """Pack the tensors added since the last call, per device (and :data:`CHUNK`) in one ``cat``, for the host
        to reduce once they arrive (:meth:`receive`): their copy goes to the host anyway, as their samples."""
        for batch in self._open_batches():
            batch.pack()

    def reduce(self) -> None:
        """Reduce the tensors added since the last call on their device: per device (and :data:`CHUNK`) one ``cat``
        and :func:`~actviz.summaries.segments.reduce_segments`. For headers the device needs (``merge_ranks``), and outside a watcher's step."""
        for batch in self._open_batches():
            batch.reduce()

    def _open_batches(self) -> list[_Batch]:
        """The batches added to since the last :meth:`pack` or :meth:`reduce`, from now on counted as done."""
        batches = [*self._full, *self._batches.values()]
        self._batches, self._full = {}, []
        self._reduced.extend(batches)
        return batches

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
        """Replace the batches' tensors by their host copies, found by ``id`` of the device tensor; a batch
        only packed (:meth:`pack`) is reduced there, by :func:`~actviz.summaries.segments.reduce_segments` on the CPU in float64."""
        for batch in self._reduced:
            batch.receive(host)
