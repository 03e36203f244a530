"""Attention health from ``F.scaled_dot_product_attention``, with no model edit.

:class:`AttentionMode` is a ``torch.overrides.TorchFunctionMode`` entered only for a logging
forward. It sees every call of ``F.scaled_dot_product_attention`` (Hugging Face ``sdpa``
models, timm, hand-written code) and of ``F.multi_head_attention_forward``
(``nn.MultiheadAttention``, torchvision's ViT, ``nn.TransformerEncoderLayer``), and for
each call recomputes a sample of attention rows from the call's own ``q`` and ``k``
(:mod:`actviz.transformers.attention_stats`: which rows, the logits with the call's scale, mask and
grouped-query layout, and the per-head numbers). This module finds the calls and the
attention modules; the numbers are made there. The same mode tells a mixture of experts'
:class:`~actviz.transformers.moe.RouterCalls` of the softmax and topk calls it sees.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..common._internals import attention_kernels
from .attention_stats import DEFAULT_ROWS, attention_logits, attention_stats, logit_bound
from .moe import ROUTER_FUNCTIONS, RouterCalls
from ..summaries.one_tensor import local_shard

__all__ = ["AttentionMode", "KernelCalls", "attention_modules", "is_attention_module", "may_attend", "mha_call", "sdpa_call"]

logger = logging.getLogger(__name__)

_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MHA_SIGNATURE = inspect.signature(_MHA)


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


_FUSED_KERNELS, _DispatchMode = attention_kernels()


class KernelCalls(_DispatchMode):
    """Entered for one attention call: ``found`` is then ``(query, key, scale, logsumexp)`` of the first fused SDPA
    kernel it ran, whose log-sum-exp the kernel returned anyway, or ``None`` (the math backend computes none).

    Example:
        >>> q = torch.randn(1, 2, 3, 4)
        >>> with KernelCalls() as calls:
        ...     _ = F.scaled_dot_product_attention(q, q, q)
        >>> tuple(calls.found[3].shape) if calls.found is not None else "math backend"
        (1, 2, 3)
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: tuple[torch.Tensor, torch.Tensor, float | None, torch.Tensor] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if self.found is None and func in _FUSED_KERNELS:
            query, key, logsumexp = args[0], args[1], result[1]
            # Plain (N, H, L, E) tensors only (a tensor subclass's op could wait on other ranks); an empty
            # log-sum-exp was not asked for (the efficient kernel without a gradient).
            if (all(type(tensor) is torch.Tensor for tensor in (query, key, logsumexp)) and logsumexp.numel()
                    and query.dim() == key.dim() == 4 and logsumexp.dim() >= 3):
                self.found = (query, key, (kwargs or {}).get("scale"), logsumexp)
        return result


def _may_fuse(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call may run a fused kernel, which returns a log-sum-exp: not with dropout on a CPU, where
    SDPA takes the math backend (whose ops would then run inside :class:`KernelCalls` for nothing)."""
    if func is _SDPA:
        bound = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
        dropout, query = bound.get("dropout_p", 0.0), bound.get("query")
    else:
        call = _MHA_SIGNATURE.bind(*args, **kwargs)
        dropout = call.arguments.get("dropout_p", 0.0) if call.arguments.get("training", True) else 0.0
        query = call.arguments.get("query")
    return not (dropout and isinstance(query, torch.Tensor) and query.device.type == "cpu")


def is_attention_module(module: torch.nn.Module) -> bool:
    """``nn.MultiheadAttention``, or a module whose class name contains ``Attention`` (any case)."""
    return isinstance(module, torch.nn.MultiheadAttention) or "attention" in type(module).__name__.lower()


def may_attend(module: torch.nn.Module) -> bool:
    """Whether ``module``'s own forward may call attention: any module but a leaf of ``torch.nn``'s own
    classes (``Linear``, ``LayerNorm``, ``Dropout``...), which never does. A subclass of one, defined
    elsewhere, may.

    Example:
        >>> class Mixer(torch.nn.Module):  # a leaf whose forward calls scaled_dot_product_attention
        ...     pass
        >>> may_attend(Mixer()), may_attend(torch.nn.Linear(2, 2)), may_attend(torch.nn.Sequential(torch.nn.ReLU()))
        (True, False, True)
    """
    if next(iter(module.children()), None) is not None:
        return True
    return not type(module).__module__.startswith("torch.nn.")


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
        attention: Whether to keep the attention calls' statistics.
        routers: Told of every call of :data:`~actviz.transformers.moe.ROUTER_FUNCTIONS` (softmax, topk and the
            ops between them) with its result and the innermost named module: a mixture of experts' routers.

    Calls are named by :meth:`enter`/:meth:`leave` (forward pre-hooks and hooks push and pop
    the enclosing modules' names); a call outside every named module is ``sdpa.{i}``. A name
    called again in the same forward keeps its first call, as layers do. A call leaves what
    :meth:`reduce` makes of it (:mod:`actviz.transformers.attention_maps` keeps the probe's weights).

    Example:
        >>> q = torch.randn(1, 2, 6, 4)
        >>> with AttentionMode() as mode:
        ...     mode.enter("attn")
        ...     _ = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        >>> [(name, tuple(stats.shape)) for name, stats in mode.calls]   # 2 heads, rows 1 to 5
        [('attn', (2, 16))]
    """

    #: Whether to keep each call's logit bound, from its kernel's log-sum-exp (:func:`logit_bound`).
    logit_bound = True

    def __init__(self, rows: int | None = DEFAULT_ROWS, attention: bool = True,
                 routers: RouterCalls | None = None) -> None:
        super().__init__()
        self.rows = rows
        self.attention = attention
        self.routers = routers
        self.calls: list[tuple[str, torch.Tensor]] = []
        #: Per call whose kernel returned a log-sum-exp: its name, its keys, its scale and :func:`logit_bound`.
        self.bounds: list[tuple[str, int, float, torch.Tensor]] = []
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
        if (func is _SDPA or func is _MHA) and self.attention and self.failed is None:
            name = self._record(func, args, kwargs)
            if name is not None and self.logit_bound and _may_fuse(func, args, kwargs):
                with KernelCalls() as kernels:
                    result = func(*args, **kwargs)
                self._bound(name, kernels.found)
                return result
        if self.routers is not None and func in ROUTER_FUNCTIONS:
            result = func(*args, **kwargs)
            self.routers.see(func, args, kwargs, result, self._stack[-1] if self._stack else None)
            return result
        return func(*args, **kwargs)

    def reduce(self, query: torch.Tensor, key: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
        """What one call leaves: :func:`attention_stats` of its sampled rows."""
        return attention_stats(attention_logits(query, key, rows=self.rows, **options))

    def _record(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """Keep the call's sampled rows' statistics; its name, or ``None`` for a name already called."""
        if self._stack:
            name = self._stack[-1]
        else:
            name, self._unnamed = f"sdpa.{self._unnamed}", self._unnamed + 1
        if name in self._names:
            return None
        self._names.add(name)
        try:
            with torch.no_grad():
                call = sdpa_call(args, kwargs) if func is _SDPA else mha_call(args, kwargs)
                if call is None:
                    return name
                # DTensors' local shards: an op on a DTensor could wait on a collective other ranks never run
                query, key = local_shard(call[0]), local_shard(call[1])
                options = dict(call[2], masks=[local_shard(mask) for mask in call[2].get("masks", ())])
                self.calls.append((name, self.reduce(query, key, options)))
        except Exception as error:
            self.failed = error
            logger.debug("attention statistics failed for %s", name, exc_info=True)
        return name

    def _bound(self, name: str, found: tuple[torch.Tensor, torch.Tensor, float | None, torch.Tensor] | None) -> None:
        """Keep the logit bound of the call's kernel (:func:`logit_bound`), where its kernel returned a log-sum-exp."""
        if found is None:
            return
        try:
            with torch.no_grad():
                query, key, scale, logsumexp = found
                self.bounds.append((name, key.shape[-2], scale if scale is not None else query.shape[-1] ** -0.5,
                                    logit_bound(query, key, logsumexp)))
        except Exception:  # the bound only is lost: the sampled rows' statistics are kept
            logger.debug("attention logit bound failed for %s", name, exc_info=True)
