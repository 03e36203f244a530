"""The attention logit bound from the SDPA kernel's log-sum-exp, read back from the event file against the exact
maxima of q·kᵀ·scale in float64, with one head's q planted ×30."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import CountOps, Run
from torch import nn

import actviz
from actviz.transformers.attention import AttentionMode

HEADS, WIDTH, PLANTED = 4, 8, 2


class PlantedAttention(nn.Module):
    """Causal self-attention whose head ``PLANTED`` has its q scaled ×30."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HEADS * WIDTH, 3 * HEADS * WIDTH)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, HEADS, WIDTH).permute(2, 0, 3, 1, 4)
        scale = torch.ones(HEADS, 1, 1)
        scale[PLANTED] = 30.0
        return q * scale, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


def exact_maxima(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per head, the largest causal logit q·kᵀ/√E over every batch element and row, in float64."""
    q, k = q.double(), k.double()
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    return logits.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))


def test_the_bound_brackets_the_exact_max_and_names_the_planted_heads_q(tmp_path):
    torch.manual_seed(0)
    model, x = PlantedAttention(), torch.randn(3, 40, HEADS * WIDTH)
    with actviz.watch(model, tmp_path, every=1):
        model(x).square().mean().backward()
    run = Run(tmp_path)
    with torch.no_grad():
        q, k, _ = model.project(x)
    exact = exact_maxima(q, k)
    upper, lower = (run.scalar(f"attention/{name}@sdpa.0", 0) for name in ("logit_bound", "logit_bound_low"))
    assert int(exact.argmax()) == PLANTED and run.scalar("attention/bound_head@sdpa.0", 0) == PLANTED
    assert lower - 1e-4 <= float(exact.max()) <= upper + 1e-4 and upper - lower == pytest.approx(math.log(40))
    q_norms = q.double().norm(dim=-1).amax(dim=(0, 2))
    k_norms = k.double().norm(dim=-1).amax(dim=(0, 2))
    assert run.scalar("attention/q_norm_max@sdpa.0", 0) == pytest.approx(float(q_norms[PLANTED]), rel=1e-5)
    assert run.scalar("attention/k_norm_max@sdpa.0", 0) == pytest.approx(float(k_norms[PLANTED]), rel=1e-5)
    others = [head for head in range(HEADS) if head != PLANTED]
    assert q_norms[PLANTED] > 10 * q_norms[others].max()  # q grew, k did not: the split names q
    assert k_norms[PLANTED] <= k_norms.max() and k_norms[PLANTED] < 3 * k_norms[others].min()
    alignment = upper / (float(q_norms[PLANTED] * k_norms[PLANTED]) / math.sqrt(WIDTH))
    assert run.scalar("attention/qk_alignment@sdpa.0", 0) == pytest.approx(alignment, rel=1e-5)
    heads = run.histogram("attention/head_logit_bound@sdpa.0", 0)
    assert heads.num == HEADS and heads.max == pytest.approx(upper, rel=1e-6)


def test_the_math_backend_dropout_gives_no_bound(tmp_path):
    attention = nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)  # dropout on CPU: the math backend
    x = torch.randn(2, 5, 16)
    with AttentionMode() as mode:
        mode.enter("attn")
        attention(x, x, x, need_weights=False)
    assert len(mode.calls) == 1 and mode.bounds == [] and mode.failed is None


def test_the_bound_adds_six_kernels_and_no_sync():
    q = torch.randn(2, 4, 100, 8)
    with AttentionMode() as plain:
        plain.logit_bound = False
        plain.enter("warm")  # the causal mask is made once and kept
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        plain.enter("a")
        with CountOps() as without:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with AttentionMode() as mode:
        mode.enter("a")
        with CountOps() as counted:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    added = len(counted.kernels) - len(without.kernels)
    assert added == 6 and counted.syncs == [], counted.kernels  # amax of LSE, 2 norms, 2 amax, stack
