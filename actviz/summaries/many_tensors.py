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
from collections.abc import Sequence

import torch

from ..options import DEFAULT_SAMPLE_SIZE, cpu_shortcuts
from .header import Reduction
from .one_tensor import flat_view, local_shard, reduce_tensor, sample_stride, wide_dtype
from .small_tensors import SmallTensors

__all__ = ["CHUNK_BYTES", "reduce_tensors"]

#: Most bytes one flat buffer holds; reducing a chunk needs one such buffer.
CHUNK_BYTES = 128 << 20


def reduce_tensors(tensors: Sequence[torch.Tensor], sample_size: int | None = DEFAULT_SAMPLE_SIZE) -> list[Reduction]:
    """:func:`reduce_tensor` of many tensors, in a number of ops that does not grow with their count.

    Floating tensors of one device and dtype are reduced together, up to 128 MB at a
    time: one copy into a flat buffer, then ``_foreach`` reductions over views of it
    (about twenty ops in all), into one header matrix and one sample buffer. Larger tensors and other dtypes go one at a time, and so does
    every CPU tensor while the CPU shortcut is on, where a plain loop measures faster.
    Zeros are not counted by the shortcut.

    Example:
        >>> from actviz.summaries.one_tensor import finish
        >>> bias, weight = torch.tensor([1.0, -1.0]), torch.arange(6.0).view(2, 3)
        >>> [finish(r).sum for r in reduce_tensors([bias, weight])]
        [0.0, 15.0]
    """
    tensors = [local_shard(tensor) for tensor in tensors]
    reductions: list[Reduction | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    shortcut = cpu_shortcuts()
    small = SmallTensors(shortcut)
    for index, tensor in enumerate(tensors):
        numel, size = tensor.numel(), tensor.numel() * tensor.element_size()
        alone = numel == 0 or not tensor.is_floating_point() or size > CHUNK_BYTES
        if alone or (shortcut and tensor.device.type == "cpu"):  # on the CPU a plain loop is faster
            reductions[index] = reduce_tensor(tensor, sample_size, count_zeros=False)
        elif (sample_size is None or numel <= sample_size) and small.takes(tensor):  # segment sums: small_tensors
            reductions[index] = small.add(flat_view(tensor), copy=False)
        else:
            groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    small.reduce()  # now: one cat copies them, before an optimizer changes them
    for indices in groups.values():
        chunk: list[int] = []
        chunk_bytes = 0
        for index in [*indices, None]:
            size = 0 if index is None else tensors[index].numel() * tensors[index].element_size()
            if chunk and (index is None or chunk_bytes + size > CHUNK_BYTES):
                found = _reduce_together([tensors[i] for i in chunk], sample_size)
                for i, reduction in zip(chunk, found):
                    reductions[i] = reduction
                chunk, chunk_bytes = [], 0
            if index is not None:
                chunk.append(index)
                chunk_bytes += size
    return reductions  # type: ignore[return-value]


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
