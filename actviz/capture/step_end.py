"""When a logging step ends: its backward pass, the optimizer step that applies its gradients, the next forward.

:class:`StepEnd` is the part of :class:`~actviz.capture.step_capture.StepCapture` that decides when the
step is over (the capture's module docstring says when). Its state lives on the capture:
``done``, ``in_forward``, ``expects_backward``, ``backward_seen``, ``awaiting_optimizer``,
the :class:`~actviz.capture.step_parameters.StepParameters` and the loop's
:class:`~actviz.capture.step_parameters.LoopHistory`.

Example (a GAN discriminator's step: two backward passes, then the optimizer step that
applies their sum, which is what ``weight_grads`` log):
    >>> import tempfile, torch, actviz
    >>> critic = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(critic.parameters(), lr=0.1)
    >>> real, fake = torch.ones(1, 2), -torch.ones(1, 2)
    >>> with actviz.watch(critic, tempfile.mkdtemp(), every=2) as viz:
    ...     optimizer.zero_grad()
    ...     critic(real).sum().backward()  # step 0: waits for its optimizer step
    ...     critic(fake).sum().backward()  # step 1
    ...     applied = critic.weight.grad.clone()
    ...     optimizer.step()
    ...     viz.flush()
    >>> viz.latest.weight_grads["weight"].sum == float(applied.sum())
    True
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..common._internals import queue_end_of_backward
from ..common.optimizer_steps import stepping

__all__ = ["MAX_FORWARDS_UNSTEPPED", "StepEnd"]

logger = logging.getLogger(__name__)

#: Forwards a step waits for an optimizer step, in a run that has not shown one yet (gradient accumulation).
MAX_FORWARDS_UNSTEPPED = 8


class StepEnd:
    """Mixed into :class:`~actviz.capture.step_capture.StepCapture`: the end-of-step decisions."""

    done: bool
    in_forward: bool
    expects_backward: bool
    backward_seen: bool
    awaiting_optimizer: bool
    options: Any
    want_stats: bool
    _parameters: Any
    _history: Any
    _stepped: bool
    _forwards_since: int
    _pass_reached: bool
    _callback_queued: bool
    _in_closure: bool

    def finish(self, missed_backward: bool = False) -> None:
        raise NotImplementedError

    def _queue_backward_callback(self) -> None:
        """Ask autograd to call :meth:`_on_backward_end` when this backward pass ends (as DDP does)."""
        if self._callback_queued:
            return
        self._callback_queued = True
        self._parameters.take_loss_scale()
        try:
            queue_end_of_backward(self._on_backward_end)
        except Exception:
            logger.debug("could not queue an end-of-backward callback", exc_info=True)

    def _on_backward_end(self) -> None:
        reached, self._pass_reached, self._callback_queued = self._pass_reached, False, False
        if self.done:
            return
        self.backward_seen = self.backward_seen or reached
        if self.backward_seen and self.want_stats:
            self._parameters.note_gradients()
            self._in_closure = self._in_closure or stepping()  # LBFGS: the step uses, then zeroes, them
            if not self._history.optimizer_steps or self._in_closure:  # as this pass left them, until a step
                self._parameters.take_gradients()
        elif self.expects_backward and not self.in_forward:  # it updated the parameters, not through us
            self.finish(missed_backward=True)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer that holds a watched parameter is about to apply the gradients: the step is over."""
        if self.done:
            return
        if not self.backward_seen:  # gradients from another forward's backward: this one's outputs got none
            if self.expects_backward and not self.in_forward:
                self.finish(missed_backward=True)
            return
        self._history.optimizer_steps = True
        if self._parameters.dropped():  # zeroed since this step's backward: the optimizer applies others
            self.finish()  # without them (finish: the loop steps an optimizer)
            return
        self._parameters.take_gradients(optimizer)
        self._stepped = True
        if not self.options.update_ratio:  # else wait until the update is done: the next forward
            self.finish()

    def _on_optimizer_done(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer step is over: if a closure ran this step's backward inside it (LBFGS, Lightning),
        it applied these gradients, which it leaves in ``.grad``."""
        if self.done or not self.backward_seen or self._stepped:
            return
        self._history.optimizer_steps = True
        self._parameters.take_gradients(optimizer)
        self._stepped = True
        if not self.options.update_ratio:
            self.finish()

    def next_forward(self) -> None:
        """A new training forward starts: end this step unless it waits for its backward pass or optimizer step.

        After its backward, a step waits for an optimizer step (a GAN discriminator's fake batch
        runs a forward and a backward first), unless the loop is known to step none.
        """
        if self.backward_seen:
            if self.want_stats and not self._stepped and self._parameters.dropped():  # zeroed before any step
                self.finish()  # logged as the backward left them unless the loop steps an optimizer (finish)
                return
            waits = self._history.optimizer_steps is not False and self._parameters.trainable and self.want_stats
            self._forwards_since += self.awaiting_optimizer
            if self._stepped or not waits:
                self.finish()
            elif self._history.optimizer_steps is None and self._forwards_since >= MAX_FORWARDS_UNSTEPPED:
                self.give_up()  # no optimizer step yet in this run: likely none
            else:
                self.awaiting_optimizer = True
        elif not self.expects_backward:
            self.finish()

    def give_up(self) -> None:
        """End a step that waited too long: for its backward pass (said once), or for an optimizer step."""
        if self.awaiting_optimizer and self._history.optimizer_steps is None:
            self._history.optimizer_steps = False  # a loop without optimizer: later steps end at the next forward
        self.finish(missed_backward=not self.backward_seen)
