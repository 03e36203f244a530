"""FP8/MX readiness (actviz.statistics.fp8_readiness) against exact float8 casts in torch: a normal tensor, a
heavy-tailed one with outliers and one with a wide dynamic range, as outputs and as their gradients, read back from
the event file; and its cost: no sync."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import actviz
from actviz.statistics.fp8_readiness import BLOCK, FORMATS, SAMPLE, Fp8Readiness, readiness

CASTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def planted(seed: int, rows: int = 128) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, 128, generator=generator)
    heavy = torch.randn(rows, 128, generator=generator)
    heavy.view(-1)[torch.randperm(heavy.numel(), generator=generator)[: heavy.numel() // 200]] *= 1000.0  # 0.5 %
    exponents = torch.rand(rows, 128, generator=generator) * 40 - 30
    wide = torch.exp2(exponents) * torch.randn(rows, 128, generator=generator).sign()
    return {"normal": normal, "heavy": heavy, "wide": wide}


def by_casts(x: torch.Tensor) -> dict[str, float]:
    """The truth: each fraction from a round trip through torch's float8 dtypes, over every element."""
    truth = {}
    for form in FORMATS:
        cast = CASTS[form.name]
        amax = x.abs().amax()
        scaled = x * (torch.tensor(form.max, dtype=torch.float32) / amax)
        back = scaled.to(cast).float()
        truth[f"fp8_{form.name}_underflow"] = ((x != 0) & (back.abs() < form.min_normal)).double().mean().item()
        blocks = x.double().reshape(-1, BLOCK)
        scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(dim=1, keepdim=True))) - form.emax)
        scaled = (blocks / scale).float()
        back = scaled.to(cast).float()
        lost = ~back.isfinite() | ((scaled.abs() - back.abs()) > form.top_step / 2)  # clamped, not rounded
        truth[f"mx_{form.name}_underflow"] = ((blocks != 0) & (back.abs() < form.min_normal)).double().mean().item()
        truth[f"mx_{form.name}_saturated"] = lost.double().mean().item()
    return truth


@pytest.mark.parametrize("name", ["normal", "heavy", "wide"])
def test_the_fractions_of_the_whole_tensor_are_the_exact_casts(name):
    x = planted(0)[name]
    values = readiness(x.abs().max().item(), x.reshape(-1).double().numpy())
    truth = by_casts(x)
    assert values == pytest.approx(truth, abs=1e-12)
    assert truth["mx_e4m3_saturated"] > 0 and (truth["fp8_e4m3_underflow"] > 0.05) == (name != "normal")


class Planted(nn.Module):
    """Three layers whose outputs are the tensors they are given."""

    def __init__(self) -> None:
        super().__init__()
        self.normal, self.heavy, self.wide = nn.Identity(), nn.Identity(), nn.Identity()

    def forward(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [getattr(self, name)(tensor) for name, tensor in tensors.items()]


@pytest.mark.usefixtures("both_paths")
@pytest.mark.parametrize("rows", [128, 1024])  # batched with the step's small tensors; summarized by the one-pass op
def test_planted_outputs_and_gradients_read_back_within_the_samples_error(tmp_path, read_run, rows):
    outputs, gradients = planted(1, rows), planted(2, rows)
    inputs = {name: tensor.clone().requires_grad_() for name, tensor in outputs.items()}
    model = Planted()
    with actviz.watch(model, tmp_path, every=1, layers=["normal", "heavy", "wide"],
                      statistics=["fp8_readiness", "fp8_gradients"]):
        torch.autograd.backward(model(inputs), list(gradients.values()))
    run = read_run(tmp_path)
    for group, tensors in (("activation_stats", outputs), ("gradient_stats", gradients)):
        for layer, tensor in tensors.items():
            for name, truth in by_casts(tensor).items():
                tolerance = 4 * math.sqrt(max(truth * (1 - truth), 1 / SAMPLE) / SAMPLE)
                assert run.scalar(f"{group}/{name}@{layer}", 0) == pytest.approx(truth, abs=tolerance), (group, layer, name)
    (kept,) = run.events.Tensors("fp8_readiness/keep_in_bf16")
    text = kept.tensor_proto.string_val[0].decode()
    assert "`heavy`" in text and "`wide`" in text and "`normal`" not in text


def test_nonfinite_amax_gives_no_per_tensor_fraction_and_the_cost_has_no_sync():
    from conftest import CountOps

    x = torch.randn(64, 64)
    x[0, 0] = math.inf
    with CountOps() as count:
        numbers = Fp8Readiness().device(x, nn.Identity(), None)
    assert count.syncs == [] and len(count.kernels) <= 5, count.kernels
    values = Fp8Readiness().host(numbers.tolist(), x.numel(), x.dtype)
    assert "fp8_e4m3_underflow" not in values and "mx_e4m3_underflow" in values
    assert Fp8Readiness().texts({"inf": values}) == {}  # no layer judged: no claim that every layer is fine
    healthy = Fp8Readiness().texts({"inf": values, "ok": {"fp8_e4m3_underflow": 0.001}})
    assert healthy == {"fp8_readiness/keep_in_bf16": "none: the e4m3 underflow with per-tensor scaling of each of the "
                                                     "1 layers with a finite amax is at most 1%"}
    assert values["mx_e4m3_saturated"] > 0  # the blocks without the Inf
