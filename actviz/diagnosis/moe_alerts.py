"""The mixture-of-experts alert: experts that no token chooses, logging step after logging step.

:class:`DeadExperts` follows each router's experts over the logging steps of one watched model and
returns :class:`~actviz.diagnosis.alerts.Alert` objects; the step carries them (``StepResults.alerts``)
to the health monitor (:class:`~actviz.diagnosis.alerts.HealthMonitor`), which reports them as it
reports its own, in ``viz.alerts``, to ``on_alert``, as a ``RuntimeWarning`` and a line of the step's
``alerts`` text: once per streak of a router (``dead_experts`` is one of
:data:`~actviz.diagnosis.alerts.ONCE_AN_EPISODE`), again if its experts die again after they recovered. ``watch(alerts=False)`` turns it off with the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .alerts import Alert

__all__ = ["DEAD_EXPERT_STEPS", "MIN_MEAN_LOAD", "DeadExperts"]

#: Logging steps in a row that the same expert must be chosen by no token.
DEAD_EXPERT_STEPS = 3
#: Steps whose mean tokens per expert is below this are not judged. An expert that a healthy router gives a
#: quarter of the mean is left out of a step with probability about ``exp(-MIN_MEAN_LOAD / 4)`` (Poisson):
#: 0.018 at 16, so three steps in a row about 6e-6; small batches leave experts out by chance.
MIN_MEAN_LOAD = 16.0


class DeadExperts:
    """The dead-experts rule with its history: an expert of a router chosen by no token for
    :data:`DEAD_EXPERT_STEPS` judged logging steps in a row. An expert nobody chooses gets no gradient
    and never learns (Shazeer et al. 2017 and Fedus et al. 2021 add a load-balancing loss against it).

    A step that chooses every expert (or that is not judged: fewer than :data:`MIN_MEAN_LOAD` tokens per
    expert on average) ends the router's streak; the streak follows the experts dead in each of its steps,
    and its alert comes once, at its :data:`DEAD_EXPERT_STEPS`-th step.

    Example:
        >>> rule = DeadExperts()
        >>> load = [40.0, 24.0, 0.0, 0.0]   # 32 tokens per expert on average
        >>> [rule.check(step, {"moe.router": load}) for step in (0, 1)]
        [[], []]
        >>> print(rule.check(2, {"moe.router": load})[0].message)
        dead experts in 'moe.router' at step 2: experts 2, 3 chosen by no token for 3 logging steps in a row, so they get no gradient (a load-balancing loss keeps experts in use)
    """

    def __init__(self, steps: int = DEAD_EXPERT_STEPS) -> None:
        self._steps = steps
        self._dead: dict[str, tuple[frozenset[int], int]] = {}  # router -> experts dead all along, steps in a row

    def check(self, step: int, loads: dict[str, Sequence[float]]) -> list[Alert]:
        """The alerts of one logging step from each router's tokens per expert."""
        found = []
        for layer, load in loads.items():
            judged = len(load) > 0 and math.fsum(load) / len(load) >= MIN_MEAN_LOAD
            dead = frozenset(expert for expert, tokens in enumerate(load) if tokens == 0) if judged else frozenset()
            before, count = self._dead.get(layer, (frozenset(), 0))
            still = dead & before
            if still:
                count += 1
            else:  # a new streak, or none
                still, count = dead, int(bool(dead))
            self._dead[layer] = (still, count)
            if count == self._steps:  # once a streak
                experts = ", ".join(str(expert) for expert in sorted(still))
                found.append(Alert(step, "dead_experts", layer, "dead_experts", float(len(still)), 0.0,
                                   f"dead experts in {layer!r} at step {step}: expert{'s' if len(still) > 1 else ''} "
                                   f"{experts} chosen by no token for {count} logging steps in a row, so "
                                   "they get no gradient (a load-balancing loss keeps experts in use)"))
        return found
