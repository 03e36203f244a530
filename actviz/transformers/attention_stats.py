"""Attention statistics from a call's own ``q`` and ``k``: pure tensor functions, on the device, no host sync.

:class:`~actviz.transformers.attention.AttentionMode` calls them for each attention call of a logging forward. For
each call they recompute a sample of attention rows:

* batch element 0, all heads, ``rows`` (64) query positions ``1, 1+s, 1+2s, ...`` with
  ``s = ceil((L-1) / rows)`` (position 0 only when ``L = 1``: under a causal mask row 0
  sees key 0 alone, so its entropy is 0 and its sink weight 1 by construction);
* logits ``q·kᵀ·scale`` with the call's scale (default ``1/sqrt(E)``), its causal flag
  (top-left aligned, as SDPA), its boolean mask (True takes part) or additive mask, and its
  grouped-query layout (``enable_gqa``: query head ``h`` reads key head ``h // (H / Hk)``).

:func:`attention_stats` keeps, per head, the max logit (the largest ``q·k·scale + mask``
over the sampled rows and the keys they may attend to) and, per sampled row, ``Σ p log p``,
the weight on key 0 (the attention sink) and the number of keys the row may attend (its
logits above :data:`LEFT_OUT`: a padding or causal mask leaves the others out). It stays on the
device (no host sync), takes about ten kernels per call, and goes to the host with the rest
of the step, where :func:`head_numbers` makes per head the max logit, the minimum and mean
softmax entropy (nats) of the sampled rows, and their mean weight on key 0, and
:func:`entropy_fractions` each head's entropy as a fraction of its rows' own ceilings
``log(keys attended)``: the measure that compares like with like when padding gives
rows different numbers of keys.

Example:
    >>> q = torch.randn(1, 2, 5, 4)
    >>> tuple(attention_stats(attention_logits(q, q, rows=4)).shape)  # max logit; per row: entropy, sink, keys
    (2, 13)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "DEFAULT_ROWS", "LEFT_OUT", "STATS", "attention_logits", "attention_stats", "bound_numbers", "entropy_fractions",
    "head_numbers", "logit_bound", "sampled_rows",
]

#: Query rows sampled per call.
DEFAULT_ROWS = 64
#: The rows of :func:`attention_stats`' result.
STATS = ("max_logit", "entropy_min", "entropy_mean", "sink_weight")
#: A key whose logit is at or below this counts as left out of its row. Additive masks use ``-inf``, ``-10⁴``
#: (older BERT code) or the dtype's lowest value (Hugging Face); a trained head's logits stay far above it.
LEFT_OUT = -1000.0

_causal_cache: dict[tuple[int, int, int, int, torch.device], torch.Tensor] = {}  # a few (rows, keys) masks
_infinities: dict[torch.device, torch.Tensor] = {}  # -inf on each device, for torch.where without a new tensor
_zeros: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # baddbmm's ignored input (beta=0)


def _minus_infinity(device: torch.device) -> torch.Tensor:
    # One float32 element, not a 0-dim tensor: torch.where then promotes low-precision logits to float32 itself.
    if device not in _infinities:
        _infinities[device] = torch.full((1,), -math.inf, device=device)
    return _infinities[device]


def _zero(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if (device, dtype) not in _zeros:
        _zeros[(device, dtype)] = torch.zeros((), device=device, dtype=dtype)
    return _zeros[(device, dtype)]


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
    """``(rows, keys)`` bool, True where a sampled query at position ``i`` may see key ``j`` (``j <= i``); cached."""
    key = (length, keys, rows.start, rows.step, device)
    mask = _causal_cache.get(key)
    if mask is None:
        if len(_causal_cache) > 64:
            _causal_cache.clear()
        positions = torch.arange(rows.start, length, rows.step, device=device)
        mask = _causal_cache[key] = torch.arange(keys, device=device)[None, :] <= positions[:, None]
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
    factor = 1.0 / math.sqrt(width) if scale is None else float(scale)
    zero = _zero(q.device, q.dtype)
    if heads != kv_heads and kv_heads > 1:
        if not enable_gqa or heads % kv_heads:
            raise ValueError(f"query has {heads} heads and key {kv_heads}: give enable_gqa=True with H % Hk == 0")
        group = heads // kv_heads
        logits = torch.baddbmm(zero, q.reshape(kv_heads, group * q.shape[1], width), k.transpose(-2, -1),
                               beta=0, alpha=factor)
        logits = logits.view(heads, q.shape[1], keys)
    else:  # one kernel for the product and the scale
        logits = torch.baddbmm(zero, q, k.expand(heads, keys, width).transpose(-2, -1), beta=0, alpha=factor)
    if is_causal:
        logits = torch.where(_causal(length, keys, sampled, logits.device), logits, _minus_infinity(logits.device))
    for mask in masks:
        if batched and mask.dim() >= query.dim():  # it has the batch dimension: take element 0's
            mask = mask[(0,) * (mask.dim() - query.dim() + 1)]
        if mask.dim() >= 2 and mask.shape[-2] > 1:
            mask = mask[..., sampled, :]
        if mask.dtype == torch.bool:
            logits = torch.where(mask, logits, _minus_infinity(logits.device))
        else:
            logits = logits + mask
    if logits.dtype != torch.float32:  # low precision with no float32 mask to promote it
        logits = logits.float()
    return logits


@torch.no_grad()
def attention_stats(logits: torch.Tensor) -> torch.Tensor:
    """The device half: per head of ``(heads, R, S)`` logits, one row ``[max logit, Σp·log p of each
    sampled row, the weight on key 0 of each sampled row, the keys each sampled row may attend]``,
    shape ``(heads, 1 + 3R)``.

    Six kernels after the logits; :func:`head_numbers` and :func:`entropy_fractions` finish it on the host.
    """
    probabilities = torch.softmax(logits, dim=-1)
    negentropy = torch.special.xlogy(probabilities, probabilities).sum(dim=-1)
    attended = (logits > LEFT_OUT).sum(dim=-1, dtype=negentropy.dtype)
    return torch.cat([logits.amax(dim=(-2, -1))[:, None], negentropy, probabilities[..., 0], attended], dim=1)


def _rows(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(entropy, sink weight, keys attended)`` per head and sampled row, in float64."""
    stats = stats.double()
    rows = (stats.shape[1] - 1) // 3
    return -stats[:, 1 : 1 + rows], stats[:, 1 + rows : 1 + 2 * rows], stats[:, 1 + 2 * rows :]


def head_numbers(stats: torch.Tensor) -> torch.Tensor:
    """The host half of :func:`attention_stats`: ``(4, heads)`` rows named by :data:`STATS`, in float64.

    A row whose entropy is NaN (every key masked) is left out of the minimum and the mean.

    Example:
        >>> stats = head_numbers(attention_stats(torch.zeros(2, 3, 4)))  # uniform over 4 keys
        >>> [round(v, 4) for v in stats[:, 0].tolist()]   # max logit, entropy min and mean (log 4), sink
        [0.0, 1.3863, 1.3863, 0.25]
    """
    entropy, sink, _ = _rows(stats)
    finite = torch.isfinite(entropy)
    counts = finite.sum(-1)
    low = torch.where(finite, entropy, math.inf).amin(-1)
    mean = torch.where(finite, entropy, 0.0).sum(-1) / counts
    return torch.stack([stats[:, 0].double(), torch.where(counts > 0, low, math.nan), mean, sink.nanmean(-1)])


def entropy_fractions(stats: torch.Tensor) -> torch.Tensor:
    """Per head, the mean over its sampled rows of each row's entropy over its own ceiling, ``log(keys the row
    may attend)``: 1 for uniform attention, 0 when one key takes all the weight, in float64.

    A row that may attend one key (or none) has no ceiling to compare with and is left out; a head with no
    row left is NaN. Under padding or a causal mask, rows see different numbers of keys: the fraction
    compares them on one scale where the entropy in nats does not.

    Example:
        >>> logits = torch.zeros(1, 2, 4)
        >>> logits[0, 0, 2:] = -math.inf   # row 0 attends 2 keys, uniformly: log 2 of log 2
        >>> logits[0, 1] = torch.tensor([9.0, -9.0, -9.0, -9.0])  # row 1: nearly all on key 0
        >>> [round(v, 3) for v in entropy_fractions(attention_stats(logits)).tolist()]   # the mean of 1 and 0
        [0.5]
    """
    entropy, _, attended = _rows(stats)
    fraction = entropy / attended.log()
    kept = torch.isfinite(fraction) & (attended > 1)
    counts = kept.sum(-1)
    mean = torch.where(kept, fraction, 0.0).sum(-1) / counts
    return torch.where(counts > 0, mean, math.nan)


@torch.no_grad()
def logit_bound(query: torch.Tensor, key: torch.Tensor, logsumexp: torch.Tensor) -> torch.Tensor:
    """The device half of the logit bound, from an SDPA kernel's own ``(N, H, L, E)`` query and ``(N, Hk, S, E)`` key
    and its log-sum-exp of each query row's logits, ``(N, H, L)`` (an efficient kernel's padded rows cut off):
    per head, over every batch element and row, ``[max LSE, max ‖q‖, max ‖k‖]``, a float32 ``(3, H)`` tensor.

    The log-sum-exp is what the kernel wrote anyway; the norms read ``q`` and ``k`` once each. Five kernels and a
    stack; no sync.

    Example:
        >>> q, k = torch.zeros(1, 2, 3, 4), torch.ones(1, 1, 5, 4)
        >>> logit_bound(q, k, torch.full((1, 2, 3), math.log(5))).tolist()[1:]   # ‖q‖ = 0, ‖k‖ = 2
        [[0.0, 0.0], [2.0, 2.0]]
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    rows = logsumexp.reshape(logsumexp.shape[0], logsumexp.shape[1], -1)[..., : query.shape[-2]]
    largest = rows.amax(dim=(0, 2)).float()
    q_norm = torch.linalg.vector_norm(query, dim=-1, dtype=torch.float32).amax(dim=(0, 2))
    k_norm = torch.linalg.vector_norm(key, dim=-1, dtype=torch.float32).amax(dim=(0, 2))
    if kv_heads != heads:  # grouped queries: query head h reads key head h // (H / Hk)
        k_norm = k_norm.repeat_interleave(heads // kv_heads)
    return torch.stack([largest, q_norm, k_norm])


def bound_numbers(bound: torch.Tensor, keys: int, scale: float) -> tuple[dict[str, float], torch.Tensor]:
    """The host half of :func:`logit_bound` for a call with ``keys`` keys and ``scale``: its scalars and each head's
    upper bound, in float64.

    Each row's log-sum-exp bounds its largest logit, ``LSE − log(keys) ≤ max ≤ LSE``, so over the call the largest
    logit ``M`` lies in ``[max LSE − log S, max LSE]`` (``logit_bound_low``, ``logit_bound``). And ``M ≤ max‖q‖ ·
    max‖k‖ · scale``: of the head with the largest bound (``bound_head``), ``q_norm_max`` and ``k_norm_max`` say
    which of q and k grew, and ``qk_alignment = max LSE / (max‖q‖ · max‖k‖ · scale)`` how far the two point the
    same way (at most 1 but for the LSE's excess over the max, ``log S`` at most).

    Example:
        >>> bound = torch.tensor([[2.0, 9.0], [1.0, 3.0], [1.0, 2.0]])   # head 1: LSE 9, ‖q‖ 3, ‖k‖ 2
        >>> numbers, heads = bound_numbers(bound, 4, 1.0)
        >>> numbers["bound_head"], numbers["qk_alignment"], round(numbers["logit_bound_low"], 3)
        (1.0, 1.5, 7.614)
    """
    bound = bound.double()
    upper, q_norm, k_norm = bound
    finite = torch.where(torch.isnan(upper), -math.inf, upper)
    head = int(finite.argmax())
    top = float(upper[head])
    product = float(q_norm[head] * k_norm[head]) * scale
    return {"logit_bound": top, "logit_bound_low": top - math.log(max(keys, 1)), "bound_head": float(head),
            "q_norm_max": float(q_norm[head]), "k_norm_max": float(k_norm[head]),
            "qk_alignment": top / product if product > 0 else math.nan}, upper
