"""A logging step's attention and mixture-of-experts router statistics, and their alerts.

The :class:`~actviz.capture.step_capture.StepCapture` of a stats step calls :meth:`TransformerStep.start`
when it attaches; the step's hooks go into the capture's own hook handles. Until the model's
forward ends, an :class:`~actviz.transformers.attention.AttentionMode` sees its attention calls; forward
pre-hooks and hooks on the attention modules (and the watched modules with children) name
each call after the innermost one enclosing it. Everything stays on the device and goes to
the host in the step's one copy; :func:`finish_on_host` writes the tags on the writer thread:

==========================================  =================================================
``attention/max_logit@{layer}``             largest ``q·k·scale + mask`` of the sampled rows
``attention/entropy_min@{layer}``           lowest head entropy: mean over its sampled rows (nats)
``attention/entropy_mean@{layer}``          mean softmax entropy of the sampled rows, all heads
``attention/sink_fraction@{layer}``         fraction of heads with > 0.3 of their weight on key 0
``attention/head_max_logit@{layer}``        histogram: each head's max logit
``attention/logit_bound@{layer}``           max log-sum-exp of the kernel's rows: ≥ the max logit
``attention/logit_bound_low@{layer}``       that − log(keys): ≤ the max logit
``attention/bound_head@{layer}``            the head with the largest bound
``attention/q_norm_max@{layer}``            that head's largest ‖q‖ (``k_norm_max@``: ‖k‖)
``attention/qk_alignment@{layer}``          bound / (‖q‖max · ‖k‖max · scale) of that head
``attention/head_logit_bound@{layer}``      histogram: each head's bound
==========================================  =================================================

Models with an attention module (``nn.MultiheadAttention``, or a class named ``*Attention*``)
get them on every stats step (``watch(statistics=None)``, the default);
naming ``"attention"`` in ``statistics=`` forces them on (hand-written attention elsewhere), a list without it off.
The same mode sees the routers of a mixture of experts (:mod:`actviz.transformers.moe`), whose
tags are ``moe/load_max_over_mean@{layer}``, ``dead_experts@``, ``router_entropy@``, ``topk_margin@``
and the histogram ``moe/expert_load@{layer}`` (the default set: models with a module whose
class name says MoE, router, gate or expert; ``"moe"`` named, any model; a list without it, off).
Steps that do not log run nothing of this: no mode, no hook. The output logits and the layers'
outliers are per-layer statistics like any other (:mod:`actviz.statistics.logits`,
:mod:`actviz.statistics.outliers`), taken in the step's one layer hook.

Example:
    >>> import tempfile, actviz
    >>> model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)
    >>> with actviz.watch(model, tempfile.mkdtemp(), every=1) as viz:
    ...     model(torch.randn(2, 6, 16)).sum().backward()
    ...     viz.flush()
    >>> sorted(tag for tag in viz.latest.scalars if tag.startswith("attention/"))[:2]
    ['attention/entropy_mean@0.self_attn', 'attention/entropy_min@0.self_attn']
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from ..selection import layer_tag_names
from ..transformers.attention import AttentionMode, attention_modules, may_attend
from ..transformers.attention_stats import bound_numbers, entropy_fractions, head_numbers
from ..transformers.moe import RouterCalls, moe_modules, router_numbers
from .compiled_model import outside_graphs
from ..output.pending_step import PendingStep
from ..common.results import StepResults
from ..common.owned_hooks import HookHandles
from .probe import unwrap_for_probe
from ..common.safe_warnings import warn_once
from ..summaries.one_tensor import finish, reduce_tensor
from ..tags import ATTENTION, MOE
from ..diagnosis.moe_alerts import DeadExperts
from ..diagnosis.transformer_alerts import TransformerAlerts

__all__ = ["SINK_WEIGHT", "TransformerStep", "finish_on_host"]

logger = logging.getLogger(__name__)

#: A head whose mean weight on key 0 is above this counts as an attention sink.
SINK_WEIGHT = 0.3


class _ModelInfo:
    """What a model's steps share, found once: its attention and MoE modules, its alert history."""

    def __init__(self, model: nn.Module) -> None:
        tag_names = layer_tag_names(model)  # every module by its tag name
        self.attention = [(tag_names.get(name, name), module) for name, module in attention_modules(model)]
        # Without the model itself: a topk in its own forward is no router's (Hugging Face's load-balancing
        # loss takes one over every layer's logits), and a value that holds its key would keep the model alive.
        self.moe = [(tag_names.get(name, name), module) for name, module in moe_modules(model) if name]
        self.everything = [(tag_names.get(name, name), module) for name, module in model.named_modules() if name]  # moe=True
        self.alerts = TransformerAlerts()
        self.dead_experts = DeadExperts()
        self.warned: set[str] = set()  # kinds of failure warned about


_models: weakref.WeakKeyDictionary[nn.Module, _ModelInfo] = weakref.WeakKeyDictionary()


def _info(model: nn.Module) -> _ModelInfo:
    info = _models.get(model)
    if info is None:
        info = _models[model] = _ModelInfo(model)
    return info


def _made_by(routers: RouterCalls, name: str, module: nn.Module, args: Any, output: Any) -> None:
    routers.made_by(name, output)


def _enter(mode: AttentionMode, name: str, module: nn.Module, args: Any) -> None:
    mode.enter(name)


def _leave(mode: AttentionMode, name: str, module: nn.Module, args: Any, output: Any) -> None:
    mode.leave(name)


class TransformerStep:
    """The transformer statistics of one stats step, from :meth:`start` to the end of its forward.

    Its hooks (the module stack, the model's output) and the mode itself go into the capture's ``forward`` hook group, so the capture removes them
    with its own when the forward ends or the step finishes.
    """

    def __init__(self, model: nn.Module, info: _ModelInfo, layers: dict[str, nn.Module], pending: PendingStep,
                 options: Any, hooks: HookHandles, attention: bool = True, moe: bool | None = None) -> None:
        self._info = info
        self._pending = pending
        self._options = options
        names = {id(module): name for name, module in layers.items()}
        routers = {True: info.everything, None: info.moe}.get(moe, [])  # the modules that may be routers
        candidates = {names.get(id(module), name) for name, module in routers}
        self._routers = None if moe is False else RouterCalls(None if moe else candidates)
        self._mode = AttentionMode(attention=attention, routers=self._routers)
        self._entered = False
        stacked = {id(module): (names.get(id(module), name), module) for name, module in info.attention}
        stacked.update({id(module): (names.get(id(module), name), module) for name, module in routers
                        if may_attend(module)})  # where a router's topk may run
        stacked.update({id(module): (name, module) for name, module in layers.items() if may_attend(module)})
        for name, module in stacked.values():
            hooks.add("forward", module.register_forward_pre_hook(partial(_enter, self._mode, name)))
            hooks.add("forward", module.register_forward_hook(partial(_leave, self._mode, name), always_call=True))
        if self._routers is not None:
            for name, module in routers:  # the router is the module whose output goes to topk
                made = partial(_made_by, self._routers, names.get(id(module), name))
                hooks.add("forward", module.register_forward_hook(made))
        done = outside_graphs(partial(self._guard, self._forward_done, ""))
        hooks.add("forward", model.register_forward_hook(done, prepend=True, always_call=True))
        hooks.add("forward", self)  # remove() leaves the mode
        self._mode.__enter__()
        self._entered = True

    @classmethod
    def start(cls, model: nn.Module, layers: dict[str, nn.Module], pending: PendingStep, options: Any,
              hooks: HookHandles) -> TransformerStep | None:
        """Start for a stats step of ``model``; ``None`` where ``options.transformer_stats`` and ``options.moe``
        leave it off."""
        wanted, moe = getattr(options, "transformer_stats", None), getattr(options, "moe", None)
        if wanted is False and moe is False:
            return None
        info = _info(unwrap_for_probe(model))  # DDP's and torch.compile's wrapped module
        attention = wanted is True or (wanted is None and bool(info.attention))
        if moe is None and not info.moe:
            moe = False
        if not attention and moe is False:
            return None
        return cls(model, info, layers, pending, options, hooks, attention, moe)

    def _guard(self, function: Callable[..., None], name: str, module: nn.Module, args: Any, output: Any) -> None:
        try:
            function(name, output)
        except Exception as error:  # noqa: BLE001 - statistics must never stop training
            _warn_once(error, self._info.warned)

    def _forward_done(self, name: str, output: Any) -> None:
        """The forward ended (``output`` is ``None`` if it raised): leave the mode and hand the step its work."""
        self.remove()
        routers = self._routers.calls if self._routers is not None else []
        bounds = self._mode.bounds
        carried = ([stats for _, stats in self._mode.calls] + [bound for *_, bound in bounds]
                   + [call.vector for call in routers])
        if carried:
            work = partial(finish_on_host, [name for name, _ in self._mode.calls], self._info, self._pending.bins,
                           routers=[(call.name, call.k) for call in routers],
                           bounds=[(name, keys, scale) for name, keys, scale, _ in bounds])
            self._pending.add_host_work(work, *carried)
        for failed in (self._mode.failed, self._routers and self._routers.failed):
            if failed is not None:
                _warn_once(failed, self._info.warned)
        for name in sorted(self._routers.dense if self._routers is not None else ()):
            warn_once(self._info.warned, f"dense {name}",
                      f"actviz: the router {name!r} chooses every one of its experts (top-k with k equal to the "
                      "number of experts, a dense layer): its load, dead experts and top-k margin mean nothing "
                      f"there, only moe/router_entropy@{name} is written (warned once)")

    def remove(self) -> None:
        """Leave the mode, if still in it. Safe to call more than once."""
        if self._entered:
            self._entered = False
            self._mode.__exit__(None, None, None)


def _warn_once(error: BaseException, warned: set[str]) -> None:
    kind = type(error).__name__
    warn_once(warned, kind, f"actviz: transformer statistics failed, {kind}: {error} (training goes on; warned once)",
              RuntimeWarning, stacklevel=3)
    logger.debug("transformer statistics failed", exc_info=error)


def _histogram(values: torch.Tensor, bins: int) -> Any:
    """The summary of a small host tensor, every element counted (no sample)."""
    return finish(reduce_tensor(values, None), bins)


def _finite(values: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor]) -> float:
    kept = values[torch.isfinite(values)]
    return float(reduce(kept)) if kept.numel() else math.nan


def finish_on_host(calls: list[str], info: _ModelInfo, bins: int, results: StepResults,
                   host: list[torch.Tensor], routers: list[tuple[str, int]] = (),
                   bounds: list[tuple[str, int, float]] = ()) -> None:
    """On the writer thread: the step's tags (see the module docstring), its alerts into ``alerts``.

    If it fails, the step keeps everything else and the failure is warned once.
    """
    try:
        found = iter(host)
        _finish(calls, info.alerts, bins, results, found)
        _finish_bounds(bounds, bins, results, found)
        _finish_routers(routers, info.dead_experts, bins, results, found)
    except Exception as error:  # noqa: BLE001 - the rest of the step must still be written
        _warn_once(error, info.warned)


def _finish_bounds(bounds: list[tuple[str, int, float]], bins: int, results: StepResults, found: Any) -> None:
    """Each call's logit bound from its kernel's log-sum-exp (:func:`~actviz.transformers.attention_stats.bound_numbers`)."""
    for name, keys, scale in bounds:
        numbers, heads = bound_numbers(next(found), keys, scale)
        results.scalars.update({ATTENTION.format(layer=name, statistic=key): value for key, value in numbers.items()})
        results.histograms[ATTENTION.format(layer=name, statistic="head_logit_bound")] = _histogram(heads, bins)


def _finish_routers(routers: list[tuple[str, int]], dead_experts: DeadExperts, bins: int, results: StepResults,
                    found: Any) -> None:
    loads = {}
    for name, k in routers:
        numbers, load = router_numbers(next(found), k)
        results.scalars.update({MOE.format(layer=name, statistic=key): value for key, value in numbers.items()})
        if load is not None:  # no rows, a non-finite router output, a dense router: no load to judge
            loads[name] = load.tolist()
            results.histograms[MOE.format(layer=name, statistic="expert_load")] = _histogram(load, bins)
    if loads:
        results.alerts.extend(dead_experts.check(results.step, loads))


def _finish(calls: list[str], alerts: TransformerAlerts, bins: int, results: StepResults, found: Any) -> None:
    attention = {}
    for name in calls:
        stats = next(found)
        max_logit, _, entropy, sink = head_numbers(stats)  # per head: max, min and mean over rows, sink
        # entropy_min: the most collapsed head. The lowest row would be a causal mask's first rows, which see
        # one or two keys and so have an entropy of at most log 2 however healthy the head is.
        numbers = {"max_logit": _finite(max_logit, torch.amax), "entropy_min": _finite(entropy, torch.amin),
                   "entropy_mean": _finite(entropy, torch.mean),
                   "sink_fraction": float((sink > SINK_WEIGHT).double().mean())}
        # The entropy rule reads each row's entropy over its own row's ceiling: padding changes the ceiling.
        attention[name] = {**numbers, "entropy_fraction_min": _finite(entropy_fractions(stats), torch.amin)}
        results.scalars.update({ATTENTION.format(layer=name, statistic=key): value for key, value in numbers.items()})
        results.histograms[ATTENTION.format(layer=name, statistic="head_max_logit")] = _histogram(max_logit, bins)
    # The outliers' alerts come from their typed values (actviz.diagnosis.step_diagnosis).
    results.alerts.extend(alerts.check(results.step, attention, {}))  # reported by the health monitor
