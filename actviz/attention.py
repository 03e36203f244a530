"""Attention health from ``F.scaled_dot_product_attention``, with no model edit.

:class:`AttentionMode` is a ``torch.overrides.TorchFunctionMode`` entered only for a logging
forward. It sees every call of ``F.scaled_dot_product_attention`` (Hugging Face ``sdpa``
models, timm, hand-written code) and of ``F.multi_head_attention_forward``
(``nn.MultiheadAttention``, torchvision's ViT, ``nn.TransformerEncoderLayer``), and for
each call recomputes a sample of attention rows from the call's own ``q`` and ``k``:

* batch element 0, all heads, ``rows`` (64) query positions ``1, 1+s, 1+2s, ...`` with
  ``s = ceil((L-1) / rows)`` (position 0 only when ``L = 1``: under a causal mask row 0
  sees key 0 alone, so its entropy is 0 and its sink weight 1 by construction);
* logits ``q·kᵀ·scale`` with the call's scale (default ``1/sqrt(E)``), its causal flag
  (top-left aligned, as SDPA), its boolean mask (True takes part) or additive mask, and its
  grouped-query layout (``enable_gqa``: query head ``h`` reads key head ``h // (H / Hk)``).

:func:`attention_stats` keeps, per head, the max logit (the largest ``q·k·scale + mask``
over the sampled rows and the keys they may attend to) and, per sampled row, ``Σ p log p``
and the weight on key 0 (the attention sink). It stays on the device (no host sync), takes
about ten kernels per call, and goes to the host with the rest of the step, where
:func:`head_numbers` makes per head the max logit, the minimum and mean softmax entropy
(nats) of the sampled rows, and their mean weight on key 0.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .summaries import local_shard

__all__ = [
    "DEFAULT_ROWS", "STATS", "AttentionMode", "attention_logits", "attention_modules", "attention_stats", "head_numbers",
    "is_attention_module", "sampled_rows",
]

logger = logging.getLogger(__name__)

#: Query rows sampled per call.
DEFAULT_ROWS = 64
#: The rows of :func:`attention_stats`' result.
STATS = ("max_logit", "entropy_min", "entropy_mean", "sink_weight")

_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MHA_SIGNATURE = inspect.signature(_MHA)
_causal_cache: dict[tuple[int, int, int, int, torch.device], torch.Tensor] = {}  # a few (rows, keys) masks
_infinities: dict[torch.device, torch.Tensor] = {}  # -inf on each device, for torch.where without a new tensor


def _minus_infinity(device: torch.device) -> torch.Tensor:
    if device not in _infinities:
        _infinities[device] = torch.tensor(-math.inf, device=device)
    return _infinities[device]


def sampled_rows(length: int, rows: int | None) -> slice:
    """The query positions sampled from ``length``: every ``s``-th from 1 (see the module docstring).

    Example:
        >>> sampled_rows(200, 64), sampled_rows(10, 64), sampled_rows(1, 64), sampled_rows(10, None)
        (slice(1, None, 4), slice(1, None, 1), slice(0, None, 1), slice(0, None, 1))
    """
    if rows is None or length == 1:
        return slice(0, None, 1)
    return slice(1, None, max(1, -(-(length - 1) // rows)))


def _causal(length: int, keys: int, rows: slice, device: torch.device) -> torch.Tensor:
    """``(rows, keys)`` bool, True where a sampled query at position ``i`` may not see key ``j`` (``j > i``); cached."""
    key = (length, keys, rows.start, rows.step, device)
    mask = _causal_cache.get(key)
    if mask is None:
        if len(_causal_cache) > 64:
            _causal_cache.clear()
        positions = torch.arange(rows.start, length, rows.step, device=device)
        mask = _causal_cache[key] = torch.arange(keys, device=device)[None, :] > positions[:, None]
    return mask


@torch.no_grad()
def attention_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    masks: Sequence[torch.Tensor] = (),
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    rows: int | None = DEFAULT_ROWS,
) -> torch.Tensor:
    """Attention logits of batch element 0 for sampled query rows: a float32 ``(heads, R, S)`` tensor.

    Args:
        query: ``(N, H, L, E)`` (or ``(N, L, E)``, ``(L, E)``: one head) as SDPA takes it.
        key: ``(N, Hk, S, E)`` likewise.
        masks: SDPA masks broadcastable to ``(N, H, L, S)``: boolean (True takes part) or additive.
        is_causal: SDPA's causal flag (top-left aligned).
        scale: SDPA's scale; ``None`` for ``1/sqrt(E)``.
        enable_gqa: ``H`` query heads share ``Hk`` key heads in groups of ``H // Hk``.
        rows: Most query rows (:func:`sampled_rows`); ``None`` for every row.

    Example:
        >>> q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8)
        >>> attention_logits(q, k, rows=5).shape   # rows 1, 3, 5, 7, 9
        torch.Size([4, 5, 10])
    """
    batched = query.dim() >= 3
    q = query[(0,) * (query.dim() - 3)] if query.dim() > 3 else (query[0][None] if batched else query[None])
    k = key[(0,) * (key.dim() - 3)] if key.dim() > 3 else (key[0][None] if batched else key[None])
    length, keys, width = q.shape[-2], k.shape[-2], q.shape[-1]
    sampled = sampled_rows(length, rows)
    q = q[:, sampled]
    heads, kv_heads = q.shape[0], k.shape[0]
    if heads != kv_heads and kv_heads > 1:
        if not enable_gqa or heads % kv_heads:
            raise ValueError(f"query has {heads} heads and key {kv_heads}: give enable_gqa=True with H % Hk == 0")
        group = heads // kv_heads
        logits = torch.bmm(q.reshape(kv_heads, group * q.shape[1], width), k.transpose(-2, -1))
        logits = logits.view(heads, q.shape[1], keys)
    else:
        logits = torch.bmm(q, k.expand(heads, keys, width).transpose(-2, -1))
    factor = 1.0 / math.sqrt(width) if scale is None else float(scale)
    logits = logits.float().mul_(factor) if logits.dtype != torch.float32 else logits.mul_(factor)
    if is_causal:
        logits.masked_fill_(_causal(length, keys, sampled, logits.device), -math.inf)
    for mask in masks:
        if batched and mask.dim() >= query.dim():  # it has the batch dimension: take element 0's
            mask = mask[(0,) * (mask.dim() - query.dim() + 1)]
        if mask.dim() >= 2 and mask.shape[-2] > 1:
            mask = mask[..., sampled, :]
        if mask.dtype == torch.bool:
            logits = torch.where(mask, logits, _minus_infinity(logits.device))
        else:
            logits = logits + mask
    return logits


@torch.no_grad()
def attention_stats(logits: torch.Tensor) -> torch.Tensor:
    """The device half: per head of ``(heads, R, S)`` logits, one row ``[max logit, Σp·log p of each
    sampled row, the weight on key 0 of each sampled row]``, shape ``(heads, 1 + 2R)``.

    Four kernels after the logits; :func:`head_numbers` finishes it on the host.
    """
    probabilities = torch.softmax(logits, dim=-1)
    negentropy = torch.special.xlogy(probabilities, probabilities).sum(dim=-1)
    return torch.cat([logits.amax(dim=(-2, -1))[:, None], negentropy, probabilities[..., 0]], dim=1)


def head_numbers(stats: torch.Tensor) -> torch.Tensor:
    """The host half of :func:`attention_stats`: ``(4, heads)`` rows named by :data:`STATS`, in float64.

    A row whose entropy is NaN (every key masked) is left out of the minimum and the mean.

    Example:
        >>> stats = head_numbers(attention_stats(torch.zeros(2, 3, 4)))  # uniform over 4 keys
        >>> [round(v, 4) for v in stats[:, 0].tolist()]   # max logit, entropy min and mean (log 4), sink
        [0.0, 1.3863, 1.3863, 0.25]
    """
    stats = stats.double()
    rows = (stats.shape[1] - 1) // 2
    entropy, sink = -stats[:, 1 : 1 + rows], stats[:, 1 + rows :]
    finite = torch.isfinite(entropy)
    counts = finite.sum(-1)
    low = torch.where(finite, entropy, math.inf).amin(-1)
    mean = torch.where(finite, entropy, 0.0).sum(-1) / counts
    return torch.stack([stats[:, 0], torch.where(counts > 0, low, math.nan), mean, sink.nanmean(-1)])


def sdpa_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``(query, key, attention_logits keyword arguments)`` of one ``scaled_dot_product_attention`` call."""
    bound = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
    mask = bound.get("attn_mask")
    return bound["query"], bound["key"], {
        "masks": () if mask is None else (mask,), "is_causal": bool(bound.get("is_causal", False)),
        "scale": bound.get("scale"), "enable_gqa": bool(bound.get("enable_gqa", False)),
    }


def mha_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None:
    """The same for ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``), its projections of
    batch element 0 recomputed; ``None`` where it adds keys of its own (``bias_k``, ``add_zero_attn``, ``static_k``).
    """
    call = _MHA_SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    a = call.arguments  # every argument, by name
    if a["bias_k"] is not None or a["add_zero_attn"] or a["static_k"] is not None:
        return None
    query, key, heads = a["query"], a["key"], a["num_heads"]
    batched = query.dim() == 3  # (L, N, E): batch_first was undone by the module
    q0, k0 = (query[:, 0], key[:, 0]) if batched else (query, key)
    width = q0.shape[-1]
    if a["use_separate_proj_weight"]:
        w_q, w_k = a["q_proj_weight"], a["k_proj_weight"]
    else:
        w_q, w_k = a["in_proj_weight"][:width], a["in_proj_weight"][width : 2 * width]
    bias = a["in_proj_bias"]
    b_q, b_k = (None, None) if bias is None else (bias[:width], bias[width : 2 * width])
    q = F.linear(q0, w_q, b_q).view(q0.shape[0], heads, -1).transpose(0, 1)[None]  # (1, H, L, E / H)
    k = F.linear(k0, w_k, b_k).view(k0.shape[0], heads, -1).transpose(0, 1)[None]
    masks = []
    for mask, padding in ((a["attn_mask"], False), (a["key_padding_mask"], True)):
        if mask is None:
            continue
        if padding and batched:
            mask = mask[0]
        mask = mask.view(1, 1, -1) if padding else (mask[:heads] if mask.dim() == 3 else mask)
        masks.append(~mask if mask.dtype == torch.bool else mask)  # MHA's True means "left out"
    return q, k, {"masks": masks}


def is_attention_module(module: torch.nn.Module) -> bool:
    """``nn.MultiheadAttention``, or a module whose class name contains ``Attention`` (any case)."""
    return isinstance(module, torch.nn.MultiheadAttention) or "attention" in type(module).__name__.lower()


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's attention modules, by ``named_modules()`` name.

    Example:
        >>> [name for name, _ in attention_modules(torch.nn.TransformerEncoderLayer(8, 2))]
        ['self_attn']
    """
    return [(name, module) for name, module in model.named_modules() if is_attention_module(module)]


class AttentionMode(TorchFunctionMode):
    """Sees every attention call of one logging forward and keeps its statistics, on the device.

    Args:
        rows: Query rows sampled per call (:func:`attention_logits`).

    Calls are named by :meth:`enter`/:meth:`leave` (forward pre-hooks and hooks push and pop
    the enclosing modules' names); a call outside every named module is ``sdpa.{i}``. A name
    called again in the same forward keeps its first call, as layers do. A call leaves what
    :meth:`reduce` makes of it (:mod:`actviz.attention_maps` keeps the probe's weights).

    Example:
        >>> q = torch.randn(1, 2, 6, 4)
        >>> with AttentionMode() as mode:
        ...     mode.enter("attn")
        ...     _ = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> [(name, tuple(stats.shape)) for name, stats in mode.calls]   # 2 heads, rows 1 to 5
        [('attn', (2, 11))]
    """

    def __init__(self, rows: int | None = DEFAULT_ROWS) -> None:
        super().__init__()
        self.rows = rows
        self.calls: list[tuple[str, torch.Tensor]] = []
        self.failed: BaseException | None = None
        self._stack: list[str] = []
        self._names: set[str] = set()
        self._unnamed = 0

    def enter(self, name: str) -> None:
        self._stack.append(name)

    def leave(self, name: str) -> None:
        if self._stack and self._stack[-1] == name:
            self._stack.pop()

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if (func is _SDPA or func is _MHA) and self.failed is None:
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def reduce(self, query: torch.Tensor, key: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
        """What one call leaves: :func:`attention_stats` of its sampled rows."""
        return attention_stats(attention_logits(query, key, rows=self.rows, **options))

    def _record(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._stack:
            name = self._stack[-1]
        else:
            name, self._unnamed = f"sdpa.{self._unnamed}", self._unnamed + 1
        if name in self._names:
            return
        self._names.add(name)
        try:
            with torch.no_grad():
                call = sdpa_call(args, kwargs) if func is _SDPA else mha_call(args, kwargs)
                if call is None:
                    return
                # DTensors' local shards: an op on a DTensor could wait on a collective other ranks never run
                query, key = local_shard(call[0]), local_shard(call[1])
                options = dict(call[2], masks=[local_shard(mask) for mask in call[2].get("masks", ())])
                self.calls.append((name, self.reduce(query, key, options)))
        except Exception as error:
            self.failed = error
            logger.debug("attention statistics failed for %s", name, exc_info=True)
