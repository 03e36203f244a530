"""One optimizer step pre-hook (and one post-hook) for the whole process, registered once and never removed.

PyTorch calls its global optimizer step pre-hooks by iterating over an ``OrderedDict``.
A hook added or removed while that loop runs (one logging step ending inside another's
hook, two watchers, two threads) raises ``RuntimeError: OrderedDict mutated during
iteration`` inside ``optimizer.step()``. So actviz registers exactly one such hook, the
first time something subscribes, and keeps it for the life of the process; what wants to
hear of optimizer steps subscribes here instead, as often as it likes, from any thread.
The hook costs one call and an empty-dict check per ``optimizer.step()`` when nobody listens.

A compiled ``optimizer.step`` (``torch.compile(optimizer.step)``) calls the hooks inside the frame Dynamo
traces. They are not traced: Dynamo meets them as ``torch.compiler.disable`` made them, so the graph breaks
there and the listeners run eagerly, at every step, with Dynamo off (no recorder of actviz's is compiled
into a graph, none recompiles). ``fullgraph=True`` refuses that break: compile the step without it.

This is one of actviz's process-wide side effects, all listed in docs/how-it-works.md ("Side effects").
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ._internals import mark_trace_time_constant

__all__ = ["OptimizerStepSubscription", "stepping", "subscribe"]

logger = logging.getLogger(__name__)

#: Called with the optimizer about to step.
Listener = Callable[[torch.optim.Optimizer], None]

_listeners: dict[int, Listener] = {}
_after: dict[int, Listener] = {}  # called after the step: a closure (LBFGS, Lightning) ran forward and backward inside
_lock = threading.Lock()
_ids = itertools.count()
_registered = False
_stepping = threading.local()  # optimizer steps under way on this thread (a closure runs inside one)


def stepping() -> bool:
    """Whether an ``optimizer.step()`` is under way on this thread (LBFGS or Lightning run the closure inside it)."""
    return getattr(_stepping, "depth", 0) > 0


class OptimizerStepSubscription:
    """Undoes :func:`subscribe`. ``remove()`` is safe to call more than once, from any thread."""

    __slots__ = ("_key",)

    def __init__(self, key: int) -> None:
        self._key: int | None = key

    def remove(self) -> None:
        key, self._key = self._key, None
        if key is not None:
            with _lock:
                _listeners.pop(key, None)
                _after.pop(key, None)


def subscribe(listener: Listener, after: Listener | None = None) -> OptimizerStepSubscription:
    """Call ``listener(optimizer)`` before every ``optimizer.step()``, and ``after(optimizer)`` after it, until removed.

    Listeners catch their own errors (actviz's report them, or re-raise with ``strict=True``):
    one that raises anyway is re-raised after every other listener has run. Listeners added
    or removed while a step's listeners run take effect from the next step.

    Example:
        >>> seen = []
        >>> subscription = subscribe(lambda optimizer: seen.append(type(optimizer).__name__))
        >>> param = torch.nn.Parameter(torch.ones(1)); param.grad = torch.ones(1)
        >>> torch.optim.SGD([param], lr=0.1).step()
        >>> subscription.remove(); subscription.remove()
        >>> torch.optim.SGD([param], lr=0.1).step()
        >>> seen
        ['SGD']
    """
    global _registered
    with _lock:
        if not _registered:
            register_optimizer_step_pre_hook(_on_step)
            register_optimizer_step_post_hook(_on_step_done)
            _registered = True
        key = next(_ids)
        _listeners[key] = listener
        if after is not None:
            _after[key] = after
    return OptimizerStepSubscription(key)


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # torch.compiler.is_compiling() is True while Dynamo traces this, and also, in eager code, while any thread
    # compiles (torch holds one process-wide flag for a compile session: actviz's writer thread compiling a summary
    # made it so). Either way the twin runs the listeners eagerly, and it never asks again: no recursion.
    if torch.compiler.is_compiling() and _untraced_ready():
        return _untraced["step"](optimizer)
    return _step_listeners(optimizer)


def _on_step_done(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling() and _untraced_ready():
        return _untraced["done"](optimizer)
    return _done_listeners(optimizer)


def _step_listeners(optimizer: torch.optim.Optimizer) -> None:
    _call(_listeners, optimizer)
    _stepping.depth = 1  # not counted up: a step that raised never reaches its post-hook


def _done_listeners(optimizer: torch.optim.Optimizer) -> None:
    _stepping.depth = 0
    _call(_after, optimizer)


_untraced: dict[str, Callable[..., None]] = {}  # the listeners' calls as torch.compiler.disable makes them


def _untraced_ready() -> bool:
    """Make the listeners' untraced calls: Dynamo calls this for real while it traces a hook (a trace-time constant).

    Made then, not at import: ``torch.compiler.disable`` imports Dynamo (seconds), which is loaded by then.
    """
    if not _untraced:
        _untraced["done"] = torch.compiler.disable(_done_listeners)
        _untraced["step"] = torch.compiler.disable(_step_listeners)
    return True


mark_trace_time_constant(_untraced_ready)


def _call(table: dict[int, Listener], optimizer: torch.optim.Optimizer) -> None:
    if not table:
        return
    with _lock:
        listeners = list(table.values())  # a snapshot: listeners may subscribe or remove themselves
    failed: BaseException | None = None
    for listener in listeners:
        try:
            listener(optimizer)
        except Exception as error:  # noqa: BLE001 - the other listeners run all the same
            failed = failed or error
    if failed is not None:
        raise failed
