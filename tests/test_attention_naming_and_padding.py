"""Which module an attention call is named after, and the entropy rule on padded batches.

* A call is named after the innermost watched (or attention) module that encloses it, whatever its class:
  a leaf named ``Mixer``, a module with children whose own forward attends, nested watched modules.
* On padded batches of mixed lengths, each row's entropy is compared with its own row's ceiling,
  ``log(keys the row may attend)``: normal training raises no ``attention_entropy_collapse``, a real collapse does.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import actviz
from actviz.transformers.attention import AttentionMode
from actviz.transformers.attention_stats import attention_logits, attention_stats, entropy_fractions, head_numbers

WIDTH, HEADS, LENGTH = 16, 2, 16
LENGTHS = (3, 9, 16)  # of LENGTH: a padded batch of mixed lengths


def _attend(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor | None = None,
            is_causal: bool = False) -> torch.Tensor:
    """Multi-head self-attention of ``x`` (N, L, E) through SDPA, with ``weight`` (3E, E) as the q, k, v projection."""
    n, length, width = x.shape
    q, k, v = F.linear(x, weight).view(n, length, 3, HEADS, width // HEADS).permute(2, 0, 3, 1, 4)
    mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    return mixed.transpose(1, 2).reshape(x.shape)


class Mixer(nn.Module):
    """A leaf (no children) whose forward calls SDPA; its class name says nothing of attention."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3 * WIDTH, WIDTH) / math.sqrt(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _attend(x, self.weight, is_causal=True)


class Block(nn.Module):
    """Children of its own (a norm and ``mixers``); optionally attends in its own forward as well."""

    def __init__(self, mixers: int = 1, attends: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mixers = nn.ModuleList(Mixer() for _ in range(mixers))
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False) if attends else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mixer in self.mixers:
            x = x + mixer(self.norm(x))
        if self.qkv is not None:
            x = x + _attend(self.norm(x), self.qkv.weight)
        return x


def _attention_layers(model: nn.Module, **options) -> set[str]:
    """The ``{layer}`` of every ``attention/max_logit@{layer}`` tag of one logging step of ``model``."""
    torch.manual_seed(0)
    with actviz.watch(model, tempfile.mkdtemp(), every=1, **options, statistics=["default", "transformer"]) as viz:
        model(torch.randn(2, 6, WIDTH)).square().mean().backward()
        viz.flush()
        scalars = viz.latest.scalars
    return {tag.split("@")[1] for tag in scalars if tag.startswith("attention/max_logit@")}


# -- naming ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", ["all", ["0.mixers.0", "1.mixers.0"]])
def test_a_leaf_of_any_class_that_calls_sdpa_names_its_calls(layers):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    assert _attention_layers(model, layers=layers) == {"0.mixers.0", "1.mixers.0"}


def test_a_module_with_children_that_calls_sdpa_itself_names_its_call():
    torch.manual_seed(0)
    model = nn.Sequential(Block(mixers=0, attends=True), Block(mixers=0, attends=True))
    assert _attention_layers(model, layers=["0", "1"]) == {"0", "1"}
    # watched leaves (its Linear, LayerNorm) do not enclose the call; no watched module does: sdpa.{i}
    assert _attention_layers(model, layers="all") == {"sdpa.0", "sdpa.1"}


def test_nested_watched_modules_the_innermost_wins():
    torch.manual_seed(0)
    model = nn.Sequential(Block(mixers=2, attends=True))
    names = _attention_layers(model, layers=["0", "0.mixers.0", "0.mixers.1"])
    # each Mixer names its own call (neither is dropped as the block's second call); the block's own call is the block's
    assert names == {"0.mixers.0", "0.mixers.1", "0"}
    # an attention module inside a watched leaf-less wrapper: the attention module is the innermost
    layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 32, dropout=0.0, batch_first=True)
    assert _attention_layers(nn.Sequential(layer), layers=["0", "0.linear1"]) == {"0.self_attn"}


# -- the entropy's ceiling under padding ----------------------------------------------------------------


def test_each_row_is_compared_with_its_own_ceiling():
    """Hand-computed: uniform attention over each row's own keys is a fraction 1, whatever the length."""
    logits = torch.zeros(1, 3, LENGTH)
    for row, length in enumerate(LENGTHS):
        logits[0, row, length:] = -math.inf
    stats = attention_stats(logits)
    _, low, mean, _ = head_numbers(stats)[:, 0].tolist()
    assert low == pytest.approx(math.log(3)) and mean == pytest.approx(sum(map(math.log, LENGTHS)) / 3)
    assert entropy_fractions(stats).tolist() == pytest.approx([1.0])
    # additive masks with a large finite negative (older BERT code, the dtype's lowest) leave keys out too
    for fill in (-1e4, torch.finfo(torch.float32).min):
        masked = torch.zeros(1, 1, LENGTH)
        masked[..., 3:] = fill
        assert entropy_fractions(attention_stats(masked)).tolist() == pytest.approx([1.0])
    # one key taking all the weight is a fraction near 0, in a short row as in a long one
    peaked = torch.full((1, 2, LENGTH), -math.inf)
    peaked[0, 0, :3] = torch.tensor([20.0, 0.0, 0.0])
    peaked[0, 1, :] = 0.0
    peaked[0, 1, 5] = 20.0
    assert entropy_fractions(attention_stats(peaked)).item() < 1e-6


def test_a_padded_sdpa_call_keeps_each_rows_key_count():
    """Through the mode, as SDPA gets it: a (N, 1, 1, S) padding mask and a causal mask together."""
    torch.manual_seed(0)
    q, k = torch.randn(3, HEADS, LENGTH, 8), torch.randn(3, HEADS, LENGTH, 8)
    padding = torch.arange(LENGTH)[None, :] < torch.tensor([5, 16, 9])[:, None]
    with AttentionMode(rows=None) as mode:
        F.scaled_dot_product_attention(q, k, k, attn_mask=padding[:, None, None, :] & torch.ones(
            LENGTH, LENGTH, dtype=torch.bool).tril())
    (_, stats), = mode.calls
    keys = stats[:, 1 + 2 * LENGTH:]  # per row: the keys it may attend (sample 0: 5 of 16, causal)
    assert keys[0].tolist() == [min(row + 1, 5) for row in range(LENGTH)]
    logits = attention_logits(q, k, masks=(padding[:, None, None, :],), is_causal=True, rows=None)
    torch.testing.assert_close(stats, attention_stats(logits))


class PaddedAttention(nn.Module):
    """Self-attention over a padded batch, through SDPA with a padding mask of one of three kinds."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)

    def forward(self, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        mask = kept[:, None, None, :]  # (N, 1, 1, S), True takes part
        if self.kind == "sdpa additive -inf":
            mask = torch.zeros(mask.shape).masked_fill(~mask, -math.inf)
        elif self.kind == "sdpa additive lowest":  # as Hugging Face builds it
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        return _attend(x, self.qkv.weight, mask)


class PaddedModel(nn.Module):
    """Two attention layers with a feed-forward after each, on a batch with its padding mask."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "multihead key_padding_mask":
            self.attention = nn.ModuleList(nn.MultiheadAttention(WIDTH, HEADS, batch_first=True) for _ in range(2))
        else:
            self.attention = nn.ModuleList(PaddedAttention(kind) for _ in range(2))
        self.feed = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        for attention, feed in zip(self.attention, self.feed):
            if self.kind == "multihead key_padding_mask":
                mixed = attention(x, x, x, key_padding_mask=~kept, need_weights=False)[0]
            else:
                mixed = attention(x, kept)
            x = x + mixed
            x = x + torch.relu(feed(x))
        return x


KINDS = ["multihead key_padding_mask", "sdpa bool", "sdpa additive -inf", "sdpa additive lowest"]


def _padded_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lengths 3, 9 and 16 of 16, in an order that changes each step: sample 0, the one measured, changes length."""
    lengths = torch.tensor(LENGTHS).roll(-step)  # sample 0: 3, 9, 16, 3, ...
    kept = torch.arange(LENGTH)[None, :] < lengths[:, None]
    x = torch.randn(3, LENGTH, WIDTH) * kept[..., None]
    return x, kept, x.flip(-1)


def _train(kind: str, steps: int, collapse_at: int | None = None) -> list[actviz.diagnosis.alerts.Alert]:
    torch.manual_seed(0)
    model = PaddedModel(kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    with actviz.watch(model, tempfile.mkdtemp(), every=1, statistics=["default", "transformer"]) as viz:
        for step in range(steps):
            if step == collapse_at:  # queries 100 times larger: each row puts all its weight on one key
                with torch.no_grad():
                    for attention in model.attention:
                        weight = attention.in_proj_weight if isinstance(attention, nn.MultiheadAttention) else (
                            attention.qkv.weight)
                        weight[:WIDTH] *= 100
            x, kept, target = _padded_batch(step)
            loss = ((model(x, kept) - target) ** 2 * kept[..., None]).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        viz.flush()
        return list(viz.alerts)


@pytest.mark.parametrize("kind", KINDS)
def test_a_padded_batch_of_mixed_lengths_raises_no_entropy_collapse(kind):
    alerts = _train(kind, steps=9)
    assert [alert for alert in alerts if alert.rule == "attention_entropy_collapse"] == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_real_collapse_under_padding_still_fires(kind):
    alerts = _train(kind, steps=9, collapse_at=6)
    collapsed = [alert for alert in alerts if alert.rule == "attention_entropy_collapse"]
    # Within the three steps after it: a short sample 0's padding queries (inputs 0) may still attend evenly
    assert {alert.layer for alert in collapsed} == {"attention.0", "attention.1"}, [a.message for a in alerts]
    assert all(6 <= alert.step <= 8 and alert.statistic == "entropy_fraction_min" for alert in collapsed)
