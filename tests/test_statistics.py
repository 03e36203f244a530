"""Per-layer statistics through their one interface: a made-up one added in a few lines and read back from the
event file, the registry's checks, and each built-in statistic's device cost (kernels, no sync)."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
from torch import nn

import actviz
from actviz.statistics import LayerStatistic, check_statistics


class Skewness(LayerStatistic):
    """The third standardised moment of each output: the whole statistic, in one class."""

    name, names = "skewness", ("skewness",)

    def applies_to(self, module):
        return isinstance(module, nn.Linear)

    def device(self, tensor, module, options):
        values = tensor.detach().reshape(-1).double()
        centred = values - values.mean()
        return torch.stack([centred.square().sum(), centred.pow(3).sum()])

    def host(self, numbers, numel, dtype):
        squares, cubes = numbers
        return {"skewness": (cubes / numel) / (squares / numel) ** 1.5}


def test_a_made_up_statistic_is_written_and_read_back(read_run):
    torch.manual_seed(0)
    model, log_dir = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), tempfile.mkdtemp()
    outputs = {}
    model[2].register_forward_hook(lambda m, a, out: outputs.update(last=out.detach().double().numpy()))
    with actviz.watch(model, log_dir, every=1, layers="all", statistics=[Skewness()],
        options=actviz.Options(strict=True)) as viz:
        model(torch.randn(16, 4).exp()).sum().backward()
    x = outputs["last"].reshape(-1)
    expected = np.mean((x - x.mean()) ** 3) / np.mean((x - x.mean()) ** 2) ** 1.5
    run = read_run(log_dir)
    assert run.scalar("activation_stats/skewness@2", 0) == pytest.approx(expected, rel=1e-5)
    assert "activation_stats/skewness@1" not in run.scalar_tags  # the ReLU: it does not apply there
    assert viz.latest.layer_values["skewness"]["2"]["skewness"] == pytest.approx(expected, rel=1e-9)


def test_the_statistics_argument_is_checked():
    assert check_statistics(None) is None
    with pytest.raises(TypeError, match=r"statistics=\[Skewness\(\)\]"):
        check_statistics([Skewness])
    with pytest.raises(TypeError, match="list of names"):
        check_statistics("outliers")
    with pytest.raises(ValueError, match="given twice"):
        check_statistics([Skewness(), Skewness()])
    with pytest.raises(ValueError, match="unknown statistic"):
        actviz.watch(nn.Linear(2, 2), tempfile.mkdtemp(), statistics=["nope"])


@pytest.mark.parametrize("module, shape, kernels", [
    (nn.ReLU(), (4, 8, 5, 5), 3), (nn.Tanh(), (4, 8), 3), (nn.Sigmoid(), (4, 8), 4),
])
def test_the_unit_counts_cost_three_or_four_kernels_and_no_sync(module, shape, kernels):
    from conftest import CountOps

    from actviz.statistics.unit_counts import DeadChannels, Saturation

    statistic = DeadChannels() if isinstance(module, nn.ReLU) else Saturation()
    assert statistic.applies_to(module)
    tensor = torch.randn(shape)
    with CountOps() as count:
        statistic.device(tensor, module, None)
    assert len(count.kernels) == kernels and count.syncs == [], count.kernels


def test_a_cnn_gets_kurtosis_and_logits_by_naming_them(read_run):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    default_dir, chosen_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
    inputs = torch.randn(2, 3, 8, 8)
    with actviz.watch(model, default_dir, every=1):
        model(inputs).sum().backward()
    assert not [tag for tag in read_run(default_dir).scalar_tags if "kurtosis" in tag or tag.startswith("logits/")]
    with actviz.watch(model, chosen_dir, every=1, statistics=["outliers", "logits"]):
        logits = model(inputs)
        logits.sum().backward()
    run = read_run(chosen_dir)
    assert {"activation_stats/kurtosis@0", "activation_stats/max_abs@2", "logits/entropy"} <= run.scalar_tags
    assert run.scalar("logits/max", 0) == pytest.approx(logits.max().item(), rel=1e-6)
    with pytest.raises(ValueError, match="did you mean 'outliers'"):
        check_statistics(["outlier"])


def test_the_logits_cost_one_op_over_the_logits_five_small_ones_and_no_sync():
    from conftest import CountOps

    from actviz.statistics.logits import Logits

    model, output = nn.Linear(3, 10), torch.randn(4, 10)
    with CountOps() as count:
        Logits().device(Logits().select(model, output), model, None)
    assert count.kernels == ["actviz.logit_rows.default", "aten.amax.default", "aten.mean.default", "aten.mean.default",
                             "aten.neg.default", "aten.stack.default"]
    assert count.syncs == []


def test_the_moments_are_typed_values_of_the_step_and_its_scalars(read_run):
    """``layer_values["moments"]`` of a step, by hand in float64 (a NaN included), and the event file's scalars."""
    torch.manual_seed(0)
    model, log_dir = nn.Sequential(nn.Linear(4, 64), nn.ReLU()), tempfile.mkdtemp()
    inputs = torch.randn(8, 4)
    inputs[0, 0] = float("nan")  # row 0 of both outputs is NaN
    with actviz.watch(model, log_dir, every=1, layers="all", alerts=False) as viz:
        model(inputs)
        viz.flush()
        moments = viz.latest.layer_values["moments"]
    run = read_run(log_dir)
    for name, output in (("0", model[0](inputs)), ("1", model(inputs))):
        values = output.detach().double().reshape(-1)
        finite = values[torch.isfinite(values)]
        expected = {"mean": finite.mean().item(), "std": finite.std().item(),
                    "zero_fraction": (values == 0).double().mean().item(),
                    "nonfinite": float((~torch.isfinite(values)).sum())}
        assert expected["nonfinite"] == 64 and all(type(value) is float for value in moments[name].values())
        assert moments[name] == pytest.approx(expected, rel=1e-5, abs=1e-7), name
        for key, value in moments[name].items():
            if key != "zero_fraction" or value:  # written once not zero
                assert run.scalar(f"activation_stats/{key}@{name}", 0) == pytest.approx(value, rel=1e-6), (name, key)
    assert "activation_stats/zero_fraction@0" not in run.scalar_tags


def test_zero_moments_are_written_only_from_the_first_step_where_they_are_not_zero(read_run):
    model, log_dir = nn.Sequential(nn.Linear(2, 3)), tempfile.mkdtemp()
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(1.0)
    batches = [torch.ones(2, 2), torch.full((2, 2), -0.5), torch.ones(2, 2), torch.full((2, 2), float("inf"))]
    with actviz.watch(model, log_dir, every=1, alerts=False) as viz:
        for batch in batches:  # outputs 3, then 0 (zero fraction 1), 3, then Inf
            model(batch)
        viz.flush()
    run = read_run(log_dir)
    assert [e.step for e in run.scalar_events("activation_stats/mean@0")] == [0, 1, 2, 3]
    assert [(e.step, e.value) for e in run.scalar_events("activation_stats/zero_fraction@0")] == [(1, 1.0), (2, 0.0),
                                                                                                 (3, 0.0)]
    assert [(e.step, e.value) for e in run.scalar_events("activation_stats/nonfinite@0")] == [(3, 6.0)]


def test_a_list_without_moments_writes_no_moments(read_run):
    model, log_dir = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), tempfile.mkdtemp()
    with actviz.watch(model, log_dir, every=1, layers="all", statistics=[Skewness()]) as viz:
        model(torch.randn(16, 4)).sum().backward()
        viz.flush()
        assert "moments" not in viz.latest.layer_values and viz.latest.layer_values["skewness"]
    run = read_run(log_dir)
    assert not [tag for tag in run.scalar_tags if tag.endswith(("/mean", "/std"))]
    assert {"activations/0", "gradients/2"} <= run.histogram_tags  # no gradient_norms either: no gradient_stats/
    assert not [tag for tag in run.scalar_tags if tag.startswith("gradient_stats/")]
    assert check_statistics(["moments"])[0].name == "moments"
