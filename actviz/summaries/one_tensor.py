"""Tensor summaries, made in two halves so that a GPU never waits for the host.

* :func:`start_summary` runs inside the hook, chooses the tensor's route (the one place that does) and gives
  a :class:`PendingSummary`, the handle that travels to the writer thread; :func:`reduce_tensor` is its
  :class:`~actviz.summaries.header.Reduction` at once. Either runs inside the hook, on the tensor's device, and leaves one
  header row (layout: :mod:`actviz.summaries.header`) and a strided sample: one op,
  ``torch.ops.actviz.summarize`` (:mod:`actviz.summaries.one_pass`), which reads the tensor once
  on a GPU; nothing read on the host. In the watcher's hooks a tensor its sample covers whole
  takes one copy instead, summarized on the host. The step's rows and copies go to the host
  in one copy (:mod:`actviz.output.pending_step`); :func:`actviz.summaries.many_tensors.reduce_tensors`
  reduces many parameters together (:mod:`actviz.summaries.small_tensors`).
* :meth:`PendingSummary.finish` (:func:`finish` of a bare reduction) runs on the host, on the writer thread: it decodes the row
  (:func:`actviz.summaries.header.decode`), or reads a whole copy's numbers (:func:`whole_numbers`), and counts the
  sample's buckets between min and max.

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
    "HEADER_SIZE", "PendingSummary", "Reduction", "finish", "flat_view", "reduce_in_one_pass", "reduce_tensor",
    "sample_stride", "start_summary", "summarize", "whole_numbers",
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


class PendingSummary:
    """One tensor's summary in flight, from its hook to the writer thread: what :func:`start_summary` gives.

    It holds one of: the :class:`~actviz.summaries.header.Reduction` made in the hook (:attr:`made`); the tensor's
    whole :attr:`copy`, which goes to the host with the step and is summarized there; or a :attr:`row` of the step's
    small tensors (:class:`~actviz.summaries.small_tensors.SmallTensors`: parameters copied end to end), whose
    reduction exists once the batch is reduced. No object but this one per tensor on the training thread.
    :meth:`finish` completes it on the host.

    Attributes:
        made: The reduction made in the hook, or a row's or a copy's once asked for (:meth:`reduction`); ``None`` before.
        row: Its row in the step's small tensors, or ``None``.
        copy: A tensor its sample covers whole: its contiguous copy, made in the hook (a later in-place op cannot
            change it), also the source of its picture.

    Example:
        >>> small = SmallTensors(cpu_shortcut=False)
        >>> whole, large = start_summary(torch.tensor([1.0, 2.0]), 8, small), start_summary(torch.arange(20.0), 8, small)
        >>> whole.copy is not None, large.made is not None
        (True, True)
        >>> whole.finish(small, {}, bins=2).sum, large.finish(small, {}, bins=2).max
        (3.0, 19.0)
    """

    # Slots, no __dict__: a logging step makes one handle per tensor (hundreds), and each dict would be one more
    # object for the garbage collector to count and trace.
    __slots__ = ("copy", "made", "mergeable", "row", "scaled", "tag")

    def __init__(self, made: Reduction | None = None, row: int | None = None, copy: torch.Tensor | None = None) -> None:
        self.made, self.row, self.copy = made, row, copy
        #: Set by the hook that keeps it (:class:`~actviz.output.pending_step.TaggedReductions`): its layer's or
        #: parameter's name, whether the loss scale multiplies it, and whether ranks merge it.
        self.tag, self.scaled, self.mergeable = "", False, False

    def join(self, small: SmallTensors) -> None:
        """A whole copy becomes a row of ``small``: its header is then made on the device with the batch's
        (``small.reduce()``), as ``merge_ranks`` needs, and :meth:`reduction` gives it."""
        if self.made is None and self.copy is not None:
            self.row, self.copy = small.add_copy(self.copy), None

    def reduction(self, small: SmallTensors | None) -> Reduction:
        """Its :class:`~actviz.summaries.header.Reduction`: the one made in the hook, or its row's in ``small``
        (complete once the batch is reduced, or received on the host), kept from then on."""
        if self.made is None:
            assert self.row is not None and small is not None, "a whole copy joins small first (join)"
            self.made = small.reduction(self.row)
        return self.made

    def finish(self, small: SmallTensors | None, host: dict[int, torch.Tensor], bins: int = DEFAULT_BINS) -> Summary:
        """The host half, on the writer thread: numbers and bucket counts, from the step's tensors copied to ``host``
        (by ``id`` of the device tensor) and its small tensors received there.

        Bucket ``i`` covers ``[min + i*w, min + (i+1)*w)`` with ``w = (max - min) / bins``; the
        last also holds ``max``. Counts come from the sample's finite values, scaled to the
        finite total when the sample is not the whole tensor.
        """
        counts, merged = np.zeros(bins), False
        if self.made is None and self.copy is not None:  # copied whole: every value is on the host now
            copy = host.get(id(self.copy), self.copy)
            sample = copy.reshape(-1).to(torch.float64).numpy()
            numel, stride = sample.size, 1
            nonfinite, zeros, low, high, total, squares, spread = whole_numbers(sample)
        else:
            reduction = self.reduction(small)
            reduction.receive(host)
            nonfinite, zeros, low, high, total, squares, spread = reduction.numbers()
            numel, stride = reduction.numel, reduction.stride
            sample = reduction.sample_values() if reduction.numel else torch.empty(0)
            sample = sample.to(torch.float64).numpy()
            if reduction.counts is not None:  # merged across ranks between common edges
                counts, merged = np.asarray(reduction.counts[reduction.index], dtype=float), True
        finite_count = numel - nonfinite
        if nonfinite:
            sample = sample[np.isfinite(sample)]
        if finite_count == 0:  # the row's +inf/-inf placeholders
            low = high = math.nan
        if not merged and finite_count and sample.size:
            if high > low:
                index = ((sample - low) / ((high - low) / bins)).astype(np.intp)  # every value >= low: floor
                counts = np.bincount(np.clip(index, 0, bins - 1, out=index), minlength=bins).astype(float)
            else:
                counts[0] = sample.size
            if stride > 1:
                counts *= finite_count / sample.size
        return Summary(
            numel, nonfinite, zeros, float(low), float(high), float(total), float(squares), counts.tolist(), float(spread)
        )


def whole_numbers(values: np.ndarray) -> tuple[int, int, float, float, float, float, float]:
    """A header's numbers (:func:`~actviz.summaries.header.decode`) of every value of a tensor, in float64 on the host:
    ``(nonfinite, zeros, min, max, sum, sum_squares, spread)`` over the finite values, NaN and ±Inf counted apart.

    Example:
        >>> whole_numbers(np.array([0.0, 2.0, np.nan, -1.0]))
        (1, 1, -1.0, 2.0, 1.0, 5.0, 4.666666666666667)
    """
    finite = np.isfinite(values)
    nonfinite = int(values.size - np.count_nonzero(finite))
    zeros = int(values.size - np.count_nonzero(values))  # NaN and ±Inf are not zeros
    if nonfinite:
        values = values[finite]
    if not values.size:
        return nonfinite, zeros, math.inf, -math.inf, 0.0, 0.0, 0.0
    total = float(values.sum())
    deviations = values - total / values.size
    return (nonfinite, zeros, float(values.min()), float(values.max()), total, float(np.dot(values, values)),
            float(np.dot(deviations, deviations)))


def start_summary(
    tensor: torch.Tensor, sample_size: int | None = DEFAULT_SAMPLE_SIZE, small: SmallTensors | None = None,
    count_zeros: bool = True, outliers: bool = False, units: tuple[float, ...] = (), strengths: bool = False,
) -> PendingSummary:
    """The device half of one tensor's summary, on the route chosen here and nowhere else.

    The routes, in order: in a watcher's step (``small`` given), a plain floating tensor its sample covers whole is
    copied once, whole (:attr:`PendingSummary.copy`: it goes to the host with the step's other tensors, and
    :meth:`PendingSummary.finish` summarizes it there), as is a DTensor's or a subclass's local values; an empty tensor needs no op; ``ACTVIZ_FUSED=1`` compiles the header
    (:mod:`actviz.summaries.fused`); a float CPU tensor takes the CPU shortcut (:mod:`actviz.summaries.cpu_shortcut`)
    unless ``ACTVIZ_CPU_SHORTCUTS=0``; any other is read once by the one-pass op (:func:`reduce_in_one_pass`).
    Many tensors at once (parameters) take :func:`actviz.summaries.many_tensors.reduce_tensors`, which batches
    the same routes.

    Args:
        tensor: Any real tensor. It is not modified, and nothing keeps it alive.
        sample_size: Most elements in the sample the buckets are counted on; ``None`` for all.
        small: The step's small tensors; without, every tensor is reduced now.
        count_zeros: Whether the CPU shortcut counts exact zeros (the device path always does).
        outliers, units: Where the one-pass op summarizes it, add the outlier numbers, or a unit fraction
            (:func:`~actviz.summaries.one_pass.unit_fraction`), to its row
            (:meth:`~actviz.summaries.header.Reduction.extra_fields`).
        strengths: Where the one-pass op summarizes a 4-D tensor (not a DTensor) by its
            :func:`~actviz.summaries.one_pass.channel_layout`, the reduction's ``strengths`` are each channel's mean
            ``|x|`` over sample 0, for its picture.

    Raises:
        TypeError: A complex tensor.
    """
    if small is not None:  # the fast path of most layer outputs and their gradients: a few attribute reads, one copy
        numel = tensor.numel()
        if (type(tensor) is torch.Tensor and numel and (sample_size is None or numel <= sample_size)
                and small.takes(tensor)):
            # Its whole copy is its summary: summarized on the host by finish.
            return PendingSummary(copy=(tensor.detach() if tensor.requires_grad else tensor).clone(
                memory_format=torch.contiguous_format))
    if tensor.is_complex():
        raise TypeError(f"cannot summarize a complex tensor ({tensor.dtype})")
    values = flat_view(local_shard(tensor))
    numel = values.numel()
    summary = PendingSummary()
    if small is not None and 0 < numel and (sample_size is None or numel <= sample_size) and small.takes(values):
        summary.copy = values.clone(memory_format=torch.contiguous_format)  # a DTensor's or a subclass's values
        return summary
    if numel == 0:
        summary.made = Reduction(0, 1, [0.0] * HEADER, 0, torch.empty(0), 0, 0)
        return summary
    stride = sample_stride(numel, sample_size)
    # Compiled only where ACTVIZ_FUSED=1 asks (fused.use_fused says why; a watcher's step batches small tensors first).
    if numel < _INT32_COUNTS_MAX and fused.use_fused():
        header = fused.run(header_sums, values)
        if header is not None:
            sample = values[::stride].clone()
            summary.made = Reduction(numel, stride, header, 0, sample, 0, sample.numel())
            return summary
    if values.device.type == "cpu" and cpu_shortcuts():
        summary.made = reduce_on_cpu(values, stride, count_zeros)
        if summary.made is not None:
            return summary
    layout = one_pass.channel_layout(tensor) if strengths and not distributed_types.is_dtensor(tensor) else None
    summary.made = reduce_in_one_pass(values, stride, outliers, units, layout or ())
    return summary


def reduce_tensor(
    tensor: torch.Tensor, sample_size: int | None = DEFAULT_SAMPLE_SIZE, count_zeros: bool = True,
    small: SmallTensors | None = None, outliers: bool = False, units: tuple[float, ...] = (), strengths: bool = False,
) -> Reduction:
    """:func:`start_summary`'s :class:`~actviz.summaries.header.Reduction` at once; :func:`finish` completes it.

    With ``small``, a row's reduction is completed when the batch is reduced (``small.reduce()``, or on the host).
    The arguments are :func:`start_summary`'s.

    Raises:
        TypeError: A complex tensor.
    """
    summary = start_summary(tensor, sample_size, small, count_zeros, outliers, units, strengths)
    if summary.made is not None:
        return summary.made
    assert small is not None
    summary.join(small)
    return small.completed(summary.row)  # type: ignore[arg-type]


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
    """The host half of a summary whose reduction is on the host already: :meth:`PendingSummary.finish`."""
    return PendingSummary(reduction).finish(None, {}, bins)


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
