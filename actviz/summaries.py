"""Tensor summaries: one small vector per tensor, computed on the tensor's device.

:func:`summarize` is what the hooks call. It reduces a tensor of any size and
dtype to a vector of ``HEADER_SIZE + bins`` numbers without syncing with the
host on a GPU, so a step can collect all its summaries and copy them back in
one transfer. :func:`Summary.from_vector` turns a vector, once on the host,
into the numbers TensorBoard's histogram proto wants.

Layout of the vector::

    [num, nonfinite, zeros, min, max, sum, sum_squares, count_0, ..., count_{bins-1}]

``num`` counts every element; the others leave NaN and ±Inf out. Bucket ``i``
covers ``[min + i*w, min + (i+1)*w)`` with ``w = (max - min) / bins``; the last
bucket also holds ``max``.

On the CPU a finite float32 tensor is summarized by one call into the optional C
extension :mod:`actviz._fused`, which reads it once (see :data:`FUSED`); other CPU
tensors by NumPy on a view of the same memory; NaN, Inf and accelerator tensors by
masked torch ops.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

try:  # the optional C extension (see setup.py); without it everything runs in NumPy and torch
    from . import _fused
except ImportError:  # pragma: no cover - depends on how actviz was installed
    _fused = None

__all__ = ["FUSED", "HEADER_SIZE", "DEFAULT_SAMPLE_SIZE", "Summary", "summarize", "summarize_many", "sample_stride"]

HEADER_SIZE = 7

#: True when float32 tensors on the CPU are summarized by the one-pass C loop in
#: :mod:`actviz._fused` (built at install time; it needs AVX2 and FMA). Set the
#: environment variable ``ACTVIZ_PURE_PYTHON=1`` to keep to NumPy and torch.
FUSED: bool = bool(_fused is not None and _fused.VECTORIZED and not os.environ.get("ACTVIZ_PURE_PYTHON"))

#: Bucket counts come from at most this many elements, taken with a fixed
#: stride; the moments, min and max always use every element. At the default
#: 64 bins that is 256 sampled values per bucket on average: a bucket holding
#: 1/64 of the values is counted within about 6% (one standard error).
DEFAULT_SAMPLE_SIZE = 1 << 14

# A stride that shares no factor with common feature-map sizes (2, 3, 5, 7, 11, 13)
# walks through every spatial position instead of hitting the same one in each channel.
_AVOID_FACTORS = 2 * 3 * 5 * 7 * 11 * 13


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


def _vector_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def summarize(
    tensor: torch.Tensor,
    bins: int = 64,
    sample_size: int | None = DEFAULT_SAMPLE_SIZE,
    count_zeros: bool = True,
) -> torch.Tensor:
    """Reduce ``tensor`` to a summary vector on its own device.

    Args:
        tensor: Any real tensor: float16/bfloat16/float32/float64, integer or bool. It is not modified.
        bins: Number of histogram buckets between the finite min and max.
        sample_size: Count buckets on a strided sample of at most this many elements and
            scale the counts to the finite total; ``None`` counts every element.
        count_zeros: Count exact zeros. It is the slowest reduction on the CPU, so gradients
            and weights, whose zero fraction nothing reports, skip it (``zeros`` is then NaN).

    Returns:
        A 1-D float64 tensor of length ``HEADER_SIZE + bins`` (see the module docstring).

    Example:
        >>> vec = summarize(torch.tensor([0.0, 1.0, 2.0, float("nan")]), bins=2)
        >>> Summary.from_vector(vec.tolist()).finite_count, Summary.from_vector(vec.tolist()).bucket_counts
        (3, [1.0, 2.0])
    """
    if tensor.is_complex():
        raise TypeError(f"cannot summarize a complex tensor ({tensor.dtype})")
    values = tensor.detach().reshape(-1)
    if values.dtype not in (torch.float32, torch.float64):
        values = values.float()
    out_dtype = _vector_dtype(values.device)
    numel = values.numel()
    if numel == 0:
        header = torch.tensor([0, 0, 0, math.nan, math.nan, 0, 0], dtype=out_dtype, device=values.device)
        return torch.cat([header, torch.zeros(bins, dtype=out_dtype, device=values.device)])

    stride = sample_stride(numel, sample_size)
    if values.device.type == "cpu":
        vector = _summarize_finite_cpu(values, bins, stride, out_dtype, count_zeros)
        if vector is not None:
            return vector
    # On an accelerator a finiteness check would sync with the host, so the masked path always runs.
    return _summarize_masked(values, bins, stride, out_dtype, count_zeros)


def _summarize_masked(
    values: torch.Tensor, bins: int, stride: int, out_dtype: torch.dtype, count_zeros: bool
) -> torch.Tensor:
    """Any 1-D float tensor, NaN and ±Inf included, on any device, without a host sync."""
    numel = values.numel()
    zeros = numel - torch.count_nonzero(values) if count_zeros else torch.full((), math.nan, device=values.device)
    finite = torch.isfinite(values)
    nonfinite = numel - finite.sum()
    finite_values = torch.where(finite, values, 0).to(out_dtype)  # wider type: squares may overflow
    total = finite_values.sum()
    total_squares = torch.dot(finite_values, finite_values)
    low = torch.where(finite, values, math.inf).amin()
    high = torch.where(finite, values, -math.inf).amax()

    counts = _bucket_counts(values, low, high, bins, stride, numel - nonfinite)
    numel_tensor = torch.full((), numel, dtype=out_dtype, device=values.device)
    header = torch.stack([t.to(out_dtype) for t in (numel_tensor, nonfinite, zeros, low, high, total, total_squares)])
    return torch.cat([header, counts.to(out_dtype)])


#: From this many elements on, torch's multi-threaded ``sum`` and ``aminmax`` beat numpy's;
#: below it numpy's lower per-call cost wins.
_TORCH_REDUCTION_MIN = 1 << 15


def _summarize_finite_cpu(
    values: torch.Tensor, bins: int, stride: int, out_dtype: torch.dtype, count_zeros: bool
) -> torch.Tensor | None:
    """The common case on the CPU: every element finite. ``None`` when some are not.

    A finite sum proves there is no NaN or Inf, and on the CPU reading it costs nothing.
    A float32 tensor takes one pass of the :mod:`actviz._fused` C loop when it is built
    (see :data:`FUSED`); otherwise the work is done on a NumPy view of the same memory
    (torch's ``sum`` and ``aminmax`` only for large tensors, where its threads pay). The
    numbers equal the masked path's, up to float rounding in the sums.
    """
    try:
        array = values.numpy()
    except (RuntimeError, TypeError):  # a tensor subclass without a numpy view: use the general path
        return None
    if FUSED and array.dtype == np.float32 and array.flags.c_contiguous:
        vector = np.empty(HEADER_SIZE + bins)
        if not _fused.summarize(array, stride, count_zeros, vector):
            return None
        return torch.from_numpy(vector).to(out_dtype)
    moments = _numpy_moments(values, array, count_zeros)
    if moments is None:
        return None
    total, total_squares, low, high, zeros = moments
    numel = array.size
    span = high - low  # a numpy scalar of the values' dtype, as the masked path computes it
    sample = array[::stride]
    if span > 0:
        # Every value is >= low, so truncation is floor; the minimum puts max in the last bucket.
        index = ((sample - low) / array.dtype.type(float(span) / bins)).astype(np.intp)
        np.minimum(index, bins - 1, out=index)
        counts = np.bincount(index, minlength=bins).astype(np.float64)
    else:
        counts = np.zeros(bins)
        counts[0] = sample.size
    if stride > 1:
        counts *= numel / sample.size
    header = [numel, 0, zeros, float(low), float(high), total, total_squares]
    return torch.from_numpy(np.concatenate([header, counts])).to(out_dtype)


def _numpy_moments(
    values: torch.Tensor, array: np.ndarray, count_zeros: bool
) -> tuple[float, float, np.generic, np.generic, float] | None:
    """``(sum, sum_squares, min, max, zeros)`` of a finite array, or ``None`` if it is not finite."""
    large = array.size >= _TORCH_REDUCTION_MIN
    total = values.sum().item() if large else float(array.sum(dtype=np.float64))
    with np.errstate(over="ignore"):  # an overflow to Inf sends the tensor to the float64 path
        total_squares = float(np.dot(array, array))
    if not math.isfinite(total + total_squares):
        return None
    if large:
        low_tensor, high_tensor = torch.aminmax(values)
        low, high = low_tensor.numpy()[()], high_tensor.numpy()[()]
    else:
        low, high = array.min(), array.max()
    zeros = _count_zeros(array, float(low), float(high)) if count_zeros else math.nan
    return total, total_squares, low, high, zeros


def summarize_many(
    tensors: Sequence[torch.Tensor],
    bins: int = 64,
    sample_size: int | None = DEFAULT_SAMPLE_SIZE,
    count_zeros: bool = True,
) -> list[torch.Tensor]:
    """``[summarize(t, bins, sample_size, count_zeros) for t in tensors]``, with the small ones done together.

    A model has dozens of biases and norm weights of a few hundred elements, where the cost
    of one :func:`summarize` call is all overhead. Small, finite float32/float64 CPU tensors
    of the same dtype are reduced in one set of NumPy calls over their concatenation;
    the others (and any with NaN or Inf) go through :func:`summarize` one by one. Sums and
    sums of squares are accumulated in float64.

    Example:
        >>> small, big = torch.arange(4.0), torch.ones(100_000)
        >>> [Summary.from_vector(v.tolist()).sum for v in summarize_many([small, big], bins=2)]
        [6.0, 100000.0]
    """
    vectors: list[torch.Tensor | None] = [None] * len(tensors)
    together: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        numel = tensor.numel()
        small = 0 < numel < _TORCH_REDUCTION_MIN and (sample_size is None or numel <= sample_size)
        if small and tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64):
            together.setdefault(tensor.dtype, []).append(index)
        else:
            vectors[index] = summarize(tensor, bins, sample_size, count_zeros)
    for indices in together.values():
        try:
            arrays = [tensors[i].detach().reshape(-1).numpy() for i in indices]
        except (RuntimeError, TypeError):  # tensor subclasses without a numpy view
            arrays = None
        found = _summarize_together(arrays, bins, count_zeros) if arrays else [None] * len(indices)
        for i, vector in zip(indices, found):
            vectors[i] = vector if vector is not None else summarize(tensors[i], bins, sample_size, count_zeros)
    return vectors  # type: ignore[return-value]


def _summarize_together(arrays: list[np.ndarray], bins: int, count_zeros: bool) -> list[torch.Tensor | None]:
    """Summary vectors of small 1-D arrays of one dtype, every element counted; ``None`` for any not finite."""
    sizes = np.array([array.size for array in arrays])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    flat = np.concatenate(arrays)
    wide = flat.astype(np.float64)
    totals = np.add.reduceat(wide, starts)
    squares = np.add.reduceat(wide * wide, starts)
    finite = np.isfinite(totals + squares)
    with np.errstate(invalid="ignore"):  # NaN in a tensor that is then left to summarize()
        lows, highs = np.minimum.reduceat(flat, starts), np.maximum.reduceat(flat, starts)
        spans = highs - lows
        zeros = np.add.reduceat(flat == 0, starts, dtype=np.int64) if count_zeros else np.full(len(arrays), np.nan)
        widths = (spans.astype(np.float64) / bins).astype(flat.dtype)  # as _summarize_finite_cpu's width
        constant = ~(spans > 0)
        widths[constant] = 1
        segment = np.repeat(np.arange(len(arrays)), sizes)
        # Every value is >= its low, so truncation is floor; the minimum puts max in the last bucket.
        index = ((flat - lows[segment]) / widths[segment]).astype(np.intp)
    np.minimum(index, bins - 1, out=index)
    index[constant[segment] | ~finite[segment]] = 0  # a constant tensor is one bucket
    counts = np.bincount(segment * bins + index, minlength=len(arrays) * bins).reshape(len(arrays), bins)
    table = np.empty((len(arrays), HEADER_SIZE + bins), dtype=np.float64)
    table[:, 0], table[:, 1], table[:, 2] = sizes, 0, zeros
    table[:, 3], table[:, 4], table[:, 5], table[:, 6] = lows, highs, totals, squares
    table[:, HEADER_SIZE:] = counts
    return [torch.from_numpy(row) if ok else None for row, ok in zip(table, finite)]


def _count_zeros(array: np.ndarray, low: float, high: float) -> int:
    """Exact zero count of a finite array. numpy counts a bool mask several times faster than torch."""
    if low > 0 or high < 0:
        return 0
    return int(np.count_nonzero(array == 0))


def _bucket_counts(
    values: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bins: int, stride: int, finite_count: torch.Tensor
) -> torch.Tensor:
    """Bucket counts of ``values[::stride]``, scaled so they add up to ``finite_count``. No host sync."""
    sample = values[::stride]
    weight = torch.isfinite(sample).to(sample.dtype)
    width = torch.where(high > low, (high - low) / bins, torch.ones_like(high))
    position = torch.nan_to_num((sample - low) / width, nan=0.0, posinf=0.0, neginf=0.0)
    index = position.floor_().clamp_(0, bins - 1).long()
    counts = torch.zeros(bins, dtype=sample.dtype, device=sample.device).scatter_add_(0, index, weight)
    if stride == 1:
        return counts
    sampled = weight.sum()
    return counts * (finite_count.to(sample.dtype) / sampled.clamp(min=1))


@dataclass(frozen=True)
class Summary:
    """Host-side numbers of one summarized tensor.

    ``num`` counts every element; ``min``, ``max``, ``sum``, ``sum_squares`` and the
    bucket counts are over the finite elements only.
    """

    num: int
    nonfinite: int
    zeros: int | None
    min: float
    max: float
    sum: float
    sum_squares: float
    bucket_counts: list[float]

    @classmethod
    def from_vector(cls, vector: list[float]) -> Summary:
        """Build from a summary vector already copied to the host (a list of floats)."""
        num, nonfinite, zeros, low, high, total, squares = vector[:HEADER_SIZE]
        zero_count = None if math.isnan(zeros) else int(zeros)
        return cls(int(num), int(nonfinite), zero_count, low, high, total, squares, list(vector[HEADER_SIZE:]))

    @property
    def finite_count(self) -> int:
        return self.num - self.nonfinite

    @property
    def mean(self) -> float:
        """Mean of the finite elements (NaN when there are none)."""
        return self.sum / self.finite_count if self.finite_count else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation (Bessel-corrected, like ``torch.std``) of the finite elements."""
        count = self.finite_count
        if count == 0:
            return math.nan
        if count == 1:
            return 0.0
        return math.sqrt(max(0.0, (self.sum_squares - self.sum * self.sum / count) / (count - 1)))

    @property
    def zero_fraction(self) -> float:
        """Fraction of all elements that are exactly zero (NaN for an empty tensor or uncounted zeros)."""
        return self.zeros / self.num if self.num and self.zeros is not None else math.nan

    @property
    def norm(self) -> float:
        """L2 norm of the finite elements."""
        return math.sqrt(max(0.0, self.sum_squares))

    @property
    def has_histogram(self) -> bool:
        """False for an empty or all-non-finite tensor, which gets scalars but no histogram."""
        return self.finite_count > 0

    def bucket_limits(self) -> list[float]:
        """Upper edge of each bucket, as TensorBoard's ``HistogramProto.bucket_limit`` wants."""
        width = (self.max - self.min) / len(self.bucket_counts)
        limits = [self.min + (i + 1) * width for i in range(len(self.bucket_counts))]
        limits[-1] = self.max
        return limits

    def histogram(self) -> tuple[list[float], list[float]]:
        """``(bucket_limits, bucket_counts)``; a constant tensor gets one bucket."""
        if self.max <= self.min:
            return [self.max], [float(self.finite_count)]
        return self.bucket_limits(), self.bucket_counts
