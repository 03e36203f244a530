"""torch.compile, TorchScript and export: actviz's code is never traced, and compiling after watch() works.

Two ways a model meets the compiler, both handled by the one root hook, :class:`StepHook`:

* **Compiled first** (``torch.compile(model)`` then ``watch``): the hook sits on the
  ``OptimizedModule`` wrapper, which runs eagerly; actviz watches the original's layers
  under their own names (no ``_orig_mod.`` prefix). A model compiled in place with
  ``model.compile()`` compiles its own ``__call__``, so actviz wraps that call instead.
* **Compiled after** ``watch``: the compiler traces the hook with the model. It reads
  ``torch.compiler.is_compiling()`` first (a constant there: no graph break, so
  ``fullgraph=True`` holds) and leaves only a call of :func:`compiled_forward`, which
  Dynamo replays eagerly after the graph (``reorderable_logging_functions``). That call
  counts the step and, when the next step logs, sets the stance ``force_eager`` ahead,
  so that the next forward runs eagerly through the hook, as when compiled first.

On a logging step the capture holds ``force_eager`` for its forward (:class:`EagerStance`),
so layer hooks run in plain Python and nothing new is compiled. ``torch.jit.trace``,
``torch.export`` and ONNX export see the hook return at once (no op, no step), and
``torch.jit.script`` compiles it as a function that does nothing. Private attributes
are read and set through :mod:`actviz._internals`.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._internals import (
    compiled_call, compiled_original, mark_trace_time_constant, reorder_after_graph, set_compiled_call, swap_stance,
)
from .hooks import InertHook

__all__ = [
    "EagerStance", "StepHook", "StepHookHandle", "attach_step_hook", "compiled_forward", "eager", "eager_ahead",
    "take_eager_ahead", "unwrap_compiled",
]


def _dynamo_loaded() -> bool:
    """Whether torch.compile has been imported: until then nothing can be compiled or traced."""
    return "torch._dynamo" in sys.modules


class EagerStance:
    """Holds ``force_eager`` from :meth:`enter` to :meth:`exit`, inside a compiled region too; else nothing.

    Example:
        >>> stance = EagerStance(); stance.enter(); stance.exit(); stance.exit()
    """

    def __init__(self, prior: Any = None) -> None:
        self._prior = prior  # a stance taken over from eager_ahead(), restored at exit

    def enter(self) -> None:
        if self._prior is None and _dynamo_loaded():
            self._prior = swap_stance("force_eager")

    def exit(self) -> None:
        prior, self._prior = self._prior, None
        if prior is not None:
            swap_stance(prior)


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
        >>> layer = torch.nn.Linear(2, 2)
        >>> unwrap_compiled(layer) is layer
        True
    """
    original = compiled_original(model)
    return model if original is None else original


# -- the root hook -------------------------------------------------------------------------------

_counted: dict[int, weakref.WeakMethod[Callable[[bool], None]]] = {}  # StepHook.key -> its owner's on_compiled_forward
_keys = itertools.count()


def compiled_forward(key: int, training: bool) -> None:
    """Replayed by Dynamo after the graph of a forward compiled with actviz's root hook in it."""
    found = _counted.get(key)
    count = None if found is None else found()
    if count is not None:
        count(training)


def _registered_for_replay() -> bool:
    """Called by Dynamo while it traces (a trace-time constant): make it replay :func:`compiled_forward`."""
    reorder_after_graph(compiled_forward)
    return True


mark_trace_time_constant(_registered_for_replay)


def _scripted_noop(module: nn.Module, args: Any) -> None:
    return None


class StepHook:
    """The root forward pre-hook: ``on_forward(model, args)`` on every eager forward of its model only.

    A copy or pickle of the model gets an :class:`~actviz.hooks.InertHook` instead. Traced by
    ``torch.compile`` it becomes a replayed :func:`compiled_forward` call; under ``torch.jit.trace``,
    ``torch.export`` or ONNX export it does nothing; ``torch.jit.script`` compiles :func:`_scripted_noop`.
    """

    __name__ = "actviz_step_hook"
    __wrapped__ = staticmethod(_scripted_noop)  # what torch.jit.script reads the source of
    __globals__ = _scripted_noop.__globals__
    __code__ = _scripted_noop.__code__
    __closure__ = None

    def __init__(
        self, on_forward: Callable[[nn.Module, Any], None], on_compiled: Callable[[bool], None], target: nn.Module
    ) -> None:
        self.key = next(_keys)
        self._on_forward = on_forward
        self._target = weakref.ref(target)
        _counted[self.key] = weakref.WeakMethod(on_compiled)

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            if not torch.compiler.is_exporting() and _registered_for_replay():
                compiled_forward(self.key, module.training and torch.is_grad_enabled())
            return None
        if torch.jit.is_tracing() or torch.compiler.is_exporting() or module is not self._target():
            return None
        self._on_forward(module, args)
        return None

    def forget(self) -> None:
        _counted.pop(self.key, None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (InertHook, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __copy__(self) -> InertHook:
        return InertHook()


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
        handle = model.register_forward_pre_hook(hook)

        def unhook() -> None:
            handle.remove()
            hook.forget()

        return StepHookHandle(unhook)

    def call(*args: Any, **kwargs: Any) -> Any:
        hook(model, args)
        return compiled(*args, **kwargs)

    set_compiled_call(model, call)

    def remove() -> None:
        hook.forget()
        if compiled_call(model) is call:  # unless someone compiled it again since
            set_compiled_call(model, compiled)

    return StepHookHandle(remove)
