"""Alerts that compare a layer with its own history, or with the other layers: how a run goes bad over time.

:class:`LayerTrends` keeps, per watched layer, the last :data:`~actviz.diagnosis.alerts.HISTORY` logging
steps of a few numbers (log10 gradient norm, log10 activation RMS, a parameter's fingerprint) and checks
each step against them:

* ``vanishing_gradients``: an output gradient exactly zero, or far below the median of the other layers;
* ``exploding_gradients``: a gradient norm a decade above the largest of its own history;
* ``exploding_activations``: an activation RMS two decades above the largest of its own history;
* ``diverged``: most layers' gradients became exactly zero while the output still has one;
* ``frozen_parameter``: a parameter with a gradient that does not change between logging steps.

Layers of one network legitimately differ by a decade or two (an embedding, a norm, a residual stream), so
the explosion rules compare a layer with itself, on a log scale, where a gradient's multiplicative noise is
additive. The thresholds are calibrated on ``scripts/diagnosis_benchmark.py`` (docs/diagnosis.md): each
docstring says what the healthy programs reach and what the sick ones reach.

Example:
    >>> from actviz.common.results import StepResults, Summary
    >>> from actviz.diagnosis.alerts import check_alerts
    >>> trends = LayerTrends(check_alerts(True))
    >>> ok, zero = Summary(4, 0, 0, 0.1, 0.2, 0.6, 0.1, [4.0]), Summary(4, 0, 4, 0.0, 0.0, 0.0, 0.0, [4.0])
    >>> for step in range(3):
    ...     found = trends(StepResults(step, gradients={"fc1": zero, "fc2": ok}))
    >>> [(alert.step, alert.rule, alert.layer) for alert in found]
    [(2, 'vanishing_gradients', 'fc1')]
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Container

from ..common.results import StepResults, Summary
from .alerts import HISTORY, Alert, HealthMonitor

__all__ = ["LayerTrends", "health_monitor"]


def _rms(summary: Summary) -> float:
    return math.sqrt(summary.sum_squares / summary.finite_count) if summary.finite_count else math.nan


class LayerTrends:
    """The history rules of one watched model; call it with each logging step's results, in order.

    Args:
        thresholds: From :func:`~actviz.diagnosis.alerts.check_alerts`.
    """

    def __init__(self, thresholds: dict[str, float]) -> None:
        self.thresholds = thresholds
        self._gradients: dict[str, deque[float]] = {}  # log10 gradient norms
        self._activations: dict[str, deque[float]] = {}  # log10 activation RMS
        self._fingerprints: dict[str, tuple[float, ...]] = {}
        self._had_gradient: set[str] = set()
        self._streaks: dict[tuple[str, str], int] = {}

    def __call__(self, results: StepResults) -> list[Alert]:
        found = [*self._vanishing(results), *self._diverged(results), *self._exploding(results),
                 *self._exploding_activations(results), *self._frozen(results)]
        self._had_gradient.update(layer for layer, s in results.gradients.items() if s.sum_squares > 0)
        return found

    def _streak(self, rule: str, layer: str, hit: bool) -> int:
        count = self._streaks.get((rule, layer), 0) + 1 if hit else 0
        self._streaks[(rule, layer)] = count
        return count

    def _vanishing(self, results: StepResults) -> list[Alert]:
        """Vanishing gradients, ``vanishing_steps`` (3) logging steps in a row: an output gradient exactly zero
        (from step 0: nothing reaches the layer; of several such layers the last in forward order is named,
        the one where the flow stops), or an RMS below ``vanishing_ratio`` (1e-3) x the median over the watched
        layers from step ``warmup_steps`` (100) on, below ``vanishing_early_ratio`` (1e-4) x from step 0.
        The healthy programs of the benchmark stay within 1.8 decades of the median (an LSTM's embedding);
        a fresh BERT's query and key projections reach 5e-4 x the median for their first steps, hence the
        warm-up; ten sigmoid layers put the first at 6e-5 x the median from step 0 (Glorot & Bengio 2010)."""
        usable = {layer: s for layer, s in results.gradients.items() if s.finite_count and not s.nonfinite}
        order = [layer for layer in results.activations if layer in usable]
        order += [layer for layer in usable if layer not in order]
        zero = [layer for layer in order if self._streak("zero", layer, usable[layer].sum_squares == 0)
                >= self.thresholds["vanishing_steps"]]
        found = []
        if zero and len(zero) < len(order):
            last = zero[-1]
            found.append(Alert(results.step, "vanishing_gradients", last, "gradient_rms", 0.0, 0.0,
                               f"vanishing gradients at step {results.step} in {last!r}: its output gradient is "
                               f"exactly zero for {self.thresholds['vanishing_steps']:g} logging steps in a row"
                               f"{f' (and in {len(zero) - 1} layer(s) before it)' if len(zero) > 1 else ''}: no "
                               "gradient flows back through it (dead or saturated units after it, or a detached path)"))
        rms = {layer: _rms(s) for layer, s in usable.items() if s.sum_squares > 0}
        if len(rms) < 3:
            return found
        ratio = self.thresholds["vanishing_ratio" if results.step >= self.thresholds["warmup_steps"]
                                else "vanishing_early_ratio"]
        median = statistics.median(rms.values())
        limit = ratio * median
        for layer, value in rms.items():
            if self._streak("vanishing", layer, value < limit) >= self.thresholds["vanishing_steps"]:
                found.append(Alert(results.step, "vanishing_gradients", layer, "gradient_rms", value, limit,
                                   f"vanishing gradients at step {results.step} in {layer!r}: its output gradient's "
                                   f"RMS {value:.3g} is below {ratio:g} x the median {median:.3g} of the watched "
                                   f"layers for {self.thresholds['vanishing_steps']:g} logging steps in a row"))
        return found

    def _diverged(self, results: StepResults) -> list[Alert]:
        """Diverged: the output gradient became exactly zero in more than half of the layers that had one before,
        while the last layer in forward order (the model's output) still gets one: the loss has a gradient and
        none passes back. A learning rate far too high blows the weights up and leaves every ReLU dead or every
        Tanh saturated (the demo CNN at lr 10: 7 of 8 layers at exactly zero). No healthy program of the benchmark
        has one layer at exactly zero."""
        usable = {layer: s for layer, s in results.gradients.items() if s.finite_count and not s.nonfinite}
        order = [layer for layer in results.activations if layer in usable] or list(usable)
        if len(order) < 3 or usable[order[-1]].sum_squares == 0:
            return []
        zero = [layer for layer in order if usable[layer].sum_squares == 0 and layer in self._had_gradient]
        if 2 * len(zero) <= len(order):
            return []
        return [Alert(results.step, "diverged", None, "zero_gradient_layers", float(len(zero)), len(order) / 2,
                      f"training diverged at step {results.step}: the gradient is exactly zero in {len(zero)} of "
                      f"{len(order)} layers that had one before, and only the output {order[-1]!r} gets one: the "
                      "units are dead or saturated, usually after a learning rate too high blew the weights up")]

    def _exploding(self, results: StepResults) -> list[Alert]:
        """Exploding gradients: a layer's gradient norm above ``exploding_factor`` (10) x the largest of its last
        logging steps (at most 32) once it has ``exploding_min_history`` (8) of them, above
        ``exploding_early_factor`` (1000) x before. The largest follows a layer that grows while it learns: the
        healthy programs of the benchmark reach 0.46 decades over it (an LSTM language model's embedding as it
        starts to learn rises 3x a logging step, 30x over its median), and their first logging steps stay within
        one decade; a learning rate x1000 reaches 4.7 decades in one logging step, the demo CNN at lr 10 five
        decades at its second."""
        found = []
        for layer, summary in results.gradients.items():
            norm = summary.norm
            history = self._gradients.setdefault(layer, deque(maxlen=HISTORY))
            if not math.isfinite(norm) or norm <= 0 or summary.nonfinite:
                continue
            value = math.log10(norm)
            grown = len(history) >= self.thresholds["exploding_min_history"]
            factor = self.thresholds["exploding_factor" if grown else "exploding_early_factor"]
            if history and value > max(history) + math.log10(factor):
                largest = 10.0 ** max(history)
                found.append(Alert(results.step, "exploding_gradients", layer, "gradient_norm", norm, factor * largest,
                                   f"exploding gradients at step {results.step} in {layer!r}: gradient norm {norm:.3g} "
                                   f"is {norm / largest:.3g}x the largest {largest:.3g} of its last {len(history)} "
                                   f"logging steps (the limit is {factor:g}x)"))
            history.append(value)
        return found

    def _exploding_activations(self, results: StepResults) -> list[Alert]:
        """Exploding activations: a layer's output RMS above ``activation_factor`` (100) x the largest of its last
        logging steps, while the last watched layer's (the model's output side) is above 10x the largest of its own:
        the blow-up reaches the output. The first such layer in forward order is named (where the blow-up enters:
        the first layer for a batch out of range, every layer for weights blown up). The healthy programs of the
        benchmark move by less than one decade; a batch x1000 moves the first layer by three, the demo CNN at
        lr 10 its output by six. A layer a normalization follows may grow by three decades at the first update
        of a batch-2 ResNet-18 while its output stays put (tests/test_zoo.py): that is no blow-up."""
        jumps: dict[str, tuple[float, float, int]] = {}  # layer -> (log10 RMS, its largest before, history length)
        for layer, summary in results.activations.items():
            rms = _rms(summary)
            history = self._activations.setdefault(layer, deque(maxlen=HISTORY))
            if not math.isfinite(rms) or rms <= 0 or summary.nonfinite:
                continue
            value = math.log10(rms)
            jumps[layer] = (value, max(history, default=math.inf), len(history))
            history.append(value)
        if not jumps:
            return []
        last_value, last_before, _ = jumps[next(reversed(jumps))]
        if not last_value > last_before + 1.0:  # the output side did not grow 10x: nothing reached it
            return []
        factor = math.log10(self.thresholds["activation_factor"])
        for layer, (value, before, count) in jumps.items():
            if value > before + factor:
                rms, limit = 10.0 ** value, 10.0 ** (before + factor)
                return [Alert(results.step, "exploding_activations", layer, "activation_rms", rms, limit,
                              f"exploding activations at step {results.step} in {layer!r}: output RMS {rms:.3g} is "
                              f"{10.0 ** (value - before):.3g}x the largest of its last {count} logging steps: a batch "
                              "out of range, or weights blown up by a learning rate too high")]
        return []

    def _frozen(self, results: StepResults) -> list[Alert]:
        """Frozen parameter: a parameter whose gradient's RMS is at least 1e-4 x its own and whose values (sum, sum
        of squares, min, max) are the same over ``frozen_steps`` + 1 (3) logging steps in a row, while other
        parameters change or an optimizer holds it at a learning rate above 0. Two causes, told apart by what the
        optimizer that applied the step's gradients says (``results.layer_values["optimizer"]``, read on the host
        at its step): it is not in the optimizer or its learning rate is 0; or it is, and its updates are below
        half a float step of its values, so rounding drops them (a batch norm's weights of 1.0 under SGD at lr
        1e-4 in float32; any weight of a model cast to bfloat16 at a small learning rate). A smaller gradient may
        move it by less than float32 resolves; the healthy programs of the benchmark have none.

        Where ``update_lost`` runs, such a parameter (the same gradient bound) that the optimizer holds at a
        learning rate above 0 is also frozen, by rounding, when at least ``frozen_lost_fraction`` (0.9) of its
        updates were lost at each of those logging steps, although a few of its elements still move, so that its
        values are not quite the same: a batch norm's 24 weights of 1.0 under SGD at lr 1e-4 in float32 with a
        gradient RMS of 1.8e-4 lose 22 of 24 updates a step (``tests/test_update_statistics.py``, the shape of
        torchvision's shufflenet_v2); a float32 MLP under Adam at lr 1e-2 loses none. The gradient bound stays:
        a convolution's bias before a batch norm has a gradient of rounding noise (5e-10), all of whose updates
        are lost, and nothing to fix."""
        found = []
        same: dict[str, bool] = {}
        for name, weights in results.weights.items():
            fingerprint = (weights.sum, weights.sum_squares, weights.min, weights.max)
            same[name] = fingerprint == self._fingerprints.get(name)
            self._fingerprints[name] = fingerprint
        others_moved = sum(not unchanged for unchanged in same.values())
        held = results.layer_values.get("optimizer", {})
        for name, weights in results.weights.items():
            grad = results.weight_grads.get(name)
            # float32 cannot hold a change below 6e-8 of a value: an SGD step at lr 1e-3 needs a gradient RMS
            # of 1e-4 x the parameter's to move it visibly
            moving_grad = (grad is not None and not grad.nonfinite and grad.sum_squares > 0
                           and _rms(grad) >= 1e-4 * _rms(weights))
            rate = held.get(name, {}).get("learning_rate", 0.0)
            lost = results.layer_values.get("update_lost", {}).get(name, {}).get("lost_fraction")
            rounded = rate > 0 and lost is not None and lost >= self.thresholds["frozen_lost_fraction"]  # not NaN
            frozen = moving_grad and ((same[name] and (others_moved > 0 or rate > 0)) or rounded)
            if self._streak("frozen", name, frozen) >= self.thresholds["frozen_steps"]:
                steps = self.thresholds["frozen_steps"] + 1
                change = ("has not changed" if same[name] else
                          f"rounding dropped at least {self.thresholds['frozen_lost_fraction']:.0%} of its updates")
                start = (f"frozen parameter at step {results.step}: {name!r} has a gradient (norm {grad.norm:.3g}) "
                         f"and {change} over {steps:g} logging steps: ")
                cause = (_rounding(rate, weights, grad, held[name], lost) if rate > 0 else
                         "it is not in the optimizer, or its learning rate is 0: add it to the optimizer (a "
                         "parameter group forgotten?) or give its group a learning rate")
                found.append(Alert(results.step, "frozen_parameter", name, "gradient_norm", grad.norm, 0.0, start + cause))
        return found


def _rounding(rate: float, weights: Summary, grad: Summary, held: dict[str, float], lost: float | None) -> str:
    """The ``frozen_parameter`` cause of a parameter in the optimizer at learning rate ``rate``: its updates round
    away. Says half a float step at its RMS value against the learning rate x its gradient's RMS (SGD's step), the
    lost-update fraction ``lost`` where ``statistics=[..., "update_lost"]`` measured it, and the fixes."""
    value = _rms(weights)
    eps = held.get("float_eps", 2.0 ** -23)
    half_step = 2.0 ** math.floor(math.log2(value)) * eps / 2 if value > 0 else math.nan
    bits = {2.0 ** -7: "bfloat16", 2.0 ** -10: "float16", 2.0 ** -23: "float32", 2.0 ** -52: "float64"}.get(eps, "its float")
    measured = f"; {lost:.1%} of its updates were lost at this step" if lost is not None and math.isfinite(lost) else ""
    return (f"it is in the optimizer at learning rate {rate:g}, but its updates are below half a {bits} step of its "
            f"values (half a step at its RMS {value:.3g} is {half_step:.3g}; learning rate x gradient RMS is "
            f"{rate * _rms(grad):.3g}){measured}, so rounding drops them: keep float32 master weights (autocast "
            "instead of casting the model to a 16-bit type), use a larger learning rate, or a smaller weight")


def health_monitor(
    thresholds: dict[str, float], relu_layers: set[str] | frozenset[str] = frozenset(),
    matrices: Container[str] | None = None, on_alert: Callable[[Alert], None] | None = None,
) -> HealthMonitor:
    """A :class:`~actviz.diagnosis.alerts.HealthMonitor` with every rule, these included.

    Example:
        >>> from actviz.diagnosis.alerts import check_alerts
        >>> health_monitor(check_alerts(True)).trends is not None
        True
    """
    return HealthMonitor(thresholds, relu_layers, matrices, on_alert, LayerTrends(thresholds))
