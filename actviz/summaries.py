"""Tensor summaries, made in two halves so that a GPU never waits for the host.

* :func:`reduce_tensor` runs inside the hook, on the tensor's device. Its core,
  :func:`reduce_values`, is a pure tensor function with no Python branch on tensor
  values: for a float32 tensor it dispatches five kernel-launching ops (``nan_to_num``,
  one ``_foreach_norm(ord=0)`` counting the non-zero elements before and after it,
  ``var_mean``, ``aminmax`` and the copy of a strided sample). The small results stay
  on the device until the step ends and go to the host in one copy
  (:mod:`actviz.transfer`). :func:`actviz.batch_summaries.reduce_tensors` reduces many
  tensors (parameters and their gradients) in nine ops per device, dtype and 128 MB.
* :func:`finish` runs on the host, on the writer thread. It turns those numbers and
  the sample into a :class:`~actviz.results.Summary`, counting the sample's buckets
  between the finite min and max.

NaN and ±Inf are counted, then replaced by 0 for the sums, min and max. Where that 0
could be the min (or max) itself, because no element is 0 and every finite one has the
same sign, the min (or max) comes from the sample's finite values instead (exact when
the sample is the whole tensor). Sums of squares of float32 tensors are accumulated in
float32 on this path: a norm above about 1.8e19 reads as inf.

On the CPU a finite float32 or float64 tensor takes a NumPy shortcut that gives the
same numbers in fewer passes; ``ACTVIZ_CPU_SHORTCUTS=0`` turns it off.

On CUDA and the other devices Inductor compiles for, :func:`reduce_tensor` takes the
header from :func:`header_sums` compiled (:mod:`actviz.fused`): one read of the tensor
instead of five (and the sample's copy), sums in float64, so no float32 overflow.
``ACTVIZ_FUSED=1`` or ``0`` forces either path on any device; the CPU's default is eager.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import fused
from .options import DEFAULT_BINS, DEFAULT_SAMPLE_SIZE, cpu_shortcuts
from .reduction import Reduction
from .results import HEADER_SIZE, Summary

__all__ = [
    "HEADER_SIZE", "Reduction", "finish", "flat_view", "header_sums", "reduce_tensor", "reduce_values", "sample_stride",
    "summarize",
]

# A stride that shares no factor with common feature-map sizes (2, 3, 5, 7, 11, 13)
# walks through every spatial position instead of hitting the same one in each channel.
_AVOID_FACTORS = 2 * 3 * 5 * 7 * 11 * 13
#: From this many elements on, torch's threaded reductions beat NumPy's in the CPU shortcut.
_TORCH_REDUCTION_MIN = 1 << 15
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
    if to_local is not None and type(tensor).__name__ == "DTensor":
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


def wide_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def reduce_values(values: torch.Tensor, stride: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The device half of a summary of a 1-D tensor: six 0-dim tensors and a strided sample.

    A pure tensor function: it never reads a value on the host, so it neither syncs
    with a GPU nor branches on data. Five ops eagerly, but slow compiled (``var_mean``
    becomes a Welford loop): :func:`header_sums` is the form to compile. The header is
    ``(nonzero, finite_nonzero, variance, mean, min, max)`` of ``z``, the values with
    NaN and ±Inf replaced by 0, for float32 and float64; float16 and bfloat16 give
    ``(..., sum, sum_squares, ...)`` accumulated in float64 instead.
    """
    wide = wide_dtype(values.device)
    if not values.is_floating_point():  # integers and bools: nothing to mask
        values = values.to(wide)
    zeroed = torch.nan_to_num(values, 0.0, 0.0, 0.0)
    nonzero, finite_nonzero = torch._foreach_norm([values, zeroed], 0, dtype=wide)
    if values.dtype in (torch.float32, torch.float64):
        first, second = torch.var_mean(zeroed, correction=0)
    else:  # 16-bit floats: var_mean would answer in 16 bits
        first = zeroed.sum(dtype=wide)
        (second,) = torch._foreach_powsum([zeroed], 2, dtype=wide)
    low, high = torch.aminmax(zeroed)
    return (nonzero, finite_nonzero, first, second, low, high), values[::stride].clone()


def header_sums(values: torch.Tensor) -> torch.Tensor:
    """:func:`reduce_values`'s header in its ``"sums"`` form, written to be compiled into one loop.

    ``(nonzero, finite_nonzero, sum, sum_squares, min, max)`` of ``z``, the values with
    NaN and ±Inf replaced by 0, as one vector; sums accumulated in float64, counts in
    int32 (exact below 2**31 elements; :func:`reduce_tensor` sends larger tensors to
    the eager path). Eagerly this is a dozen ops; :mod:`actviz.fused` compiles it, and
    Inductor reads the tensor once (``var_mean`` would lower to a Welford loop that is
    not vectorized, and int64 counts made the CPU loop 2.6 times slower).

    Example:
        >>> header_sums(torch.tensor([0.0, 2.0, float("nan"), -1.0])).tolist()
        [3.0, 2.0, 1.0, 5.0, -1.0, 2.0]
    """
    wide = wide_dtype(values.device)
    if not values.is_floating_point():
        values = values.to(wide)
    zeroed = torch.where(values.abs() < math.inf, values, 0)  # NaN < inf is false
    widened = zeroed.to(wide)
    counts = [(values != 0).sum(dtype=torch.int32).to(wide), (zeroed != 0).sum(dtype=torch.int32).to(wide)]
    bounds = [zeroed.amin().to(wide), zeroed.amax().to(wide)]
    return torch.stack([*counts, widened.sum(), (widened * widened).sum(), *bounds])


def reduce_tensor(
    tensor: torch.Tensor, sample_size: int | None = DEFAULT_SAMPLE_SIZE, count_zeros: bool = True
) -> Reduction:
    """Reduce one tensor on its device (see :func:`reduce_values`); :func:`finish` completes it.

    Args:
        tensor: Any real tensor. It is not modified, and nothing keeps it alive.
        sample_size: Most elements in the sample the buckets are counted on; ``None`` for all.
        count_zeros: Whether the CPU shortcut counts exact zeros (the device path always does).

    Raises:
        TypeError: A complex tensor.
    """
    if tensor.is_complex():
        raise TypeError(f"cannot summarize a complex tensor ({tensor.dtype})")
    values = flat_view(local_shard(tensor))
    numel = values.numel()
    if numel == 0:
        return Reduction(0, 1, "numbers", [0.0, 0, math.nan, math.nan, 0.0, 0.0], torch.empty(0))
    stride = sample_stride(numel, sample_size)
    if numel < _INT32_COUNTS_MAX and fused.use_fused(values.device):
        header = fused.run(header_sums, values)
        if header is not None:
            return Reduction(numel, stride, "sums", list(header.unbind()), values[::stride].clone())
    if values.device.type == "cpu" and cpu_shortcuts():
        found = _reduce_on_cpu(values, stride, count_zeros)
        if found is not None:
            return found
    header, sample = reduce_values(values, stride)
    form = "var_mean" if values.dtype in (torch.float32, torch.float64) or not values.is_floating_point() else "sums"
    return Reduction(numel, stride, form, list(header), sample)


def _reduce_on_cpu(values: torch.Tensor, stride: int, count_zeros: bool) -> Reduction | None:
    """The CPU shortcut for a finite float32/float64 tensor; ``None`` for any other.

    A finite sum proves there is no NaN or Inf, and on the CPU reading it costs nothing.
    Sums of squares that overflow float32 are redone in float64.
    """
    if values.dtype not in (torch.float32, torch.float64):
        return None
    try:
        array = values.numpy()
    except (RuntimeError, TypeError):  # a tensor subclass without a NumPy view
        return None
    large = array.size >= _TORCH_REDUCTION_MIN
    if large:  # torch's threaded reductions
        squares, total = float(torch.dot(values, values)), float(values.sum())
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            squares, total = float(np.dot(array, array)), float(array.sum(dtype=np.float64))
    if not math.isfinite(total):
        return None
    if not math.isfinite(squares):  # float32 squares that overflow: redo them in float64
        wide = array.astype(np.float64)
        squares = float(np.dot(wide, wide))
    if large:
        low, high = (float(bound) for bound in torch.aminmax(values))
    else:
        low, high = float(array.min()), float(array.max())
    zeros = None
    if count_zeros:
        zeros = 0 if low > 0 or high < 0 else int(np.count_nonzero(array == 0))
    sample = torch.from_numpy(array[::stride].copy())  # a copy: a later in-place op must not change it
    return Reduction(array.size, stride, "numbers", [0, zeros, low, high, total, squares], sample)


def finish(reduction: Reduction, bins: int = DEFAULT_BINS) -> Summary:
    """The host half of a summary: numbers and bucket counts, once the reduction is on the host.

    Bucket ``i`` covers ``[min + i*w, min + (i+1)*w)`` with ``w = (max - min) / bins``; the
    last also holds ``max``. Counts come from the sample's finite values, scaled to the
    finite total when the sample is not the whole tensor.
    """
    nonfinite, zeros, low, high, total, squares = reduction.numbers()
    numel = reduction.numel
    finite_count = numel - int(nonfinite)
    sample = reduction.sample
    sample = sample.to(torch.float64).numpy() if isinstance(sample, torch.Tensor) else np.asarray(sample, float)
    if nonfinite:
        sample = sample[np.isfinite(sample)]
    if finite_count == 0:
        low = high = math.nan
    elif nonfinite and zeros == 0 and sample.size and reduction.counts is None:  # the 0 for NaN/Inf: min or max?
        low = float(sample.min()) if low == 0 else low
        high = float(sample.max()) if high == 0 else high
    counts = np.zeros(bins)
    if reduction.counts is not None:  # merged across ranks between common edges
        counts = np.asarray(reduction.counts, dtype=float)
    elif finite_count and sample.size:
        if high > low:
            index = ((sample - low) / ((high - low) / bins)).astype(np.intp)  # every value >= low: floor
            counts = np.bincount(np.minimum(index, bins - 1, out=index), minlength=bins).astype(float)
        else:
            counts[0] = sample.size
        if reduction.stride > 1:
            counts *= finite_count / sample.size
    return Summary(numel, int(nonfinite), zeros, float(low), float(high), float(total), float(squares), counts.tolist())


def summarize(
    tensor: torch.Tensor,
    bins: int = DEFAULT_BINS,
    sample_size: int | None = DEFAULT_SAMPLE_SIZE,
    count_zeros: bool = True,
) -> torch.Tensor:
    """Summary vector of one tensor, on the host (see :meth:`actviz.results.Summary.vector`).

    For one tensor at a time: it waits for the device. The watcher reduces on the device
    and copies a whole step back at once instead.

    Example:
        >>> vec = summarize(torch.tensor([0.0, 1.0, 2.0, float("nan")]), bins=2)
        >>> Summary.from_vector(vec.tolist()).finite_count, Summary.from_vector(vec.tolist()).bucket_counts
        (3, [1.0, 2.0])
    """
    reduction = reduce_tensor(tensor, sample_size, count_zeros)
    reduction.receive(iter([t.cpu() for t in reduction.device_tensors()]))
    return torch.tensor(finish(reduction, bins).vector(), dtype=torch.float64)
