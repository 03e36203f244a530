"""The update statistics (update_rms, update_lost, adam_epsilon) against float64 hand computations from the optimizer's
state, read back from the event file; and frozen_parameter's two causes."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import CountOps
from torch import nn

import actviz

UPDATES = ["default", "update_rms", "update_lost", "adam_epsilon"]


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.usefixtures("both_paths")
def test_adam_epsilon_fraction_and_update_rms_equal_a_float64_hand_computation(read_run):
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)  # a large ε: some elements below it
    log_dir = tempfile.mkdtemp()
    expected: dict[tuple[int, str], tuple[float, float]] = {}
    with actviz.watch(model, log_dir, every=2, image_every=False, statistics=UPDATES) as viz:
        for step in range(5):
            before = {name: param.detach().double().clone() for name, param in model.named_parameters()}
            optimizer.zero_grad()
            F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
            optimizer.step()
            if step % 2 == 0:
                for name, param in model.named_parameters():
                    state, group = optimizer.state[param], optimizer.param_groups[0]
                    beta1, beta2 = group["betas"]
                    t = float(state["step"])
                    m_hat = state["exp_avg"].double() / (1 - beta1 ** t)
                    v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** t)
                    update = group["lr"] * m_hat / (v_hat.sqrt() + group["eps"])
                    assert torch.allclose(param.detach().double() - before[name], -update, rtol=1e-3, atol=1e-7)
                    epsilon = float((group["eps"] > v_hat.sqrt()).double().mean())
                    expected[(step, name)] = (float(update.square().mean().sqrt()), epsilon)
        viz.flush()
    run = read_run(log_dir)
    fractions = set()
    for (step, name), (rms, epsilon) in expected.items():
        assert run.scalar(f"update_stats/rms@{name}", step) == pytest.approx(rms, rel=1e-4)
        assert run.scalar(f"update_stats/epsilon_fraction@{name}", step) == pytest.approx(epsilon, abs=1e-6)
        assert run.scalar(f"update_stats/lost_fraction@{name}", step) == 0.0  # float32 at lr 1e-2: nothing lost
        fractions.add(epsilon)
    assert len([fraction for fraction in fractions if 0 < fraction < 1]) > 2  # not all 0 or 1


def bf16_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)


def test_a_bfloat16_model_that_loses_its_updates_is_named_by_frozen_parameter_and_the_lost_fraction():
    model = bf16_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs, labels = torch.randn(64, 8).to(torch.bfloat16), torch.randint(0, 4, (64,))
    lost_by_hand = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False,
                          statistics=["default", "update_lost"]) as viz:
            for step in range(4):
                optimizer.zero_grad()
                F.cross_entropy(model(inputs).float(), labels).backward()
                weight, grad = model[3].weight.detach().clone(), model[3].weight.grad.clone()
                optimizer.step()
                unchanged = (model[3].weight.detach() == weight) & (grad != 0)
                lost_by_hand[step] = float(unchanged.sum()) / float((grad != 0).sum())
                viz.flush()
                assert viz.latest.layer_values["update_lost"]["3.weight"]["lost_fraction"] == pytest.approx(
                    lost_by_hand[step], abs=1e-6)
    assert min(lost_by_hand.values()) > 0.5  # bfloat16 at lr 1e-3: most updates of the last layer are lost
    frozen = [alert for alert in viz.alerts if alert.rule == "frozen_parameter"]
    assert "1.weight" in [alert.layer for alert in frozen]  # the batch norm's weights of 1.0: every update lost
    message = next(alert.message for alert in frozen if alert.layer == "1.weight")
    assert "in the optimizer at learning rate 0.001" in message and "bfloat16" in message, message
    assert "float32 master weights" in message and "larger learning rate" in message and "smaller weight" in message
    assert "not in the optimizer" not in message
    assert any("frozen parameter" in str(w.message) for w in caught)


def test_a_parameter_left_out_of_the_optimizer_is_named_as_such():
    model = mlp()
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)  # model[0] forgotten
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False) as viz:
            for _ in range(4):
                optimizer.zero_grad()
                F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
                optimizer.step()
            viz.flush()
    frozen = {alert.layer: alert.message for alert in viz.alerts if alert.rule == "frozen_parameter"}
    assert set(frozen) == {"0.weight", "0.bias"}
    assert all("not in the optimizer, or its learning rate is 0" in message for message in frozen.values())


def test_the_update_statistics_are_off_by_default_and_cost_no_sync(monkeypatch):
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()  # its state made: the steps below dispatch the same ops of their own
    syncs = {}
    for statistics in (None, UPDATES):
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, statistics=statistics) as viz:
            with CountOps() as count:
                optimizer.zero_grad()
                model(torch.randn(4, 6)).sum().backward()
                optimizer.step()  # Adam's own step reads its step count on the host: the same syncs either way
                viz.flush()
        syncs[statistics is None] = sorted(count.syncs)
        written = [tag for tag in viz.latest.scalars if tag.startswith("update_stats/")]
        assert (written == []) if statistics is None else len(written) == 3 * 4
    assert syncs[True] == syncs[False]
