"""Attention statistics from SDPA calls, against softmax(q kᵀ·scale + mask) computed eagerly for every row."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from actviz.attention import AttentionMode, attention_logits, attention_stats


def brute_force(q, k, mask=None, is_causal=False, scale=None, groups=1):
    """Every row of batch element 0 in float64: (logits (H, L, S) with -inf where left out, softmax)."""
    q, k = q[0].double(), k[0].double()
    if groups > 1:
        k = k.repeat_interleave(groups, dim=0)
    factor = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = q @ k.transpose(-2, -1) * factor
    length, keys = logits.shape[-2:]
    if is_causal:
        allowed = torch.ones(length, keys, dtype=torch.bool).tril()
        logits = logits.masked_fill(~allowed, -math.inf)
    if mask is not None:
        mask = mask[0] if mask.dim() == 4 else mask
        logits = torch.where(mask, logits, -math.inf) if mask.dtype == torch.bool else logits + mask.double()
    return logits, torch.softmax(logits, -1)


def expected_stats(logits, probabilities, rows):
    sampled_logits, p = logits[:, rows], probabilities[:, rows]
    entropy = -(torch.where(p > 0, p * p.log(), 0.0)).sum(-1)
    return torch.stack([sampled_logits.amax((-2, -1)), entropy.amin(-1), entropy.mean(-1), p[..., 0].mean(-1)])


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "given scale": {"scale": 0.3},
    "causal, given scale": {"is_causal": True, "scale": 2.0},
}


@pytest.mark.parametrize("length, rows", [(10, 64), (200, 64), (7, 3)])
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_rows_match_brute_force(case, length, rows):
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, length, 8), torch.randn(2, 3, length, 8)
    logits, probabilities = brute_force(q, k, **CASES[case])
    step = -(-length // rows)
    sampled = list(range(0, length, step))
    stats = attention_stats(attention_logits(q, k, rows=rows, **CASES[case]))
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, sampled), atol=1e-5, rtol=1e-5)
    assert (stats[0].double() <= logits.amax((-2, -1)) + 1e-5).all()  # sampled max <= exact max


@pytest.mark.parametrize("kind", ["bool", "additive", "bool per batch and head"])
def test_masks_match_brute_force(kind):
    torch.manual_seed(1)
    q, k = torch.randn(2, 2, 12, 4), torch.randn(2, 2, 16, 4)
    if kind == "bool":
        mask = torch.rand(12, 16) > 0.3
        mask[:, 0] = True  # no row left without a key
    elif kind == "additive":
        mask = torch.randn(12, 16) * 3
    else:
        mask = torch.rand(2, 2, 12, 16) > 0.5
        mask[..., 3] = True
    logits, probabilities = brute_force(q, k, mask=mask)
    stats = attention_stats(attention_logits(q, k, masks=(mask,), rows=5))
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, [0, 3, 6, 9]), atol=1e-5, rtol=1e-5)
    # and the call as SDPA gets it, through the mode
    with AttentionMode(rows=5) as mode:
        out = F.scaled_dot_product_attention(q, k, torch.randn(2, 2, 16, 4), attn_mask=mask)
    assert out.shape == (2, 2, 12, 4)
    torch.testing.assert_close(mode.calls[0][1], stats)


def test_grouped_query_attention():
    torch.manual_seed(2)
    q, k = torch.randn(1, 6, 9, 4), torch.randn(1, 2, 9, 4)
    logits, probabilities = brute_force(q, k, is_causal=True, groups=3)
    with AttentionMode() as mode:
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    (name, stats), = mode.calls
    assert name == "sdpa.0"
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, list(range(9))), atol=1e-5, rtol=1e-5)


def test_three_dimensional_and_half_precision_inputs():
    torch.manual_seed(3)
    q, k = torch.randn(2, 5, 8), torch.randn(2, 7, 8)  # (N, L, E): one head
    logits, probabilities = brute_force(q[:, None], k[:, None])
    stats = attention_stats(attention_logits(q, k))
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, list(range(5))), atol=1e-5, rtol=1e-5)
    half = attention_stats(attention_logits(q.bfloat16()[:, None], k.bfloat16()[:, None]))
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, stats, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_multihead_attention_module(need_weights, masked):
    torch.manual_seed(4)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(3, 6, 8)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1) if masked else None  # MHA's True: left out
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, 5] = True  # batch element 0 leaves out key 5
    with AttentionMode() as mode:
        mode.enter("attn")
        attention(x, x, x, attn_mask=mask, key_padding_mask=padding, need_weights=need_weights)
    (name, stats), = mode.calls
    w_q, w_k, _ = attention.in_proj_weight.chunk(3)
    b_q, b_k, _ = attention.in_proj_bias.chunk(3)
    q = (x[0] @ w_q.T + b_q).view(6, 2, 4).transpose(0, 1)[None]
    k = (x[0] @ w_k.T + b_k).view(6, 2, 4).transpose(0, 1)[None]
    allowed = torch.ones(6, 6, dtype=torch.bool)
    allowed[:, 5] = False
    if masked:
        allowed &= torch.ones(6, 6, dtype=torch.bool).tril()
    logits, probabilities = brute_force(q.detach(), k.detach(), mask=allowed)
    torch.testing.assert_close(stats.double(), expected_stats(logits, probabilities, list(range(6))), atol=1e-5, rtol=1e-5)


def test_calls_are_named_by_the_innermost_module_and_a_second_call_keeps_the_first():
    q = torch.randn(1, 1, 4, 2)
    with AttentionMode() as mode:
        mode.enter("block")
        mode.enter("block.attn")
        F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q * 100, q, q)  # same module again: its first call is kept
        mode.leave("block.attn")
        F.scaled_dot_product_attention(q, q, q)
    assert [name for name, _ in mode.calls] == ["block.attn", "block"]


def test_a_failing_statistic_never_stops_the_forward():
    q = torch.randn(1, 4, 3, 2)
    with AttentionMode() as mode:
        out = F.scaled_dot_product_attention(q, q, q)
        with pytest.raises(RuntimeError):  # the user's own error still raises
            F.scaled_dot_product_attention(q, torch.randn(1, 4, 3, 5), q)
    assert out.shape == q.shape and mode.failed is not None  # stats stopped after the failure, the forward did not
