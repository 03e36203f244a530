"""What a long run writes and keeps is bounded: flow pictures per image step, spike alerts, the alerts kept."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch
from conftest import small_cnn
from torch import nn

import actviz
from actviz.diagnosis.alerts import KEPT_ALERTS, Alert, HealthMonitor, check_alerts
from actviz.common.results import StepResults, Summary
from actviz.diagnosis.flow import REDRAW_STEPS, WINDOW, FlowHistory, flow_layout
from actviz.diagnosis.spikes import FLOOR, QUIET, RING

# -- flow pictures: a window of the latest WINDOW logging steps -------------------------------------------------

FLOW_STEPS, FLOW_IMAGE_EVERY = 320, 32


def test_flow_pictures_cost_the_same_bytes_at_every_image_step_once_the_window_is_full(tmp_path, read_run):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1, image_every=FLOW_IMAGE_EVERY, layers="all",
                          options=actviz.Options(flow_pictures=True)):
            for _ in range(FLOW_STEPS):
                loss = model(torch.randn(16, 8)).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    run = read_run(tmp_path)
    tags = sorted(tag for tag in run.image_tags if tag.startswith("flow/"))
    assert "flow/gradient_norm" in tags
    image_steps = run.image_steps("flow/gradient_norm")
    assert image_steps == list(range(0, FLOW_STEPS, FLOW_IMAGE_EVERY))
    full = [step for step in image_steps if step + 1 >= WINDOW]  # the window is full from logging step WINDOW - 1
    assert full[0] == 64 and full[-1] == 288

    def flow_bytes(step: int) -> int:
        return sum(len(event.encoded_image_string) for tag in tags
                   for event in run.events.Images(run.tensorboard_tag(tag)) if event.step == step)

    sizes = {step: flow_bytes(step) for step in full}
    # 289 logging steps cost what 65 did: the bytes follow the window, not the run's length
    assert max(sizes.values()) <= 1.25 * sizes[full[0]], sizes
    rows = ["0", "1", "2", "3", "4"]
    layout = flow_layout(rows, WINDOW)
    for step in full:
        assert run.image("flow/gradient_norm", step).shape[:2] == (layout.height, layout.width)


def test_flow_pictures_are_drawn_at_every_image_step_while_the_window_fills_then_once_every_redraw_steps():
    flow = FlowHistory(image_steps=lambda step: True)  # every logging step is an image step (image_every=every)
    summary = Summary(4, 0, 0, -1.0, 1.0, 0.0, 4.0, [4.0])
    drawn = []
    for step in range(WINDOW + 3 * REDRAW_STEPS):
        results = StepResults(step, activations={"fc": summary, "out": summary.divided_by(0.5)},
                              gradients={"fc": summary, "out": summary})
        flow.add(results)
        if results.pictures:
            drawn.append(step)
    # steps 0 to 62 have fewer than WINDOW columns; from then on 16 logging steps pass between two pictures
    assert drawn == [*range(WINDOW - 1), *range(WINDOW - 2 + REDRAW_STEPS, WINDOW + 3 * REDRAW_STEPS, REDRAW_STEPS)]


# -- the spike recorder adapts to a lasting change and ignores a small batch's wander ------------------------


def train_scaled(log_dir, factors: list[float], **watch_kwargs):
    """A linear layer on one fixed batch with a learning rate of 0: step s's global gradient norm is exactly
    ``factors[s]`` times that of step 0, because its loss is scaled by it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    inputs = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, log_dir, every=10**6, alerts=False, **watch_kwargs, extras=[actviz.Spikes()]) as viz:
            for factor in factors:
                loss = model(inputs).square().mean() * factor
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            viz.flush()
    return viz


def smooth(steps: int, seed: int = 0) -> list[float]:
    """A healthy run's global norm, up to a factor: within 1 % of 1."""
    generator = random.Random(seed)
    return [1.0 + generator.uniform(-0.01, 0.01) for _ in range(steps)]


def spike_steps(viz) -> list[int]:
    return [alert.step for alert in viz.alerts if alert.rule == "gradient_spike"]


def test_a_lasting_5x_change_of_scale_is_one_alert_then_a_new_baseline(tmp_path, read_run):
    factors = [value * (5.0 if step >= 100 else 1.0) for step, value in enumerate(smooth(400))]
    viz = train_scaled(tmp_path, factors)
    assert spike_steps(viz) == [100]
    # one spike record: the ring buffer's steps before it, once
    steps = [event.step for event in read_run(tmp_path).scalar_events("spikes/global_gradient_norm")]
    assert steps == list(range(100 - RING + 1, 101))


def test_after_a_lasting_change_a_real_spike_is_still_caught(tmp_path):
    factors = [value * (5.0 if step >= 100 else 1.0) * (100.0 if step == 200 else 1.0)
               for step, value in enumerate(smooth(260))]
    assert spike_steps(train_scaled(tmp_path, factors)) == [100, 200]


def test_a_100x_spike_is_caught_and_a_2x_one_is_not(tmp_path):
    factors = smooth(200)
    for step in (50, 90, 130):  # a hard small batch: twice the norm
        factors[step] *= 2.0
    factors[170] *= 100.0
    viz = train_scaled(tmp_path, factors)
    assert spike_steps(viz) == [170]
    (alert,) = viz.alerts
    assert alert.value / alert.threshold == pytest.approx(100.0 / FLOOR, rel=0.05)


def test_multiplicative_noise_of_2x_is_no_spike(tmp_path):
    generator = random.Random(1)
    factors = [math.exp(generator.uniform(-math.log(2.0), math.log(2.0))) for _ in range(400)]
    assert max(factors) / min(factors) > 3.9  # the whole 2x either way
    assert spike_steps(train_scaled(tmp_path, factors)) == []


def test_spikes_no_more_than_quiet_steps_apart_are_one_alert(tmp_path):
    factors = smooth(300)
    for step in range(100, 300, QUIET // 2):  # a spiky phase: 10x every 8 steps
        factors[step] *= 10.0
    assert spike_steps(train_scaled(tmp_path, factors)) == [100]


def test_a_healthy_batch_1_run_has_no_spike(tmp_path):
    """Batch 1 of a classifier: the norm wanders by 1000x between right and wrong samples (a robust deviation
    of about 2 in log); the mean + 6 standard deviations of raw norms called 4 of 600 steps spikes."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    model = small_cnn(inplace=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=10**6, alerts=False, extras=[actviz.Spikes()]) as viz:
            for _ in range(600):
                inputs = torch.randn(1, 3, 8, 8)
                with torch.no_grad():
                    labels = teacher(inputs).argmax(1)
                loss = nn.functional.cross_entropy(model(inputs), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            viz.flush()
    assert spike_steps(viz) == []


# -- the alerts kept in memory -------------------------------------------------------------------------------


def test_the_alerts_kept_are_the_latest_kept_alerts():
    monitor = HealthMonitor(check_alerts(True) or {})
    alerts = [Alert(step, "gradient_spike", None, "global_gradient_norm", 1.0, 0.5, "x")
              for step in range(KEPT_ALERTS + 5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor.report(None, alerts)
    assert len(monitor.alerts) == KEPT_ALERTS
    assert [alert.step for alert in monitor.alerts] == list(range(5, KEPT_ALERTS + 5))

