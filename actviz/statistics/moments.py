"""The moments of a layer's output, the statistic :class:`Moments`: the numbers of its summary's header.

Per summarized output ``x`` (``n`` elements), from the header row the summary reads anyway
(:mod:`actviz.summaries.header`), with no op and no copy of its own:

* ``mean`` and ``std`` (Bessel-corrected) of the finite elements;
* ``zero_fraction``: the fraction of all elements that are exactly zero;
* ``nonfinite``: how many are NaN or ±Inf.

They are written as ``activation_stats/mean@{layer}``, ``std@``, ``zero_fraction@`` and
``nonfinite@``; the last two only from the first step where they are not zero
(:data:`actviz.tags.ONCE_NOT_ZERO`).
"""

from __future__ import annotations

from ..common.results import Summary
from .layer_statistic import LayerStatistic

__all__ = ["Moments"]


class Moments(LayerStatistic):
    """Mean, std, zero fraction and non-finite count of each summarized output, taken from its summary.

    Example:
        >>> Moments().from_layer_summary(Summary(4, 1, 1, 0.0, 2.0, 3.0, 5.0, [2.0, 1.0]))
        {'mean': 1.0, 'std': 1.0, 'zero_fraction': 0.25, 'nonfinite': 1.0}
    """

    name = "moments"
    names = ("mean", "std", "zero_fraction", "nonfinite")
    reads_summary = True
    cost = "none: the summary's header"

    def from_layer_summary(self, summary: Summary) -> dict[str, float]:
        return {"mean": summary.mean, "std": summary.std, "zero_fraction": summary.zero_fraction,
                "nonfinite": float(summary.nonfinite)}
