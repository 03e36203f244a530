"""Outliers and headroom against NumPy in float64, and the alerts they raise."""

from __future__ import annotations

import math
import tempfile
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import actviz
from actviz.statistics.outliers import outlier_numbers, outlier_vector
from actviz.diagnosis.transformer_alerts import headroom_alerts, massive_activation_alerts


def by_numpy(values: np.ndarray, dtype_max: float | None) -> dict[str, float]:
    x = values.astype(np.float64).ravel()
    centred = x - x.mean()
    found = {
        "max_abs": np.abs(x).max(),
        "kurtosis": np.mean(centred**4) / np.mean(centred**2) ** 2,
        "outlier_fraction": np.mean(np.abs(x) >= 6),
    }
    if dtype_max is not None:
        found["headroom_bits"] = math.log2(dtype_max / found["max_abs"])
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("distribution", ["gaussian", "heavy tails"])
def test_against_numpy(dtype, distribution):
    torch.manual_seed(0)
    values = torch.randn(3, 50, 40) * 3
    if distribution == "heavy tails":
        values[0, 4, :] *= 40  # one outlier feature
    values = values.to(dtype)
    numbers = outlier_numbers(outlier_vector(values, None).tolist(), values.numel(), dtype)
    expected = by_numpy(values.float().numpy(), torch.finfo(dtype).max if dtype.itemsize <= 2 else None)
    assert set(numbers) - {"median_abs"} == set(expected)
    for key, value in expected.items():
        assert numbers[key] == pytest.approx(value, rel=1e-5), key
    assert numbers["median_abs"] == pytest.approx(np.median(np.abs(values.float().numpy())), rel=0.01)


def test_gaussian_kurtosis_is_three_and_constant_is_nan():
    torch.manual_seed(1)
    gaussian = outlier_numbers(outlier_vector(torch.randn(200_000), None).tolist(), 200_000, torch.float32)
    assert gaussian["kurtosis"] == pytest.approx(3.0, abs=0.05)
    constant = outlier_numbers(outlier_vector(torch.full((10,), 2.0), None).tolist(), 10, torch.float32)
    assert math.isnan(constant["kurtosis"]) and constant["max_abs"] == 2.0


def test_the_median_comes_from_the_histogram_sample():
    values = torch.arange(1.0, 10001.0)
    sampled = outlier_vector(values, 100).tolist()[4]  # stride 101: every 101st element
    assert sampled == float(np.median(values.numpy()[::101]).round()) or sampled == float(
        torch.tensor(values.numpy()[::101]).median())


def test_alert_rules():
    assert headroom_alerts(0, {"a": {"headroom_bits": 3.0, "max_abs": 8000.0}}) == []
    assert len(headroom_alerts(0, {"a": {"headroom_bits": 0.9, "max_abs": 35000.0}})) == 1
    assert massive_activation_alerts(0, {"a": {"max_abs": 999.0, "median_abs": 1.0}}) == []
    assert len(massive_activation_alerts(0, {"a": {"max_abs": 1001.0, "median_abs": 1.0}})) == 1
    assert massive_activation_alerts(0, {"a": {"max_abs": 5.0, "median_abs": 0.0}}) == []


class Block(nn.Module):
    """Attention then an MLP whose hidden units hold one massive feature."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.up = nn.Linear(8, 64)
        with torch.no_grad():
            self.up.bias[7] = 30_000.0  # a massive activation; in float16, 1.1 bits below 65504

    def forward(self, x):
        mixed, _ = self.attention(x, x, x, need_weights=False)
        return self.up(mixed)


def test_tags_and_alerts_read_back(read_run):
    torch.manual_seed(0)
    model, log_dir = Block().half(), tempfile.mkdtemp()
    x = torch.randn(2, 5, 8).half()
    outputs = {}
    model.up.register_forward_hook(lambda m, a, out: outputs.update(up=out.detach().clone()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with actviz.watch(model, log_dir, every=1, options=actviz.Options(strict=True)):
            model(x).float().sum().backward()
    expected = by_numpy(outputs["up"].float().numpy(), 65504.0)
    run = read_run(log_dir)
    for key, value in expected.items():
        assert run.scalar(f"activation_stats/{key}@up", 0) == pytest.approx(value, rel=1e-5), key
    assert run.scalar("activation_stats/headroom_bits@up", 0) < 1.2
    messages = [str(w.message) for w in caught if "actviz" in str(w.message)]
    assert any("massive activation in 'up'" in m for m in messages), messages
    alerts = run.events.Tensors("alerts")[0].tensor_proto.string_val[0].decode()
    assert "massive activation in 'up'" in alerts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_output_gives_its_outlier_numbers_from_its_one_summary_op(dtype, monkeypatch):
    # The one-pass op adds the outlier numbers to the row it reads anyway; the median comes from the sample.
    from conftest import CountOps

    from actviz.statistics.outliers import Outliers
    from actviz.summaries.one_pass import OUTLIER_FIELDS
    from actviz.summaries.one_tensor import reduce_tensor

    monkeypatch.setenv("ACTVIZ_CPU_SHORTCUTS", "0")
    tensor = (torch.randn(4, 100, 64) * 3).to(dtype)  # 25,600 elements: larger than the sample of 4,096
    with CountOps() as count:
        reduction = reduce_tensor(tensor, 1 << 12, outliers=True)
        numbers = Outliers().from_summary(reduction.extra_fields(OUTLIER_FIELDS), reduction.sample_values())
    assert count.kernels == ["actviz.summarize.default", "aten.abs.default", "aten.median.default", "aten.cat.default"]
    assert count.syncs == []
    assert numbers.tolist() == pytest.approx(outlier_vector(tensor, 1 << 12).tolist(), rel=1e-6)


def test_the_nan_alert_and_the_transformer_alerts_share_the_alerts_text(read_run):
    torch.manual_seed(0)
    broken = nn.Linear(64, 4)
    with torch.no_grad():
        broken.weight[0, 0] = float("nan")
    model, log_dir = nn.Sequential(Block(), broken), tempfile.mkdtemp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with actviz.watch(model, log_dir, every=1):
            model(torch.randn(2, 5, 8)).sum().backward()
    alerts = read_run(log_dir).events.Tensors("alerts")[0].tensor_proto.string_val[0].decode()
    assert "NaN or Inf first at step 0, in the output of '1'" in alerts
    assert "massive activation in '0.up'" in alerts


def test_a_vocabulary_sized_output_is_reduced_a_piece_at_a_time_with_the_same_numbers(monkeypatch):
    import actviz.summaries.outlier_moments as outlier_moments

    torch.manual_seed(0)
    tensor = torch.randn(3, 1000, 70) * 3
    tensor[0, 0, 0] = 40.0  # an outlier in the first piece
    whole = outlier_vector(tensor, 4096)
    monkeypatch.setattr(outlier_moments, "PIECE", 10_000)  # 21 pieces
    pieces = outlier_vector(tensor, 4096)
    assert torch.allclose(whole, pieces, rtol=1e-9)
    expected = by_numpy(tensor.numpy(), None)
    numbers = outlier_numbers(pieces.tolist(), tensor.numel(), tensor.dtype)
    for key, value in expected.items():
        assert numbers[key] == pytest.approx(value, rel=1e-6), key
