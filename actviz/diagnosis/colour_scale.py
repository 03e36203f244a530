"""The log colour scale of the flow pictures and of the actviz tab: whole decades, from a floor.

A statistic's scale spans the decades of its finite positive values, but never below its floor
(:data:`BAR_FLOORS`): a zero fraction of 1e-6 (one zero in a million elements) is noise, so it takes the
darkest colour instead of being the brightest cell of a scale from 1e-7 to 1e-6. A fraction's scale ends
at 1 (:data:`FRACTIONS`). :func:`actviz.diagnosis.flow.draw_flow` and :mod:`actviz.view.run_data` use it.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["BAR_FLOORS", "FRACTIONS", "colour_bar_range", "colour_floor"]

#: The lowest decade a colour scale of these statistics shows (by the last part of their name): a zero fraction
#: under 1e-3 (one element in a thousand) or an update ratio under 1e-6 is noise and takes the darkest colour,
#: not the brightest when nothing is larger. A zero fraction's scale ends at 1 (``FRACTIONS``).
BAR_FLOORS = {"zero_fraction": -3, "update_ratio": -6}
FRACTIONS = frozenset({"zero_fraction"})


def colour_floor(statistic: str) -> float:
    """The smallest value a colour scale of ``statistic`` (``zero_fraction``, ``activation_stats/zero_fraction``)
    tells from zero: :data:`BAR_FLOORS`, or 0 (a gradient norm of 1e-9 beside 1e-2 is news: it vanished).

    Example:
        >>> colour_floor("activation_stats/zero_fraction"), colour_floor("gradient_norm")
        (0.001, 0.0)
    """
    decade = BAR_FLOORS.get(statistic.rsplit("/", 1)[-1])
    return 0.0 if decade is None else 10.0 ** decade


def colour_bar_range(values: np.ndarray, statistic: str = "") -> tuple[int, int]:
    """Whole decades ``(low, high)`` spanning the finite positive ``values`` of ``statistic`` above its
    :func:`colour_floor` (``(-1, 0)`` if none); a fraction's ends at 1.

    Example:
        >>> colour_bar_range(np.array([0.003, 0.5, np.nan, 0.0]))
        (-3, 0)
        >>> colour_bar_range(np.array([0.0, 1e-6]), "zero_fraction")  # noise: below the scale, the darkest colour
        (-3, 0)
    """
    fraction = statistic.rsplit("/", 1)[-1] in FRACTIONS
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size == 0:
        return (-1, 0) if not fraction else (BAR_FLOORS["zero_fraction"], 0)
    largest = float(positive.max())
    low = math.floor(math.log10(max(float(positive.min()), colour_floor(statistic))))
    high = 0 if fraction else math.ceil(math.log10(largest))
    return low, max(high, low + 1)
