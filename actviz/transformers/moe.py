"""Mixture-of-experts router health, from the ``torch.topk`` calls of a logging forward.

A **router** is a module whose output's last dimension is the experts and whose output, or its
softmax, goes to ``torch.topk`` during the forward. :class:`RouterCalls` is told, by the
:class:`~actviz.transformers.attention.AttentionMode` of a logging forward, of the calls in
:data:`ROUTER_FUNCTIONS` and their results:

* a softmax over the last dimension, and the ops that keep the last dimension and the values
  (``float``, ``to``, ``view``, ``reshape``, ``flatten``...), carry their input's origin: the
  module whose output it was (told by :meth:`RouterCalls.made_by`, a forward hook) and whether
  it is a softmax's output (probabilities);
* a ``torch.topk(x, k, dim=-1)`` (largest, ``0 < k < experts``) is a router's call. Its router is
  **the module whose output** ``x`` **was made from**, where a module made it (a hand-written
  ``logits = self.router(h)``, an ``nn.Linear``, then softmax and topk in the block's forward),
  **else the innermost running module** (Hugging Face's ``MixtralTopKRouter``,
  ``Qwen2MoeTopKRouter`` and ``OlmoeTopKRouter`` call softmax and topk in their own forward).
  The probabilities are ``x`` where ``x`` is a softmax's output; ``x`` normalized where it is scores
  (a sigmoid's output, or probabilities or scores edited by an add or a ``masked_fill``: Ernie 4.5's
  bias, DeepSeek-V2's group mask); else ``softmax(x)`` in float32 (:func:`_what_topk_saw`).
  Of a router's calls in one forward the first over the most experts is kept (DeepSeek-V3's
  router takes a topk over groups of experts before the one over every expert); a call named after
  the innermost module over fewer experts than a later one of a router inside it is dropped;
* a ``max(x, dim=-1)`` of a module's output, or in a candidate named router or gate, is a top-1 router's call
  (Phi-3.5-MoE's ``sparsemixer``).

With ``watch(moe=None)`` (the default) only the modules whose class name says MoE, router,
gate or expert (:func:`is_moe_module`), and the modules inside them, can be routers, the model
itself excepted (Hugging Face's load-balancing loss takes a topk over every layer's logits in
the model's forward); with ``moe=True`` any module can, and a topk outside every module is
``topk.{i}``.

Each call leaves one float32 vector of ``experts + 2`` numbers on the device, with no host
sync (:func:`router_vector`): the tokens that chose each expert, then the sums over tokens
of the softmax entropy and of the gap between the k-th and (k+1)-th probability.
:func:`router_numbers` turns it into the logged values on the writer thread.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ROUTER_FUNCTIONS", "RouterCall", "RouterCalls", "is_moe_module", "moe_modules", "router_numbers", "router_vector",
]

_MOE_NAME = re.compile(r"(?i:moe|router|expert)|(?:^|(?<=[^a-z]))[Gg]ate(?!d)")  # not Aggregate, not GatedMLP
_ROUTER_NAME = re.compile(r"(?i:router|gate)")
_TOPK = frozenset({torch.topk, torch.Tensor.topk})
_MAX = frozenset({torch.max, torch.Tensor.max})  # Phi-3.5-MoE's sparsemixer routes with max(dim=-1)
_SOFTMAX = frozenset({F.softmax, torch.softmax, torch.Tensor.softmax})
_SIGMOID = frozenset({torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, torch.special.expit})
#: Ops that edit scores before the topk: a bias added (Ernie 4.5, DeepSeek-V3), a mask (DeepSeek-V2's groups).
_EDITS = frozenset({
    torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add, torch.add, torch.Tensor.__sub__,
    torch.Tensor.sub, torch.sub, torch.Tensor.masked_fill, torch.masked_fill, torch.Tensor.__iadd__,
    torch.Tensor.add_, torch.Tensor.__isub__, torch.Tensor.sub_, torch.Tensor.masked_fill_,
})
#: What a tracked tensor holds: logits (softmax them), probabilities (a softmax's output, rows sum to 1), or scores
#: (a sigmoid's output, or probabilities or scores edited: nonnegative weights whose rows need not sum to 1).
LOGITS, PROBABILITIES, SCORES = "logits", "probabilities", "scores"
#: Ops that keep a tensor's values and its last dimension: the router's output through them is still its output.
_SAME_VALUES = frozenset({
    torch.Tensor.float, torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.view, torch.Tensor.reshape,
    torch.reshape, torch.Tensor.flatten, torch.flatten, torch.Tensor.contiguous, torch.Tensor.detach,
})
#: The calls :class:`RouterCalls` is told of; every other op passes through the mode untouched.
ROUTER_FUNCTIONS = _TOPK | _MAX | _SOFTMAX | _SIGMOID | _EDITS | _SAME_VALUES


def is_moe_module(module: nn.Module) -> bool:
    """Whether the class name says MoE, router, gate or expert (``*MoE*``, ``*Moe*``, ``*Router*``,
    ``*Gate*``, ``*Expert*``); ``Gate`` as a word: not ``Aggregate``, not ``GatedMLP``.

    Example:
        >>> class TopKGate(nn.Linear): pass
        >>> class Aggregate(nn.Module): pass
        >>> is_moe_module(TopKGate(2, 2)), is_moe_module(Aggregate()), is_moe_module(nn.Linear(2, 2))
        (True, False, False)
    """
    return _MOE_NAME.search(type(module).__name__) is not None


def moe_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that may be routers with ``moe=None``: each MoE-named module and every module inside it,
    by ``named_modules()`` name (the model itself is ``""``).

    Example:
        >>> class SparseMoeBlock(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.router = nn.Linear(4, 8)
        >>> [name for name, _ in moe_modules(nn.Sequential(nn.Linear(4, 4), SparseMoeBlock()))]
        ['1', '1.router']
    """
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if is_moe_module(module):
            found.update(module.named_modules(prefix=name))
    return list(found.items())


def router_vector(probabilities: torch.Tensor, indices: torch.Tensor, k: int) -> torch.Tensor:
    """One router call on the device: ``experts + 2`` float32 numbers, no host sync.

    ``[tokens per expert..., Σ entropy, Σ (p_k - p_{k+1})]``: how many rows chose each expert among
    their ``k``, then the sums over rows of the softmax entropy (nats) and of the gap between the
    k-th and (k+1)-th largest probability (0 where ``k`` is every expert): 10 kernels, none of which waits for
    the device. A non-finite router output makes the entropy's sum NaN, which :func:`router_numbers` reads.

    Example:
        >>> p = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3]])
        >>> router_vector(p, p.topk(1).indices, 1)
        tensor([2.0000, 0.0000, 0.0000, 1.9276, 0.5000])
    """
    experts = probabilities.shape[-1]
    p = probabilities.detach().reshape(-1, experts).float()
    chosen = indices.reshape(-1)
    out = torch.zeros(experts + 2, device=p.device)
    out.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=out.dtype))
    top = torch.topk(p, min(k + 1, experts), dim=-1).values
    margin = (top[:, k - 1] - top[:, k]).sum() if k < experts else top.new_zeros(())
    out[experts:] = torch.stack([torch.special.entr(p).sum(), margin])
    return out


def router_numbers(vector: torch.Tensor, k: int) -> tuple[dict[str, float], torch.Tensor | None]:
    """On the host: ``({statistic: value}, tokens per expert)`` of a :func:`router_vector`.

    ``load_max_over_mean`` is the busiest expert's tokens over the mean (1 when balanced, ``experts / k``
    when every row chooses the same ``k``), ``dead_experts`` the experts no row chose, ``router_entropy`` and
    ``topk_margin`` the means over rows.

    What no longer means anything is left out, and the load is ``None``: everything for a call of no rows; the
    load, ``load_max_over_mean`` and ``dead_experts`` where the router's output was not finite (a NaN's topk
    picks the same experts whatever the router learned: no routing collapse to report); all but
    ``router_entropy`` for a dense router (``k`` is every expert: each row chooses all of them).

    Example:
        >>> numbers, load = router_numbers(torch.tensor([3.0, 1.0, 0.0, 0.0, 2.4, 0.8], dtype=torch.float64), 1)
        >>> numbers
        {'load_max_over_mean': 3.0, 'dead_experts': 2.0, 'router_entropy': 0.6, 'topk_margin': 0.2}
        >>> router_numbers(torch.tensor([3.0, 1.0, 0.0, 0.0, math.nan, 0.5]), 1)
        ({'router_entropy': nan, 'topk_margin': 0.125}, None)
        >>> router_numbers(torch.zeros(6), 1)
        ({}, None)
    """
    load = vector[:-2].double()
    rows = float(load.sum()) / k
    if not rows:
        return {}, None
    entropy, margin = float(vector[-2]) / rows, float(vector[-1]) / rows
    if k >= len(load):
        return {"router_entropy": entropy}, None
    if not math.isfinite(entropy):
        return {"router_entropy": entropy, "topk_margin": margin}, None
    return {
        "load_max_over_mean": float(load.max()) / float(load.mean()),
        "dead_experts": float((load == 0).sum()),
        "router_entropy": entropy,
        "topk_margin": margin,
    }, load


class RouterCall:
    """One router's call of a forward: its name, its ``k`` and its :func:`router_vector` on the device."""

    __slots__ = ("name", "k", "vector")

    def __init__(self, name: str, k: int, vector: torch.Tensor) -> None:
        self.name, self.k, self.vector = name, k, vector


class RouterCalls:
    """The router calls of one logging forward (see the module docstring for the rule).

    Args:
        candidates: The names that may be routers (``moe=None``: :func:`moe_modules` but the model itself), or
            ``None`` for any (``moe=True``).

    Example:
        >>> calls = RouterCalls(None)
        >>> logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 1.0, -2.0]])
        >>> calls.made_by("block.router", logits)                     # the router's forward hook
        >>> probs = torch.softmax(logits, -1)
        >>> calls.see(torch.softmax, (logits, -1), {}, probs, "block")
        >>> calls.see(torch.topk, (probs, 2), {}, probs.topk(2), "block")
        >>> [(call.name, call.k, call.vector[:4].tolist()) for call in calls.calls]
        [('block.router', 2, [1.0, 1.0, 2.0, 0.0])]
    """

    def __init__(self, candidates: set[str] | None) -> None:
        self.candidates = candidates
        self.calls: list[RouterCall] = []
        self.failed: BaseException | None = None
        self.dense: set[str] = set()  # routers whose topk takes every expert (k == experts)
        # id(tensor) -> (weak reference to it, the module whose output it was or None, LOGITS, PROBABILITIES or SCORES)
        self._origins: dict[int, tuple[weakref.ref[torch.Tensor], str | None, str]] = {}
        self._kept: dict[str, int] = {}  # router -> its call's place in calls
        self._innermost: set[str] = set()  # routers named after the innermost running module (their input's unknown)
        self._unnamed = 0

    def made_by(self, name: str, output: Any) -> None:
        """A module's forward hook: ``output`` (its first tensor) was made by the module ``name``."""
        first = output
        if isinstance(output, (tuple, list)):  # Hugging Face's routers return (logits, weights, indices)
            first = next((item for item in output if isinstance(item, torch.Tensor)), None)
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            origin = self._origin(first)  # a router that returns its softmax (or scores): still what it was
            self._remember(first, name, origin[1] if origin else LOGITS)

    def see(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
            innermost: str | None) -> None:
        """One call of :data:`ROUTER_FUNCTIONS` and its ``result``; ``innermost``: the innermost running module."""
        if self.failed is not None:
            return
        try:
            source = args[0] if args else kwargs.get("input", kwargs.get("self"))
            if func in _EDITS and len(args) > 1 and self._origin(args[1]) is not None \
                    and (not isinstance(source, torch.Tensor) or self._origin(source) is None):
                source = args[1]  # bias + scores
            if not isinstance(source, torch.Tensor) or source.dim() == 0:
                return
            if func in _TOPK:
                self._topk(source, args, kwargs, result, innermost)
            elif func in _MAX:
                self._max(source, args, kwargs, result, innermost)
            elif isinstance(result, torch.Tensor) and result.dim() > 0 and result.shape[-1] == source.shape[-1]:
                origin = self._origin(source)
                if func in _SOFTMAX and _last_dimension(args, kwargs, source.dim()):
                    self._remember(result, origin[0] if origin else None, PROBABILITIES)
                elif func in _SIGMOID:
                    self._remember(result, origin[0] if origin else None, SCORES)
                elif origin is not None and func in _EDITS:  # edited probabilities are scores; logits stay logits
                    self._remember(result, origin[0], LOGITS if origin[1] == LOGITS else SCORES)
                elif origin is not None and func not in _SOFTMAX:
                    self._remember(result, *origin)
        except Exception as error:  # noqa: BLE001 - kept and warned once by the step; training goes on
            self.failed = error

    def _remember(self, tensor: torch.Tensor, name: str | None, kind: str) -> None:
        self._origins[id(tensor)] = (weakref.ref(tensor), name, kind)

    def _origin(self, tensor: Any) -> tuple[str | None, str] | None:
        found = self._origins.get(id(tensor))
        if found is None or found[0]() is not tensor:  # an id reused by a tensor made since
            return None
        return found[1], found[2]

    def _topk(self, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
              innermost: str | None) -> None:
        k = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        if largest and isinstance(k, int) and isinstance(result, tuple) and len(result) == 2:
            self._call(x, k, dim, result[1], innermost)

    def _max(self, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any,
             innermost: str | None) -> None:
        """``x.max(dim=-1)``: a top-1 router's call, where ``x`` is a module's output, or inside a router candidate
        named router or gate (Phi-3.5-MoE's ``PhimoeTopKRouter`` calls ``sparsemixer`` on its own logits)."""
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if isinstance(dim, int) and isinstance(result, tuple) and len(result) == 2 and x.shape[-1] > 1:
            origin = self._origin(x)
            in_router = (innermost is not None and self.candidates is not None and innermost in self.candidates
                         and _ROUTER_NAME.search(innermost.rsplit(".", 1)[-1]) is not None)
            if (origin is not None and origin[0] is not None) or in_router:  # not every max over a last dim routes
                self._call(x, 1, dim, result[1], innermost)

    def _call(self, x: torch.Tensor, k: int, dim: Any, indices: torch.Tensor, innermost: str | None) -> None:
        """A top-``k`` choice over ``x``'s last dimension, with the ``indices`` chosen: a router's call."""
        experts = x.shape[-1]
        if not 0 < k <= experts or dim not in (-1, x.dim() - 1) or not x.is_floating_point():
            return
        origin = self._origin(x)
        name = origin[0] if origin and origin[0] is not None else innermost
        if name is None:
            if self.candidates is not None:
                return
            name, self._unnamed = f"topk.{self._unnamed}", self._unnamed + 1
        elif self.candidates is not None and name not in self.candidates:
            return
        if origin and origin[0] is not None:
            self._drop_group_choices(name, experts)
        else:
            self._innermost.add(name)
        kept = self._kept.get(name)
        if kept is not None and self.calls[kept].vector.numel() >= experts + 2:
            return
        with torch.no_grad():
            call = RouterCall(name, k, router_vector(_what_topk_saw(x, origin[1] if origin else LOGITS), indices, k))
        if k == experts:  # every expert chosen by every row: a dense layer, named once by the step
            self.dense.add(name)
        if kept is None:
            self._kept[name] = len(self.calls)
            self.calls.append(call)
        else:  # a topk over groups of experts came first (DeepSeek-V3's group-limited routing)
            self.calls[kept] = call


    def _drop_group_choices(self, name: str, experts: int) -> None:
        """Drop the calls over fewer experts named after a module around router ``name`` for want of a source: a
        choice of groups of experts before the choice over every expert (DeepSeek-V2's group-limited greedy)."""
        dropped = [kept for kept in self._innermost if name.startswith(f"{kept}.") and kept in self._kept
                   and self.calls[self._kept[kept]].vector.numel() < experts + 2]
        if dropped:
            self.calls = [call for call in self.calls if call.name not in dropped]
            self._kept = {call.name: index for index, call in enumerate(self.calls)}
            self.dense.difference_update(dropped)


def _what_topk_saw(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The distribution of a router's choice over its experts: a softmax's output as it is, logits' softmax in
    float32, and scores (a sigmoid's, or probabilities with a bias added or a mask) normalized to sum to 1 per row,
    negative ones as 0: the choice topk made, with no second softmax.

    Example:
        >>> _what_topk_saw(torch.tensor([[0.6, 0.2, 0.0, 0.2]]), SCORES)  # probabilities with one expert masked
        tensor([[0.6000, 0.2000, 0.0000, 0.2000]])
        >>> _what_topk_saw(torch.tensor([[0.9, 0.3, 0.3, 0.3]]), SCORES)  # sigmoid scores
        tensor([[0.5000, 0.1667, 0.1667, 0.1667]])
    """
    x = x.detach()
    if kind == PROBABILITIES:
        return x
    if kind == LOGITS:
        return torch.softmax(x.float(), dim=-1)
    scores = x.float().clamp(min=0.0)
    return scores / scores.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


def _last_dimension(args: tuple[Any, ...], kwargs: dict[str, Any], dims: int) -> bool:
    """Whether a softmax call's ``dim`` is the last one (``F.softmax``'s implicit dim as it picks it)."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:
        dim = 0 if dims in (0, 1, 3) else 1
    return isinstance(dim, int) and dim in (-1, dims - 1)
