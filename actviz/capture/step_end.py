"""When a logging step ends: its stage, and one method per event that moves it on.

A :class:`StepEnd` belongs to one :class:`~actviz.capture.step_capture.StepCapture` and holds
its :class:`Stage`; the capture, its output gradients and the optimizer hook tell it what
happened, and it decides when the step is over. The stages, and the events that leave them:

========================= ===============================================================================
``FORWARD``               the model's forward runs. :meth:`~StepEnd.forward_done`: over if nothing waits
                          for a backward pass, else ``WAITING_FOR_BACKWARD``
``WAITING_FOR_BACKWARD``  a watched output requires grad. :meth:`~StepEnd.backward_done`:
                          ``WAITING_FOR_OPTIMIZER``; an optimizer step first: over, without gradients
``WAITING_FOR_OPTIMIZER`` a backward pass reached the outputs. :meth:`~StepEnd.optimizer_step`: the
                          gradients it applies are taken, and the step is over (or ``WAITING_FOR_UPDATE``);
                          :meth:`~StepEnd.next_forward`: over in a loop that steps no optimizer
``WAITING_FOR_UPDATE``    with ``update_ratio`` or an update statistic, the optimizer took the gradients: over at the
                          next forward, once the update is done
``DONE``                  :meth:`~StepEnd.close` ran (also at ``flush()``): hooks off, results delivered
========================= ===============================================================================

A step may wait for its backward through other forwards (a siamese pair, an RL episode) and, after
it, for the optimizer step through further forwards and backwards (a GAN discriminator's real and
fake batches; gradient accumulation, at most :data:`MAX_FORWARDS_UNSTEPPED` forwards in a run that
has shown no optimizer step). :meth:`~StepEnd.give_up` ends a step that waited too long
(:mod:`actviz.capture.open_steps`).

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

import enum
from collections.abc import Callable

import torch

from ..common.optimizer_steps import stepping
from .step_parameters import LoopHistory, StepParameters

__all__ = ["MAX_FORWARDS_UNSTEPPED", "Stage", "StepEnd"]

#: Forwards a step waits for an optimizer step, in a run that has not shown one yet (gradient accumulation).
MAX_FORWARDS_UNSTEPPED = 8


class Stage(enum.Enum):
    """Where a logging step is in its life (the module docstring's table says what moves it on)."""

    FORWARD = "forward"
    WAITING_FOR_BACKWARD = "waiting for backward"
    WAITING_FOR_OPTIMIZER = "waiting for the optimizer"
    WAITING_FOR_UPDATE = "waiting for the update"
    DONE = "done"


_BACKWARD_SEEN = (Stage.WAITING_FOR_OPTIMIZER, Stage.WAITING_FOR_UPDATE)  # a backward pass reached the outputs


class StepEnd:
    """The stage of one logging step, and the decision, at each event, whether it is over.

    Args:
        parameters: The step's watched parameters: whose gradients each event takes, or drops.
        history: What the watcher knows of its loop: whether it steps an optimizer.
        want_stats: The step logs its parameters' gradients (a stats step).
        hand_over: Called once, by :meth:`close`, with whether the gradients the step waited for
            never came or were dropped (:meth:`~actviz.capture.step_capture.StepCapture.hand_over`).

    Attributes:
        stage: The step's :class:`Stage`.
        dropped_gradients: The step ended without the gradients its backward made: they were
            zeroed before an optimizer applied them.
    """

    def __init__(self, parameters: StepParameters, history: LoopHistory, *, want_stats: bool,
                 hand_over: Callable[[bool], None]) -> None:
        self.stage = Stage.FORWARD
        self.dropped_gradients = False
        self._parameters = parameters
        self._history = history
        self._want_stats = want_stats
        self._hand_over = hand_over
        self._in_closure = False  # its backward ran inside an optimizer step's closure (LBFGS, Lightning)
        self._forwards_waited = 0  # forwards started while it waited for an optimizer step

    def forward_done(self, expects_backward: bool, backward_seen: bool) -> None:
        """The model's forward returned: a watched output requires grad (``expects_backward``), and a
        backward pass inside the forward may already have reached them (``backward_seen``: ``torch.autograd.grad``)."""
        if self.stage is not Stage.FORWARD:
            return
        if backward_seen:
            self.stage = Stage.WAITING_FOR_OPTIMIZER
        elif expects_backward:
            self.stage = Stage.WAITING_FOR_BACKWARD
        else:
            self.close()

    def backward_done(self) -> None:
        """A backward pass that reached a watched output ended: the gradients are taken as it left them
        when no optimizer will (a loop without one, or a closure's step that already ran)."""
        if self.stage is Stage.DONE:
            return
        if self.stage is Stage.WAITING_FOR_BACKWARD:
            self.stage = Stage.WAITING_FOR_OPTIMIZER
        if self._want_stats:
            self._parameters.note_gradients()
            self._in_closure = self._in_closure or stepping()  # LBFGS: the step uses, then zeroes, them
            if not self._history.optimizer_steps or self._in_closure:  # as this pass left them, until a step
                self._parameters.take_gradients()
        elif self.stage is not Stage.FORWARD:  # an images step: it has no parameter gradients to wait for
            self.close(missed_backward=True)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer that holds a watched parameter is about to apply the gradients: the step is over."""
        stage = self.stage
        if stage is Stage.WAITING_FOR_BACKWARD:  # gradients from another forward's backward: this one's outputs got none
            self.close(missed_backward=True)
        if stage not in _BACKWARD_SEEN:
            return
        self._history.optimizer_steps = True
        if self._parameters.dropped():  # zeroed since this step's backward: the optimizer applies others
            self.close()  # without them (close: the loop steps an optimizer)
            return
        self._optimizer_took(optimizer)

    def optimizer_done(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer step is over: if a closure ran this step's backward inside it (LBFGS, Lightning),
        it applied these gradients, which it leaves in ``.grad``."""
        if self.stage is Stage.WAITING_FOR_OPTIMIZER:
            self._history.optimizer_steps = True
            self._optimizer_took(optimizer)

    def _optimizer_took(self, optimizer: torch.optim.Optimizer) -> None:
        self._parameters.take_gradients(optimizer)
        self.stage = Stage.WAITING_FOR_UPDATE
        if not self._parameters.waits_for_update:  # else wait until the update is done: the next forward
            self.close()

    def next_forward(self) -> None:
        """A new training forward starts: end this step unless it waits for its backward pass or optimizer step.

        After its backward, a step waits for an optimizer step (a GAN discriminator's fake batch
        runs a forward and a backward first), unless the loop is known to step none.
        """
        stage = self.stage
        if stage is Stage.WAITING_FOR_UPDATE:
            self.close()
        elif stage is Stage.WAITING_FOR_OPTIMIZER:
            want_stats = self._want_stats
            if want_stats and self._parameters.dropped():  # zeroed before any step
                self.close()  # logged as the backward left them unless the loop steps an optimizer (close)
            elif not (self._history.optimizer_steps is not False and self._parameters.trainable and want_stats):
                self.close()
            elif self._history.optimizer_steps is None and self._forwards_waited >= MAX_FORWARDS_UNSTEPPED:
                self.give_up()  # no optimizer step yet in this run: likely none
            else:
                self._forwards_waited += 1

    def give_up(self) -> None:
        """End a step that waited too long: for its backward pass (said once), or for an optimizer step."""
        if self.stage is Stage.WAITING_FOR_OPTIMIZER and self._history.optimizer_steps is None:
            self._history.optimizer_steps = False  # a loop without optimizer: later steps end at the next forward
        self.close(missed_backward=self.stage not in _BACKWARD_SEEN)

    def close(self, missed_backward: bool = False) -> None:
        """End the step (also at ``flush()`` and ``close()``): once, however often called.

        ``missed_backward`` says the backward pass the outputs waited for never came.
        """
        if self.stage is Stage.DONE:
            return
        if self.stage is Stage.WAITING_FOR_OPTIMIZER and self._want_stats and not self._parameters.taken_at_step:
            # A closure's step (LBFGS, Lightning) and a loop that updates by hand (word_language_model) used them as
            # its backward left them; a loop whose optimizer steps them did not (zeroed first, or no step came).
            if not self._in_closure and self._history.optimizer_steps:
                self._parameters.discard_gradients()
                self.dropped_gradients = True
        self.stage = Stage.DONE
        hand_over, self._hand_over = self._hand_over, _handed_over  # the capture's own method: no cycle left
        hand_over(missed_backward or self.dropped_gradients)


def _handed_over(missed_backward: bool) -> None:
    """What a closed :class:`StepEnd` holds instead of its capture's ``hand_over``: the step went once."""
