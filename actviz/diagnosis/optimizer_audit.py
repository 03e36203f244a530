"""The optimizer audit: what is wrong with how the optimizers hold a watched model's parameters, said once.

On the host, over the first optimizer steps that touch the model's parameters (no device work, nothing after):

* ``weight_decay_on_norm``, at the first step of each optimizer: a group with weight decay above 0 holds norm
  weights and biases (any module whose class name has ``Norm``), biases or embeddings (``nn.Embedding``,
  ``nn.EmbeddingBag``), which decay pulls towards zero for no gain in generalisation (the reason nanoGPT's
  ``configure_optimizers`` and the Hugging Face Trainer keep norms and biases in a group without decay). The
  warning names them all; the alert is raised where norm parameters are decayed (biases and embeddings alone:
  the warning only, as nanoGPT decays its embeddings on purpose);
* ``no_gradient``: a parameter an optimizer holds that never gets a gradient: ``requires_grad`` is ``False``
  at the first step (a layer frozen by mistake), or its ``.grad`` is ``None`` after each of the first
  :data:`AUDITED_STEPS` steps of its optimizer (a layer left out of the forward);
* ``not_in_optimizer``: a parameter with a gradient after those steps that no optimizer which stepped holds;
* ``zero_learning_rate``: a group whose learning rate is 0 at its optimizer's first step and still after
  :data:`AUDITED_STEPS` of them (a warm-up from 0 has moved on by then).

Everything is judged at the first optimizer's step number :data:`AUDITED_STEPS` + 1, after that many whole
iterations (a GAN's two optimizers have both stepped): then the audit unsubscribes, and later steps cost
nothing. Each finding is one warning (:func:`~actviz.common.safe_warnings.warn_once`, naming the model, the
parameters by their qualified names, and the fix) and one :class:`~actviz.diagnosis.alerts.Alert`, in
``viz.alerts``, ``on_alert`` and the ``alerts`` text at the next logging step. Any optimizer is read through
``param_groups`` alone (LBFGS, ``ZeroRedundancyOptimizer``, fused and foreach Adam); a group key that is
missing or not a number is skipped, and an error ends the audit with one warning, never the step.

Example:
    >>> import torch, warnings
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    >>> found = []
    >>> audit = OptimizerAudit(model, found.extend)
    >>> optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    >>> with warnings.catch_warnings(record=True):
    ...     warnings.simplefilter("always")
    ...     for _ in range(AUDITED_STEPS + 1):
    ...         model(torch.ones(1, 2)).sum().backward()
    ...         optimizer.step()
    >>> audit.close()
    >>> [(alert.rule, alert.layer) for alert in found]
    [('weight_decay_on_norm', '1.weight')]
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..common.distributed_types import is_norm_by_class_name
from ..common.optimizer_steps import subscribe
from ..common.safe_warnings import warn_once
from .alerts import Alert

__all__ = ["AUDITED_STEPS", "OPTIMIZER_VALUES", "OptimizerAudit", "learning_rates", "parameter_kinds"]

logger = logging.getLogger(__name__)

#: Steps of the first optimizer after which the gradients, the groups' learning rates and the optimizers are judged.
AUDITED_STEPS = 2
#: Names a warning lists before "and N more".
LISTED = 8

#: The fix of weight decay on norms, biases and embeddings, as nanoGPT's ``configure_optimizers`` writes it.
DECAY_FIX = ("put them in a group with weight_decay=0, as nanoGPT's configure_optimizers does:\n"
             "    decay = [p for p in model.parameters() if p.dim() >= 2]\n"
             "    no_decay = [p for p in model.parameters() if p.dim() < 2]\n"
             "    optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1}, "
             "{'params': no_decay, 'weight_decay': 0.0}], lr=lr)\n"
             "(an embedding has 2 dimensions: leave it out of decay by name if you want it undecayed)")


def parameter_kinds(model: nn.Module) -> dict[int, tuple[str, str]]:
    """``id(parameter) -> (qualified name, kind)`` of ``model``'s parameters; kind ``"norm"``, ``"embedding"``,
    ``"bias"`` or ``""``.

    Example:
        >>> kinds = parameter_kinds(nn.Sequential(nn.Embedding(3, 2), nn.Linear(2, 2), nn.LayerNorm(2)))
        >>> sorted(kinds.values())
        [('0.weight', 'embedding'), ('1.bias', 'bias'), ('1.weight', ''), ('2.bias', 'norm'), ('2.weight', 'norm')]
    """
    found: dict[int, tuple[str, str]] = {}
    for prefix, module in model.named_modules():
        if is_norm_by_class_name(module):
            kind = "norm"
        elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            kind = "embedding"
        else:
            kind = ""
        for local, param in module.named_parameters(recurse=False):
            if id(param) not in found:
                name = f"{prefix}.{local}" if prefix else local
                found[id(param)] = (name, kind or ("bias" if local.endswith("bias") else ""))
    return found


def _number(value: Any) -> float | None:
    """A group's ``lr`` or ``weight_decay`` as a float, or ``None`` where reading it would need the device."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1:
        return float(value)
    return None


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:LISTED])
    return f"{shown} and {len(names) - LISTED} more" if len(names) > LISTED else shown


def _group_params(group: dict) -> Iterable[Any]:
    params = group.get("params", ())
    return params if isinstance(params, (list, tuple)) else ()


class OptimizerAudit:
    """Audits the optimizers that step ``model``'s parameters over their first steps (the module docstring says what).

    Args:
        model: The watched model.
        report: Called with the audit's alerts, once, on the training thread.
        current_step: The watcher's step an alert is dated by.
    """

    def __init__(self, model: nn.Module, report: Callable[[list[Alert]], None],
                 current_step: Callable[[], int | None] = lambda: 0) -> None:
        self._model_name = type(model).__name__
        self._model = weakref.ref(model)  # a watcher dropped unclosed keeps no model alive through the audit
        self._kinds = parameter_kinds(model)
        self._report = report
        self._current_step = current_step
        self._said: set[str] = set()
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._first: weakref.ref[torch.optim.Optimizer] | None = None
        self._first_steps = 0
        self._with_gradient: set[int] = set()  # parameters with a .grad after some optimizer's step
        self._zero_rate: dict[tuple[int, int], str] = {}  # (id(optimizer), group) with lr 0 at the first step
        self._subscription: Any = subscribe(self._before, after=self._after)

    def close(self) -> None:
        """Stop auditing (idempotent)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            subscription.remove()

    @property
    def _params(self) -> dict[int, nn.Parameter]:
        """The model's parameters by id, looked up afresh (only during the audit's few steps)."""
        model = self._model()
        if model is None:
            self.close()
            return {}
        return {id(param): param for param in model.parameters()}

    def _seen(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(ref() is optimizer for ref in self._optimizers)

    def _before(self, optimizer: torch.optim.Optimizer) -> None:
        if self._subscription is None:
            return
        try:
            if self._seen(optimizer):
                if self._first is not None and self._first() is optimizer:
                    self._first_steps += 1
                    if self._first_steps >= AUDITED_STEPS:
                        self.close()
                        self._judge()
                return
            groups = list(getattr(optimizer, "param_groups", ()))
            if not any(id(param) in self._kinds for group in groups for param in _group_params(group)):
                return
            self._optimizers.append(weakref.ref(optimizer))
            if self._first is None:
                self._first = weakref.ref(optimizer)
            self._first_look(optimizer, groups)
        except Exception as error:  # noqa: BLE001 - an audit must never stop training
            self._fail(error)

    def _after(self, optimizer: torch.optim.Optimizer) -> None:
        if self._subscription is None or not self._seen(optimizer):
            return
        try:
            self._with_gradient.update(key for key, param in self._params.items() if param.grad is not None)
        except Exception as error:  # noqa: BLE001
            self._fail(error)

    def _first_look(self, optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
        """At an optimizer's first step: weight decay on norms, biases and embeddings; frozen parameters it holds;
        groups at learning rate 0 (judged later)."""
        params = self._params
        kind_names: dict[str, list[str]] = {"norm": [], "bias": [], "embedding": []}
        decays: set[float] = set()
        frozen: list[str] = []
        for index, group in enumerate(groups):
            decay = _number(group.get("weight_decay", 0.0))
            rate = _number(group.get("lr"))
            held = [key for key in map(id, _group_params(group)) if key in self._kinds]
            if rate == 0.0 and held:
                self._zero_rate[(id(optimizer), index)] = f"group {index} of {type(optimizer).__name__}"
            for key in held:
                name, kind = self._kinds[key]
                if decay and decay > 0 and kind:
                    kind_names[kind].append(name)
                    decays.add(decay)
                if key in params and not params[key].requires_grad:
                    frozen.append(name)
        found = []
        decayed = [name for names in kind_names.values() for name in names]
        if decayed:
            counts = ", ".join(f"{len(names)} {kind}" for kind, names in kind_names.items() if names)
            message = (f"{type(optimizer).__name__} applies weight decay {', '.join(f'{d:g}' for d in sorted(decays))} "
                       f"to {counts} parameter(s) of {self._model_name}: {_listed(decayed)}; decay pulls them towards "
                       f"zero for no gain: {DECAY_FIX}")
            # an alert where it shrinks a norm's gain and shift; biases and embeddings alone (nanoGPT decays its
            # embeddings on purpose) are the warning's only
            found.append(self._finding("weight_decay_on_norm", kind_names["norm"] or decayed, message,
                                       alert=bool(kind_names["norm"])))
        if frozen:
            message = (f"{type(optimizer).__name__} holds {len(frozen)} parameter(s) of {self._model_name} that never get "
                       f"a gradient (requires_grad is False): {_listed(frozen)}; a layer frozen by mistake? Call "
                       "requires_grad_(True) on it, or leave it out of the optimizer if it is frozen on purpose")
            found.append(self._finding("no_gradient", frozen, message))
        self._hand_on(found)

    def _judge(self) -> None:
        """After :data:`AUDITED_STEPS` steps of the first optimizer: gradients no optimizer takes, parameters that
        got none, groups still at learning rate 0."""
        held: dict[int, str] = {}  # id(parameter) -> its optimizer's class name
        groups_at_zero = []
        for ref in self._optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            for index, group in enumerate(getattr(optimizer, "param_groups", ())):
                for param in _group_params(group):
                    held.setdefault(id(param), type(optimizer).__name__)
                label = self._zero_rate.get((id(optimizer), index))
                if label is not None and _number(group.get("lr")) == 0.0:
                    names = [self._kinds[key][0] for key in map(id, _group_params(group)) if key in self._kinds]
                    groups_at_zero.append((label, names))
        found = []
        params = self._params
        orphans = [self._kinds[key][0] for key in params if key in self._with_gradient and key not in held]
        if orphans:
            message = (f"{len(orphans)} parameter(s) of {self._model_name} get a gradient that no optimizer applies: "
                       f"{_listed(orphans)}; they never change. Add them to the optimizer (a parameter group "
                       "forgotten?), or call requires_grad_(False) on them if they are frozen on purpose")
            found.append(self._finding("not_in_optimizer", orphans, message))
        starved = [self._kinds[key][0] for key in held if key in params
                   and params[key].requires_grad and key not in self._with_gradient]
        if starved:
            message = (f"{len(starved)} parameter(s) of {self._model_name} held by an optimizer got no gradient in its "
                       f"first {AUDITED_STEPS} steps: {_listed(starved)}; a layer left out of the forward, or its "
                       "output detached? Use it, or leave it out of the optimizer")
            found.append(self._finding("no_gradient", starved, message))
        for label, names in groups_at_zero:
            message = (f"{label} has learning rate 0 after {AUDITED_STEPS} steps: its {len(names)} parameter(s) of "
                       f"{self._model_name} never change: {_listed(names)}; give the group a learning rate (a "
                       "scheduler that starts at 0 has moved on by then)")
            found.append(self._finding("zero_learning_rate", names, message))
        self._hand_on(found)

    def _finding(self, rule: str, names: list[str], message: str, alert: bool = True) -> tuple[Alert, bool]:
        step = self._current_step()
        return Alert(0 if step is None else step, rule, names[0], "optimizer", float(len(names)), 0.0, message), alert

    def _hand_on(self, found: list[tuple[Alert, bool]]) -> None:
        fresh = [alert for alert, raised in found
                 if warn_once(self._said, (alert.rule, alert.layer), f"actviz: {alert.message}", stacklevel=4) and raised]
        if fresh:
            self._report(fresh)

    def _fail(self, error: BaseException) -> None:
        self.close()
        warn_once(self._said, "failed", f"actviz: the optimizer audit of {self._model_name} failed and stops, "
                  f"{type(error).__name__}: {error} (training goes on)")
        logger.debug("optimizer audit failed", exc_info=error)


#: ``results.layer_values[OPTIMIZER_VALUES][param]``: the learning rate of the optimizer group that applied the
#: step's gradients to ``param``, and the ``torch.finfo(dtype).eps`` of its float format (what ``frozen_parameter`` reads).
OPTIMIZER_VALUES = "optimizer"

def learning_rates(optimizer: torch.optim.Optimizer, named: Sequence[tuple[str, nn.Parameter]]) -> dict[str, dict[str, float]]:
    """``{name: {"learning_rate": lr, "float_eps": eps}}`` of each of ``named`` that ``optimizer`` holds, its
    group's ``lr`` a number (a tensor on the CPU too; one on an accelerator is left out: reading it would wait for it).

    Example:
        >>> layer = nn.Linear(2, 1).to(torch.bfloat16)
        >>> learning_rates(torch.optim.SGD([layer.weight], lr=0.1), list(layer.named_parameters()))
        {'weight': {'learning_rate': 0.1, 'float_eps': 0.0078125}}
    """
    ids = {id(param): (name, param) for name, param in named}
    found = {}
    for group in getattr(optimizer, "param_groups", ()):
        rate = group.get("lr") if isinstance(group, dict) else None
        if isinstance(rate, torch.Tensor) and rate.device.type == "cpu" and rate.numel() == 1:
            rate = float(rate)
        if not isinstance(rate, (int, float)) or isinstance(rate, bool):
            continue
        for param in group.get("params", ()):
            entry = ids.get(id(param))
            if entry is not None and entry[1].is_floating_point():
                found[entry[0]] = {"learning_rate": float(rate), "float_eps": torch.finfo(entry[1].dtype).eps}
    return found
