"""Layers x steps onto at most a few hundred columns: what the heat map of the actviz tab draws.

A run's steps (every step any layer logged) are cut into at most ``columns`` bins of consecutive steps, as
even in count as they divide. Each cell keeps two numbers of its layer's values in the bin: the **max**, so that
a spike in one step of a bin still shows, and the **last**, what the layer ended the bin with. A NaN in a bin
makes its max NaN: a non-finite value is never hidden. With as many columns as steps each cell is one value,
unchanged.

Example:
    >>> bins = bin_steps({"a": ([0, 1, 2, 3], [1.0, 5.0, 2.0, 3.0]), "b": ([1], [7.0])}, ["a", "b"], columns=2)
    >>> bins.first_steps, bins.last_steps
    ([0, 2], [1, 3])
    >>> bins.matrix_json("max"), bins.matrix_json("last")
    ('[[5,3],[7,null]]', '[[5,3],[7,null]]')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_COLUMNS", "Bins", "bin_steps", "json_number", "number_json"]

#: The most step columns a heat map gets: about one per screen pixel of a laptop's plot.
MAX_COLUMNS = 500


@dataclass
class Bins:
    """The heat map of one statistic: per layer (rows) and bin (columns) the max and the last value; ``empty``
    marks the cells with none."""

    first_steps: list[int]
    last_steps: list[int]
    max: np.ndarray
    last: np.ndarray
    empty: np.ndarray

    def matrix_json(self, which: str) -> str:
        """``max`` or ``last`` as JSON rows, each number to float32's 9 digits (the event file keeps float32), a cell
        with no value ``null``, NaN and infinities as :func:`json_number` writes them."""
        table = self.max if which == "max" else self.last
        rows = []
        for values, empty in zip(table.tolist(), self.empty):
            if empty.any() or not all(map(math.isfinite, values)):
                rows.append(",".join("null" if gone else number_json(value) for value, gone in zip(values, empty)))
            else:  # the common case, with no check per value
                rows.append(",".join(map(_NINE_DIGITS, values)))
        return "[" + ",".join(f"[{row}]" for row in rows) + "]"


_NINE_DIGITS = "{:.9g}".format


def number_json(value: float) -> str:
    """One number as JSON text, to 9 digits; NaN and infinities as strings (see :func:`json_number`).

    Example:
        >>> number_json(0.1234567891), number_json(float("inf"))
        ('0.123456789', '"Infinity"')
    """
    return _NINE_DIGITS(value) if math.isfinite(value) else f'"{json_number(value)}"'


def json_number(value: float) -> float | str:
    """A float for JSON: ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` as strings (JSON has no such numbers).

    Example:
        >>> json_number(0.5), json_number(float("nan")), json_number(float("-inf"))
        (0.5, 'NaN', '-Infinity')
    """
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def bin_steps(series: dict[str, tuple[Sequence[int] | np.ndarray, Sequence[float] | np.ndarray]],
              layers: Sequence[str], columns: int = MAX_COLUMNS) -> Bins:
    """Each layer's points, ``(steps, values)``, in at most ``columns`` bins of steps (module docstring)."""
    points = {layer: (np.asarray(series[layer][0], dtype=np.int64), np.asarray(series[layer][1], dtype=np.float64))
              for layer in layers if layer in series and len(series[layer][0])}
    steps = np.unique(np.concatenate([steps for steps, _ in points.values()])) if points else np.zeros(0, np.int64)
    if steps.size == 0:
        nothing = np.zeros((len(layers), 0))
        return Bins([], [], nothing, nothing, nothing.astype(bool))
    count = min(columns, steps.size)
    starts = (np.arange(count) * steps.size) // count  # first step index of each bin
    ends = np.append(starts[1:], steps.size) - 1
    values = np.full((len(layers), steps.size), -np.inf)
    present = np.zeros((len(layers), steps.size), dtype=bool)
    for row, layer in enumerate(layers):
        if layer in points:
            where = np.searchsorted(steps, points[layer][0])
            values[row, where] = points[layer][1]
            present[row, where] = True
    maxima = np.maximum.reduceat(values, starts, axis=1)  # NaN propagates: a bin with a NaN is NaN
    positions = np.where(present, np.arange(steps.size), -1)
    last_index = np.maximum.reduceat(positions, starts, axis=1)
    lasts = np.take_along_axis(values, np.maximum(last_index, 0), axis=1)
    return Bins(steps[starts].tolist(), steps[ends].tolist(), maxima, lasts, last_index < 0)
