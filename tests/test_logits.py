"""Output-logit health against torch.logsumexp and entropy by hand, and read back from the event files."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
from torch import nn

import actviz
from actviz.statistics.logits import find_logits, last_linear_width, logit_vector


@pytest.mark.parametrize("shape", [(4, 10), (2, 5, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_vector_against_hand_computed(shape, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(shape) * 4).to(dtype)
    rows = logits.double().reshape(-1, shape[-1])
    log_z = torch.logsumexp(rows, -1)
    entropy = [-sum(math.exp(v - z) * (v - z) for v in row.tolist()) for row, z in zip(rows, log_z.tolist())]
    found = logit_vector(logits).tolist()
    assert found[0] == pytest.approx(rows.max().item(), rel=1e-6)
    assert found[1] == pytest.approx(log_z.mean().item(), rel=1e-5)
    assert found[2] == pytest.approx(sum(entropy) / len(entropy), rel=1e-5)


def test_masked_vocabulary_entries_are_not_nan():
    logits = torch.tensor([[0.0, -math.inf, 0.0]])
    assert logit_vector(logits).tolist() == pytest.approx([0.0, math.log(2), math.log(2)])


def test_which_outputs_are_logits():
    head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    assert last_linear_width(head) == 5
    assert find_logits(torch.zeros(3, 5), 5) is not None
    assert find_logits(torch.zeros(3, 16), 5) is None  # a hidden state, not the head's classes
    assert find_logits(torch.zeros(5), 5) is None  # no class dimension
    assert find_logits(torch.zeros(3, 5, dtype=torch.long), 5) is None
    assert find_logits((torch.zeros(3, 5),), 5) is None
    assert find_logits({"logits": torch.zeros(2, 3, 9)}, None).shape == (2, 3, 9)


class Classifier(nn.Module):
    """A tiny attention classifier: self-attention over tokens, mean-pooled, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 6)

    def forward(self, x):
        mixed, _ = self.attention(x, x, x, need_weights=False)
        return self.head(mixed.mean(1))


def test_logit_tags_read_back(read_run):
    torch.manual_seed(0)
    model, log_dir = Classifier(), tempfile.mkdtemp()
    x = torch.randn(4, 5, 8)
    with actviz.watch(model, log_dir, every=1, options=actviz.Options(strict=True)):
        logits = model(x)
        logits.sum().backward()
    rows = logits.detach().double()
    log_z = torch.logsumexp(rows, -1)
    p = torch.softmax(rows, -1)
    run = read_run(log_dir)
    assert run.scalar("logits/max", 0) == pytest.approx(rows.max().item(), rel=1e-6)
    assert run.scalar("logits/logsumexp", 0) == pytest.approx(log_z.mean().item(), rel=1e-5)
    assert run.scalar("logits/entropy", 0) == pytest.approx(-(p * p.log()).sum(-1).mean().item(), rel=1e-5)


def test_transformer_stats_false_logs_none_of_them(read_run):
    model, log_dir = Classifier(), tempfile.mkdtemp()
    with actviz.watch(model, log_dir, every=1, statistics=["moments", "dead_channels", "saturation"]):
        model(torch.randn(2, 3, 8)).sum().backward()
    run = read_run(log_dir)
    assert not [tag for tag in run.scalar_tags if tag.startswith(("logits/", "attention/")) or "max_abs" in tag]
    assert "activation_stats/mean@head" in run.scalar_tags


def test_vocabulary_sized_logits_are_reduced_rows_at_a_time_with_the_same_numbers(monkeypatch):
    import actviz.statistics.logit_rows as logit_rows

    torch.manual_seed(0)
    values = torch.randn(2, 50, 300) * 4
    whole = logit_vector(values)
    monkeypatch.setattr(logit_rows, "PIECE", 1_000)  # three rows of 300 classes at a time: 34 pieces
    pieces = logit_vector(values)
    x = values.double().reshape(-1, 300)
    log_z = torch.logsumexp(x, -1)
    entropy = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
    assert torch.allclose(whole, pieces, rtol=1e-6)
    assert pieces.tolist() == pytest.approx([x.max().item(), log_z.mean().item(), entropy.mean().item()], rel=1e-5)
