"""Ctrl-C at any stage of a logging step's start or end: no hook is left after ``close()``, and the next steps log.

Each stage's function is patched to raise ``KeyboardInterrupt`` once, at step 1 (after the real work of the stage
where the interrupt would come after it, as a signal may); the loop catches it, as a notebook cell or a trainer's
Ctrl-C handler does, and trains on. ``torch`` runs a module's ``always_call`` forward hooks on an ``Exception``
only, so a ``KeyboardInterrupt`` leaves a forward without the hook that ends its step.
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
from conftest import NO_HOOKS, hooks_left, small_cnn
from torch import nn

import actviz
from actviz.capture.open_steps import OpenSteps
from actviz.capture.output_gradients import OutputGradients
from actviz.capture.probe import ProbeForward
from actviz.capture.step_capture import StepCapture
from actviz.capture.step_end import StepEnd
from actviz.capture.step_parameters import LoopHistory, StepParameters
from actviz.common.owned_hooks import ForwardHooks
from actviz.output.pending_step import PendingStep

STEPS, INTERRUPTED = 4, 1

#: stage: (the object, its function's name, whether the interrupt comes after the function's own work)
STAGES = {
    "probe pictures": (ProbeForward, "pictures", False),
    "registration": (OpenSteps, "add", True),
    "statistics chosen": (LoopHistory, "statistics", False),
    "layer hooks put on": (ForwardHooks, "add_to", True),
    "parameters attached": (StepParameters, "attach", True),
    "end of forward": (StepCapture, "_forward_done", False),
    "output gradient": (OutputGradients, "_on_node_grad", True),
    "end of backward": (StepEnd, "backward_done", False),
    "optimizer step": (StepEnd, "optimizer_step", False),
    "hand over": (StepCapture, "hand_over", False),
    "copy to the host": (PendingStep, "send", True),
    "delivery": (OpenSteps, "deliver_in_order", True),
}


class Interruptible(nn.Module):
    """small_cnn, whose forward can be interrupted between its layers (Ctrl-C inside the user's own code)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = small_cnn()
        self.interrupt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body[:3](x)
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return self.body[3:](x)


def interrupt_once(monkeypatch: pytest.MonkeyPatch, owner: type, name: str, after: bool, armed: dict) -> None:
    original = getattr(owner, name)

    def patched(*args, **kwargs):
        if armed["now"]:
            armed["now"] = False
            if after:
                original(*args, **kwargs)
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)


def train(model: Interruptible, viz: actviz.Watcher, armed: dict, stage: str) -> list[int]:
    """Train STEPS steps; the stage raises once at step INTERRUPTED. The steps whose code raised KeyboardInterrupt."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    interrupted = []
    for step in range(STEPS):
        armed["now"] = step == INTERRUPTED and stage != "in the forward"
        model.interrupt = step == INTERRUPTED and stage == "in the forward"
        try:
            optimizer.zero_grad()
            model(torch.randn(4, 3, 8, 8)).square().mean().backward()
            optimizer.step()
        except KeyboardInterrupt:
            interrupted.append(step)
    armed["now"] = False
    viz.flush()
    return interrupted


@pytest.mark.parametrize(("stage", "probe"), [(stage, probe) for stage in [*STAGES, "in the forward"]
                                               for probe in (False, True) if probe or stage != "probe pictures"])
def test_ctrl_c_at_any_stage_leaves_no_hook_and_the_next_steps_log(monkeypatch, stage, probe):
    armed = {"now": False}
    if stage in STAGES:
        interrupt_once(monkeypatch, *STAGES[stage], armed)
    model = Interruptible()
    written = []
    options = {"extras": [actviz.Probe(torch.randn(1, 3, 8, 8))]} if probe else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        viz = actviz.watch(model, tempfile.mkdtemp(), every=1, on_step=lambda results: written.append(results.step),
                           **options)
        interrupted = train(model, viz, armed, stage)
        viz.close()
    assert interrupted == [INTERRUPTED], "the interrupt reached the training loop"
    assert hooks_left(model) == NO_HOOKS
    assert {INTERRUPTED + 1, INTERRUPTED + 2} <= set(written), written  # the steps after it log
    assert written == sorted(written)
    # A new watcher on the same model works and leaves nothing either.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, **options) as again:
            model(torch.randn(4, 3, 8, 8)).square().mean().backward()
            again.flush()
            assert again.latest is not None and again.latest.step == 0
    assert hooks_left(model) == NO_HOOKS
