"""Transformer alerts: pure rules over one logging step's numbers and a short history.

Each rule takes the step's attention statistics (``{layer: {"max_logit": ..., "entropy_min":
..., "entropy_fraction_min": ...}}``) or outlier numbers (``{layer: {"max_abs": ..., "median_abs": ..., "headroom_bits":
...}}``) and returns messages; none reads a device or keeps state, so another alert
mechanism can call them as they are. :class:`TransformerAlerts` keeps the history the
entropy rule needs, one per watched model. Each rule returns :class:`~actviz.diagnosis.alerts.Alert`
objects; the step carries them (``StepResults.alerts``) to the health monitor
(:class:`~actviz.diagnosis.alerts.HealthMonitor`), which reports them as it reports its own: once per
rule and layer, in ``viz.alerts``, to ``on_alert``, as a ``RuntimeWarning`` and a line of
the step's ``alerts`` text. ``watch(alerts=False)`` turns them off with the others.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence

from .alerts import Alert

__all__ = [
    "ENTROPY_WINDOW", "HEADROOM_MIN_BITS", "MASSIVE_RATIO", "MAX_LOGIT_LIMIT", "TransformerAlerts",
    "COLLAPSED_FRACTION", "entropy_collapse_alerts", "entropy_level", "headroom_alerts", "massive_activation_alerts", "max_logit_alerts",
    "outlier_alerts",
]

#: Attention logits above this (Kimi K2's QK-clip threshold; Gemma 2 soft-caps at 50).
MAX_LOGIT_LIMIT = 100.0
#: Logging steps the entropy rule looks back over.
ENTROPY_WINDOW = 5
#: The fraction of its ceiling ``log(keys)`` below which a head's entropy counts as collapsed: a head whose
#: weight one key takes is near 0 (0.003 to 0.05 in tests/test_attention_naming_and_padding.py), while
#: healthy heads that sharpen as they learn stay above it (the word language model's Transformer of
#: scripts/diagnosis_benchmark.py goes down to 0.30).
COLLAPSED_FRACTION = 0.1
#: Low-precision outputs with less headroom than this, in bits, are about to overflow.
HEADROOM_MIN_BITS = 1.0
#: max|x| over this many times the median |x|: massive activations (Sun et al. 2024).
MASSIVE_RATIO = 1000.0

Numbers = Mapping[str, Mapping[str, float]]


def max_logit_alerts(step: int, attention: Numbers, limit: float = MAX_LOGIT_LIMIT) -> list[Alert]:
    """Layers whose attention max logit is above ``limit``.

    Example:
        >>> [alert.message for alert in max_logit_alerts(3, {"h.0.attn": {"max_logit": 140.0}, "h.1": {"max_logit": 9.0}})]
        ["attention max logit 140 > 100 in 'h.0.attn' at step 3 (softmax near one-hot; QK-norm or clipping keeps it down)"]
    """
    return [Alert(step, "attention_max_logit", layer, "max_logit", stats["max_logit"], limit,
                  f"attention max logit {stats['max_logit']:.4g} > {limit:g} in {layer!r} at step {step} "
                  "(softmax near one-hot; QK-norm or clipping keeps it down)")
            for layer, stats in attention.items() if stats.get("max_logit", -math.inf) > limit]


def entropy_level(stats: Mapping[str, float]) -> tuple[str, float]:
    """What the entropy rule follows for one layer: ``("entropy_fraction_min", value)`` where the step has it,
    else ``("entropy_min", nats)``.

    ``entropy_fraction_min`` is the lowest, over heads, of a head's mean over its sampled rows of each row's
    entropy over its own ceiling ``log(keys the row may attend)``
    (:func:`~actviz.transformers.attention_stats.entropy_fractions`). A padded batch gives rows different
    ceilings, and the sample that is measured changes from step to step: the fraction compares like with
    like where nats do not. The entropy in nats is what a run's ``entropy_min`` tag holds.

    Example:
        >>> entropy_level({"entropy_min": 0.7, "entropy_fraction_min": 0.64}), entropy_level({"entropy_min": 0.7})
        (('entropy_fraction_min', 0.64), ('entropy_min', 0.7))
    """
    if "entropy_fraction_min" in stats:
        return "entropy_fraction_min", stats["entropy_fraction_min"]
    return "entropy_min", stats.get("entropy_min", math.nan)


def entropy_collapse_alerts(step: int, attention: Numbers, history: Mapping[str, Sequence[float]]) -> list[Alert]:
    """Layers whose entropy (:func:`entropy_level`) fell below half its highest value over the recent logging
    steps (``history``, of the same measure), and, as a fraction of its ceiling, below
    :data:`COLLAPSED_FRACTION`.

    One key taking all the weight brings the fraction of the ceiling to 0 whatever the row's length, while
    a healthy head's fraction moves little from batch to batch, padded or not: half of its recent highest
    leaves a margin that padded batches of lengths 3 to 16 of 16 stay inside. A head that sharpens as it
    learns may halve its fraction over a few logging steps, and stays above :data:`COLLAPSED_FRACTION`.

    Example:
        >>> [alert.message for alert in entropy_collapse_alerts(9, {"attn": {"entropy_min": 0.4}}, {"attn": [2.0, 1.5]})]
        ["attention entropy collapse in 'attn' at step 9: minimum 0.4 nats, down from 2 over the last 2 logging steps"]
        >>> (alert,) = entropy_collapse_alerts(9, {"a": {"entropy_min": 0.01, "entropy_fraction_min": 0.02}},
        ...                                    {"a": [0.8, 0.7]})
        >>> print(alert.message)
        attention entropy collapse in 'a' at step 9: 0.02 of its ceiling log(keys), down from 0.8 over the last 2 logging steps
    """
    found = []
    for layer, stats in attention.items():
        recent = [value for value in history.get(layer, ()) if math.isfinite(value)]
        statistic, current = entropy_level(stats)
        collapsed = statistic == "entropy_min" or current < COLLAPSED_FRACTION
        if recent and math.isfinite(current) and current < 0.5 * max(recent) and collapsed:
            level = f"minimum {current:.3g} nats" if statistic == "entropy_min" else (
                f"{current:.3g} of its ceiling log(keys)")
            found.append(Alert(step, "attention_entropy_collapse", layer, statistic, current, 0.5 * max(recent),
                               f"attention entropy collapse in {layer!r} at step {step}: {level}, "
                               f"down from {max(recent):.3g} over the last {len(recent)} logging steps"))
    return found


def headroom_alerts(step: int, outliers: Numbers, minimum: float = HEADROOM_MIN_BITS) -> list[Alert]:
    """Low-precision layers with less than ``minimum`` bits of headroom left.

    Example:
        >>> [alert.message for alert in headroom_alerts(2, {"mlp": {"headroom_bits": 0.5, "max_abs": 45000.0}})]
        ["'mlp' is 0.5 bits from overflowing its dtype at step 2 (max |x| 4.5e+04)"]
    """
    return [Alert(step, "low_headroom", layer, "headroom_bits", stats["headroom_bits"], minimum,
                  f"{layer!r} is {stats['headroom_bits']:.2g} bits from overflowing its dtype at step {step} "
                  f"(max |x| {stats['max_abs']:.2g})")
            for layer, stats in outliers.items() if stats.get("headroom_bits", math.inf) < minimum]


def massive_activation_alerts(step: int, outliers: Numbers, ratio: float = MASSIVE_RATIO) -> list[Alert]:
    """Layers whose max |x| is over ``ratio`` times their median |x| (median of the histogram's sample).

    Example:
        >>> [alert.message for alert in massive_activation_alerts(1, {"h.3": {"max_abs": 2e4, "median_abs": 0.5}})]
        ["massive activation in 'h.3' at step 1: max |x| 2e+04 is 4e+04 times the median |x| 0.5"]
    """
    found = []
    for layer, stats in outliers.items():
        high, median = stats.get("max_abs", math.nan), stats.get("median_abs", math.nan)
        if median > 0 and high > ratio * median:
            found.append(Alert(step, "massive_activation", layer, "max_abs_over_median", high / median, ratio,
                               f"massive activation in {layer!r} at step {step}: max |x| {high:.3g} is "
                               f"{high / median:.3g} times the median |x| {median:.3g}"))
    return found


def outlier_alerts(step: int, outliers: Numbers) -> list[Alert]:
    """The rules over the outlier statistic's typed values (``results.layer_values["outliers"]``):
    :func:`headroom_alerts`, then :func:`massive_activation_alerts`.

    Example:
        >>> [alert.rule for alert in outlier_alerts(2, {"mlp": {"headroom_bits": 0.5, "max_abs": 45000.0, "median_abs": 1.0}})]
        ['low_headroom', 'massive_activation']
    """
    return [*headroom_alerts(step, outliers), *massive_activation_alerts(step, outliers)]


class TransformerAlerts:
    """The rules above with their history, for one watched model's logging steps, in order.

    Example:
        >>> alerts = TransformerAlerts()
        >>> alerts.check(0, {"attn": {"max_logit": 5.0, "entropy_min": 2.0}}, {})
        []
        >>> [alert.rule for alert in alerts.check(1, {"attn": {"max_logit": 5.0, "entropy_min": 0.5}}, {})]
        ['attention_entropy_collapse']
    """

    def __init__(self, window: int = ENTROPY_WINDOW) -> None:
        self._entropy: dict[str, deque[float]] = {}
        self._window = window

    def check(self, step: int, attention: Numbers, outliers: Numbers) -> list[Alert]:
        """Every alert of one step (the health monitor reports each rule and layer once), then remember its entropies."""
        found = [
            *max_logit_alerts(step, attention), *entropy_collapse_alerts(step, attention, self._entropy),
            *headroom_alerts(step, outliers), *massive_activation_alerts(step, outliers),
        ]
        for layer, stats in attention.items():
            self._entropy.setdefault(layer, deque(maxlen=self._window)).append(entropy_level(stats)[1])
        return found
