"""The summary header: one row of numbers per tensor, its layout written here once and decoded here once.

Layout. Every path that reduces a tensor (eager, compiled, many parameters at once, the
CPU shortcut, ``merge_ranks``) writes the same :data:`FIELDS`, in this order, as floats
(float64, or float32 where that is exact: a float32 tensor under 2**24 elements on the eager
path, and anything on MPS), about ``z``, the tensor with NaN and ±Inf replaced by 0:

=================  =================================================================
``nonzero``        elements ``!= 0`` (NaN and ±Inf count); NaN where not counted
``finite_nonzero`` finite elements ``!= 0``; NaN where not counted
``mean``           mean of ``z`` over all ``numel`` elements
``variance``       population variance of ``z`` over all ``numel`` elements
``min``, ``max``   of the finite elements, on every path; ``+inf``/``-inf`` where none
=================  =================================================================

``numel`` stays on the host. A tensor's row lives in a device tensor: alone (a 1-D row,
possibly followed by its sample) or as row ``index`` of a ``(k, len(FIELDS))`` matrix
(a step's small tensors, or parameters, reduced together). :func:`decode` turns a row into
the numbers of a :class:`~actviz.common.results.Summary`; :func:`actviz.summaries.one_tensor.finish` adds the
bucket counts. To add a statistic, add its name to :data:`FIELDS` (its column follows) and
compute it where the rows are made (:mod:`actviz.summaries.one_tensor`, :mod:`actviz.summaries.small_tensors`,
:mod:`actviz.summaries.many_tensors`, :mod:`actviz.summaries.piecewise`, :mod:`actviz.summaries.cpu_shortcut`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["FIELDS", "HEADER", "Reduction", "decode", "wide_dtype"]

#: The header's columns, in order. Adding one is adding a name here and computing it where rows are made.
FIELDS = ("nonzero", "finite_nonzero", "mean", "variance", "min", "max")
#: Numbers in a header row.
HEADER = len(FIELDS)


class Reduction:
    """One tensor reduced on its device: its header row and its strided sample.

    Args:
        numel: Elements of the tensor.
        stride: The sample's stride.
        header: The tensor (or, on the CPU shortcut, a list of floats) holding the row.
        index: Which row of ``header`` (a 2-D matrix), or 0 for a 1-D row.
        sample: The tensor holding the sample, flat, at ``[start, stop)``.
        extra: The names of the numbers after the header in a 1-D row: the one-pass op's outlier fields
            (:data:`~actviz.summaries.one_pass.OUTLIER_FIELDS`) and unit fraction, read by :meth:`extra_fields`.
        strengths: Where the one-pass op was asked for them, each channel's mean ``|x|`` over sample 0, on the tensor's
            device (:func:`~actviz.summaries.one_pass.channel_strength`): what picks the channels of its picture.

    Example:
        >>> row = torch.tensor([3.0, 2.0, 0.25, 1.1875, -1.0, 2.0], dtype=torch.float64)
        >>> reduction = Reduction(4, 1, row, 0, torch.tensor([0.0, 2.0, float("nan"), -1.0]), 0, 4)
        >>> reduction.numbers()[:4]  # nonfinite, zeros, min, max
        (1, 1, -1.0, 2.0)
    """

    __slots__ = ("counts", "extra", "header", "index", "numel", "sample", "start", "stop", "stride", "strengths")

    def __init__(
        self, numel: int, stride: int, header: Any, index: int, sample: Any, start: int, stop: int,
        extra: tuple[str, ...] = (), strengths: Any = None,
    ) -> None:
        self.numel = numel
        self.stride = stride
        self.header = header
        self.index = index
        self.sample = sample
        self.start = start
        self.stop = stop
        self.extra = extra
        self.strengths = strengths
        self.counts: Any = None  # bucket counts merged across ranks (actviz.summaries.merge_ranks), else counted from the sample

    def row(self) -> list[float]:
        """The header row as floats (the header on the host)."""
        return self.row_tensor().tolist() if isinstance(self.header, torch.Tensor) else list(self.header)

    def row_tensor(self) -> torch.Tensor:
        """The header row as a 1-D tensor where the header tensor is."""
        flat = self.header.reshape(-1)
        return flat[self.index * HEADER : self.index * HEADER + HEADER]

    def extra_fields(self, names: tuple[str, ...]) -> torch.Tensor | None:
        """The numbers ``names`` of those after the header, a view on the device; ``None`` unless the row has
        them, in that order."""
        if not names or names[0] not in self.extra:
            return None
        start = self.extra.index(names[0])
        if self.extra[start : start + len(names)] != names:
            return None
        return self.header[HEADER + start : HEADER + start + len(names)]

    def sample_values(self) -> torch.Tensor:
        """The sample, a 1-D view of the tensor that holds it."""
        return self.sample.reshape(-1)[self.start : self.stop]

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors to copy to the host (header and sample may be one tensor)."""
        found = [] if not isinstance(self.header, torch.Tensor) else [self.header]
        if self.sample is not self.header:
            found.append(self.sample)
        if self.counts is not None:
            found.append(self.counts)
        return found

    def receive(self, host: dict[int, torch.Tensor]) -> None:
        """Replace the device tensors by their host copies, found by ``id`` of the device tensor."""
        if isinstance(self.header, torch.Tensor):
            self.header = host.get(id(self.header), self.header)
        self.sample = host.get(id(self.sample), self.sample)
        if self.counts is not None:
            self.counts = host.get(id(self.counts), self.counts)

    def numbers(self) -> tuple[int, int | None, float, float, float, float, float]:
        """:func:`decode` of this reduction's row: ``(nonfinite, zeros, min, max, sum, sum_squares, spread)``."""
        return decode(self.row(), self.numel)


def decode(row: list[float], numel: int) -> tuple[int, int | None, float, float, float, float, float]:
    """Numbers of one header row: ``(nonfinite, zeros, min, max, sum, sum_squares, spread)``.

    ``sum``, ``sum_squares`` and ``spread`` (the sum of squared deviations from their mean)
    are over the finite elements; ``zeros`` is ``None`` where it was not counted.

    Example:
        >>> decode([3.0, 2.0, 0.25, 1.1875, -1.0, 2.0], 4)  # z = [0, 2, 0 (for a NaN), -1]
        (1, 1, -1.0, 2.0, 1.0, 5.0, 4.666666666666667)
    """
    nonzero, finite_nonzero, mean, variance, low, high = row[:HEADER]
    counted = not math.isnan(nonzero)
    nonfinite = int(nonzero - finite_nonzero) if counted else 0
    zeros = int(numel - nonzero) if counted else None
    finite = numel - nonfinite
    total = mean * numel
    centered = max(0.0, variance * numel)
    squares = centered + mean * total
    spread = centered
    if nonfinite:  # the 0s put in for NaN/Inf are in the moments of z: take them out
        finite_mean = total / finite if finite else 0.0
        spread = max(0.0, centered - nonfinite * mean * mean - finite * (finite_mean - mean) ** 2)
    return nonfinite, zeros, low, high, total, squares, spread


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype header rows and moments are taken in on ``device``: float64, or float32 on MPS (no float64 there)."""
    return torch.float32 if device.type == "mps" else torch.float64
