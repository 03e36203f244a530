"""A tensor reduced on its device: the device half of a summary, until the host finishes it.

:func:`actviz.summaries.reduce_tensor` and its kin make :class:`Reduction` objects inside
the hooks; :class:`actviz.transfer.PendingStep` brings their tensors to the host in one
copy per step; :func:`actviz.summaries.finish` turns each into a
:class:`~actviz.results.Summary`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Reduction"]


@dataclass
class Reduction:
    """One tensor reduced on its device: a few numbers and a strided sample.

    ``header`` holds 0-dim tensors on the device until the step's copy to the host
    (:meth:`receive`), then host values; ``form`` says what they are (see :meth:`numbers`).

    Example:
        >>> reduction = Reduction(4, 1, "sums", [torch.tensor(3.0), torch.tensor(2.0), torch.tensor(1.0),
        ...                       torch.tensor(5.0), torch.tensor(-1.0), torch.tensor(2.0)], torch.zeros(4))
        >>> reduction.numbers()  # nonfinite, zeros, min, max, sum, sum of squares
        (1.0, 1, -1.0, 2.0, 1.0, 5.0)
    """

    numel: int
    stride: int
    form: str
    header: list[Any]
    sample: Any
    counts: Any = None  # bucket counts merged across ranks (actviz.merge), else counted from the sample

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors still to be copied to the host: the header's, the sample, merged counts."""
        if self.form == "numbers":
            return []
        return [*self.header, self.sample] + ([] if self.counts is None else [self.counts])

    def receive(self, host_tensors: Any) -> None:
        """Take this reduction's tensors back, in :meth:`device_tensors` order, from an iterator."""
        if self.form != "numbers":
            self.header = [float(next(host_tensors)) for _ in self.header]
            self.sample = next(host_tensors)
            if self.counts is not None:
                self.counts = next(host_tensors)
            if self.form == "merged":  # every rank's elements
                self.numel = int(self.header[0])

    def numbers(self) -> tuple[float, int | None, float, float, float, float]:
        """``(nonfinite, zeros, min, max, sum, sum_squares)`` on the host, min and max still raw."""
        header, numel = self.header, self.numel
        if self.form == "numbers":  # the CPU shortcut's: already these
            return tuple(header)  # type: ignore[return-value]
        header = [float(value) for value in header]  # 0-dim host tensors or floats
        nonzero, finite_nonzero = header[0], header[1]
        if self.form == "merged":  # numel, nonzero, finite_nonzero, sum, sum_squares, min, max
            nonzero, finite_nonzero = header[1], header[2]
            total, squares, low, high = header[3:7]
        elif self.form == "var_mean":
            variance, mean = header[2], header[3]
            total, squares, low, high = mean * numel, (variance + mean * mean) * numel, header[4], header[5]
        elif self.form == "sums":
            total, squares, low, high = header[2:6]
        else:  # "split_sums", from reduce_tensors: sum = 2 * sum(relu) - sum(abs)
            positive, absolute, squares, high, negated_low = header[2:7]
            total, low = 2 * positive - absolute, -negated_low
        return nonzero - finite_nonzero, int(numel - nonzero), low, high, total, squares
