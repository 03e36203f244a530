"""``actviz diff RUN_A RUN_B``: the first logged step where two runs part, and the layer where they part first.

Each run folder is read back step by step (:mod:`actviz.run_reader`): per logged step, per watched layer,
the numbers of :data:`STATISTICS`. :func:`compare_runs` goes through the steps both runs logged, in order,
and compares every statistic both have with ``|a - b| <= atol + rtol * max(|a|, |b|, scale)``, ``scale`` the
statistic's own (its largest ``|value|`` so far in either run; NaN equals NaN, an infinity only itself). At the
first step where one differs, the layer named is

* the first layer in forward order whose output moved (by more than rounding, :data:`ROUNDING` and
  :func:`rounding_floor`, even within the tolerances), since every later layer's output follows from it;
* where no output moved, the *last* layer in forward order whose gradient moved: the backward pass runs from
  the last layer to the first, so that is where it parts first. A sum that is 0 up to rounding (a cross-entropy
  gradient's sum) is named only where nothing else moved.

Forward order is the order of the run's ``layers`` text (the model's), else the order the layers' output
tags first appear in. :func:`diff` is the command: its text or JSON and its exit status
(:data:`EXIT_SAME`, :data:`EXIT_PARTED`, :data:`EXIT_NO_RUN`, :data:`EXIT_DAMAGED`). Both runs are walked side by
side in step order (:class:`RunStream`): the memory held is one step's values, whatever the runs' length.

Example:
    >>> a = RunStatistics("a", ["fc1", "fc2"], {0: {("fc1", "activation_mean"): 0.5, ("fc2", "activation_mean"): 1.0},
    ...                                         5: {("fc1", "activation_mean"): 0.5, ("fc2", "activation_mean"): 2.0}})
    >>> b = RunStatistics("b", ["fc1", "fc2"], {0: {("fc1", "activation_mean"): 0.5, ("fc2", "activation_mean"): 1.0},
    ...                                         5: {("fc1", "activation_mean"): 0.5, ("fc2", "activation_mean"): 3.0}})
    >>> compare_runs(a, b).first_divergence
    Difference(step=5, layer='fc2', statistic='activation_mean', a=2.0, b=3.0)
    >>> compare_runs(a, b, rtol=0.5).first_divergence is None
    True
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

from .run_reader import STATISTICS, NoRunToCompare, RunStatistics, RunStream, _shown, read_run

__all__ = [
    "DIFF_DESCRIPTION", "DIFF_EPILOG", "EXIT_DAMAGED", "EXIT_NO_RUN", "EXIT_PARTED", "EXIT_SAME", "ROUNDING", "STATISTICS",
    "Comparison", "Difference", "NoRunToCompare", "RunStatistics", "RunStream", "add_diff_parser", "agree",
    "compare_runs", "diff", "format_comparison", "read_run", "rounding_floor",
]

#: ``actviz diff``'s exit statuses: every common step agrees, the runs part, a folder holds no run or no common step,
#: an event file is damaged (over the others: what was read before the damage is compared and reported).
EXIT_SAME, EXIT_PARTED, EXIT_NO_RUN, EXIT_DAMAGED = 0, 1, 2, 3

_ROWS_SHOWN = 12

DIFF_DESCRIPTION = """\
Find where two training runs part: the first step both logged at which a watched layer's
statistics differ, and the layer where they differ first. Reads the event files that
actviz.watch(model, "runs/a") wrote; no TensorBoard server and no training code needed.

Compared per layer at every step both runs logged: the output's mean, std, sum, sum of
squares and NaN/Inf count, and the output gradient's norm, sum, sum of squares and NaN/Inf
count. Two values agree when |a - b| <= atol + rtol * max(|a|, |b|, scale), scale the largest
|value| that statistic of that layer took so far in either run.
"""

DIFF_EPILOG = """\
examples:
  actviz diff runs/fp32 runs/bf16                    # where does bf16 leave fp32?
  actviz diff runs/seed0 runs/seed0-again            # is the program deterministic? (exit 0)
  actviz diff runs/cpu runs/gpu --rtol 1e-2 --atol 1e-6
  actviz diff runs/a runs/b --json                   # {"first_divergence": {"step": ..., "layer": ...}}

which layer is named:
  the first layer in forward order whose output moved (past rounding, even within the
  tolerances): every later output follows from it; where no output moved, the LAST layer in
  forward order whose gradient moved: the backward pass starts there. A sum that is 0 up to
  rounding (a cross-entropy gradient's sum) is named only where nothing else moved. Forward order is the run's `layers` text (the model's order).
  A change that starts at a logged step shows there, at its layer. One that starts between
  logged steps shows at the next one, maybe in earlier layers too (their weights were
  updated differently since): log every step (watch(..., every=1)) to find step and layer.

tolerances:
  --rtol is relative to the larger value. Statistics near 0 (the mean after a BatchNorm, a
  histogram's sum) need --atol once the runs are on different hardware or kernels.

exit codes: 0 every common step agrees, 1 the runs part, 2 a folder holds no actviz run
  or the two runs share no logged step, 3 an event file is damaged (bad checksum, cut
  short): it is read up to the damage, compared that far and named after the result
  (--json: "problems"). 3 comes before 1 and 0: a CI step must not pass on a run it
  could not read whole.
"""


@dataclass
class Difference:
    """One statistic of one layer at one step that differs: ``a`` in the first run, ``b`` in the second."""

    step: int
    layer: str
    statistic: str
    a: float
    b: float


@dataclass
class Comparison:
    """What :func:`compare_runs` found: the steps compared, the first divergence (``None``: none) and every
    layer that differs at its step (its first differing statistic, in forward order)."""

    common_steps: list[int]
    layers: list[str]
    first_divergence: Difference | None
    differing: list[Difference]


def agree(a: float, b: float, rtol: float, atol: float, scale: float = 0.0) -> bool:
    """``|a - b| <= atol + rtol * max(|a|, |b|, scale)``; NaN agrees only with NaN, an infinity only with itself.

    ``scale`` is the statistic's own scale (:func:`compare_runs`: the largest value it took so far).

    Example:
        >>> agree(1.0, 1.0005, 1e-3, 0.0), agree(0.0, 1e-9, 1e-3, 0.0), agree(0.0, 1e-9, 1e-3, 1e-6)
        (True, False, True)
        >>> agree(0.0, 1e-9, 1e-3, 0.0, scale=1.0)  # a mean near 0 whose values reach 1 elsewhere
        True
    """
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= atol + rtol * max(abs(a), abs(b), scale)


#: A statistic that moved by less than this, relative to its own scale, moved by rounding alone (16 float32 ulps).
ROUNDING = 16 * 2.0 ** -23
_EPS32 = 2.0 ** -23
_SUMS = ("activation_sum", "activation_mean", "gradient_sum")


def rounding_floor(values: dict[tuple[str, str], float], layer: str, statistic: str) -> float:
    """How far from 0 a sum (or mean) of a layer's float32 numbers lands by rounding alone; 0 for other statistics.

    A sum of ``N`` numbers is off by about ``eps · Σ|x| <= eps · sqrt(N · Σx²)`` (``eps`` = 2⁻²³): a cross-entropy
    gradient's sum, 0 in exact arithmetic, is that rounding. From the histogram's count and sum of squares.

    Example:
        >>> values = {("fc", "gradient_count"): 100.0, ("fc", "gradient_sum_squares"): 1.0}
        >>> round(rounding_floor(values, "fc", "gradient_sum") / 2.0 ** -23, 6)  # eps · sqrt(100 · 1)
        10.0
    """
    if statistic not in _SUMS:
        return 0.0
    kind = statistic.split("_")[0]
    count, squares = values.get((layer, f"{kind}_count")), values.get((layer, f"{kind}_sum_squares"))
    if not count or squares is None or not math.isfinite(squares):
        return 0.0
    floor = _EPS32 * math.sqrt(count * squares)
    return floor / count if statistic == "activation_mean" else floor


def compare_runs(run_a: RunStatistics | RunStream, run_b: RunStatistics | RunStream, rtol: float = 1e-3,
                 atol: float = 0.0, scales: dict[tuple[str, str], float] | None = None) -> Comparison:
    """The first step both runs logged where a statistic differs, and the layer where they part (module docstring).

    Walks both runs side by side in step order (:meth:`RunStream.walk`), one step of each in memory; once they
    part, the rest of each run is read for its damage alone. Raises :class:`NoRunToCompare` when the runs share
    no logged step, or no statistic of a layer. ``scales``: each ``(layer, statistic)``'s largest ``|value|`` at
    earlier steps not given here (the tab's comparison, :mod:`actviz.view.run_compare`); updated in place.
    """
    walks = run_a.walk(), run_b.walk()
    common: list[int] = []
    shared = False
    found: Comparison | None = None
    scales = {} if scales is None else scales  # each statistic's own scale: its largest |value| so far, in either run
    a, b = next(walks[0], None), next(walks[1], None)
    while a is not None and b is not None and found is None:
        if a[0] != b[0]:
            if a[0] < b[0]:
                a = next(walks[0], None)
            else:
                b = next(walks[1], None)
            continue
        step = a[0]
        common.append(step)
        layers = [layer for layer in dict.fromkeys([*run_a.layers, *run_b.layers])
                  if layer in run_a.layers and layer in run_b.layers]
        shared = shared or bool(layers)
        parted, differing = _differing(step, layers, a[1], b[1], rtol, atol, scales)
        if parted:
            found = Comparison(common, layers, _named(differing), [entry for entry, _ in differing])
        a, b = next(walks[0], None), next(walks[1], None)
    for walk in walks:  # the rest: its damage, and whether it holds a run at all
        for _ in walk:
            pass
    if found is not None:
        return found
    if not common:
        raise NoRunToCompare(f"the runs share no logged step: {_steps(run_a)} in {ascii(run_a.path)}, "
                             f"{_steps(run_b)} in {ascii(run_b.path)}")
    if not shared:
        raise NoRunToCompare("the runs share no watched layer: "
                             f"{', '.join(run_a.layers[:3])} and {', '.join(run_b.layers[:3])}")
    layers = [layer for layer in dict.fromkeys([*run_a.layers, *run_b.layers])
              if layer in run_a.layers and layer in run_b.layers]
    return Comparison(common, layers, None, [])


def _differing(step: int, layers: list[str], values_a: dict[tuple[str, str], float],
               values_b: dict[tuple[str, str], float], rtol: float, atol: float,
               scales: dict[tuple[str, str], float]) -> tuple[bool, list[tuple[Difference, bool]]]:
    """Whether the runs part at ``step`` (a statistic outside the tolerances), and each layer's first statistic that
    moved, in forward order (outputs before gradients), with whether it moved past rounding.

    A statistic is judged against its own scale (``scales``, updated here). It moved when it changed by more than
    its rounding (:data:`ROUNDING` of its scale, and :func:`rounding_floor` for a sum); a sum that is 0 up to
    rounding in both runs parts the runs but names no layer while another statistic moved.
    """
    parted = False
    differing = []
    for layer in layers:
        first: tuple[Difference, bool] | None = None
        for statistic in STATISTICS:
            a, b = values_a.get((layer, statistic)), values_b.get((layer, statistic))
            if a is None or b is None:
                continue
            key = (layer, statistic)
            scale = max([scales.get(key, 0.0), *(abs(value) for value in (a, b) if math.isfinite(value))])
            scales[key] = scale
            floor = max(rounding_floor(values_a, layer, statistic), rounding_floor(values_b, layer, statistic))
            if agree(a, b, rtol, atol, max(scale, floor)):
                if first is None and not agree(a, b, 0.0, atol + max(ROUNDING * scale, floor)):
                    first = (Difference(step, layer, statistic, a, b), True)  # moved, within the tolerances
                continue
            parted = True
            noise = floor > 0 and max(abs(a), abs(b)) <= floor
            if first is None or (first[1] is False and not noise):
                first = (Difference(step, layer, statistic, a, b), not noise)
        if first is not None:
            differing.append(first)
    return parted, differing


def _named(differing: list[tuple[Difference, bool]]) -> Difference:
    """The first layer in forward order whose output moved; else the last whose gradient moved; else the last
    that differs (a sum that is only rounding)."""
    moved = [entry for entry, real in differing if real]
    outputs = [entry for entry in moved if entry.statistic.startswith("activation_")]
    if outputs:
        return outputs[0]
    return moved[-1] if moved else differing[-1][0]


def _steps(run: RunStatistics | RunStream) -> str:
    if isinstance(run, RunStream):
        count, first, last = run.steps_seen
    else:
        count, first, last = len(run.steps), min(run.steps), max(run.steps)
    return f"steps {first} to {last} ({count} logged)" if count > 1 else f"step {first}"


def _number(value: float) -> str:
    return f"{value:.7g}"


def _relative(difference: Difference) -> str:
    a, b = difference.a, difference.b
    if not (math.isfinite(a) and math.isfinite(b)):
        return "-"
    return f"{abs(a - b) / max(abs(a), abs(b)):.2g}"


def format_comparison(comparison: Comparison, rtol: float, atol: float) -> str:
    """The text ``actviz diff`` prints: the first divergence, then the layers that differ at its step."""
    steps = comparison.common_steps
    compared = (f"{len(steps)} common logged step(s), {steps[0]} to {steps[-1]}, "
                f"{len(comparison.layers)} layer(s), rtol {rtol:g}, atol {atol:g}")
    first = comparison.first_divergence
    if first is None:
        return f"the runs agree: {compared}"
    where = "output" if first.statistic.startswith("activation_") else "gradient"
    lines = [
        f"the runs part at step {first.step}, layer {_shown(first.layer)} ({where}): "
        f"{first.statistic} {_number(first.a)} vs {_number(first.b)}",
        f"compared: {compared}; " + (f"every common step before {first.step} agrees" if first.step != steps[0]
                                     else f"they part at their first common step, {first.step}: none before it"),
    ]
    if where == "gradient":
        lines.append("only gradients differ at this step: the backward pass parts at the last of these layers")
    rows = [("layer", "statistic", "a", "b", "rel. diff")]
    rows += [(_shown(d.layer), d.statistic, _number(d.a), _number(d.b), _relative(d))
             for d in comparison.differing[:_ROWS_SHOWN]]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines += ["", f"layers that differ at step {first.step}, in forward order (the first statistic of each):"]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    if len(comparison.differing) > _ROWS_SHOWN:
        lines.append(f"  ... and {len(comparison.differing) - _ROWS_SHOWN} more")
    return "\n".join(lines)


def diff(run_a: str | os.PathLike[str], run_b: str | os.PathLike[str], rtol: float = 1e-3, atol: float = 0.0,
         as_json: bool = False) -> tuple[int, str]:
    """``(exit status, text)`` of ``actviz diff run_a run_b``: 0 they agree, 1 they part, 2 nothing to compare,
    3 a damaged event file (the comparison covers what was read before the damage; over 1 and 0, as doctor's).

    Example:
        >>> import tempfile
        >>> diff(tempfile.mkdtemp(), tempfile.mkdtemp())[0]
        2
    """
    runs: list[RunStream] = []
    try:
        runs += [RunStream(run_a), RunStream(run_b)]
        comparison = compare_runs(*runs, rtol=rtol, atol=atol)
    except NoRunToCompare as error:
        problems = [problem for run in runs for problem in run.problems]
        status = EXIT_DAMAGED if problems else EXIT_NO_RUN
        if as_json:
            return status, json.dumps({"error": str(error), "status": status, "problems": problems})
        return status, "\n".join([f"actviz diff: error: {error}", *(f"damaged: {p}" for p in problems)])
    problems = [problem for run in runs for problem in run.problems]
    status = EXIT_DAMAGED if problems else EXIT_SAME if comparison.first_divergence is None else EXIT_PARTED
    if as_json:
        first = comparison.first_divergence
        found = None if first is None else {key: _finite(value) for key, value in asdict(first).items()}
        return status, json.dumps({"first_divergence": found, "status": status, "problems": problems})
    text = format_comparison(comparison, rtol, atol)
    text += "".join(f"\nnote: {note}" for run in runs for note in run.notes)
    if problems:
        text += ("\n\nexit 3: an event file is damaged, and the comparison covers only what was read before the "
                 "damage:\n" + "\n".join(f"damaged: {problem}" for problem in problems))
    return status, text


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as ``null``: strict JSON, as CI tools read it."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}; for example 1e-3")
    return value


def add_diff_parser(commands: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """Add the ``diff`` subcommand to the ``actviz`` parser's subcommands."""
    parser = commands.add_parser("diff", help="the first step and layer where two runs part",
                                 description=DIFF_DESCRIPTION, epilog=DIFF_EPILOG, formatter_class=formatter)
    parser.add_argument("run_a", metavar="RUN_A", help="a run folder (the log_dir of actviz.watch)")
    parser.add_argument("run_b", metavar="RUN_B", help="the run folder to compare it with")
    parser.add_argument("--rtol", type=_tolerance, default=1e-3, help="relative tolerance, of the larger value")
    parser.add_argument("--atol", type=_tolerance, default=0.0,
                        help="absolute tolerance, for statistics near 0 (default: 0)")
    parser.add_argument("--json", action="store_true",
                        help='print {"first_divergence": {"step", "layer", "statistic", "a", "b"} or null, "status", "problems"}')
