"""The logging steps a watcher has open, and the order their results leave in.

A step stays open after its forward while it waits: for its backward pass (a siamese
pair's first half, an RL episode's actions) or, after it, for the optimizer step that
applies its gradients (a GAN discriminator's real batch waits through the fake batch).
At most :data:`MAX_WAITING` wait; the oldest beyond that give up. A step that ends while an
earlier one still waits is held back, so steps reach the writer in order.

Example (a siamese step: its first half waits for the backward pass through both halves):
    >>> import tempfile, torch, actviz
    >>> encoder = torch.nn.Linear(3, 2)
    >>> with actviz.watch(encoder, tempfile.mkdtemp(), every=2) as viz:
    ...     left, right = encoder(torch.randn(4, 3)), encoder(torch.randn(4, 3))  # steps 0 and 1
    ...     (left - right).square().sum().backward()
    ...     viz.flush()
    >>> viz.latest.step, sorted(viz.latest.weight_grads)
    (0, ['bias', 'weight'])
"""

from __future__ import annotations

from collections.abc import Callable

from ..output.pending_step import PendingStep
from .step_capture import StepCapture
from .step_end import Stage

__all__ = ["MAX_WAITING", "OpenSteps"]

#: Most steps kept open while they wait for a backward pass or an optimizer step that has not come yet.
MAX_WAITING = 4


class OpenSteps:
    """The open :class:`~actviz.capture.step_capture.StepCapture` objects of one watcher.

    Args:
        deliver: Where finished steps go, in step order.
    """

    def __init__(self, deliver: Callable[[PendingStep], None] | None) -> None:
        self.captures: list[StepCapture] = []
        self._deliver = deliver
        self._ready: list[PendingStep] = []  # finished steps held back for an earlier one

    def in_forward(self) -> bool:
        return any(capture.end.stage is Stage.FORWARD for capture in self.captures)

    def add(self, capture: StepCapture) -> None:
        self.captures.append(capture)

    def next_forward(self) -> None:
        """A training forward starts: end the steps that wait for nothing, give up the oldest beyond the limit."""
        for capture in self.captures:
            capture.end.next_forward()
        waiting = [capture for capture in self.captures if capture.end.stage is not Stage.DONE]
        for capture in waiting[:-MAX_WAITING]:
            capture.end.give_up()
        if len(waiting) != len(self.captures):  # ended: any hook a Ctrl-C inside its end left behind goes now
            for capture in self.captures:
                if capture.end.stage is Stage.DONE:
                    capture.abandon()
        self.captures = waiting[-MAX_WAITING:]
        self._release()

    def finish_all(self) -> None:
        captures = self.captures
        while captures:  # one at a time: a Ctrl-C here leaves the rest open for the next call
            captures[0].end.close()
            captures[0].abandon()  # ended: any hook a Ctrl-C inside its end left behind goes too
            del captures[0]
        self._release()

    def end_interrupted(self) -> None:
        """Abandon the steps still in their forward when a new top-level forward starts: an exception that is not
        an ``Exception`` (Ctrl-C) left their forward without the hook that ends it (torch runs ``always_call``
        hooks on an ``Exception`` only)."""
        for capture in self.captures:
            if capture.end.stage is Stage.FORWARD:
                capture.abandon()
        self.captures = [capture for capture in self.captures if capture.end.stage is not Stage.DONE]
        self._release()

    def release_stances(self) -> None:
        """Outside a compiled call: the steps past their forward need not keep later forwards eager."""
        for capture in self.captures:
            if capture.end.stage is not Stage.FORWARD:
                capture.release_stance()

    def forget(self) -> None:
        """Drop every open step without ending it (a forked child: they are the parent's)."""
        self.captures, self._ready = [], []

    def deliver_in_order(self, pending: PendingStep) -> None:
        """A capture's ``deliver``: hand ``pending`` on once every earlier open step has ended."""
        self._ready.append(pending)
        self._release()

    def _release(self) -> None:
        first_open = min((capture.step for capture in self.captures if capture.end.stage is not Stage.DONE), default=None)
        ready = sorted(self._ready, key=lambda pending: pending.step)
        self._ready = [pending for pending in ready if first_open is not None and pending.step >= first_open]
        if self._deliver is not None:
            for pending in ready[:len(ready) - len(self._ready)]:
                self._deliver(pending)
