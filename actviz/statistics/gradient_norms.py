"""The norm and non-finite count of each output gradient, the statistic :class:`GradientNorms`.

Per summarized gradient with respect to a watched layer's output, from the header row its summary reads anyway
(:mod:`actviz.summaries.header`), with no op and no copy of its own:

* ``norm``: the L2 norm of the finite elements;
* ``nonfinite``: how many are NaN or ±Inf.

They are written as ``gradient_stats/norm@{layer}`` and ``nonfinite@{layer}``; the last only from the first step where it
is not zero (:data:`actviz.tags.ONCE_NOT_ZERO`).
"""

from __future__ import annotations

from ..common.results import Summary
from .layer_statistic import LayerStatistic

__all__ = ["GradientNorms"]


class GradientNorms(LayerStatistic):
    """L2 norm and non-finite count of each summarized output gradient, taken from its summary.

    Example:
        >>> GradientNorms().from_layer_summary(Summary(3, 1, 0, -4.0, 3.0, -1.0, 25.0, [1.0, 1.0]))
        {'norm': 5.0, 'nonfinite': 1.0}
    """

    name = "gradient_norms"
    names = ("norm", "nonfinite")
    target = "output_gradient"
    reads_summary = True
    cost = "none: the summary's header"

    def from_layer_summary(self, summary: Summary) -> dict[str, float]:
        return {"norm": summary.norm, "nonfinite": float(summary.nonfinite)}
