"""Tensor summaries, made in two halves so that a GPU never waits for the host.

* :func:`reduce_tensor` runs inside the hook, on the tensor's device, and leaves one
  header row (layout: :mod:`actviz.summaries.header`) and a strided sample: one op,
  ``torch.ops.actviz.summarize`` (:mod:`actviz.summaries.one_pass`), which reads the tensor once
  on a GPU; nothing read on the host. In the watcher's hooks a tensor its sample covers whole
  takes one copy instead (:mod:`actviz.summaries.small_tensors`). The step's rows go to the host
  in one copy (:mod:`actviz.output.pending_step`); :func:`actviz.summaries.many_tensors.reduce_tensors`
  reduces many parameters together.
* :func:`finish` runs on the host, on the writer thread: it decodes the row
  (:func:`actviz.summaries.header.decode`) and counts the sample's buckets between min and max.

On the CPU a float32 or float64 tensor takes a shortcut that reads its numbers at once
(:mod:`actviz.summaries.cpu_shortcut`); ``ACTVIZ_CPU_SHORTCUTS=0`` turns it off. Only where
``ACTVIZ_FUSED=1`` asks is :func:`~actviz.summaries.one_pass.header_sums` compiled instead
(:mod:`actviz.summaries.fused`, off by default on every device: :func:`~actviz.summaries.fused.use_fused` says why).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..common import distributed_types
from ..options import DEFAULT_BINS, DEFAULT_SAMPLE_SIZE, cpu_shortcuts
from ..common.results import HEADER_SIZE, Summary
from . import fused, one_pass, piecewise
from .one_pass import SUMMARIZE
from .one_pass import header_sums
from .cpu_shortcut import reduce_on_cpu
from .header import HEADER, Reduction, wide_dtype
from .small_tensors import SmallTensors

__all__ = [
    "HEADER_SIZE", "Reduction", "finish", "flat_view", "reduce_in_one_pass", "reduce_tensor",
    "sample_stride",
    "summarize",
]

# A stride that shares no factor with common feature-map sizes (2, 3, 5, 7, 11, 13)
# walks through every spatial position instead of hitting the same one in each channel.
_AVOID_FACTORS = 2 * 3 * 5 * 7 * 11 * 13
#: header_sums counts in int32: larger tensors take the eager path.
_INT32_COUNTS_MAX = 1 << 31


def sample_stride(numel: int, sample_size: int | None) -> int:
    """Stride that takes at most ``sample_size`` elements from ``numel``, evenly spread.

    Example:
        >>> sample_stride(1000, None), sample_stride(1000, 1000), sample_stride(2_000_000, 65536)
        (1, 1, 31)
    """
    if sample_size is None or numel <= sample_size:
        return 1
    stride = -(-numel // sample_size)
    while math.gcd(stride, _AVOID_FACTORS) != 1:
        stride += 1
    return stride


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2, tensor parallelism), detached; any other tensor detached.

    An op on a DTensor may run a collective, and actviz reduces on rank 0 alone by default:
    reducing the local shard never waits for another rank.
    """
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and distributed_types.is_dtensor(tensor):
        tensor = to_local()
    return tensor.detach()


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of ``tensor`` as a 1-D tensor in memory order: a view unless it has gaps.

    A channels-last activation is read as it lies in memory instead of being copied.
    """
    if tensor.is_contiguous():
        return tensor.view(-1)
    order = sorted(range(tensor.dim()), key=lambda dim: (tensor.stride(dim), tensor.size(dim)), reverse=True)
    permuted = tensor.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else tensor.reshape(-1)


def reduce_tensor(
    tensor: torch.Tensor, sample_size: int | None = DEFAULT_SAMPLE_SIZE, count_zeros: bool = True,
    small: SmallTensors | None = None, outliers: bool = False, units: tuple[float, ...] = (),
    channels: tuple[int, ...] = (),
) -> Reduction:
    """Reduce one tensor on its device (see :func:`reduce_values`); :func:`finish` completes it.

    Args:
        tensor: Any real tensor. It is not modified, and nothing keeps it alive.
        sample_size: Most elements in the sample the buckets are counted on; ``None`` for all.
        count_zeros: Whether the CPU shortcut counts exact zeros (the device path always does).
        small: The step's small tensors: a floating tensor its sample covers whole is copied
            there and reduced with the others when the step ends (:mod:`actviz.summaries.small_tensors`).
        outliers, units: Where the one-pass op summarizes it, add the outlier numbers, or a unit fraction
            (:func:`~actviz.summaries.one_pass.unit_fraction`), to its row
            (:meth:`~actviz.summaries.header.Reduction.extra_fields`).
        channels: Where the one-pass op summarizes it, its :func:`~actviz.summaries.one_pass.channel_layout`: the
            reduction's ``strengths`` are then each channel's mean ``|x|`` over sample 0, for its picture.

    Raises:
        TypeError: A complex tensor.
    """
    if small is not None and (copy := small.whole_copy(tensor, sample_size)) is not None:
        return small.add(copy, copied=True)  # its sample is the whole tensor: batched with the step's other small ones
    if tensor.is_complex():
        raise TypeError(f"cannot summarize a complex tensor ({tensor.dtype})")
    values = flat_view(local_shard(tensor))
    numel = values.numel()
    if numel == 0:
        return Reduction(0, 1, [0.0] * HEADER, 0, torch.empty(0), 0, 0)
    if small is not None and (sample_size is None or numel <= sample_size) and small.takes(values):
        return small.add(values)  # its sample is the whole tensor: batched with the step's other small ones
    stride = sample_stride(numel, sample_size)
    # Compiled only where ACTVIZ_FUSED=1 asks (fused.use_fused says why; a watcher's step batches small tensors first).
    if numel < _INT32_COUNTS_MAX and fused.use_fused():
        header = fused.run(header_sums, values)
        if header is not None:
            sample = values[::stride].clone()
            return Reduction(numel, stride, header, 0, sample, 0, sample.numel())
    if values.device.type == "cpu" and cpu_shortcuts():
        found = reduce_on_cpu(values, stride, count_zeros)
        if found is not None:
            return found
    return reduce_in_one_pass(values, stride, outliers, units, channels)


def reduce_in_one_pass(values: torch.Tensor, stride: int, outliers: bool = False,
                       units: tuple[float, ...] = (), channels: tuple[int, ...] = ()) -> Reduction:
    """The device half of a summary of a non-empty 1-D tensor by the one-pass op (:mod:`actviz.summaries.one_pass`):
    one op, its row (with ``outliers``, the outlier numbers after the header) and its sample in one tensor.
    Integer and bool tensors are counted and summed as they are (:func:`~actviz.summaries.piecewise.reduce_integers`)."""
    if not values.is_floating_point():
        return piecewise.reduce_integers(values, stride, wide_dtype(values.device))
    row = SUMMARIZE([values], [stride], outliers, list(units), list(channels))
    extra = (one_pass.OUTLIER_FIELDS if outliers else ()) + (one_pass.UNIT_FIELDS if units else ())
    stop = row.numel() - (channels[0] if channels else 0)
    strengths = row[stop:] if channels else None
    return Reduction(values.numel(), stride, row, 0, row, HEADER + len(extra), stop, extra=extra, strengths=strengths)


def finish(reduction: Reduction, bins: int = DEFAULT_BINS) -> Summary:
    """The host half of a summary: numbers and bucket counts, once the reduction is on the host.

    Bucket ``i`` covers ``[min + i*w, min + (i+1)*w)`` with ``w = (max - min) / bins``; the
    last also holds ``max``. Counts come from the sample's finite values, scaled to the
    finite total when the sample is not the whole tensor.
    """
    nonfinite, zeros, low, high, total, squares, spread = reduction.numbers()
    numel = reduction.numel
    finite_count = numel - nonfinite
    sample = reduction.sample_values() if reduction.numel else torch.empty(0)
    sample = sample.to(torch.float64).numpy()
    if nonfinite:
        sample = sample[np.isfinite(sample)]
    if finite_count == 0:  # the row's +inf/-inf placeholders
        low = high = math.nan
    counts = np.zeros(bins)
    if reduction.counts is not None:  # merged across ranks between common edges
        counts = np.asarray(reduction.counts[reduction.index], dtype=float)
    elif finite_count and sample.size:
        if high > low:
            index = ((sample - low) / ((high - low) / bins)).astype(np.intp)  # every value >= low: floor
            counts = np.bincount(np.clip(index, 0, bins - 1, out=index), minlength=bins).astype(float)
        else:
            counts[0] = sample.size
        if reduction.stride > 1:
            counts *= finite_count / sample.size
    return Summary(
        numel, nonfinite, zeros, float(low), float(high), float(total), float(squares), counts.tolist(), float(spread)
    )


def summarize(
    tensor: torch.Tensor,
    bins: int = DEFAULT_BINS,
    sample_size: int | None = DEFAULT_SAMPLE_SIZE,
    count_zeros: bool = True,
) -> torch.Tensor:
    """Summary vector of one tensor, on the host (see :meth:`actviz.common.results.Summary.vector`).

    For one tensor at a time: it waits for the device. The watcher reduces on the device
    and copies a whole step back at once instead.

    Example:
        >>> vec = summarize(torch.tensor([0.0, 1.0, 2.0, float("nan")]), bins=2)
        >>> Summary.from_vector(vec.tolist()).finite_count, Summary.from_vector(vec.tolist()).bucket_counts
        (3, [1.0, 2.0])
    """
    reduction = reduce_tensor(tensor, sample_size, count_zeros)
    reduction.receive({id(t): t.cpu() for t in reduction.device_tensors()})
    return torch.tensor(finish(reduction, bins).vector(), dtype=torch.float64)
