"""Many tensors reduced together: parameters and their gradients in a fixed number of ops.

A ResNet-50 has 161 parameters. Reducing each on its own (:func:`~actviz.summaries.one_tensor.reduce_tensor`)
would dispatch eight ops per parameter; here the small ones (the sample covers them whole:
biases, norms, small convolutions) share the segment reduction of :mod:`actviz.summaries.small_tensors`,
about 25 ops per million elements, and the larger floating tensors of one device and dtype share
about twenty ops per 128 MB, whatever their count: one copy into a flat buffer, then ``_foreach``
reductions over views of it (on a CPU, one op per tensor each). The results are the same :class:`~actviz.summaries.header.Reduction`
objects, finished on the host by :func:`~actviz.summaries.one_tensor.finish`.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..common import distributed_types
from ..common._internals import flatten_copy
from ..options import DEFAULT_SAMPLE_SIZE, cpu_shortcuts
from .header import Reduction
from .one_tensor import flat_view, local_shard, reduce_tensor, sample_stride, wide_dtype
from .small_tensors import SmallTensors

__all__ = ["CHUNK_BYTES", "reduce_tensors"]

#: Most bytes one flat buffer holds; reducing a chunk needs one such buffer.
CHUNK_BYTES = 128 << 20


def reduce_tensors(
    tensors: Sequence[torch.Tensor], sample_size: int | None = DEFAULT_SAMPLE_SIZE,
    owners: Sequence[torch.Tensor] | None = None, small: SmallTensors | None = None,
) -> list[Reduction | int]:
    """:func:`reduce_tensor` of many tensors, in a number of ops that does not grow with their count.

    Floating tensors of one device its sample covers whole (biases, norms, small convolutions)
    are copied end to end in one op and share the segment reduction of
    :mod:`actviz.summaries.small_tensors`. Larger floating tensors of one device and dtype are
    reduced together, up to 128 MB at a time: one copy into a flat buffer, then ``_foreach``
    reductions over views of it (about twenty ops in all), into one header matrix and one sample
    buffer. Larger tensors and other dtypes go one at a time, and so does every CPU tensor while
    the CPU shortcut is on, where a plain loop measures faster. Zeros are not counted by the shortcut.

    ``owners``: the parameters ``tensors`` belong to (themselves, or whose ``.grad`` they are), the
    same every step: which tensor goes where is then decided once and kept (:class:`_Plan`).
    ``small``: the step's small tensors, where the copied ones join the step's one segment
    reduction (completed by ``small.reduce()``) and are returned as their rows there (``int``,
    see :meth:`~actviz.summaries.small_tensors.SmallTensors.reduction`); without, they are reduced here.

    Example:
        >>> from actviz.summaries.one_tensor import finish
        >>> bias, weight = torch.tensor([1.0, -1.0]), torch.arange(6.0).view(2, 3)
        >>> [finish(r).sum for r in reduce_tensors([bias, weight])]
        [0.0, 15.0]
    """
    plan = _Plan.find(tensors, owners, sample_size, cpu_shortcuts())
    reductions: list[Reduction | int | None] = [None] * len(tensors)
    if plan.flat:
        batch = small if small is not None else SmallTensors(cpu_shortcut=False)
        try:
            for indices, sizes, device in plan.flat:
                flat = flatten_copy([tensors[index] for index in indices])  # one op: the values as they are now
                if flat.device != device or not flat.is_floating_point():
                    raise ValueError(f"tensors planned on {device} now give {flat.dtype} on {flat.device}")
                for index, row in zip(indices, batch.add_segments(flat, sizes)):
                    reductions[index] = row
        except Exception:
            _Plan.forget(plan)  # a parameter moved or changed: planned again next time
            raise
        if small is None:
            batch.reduce()
            for indices, _, _ in plan.flat:
                for index in indices:
                    reductions[index] = batch.reduction(reductions[index])  # type: ignore[arg-type]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    shards = {index: local_shard(tensors[index]) for index in plan.rest}
    for index, tensor in shards.items():
        if tensor.numel() == 0 or not tensor.is_floating_point() or tensor.numel() * tensor.element_size() > CHUNK_BYTES:
            reductions[index] = reduce_tensor(tensor, sample_size, count_zeros=False)
        elif plan.shortcut and tensor.device.type == "cpu":  # on the CPU a plain loop is faster
            reductions[index] = reduce_tensor(tensor, sample_size, count_zeros=False)
        else:
            groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for indices in groups.values():
        chunk: list[int] = []
        chunk_bytes = 0
        for index in [*indices, None]:
            size = 0 if index is None else shards[index].numel() * shards[index].element_size()
            if chunk and (index is None or chunk_bytes + size > CHUNK_BYTES):
                found = _reduce_together([shards[i] for i in chunk], sample_size)
                for i, reduction in zip(chunk, found):
                    reductions[i] = reduction
                chunk, chunk_bytes = [], 0
            if index is not None:
                chunk.append(index)
                chunk_bytes += size
    return reductions  # type: ignore[return-value]


class _Plan:
    """Which of a list of tensors are copied end to end (:attr:`flat`, per device) and which are reduced in groups by size (:attr:`rest`).

    Planned once for a list of parameters, kept while the same parameters, with the same sizes,
    come again: a step then spends no Python per parameter on deciding.
    """

    __slots__ = ("flat", "key", "numels", "owners", "rest", "shortcut")
    _kept: dict[tuple[Any, ...], _Plan] = {}

    def __init__(self, tensors: Sequence[torch.Tensor], sample_size: int | None, shortcut: bool) -> None:
        self.shortcut = shortcut
        self.numels = tuple(map(torch.Tensor.numel, tensors))
        self.owners: list[weakref.ref[torch.Tensor]] = []
        self.key: tuple[Any, ...] = ()
        small = SmallTensors(shortcut)
        by_device: dict[torch.device, list[int]] = {}
        self.rest: list[int] = []
        for index, tensor in enumerate(tensors):
            whole = tensor.numel() > 0 and (sample_size is None or tensor.numel() <= sample_size)
            if whole and not distributed_types.is_dtensor(tensor) and small.takes(tensor):
                by_device.setdefault(tensor.device, []).append(index)
            else:
                self.rest.append(index)
        self.flat = [(indices, [self.numels[i] for i in indices], device) for device, indices in by_device.items()]

    @classmethod
    def find(cls, tensors: Sequence[torch.Tensor], owners: Sequence[torch.Tensor] | None, sample_size: int | None,
             shortcut: bool) -> _Plan:
        """The kept plan for ``owners`` if their tensors still have the same sizes, else a new one (kept if ``owners``)."""
        if owners is None:
            return cls(tensors, sample_size, shortcut)
        key = (tuple(map(id, owners)), sample_size, shortcut)
        plan = cls._kept.get(key)
        if (plan is None or plan.numels != tuple(map(torch.Tensor.numel, tensors))
                or not all(map(operator.is_, map(weakref.ref.__call__, plan.owners), owners))):  # no frame per owner
            if len(cls._kept) > 8:  # ever new parameter lists: keep a few
                cls._kept.clear()
            plan = cls._kept[key] = cls(tensors, sample_size, shortcut)
            plan.key, plan.owners = key, [weakref.ref(owner) for owner in owners]
        return plan

    @classmethod
    def forget(cls, plan: _Plan) -> None:
        cls._kept.pop(plan.key, None)


_reciprocals: dict[tuple[torch.device, torch.dtype, tuple[int, ...]], torch.Tensor] = {}


def _reciprocal_sizes(sizes: list[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``1 / sizes`` on ``device``, made once per set of sizes (the same parameters every step)."""
    key = (device, dtype, tuple(sizes))
    found = _reciprocals.get(key)
    if found is None:
        if len(_reciprocals) > 64:  # a run with ever new parameter sets: keep a few
            _reciprocals.clear()
        found = _reciprocals[key] = torch.tensor([1.0 / size for size in sizes], dtype=dtype).to(device)
    return found


def _reduce_together(tensors: Sequence[torch.Tensor], sample_size: int | None) -> list[Reduction]:
    """Non-empty floating tensors of one device and dtype: one ``(k, HEADER)`` matrix, one buffer of their size.

    Sum, squares, counts and exact finite min/max come from ``_foreach`` reductions over
    views of one flat copy, changed in place between them (zeros for NaN/Inf, then ``-inf``,
    then negated), so the transient memory is the tensors' size once.
    """
    views = [flat_view(tensor) for tensor in tensors]
    sizes = [view.numel() for view in views]
    strides = [sample_stride(size, sample_size) for size in sizes]
    wide = wide_dtype(views[0].device)
    samples = torch.cat([view[::stride] for view, stride in zip(views, strides)])
    flat = torch.cat(views)
    parts = list(flat.split(sizes))
    flat.nan_to_num_(0.0, 0.0, 0.0)
    count = len(views)
    counts = torch._foreach_norm(views + parts, 0, dtype=wide)  # non-zeros before and after
    sums = torch._foreach_powsum(parts, 2, dtype=wide) + torch._foreach_powsum(parts, 1, dtype=wide)
    flat.clamp_min_(0)
    sums += torch._foreach_powsum(parts, 1, dtype=wide)  # sum = 2 * sum(relu) - sum(abs)
    torch.cat(views, out=flat)
    flat.nan_to_num_(-math.inf, -math.inf, -math.inf)
    bounds = torch._foreach_max(parts)
    flat.neg_().nan_to_num_(posinf=-math.inf)  # -x, and -inf for NaN/Inf
    bounds += torch._foreach_max(parts)
    raw = torch.stack(counts + sums).view(5, count)  # nonzero, finite nonzero, squares, abs, relu
    high, negated_low = torch.stack(bounds).to(wide).view(2, count)
    reciprocal = _reciprocal_sizes(sizes, raw.device, wide)
    mean = (2 * raw[4] - raw[3]) * reciprocal
    header = torch.stack([raw[0], raw[1], mean, (raw[2] * reciprocal - mean * mean).clamp_min_(0), -negated_low, high], 1)
    found, start = [], 0
    for index, (size, stride) in enumerate(zip(sizes, strides)):
        stop = start + -(-size // stride)
        found.append(Reduction(size, stride, header, index, samples, start, stop))
        start = stop
    return found
