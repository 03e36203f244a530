"""Health alerts: each rule against a pathology injected into a small model, and silence on healthy runs."""

from __future__ import annotations

import math
import random
import statistics
import warnings

import pytest
import torch
from torch import nn

import actviz
from actviz.diagnosis.alerts import HealthMonitor, check_alerts
from actviz.diagnosis.trends import health_monitor
from actviz.common.results import StepResults, Summary


class Scale(nn.Module):
    """Multiplies its input: a pathology in one line."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def mlp(scale: float = 1.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), Scale(scale), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


NO_WARMUP = {"warmup_steps": 0}  # judge the trend rules from step 0: a few steps test them


def train(model: nn.Module, log_dir, steps: int = 8, lr: float = 0.01, optimizer: str = "sgd", inputs=None,
          every: int = 1, **watch_kwargs):
    """Train ``model`` on a fixed regression task; return the watcher's alerts and the warnings given."""
    torch.manual_seed(1)
    data = torch.randn(64, 8) if inputs is None else inputs
    target = torch.randn(64, 4)
    make = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    opt = make(model.parameters(), lr=lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, log_dir, every=every, image_every=False, **watch_kwargs) as viz:
            for _step in range(steps):
                batch = torch.randint(0, len(data), (16,))
                loss = (model(data[batch]) - target[batch]).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            viz.flush()
            alerts = viz.alerts
    return alerts, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def rules(alerts) -> set[tuple[str, str]]:
    return {(alert.rule, alert.layer) for alert in alerts}


def test_a_layer_scaled_by_1e_6_gives_the_vanishing_alert_for_that_layer_alone(tmp_path, read_run):
    seen = []
    alerts, messages = train(mlp(1e-6), tmp_path, steps=121, every=10, on_alert=seen.append)  # the defaults
    assert rules(alerts) == {("vanishing_gradients", "0")}
    (alert,) = alerts
    assert alert.step == 20  # below 1e-4 x the median since step 0: the third logging step, in the warm-up
    assert seen == alerts
    assert sum("vanishing gradients" in message for message in messages) == 1  # warned once per rule and layer
    # the value is the gradient's RMS, by hand from the logged norm; the threshold is 1e-4 x the median RMS
    run = read_run(tmp_path)
    numel = 16 * 32
    rms = {layer: run.scalar(f"gradient_stats/norm@{layer}", alert.step) / math.sqrt(numel if layer != "5" else 64)
           for layer in ("0", "3", "5")}
    assert alert.value == pytest.approx(rms["0"], rel=1e-5)
    assert alert.threshold == pytest.approx(1e-4 * sorted(rms.values())[1], rel=1e-5)
    (text,) = run.events.Tensors("alerts")
    assert text.step == alert.step and "vanishing_gradients" in text.tensor_proto.string_val[0].decode()


def test_the_same_model_unscaled_raises_nothing(tmp_path):
    alerts, messages = train(mlp(1.0), tmp_path, steps=121, every=10)
    assert alerts == [] and messages == []


def _vanishing_steps(thresholds, ratio: float, zero: bool = False, steps: int = 8) -> list[int]:
    """Steps of the vanishing alerts on layer "a", whose gradient RMS is ``ratio`` x its two neighbours'."""
    monitor = health_monitor(thresholds)
    ones = Summary(4, 0, 0, 1.0, 1.0, 4.0, 4.0, [4.0])
    small = Summary(4, 0, 4 if zero else 0, ratio, ratio, 4 * ratio, 4 * ratio * ratio, [4.0])
    found = []
    for step in range(steps):
        results = StepResults(step, gradients={"a": small, "b": ones, "c": ones})
        found += [alert.step for alert in monitor.check(results) if alert.rule == "vanishing_gradients"]
    return found


@pytest.mark.filterwarnings("ignore:actviz. vanishing:RuntimeWarning")
def test_the_warmup_covers_a_transient_but_not_a_gradient_far_below_or_exactly_zero():
    assert _vanishing_steps(check_alerts(True), 5e-4) == []  # a fresh BERT's query projection: the warm-up
    assert _vanishing_steps(check_alerts(NO_WARMUP), 5e-4) == [2]  # 0, 1, 2 in a row
    assert _vanishing_steps(check_alerts(True), 1e-5) == [2]  # below 1e-4 x the median: from step 0
    assert _vanishing_steps(check_alerts(True), 0.0, zero=True) == [2]  # exactly zero: from step 0


def test_a_relu_fed_a_bias_of_minus_10_has_dead_units(tmp_path):
    model = mlp()
    with torch.no_grad():
        model[0].bias.fill_(-10.0)
        model[0].weight.mul_(0.1)
    alerts, _ = train(model, tmp_path, layers="all")
    assert ("dead_units", "2") in rules(alerts)
    dead = next(alert for alert in alerts if alert.rule == "dead_units")
    assert dead.statistic == "zero_fraction" and dead.value == 1.0 and dead.step == 0


def test_a_conv_relu_with_nine_of_ten_channels_dead_gives_the_channel_rule(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 10, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(10 * 6 * 6, 4))
    with torch.no_grad():
        model[0].bias[:9] = -10.0  # channel 9 lives: about half its outputs are non-zero
        model[0].weight.mul_(0.1)
    alerts, _ = train(model, tmp_path, layers="all", inputs=torch.randn(64, 3, 6, 6))
    (dead,) = [alert for alert in alerts if alert.rule == "dead_units"]
    assert (dead.layer, dead.statistic, dead.value) == ("1", "dead_channel_fraction", pytest.approx(0.9))
    assert dead.value < 1.0


def test_a_tanh_fed_x50_is_saturated_and_x1_is_not(tmp_path):
    def model(scale: float) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), Scale(scale), nn.Tanh(), nn.Linear(32, 4))

    alerts, _ = train(model(50.0), tmp_path / "sick", layers="all")
    (saturated,) = [alert for alert in alerts if alert.rule == "saturation"]
    assert saturated.layer == "2" and saturated.step == 0
    # by hand: the fraction of the Tanh's outputs within 0.03 of +-1 at step 0
    torch.manual_seed(1)
    data = torch.randn(64, 8)
    torch.manual_seed(1)
    torch.randn(64, 8), torch.randn(64, 4)
    batch = torch.randint(0, 64, (16,))
    expected = (model(50.0)[:3](data[batch]).abs() > 0.97).double().mean().item()
    assert saturated.value == pytest.approx(expected, abs=1e-6)
    healthy, _ = train(model(1.0), tmp_path / "healthy", layers="all")
    assert [alert for alert in healthy if alert.rule == "saturation"] == []


def test_a_sigmoid_fed_x50_is_saturated(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), Scale(50.0), nn.Sigmoid(), nn.Linear(32, 4))
    alerts, _ = train(model, tmp_path, layers="all")
    assert ("saturation", "2") in rules(alerts)


def test_learning_rate_x1000_gives_the_update_ratio_alert(tmp_path):
    alerts, _ = train(mlp(), tmp_path / "sick", lr=1.0, optimizer="adam", statistics=["default", "update_ratio"],
                     alerts=NO_WARMUP)
    found = [alert for alert in alerts if alert.rule == "update_ratio"]
    assert {alert.layer for alert in found} == {"0.weight", "3.weight", "5.weight"}  # weights, not biases
    assert all(alert.value > 1e-2 and alert.threshold == 1e-2 for alert in found)
    healthy, _ = train(mlp(), tmp_path / "healthy", lr=1e-3, optimizer="adam", statistics=["default", "update_ratio"],
                     alerts=NO_WARMUP)
    assert healthy == []


def test_the_first_nan_is_an_alert_named_once(tmp_path):
    model = mlp()
    data = torch.randn(64, 8)
    data[3, 0] = math.nan
    alerts, messages = train(model, tmp_path, steps=4, inputs=data)
    nonfinite = [alert for alert in alerts if alert.rule == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0].layer == "0"
    assert sum("NaN or Inf first" in message for message in messages) == 1


def test_a_loss_x1000_gives_exploding_gradients_at_that_step(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tmp_path, every=1, image_every=False, alerts=NO_WARMUP) as viz:
            for step in range(20):
                loss = model(torch.randn(16, 8)).square().mean() * (1000.0 if step == 15 else 1.0)
                opt.zero_grad()
                loss.backward()
                opt.step()
            viz.flush()
    assert rules(viz.alerts) == {("exploding_gradients", layer) for layer in ("0", "3", "5")}
    assert {alert.step for alert in viz.alerts} == {15}


def _gradient_norms(monitor: HealthMonitor, norms: list[float]) -> list[tuple[int, float]]:
    """Feed one layer's gradient norms, one logging step each; return (step, norm) of each exploding alert."""
    found = []
    for step, norm in enumerate(norms):
        gradient = Summary(1, 0, 0, norm, norm, norm, norm * norm, [1.0])  # one element: its norm is ``norm``
        results = StepResults(step * 10 + 100, gradients={"embedding": gradient})
        found += [(alert.step, alert.value) for alert in monitor.check(results) if alert.rule == "exploding_gradients"]
    return found


@pytest.mark.filterwarnings("ignore:actviz. exploding:RuntimeWarning")
def test_exploding_gradients_ignore_multiplicative_noise_and_a_large_first_value_but_not_a_jump():
    # An embedding's gradient norm at batch 8: a large first step, then a wander of 2x (0.3 decades) either way,
    # and one batch at 12x the median (rare tokens).
    rng = random.Random(0)
    noisy = [40.0] + [0.2 * 10 ** rng.gauss(0, 0.3) for _ in range(30)]
    noisy[25] = 12 * statistics.median(noisy[1:25])
    # The rule of raw norms (above the mean + 6 sigma or 10 x the median of the last 8 to 32) fired on it:
    raw = [i for i in range(8, len(noisy)) if noisy[i] > min(
        statistics.fmean(noisy[max(0, i - 32):i]) + 6 * statistics.pstdev(noisy[max(0, i - 32):i]),
        10 * statistics.median(noisy[max(0, i - 32):i]))]
    assert raw == [25]
    assert _gradient_norms(health_monitor(check_alerts(True)), noisy) == []
    # A steady layer that jumps 30x at its 20th logging step: one alert, at that step.
    steady = [1.0 + 0.05 * math.sin(i) for i in range(20)] + [30.0, 31.0]
    assert _gradient_norms(health_monitor(check_alerts(True)), steady) == [(300, 30.0)]
    # 9x the largest of a steady layer is not an explosion (the limit is one decade over it) ...
    assert _gradient_norms(health_monitor(check_alerts(True)), steady[:20] + [9.0]) == []
    # ... and a wandering layer needs a larger jump than a steady one: a decade over its largest value.
    median = statistics.median(noisy[:20])
    assert _gradient_norms(health_monitor(check_alerts(True)), noisy[:20] + [median * 30]) == []
    assert _gradient_norms(health_monitor(check_alerts(True)), noisy[:20] + [median * 3000]) == [(300, median * 3000)]


def test_alerts_false_turns_them_off_and_a_dict_overrides_thresholds(tmp_path):
    alerts, messages = train(mlp(1e-6), tmp_path / "off", alerts=False)
    assert alerts == [] and messages == []
    alerts, _ = train(mlp(1e-6), tmp_path / "strict", alerts={"vanishing_steps": 1, "warmup_steps": 0})
    assert [(alert.rule, alert.step) for alert in alerts] == [("vanishing_gradients", 0)]


@pytest.mark.parametrize("value, error, message", [
    ("yes", TypeError, "alerts must be True, False or a dict"),
    ({"vanish_ratio": 1e-4}, ValueError, "did you mean 'vanishing_ratio'"),
    ({"vanishing_ratio": -1}, ValueError, r"must be a fraction of the median in \(0, 1\], got -1; for example alerts="),
    ({"warmup_steps": -1}, ValueError, "must be a whole number of training steps, 0 or more, got -1"),
    ({"saturation_fraction": float("nan")}, ValueError, r"must be a fraction in \(0, 1\], got nan"),
    ({"exploding_factor": 0.5}, ValueError, "must be a factor over the history, 1 or more"),
    ({"vanishing_ratio": "1e-4"}, TypeError, "must be a number"),
])
def test_bad_alerts_are_named(value, error, message, tmp_path):
    with pytest.raises(error, match=message):
        actviz.watch(mlp(), tmp_path, alerts=value)
    with pytest.raises(error, match=message):
        check_alerts(value)


def test_bad_on_alert_and_spikes_are_named(tmp_path):
    with pytest.raises(TypeError, match="on_alert must be a function"):
        actviz.watch(mlp(), tmp_path, on_alert=3)
    with pytest.raises(TypeError, match=r"^extras takes objects, got the class Spikes; for example extras=\[actviz.Spikes\(\)\]$"):
        actviz.watch(mlp(), tmp_path, extras=[actviz.Spikes])


def test_a_failing_on_alert_warns_and_training_goes_on(tmp_path):
    def broken(alert):
        raise ValueError("boom")

    alerts, messages = train(mlp(1e-6), tmp_path, on_alert=broken, alerts=NO_WARMUP)
    assert len(alerts) == 1 and any("on_alert callback raised ValueError: boom" in m for m in messages)


# -- healthy runs raise nothing ------------------------------------------------------------------

def _demo():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "demo_train.py"
    spec = importlib.util.spec_from_file_location("demo_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_quietly(model, log_dir, batches, loss_fn, steps: int = 300, lr: float = 5e-4, optimizer=None,
                   **watch_kwargs):
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, log_dir, every=10, image_every=100, **{"statistics": ["default", "update_ratio"], **watch_kwargs}) as viz:
            for step in range(steps):
                inputs, target = batches(step)
                loss = loss_fn(model(inputs), target)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            viz.flush()
            alerts = viz.alerts
    return alerts, [str(w.message) for w in caught if "actviz" in str(w.message)], loss.item()


def test_300_steps_of_the_demo_cnn_raise_no_alert(tmp_path):
    demo = _demo()
    torch.manual_seed(0)
    images, labels = demo.make_dataset(512, 32, seed=0)
    model = demo.small_cnn()

    def batches(step):
        batch = torch.randint(0, len(images), (32,))
        return images[batch], labels[batch]

    alerts, messages, loss = _train_quietly(model, tmp_path, batches, nn.CrossEntropyLoss(), layers="all")
    assert alerts == [] and messages == []
    assert loss < 1.5  # it learned: chance is ln 6 = 1.79


def test_300_steps_of_resnet18_at_a_small_size_raise_no_alert(tmp_path):
    import torchvision

    demo = _demo()
    torch.manual_seed(0)
    images, labels = demo.make_dataset(256, 16, seed=0)
    model = torchvision.models.resnet18(num_classes=6)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)  # ResNet's recipe, fast on a CPU

    def batches(step):
        batch = torch.randint(0, len(images), (8,))
        return images[batch], labels[batch]

    layers = ["conv", "relu", nn.Linear]
    # update_ratio stays off, its default: SGD's first steps move fc.weight by 8 % (see docs/diagnosis.md)
    alerts, messages, _ = _train_quietly(model, tmp_path, batches, nn.CrossEntropyLoss(), optimizer=sgd, layers=layers,
                                         statistics=None)
    assert alerts == [] and messages == []


def test_300_steps_of_a_tiny_gpt2_raise_no_alert(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    model.train()

    def batches(step):  # counting sequences: learnable
        start = torch.randint(0, 48, (8, 1))
        tokens = start + torch.arange(16)
        return tokens, tokens

    def loss_fn(output, tokens):
        logits = output.logits[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    # update_ratio stays off, its default: Adam's first steps move GPT-2's 0.02-std weights by 5 % (docs/diagnosis.md)
    alerts, messages, loss = _train_quietly(model, tmp_path, batches, loss_fn, lr=1e-3, statistics=None)
    assert alerts == [] and messages == []
    assert loss < 2.0  # it learned: chance is ln 64 = 4.16
