"""Where two runs part, for the actviz tab: :func:`actviz.run_diff.compare_runs`' answer, found with numpy first.

``actviz diff``'s rule (:func:`~actviz.run_diff.compare_runs`) walks the common steps in order and compares every
statistic of every layer in Python: about a second per million values. The tab holds each run's compared scalars
as a :class:`ScalarTable` (a row per step, a column per ``(layer, statistic)``) and checks a block of rows at once
with numpy: a value within half the tolerance of the other (``|a - b| <= (atol + rtol * max(|a|, |b|)) / 2``,
both finite) agrees by that rule too, since halving is exact in floating point. Only the rows where some value
is not that close go to ``compare_runs``, in step order, each with every statistic's scale (its largest ``|value|``
at the rows before), and the first row it finds a difference in is its answer over every step: every row before
agrees.

Example:
    >>> steps = np.arange(4)
    >>> a = ScalarTable.from_series("a", ["fc"], {("fc", "activation_mean"): (steps, np.array([1.0, 2, 3, 4]))})
    >>> b = ScalarTable.from_series("b", ["fc"], {("fc", "activation_mean"): (steps, np.array([1.0, 2, 3.5, 9]))})
    >>> compare_tables(a, b).first_divergence
    Difference(step=2, layer='fc', statistic='activation_mean', a=3.0, b=3.5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..run_diff import Comparison, RunStatistics, compare_runs

__all__ = ["ROWS_AT_ONCE", "ScalarTable", "compare_tables"]

#: Steps checked in one numpy block: a first divergence early in a long run is found without checking the rest.
ROWS_AT_ONCE = 4096


@dataclass
class ScalarTable:
    """One run's compared scalars: ``values[row, column]`` is ``columns[column]`` (a ``(layer, statistic)``) at
    ``steps[row]`` where ``held`` says the run has it, NaN elsewhere. ``layers`` in forward order."""

    path: str
    layers: list[str]
    steps: np.ndarray
    columns: list[tuple[str, str]]
    values: np.ndarray
    held: np.ndarray

    @classmethod
    def from_series(cls, path: str, layers: list[str],
                    series: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]) -> ScalarTable:
        """A table from each ``(layer, statistic)``'s ``(steps, values)``; of a step written twice, the last value."""
        columns = list(series)
        parts = [np.asarray(steps, dtype=np.int64) for steps, _ in series.values()]
        if parts and all(np.array_equal(part, parts[0]) for part in parts[1:]):  # the common case: the same steps
            steps = np.unique(parts[0])
        else:
            steps = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
        values = np.full((steps.size, len(columns)), np.nan)
        held = np.zeros((steps.size, len(columns)), dtype=bool)
        for column, (point_steps, (_, point_values)) in enumerate(zip(parts, series.values())):
            point_values = np.asarray(point_values, dtype=np.float64)
            if not (np.diff(point_steps) > 0).all():  # a step written twice, or out of order
                # np.unique keeps the first of equal steps: of the reversed points, that is the last one written
                point_steps, first = np.unique(point_steps[::-1], return_index=True)
                point_values = point_values[::-1][first]
            rows = np.searchsorted(steps, point_steps)
            values[rows, column] = point_values
            held[rows, column] = True
        return cls(path, layers, steps, columns, values, held)

    def statistics(self, rows: Sequence[int] | np.ndarray) -> RunStatistics:
        """The given rows as :func:`~actviz.run_diff.compare_runs` reads a run: ``{step: {(layer, statistic): value}}``."""
        steps = {}
        for row in rows:
            held = np.flatnonzero(self.held[row])
            steps[int(self.steps[row])] = dict(zip([self.columns[column] for column in held],
                                                   self.values[row, held].tolist()))
        return RunStatistics(self.path, self.layers, steps)


def compare_tables(first: ScalarTable, second: ScalarTable, rtol: float = 1e-3, atol: float = 0.0,
                   rows_at_once: int = ROWS_AT_ONCE) -> Comparison:
    """``compare_runs`` over every step both tables hold, checked with numpy first (module docstring).

    Raises:
        actviz.run_diff.NoRunToCompare: No common step, or no common layer (as ``compare_runs`` raises it).
    """
    common, rows_a, rows_b = np.intersect1d(first.steps, second.steps, assume_unique=True, return_indices=True)
    if common.size == 0:  # compare_runs names each run's steps
        outline = [RunStatistics(table.path, table.layers, {int(step): {} for step in table.steps})
                   for table in (first, second)]
        return compare_runs(*outline, rtol, atol)
    where = {key: column for column, key in enumerate(second.columns)}
    shared = [(column, where[key]) for column, key in enumerate(first.columns) if key in where]
    columns_a = np.array([column for column, _ in shared], dtype=np.intp)
    columns_b = np.array([column for _, column in shared], dtype=np.intp)
    keys = [first.columns[column] for column in columns_a]
    running = np.zeros(len(shared))  # each column's scale: its largest |value| at the rows before, as compare_runs
    for start in range(0, common.size, rows_at_once):
        block_a, block_b = rows_a[start:start + rows_at_once], rows_b[start:start + rows_at_once]
        a, b = first.values[np.ix_(block_a, columns_a)], second.values[np.ix_(block_b, columns_b)]
        held = first.held[np.ix_(block_a, columns_a)] & second.held[np.ix_(block_b, columns_b)]
        with np.errstate(invalid="ignore"):
            close = np.abs(a - b) <= 0.5 * (atol + rtol * np.maximum(np.abs(a), np.abs(b)))
        unsure = np.flatnonzero((held & ~(close & np.isfinite(a) & np.isfinite(b))).any(axis=1))
        sizes = np.where(held, np.fmax(np.where(np.isfinite(a), np.abs(a), 0.0), np.where(np.isfinite(b), np.abs(b), 0.0)), 0.0)
        before = np.maximum.accumulate(np.vstack([running, sizes]), axis=0)  # row i: the scales before block row i
        for row in unsure.tolist():  # each with the scales of every row before it, the close ones too
            scales = {key: float(scale) for key, scale in zip(keys, before[row]) if scale > 0}
            found = compare_runs(first.statistics(block_a[[row]]), second.statistics(block_b[[row]]), rtol, atol,
                                 scales=scales)
            if found.first_divergence is not None:
                compared = common[common <= found.first_divergence.step].tolist()  # as compare_runs: up to where they part
                return Comparison(compared, found.layers, found.first_divergence, found.differing)
        running = before[-1]
    # every common step agrees: compare_runs on the first names the shared layers (or raises: none shared)
    found = compare_runs(first.statistics(rows_a[:1]), second.statistics(rows_b[:1]), rtol, atol)
    return Comparison(common.tolist(), found.layers, None, [])
