"""Attention pictures of the probe, against maps and rollout computed by hand."""

from __future__ import annotations

import tempfile

import numpy as np
import torch
from test_attention import tiny_vit
from torch import nn

import actviz
from actviz.transformers.attention_maps import rollout
from actviz.pictures.gradcam import gradcam_overlay
from actviz.pictures.rendering import draw_grid


def vit_weights_by_hand(model, image):
    """Each encoder block's attention weights of sample 0, (heads, L, L), recomputed in float64 from its input."""
    inputs = {}
    hooks = [block.ln_1.register_forward_hook(lambda m, a, out, i=i: inputs.__setitem__(i, out.detach()))
             for i, block in enumerate(model.encoder.layers)]
    with torch.no_grad():
        model.eval()(image)
    for hook in hooks:
        hook.remove()
    found = []
    for i, block in enumerate(model.encoder.layers):
        attention = block.self_attention
        x = inputs[i][0].double()
        w_q, w_k, _ = attention.in_proj_weight.double().chunk(3)
        b_q, b_k, _ = attention.in_proj_bias.double().chunk(3)
        heads, width = attention.num_heads, attention.head_dim
        q = (x @ w_q.T + b_q).view(-1, heads, width).transpose(0, 1)
        k = (x @ w_k.T + b_k).view(-1, heads, width).transpose(0, 1)
        found.append(torch.softmax(q @ k.transpose(-2, -1) / width**0.5, -1).detach())
    return found


def hand_rollout(maps):
    tokens = maps[0].shape[-1]
    joint = np.eye(tokens)
    for weights in maps:
        mixed = 0.5 * weights.mean(0).numpy() + 0.5 * np.eye(tokens)
        joint = (mixed / mixed.sum(-1, keepdims=True)) @ joint
    row = joint[0, 1:]
    side = int(round((tokens - 1) ** 0.5))
    return torch.from_numpy(row / row.max()).reshape(side, side).float()


def test_vit_probe_draws_each_heads_map_and_the_rollout(read_run):
    model, log_dir = tiny_vit(), tempfile.mkdtemp()
    torch.manual_seed(5)
    probe = torch.randn(1, 3, 16, 16)
    with actviz.watch(model, log_dir, every=1, extras=[actviz.Probe(probe)], options=actviz.Options(strict=True)):
        model(torch.randn(2, 3, 16, 16)).square().mean().backward()
    expected = vit_weights_by_hand(tiny_vit(), probe)  # the same initial weights: the probe ran before the update
    run = read_run(log_dir)
    for i, weights in enumerate(expected):
        picture = run.image(f"attention_maps/encoder_layer_{i}.self_attention", 0)
        by_hand = draw_grid(weights.float())[0].numpy()
        assert picture.shape[:2] == by_hand.shape
        assert np.abs(picture.astype(int) - by_hand.astype(int)).max() <= 1
    overlay = run.image("attention_rollout", 0)
    by_hand = gradcam_overlay(probe[0], hand_rollout(expected)).permute(1, 2, 0).numpy()
    assert np.abs(overlay.astype(int) - by_hand.astype(int)).max() <= 1


def test_rollout_needs_square_vit_maps():
    assert rollout(torch.full((2, 6, 6), 1 / 6)) is None  # 6 tokens: neither n² nor 1 + n²
    assert rollout(torch.full((2, 4, 9), 1 / 9)) is None  # cross-attention
    assert rollout(torch.full((1, 4, 4), 0.25)).shape == (2, 2)  # 2 x 2 patches, no class token


def test_text_model_probe_draws_maps_but_no_rollout(read_run):
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    model, log_dir = nn.Sequential(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), nn.Linear(8, 3)), tempfile.mkdtemp()
    with actviz.watch(model, log_dir, every=1, extras=[actviz.Probe(torch.randn(1, 7, 8))],
        options=actviz.Options(strict=True)):
        model(torch.randn(2, 7, 8)).sum().backward()
    run = read_run(log_dir)
    assert "attention_maps/0.0.self_attn" in run.image_tags
    assert "attention_rollout" not in run.image_tags
    assert run.image("attention_maps/0.0.self_attn", 0).shape[:2] == draw_grid(torch.rand(2, 7, 7))[0].shape


def test_a_long_sequence_keeps_its_first_rows_and_keys_only():
    import torch.nn.functional as F
    from test_attention import brute_force

    from actviz.transformers.attention_maps import MAX_POSITIONS, ProbeMode

    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 1100, 4), torch.randn(1, 2, 1100, 4)
    with ProbeMode() as mode:
        F.scaled_dot_product_attention(q, k, k, is_causal=True)
        mode.enter("square")
        F.scaled_dot_product_attention(q[:, :, :300], k[:, :, :300], k[:, :, :300])
    (long_name, long_weights), (square_name, square_weights) = mode.calls
    _, expected = brute_force(q, k, is_causal=True)  # every row over every key, then the corner
    assert long_weights.shape == (2, MAX_POSITIONS, MAX_POSITIONS)
    torch.testing.assert_close(long_weights.double(), expected[:, :MAX_POSITIONS, :MAX_POSITIONS], atol=1e-6, rtol=1e-5)
    assert square_weights.shape == (2, MAX_POSITIONS, MAX_POSITIONS)
    (head_mean,) = mode.rollout_maps  # only the square map of at most 1025 tokens, whole
    _, square = brute_force(q[:, :, :300], k[:, :, :300])
    torch.testing.assert_close(head_mean.double(), square.mean(0), atol=1e-6, rtol=1e-5)
