"""torch.compile, TorchScript and export: actviz's code is never traced, and compiling after watch() works.

Two ways a model meets the compiler, both handled by the one root hook, :class:`StepHook`:

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

On a logging step the capture holds ``force_eager`` for its forward (:class:`EagerStance`),
so layer hooks run in plain Python and nothing new is compiled. ``torch.jit.trace``,
``torch.export`` and ONNX export see the hook return at once (no op, no step), and
``torch.jit.script`` compiles it as a function that does nothing. Private attributes
are read and set through :mod:`actviz._internals`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import linecache
import sys
import typing
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._internals import (
    compiled_call, compiled_original, mark_trace_time_constant, set_compiled_call, swap_stance,
)

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


def compiled_forward(token: torch.Tensor, key: int, training: bool) -> None:
    """The body of ``actviz::forward_step``: a compiled forward with actviz's root hook in it runs."""
    found = _counted.get(key)
    count = None if found is None else found()
    if count is not None:
        count(training)


_token = torch.zeros(())  # what the op says it mutates, so that no compiler drops it
_op_defined = False


def _op_ready() -> bool:
    """Define ``actviz::forward_step`` once; Dynamo calls this while it traces the hook (a trace-time constant)."""
    global _op_defined
    if not _op_defined:
        op = torch.library.custom_op("actviz::forward_step", compiled_forward, mutates_args=("token",))
        op.register_fake(lambda token, key, training: None)
        _op_defined = True
    return True


mark_trace_time_constant(_op_ready)


def inert_step_hook(module: nn.Module, args: Any) -> None:
    """What a root hook unpickles as in a process where it is not live: it takes itself off and does nothing."""
    _drop_hook(module, inert_step_hook)


def _drop_hook(module: nn.Module, hook: Any) -> None:
    """Take ``hook`` off a copy of a watched model (torch iterates over a snapshot of the hooks: safe here)."""
    for key in [key for key, value in module._forward_pre_hooks.items() if value is hook]:
        del module._forward_pre_hooks[key]


_hook_functions: dict[str, Callable[[nn.Module, Any], None]] = {}  # kept: a copy may pickle it after close


def __getattr__(name: str) -> Any:
    """A root hook pickled by name (``torch.save(model)``), unpickled where it is not live, is a no-op."""
    if name.startswith("actviz_step_hook_"):
        return _hook_functions.get(name, inert_step_hook)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _type_name(hint: Any) -> str:
    return f"{hint.__module__}.{hint.__qualname__}" if isinstance(hint, type) else repr(hint)


def _forward_input_type(model: nn.Module) -> str:
    """``Tuple[...]`` of ``model.forward``'s positional argument types: what ``torch.jit.script`` wants a pre-hook to take.

    Example:
        >>> _forward_input_type(nn.Linear(2, 2))
        'typing.Tuple[torch.Tensor]'
    """
    try:
        hints = typing.get_type_hints(model.forward)
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = [p.name for p in inspect.signature(model.forward).parameters.values() if p.kind in kinds]
        types = [_type_name(hints.get(name, torch.Tensor)) for name in names] or ["torch.Tensor"]
    except Exception:  # noqa: BLE001 - only scripting reads it
        types = ["torch.Tensor"]
    return f"typing.Tuple[{', '.join(types)}]"


# The root hook's source. TorchScript compiles a model's hooks from their source, and wants the
# pre-hook's input typed as the forward's: so the function is made from this text, with that type.
_HOOK_SOURCE = """
def make(state, key, forward_step, is_exporting, op_ready, token, drop):
    def {name}(module, args):
        # type: ({args}) -> None
        if torch.jit.is_scripting():
            return None
        if torch.compiler.is_compiling():
            if not is_exporting() and op_ready():
                forward_step(token, key, module.training and torch.is_grad_enabled())
            return None
        if torch.jit.is_tracing() or is_exporting():
            return None
        target = state.get("target")
        if target is not None and module is target():
            state["on_forward"](module, args)
        else:
            drop(module, {name})
        return None
    return {name}
"""


def _make_hook(name: str, args_type: str, state: dict[str, Any], key: int) -> Callable[[nn.Module, Any], None]:
    source = _HOOK_SOURCE.format(name=name, args=args_type)
    filename = f"<actviz root hook {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for inspect.getsource
    namespace: dict[str, Any] = {"torch": torch, "typing": typing, "__name__": __name__}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own text, see above
    forward_step = _ForwardStep()
    return namespace["make"](state, key, forward_step, torch.compiler.is_exporting, _op_ready, _token, _drop_hook)


class _ForwardStep:
    """``torch.ops.actviz.forward_step``, looked up when called (the op is defined while Dynamo traces)."""

    def __call__(self, token: torch.Tensor, key: int, training: bool) -> None:
        torch.ops.actviz.forward_step(token, key, training)


class StepHook:
    """The watcher's root forward pre-hook: a module-level function, live for its model only.

    ``function(model, args)`` calls ``on_forward(model, args)`` on every eager forward of
    ``target``. A copy of the model shares the function, which takes itself off the copy at
    its first forward; a pickle stores it by name, and unpickled where it is not live it is
    :func:`inert_step_hook`. After ``close()`` it is a no-op everywhere.
    Traced by ``torch.compile`` it becomes one ``actviz::forward_step`` op; under
    ``torch.jit.trace``, ``torch.export`` or ONNX export it does nothing; ``torch.jit.script``
    compiles only its first lines (``is_scripting()`` is a constant there).
    """

    def __init__(
        self, on_forward: Callable[[nn.Module, Any], None], on_compiled: Callable[[bool], None], target: nn.Module
    ) -> None:
        key = next(_keys)
        self.key = key
        _counted[key] = weakref.WeakMethod(on_compiled)
        self._state: dict[str, Any] = {"on_forward": on_forward, "target": weakref.ref(target)}
        name = f"actviz_step_hook_{key}"
        hook = _make_hook(name, _forward_input_type(target), self._state, key)
        hook.__module__ = __name__
        hook.__qualname__ = name
        _hook_functions[name] = hook
        self.function = hook

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.function(module, args)

    def forget(self) -> None:
        """Make the function a no-op for good (copies may still hold it) and let the watcher go."""
        _counted.pop(self.key, None)
        self._state.clear()


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
