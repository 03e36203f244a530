"""Silences: why a watched run logs nothing, said once, with the cause and the fix.

A step is a call ``model(x)`` of the watched model in training mode with grad enabled
(see ``docs/steps.md``). Everything else is invisible by design, so a run can log
nothing for a reason the user cannot see. :class:`Silences` counts what the watcher's
root hook saw and says what it means:

* an optimizer steps twice in a row on the model's parameters with no training forward
  between: what ran between says why, at once. Only eval forwards: the model trains in eval
  mode (``model.train()`` forgotten, after a validation say); only forwards with grad
  disabled: it trains under ``no_grad``; no forward at all: it is called as
  ``model.forward(x)``, or its layers train through ``layer.forward()`` calls;
* no training forward at all: the same causes, from every forward seen, at ``close()``,
  or at ``flush()`` once the parameters have changed (a validation before training is fine);
* training forwards, none of them on a step the schedule picks: at ``close()``.

Optimizer steps come from the one process-wide pre-hook (:mod:`actviz.common.optimizer_steps`);
parameter changes without an optimizer from their version counters. A normal run says
nothing, and each kind is said at most once per watcher.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn

from ..common._internals import tensor_version
from ..common.optimizer_steps import OptimizerStepSubscription, subscribe
from ..common.safe_warnings import warn_once
from ..schedule import Schedule

__all__ = ["Silences"]

logger = logging.getLogger(__name__)

_FORWARD_FIX = (
    "A forward run as model.forward(x), or as layer.forward(x) inside a layer's own training loop (as "
    "forward-forward networks do), bypasses PyTorch's module hooks, so actviz never sees it: call model(x) "
    "instead. Forwards it does see, such as inference calls of a predict() method, are counted as training "
    "steps unless they run under torch.no_grad()."
)


class Silences:
    """Counts the forwards, steps and optimizer steps a watcher saw, and warns when they add up to silence.

    Args:
        model: The watched model (its parameters are the ones whose changes count).
        stats_schedule: The schedule of ``every=``.
        image_schedule: The schedule of ``image_every=``.
        active: ``False`` on a rank that logs nothing of its own (it may count the steps, FSDP2): nothing is said.

    Example:
        >>> import warnings
        >>> model = nn.Linear(2, 1).eval()
        >>> silences = Silences(model, Schedule.parse(10), Schedule.parse(10))
        >>> for _ in range(3):
        ...     silences.saw_forward(model)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     silences.check(closing=True)
        >>> "saw 3 forwards of Linear in eval mode" in str(caught[0].message)
        True
        >>> silences.close()
    """

    def __init__(
        self, model: nn.Module, stats_schedule: Schedule, image_schedule: Schedule, active: bool = True
    ) -> None:
        self._name = type(model).__name__
        self._active = active
        self._parameters = list(model.parameters()) if active else []
        self._ids = {id(param) for param in self._parameters}
        self._versions = [tensor_version(param) for param in self._parameters]
        self._schedules = (stats_schedule, image_schedule)
        self.training = self.eval = self.no_grad = 0  # forwards seen, by kind
        self._since = [0, 0]  # eval and no-grad forwards since the last training forward
        self.steps = self.logging_steps = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self._said: set[str] = set()
        self._holds: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        # per optimizer, at its last step: the forward counts, and how many of its steps in a row saw no training one
        self._last_seen: weakref.WeakKeyDictionary[Any, tuple[int, int, int, int]] = weakref.WeakKeyDictionary()
        self._subscription: OptimizerStepSubscription | None = None
        if active and self._parameters:
            self._subscription = subscribe(self._on_optimizer_step)

    # -- what the watcher saw ------------------------------------------------------------

    def saw_forward(self, model: nn.Module) -> None:
        """A forward of the watched model started (its root hook ran)."""
        if not model.training:
            self.eval += 1
            self._since[0] += 1
        elif not torch.is_grad_enabled():
            self.no_grad += 1
            self._since[1] += 1
        else:
            self.training += 1
            self._since = [0, 0]

    def saw_step(self, step: int, logs: bool) -> None:
        """A training forward started step ``step``; ``logs`` if a schedule picked it."""
        self.steps += 1
        self.logging_steps += int(logs)
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step

    # -- what it means -------------------------------------------------------------------

    def check(self, closing: bool) -> None:
        """Say what the counts mean, once per kind: at ``flush()`` (``closing=False``) and ``close()``."""
        if not self._active:
            return
        if self.training == 0:
            if self._said & {"eval", "no_grad", "no_forward"}:
                return  # said at an optimizer step already, from what ran between two steps
            changed = self._parameters_changed()
            if not (closing or changed):
                return  # nothing trained yet: a validation before training is fine
            if self.eval:
                self._say("eval", f"actviz logged nothing: it saw {self.eval} forwards of {self._name} in eval mode"
                          f"{self._no_grad_too()} and none in training mode with grad enabled, the only forwards "
                          "it logs. Call model.train() before the training loop (model.eval() stays on, after a "
                          "validation too, until model.train()).")
            elif self.no_grad:
                self._say("no_grad", f"actviz logged nothing: it saw {self.no_grad} forwards of {self._name} with "
                          "grad disabled (torch.no_grad() or torch.inference_mode()) and none with grad enabled, "
                          "the only forwards it logs. Run the training forward and backward outside no_grad.")
            elif changed:
                self._say("no_forward", f"actviz logged nothing: the parameters of {self._name} changed, but no "
                          f"forward of {self._name} was seen at all. {_FORWARD_FIX}")
        elif closing and self.logging_steps == 0:
            stats, images = self._schedules
            self._say("schedule", f"actviz logged nothing: it counted {self.steps} training steps (numbered "
                      f"{self.first_step} to {self.last_step}), and neither every= nor image_every= picks any of "
                      f"them ({_describe(stats)}; {_describe(images)}). Pick steps the run reaches (every=N "
                      "logs step 0, N, 2N, ...), or, with Options(auto_step=False), check the numbers given to viz.set_step().")

    def close(self) -> None:
        """Stop listening to optimizer steps. Safe to call more than once."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            subscription.remove()

    # -- helpers -------------------------------------------------------------------------

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        try:
            if not self._optimizer_holds_ours(optimizer):
                return
            trained, evals, no_grads, blind_run = self._last_seen.get(optimizer, (0, 0, 0, 0))
            blind = self.training == trained  # no training forward since this optimizer's last step
            self._last_seen[optimizer] = (self.training, self.eval, self.no_grad, blind_run + 1 if blind else 0)
            if blind and blind_run >= 1:  # twice in a row: LBFGS's first step comes before any forward
                # What ran between these two steps says why (a validation before training does not count).
                kind = "eval" if self.eval > evals else "no_grad" if self.no_grad > no_grads else "no_forward"
                self._say_blind(kind, type(optimizer).__name__, blind_run + 1, *self._since)
        except Exception:
            logger.debug("could not check an optimizer step for silences", exc_info=True)

    def _optimizer_holds_ours(self, optimizer: torch.optim.Optimizer) -> bool:
        holds = self._holds.get(optimizer)
        if holds is None:
            params = (param for group in optimizer.param_groups for param in group["params"])
            holds = self._holds[optimizer] = any(id(param) in self._ids for param in params)
        return holds

    def _say_blind(self, kind: str, optimizer: str, steps: int, evals: int, no_grads: int) -> None:
        seen = f"{optimizer} stepped {steps} times in a row on the parameters of {self._name} with no training forward"
        since = "since the last training forward (or since watch())"
        if kind == "eval":
            self._say("eval", f"actviz logs nothing now: {self._name} trains in eval mode. {seen} in between, and the "
                      f"{evals} forwards it saw {since} ran in eval mode{self._no_grad_too(no_grads)}. After a "
                      "validation, model.eval() stays on until model.train(): call model.train() before training "
                      "again (BatchNorm and Dropout also behave differently in eval mode).", stacklevel=5)
        elif kind == "no_grad":
            self._say("no_grad", f"actviz logs nothing now: {seen} in between; the {no_grads} forwards it saw {since} "
                      "ran with grad disabled (torch.no_grad() or torch.inference_mode()). Run the training forward "
                      "outside no_grad.", stacklevel=5)
        else:
            self._say("no_forward", f"actviz logs nothing now: {seen}, and no forward of {self._name} at all, in "
                      f"between. {_FORWARD_FIX}", stacklevel=5)

    def _no_grad_too(self, count: int | None = None) -> str:
        count = self.no_grad if count is None else count
        return f" ({count} more in training mode with grad disabled)" if count else ""

    def _parameters_changed(self) -> bool:
        return any(tensor_version(param) != version for param, version in zip(self._parameters, self._versions))

    def _say(self, kind: str, message: str, stacklevel: int = 4) -> None:
        warn_once(self._said, kind, message, RuntimeWarning, stacklevel=stacklevel)


def _describe(schedule: Schedule) -> str:
    return schedule.describe()
