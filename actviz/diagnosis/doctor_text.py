"""The text of ``actviz doctor``: the layer table with each gradient norm's sparkline, then the alerts.

It takes :mod:`actviz.diagnosis.doctor`'s ``RunHealth`` and ``FileProblem`` without importing them (no cycle).

:func:`format_run` lays out one :class:`~actviz.diagnosis.doctor.RunHealth`; :func:`trend` draws a sparkline.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["TREND_DECADES", "format_run", "number", "problem_line", "shown", "trend"]

_SPARKS = "▁▂▃▄▅▆▇█"


def shown(text: object) -> str:
    """``text`` for a terminal: control characters and undecodable bytes escaped, not sent raw."""
    return "".join(char if char.isprintable() else ascii(char)[1:-1] for char in str(text))


def problem_line(problem: Any) -> str:
    return f"{shown(problem.path)}: {shown(problem.reason)}"


def number(value: float | None) -> str:
    if value is None:
        return "-"
    return "nan" if math.isnan(value) else f"{value:.3g}"


#: Decades of change that fill a sparkline's height: a series that changes less is drawn that much flatter.
TREND_DECADES = 1.0


def trend(values: list[float]) -> str:
    """A sparkline of ``values`` (gradient norms, on a log scale) and last / first.

    One decade of change fills the height (:data:`TREND_DECADES`), so a flat series looks flat; an exact zero
    is drawn as ``_``, below the lowest bar, and a series that fell to zero ends in ``to 0``.

    Example:
        >>> trend([1.0, 1.0001, 1.0]), trend([0.01, 0.34, 0.0, 0.0]), trend([1.0, 10.0, 100.0])
        ('▄▄▄ x1', '▁█__ to 0', '▁▅█ x1e+02')
    """
    kept = [value for value in values if math.isfinite(value) and value >= 0]
    if len(kept) < 2:
        return "-"
    logs = [math.log10(value) for value in kept if value > 0]
    if not logs:
        return "_" * len(kept) + " x0"
    low, high = min(logs), max(logs)
    if high - low >= TREND_DECADES:  # lowest to highest bar
        def level(log: float) -> int:
            return round((log - low) / (high - low) * 7)
    else:  # less: drawn around the middle bar, one decade to the height
        def level(log: float) -> int:
            return min(7, max(0, round(3 + (log - (low + high) / 2) / TREND_DECADES * 7)))
    spark = "".join("_" if value == 0 else _SPARKS[level(math.log10(value))] for value in kept)
    if kept[-1] == 0:
        return f"{spark} to 0"
    if kept[0] == 0:
        return f"{spark} from 0"
    return f"{spark} x{kept[-1] / kept[0]:.2g}"


def format_run(health: Any) -> str:
    """The report of one run as text: the layer table, then the alerts."""
    rows = [("layer", "grad norm", "trend", "act std", "zero frac", "nan/inf")]
    for layer in health.layers:
        rows.append((shown(layer.layer), number(layer.gradient_norm), trend(layer.gradient_trend),
                     number(layer.activation_std), number(layer.zero_fraction), str(layer.nonfinite)))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = [f"run {shown(health.path)} (last step {health.last_step})", ""]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.append("")
    if health.alerts:
        lines.append(f"{len(health.alerts)} alert(s):")
        cells = [(str(a["step"]), shown(a["rule"]), shown(a["layer"] or "-"), shown(a["message"])) for a in health.alerts]
        step_width, rule_width, layer_width = (max(len(row[column]) for row in cells) for column in range(3))
        lines += [f"  step {step.rjust(max(step_width, 6))}  {rule.ljust(rule_width)}  {layer.ljust(layer_width)}  "
                  f"{message}" for step, rule, layer, message in cells]
    else:
        lines.append("no alerts")
    return "\n".join(lines)
