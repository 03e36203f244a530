"""Many tensors reduced together: parameters and their gradients in a fixed number of ops.

A ResNet-50 has 161 parameters. Reducing each on its own (:func:`~actviz.summaries.one_tensor.reduce_tensor`)
would dispatch an op per parameter; here the small ones (the sample covers them whole:
biases, norms, small convolutions) share the segment reduction of :mod:`actviz.summaries.small_tensors`,
about 25 ops per million elements, and the larger floating tensors of one device and dtype share
one call of the one-pass op (:mod:`actviz.summaries.one_pass`), whatever their count, which reads each
where it lies. The results are the same handles as one tensor's
(:class:`~actviz.summaries.one_tensor.PendingSummary`), finished on the host by their ``finish``.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..common import distributed_types
from ..common._internals import flatten_copy
from ..options import DEFAULT_SAMPLE_SIZE, cpu_shortcuts
from .one_pass import SUMMARIZE
from .header import HEADER, Reduction
from .one_tensor import PendingSummary, flat_view, local_shard, sample_stride, start_summary
from .small_tensors import SmallTensors

__all__ = ["reduce_tensors"]

def reduce_tensors(
    tensors: Sequence[torch.Tensor], sample_size: int | None = DEFAULT_SAMPLE_SIZE,
    owners: Sequence[torch.Tensor] | None = None, small: SmallTensors | None = None,
) -> list[PendingSummary]:
    """:func:`~actviz.summaries.one_tensor.start_summary` of many tensors, in a number of ops that does not grow with their count.

    Floating tensors of one device its sample covers whole (biases, norms, small convolutions)
    are copied end to end in one op and share the segment reduction of
    :mod:`actviz.summaries.small_tensors`. Larger floating tensors of one device and dtype are
    reduced together by one call of the one-pass op, into one tensor of header rows and samples.
    Other dtypes go one at a time, and so does every CPU tensor while the CPU shortcut is on,
    where a plain loop measures faster. Zeros are not counted by the shortcut.

    ``owners``: the parameters ``tensors`` belong to (themselves, or whose ``.grad`` they are), the
    same every step: which tensor goes where is then decided once and kept (:class:`_Plan`).
    ``small``: the step's small tensors, where the copied ones join the step's one segment
    reduction (completed by ``small.reduce()``) and are returned as their rows there; without, they are reduced
    here. Each tensor's summary is a :class:`~actviz.summaries.one_tensor.PendingSummary`, as
    :func:`~actviz.summaries.one_tensor.start_summary` gives one tensor's; the one-by-one routes are its.

    Example:
        >>> from actviz.summaries.one_tensor import finish
        >>> bias, weight = torch.tensor([1.0, -1.0]), torch.arange(6.0).view(2, 3)
        >>> [finish(summary.made).sum for summary in reduce_tensors([bias, weight])]
        [0.0, 15.0]
    """
    plan = _Plan.find(tensors, owners, sample_size, cpu_shortcuts())
    reductions: list[PendingSummary | None] = [None] * len(tensors)
    if plan.flat:
        batch = small if small is not None else SmallTensors(cpu_shortcut=False)
        try:
            for indices, sizes, device in plan.flat:
                flat = flatten_copy([tensors[index] for index in indices])  # one op: the values as they are now
                if flat.device != device or not flat.is_floating_point():
                    raise ValueError(f"tensors planned on {device} now give {flat.dtype} on {flat.device}")
                for index, row in zip(indices, batch.add_segments(flat, sizes)):
                    reductions[index] = PendingSummary(row=row)
        except Exception:
            _Plan.forget(plan)  # a parameter moved or changed: planned again next time
            raise
        if small is None:
            batch.reduce()
            for indices, _, _ in plan.flat:
                for index in indices:
                    reductions[index].reduction(batch)  # type: ignore[union-attr]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    shards = {index: local_shard(tensors[index]) for index in plan.rest}
    for index, tensor in shards.items():
        if (tensor.numel() == 0 or not tensor.is_floating_point()
                or (plan.shortcut and tensor.device.type == "cpu")):  # on the CPU a plain loop is faster
            reductions[index] = start_summary(tensor, sample_size, count_zeros=False)
        else:
            groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for indices in groups.values():
        for index, reduction in zip(indices, _reduce_together([shards[index] for index in indices], sample_size)):
            reductions[index] = PendingSummary(reduction)
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


def _reduce_together(tensors: Sequence[torch.Tensor], sample_size: int | None) -> list[Reduction]:
    """Non-empty floating tensors of one device and dtype: one call of the one-pass op
    (:mod:`actviz.summaries.one_pass`), which reads each where it lies and leaves their header rows and samples in one tensor."""
    views = [flat_view(tensor) for tensor in tensors]
    sizes = [view.numel() for view in views]
    strides = [sample_stride(size, sample_size) for size in sizes]
    out = SUMMARIZE(views, strides, False)
    found, start = [], len(sizes) * HEADER
    for index, (size, stride) in enumerate(zip(sizes, strides)):
        stop = start + -(-size // stride)
        found.append(Reduction(size, stride, out, index, out, start, stop))
        start = stop
    return found
