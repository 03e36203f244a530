"""The residual stream statistic, ``statistics=["residual"]``, read back from the event file against values known by
construction: identity, 2·x and ×1.1 blocks, and rank-1 and orthogonal token rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import CountOps, Run
from torch import nn

import actviz
from actviz.statistics.residual import ROWS, Residual, residual_blocks


class Scaled(nn.Module):
    """``y = factor · x``: write ratio ``|factor − 1|``, growth ``|factor|``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.factor == 1.0 else x * self.factor


class Stack(nn.Module):
    """A learned scalar in front of a ModuleList of blocks, GPT-2's ``h`` in miniature."""

    def __init__(self, *factors: float) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))
        self.h = nn.ModuleList(Scaled(factor) for factor in factors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.gain
        for block in self.h:
            x = block(x)
        return x


def residual_run(tmp_path, model: nn.Module, x: torch.Tensor) -> Run:
    with actviz.watch(model, tmp_path, every=1, statistics=["default", "residual"]):
        model(x).square().sum().backward()
    return Run(tmp_path)


def test_identity_twice_and_one_point_one_blocks_give_their_write_ratio_and_growth(tmp_path):
    x = torch.randn(2, 5, 8)
    run = residual_run(tmp_path, Stack(1.0, 2.0, 1.1, 1.1), x)
    rms_in = float(x.double().square().mean().sqrt())
    expected = {"h.0": (0.0, 1.0, rms_in), "h.1": (1.0, 2.0, 2 * rms_in), "h.2": (0.1, 1.1, 2.2 * rms_in),
                "h.3": (0.1, 1.1, 2.42 * rms_in)}
    for block, (write_ratio, growth, rms) in expected.items():
        assert run.scalar(f"residual/write_ratio@{block}", 0) == pytest.approx(write_ratio, abs=1e-6)
        assert run.scalar(f"residual/growth@{block}", 0) == pytest.approx(growth, rel=1e-6)
        assert run.scalar(f"residual/rms@{block}", 0) == pytest.approx(rms, rel=1e-6)


def test_rank_one_rows_have_effective_rank_one_and_cosine_one(tmp_path):
    direction = torch.randn(16)
    x = torch.rand(3, 7, 1).add(0.5) * direction  # 21 rows, positive multiples of one vector
    run = residual_run(tmp_path, Stack(1.0, 1.0), x)
    assert run.scalar("residual/effective_rank@h.0", 0) == pytest.approx(1.0, abs=1e-3)
    assert run.scalar("residual/mean_cosine@h.1", 0) == pytest.approx(1.0, abs=1e-6)


def test_orthogonal_rows_have_effective_rank_the_row_count_and_cosine_zero(tmp_path):
    q, _ = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))
    x = (3.0 * q[:12]).float().reshape(2, 6, 32)  # 12 orthogonal rows of one norm
    run = residual_run(tmp_path, Stack(1.0, 1.0), x)
    assert run.scalar("residual/effective_rank@h.0", 0) == pytest.approx(12.0, rel=1e-5)
    assert run.scalar("residual/mean_cosine@h.0", 0) == pytest.approx(0.0, abs=1e-6)


def test_many_rows_are_sampled_evenly_and_match_numpy():
    torch.manual_seed(0)
    y = torch.randn(4, 300, 24)
    numbers = Residual().device_with_input(y, y, nn.Identity(), None)
    values = Residual().host(numbers.tolist(), y.numel(), y.dtype)
    rows = y.reshape(-1, 24).double().numpy()[:: math.ceil(1200 / ROWS)]
    singular = np.linalg.svd(rows, compute_uv=False)
    p = singular / singular.sum()
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    cosine = unit @ unit.T
    assert len(rows) <= ROWS and values["write_ratio"] == 0.0
    assert values["rms"] == pytest.approx(float(np.sqrt(np.mean(rows**2))), rel=1e-5)  # of the sampled rows
    assert values["effective_rank"] == pytest.approx(float(np.exp(-(p * np.log(p)).sum())), rel=1e-5)
    assert values["mean_cosine"] == pytest.approx((cosine.sum() - len(rows)) / (len(rows) * (len(rows) - 1)), abs=1e-6)


def test_blocks_are_the_repeated_children_of_module_lists_outermost_only():
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16), 2, enable_nested_tensor=False)
    assert list(residual_blocks(encoder)) == ["layers.0", "layers.1"]
    assert list(residual_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))) == []
    assert list(residual_blocks(Stack(1.0, 1.0))) == ["h.0", "h.1"]


def test_a_block_adds_ten_kernels_and_no_sync():
    x = torch.randn(2, 64, 32)
    y = 2 * x
    with CountOps() as counted:  # 3 norms, sub, mm, 2 scales, div, stack, cat
        Residual().device_with_input(y, x, nn.Identity(), None)
    assert len(counted.kernels) == 10 and counted.syncs == [], counted.kernels


def test_a_cnns_blocks_are_skipped_with_no_op():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=4)
    blocks = residual_blocks(model)
    assert "layer1.0" in blocks and len(blocks) == 8  # BasicBlocks, repeated in each nn.Sequential stage
    x = torch.randn(1, 64, 8, 8)
    y = blocks["layer1.0"](x)
    with CountOps() as counted:
        assert Residual().device_with_input(y, x, blocks["layer1.0"], None) is None
    assert counted.kernels == []
