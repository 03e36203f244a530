"""Dormant units (actviz.statistics.dormant_units) against planted quiet channels, scored in float64 over the whole
batch by hand, read back from the event file; and their cost: one kernel, no sync."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import actviz
from actviz.statistics.dormant_units import TAUS, DormantUnits

QUIET = (3, 7, 11)  # scaled by 0.01: dormant on every sample
ON_INPUT_ZERO = (12, 13, 14, 15)  # fed by input channel 0 alone, which sample 0 lacks: quiet there, busy elsewhere


def planted_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.ReLU())
    with torch.no_grad():
        model[0].weight[list(ON_INPUT_ZERO), 1:] = 0
        model[0].bias[list(ON_INPUT_ZERO)] = 0
        model[0].weight[list(QUIET)] *= 0.01
        model[0].bias[list(QUIET)] *= 0.01
    return model


def dormant_by_hand(output: np.ndarray) -> dict[float, list[int]]:
    """Sokar et al.'s τ-dormant units of a (batch, channels, ...) output, in float64."""
    means = np.abs(output).reshape(output.shape[0], output.shape[1], -1).mean(axis=(0, 2))
    return {tau: [int(i) for i in np.flatnonzero(means / means.mean() <= tau)] for tau in TAUS}


def test_planted_dormant_channels_are_counted_over_the_whole_batch(tmp_path, read_run):
    model = planted_model()
    inputs = torch.randn(8, 4, 6, 6)
    inputs[0, 0] = 0  # sample 0 lacks input channel 0
    with actviz.watch(model, tmp_path, every=1, layers=["0"], statistics=["moments", "dormant_units"]):
        output = model(inputs)
        output.sum().backward()
    truth = dormant_by_hand(output.detach().double().numpy())
    from_sample_zero = dormant_by_hand(output.detach()[:1].double().numpy())
    assert truth[0.025] == list(QUIET)
    assert from_sample_zero[0.025] != truth[0.025] and set(ON_INPUT_ZERO) <= set(from_sample_zero[0.025])
    run = read_run(tmp_path)
    layer = "1"  # the ReLU, not watched: counted on its own
    for tau in TAUS:
        assert run.scalar(f"activation_stats/dormant_count_{tau}@{layer}", 0) == len(truth[tau])
        assert run.scalar(f"activation_stats/dormant_fraction_{tau}@{layer}", 0) == pytest.approx(len(truth[tau]) / 16)
    (event,) = run.events.Tensors(f"activation_stats/dormant_units@{layer}")
    text = event.tensor_proto.string_val[0].decode()
    assert text == "; ".join(f"τ = {tau}: {', '.join(map(str, truth[tau]))}" for tau in TAUS)


def test_sequence_features_are_the_units_and_a_healthy_layer_writes_no_text(tmp_path, read_run):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 12), nn.GELU())
    with torch.no_grad():
        model[0].weight[5] *= 0.001
        model[0].bias[5] = 0
    tokens = torch.randn(3, 10, 8)
    with actviz.watch(model, tmp_path, every=1, layers="all", statistics=["dormant_units"]):
        output = model(tokens)
        output.sum().backward()
    means = np.abs(output.detach().double().numpy()).mean(axis=(0, 1))
    expected = int((means / means.mean() <= 0.1).sum())
    run = read_run(tmp_path)
    assert run.scalar("activation_stats/dormant_count_0.1@1", 0) == expected >= 1
    assert "activation_stats/dormant_count_0.1@0" not in run.scalar_tags  # a Linear is not an activation
    values = DormantUnits().host(torch.ones(12).tolist(), 360, torch.float32)
    assert values["dormant_count_0.1"] == 0 and DormantUnits().texts({"x": values}) == {}


def test_nonfinite_channels_are_left_out_and_an_all_zero_layer_is_all_dormant():
    values = DormantUnits().host([float("nan"), 4.0, 0.0, 4.0], 8, torch.float32)
    assert values["dormant_units_0.025"] == (2,) and values["dormant_fraction_0.025"] == pytest.approx(1 / 3)
    assert DormantUnits().host([0.0, 0.0], 4, torch.float32)["dormant_fraction_0.1"] == 1.0


def test_the_dormant_units_cost_one_kernel_and_no_sync():
    from conftest import CountOps

    tensor = torch.randn(4, 8, 5, 5)
    with CountOps() as count:
        DormantUnits().device(tensor, nn.SiLU(), None)
    assert count.kernels == ["aten.linalg_vector_norm.default"] and count.syncs == []


def test_a_1d_convolutions_channels_are_its_units_when_named_alone(tmp_path, read_run):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv1d(3, 6, 3), nn.ReLU())
    with torch.no_grad():
        model[0].weight[4] *= 0.001
        model[0].bias[4] = 0
    with actviz.watch(model, tmp_path, every=1, statistics=["dormant_units"]):
        output = model(torch.randn(4, 3, 10))  # (batch, channels, length): channels in dimension 1
        output.sum().backward()
    truth = dormant_by_hand(output.detach().double().numpy())
    assert 4 in truth[0.025]
    assert read_run(tmp_path).scalar("activation_stats/dormant_count_0.025@1", 0) == len(truth[0.025])
