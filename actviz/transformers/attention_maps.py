"""Attention pictures of the probe: each head's weights as a grid, and attention rollout over a ViT's image.

On image steps with ``watch(..., extras=[actviz.Probe(batch)])``, the probe's forward runs inside an
:class:`~actviz.transformers.attention.AttentionMode` that keeps the whole softmax of probe sample 0
for each attention module (its first ``MAX_POSITIONS`` queries and keys):

* ``attention_maps/{layer}``: one tile per head, queries down, keys across, each tile
  normalised on its own (white: the largest weight of that head);
* ``attention_rollout``: for a ViT (square maps of ``1 + n²`` tokens, a class token first,
  or ``n²``), Abnar & Zuidema's attention rollout, ``R = Π (½·mean_heads(A) + ½·I)`` with
  rows renormalised, over the layers in forward order; the class token's row over the
  ``n × n`` patches (the mean row without a class token) is drawn over the probe image.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from .attention import AttentionMode, attention_logits, attention_modules
from ..pictures.gradcam import gradcam_overlay
from ..common.owned_hooks import HookHandles
from ..pictures.rendering import Picture, draw_grid
from ..selection import layer_tag_names
from ..tags import ATTENTION_MAPS

ROLLOUT = "(rollout)"

__all__ = ["MAX_POSITIONS", "MAX_ROLLOUT_TOKENS", "ProbeMode", "attention_pictures", "draw_heads", "draw_rollout", "record_attention", "rollout"]

#: Queries and keys drawn per map, from position 0.
MAX_POSITIONS = 256
#: Square maps up to this many tokens are kept whole, averaged over the heads, for the rollout (ViT-H/14 at 448 px).
MAX_ROLLOUT_TOKENS = 1025


class ProbeMode(AttentionMode):
    """Keeps, per attention call, the first :data:`MAX_POSITIONS` queries' weights over the first
    :data:`MAX_POSITIONS` keys, ``(heads, ≤256, ≤256)``, and for self-attention over at most
    :data:`MAX_ROLLOUT_TOKENS` tokens its whole map averaged over the heads (in :attr:`rollout_maps`).
    """

    logit_bound = False

    def __init__(self) -> None:
        super().__init__(rows=None)
        self.rollout_maps: list[torch.Tensor] = []

    def reduce(self, query: torch.Tensor, key: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
        length, keys = query.shape[-2], key.shape[-2]
        whole = length == keys <= MAX_ROLLOUT_TOKENS
        if not whole and length > MAX_POSITIONS:  # the first rows only: no (heads, L, S) for a long sequence
            query = query[..., :MAX_POSITIONS, :]
            options = dict(options, masks=[mask[..., :MAX_POSITIONS, :] if mask.dim() >= 2 and mask.shape[-2] > 1
                                           else mask for mask in options.get("masks", ())])
        weights = torch.softmax(attention_logits(query, key, rows=None, **options), dim=-1)
        if whole:
            self.rollout_maps.append(weights.mean(0))
        return weights[:, :MAX_POSITIONS, :MAX_POSITIONS].clone()


def _enter(mode: AttentionMode, name: str, module: nn.Module, args: Any) -> None:
    mode.enter(name)


def _leave(mode: AttentionMode, name: str, module: nn.Module, args: Any, output: Any) -> None:
    mode.leave(name)


@contextlib.contextmanager
def record_attention(model: nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Within it, every attention call of ``model`` leaves ``(module name, (heads, L, S) weights of sample 0)``
    (see :class:`ProbeMode`); at the end, ``("(rollout)", (layers, T, T) head means)`` if there are any.

    Nothing is recorded for a model without an attention module (see
    :func:`~actviz.transformers.attention.attention_modules`).

    Example:
        >>> layer = nn.TransformerEncoderLayer(8, 2, batch_first=True).eval()
        >>> with torch.no_grad(), record_attention(layer) as maps:
        ...     _ = layer(torch.randn(1, 5, 8))
        >>> [(name, tuple(weights.shape)) for name, weights in maps]
        [('self_attn', (2, 5, 5)), ('(rollout)', (1, 5, 5))]
    """
    found: list[tuple[str, torch.Tensor]] = []
    tag_names = layer_tag_names(model)  # the names every tag uses (bert.encoder.layer.0.attention.self -> 0.self)
    modules = [(tag_names.get(name, name), module) for name, module in attention_modules(model)]
    if not modules:
        yield found
        return
    mode = ProbeMode()
    with HookHandles() as handles:
        for name, module in modules:
            handles.add("enter", module.register_forward_pre_hook(partial(_enter, mode, name)))
            handles.add("leave", module.register_forward_hook(partial(_leave, mode, name), always_call=True))
        with mode:
            yield found
    found.extend(mode.calls)
    if mode.rollout_maps and len({tuple(weights.shape) for weights in mode.rollout_maps}) == 1:
        found.append((ROLLOUT, torch.stack(mode.rollout_maps)))


@torch.no_grad()
def draw_heads(weights: torch.Tensor) -> torch.Tensor:
    """A ``(heads, L, S)`` map as a grid of one grayscale tile per head: a ``(1, H, W)`` ``uint8`` image."""
    return draw_grid(weights.float())


def _patch_side(tokens: int) -> tuple[int, int] | None:
    """``(class tokens, side)`` if ``tokens`` is ``1 + n²`` or ``n²``, else ``None``."""
    for extra in (1, 0):
        side = math.isqrt(max(tokens - extra, 0))
        if side > 1 and side * side == tokens - extra:
            return extra, side
    return None


def rollout(head_means: torch.Tensor) -> torch.Tensor | None:
    """Attention rollout over the patches from ``(layers, T, T)`` maps averaged over the heads, in forward
    order: an ``(n, n)`` map in [0, 1], or ``None`` unless ``T`` is ``1 + n²`` or ``n²`` (a ViT's tokens).

    Example:
        >>> uniform = torch.full((2, 5, 5), 0.2)  # two layers; a class token and 2 x 2 patches
        >>> rollout(uniform).tolist()
        [[1.0, 1.0], [1.0, 1.0]]
    """
    tokens = head_means.shape[-1]
    layout = _patch_side(tokens)
    if head_means.dim() != 3 or head_means.shape[-2] != tokens or layout is None:
        return None
    eye = torch.eye(tokens, dtype=torch.float64)
    joint = eye
    for weights in head_means.double():
        mixed = 0.5 * weights + 0.5 * eye
        joint = (mixed / mixed.sum(-1, keepdim=True)) @ joint
    extra, side = layout
    row = joint[0, 1:] if extra else joint.mean(0)
    return (row / row.max().clamp_min(1e-30)).reshape(side, side).float()


def draw_rollout(image: torch.Tensor, head_means: torch.Tensor) -> torch.Tensor:
    """The probe image with the attention rollout of ``head_means`` over it, as Grad-CAM is drawn."""
    found = rollout(head_means)
    assert found is not None  # attention_pictures checked the layout
    return gradcam_overlay(image, found)


def attention_pictures(maps: list[tuple[str, torch.Tensor]], image: torch.Tensor | None) -> list[Picture]:
    """The probe's pictures (what :func:`record_attention` left), as :class:`~actviz.capture.probe.ProbeForward` hands them on."""
    pictures: list[Picture] = [Picture(ATTENTION_MAPS.format(layer=name), draw_heads, (weights,), True)
                               for name, weights in maps if name != ROLLOUT]
    head_means = dict(maps).get(ROLLOUT)
    if image is not None and head_means is not None and rollout(head_means[:1]) is not None:
        pictures.append(Picture("attention_rollout", draw_rollout, (image, head_means), True))
    return pictures
