"""Small tensors of one step reduced together: one copy each in its hook, a constant number of ops at the step's end.

A tensor no larger than its histogram sample is kept whole as its sample anyway. On the
accelerator path its hook makes one copy of it (:meth:`SmallTensors.add`, one op) instead of
reducing it there (five or more ops, and Python, per tensor: a micro ResNet-50 has over 200
such tensors per logging step). When the step ends, :meth:`SmallTensors.reduce` reduces every
copy of a device in about 25 ops, whatever their number: one ``cat``, then segment sums
(``index_add_``) and segment bounds (``scatter_reduce_``) over a segment-id tensor made once
on the host for the step's sizes. It writes one ``(k, len(FIELDS))`` header matrix
(:mod:`actviz.reduction`): counts, mean and centred variance of ``z`` (NaN and ±Inf
replaced by 0) in float64 (float32 on MPS), and exact min and max of the finite values
(``+inf``/``-inf`` where there are none). Each tensor's sample is its slice of the ``cat``.
Nothing is read on the host: no sync.

Example:
    >>> from actviz.summaries import finish
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

import math

import torch

from .reduction import Reduction

__all__ = ["SMALL_MAX", "SmallTensors", "reduce_segments"]

#: Most elements of a tensor batched here (with ``sample_size=None`` every tensor would be "small").
SMALL_MAX = 1 << 16

_layouts: dict[tuple[torch.device, torch.dtype, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}


def _layout(sizes: tuple[int, ...], device: torch.device, wide: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ids (one per element) and ``1 / sizes`` on ``device``: made on the host once per set of sizes."""
    key = (device, wide, sizes)
    found = _layouts.get(key)
    if found is None:
        if len(_layouts) > 16:  # a run whose sizes change every step: keep a few
            _layouts.clear()
        lengths = torch.tensor(sizes, dtype=torch.int64)
        segment = torch.repeat_interleave(torch.arange(len(sizes)), lengths, output_size=sum(sizes))  # on the host
        reciprocal = torch.tensor([1.0 / size for size in sizes], dtype=wide)
        found = _layouts[key] = (segment.to(device, non_blocking=True), reciprocal.to(device, non_blocking=True))
    return found


def reduce_segments(flat: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """The ``(len(sizes), len(FIELDS))`` header of consecutive segments of ``flat`` (a wide floating 1-D tensor).

    A constant number of ops for any number of segments, none of them syncing. Every size must be > 0.

    Example:
        >>> reduce_segments(torch.tensor([0.0, 2.0, float("nan"), -1.0, 5.0], dtype=torch.float64), (4, 1)).tolist()
        [[3.0, 2.0, 0.25, 1.1875, -1.0, 2.0], [1.0, 1.0, 5.0, 0.0, 5.0, 5.0]]
    """
    device, wide, count = flat.device, flat.dtype, len(sizes)
    segment, reciprocal = _layout(sizes, device, wide)
    columns = torch.empty((flat.numel(), 3), dtype=wide, device=device)  # non-zero, finite non-zero, z
    zeroed = columns[:, 2]
    torch.ne(flat, 0, out=columns[:, 0])  # NaN and ±Inf count as non-zero
    torch.nan_to_num(flat, 0.0, 0.0, 0.0, out=zeroed)
    torch.ne(zeroed, 0, out=columns[:, 1])
    sums = torch.zeros((count, 3), dtype=wide, device=device).index_add_(0, segment, columns)
    mean = sums[:, 2] * reciprocal
    deviations = torch.empty((flat.numel(), 2), dtype=wide, device=device)  # about the mean: no cancellation
    torch.sub(zeroed, mean.index_select(0, segment), out=deviations[:, 0])
    torch.mul(deviations[:, 0], deviations[:, 0], out=deviations[:, 1])
    moments = torch.zeros((count, 2), dtype=wide, device=device).index_add_(0, segment, deviations) * reciprocal.unsqueeze(1)
    residual = moments[:, 0]  # what rounding the mean left
    variance = (moments[:, 1] - residual * residual).clamp_min_(0)
    low = torch.full((count,), math.inf, dtype=wide, device=device)
    low.scatter_reduce_(0, segment, torch.nan_to_num(flat, math.inf, math.inf, math.inf), "amin")
    high = torch.full((count,), -math.inf, dtype=wide, device=device)
    high.scatter_reduce_(0, segment, torch.nan_to_num(flat, -math.inf, -math.inf, -math.inf), "amax")
    return torch.stack([sums[:, 0], sums[:, 1], mean + residual, variance, low, high], 1)


class _Batch:
    """One device's copies, their reductions and sizes, in three parallel lists."""

    __slots__ = ("copies", "reductions", "sizes", "stop")

    def __init__(self) -> None:
        self.copies: list[torch.Tensor] = []
        self.reductions: list[Reduction] = []
        self.sizes: list[int] = []
        self.stop = 0


class SmallTensors:
    """One step's small floating tensors, per device, until :meth:`reduce` reduces them all together.

    Args:
        cpu_shortcut: CPU tensors take the CPU shortcut instead (``ACTVIZ_CPU_SHORTCUTS``, read once per step).
    """

    __slots__ = ("_batches", "_cpu_shortcut")

    def __init__(self, cpu_shortcut: bool) -> None:
        self._cpu_shortcut = cpu_shortcut
        self._batches: dict[torch.device, _Batch] = {}

    def takes(self, values: torch.Tensor) -> bool:
        """Whether ``values`` (1-D, its sample whole) is batched: a floating tensor not on the CPU shortcut."""
        return (
            values.numel() <= SMALL_MAX and values.is_floating_point()
            and not (self._cpu_shortcut and values.device.type == "cpu")
        )

    def add(self, values: torch.Tensor) -> Reduction:
        """Copy ``values`` (1-D, floating) and return its :class:`Reduction`, completed by :meth:`reduce`."""
        batch = self._batches.get(values.device)
        if batch is None:
            batch = self._batches[values.device] = _Batch()
        copy = values.clone()  # a later in-place op (ReLU) must not change what is logged
        numel = values.numel()
        reduction = Reduction(numel, 1, None, len(batch.reductions), None, batch.stop, batch.stop + numel)
        batch.copies.append(copy)
        batch.reductions.append(reduction)
        batch.sizes.append(numel)
        batch.stop += numel
        return reduction

    def reduce(self) -> None:
        """Reduce every tensor added since the last call: per device one ``cat`` and :func:`reduce_segments`."""
        batches, self._batches = self._batches, {}
        for device, batch in batches.items():
            flat = torch.cat(batch.copies) if len(batch.copies) > 1 else batch.copies[0]  # promotes mixed dtypes
            wide = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
            with torch.no_grad():
                header = reduce_segments(flat.to(wide), tuple(batch.sizes))
            for reduction in batch.reductions:
                reduction.header, reduction.sample = header, flat
