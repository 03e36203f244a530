"""torch.compile and actviz: logging steps run eagerly, and compiling after watch() works.

Two ways a model meets the compiler, both handled by the one root hook
(:class:`actviz.capture.root_hook.StepHook`, which also keeps TorchScript and export clean):

* **Compiled first** (``torch.compile(model)`` then ``watch``): the hook sits on the
  ``OptimizedModule`` wrapper, which runs eagerly; actviz watches the original's layers
  under their own names (no ``_orig_mod.`` prefix). A model compiled in place with
  ``model.compile()`` compiles its own ``__call__``, so actviz wraps that call instead.
* **Compiled after** ``watch``: the compiler traces the hook with the model. It reads
  ``torch.compiler.is_compiling()`` first (a constant there: no graph break, so
  ``fullgraph=True`` holds) and leaves in the graph one op, ``actviz::forward_step``, a
  custom op whose Python body runs each time the graph runs (:func:`compiled_forward`).
  It counts the step and, when the next step logs, sets the stance ``force_eager`` ahead,
  so that the next forward runs eagerly through the hook, as when compiled first.

On a logging step the capture holds ``force_eager`` until the step ends (:class:`EagerStance`;
not only for the forward: ``fullgraph=True`` checks the stance as the compiled call returns),
so layer hooks run in plain Python and nothing new is compiled. Private attributes are read
and set through :mod:`actviz.common._internals`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..common._internals import compiled_call, compiled_original, set_compiled_call, swap_stance
from .root_hook import leave_out_of_copies

if TYPE_CHECKING:
    from .root_hook import StepHook

__all__ = ["EagerStance", "StepHookHandle", "attach_step_hook", "eager", "eager_ahead", "outside_graphs",
           "take_eager_ahead", "unwrap_compiled"]


def _dynamo_loaded() -> bool:
    """Whether torch.compile has been imported: until then nothing can be compiled or traced."""
    return "torch._dynamo" in sys.modules


_holders = 0  # EagerStance objects holding force_eager now: steps of several watchers overlap
_prior: Any = None  # the stance before the first of them
_lock = threading.Lock()


class EagerStance:
    """Holds ``force_eager`` from :meth:`enter` to :meth:`exit`, inside a compiled region too; else nothing.

    Holders are counted: the stance before the first comes back when the last one exits,
    in whatever order they exit (steps of two watched models end in any order).

    Example:
        >>> stance = EagerStance(); stance.enter(); stance.exit(); stance.exit()
    """

    def __init__(self) -> None:
        self._held = False

    def enter(self) -> None:
        global _holders, _prior
        if self._held or not _dynamo_loaded():
            return
        with _lock:
            if _holders == 0:
                _prior = swap_stance("force_eager")
            _holders += 1
            self._held = True

    def exit(self) -> None:
        global _holders, _prior
        if not self._held:
            return
        with _lock:
            self._held = False
            _holders -= 1
            if _holders == 0:
                prior, _prior = _prior, None
                swap_stance(prior)


def outside_graphs(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, never traced by torch.compile (``torch.compiler.disable``) once torch.compile is loaded."""
    return torch.compiler.disable(function) if _dynamo_loaded() else function


@contextlib.contextmanager
def eager() -> Any:
    """A context in which compiled functions run eagerly (``force_eager``), or a no-op before torch.compile."""
    stance = EagerStance()
    stance.enter()
    try:
        yield
    finally:
        stance.exit()


_ahead: EagerStance | None = None  # force_eager set for the next forward of a model compiled after watch()


def eager_ahead() -> None:
    """Run the next compiled call eagerly: the next forward of a model compiled after ``watch()`` logs."""
    global _ahead
    if _ahead is None and _dynamo_loaded():
        _ahead = EagerStance()
        _ahead.enter()


def take_eager_ahead() -> EagerStance:
    """The stance :func:`eager_ahead` set, for a capture to end with its forward; or a fresh one."""
    global _ahead
    taken, _ahead = _ahead, None
    return taken if taken is not None else EagerStance()


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` wraps (``_orig_mod``), or ``model`` itself.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> unwrap_compiled(layer) is layer
        True
    """
    original = compiled_original(model)
    return model if original is None else original


class StepHookHandle:
    """Undoes :func:`attach_step_hook`. ``remove()`` is safe to call more than once."""

    def __init__(self, remove: Callable[[], None]) -> None:
        self._remove: Callable[[], None] | None = remove

    def remove(self) -> None:
        remove, self._remove = self._remove, None
        if remove is not None:
            remove()


def attach_step_hook(model: nn.Module, hook: StepHook) -> StepHookHandle:
    """Call ``hook(model, args)`` before every forward of ``model``.

    A forward pre-hook, except for a model compiled in place with ``model.compile()``: its
    compiled ``__call__`` would trace a pre-hook, so the compiled call itself is wrapped.
    """
    compiled = compiled_call(model)
    if compiled is None:
        handle = model.register_forward_pre_hook(hook.function)
        let_into_copies = leave_out_of_copies(model, hook.function)  # torch.load(weights_only=True) meets no actviz name

        def unhook() -> None:
            handle.remove()
            let_into_copies()
            hook.forget()

        return StepHookHandle(unhook)

    def call(*args: Any, **kwargs: Any) -> Any:
        hook(model, args)
        try:
            return compiled(*args, **kwargs)
        finally:
            hook.after_call()  # outside the compiled call: a logging step's force_eager may end now

    set_compiled_call(model, call)

    def remove() -> None:
        hook.forget()
        if compiled_call(model) is call:  # unless someone compiled it again since
            set_compiled_call(model, compiled)

    return StepHookHandle(remove)
