"""A sink gets each step once, in order, with ``spikes=True`` too: a spike's ring-buffer norms of steps already
written are left out, and its alert goes with the step being written."""

from __future__ import annotations

import tempfile
import warnings

import torch
from conftest import small_cnn

import actviz


class Steps:
    """A sink that keeps the step numbers and the alert texts it gets."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.alerts: list[str] = []

    def write(self, results) -> None:
        self.steps.append(results.step)
        if "alerts" in results.texts:
            self.alerts.append(results.texts["alerts"])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def run(every: int) -> Steps:
    torch.manual_seed(0)
    model, sink = small_cnn(), Steps()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tempfile.mkdtemp(), every=every, image_every=False, sink=sink,
            extras=[actviz.Spikes()]) as viz:
            for step in range(60):
                loss = model(torch.randn(4, 3, 8, 8)).square().mean() * (1000.0 if step == 40 else 1.0)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            viz.flush()
    return sink


def test_a_sink_gets_each_step_once_and_in_order_when_a_spike_falls_on_a_logged_step():
    sink = run(every=10)  # step 40 logs, and spikes: its ring buffer holds steps 33 to 40, some of them written
    assert sink.steps == sorted(set(sink.steps)), sink.steps
    assert 40 in sink.steps and 41 in sink.steps  # the step, and the steps after it logged in full
    assert any("gradient spike at step 40" in text for text in sink.alerts), sink.alerts


def test_a_spike_between_logged_steps_writes_its_ring_steps_in_order():
    sink = run(every=1000)
    assert sink.steps == sorted(set(sink.steps)), sink.steps
    assert set(range(33, 41)) <= set(sink.steps)  # the ring buffer's steps, before the steps logged after the spike
    assert any("gradient spike at step 40" in text for text in sink.alerts), sink.alerts
