"""Health alerts: rules over the statistics a logging step already has, checked on the writer thread.

:class:`HealthMonitor` looks at each step's :class:`~actviz.common.results.StepResults` once it is on the host
and keeps a short history per layer (a few floats), so the rules cost the training thread nothing and never
wait for a device. Each rule fires once per layer and run (:data:`ONCE_AN_EPISODE` once per episode): an :class:`Alert` kept in ``viz.alerts`` (the latest
:data:`KEPT_ALERTS`), passed to ``on_alert``, a line of the ``alerts`` text at its step, and a ``RuntimeWarning``.
``watch(alerts={...})`` overrides the thresholds of :data:`DEFAULT_THRESHOLDS`; each rule's docstring says
where its comes from. The per-layer rules read typed values (``results.layer_values``): a ReLU output's zero fraction
(:mod:`actviz.statistics.moments`), and two counts made in the layer's hook (:mod:`actviz.statistics.unit_counts`),
the fraction of a ReLU's channels that are zero for the whole batch and of a Tanh's or Sigmoid's outputs near
its bounds. The first-NaN rule reads the summaries: it is one rule over outputs and their gradients, in
forward then backward order, and names the element count.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from typing import Any

from ..common.results import StepResults
from ..common.safe_warnings import warn_safely
from ..common.suggestions import did_you_mean
from ..tags import ALERTS, UPDATE_RATIO

__all__ = ["DEFAULT_THRESHOLDS", "KEPT_ALERTS", "ONCE_AN_EPISODE", "Alert", "HealthMonitor", "check_alerts", "escape",
           "parse_alert_lines", "unescape"]

#: Every threshold a rule uses; ``watch(alerts={"vanishing_ratio": 1e-4})`` overrides one.
DEFAULT_THRESHOLDS: dict[str, float] = {
    "warmup_steps": 100,  # the vanishing ratio and update-ratio alerts only from this training step on
    "vanishing_ratio": 1e-3,  # RMS output gradient below this x the median over watched layers (after the warm-up) ...
    "vanishing_early_ratio": 1e-4,  # ... or below this x the median at any step ...
    "vanishing_steps": 3,  # ... or exactly zero, for this many logging steps in a row
    "exploding_factor": 10.0,  # gradient norm above this x the largest of its last logging steps ...
    "exploding_min_history": 8,  # ... once it has this many logging steps of history ...
    "exploding_early_factor": 1000.0,  # ... or above this x the largest of its fewer logging steps
    "activation_factor": 100.0,  # activation RMS above this x the largest of its last logging steps
    "frozen_steps": 2,  # a parameter with a gradient unchanged over this many logging steps in a row ...
    "frozen_lost_fraction": 0.9,  # ... or, where update_lost runs, losing this fraction of its updates to rounding
    "dead_zero_fraction": 0.99,  # zero fraction of a ReLU-family output
    "dead_channel_fraction": 0.9,  # fraction of a ReLU's channels that are zero for the whole batch
    "saturation_fraction": 0.05,  # fraction of a Tanh's or Sigmoid's outputs within 0.03 of a bound
    "update_ratio_low": 1e-4,  # ||dW|| / ||W|| of a weight below this ...
    "update_ratio_high": 1e-2,  # ... or above this (above 1: from step 0) ...
    "update_ratio_steps": 3,  # ... for this many logging steps in a row
}

#: Rules that fire once per episode, which they end themselves (an expert chosen again ends its dead streak):
#: the monitor reports each of their alerts, where it reports other rules once per layer and run.
ONCE_AN_EPISODE = frozenset({"dead_experts"})
#: Logging steps of gradient norms kept per layer for the exploding-gradient rule.
HISTORY = 32
#: The latest alerts kept in memory (``viz.alerts``); every alert is also in the ``alerts`` text and ``on_alert``.
KEPT_ALERTS = 1000


@dataclass(frozen=True)
class Alert:
    """One health alert: what was seen, where and when, against which threshold.

    Example:
        >>> alert = Alert(30, "vanishing_gradients", "fc1", "gradient_rms", 2e-9, 1e-4, "...")
        >>> alert.rule, alert.layer
        ('vanishing_gradients', 'fc1')
    """

    step: int
    rule: str
    layer: str | None
    statistic: str
    value: float
    threshold: float
    message: str

    def line(self) -> str:
        """The alert as one markdown line of the ``alerts`` text: ``step N · **rule** · `layer`: message``.

        The layer (``-`` without backticks when there is none) and the message are :func:`escape`-d, so
        :func:`parse_alert_lines` gives back exactly what was written, whatever a layer's name holds.

        Example:
            >>> print(Alert(3, "dead_units", "a`b", "zero_fraction", 1.0, 0.99, "dead").line())
            step 3 · **dead_units** · `a\\x60b`: dead
        """
        layer = "-" if self.layer is None else f"`{escape(self.layer)}`"
        return f"step {self.step} · **{self.rule}** · {layer}: {escape(self.message)}"


_LINE = re.compile(r"step (\d+) · \*\*(\w+)\*\* · (?:`([^`]*)`|-): (.*)")
_ESCAPED = re.compile(r"\\(\\|x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})")


def escape(text: str) -> str:
    """``text`` on one line with no backtick and no control character, undone exactly by :func:`unescape`.

    A backslash is doubled; a backtick and every character Python does not print (newlines, terminal
    escapes, lone surrogates of a name that is not UTF-8) become ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``.

    Example:
        >>> print(escape("fc`1" + chr(10) + chr(27) + "[31m"))
        fc\\x601\\x0a\\x1b[31m
        >>> unescape(escape("a" + chr(92) + chr(10))) == "a" + chr(92) + chr(10)
        True
    """
    out = []
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif char == "`" or not char.isprintable():
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)


def unescape(text: str) -> str:
    """The text :func:`escape` was given."""
    return _ESCAPED.sub(lambda match: "\\" if match[1] == "\\" else chr(int(match[1][1:], 16)), text)


def parse_alert_lines(text: str, step: int = 0) -> list[tuple[int, str, str | None, str]]:
    """``(step, rule, layer, message)`` of each :meth:`Alert.line` in an ``alerts`` text; ``layer`` is ``None``
    for an alert about no layer. A paragraph in no alert's form (the first NaN/Inf, as actviz wrote it before
    it had rules) is a ``nonfinite`` alert at ``step``, the text's own.

    Example:
        >>> alert = Alert(7, "nonfinite", "fc`" + chr(10), "activations_nonfinite", 1.0, 0.0, "NaN")
        >>> parse_alert_lines(alert.line() + 2 * chr(10) + Alert(8, "gradient_spike", None, "", 0, 0, "x").line())
        [(7, 'nonfinite', 'fc`\\n', 'NaN'), (8, 'gradient_spike', None, 'x')]
    """
    found: list[tuple[int, str, str | None, str]] = []
    for paragraph in text.split("\n\n"):  # each line as written, its spaces included
        match = _LINE.fullmatch(paragraph)
        if match:
            layer = None if match[3] is None else unescape(match[3])
            found.append((int(match[1]), match[2], layer, unescape(match[4])))
        elif paragraph.strip():
            found.append((step, "nonfinite", None, paragraph.strip().removeprefix("actviz: ")))
    return found


def check_alerts(alerts: Any) -> dict[str, float] | None:
    """Check ``watch(alerts=)``: ``True`` gives the default thresholds, ``False`` ``None``, a dict overrides some.

    Raises:
        TypeError: Not a bool or a dict, or a threshold that is not a number.
        ValueError: An unknown threshold name (the nearest is suggested), or a value out of its bounds:
            fractions in (0, 1], counts of steps whole numbers (logging steps 1 or more, ``warmup_steps`` 0 or
            more, ``exploding_min_history`` at most 32), factors 1 or more, the rest
            positive and ``update_ratio_low`` below ``update_ratio_high``. The error names the unit and the
            default.

    Example:
        >>> check_alerts({"vanishing_ratio": 1e-4})["vanishing_ratio"], check_alerts(False)
        (0.0001, None)
        >>> check_alerts({"vanish_ratio": 1e-4})
        Traceback (most recent call last):
        ...
        ValueError: unknown alert threshold 'vanish_ratio'; did you mean 'vanishing_ratio'?
    """
    if alerts is True:
        return dict(DEFAULT_THRESHOLDS)
    if alerts is False:
        return None
    if not isinstance(alerts, Mapping):
        raise TypeError(f"alerts must be True, False or a dict of thresholds, got {type(alerts).__name__}: {alerts!r}")
    thresholds = dict(DEFAULT_THRESHOLDS)
    for name, value in alerts.items():
        if name not in DEFAULT_THRESHOLDS:
            hint = did_you_mean(str(name), DEFAULT_THRESHOLDS, otherwise=f"; known: {', '.join(DEFAULT_THRESHOLDS)}")
            raise ValueError(f"unknown alert threshold {name!r}{hint}")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"alert threshold {name} must be a number, got {type(value).__name__}: {value!r}")
        unit, good = _BOUNDS[name]
        if not (math.isfinite(value) and good(value)):
            raise ValueError(f"alert threshold {name} must be {unit}, got {value!r}; for example "
                             f"alerts={{{name!r}: {DEFAULT_THRESHOLDS[name]:g}}} (the default)")
        thresholds[name] = float(value)
    if thresholds["update_ratio_low"] >= thresholds["update_ratio_high"]:
        raise ValueError(f"alert thresholds update_ratio_low ({thresholds['update_ratio_low']:g}) must be below "
                         f"update_ratio_high ({thresholds['update_ratio_high']:g}); for example "
                         "alerts={'update_ratio_low': 1e-4, 'update_ratio_high': 1e-2} (the defaults)")
    return thresholds


def _whole(low: float, high: float = math.inf) -> Callable[[float], bool]:
    return lambda value: float(value).is_integer() and low <= value <= high


#: Each threshold's unit, as an error names it, and its test.
_BOUNDS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "warmup_steps": ("a whole number of training steps, 0 or more", _whole(0)),
    "vanishing_ratio": ("a fraction of the median in (0, 1]", lambda value: 0 < value <= 1),
    "vanishing_early_ratio": ("a fraction of the median in (0, 1]", lambda value: 0 < value <= 1),
    "vanishing_steps": ("a whole number of logging steps, 1 or more", _whole(1)),
    "exploding_factor": ("a factor over the history, 1 or more", lambda value: value >= 1),
    "exploding_early_factor": ("a factor over the history, 1 or more", lambda value: value >= 1),
    "activation_factor": ("a factor over the history, 1 or more", lambda value: value >= 1),
    "frozen_steps": ("a whole number of logging steps, 1 or more", _whole(1)),
    "frozen_lost_fraction": ("a fraction in (0, 1]", lambda value: 0 < value <= 1),
    "exploding_min_history": (f"a whole number of logging steps from 1 to {HISTORY} (the history kept)",
                              _whole(1, HISTORY)),
    "dead_zero_fraction": ("a fraction in (0, 1]", lambda value: 0 < value <= 1),
    "dead_channel_fraction": ("a fraction in (0, 1]", lambda value: 0 < value <= 1),
    "saturation_fraction": ("a fraction in (0, 1]", lambda value: 0 < value <= 1),
    "update_ratio_low": ("a positive ratio ||dW|| / ||W||", lambda value: value > 0),
    "update_ratio_high": ("a positive ratio ||dW|| / ||W||", lambda value: value > 0),
    "update_ratio_steps": ("a whole number of logging steps, 1 or more", _whole(1)),
}


class HealthMonitor:
    """Applies the rules to each step's results on the writer thread and reports what they find.

    The rules of one step (non-finite values, dead units, saturation, the update ratio) are here; the rules
    that compare a layer with its own history are :class:`actviz.diagnosis.trends.LayerTrends`, given as
    ``trends`` (:func:`actviz.diagnosis.trends.health_monitor` makes a monitor with them).

    Args:
        thresholds: From :func:`check_alerts`.
        relu_layers: Names of the watched layers that are ReLU-family modules.
        matrices: Names of the watched parameters with 2 or more dimensions (the update-ratio rule's);
            ``None`` for every parameter.
        on_alert: Called with each :class:`Alert`, on the writer thread.
        trends: Called with each step's results; returns more alerts.

    Example:
        >>> monitor = HealthMonitor(check_alerts(True), relu_layers={"relu"})
        >>> dead = {"mean": 0.0, "std": 0.0, "zero_fraction": 1.0, "nonfinite": 0.0}
        >>> [alert.rule for alert in monitor.check(StepResults(5, layer_values={"moments": {"relu": dead}}))]
        ['dead_units']
    """

    def __init__(
        self, thresholds: dict[str, float], relu_layers: set[str] | frozenset[str] = frozenset(),
        matrices: Container[str] | None = None, on_alert: Callable[[Alert], None] | None = None,
        trends: Callable[[StepResults], list[Alert]] | None = None,
    ) -> None:
        self.thresholds = thresholds
        self.relu_layers = set(relu_layers)
        self.matrices = matrices
        self.on_alert = on_alert
        self.alerts: deque[Alert] = deque(maxlen=KEPT_ALERTS)
        self.trends = trends
        self._fired: set[tuple[str, str | None]] = set()
        self._streaks: dict[tuple[str, str], int] = {}

    def check(self, results: StepResults) -> list[Alert]:
        """Run every rule on one step; return the new alerts (each rule fires once per layer and run, those of
        :data:`ONCE_AN_EPISODE` once per episode)."""
        found = [*self._nonfinite(results), *self._dead_units(results), *self._saturation(results),
                 *results.alerts]  # found while the step was finished (actviz.diagnosis.transformer_alerts)
        results.alerts = []
        found += self.trends(results) if self.trends is not None else []
        found += self._update_ratio(results)
        fresh = []
        for alert in found:
            if alert.rule in ONCE_AN_EPISODE or (alert.rule, alert.layer) not in self._fired:
                self._fired.add((alert.rule, alert.layer))
                fresh.append(alert)
        self.report(results, fresh)
        return fresh

    def report(self, results: StepResults | None, alerts: list[Alert], warn: bool = True) -> None:
        """Keep, warn about (unless said already: ``warn=False``), write into ``results.texts["alerts"]`` and hand
        on ``alerts``."""
        for alert in alerts:
            self.alerts.append(alert)
            if warn:
                warn_safely(f"actviz: {alert.message}", RuntimeWarning, stacklevel=2)
            if self.on_alert is not None:
                try:
                    self.on_alert(alert)
                except Exception as error:  # noqa: BLE001 - the user's callback must not stop training
                    warn_safely(f"actviz's on_alert callback raised {type(error).__name__}: {error}", RuntimeWarning)
        if alerts and results is not None:
            lines = [alert.line() for alert in alerts]
            old = results.texts.get(ALERTS)
            results.texts[ALERTS] = "\n\n".join([old, *lines] if old else lines)

    def _streak(self, rule: str, layer: str, hit: bool) -> int:
        """How many logging steps in a row ``rule`` has held for ``layer``, this one included."""
        count = self._streaks.get((rule, layer), 0) + 1 if hit else 0
        self._streaks[(rule, layer)] = count
        return count

    def _nonfinite(self, results: StepResults) -> list[Alert]:
        """First NaN or Inf: in forward order the first layer whose output is not finite, else the first
        gradient the backward pass reached that is not. No threshold: one bad element is one too many."""
        for kind, where in (("activations", "in the output of"), ("gradients", "in the gradient flowing into")):
            for layer, summary in getattr(results, kind).items():
                if summary.nonfinite:
                    return [Alert(results.step, "nonfinite", layer, f"{kind}_nonfinite", float(summary.nonfinite), 0.0,
                                  f"NaN or Inf first at step {results.step}, {where} {layer!r} "
                                  f"({summary.nonfinite} of {summary.num} elements)")]
        return []

    def _dead_units(self, results: StepResults) -> list[Alert]:
        """Dead units: a watched ReLU-family output with ``dead_zero_fraction`` (0.99) of its elements zero, or
        any ReLU-family output, watched or not, with ``dead_channel_fraction`` (0.9) of its channels zero for the
        whole batch (the dead-channel count runs on every ReLU module of the model). A healthy ReLU
        zeroes about half its inputs; a unit whose input is negative for every sample gets no gradient
        and never recovers (the "dying ReLU" of Lu et al. 2019)."""
        found = []
        counted = results.layer_values.get("dead_channels", {})
        moments = results.layer_values.get("moments", {})
        for layer in self.relu_layers & moments.keys():
            fraction = moments[layer]["zero_fraction"]
            if fraction >= self.thresholds["dead_zero_fraction"]:
                found.append(Alert(results.step, "dead_units", layer, "zero_fraction", fraction,
                                   self.thresholds["dead_zero_fraction"],
                                   f"dead units at step {results.step} in {layer!r}: {fraction:.1%} of its outputs "
                                   "are zero, so almost no gradient flows back through it"))
        named = {alert.layer for alert in found}
        for layer in [layer for layer in counted if layer not in named]:  # watched ReLUs, and those not watched
            channels = counted[layer].get("dead_channel_fraction", math.nan)
            if channels >= self.thresholds["dead_channel_fraction"] - 1e-6:  # counted in float32 on the device
                found.append(Alert(results.step, "dead_units", layer, "dead_channel_fraction", channels,
                                   self.thresholds["dead_channel_fraction"],
                                   f"dead units at step {results.step} in {layer!r}: {channels:.1%} of its channels "
                                   "are zero for the whole batch"))
        return found

    def _saturation(self, results: StepResults) -> list[Alert]:
        """Saturation: more than ``saturation_fraction`` (5 %) of a Tanh's or Sigmoid's outputs within 0.03
        of its bounds, where its slope is below 0.06 (Tanh) or 0.03 (Sigmoid) and gradients die. Glorot &
        Bengio (2010) trace the stalled training of deep sigmoid nets to exactly this."""
        found = []
        for layer, values in results.layer_values.get("saturation", {}).items():
            fraction = values.get("saturated_fraction", math.nan)
            if fraction > self.thresholds["saturation_fraction"]:
                found.append(Alert(results.step, "saturation", layer, "saturated_fraction", fraction,
                                   self.thresholds["saturation_fraction"],
                                   f"saturation at step {results.step} in {layer!r}: {fraction:.1%} of its outputs "
                                   "are within 0.03 of the bounds, where its gradient vanishes"))
        return found

    def _update_ratio(self, results: StepResults) -> list[Alert]:
        """Update ratio out of [``update_ratio_low``, ``update_ratio_high``] = [1e-4, 1e-2] for
        ``update_ratio_steps`` (3) logging steps in a row, weights with 2 or more dimensions only (a bias
        starting at zero has no meaningful ratio). Around 1e-3 is healthy (Karpathy, CS231n "Babysitting
        the learning process"); a decade off either side means a learning rate 10x too large or small.
        Judged from step ``warmup_steps`` (100) on, Adam's first updates being as large as the learning rate
        whatever the gradient; a ratio above 1 (a weight that moves by more than itself) from step 0."""
        low, high = self.thresholds["update_ratio_low"], self.thresholds["update_ratio_high"]
        judged = results.step >= self.thresholds["warmup_steps"]
        found = []
        for tag, ratio in results.scalars.items():
            param = tag.removeprefix(UPDATE_RATIO.format(param=""))
            if param == tag or not math.isfinite(ratio) or (self.matrices is not None and param not in self.matrices):
                continue
            outside = (ratio > 1 or judged) and not low <= ratio <= high
            if self._streak("update_ratio", param, outside) >= self.thresholds["update_ratio_steps"]:
                side = "above" if ratio > high else "below"
                found.append(Alert(results.step, "update_ratio", param, "update_ratio", ratio,
                                   high if ratio > high else low,
                                   f"update ratio at step {results.step} of {param!r}: ||dW||/||W|| = {ratio:.3g} is "
                                   f"{side} [{low:g}, {high:g}] for {self.thresholds['update_ratio_steps']:g} logging "
                                   f"steps in a row: the learning rate is likely too {'high' if side == 'above' else 'low'}"))
        return found
