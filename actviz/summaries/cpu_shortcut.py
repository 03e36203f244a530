"""The CPU shortcut: a float32 or float64 CPU tensor's summary read at once, moments in float64 about the mean.

On the CPU the numbers are on the host already, so NumPy (or torch's threaded reductions
for large tensors) reads them directly instead of the accelerator path's ops, and a tensor
with NaN or ±Inf is reduced over its finite elements. ``ACTVIZ_CPU_SHORTCUTS=0`` turns it
off (:func:`actviz.options.cpu_shortcuts`).

Example:
    >>> reduction = reduce_on_cpu(torch.tensor([1.0, float("nan"), 3.0]), 1, True)
    >>> reduction.header  # the header's layout (actviz.summaries.header): about z, NaN replaced by 0
    [3, 2, 1.3333333333333333, 1.5555555555555556, 1.0, 3.0]
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .header import Reduction

__all__ = ["reduce_on_cpu"]

#: From this many elements on, torch's threaded reductions beat NumPy's in the CPU shortcut.
_TORCH_REDUCTION_MIN = 1 << 15


def reduce_on_cpu(values: torch.Tensor, stride: int, count_zeros: bool) -> Reduction | None:
    """The CPU shortcut for a float32/float64 tensor; ``None`` for any other.

    Moments in float64, about the mean (no cancellation, whatever the offset); a tensor
    with NaN or ±Inf is reduced over its finite elements, on the host.
    """
    if values.dtype not in (torch.float32, torch.float64):
        return None
    try:
        array = values.numpy()
    except (RuntimeError, TypeError):  # a tensor subclass without a NumPy view
        return None
    numel = array.size
    large = numel >= _TORCH_REDUCTION_MIN  # torch's threaded reductions
    with np.errstate(over="ignore", invalid="ignore"):
        if large:
            squares, total = float(torch.dot(values, values)), float(values.sum())
        else:
            squares, total = float(np.dot(array, array)), float(array.sum(dtype=np.float64))
    mean = total / numel
    variance = squares / numel - mean * mean
    nonfinite = 0
    finite = array
    if not (math.isfinite(total) and math.isfinite(squares)):  # NaN, ±Inf or float32 squares past 3.4e38
        mask = np.isfinite(array)
        finite = array[mask]
        nonfinite = numel - finite.size
        if not finite.size:
            return None
        mean, variance = _centred(np.where(mask, array, 0).astype(np.float64), numel)  # rare: float64 is fine
    elif not variance > 0.5 * (squares / numel):  # a mean large against the spread: the sums cancel, centre them
        mean, variance = _centred(array, numel)
    if finite.size >= _TORCH_REDUCTION_MIN and finite is array:
        low, high = (float(bound) for bound in torch.aminmax(values))
    else:
        low, high = float(finite.min()), float(finite.max())
    nonzero = math.nan
    if count_zeros or nonfinite:
        nonzero = numel - (0 if low > 0 or high < 0 else int(np.count_nonzero(finite == 0)))
    header = [nonzero, nonzero - nonfinite, mean, variance, low, high]
    sample = torch.from_numpy(array[::stride].copy())  # a copy: a later in-place op must not change it
    return Reduction(numel, stride, header, 0, sample, 0, sample.numel())


def _centred(array: np.ndarray, numel: int) -> tuple[float, float]:
    """Mean and population variance in float64 about the mean: exact whatever the offset (mean 1e4, std 1)."""
    mean = float(array.sum(dtype=np.float64)) / numel
    with np.errstate(over="ignore", invalid="ignore"):
        shift = array.dtype.type(mean)  # in the array's dtype: x - shift is exact near the mean, no wide copy
        deviation = array - shift
        residual = float(deviation.sum(dtype=np.float64)) / numel  # what rounding the shift left
        squares = float(np.square(deviation, out=deviation).sum(dtype=np.float64)) / numel
    return float(shift) + residual, max(0.0, squares - residual * residual)
