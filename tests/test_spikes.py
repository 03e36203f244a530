"""The spike recorder: a loss x1000 at step s is named at s, the layers ranked, and s+1..s+3 logged in full."""

from __future__ import annotations

import math
import statistics
import warnings

import pytest
import torch
from conftest import CountOps, small_cnn

import actviz
from actviz.diagnosis.spikes import FOLLOW, RING

SPIKE = 40
LAYERS = {"0": 0, "2": 2, "3": 3, "6": 6}  # small_cnn's watched layers: conv, conv, batch norm, linear


def train(log_dir, steps: int, spike_at: int | None = None, nan_at: int | None = None, **watch_kwargs):
    """Train small_cnn; return the watcher and each step's per-layer gradient norms, by hand in float64."""
    torch.manual_seed(0)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    norms: dict[int, dict[str, float]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, log_dir, every=1000, **watch_kwargs, extras=[actviz.Spikes()]) as viz:
            for step in range(steps):
                loss = model(torch.randn(4, 3, 8, 8)).square().mean()
                loss = loss * (1000.0 if step == spike_at else 1.0) * (math.nan if step == nan_at else 1.0)
                optimizer.zero_grad()
                loss.backward()
                norms[step] = {name: math.sqrt(sum(float(p.grad.double().square().sum()) for p in model[i].parameters()))
                               for name, i in LAYERS.items()}
                optimizer.step()
            viz.flush()
    return viz, norms


def test_a_loss_x1000_gives_a_spike_alert_at_that_step_and_full_logs_after(tmp_path, read_run):
    viz, norms = train(tmp_path, 50, spike_at=SPIKE)
    (alert,) = viz.alerts
    assert (alert.rule, alert.step) == ("gradient_spike", SPIKE)
    assert alert.value == pytest.approx(math.sqrt(sum(n * n for n in norms[SPIKE].values())), rel=1e-5)
    run = read_run(tmp_path)
    logged = list(range(SPIKE + 1, SPIKE + 1 + FOLLOW))
    assert run.histogram_steps("activations/0") == [0, *logged]  # every=1000: step 0, then the steps after the spike
    assert run.histogram_steps("weight_grads/6.weight") == [0, *logged]
    assert run.image_steps("feature_maps/0") == [0, *logged]  # pictures included
    # the ring buffer: per-layer gradient norms of the last 16 steps, as computed by hand
    for step in range(SPIKE - RING + 1, SPIKE + 1):
        for layer in LAYERS:
            assert run.scalar(f"spikes/gradient_norm/{layer}", step) == pytest.approx(
                norms[step][layer], rel=1e-5)
    assert [e.step for e in run.scalar_events("spikes/gradient_norm/0")] == list(range(SPIKE - RING + 1, SPIKE + 1))
    # the layers, ranked by their own z-scores over the ring's earlier steps
    z = {}
    for layer in LAYERS:
        before = [norms[step][layer] for step in range(SPIKE - RING + 1, SPIKE)]
        z[layer] = (norms[SPIKE][layer] - statistics.fmean(before)) / statistics.pstdev(before)
    ranked = sorted(z, key=lambda layer: -z[layer])
    assert alert.layer == ranked[0]
    named = alert.message.split("layers by z-score")[1]
    assert [named.index(f" {layer} (z=") for layer in ranked] == sorted(named.index(f" {layer} (z=") for layer in ranked)
    (text,) = run.events.Tensors("alerts")
    assert text.step == SPIKE and "gradient_spike" in text.tensor_proto.string_val[0].decode()


def test_a_healthy_run_has_no_spike(tmp_path, read_run):
    viz, _ = train(tmp_path, 60)
    assert viz.alerts == []
    assert not any(tag.startswith("spikes/") for tag in read_run(tmp_path).scalar_tags)


def test_a_nan_loss_is_a_spike_named_once(tmp_path):
    viz, _ = train(tmp_path, 30, nan_at=20, alerts=False)
    assert [(alert.rule, alert.step) for alert in viz.alerts] == [("gradient_spike", 20)]
    assert "not finite" in viz.alerts[0].message


def test_the_norms_subscribe_once_and_take_their_hooks_off_at_close_and_are_on_by_default(tmp_path):
    from actviz.diagnosis.step_norms import StepNorms
    from actviz.common import optimizer_steps

    def readers() -> int:  # other parts of a watcher (actviz.diagnosis.silences) listen to optimizer steps too
        return sum(isinstance(getattr(listener, "__self__", None), StepNorms)
                   for listener in optimizer_steps._listeners.values())

    def hooks(model) -> int:
        return sum(len(param._post_accumulate_grad_hooks or {}) for param in model.parameters())

    before = readers()
    for kwargs in ({}, {"extras": [actviz.Spikes()]}, {"alerts": False}):  # on by default, with and without alerts
        model = small_cnn()
        with actviz.watch(model, tmp_path / str(len(kwargs)), every=1000, **kwargs):
            assert readers() == before + 1
            assert hooks(model) == len(list(model.parameters()))  # one per trainable parameter
        assert readers() == before and hooks(model) == 0
    model = small_cnn()
    with actviz.watch(model, tmp_path / "off", every=1000, alerts=False, statistics=["moments"]):
        assert readers() == before and hooks(model) == 0  # nothing asks for them: nothing on the model


def test_a_step_that_does_not_log_pays_six_ops_and_no_sync(tmp_path, monkeypatch):
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")  # the accelerator path: the copy to the host included
    counts = {}
    for norms in (False, True):
        torch.manual_seed(0)
        model = small_cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        off = {} if norms else {"alerts": False, "statistics": ["moments"]}
        with actviz.watch(model, tmp_path / str(norms), every=1000, **off):
            for _step in range(4):  # step 0 logs; steps 1-3 do not
                with CountOps() as count:
                    loss = model(torch.randn(4, 3, 8, 8)).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
        counts[norms] = count
    extra = list(counts[True].kernels)
    for op in counts[False].kernels:
        extra.remove(op)
    # before clipping, at the backward's end: 2; after it, at the optimizer step: 2, both norms 1, their copy 1
    assert sorted(extra) == sorted(["aten._foreach_norm.Scalar", "aten.stack.out"] * 2 + [
        "aten.linalg_vector_norm.default", "aten.copy_.default"]), extra
    assert counts[True].syncs == counts[False].syncs == []


class DenseAndIdleExpert(torch.nn.Module):
    """A dense layer, and an expert whose output is multiplied by 0 (no token routed to it) until it is switched on."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(4, 1)
        self.expert = torch.nn.Linear(4, 1)
        self.expert_on = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x) + self.expert_on * self.expert(x)


def test_a_layer_with_no_gradient_before_is_ranked_after_the_layers_that_grew(tmp_path):
    # Step 30: the loss ×1000 and the idle expert gets its first gradient. Its history is exactly 0 (σ = 0): growth
    # from nothing has no z-score, and must not put it ahead of the dense layer that carries the spike.
    torch.manual_seed(0)
    model = DenseAndIdleExpert()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with actviz.watch(model, tmp_path, every=1000, extras=[actviz.Spikes()]) as viz:
        for step in range(34):
            model.expert_on = 1.0 if step == 30 else 0.0
            optimizer.zero_grad()
            (model(torch.randn(8, 4)).square().mean() * (1000.0 if step == 30 else 1.0)).backward()
            optimizer.step()
        viz.flush()
    (alert,) = [alert for alert in viz.alerts if alert.rule == "gradient_spike"]
    assert alert.step == 30 and alert.layer == "dense", alert.message
    assert "expert (no z-score: no gradient before)" in alert.message
    assert alert.message.index("dense (z=") < alert.message.index("expert (")
