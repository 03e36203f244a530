"""A statistic declares its target: the kurtosis of output gradients and of parameter gradients, each one class
(actviz.statistics.gradient_kurtosis) and one tag row, read back from the event file and checked against numpy."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from conftest import small_cnn

import actviz


def kurtosis(tensor: torch.Tensor) -> float:
    """The fourth standardised moment in float64, by hand."""
    values = tensor.detach().double().numpy().ravel()
    centred = values - values.mean()
    return float(len(values) * np.sum(centred**4) / np.sum(centred**2) ** 2)


@pytest.mark.usefixtures("both_paths")
def test_the_kurtosis_of_each_output_gradient_is_written_as_gradient_stats(tmp_path, read_run):
    model, grads = small_cnn(inplace=False), {}

    def keep_gradient(name, module, inputs, output):
        output.register_hook(lambda grad: grads.setdefault(name, grad))

    for name in ("0", "6"):
        model.get_submodule(name).register_forward_hook(partial(keep_gradient, name))
    with actviz.watch(model, tmp_path, every=1, image_every=False, statistics=["default", "gradient_kurtosis"]):
        model(torch.randn(4, 3, 8, 8)).pow(3).sum().backward()
    run = read_run(tmp_path)
    for name in ("0", "6"):
        assert run.scalar(f"gradient_stats/kurtosis@{name}", 0) == pytest.approx(kurtosis(grads[name]), rel=1e-5)
    assert not any(tag.startswith("weight_grad_stats/") for tag in run.scalar_tags)


@pytest.mark.usefixtures("both_paths")
def test_the_kurtosis_of_each_parameter_gradient_as_applied_is_written_as_weight_grad_stats(tmp_path, read_run):
    model = small_cnn(inplace=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with actviz.watch(model, tmp_path, every=1, image_every=False, statistics=["default", "weight_grad_kurtosis"]):
        model(torch.randn(4, 3, 8, 8)).pow(3).sum().backward()
        applied = {name: param.grad.clone() for name, param in model.named_parameters()}
        optimizer.step()
    run = read_run(tmp_path)
    tags = {tag for tag in run.scalar_tags if tag.startswith("weight_grad_stats/")}
    assert tags == {f"weight_grad_stats/kurtosis@{name}" for name in ("0.weight", "0.bias", "2.weight", "2.bias",
                                                                       "3.weight", "3.bias", "6.weight", "6.bias")}
    for name in ("0.weight", "3.bias", "6.weight"):
        assert run.scalar(f"weight_grad_stats/kurtosis@{name}", 0) == pytest.approx(kurtosis(applied[name]), rel=1e-5)
    assert not any(tag.endswith("/kurtosis") and tag.startswith("gradient_stats/") for tag in run.scalar_tags)
