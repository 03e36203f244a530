"""One op that summarizes tensors, each from one read: ``torch.ops.actviz.summarize``.

``summarize(tensors, strides, outliers)`` takes 1-D tensors of one device and dtype (one layer output, or a
step's parameters) and returns one float64 tensor (float32 on MPS): a row of numbers per tensor, then each
tensor's strided sample (``tensor[::stride]``). A row is the summary header of :mod:`actviz.summaries.header`
(six numbers: ``nonzero``, ``finite_nonzero``, ``mean``, ``variance``, ``min``, ``max``), followed, with
``outliers=True``, by :data:`OUTLIER_FIELDS`: the device half of :class:`~actviz.statistics.outliers.Outliers`,
and, where ``units`` asks (one tensor), by one unit fraction: the device half of
:class:`~actviz.statistics.unit_counts.DeadChannels` or :class:`~actviz.statistics.unit_counts.Saturation`
(:func:`unit_fraction`). Where ``channels`` gives a 4-D output's channel layout (:func:`channel_layout`), the
op's output ends with the strength of each channel of sample 0 (:func:`channel_strength`): what picks the
channels of its feature-map grid, from the same read.

It is a ``torch.library`` op, so a ``TorchDispatchMode`` (the op and byte budgets of the tests,
``scripts/count_device_ops.py``) sees one op with the tensors as its inputs and the rows as its output.
Its bodies:

* on CUDA, where Triton is installed (it comes with PyTorch's CUDA wheels): two Triton kernels that read
  each tensor once where it lies (:mod:`actviz.summaries.one_pass_triton`); on the CPU too, where
  ``TRITON_INTERPRET=1`` was set before actviz was imported, which is how the test suite checks the kernels
  without a GPU;
* everywhere else (the CPU, MPS, a GPU without Triton, float8 tensors): the eager torch ops of
  :func:`header_sums` (in float64 pieces for a tensor over :data:`~actviz.summaries.piecewise.PIECE` elements)
  and :func:`~actviz.summaries.outlier_moments.outlier_moments`, several passes.

Example:
    >>> row = torch.ops.actviz.summarize([torch.tensor([0.0, 2.0, float("nan"), -1.0])], [2], False)
    >>> row.tolist()  # nonzero, finite nonzero, mean and variance of z = [0, 2, 0, -1], min, max; then x[::2]
    [3.0, 2.0, 0.25, 1.1875, -1.0, 2.0, 0.0, nan]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from ..common.torch_ops import define_op, triton_runs_on
from . import piecewise
from .header import HEADER, wide_dtype
from .outlier_moments import OUTLIER_THRESHOLD, outlier_moments

__all__ = [
    "OUTLIER_FIELDS", "OUTLIER_THRESHOLD", "SUMMARIZE", "TRITON_DTYPES", "UNIT_FIELDS", "channel_layout", "channel_strength",
    "eager_summarize", "header_sums", "row_width", "summarize", "triton_body", "unit_fraction",
]

#: The numbers ``outliers=True`` adds to a row: ``max |x|`` (NaN left out), the count of ``|x| >=``
#: :data:`OUTLIER_THRESHOLD`, and ``Σ(z-μ)²`` and ``Σ(z-μ)⁴`` about the mean ``μ`` of ``z``.
OUTLIER_FIELDS = ("max_abs", "outliers", "centred_squares", "centred_fourths")
#: The number ``units`` adds to a row, after the outlier numbers: :func:`unit_fraction`.
UNIT_FIELDS = ("unit_fraction",)
#: The dtypes the Triton body reads; others take the eager body.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def row_width(outliers: bool, units: bool = False) -> int:
    """Numbers in one tensor's row: the header, the outlier numbers if asked, the unit fraction if asked."""
    return HEADER + (len(OUTLIER_FIELDS) if outliers else 0) + (1 if units else 0)


def _sample_size(size: int, stride: int) -> int:
    return -(-size // stride)


@functools.cache
def triton_body():
    """:func:`~actviz.summaries.one_pass_triton.summarize_tensors`, or ``None`` where Triton is not installed."""
    try:
        from . import one_pass_triton
    except Exception:  # noqa: BLE001 - no Triton (or a broken one): the eager body
        return None
    return one_pass_triton.summarize_tensors


def _takes_triton(tensors: Sequence[torch.Tensor], units: Sequence[float] = (), channels: Sequence[int] = ()) -> bool:
    first = tensors[0]
    if first.dtype not in TRITON_DTYPES or not all(tensor.is_contiguous() for tensor in tensors):
        return False
    if not (triton_runs_on(first.device) and triton_body() is not None):
        return False
    return not channels or int(channels[0]) * int(channels[1]) < 2**31 - 2**16  # sample 0 within 32-bit offsets


def summarize(tensors: Sequence[torch.Tensor], strides: Sequence[int], outliers: bool,
              units: Sequence[float] = (), channels: Sequence[int] = ()) -> torch.Tensor:
    """Rows and samples of ``tensors`` (see the module docstring): 1-D, non-empty, of one device and dtype."""
    if (units or channels) and len(tensors) != 1:
        raise ValueError(f"units and channel strengths are counted for one tensor at a time, got {len(tensors)}")
    width = row_width(outliers, bool(units))
    if _takes_triton(tensors, units, channels):
        from .one_pass_tables import CaptureNeedsTables, takes_units
        try:
            if takes_units(tuple(units), tensors[0].numel()):
                return triton_body()(list(tensors), tuple(strides), width, OUTLIER_THRESHOLD, outliers, tuple(units),
                                     tuple(channels))
            # Dead channels past the kernels' histogram (over 4,096 channels, channels-last or short): counted eagerly.
            out = triton_body()(list(tensors), tuple(strides), width - 1, OUTLIER_THRESHOLD, outliers, (), tuple(channels))
        except CaptureNeedsTables:  # the first step of these tensors inside a CUDA graph capture
            return eager_summarize(tensors, strides, outliers, units, channels)
        fraction = unit_fraction(tensors[0], units).to(out.dtype).view(1)
        return torch.cat([out[: width - 1], fraction, out[width - 1:]])
    return eager_summarize(tensors, strides, outliers, units, channels)


def _fake_summarize(tensors: Sequence[torch.Tensor], strides: Sequence[int], outliers: bool,
                    units: Sequence[float] = (), channels: Sequence[int] = ()) -> torch.Tensor:
    total = len(tensors) * row_width(outliers, bool(units)) + sum(map(_sample_size, (t.numel() for t in tensors), strides))
    return tensors[0].new_empty(total + (channels[0] if channels else 0), dtype=wide_dtype(tensors[0].device))


#: The op, as actviz's reductions call it (:func:`~actviz.common.torch_ops.define_op`).
SUMMARIZE = define_op(
    "summarize", "summarize(Tensor[] tensors, int[] strides, bool outliers, float[] units=[], int[] channels=[]) -> Tensor",
    summarize, _fake_summarize)


def channel_layout(tensor: torch.Tensor, sequence: bool = False) -> tuple[int, int, int] | None:
    """How a layer output's channels lie in its memory order: ``(channels, spatial, channels_last)``, or ``None`` for
    a layout the one-pass op does not read by channel (fewer than 3 dimensions, neither contiguous nor channels-last).

    With ``sequence``, a 3-D output is ``(batch, positions, features)``, as a transformer's or an RNN's layers give
    it: its channels are its last dimension, channels-last in memory where it is contiguous.

    Example:
        >>> channel_layout(torch.zeros(2, 3, 4, 5)), channel_layout(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
        ((3, 20, 0), (3, 20, 1))
        >>> channel_layout(torch.zeros(2, 7, 128), sequence=True)  # 128 features at each of 7 positions
        (128, 7, 1)
    """
    if tensor.dim() < 3 or tensor.numel() == 0:
        return None
    if sequence and tensor.dim() == 3:
        return (tensor.shape[2], tensor.shape[1], 1) if tensor.is_contiguous() else None
    channels = tensor.shape[1]
    spatial = tensor.numel() // (tensor.shape[0] * channels)
    if tensor.is_contiguous():
        return channels, spatial, 0
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return channels, spatial, 1
    return None


def eager_summarize(tensors: Sequence[torch.Tensor], strides: Sequence[int], outliers: bool,
                    units: Sequence[float] = (), channels: Sequence[int] = ()) -> torch.Tensor:
    """The op's eager body: per tensor, :func:`header_sums` (a tensor over
    :data:`~actviz.summaries.piecewise.PIECE` elements a piece at a time, so that its float64 temporaries stay
    a piece's size) and, with ``outliers``, :func:`~actviz.summaries.outlier_moments.outlier_moments`."""
    wide = wide_dtype(tensors[0].device)
    rows, samples = [], []
    for segment, stride in zip(tensors, strides):
        readable = segment if segment.dtype in TRITON_DTYPES else segment.float()  # float8: no nan_to_num, no abs
        if readable.numel() > piecewise.PIECE:
            rows.append(piecewise.reduce_in_pieces(readable, wide))
        else:
            rows.append(header_sums(readable))
        if outliers:
            rows.append(outlier_moments(readable).to(wide))
        if units:
            rows.append(unit_fraction(readable, units).to(wide).view(1))
        samples.append(segment[::stride].to(wide))
    if channels:  # one tensor: readable is its own
        samples.append(channel_strength(readable, channels).to(wide))
    return torch.cat(rows + samples)


def channel_strength(values: torch.Tensor, channels: Sequence[int]) -> torch.Tensor:
    """The mean ``|x|`` of each channel of sample 0 (NaN and ±Inf count as 0), from a 1-D tensor in memory order
    laid out as ``channels`` says (:func:`channel_layout`), in float64 (float32 on MPS): the strongest channels are the ones a
    feature-map grid draws (:func:`~actviz.pictures.rendering.select_channels`).

    Example:
        >>> values = torch.tensor([1.0, -3.0, float("nan"), 2.0, 9.0, 9.0, 9.0, 9.0])  # 2 samples of (2 channels, 2)
        >>> channel_strength(values, (2, 2, 0)).tolist(), channel_strength(values, (2, 2, 1)).tolist()
        ([2.0, 1.0], [0.5, 2.5])
    """
    count, spatial, channels_last = int(channels[0]), int(channels[1]), bool(channels[2])
    first = values[: count * spatial].abs()
    magnitudes = torch.where(first < math.inf, first, 0).to(wide_dtype(values.device))
    if channels_last:  # (positions, channels) in memory
        return magnitudes.view(spatial, count).sum(dim=0) / spatial
    return magnitudes.view(count, spatial).sum(dim=1) / spatial


def unit_fraction(values: torch.Tensor, units: Sequence[float]) -> torch.Tensor:
    """The eager unit count of a 1-D tensor in memory order: ``(1, channels, spatial, channels_last)``, the
    fraction of channels with no non-zero element; ``(2, centre, bound)``, the fraction of elements farther than
    ``bound`` from ``centre``.

    Example:
        >>> unit_fraction(torch.tensor([0.0, 0.0, 1.0, 0.0]), (1, 2, 1, 0)).item()  # (2 samples, 2 channels)
        0.5
    """
    if int(units[0]) == 1:
        channels, spatial, channels_last = int(units[1]), int(units[2]), bool(units[3])
        if channels_last:  # (positions, channels) in memory
            alive = (values.view(-1, channels) != 0).any(dim=0)
        else:  # (samples, channels, positions)
            alive = (values.view(-1, channels, spatial) != 0).any(dim=2).any(dim=0)
        return torch.mean(~alive, dtype=wide_dtype(values.device))
    return torch.mean((values - units[1]).abs() > units[2], dtype=wide_dtype(values.device))


def header_sums(values: torch.Tensor) -> torch.Tensor:
    """The header row (see :mod:`actviz.summaries.header`) in one pass, written to be compiled into one loop.

    Sums accumulated in float64 about the first element of ``z`` (the values with NaN and
    ±Inf replaced by 0), so that a large offset cancels nothing; counts in int32 (exact
    below 2**31 elements; :func:`eager_summarize` takes tensors over 4 M elements a piece at a time);
    min and max of the finite elements. Eagerly this is a dozen ops; :mod:`actviz.summaries.fused`
    compiles it, and Inductor reads the tensor once.

    Example:
        >>> header_sums(torch.tensor([0.0, 2.0, float("nan"), -1.0])).tolist()
        [3.0, 2.0, 0.25, 1.1875, -1.0, 2.0]
    """
    wide = wide_dtype(values.device)
    if not values.is_floating_point():
        values = values.to(wide)
    finite = values.abs() < math.inf  # NaN < inf is false
    zeroed = torch.where(finite, values, 0)
    widened = zeroed.to(wide)
    shifted = widened - widened[0]
    count = values.numel()
    first, second = shifted.sum() / count, (shifted * shifted).sum() / count
    counts = [(values != 0).sum(dtype=torch.int32).to(wide), (zeroed != 0).sum(dtype=torch.int32).to(wide)]
    bounds = [torch.where(finite, values, math.inf).amin().to(wide), torch.where(finite, values, -math.inf).amax().to(wide)]
    return torch.stack([*counts, widened[0] + first, (second - first * first).clamp_min(0), *bounds])
