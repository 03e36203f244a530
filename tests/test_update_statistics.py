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


def test_a_parameter_over_the_sample_size_is_measured_on_its_strided_sample_near_its_full_value(read_run):
    from actviz.statistics.update_sample import UPDATE_SAMPLE_SIZE, sample_stride

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 100), nn.ReLU(), nn.Linear(100, 3))  # 20,000 weights: sampled
    with torch.no_grad():
        model[0].weight[:40] += 3e3  # 8,000 weights whose updates float32 cannot hold at lr 1e-4
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-6)
    stride = sample_stride(model[0].weight.shape)
    assert stride == 3 and 20_000 > UPDATE_SAMPLE_SIZE >= len(range(0, 20_000, stride))
    log_dir = tempfile.mkdtemp()
    with actviz.watch(model, log_dir, every=1, image_every=False, statistics=UPDATES) as viz:
        for _ in range(2):
            before = model[0].weight.detach().double().clone()
            optimizer.zero_grad()
            F.cross_entropy(model(torch.randn(32, 200)), torch.randint(0, 3, (32,))).backward()
            had_gradient = model[0].weight.grad.reshape(-1).ne(0)
            optimizer.step()
            viz.flush()
    update = (model[0].weight.detach().double() - before).reshape(-1)
    state, group = optimizer.state[model[0].weight], optimizer.param_groups[0]
    v_hat = state["exp_avg_sq"].double().reshape(-1) / (1 - group["betas"][1] ** float(state["step"]))
    below = (group["eps"] > v_hat.sqrt()).double()
    lost = (update == 0) & had_gradient
    sampled = slice(None, None, stride)
    run = read_run(log_dir)
    rms = run.scalar("update_stats/rms@0.weight", 1)
    lost_fraction = run.scalar("update_stats/lost_fraction@0.weight", 1)
    epsilon_fraction = run.scalar("update_stats/epsilon_fraction@0.weight", 1)
    # the very elements of the sample, by hand in float64
    assert rms == pytest.approx(float(update[sampled].square().mean().sqrt()), rel=1e-5)
    assert lost_fraction == pytest.approx(float(lost[sampled].sum() / had_gradient[sampled].sum()), abs=1e-6)
    assert epsilon_fraction == pytest.approx(float(below[sampled].mean()), abs=1e-6)
    # and an estimate of the whole tensor's values
    assert rms == pytest.approx(float(update.square().mean().sqrt()), rel=0.05)
    assert lost_fraction == pytest.approx(float(lost.sum() / had_gradient.sum()), abs=0.02)
    assert 0.3 < lost_fraction < 0.5  # the 8,000 large weights of 20,000 (all with a gradient): not trivially 0 or 1
    assert epsilon_fraction == pytest.approx(float(below.mean()), abs=0.02)
    assert sample_stride(model[2].weight.shape) == 1  # 300 weights: read whole, exact (the tests above)


def _logging_ops(model: nn.Module, statistics: list[str] | None) -> int:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()  # its state made
    with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False, statistics=statistics) as viz:
        with CountOps() as count:
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            viz.flush()
    return len(count.kernels)


def test_the_update_statistics_add_a_few_ops_for_all_the_parameters_not_a_few_per_parameter(monkeypatch):
    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    added = {}
    for depth in (2, 8):  # 4 and 16 parameters
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])
        added[depth] = _logging_ops(model, UPDATES) - _logging_ops(model, ["default"])
    assert added[2] == added[8] and added[8] <= 24, added  # was 9 more per parameter


def test_batch_norm_weights_whose_updates_round_away_but_for_a_few_elements_are_named_frozen_by_rounding():
    torch.manual_seed(0)  # a batch norm's weights of 1.0 under SGD at lr 1e-4 in float32, as in shufflenet_v2
    model = nn.Sequential(nn.Conv2d(3, 24, 3), nn.BatchNorm2d(24), nn.ReLU(), nn.Flatten(), nn.Linear(24 * 36, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    inputs, labels = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    moved, lost_by_hand = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False,
                          statistics=["default", "update_lost"]) as viz:
            for _ in range(4):
                optimizer.zero_grad()
                (0.01 * F.cross_entropy(model(inputs), labels)).backward()  # gradient RMS about 1.8e-4
                weight, had_gradient = model[1].weight.detach().clone(), model[1].weight.grad.ne(0)
                optimizer.step()
                viz.flush()
                changed = model[1].weight.detach() != weight
                moved.append(int(changed.sum()))
                lost_by_hand.append(int((~changed & had_gradient).sum()) / int(had_gradient.sum()))
                assert viz.latest.layer_values["update_lost"]["1.weight"]["lost_fraction"] == pytest.approx(
                    lost_by_hand[-1], abs=1e-9)
    assert all(0 < count <= 2 for count in moved), moved  # a few still move: the values are never the same
    assert min(lost_by_hand) >= 0.9
    frozen = {alert.layer: alert.message for alert in viz.alerts if alert.rule == "frozen_parameter"}
    assert list(frozen) == ["1.weight"], frozen
    message = frozen["1.weight"]
    assert "rounding dropped at least 90% of its updates over 3 logging steps" in message, message
    assert "in the optimizer at learning rate 0.0001" in message and "float32 step" in message
    assert f"{lost_by_hand[1]:.1%} of its updates were lost" in message
    assert "larger learning rate" in message and "not in the optimizer" not in message


def test_a_users_own_statistic_of_the_update_gets_each_parameters_update_and_applied_update():
    from actviz.statistics.layer_statistic import LayerStatistic

    class LargestUpdate(LayerStatistic):  # not an UpdateStatistic: its device() runs per parameter
        name, names, target = "largest_update", ("largest",), "parameter_update"

        def device(self, tensor, module, options):
            return torch.stack([tensor.abs().max(), module.after.abs().max()]).float()

        def host(self, numbers, numel, dtype):
            return {"largest": numbers[0], "after": numbers[1]}

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False,
                      statistics=["default", LargestUpdate()]) as viz:
        before = {name: param.detach().double().clone() for name, param in model.named_parameters()}
        F.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
        optimizer.step()
        viz.flush()
    found = viz.latest.layer_values["largest_update"]
    assert set(found) == set(before)
    for name, param in model.named_parameters():
        assert found[name]["largest"] == pytest.approx(float((param.detach().double() - before[name]).abs().max()),
                                                       rel=1e-5)
        assert found[name]["after"] == pytest.approx(float(param.detach().abs().max()), rel=1e-6)
