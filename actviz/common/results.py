"""What one step logs, on the host: :class:`Summary` per tensor and :class:`StepResults` per step.

Nothing here touches a device. The capture produces these (through
:mod:`actviz.output.pending_step`), the sinks consume them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .histogram_buckets import fixed_width_limits
from .pixels import PaletteImage

__all__ = ["HEADER_SIZE", "StepResults", "Summary"]

#: Numbers in front of the bucket counts in a summary vector (see :meth:`Summary.vector`).
HEADER_SIZE = 8


@dataclass(frozen=True)
class Summary:
    """Host-side numbers of one summarized tensor.

    ``num`` counts every element; ``min``, ``max``, ``sum``, ``sum_squares`` and the
    bucket counts are over the finite elements only. ``zeros`` is ``None`` where it
    was not counted. ``spread``, the sum of squared deviations of the finite elements
    from their mean, gives :attr:`std` without cancellation; ``None`` where unknown.
    """

    num: int
    nonfinite: int
    zeros: int | None
    min: float
    max: float
    sum: float
    sum_squares: float
    bucket_counts: list[float]
    spread: float | None = None

    @classmethod
    def from_vector(cls, vector: list[float]) -> Summary:
        """Build from a summary vector already on the host (a list of floats, see :meth:`vector`)."""
        num, nonfinite, zeros, low, high, total, squares, spread = vector[:HEADER_SIZE]
        zero_count = None if math.isnan(zeros) else int(zeros)
        spread = None if math.isnan(spread) else spread
        return cls(int(num), int(nonfinite), zero_count, low, high, total, squares, list(vector[HEADER_SIZE:]), spread)

    def vector(self) -> list[float]:
        """``[num, nonfinite, zeros, min, max, sum, sum_squares, spread, count_0, ..., count_{bins-1}]``.

        ``zeros`` and ``spread`` are NaN when unknown. :meth:`from_vector` reads it back.
        """
        zeros = math.nan if self.zeros is None else float(self.zeros)
        spread = math.nan if self.spread is None else float(self.spread)
        header = [float(self.num), float(self.nonfinite), zeros, self.min, self.max, self.sum, self.sum_squares, spread]
        return header + [float(count) for count in self.bucket_counts]

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
        if self.spread is not None:
            return math.sqrt(self.spread / (count - 1))
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

    def divided_by(self, factor: float) -> Summary:
        """The summary of this tensor divided by ``factor`` (an AMP loss scale): exact for a power of two."""
        return Summary(
            self.num, self.nonfinite, self.zeros, self.min / factor, self.max / factor, self.sum / factor,
            self.sum_squares / (factor * factor), self.bucket_counts,
            None if self.spread is None else self.spread / (factor * factor),
        )

    def bucket_limits(self) -> list[float]:
        """Upper edge of each bucket, as TensorBoard's ``HistogramProto.bucket_limit`` wants."""
        return fixed_width_limits(self.min, self.max, len(self.bucket_counts))

    def histogram(self) -> tuple[list[float], list[float]]:
        """``(bucket_limits, bucket_counts)``; a constant tensor gets one bucket."""
        if self.max <= self.min:
            return [self.max], [float(self.finite_count)]
        return self.bucket_limits(), self.bucket_counts


@dataclass
class StepResults:
    """Everything one step logs, on the host. Keys are tag suffixes (layer or parameter names)."""

    step: int
    activations: dict[str, Summary] = field(default_factory=dict)
    gradients: dict[str, Summary] = field(default_factory=dict)
    weights: dict[str, Summary] = field(default_factory=dict)
    weight_grads: dict[str, Summary] = field(default_factory=dict)
    images: dict[str, torch.Tensor | PaletteImage] = field(default_factory=dict)  # feature_maps/{layer}; heat maps: PaletteImage
    pictures: dict[str, torch.Tensor] = field(default_factory=dict)  # full tags: probe/input, gradcam/{layer}
    scalars: dict[str, float] = field(default_factory=dict)  # full tags, e.g. "amp/grad_scale"
    texts: dict[str, str] = field(default_factory=dict)  # full tags, e.g. "layers": markdown
    histograms: dict[str, Summary] = field(default_factory=dict)  # full tags: attention/head_max_logit@{layer}
    # Per-layer statistics' values (actviz.statistics): statistic name -> layer -> value name -> value. What the alerts
    # read; the values a statistic writes are in scalars too, under their tags
    layer_values: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # Alerts found while the step was finished on the host (the transformer rules): actviz.diagnosis.alerts.Alert objects,
    # which the health monitor reports with its own (written as the "alerts" text, never as a tag of their own)
    alerts: list[Any] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.activations or self.gradients or self.weights or self.weight_grads or self.images or self.pictures
            or self.scalars or self.texts or self.histograms
        )

    def statistics(self) -> dict[str, dict[str, float]]:
        """Every summary's numbers, by full tag: ``count``, ``mean``, ``std``, ``min``, ``max``, ``norm``, ``nonfinite``.

        Example:
            >>> results = StepResults(7, activations={"fc": Summary(4, 1, 0, -1.0, 2.0, 1.0, 5.0, [1.0, 2.0])})
            >>> results.statistics()["activations/fc"]["nonfinite"], results.statistics()["activations/fc"]["max"]
            (1, 2.0)
        """
        found = {}
        for kind in ("activations", "gradients", "weights", "weight_grads"):
            for name, summary in getattr(self, kind).items():
                found[f"{kind}/{name}"] = {
                    "count": summary.num, "mean": summary.mean, "std": summary.std, "min": summary.min,
                    "max": summary.max, "norm": summary.norm, "nonfinite": summary.nonfinite,
                }
        return found
