"""The watcher's root hook: the one module hook actviz leaves on a model between logging steps.

It is a named module-level function, made from source text (:data:`_HOOK_SOURCE`) because
``torch.jit.script`` compiles a model's hooks from their source and wants the pre-hook's
input typed as the forward's. What it does, wherever the model goes:

* eager forward of the watched model: calls the watcher (``on_forward``);
* a copy or a pickle (``copy.deepcopy``, ``AveragedModel``, ``torch.save(model)``, spawn) of a model
  whose class copies and pickles as ``nn.Module`` does: left out (:func:`leave_out_of_copies`), so that
  ``torch.load(weights_only=True)`` meets no actviz name; a copy made another way (a class's own
  ``__copy__``, ``__reduce__`` or tuple ``__getstate__``, a ``torch.fx.GraphModule``) holds the function,
  which takes itself off the copy at its first forward, and pickled by name it unpickles as
  :func:`inert_step_hook` where that name is not live;
* a replica that shares the model's hook dicts (``torch.nn.parallel.replicate``, ``DataParallel``):
  nothing, and the hook stays on the model;
* ``torch.compile`` traces it: ``is_compiling()`` is a constant there, so no graph break; it
  leaves one op, ``actviz::forward_step``, whose Python body counts the step each time the
  graph runs (see :mod:`actviz.capture.compiled_model`);
* ``torch.jit.trace``, ``torch.export``, ONNX export: returns at once (no op, no step);
* ``torch.jit.script``: only its first two lines compile (``is_scripting()`` is a constant).
"""

from __future__ import annotations

import inspect
import itertools
import linecache
import typing
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..common._internals import exporting_now, forward_hooks, mark_trace_time_constant, traced_here

__all__ = ["StepHook", "compiled_forward", "inert_step_hook", "leave_out_of_copies"]

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
    """Whether a traced root hook leaves ``actviz::forward_step``: under ``torch.compile`` yes, under ``torch.export`` no.

    Dynamo calls this while it traces (a trace-time constant), so it reads export's own flag: torch 2.11's
    Dynamo folds ``torch.compiler.is_exporting()`` to True under ``torch.compile`` too, which left a model
    compiled after ``watch()`` without its step op (no step counted, nothing logged after step 0).
    The op is defined here, once.
    """
    global _op_defined
    if exporting_now():
        return False
    if not _op_defined:
        op = torch.library.custom_op("actviz::forward_step", compiled_forward, mutates_args=("token",))
        op.register_fake(lambda token, key, training: None)
        _op_defined = True
    return True


mark_trace_time_constant(_op_ready)


def inert_step_hook(module: nn.Module, args: Any) -> None:
    """What a root hook unpickles as in a process where it is not live: it takes itself off and does nothing."""
    _drop_hook(module, inert_step_hook)


def _drop_hook(module: nn.Module, hook: Any, state: dict[str, Any] | None = None) -> None:
    """Take ``hook`` off a copy of a watched model (torch iterates over a snapshot of the hooks: safe here).

    A replica that shares the watched model's hook dict (``torch.nn.parallel.replicate``) keeps it: taking it
    off the replica would take it off the model. A copy of the model's ``__dict__`` also holds the model's
    ``__getstate__`` (:func:`leave_out_of_copies`), which would pickle the model in the copy's place: dropped.
    """
    found = None if state is None else state.get("target")
    target = None if found is None else found()
    own = vars(module)
    if isinstance(own.get("__getstate__"), _StateWithout) and module is not target:
        del own["__getstate__"]
    hooks = forward_hooks(module, pre=True)
    if target is not None and forward_hooks(target, pre=True) is hooks:
        return
    for key in [key for key, value in hooks.items() if value is hook]:
        del hooks[key]


# Each live root hook by name, for pickles by name; weak, so that a dropped model lets its watcher go (a copy
# that holds the function keeps it here, after close too).
_hook_functions: weakref.WeakValueDictionary[str, Callable[[nn.Module, Any], None]] = weakref.WeakValueDictionary()


def leave_out_of_copies(model: nn.Module, hook: Callable[[nn.Module, Any], None]) -> Callable[[], None]:
    """Make pickles and copies of ``model`` leave out ``hook``, one of its forward pre-hooks; returns the undo.

    ``torch.save(model)`` pickles a module's hooks with it, and ``torch.load`` refuses, by default
    since torch 2.6 (``weights_only=True``), any name it was not told to trust: a watched model
    saved whole would not load (pytorch/examples' word_language_model does this). Pickle and
    ``copy`` ask the instance for ``__getstate__`` before its class, so one entry in the model's
    ``__dict__`` (left out of the state itself) gives them torch's state less the hook.

    Only where the class copies and pickles as ``nn.Module`` does: a class with its own ``__getstate__``,
    ``__reduce__``, ``__reduce_ex__``, ``__copy__`` or ``__deepcopy__`` (a ``torch.fx.GraphModule``) puts
    its ``__dict__`` in its copies and pickles as it is, where the entry would pickle a weak reference
    (``cannot pickle 'weakref.ReferenceType'``) or stand for the original in a copy. Such a model gets
    nothing: its pickles hold the hook by name (:func:`inert_step_hook` where it is not live).

    Example:
        >>> class OwnCopy(nn.Linear):
        ...     def __copy__(self): return self
        >>> undo = leave_out_of_copies(nn.Linear(2, 2), inert_step_hook); undo(); undo()
        >>> undo = leave_out_of_copies(model := OwnCopy(2, 2), inert_step_hook); "__getstate__" in vars(model)
        False
    """
    if not _pickles_as_a_module(type(model)):
        return _nothing_to_undo
    getstate = _StateWithout(model, hook)
    vars(model)["__getstate__"] = getstate

    def undo() -> None:
        if vars(model).get("__getstate__") is getstate:
            del vars(model)["__getstate__"]

    return undo


_OWN_WAYS = ("__reduce__", "__reduce_ex__", "__copy__", "__deepcopy__")


def _pickles_as_a_module(cls: type) -> bool:
    """Whether ``cls`` copies and pickles as ``nn.Module`` does: by the state ``nn.Module.__getstate__`` gives."""
    return (getattr(cls, "__getstate__", None) is nn.Module.__getstate__
            and all(getattr(cls, name, None) is getattr(object, name, None) for name in _OWN_WAYS))


def _nothing_to_undo() -> None:
    """What :func:`leave_out_of_copies` returns where it left nothing on the model."""


class _StateWithout:
    """A model's ``__getstate__``: its class's state, less one forward pre-hook (:func:`leave_out_of_copies`)."""

    __slots__ = ("_hook", "_model")

    def __init__(self, model: nn.Module, hook: Callable[[nn.Module, Any], None]) -> None:
        self._model = weakref.ref(model)
        self._hook = hook

    def __call__(self) -> Any:
        model = self._model()
        if model is None:
            return None
        state = type(model).__getstate__(model)
        if not isinstance(state, dict):  # a class that pickles its own way
            return state
        state = {name: value for name, value in state.items() if value is not self}
        hooks = forward_hooks(model, pre=True)
        for name, value in state.items():
            if value is hooks:  # the same entries in a new dict, less the hook: a shallow copy's own
                state[name] = OrderedDict((key, found) for key, found in hooks.items() if found is not self._hook)
                break
        return state


def __getattr__(name: str) -> Any:
    """A root hook pickled by name (``torch.save(model)``), unpickled where it is not live, is a no-op."""
    if name.startswith("actviz_step_hook_"):
        return _hook_functions.get(name, inert_step_hook)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _type_name(hint: Any) -> str:
    return f"{hint.__module__}.{hint.__qualname__}" if isinstance(hint, type) else repr(hint)


def _forward_input_type(model: nn.Module) -> str:
    """``Tuple[...]`` of ``model.forward``'s positional argument types, as ``torch.jit.script`` types a pre-hook.

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
def make(state, key, forward_step, is_exporting, op_ready, token, drop, traced_here):
    def {name}(module, args):
        # type: ({args}) -> None
        if torch.jit.is_scripting():
            return None
        if torch.compiler.is_compiling() and traced_here():  # not another thread's compile
            if op_ready():  # not is_exporting(): Dynamo may fold that to True under torch.compile
                forward_step(token, key, module.training and torch.is_grad_enabled())
            return None
        if torch.jit.is_tracing() or is_exporting():
            return None
        target = state.get("target")
        if target is not None and module is target():
            state["on_forward"](module, args)
        else:
            drop(module, {name}, state)
        return None
    return {name}
"""


def _make_hook(name: str, args_type: str, state: dict[str, Any], key: int) -> Callable[[nn.Module, Any], None]:
    source = _HOOK_SOURCE.format(name=name, args=args_type)
    filename = f"<actviz root hook {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for inspect.getsource
    namespace: dict[str, Any] = {"torch": torch, "typing": typing, "__name__": __name__}
    exec(compile(source, filename, "exec"), namespace)
    forward_step = _ForwardStep()
    return namespace["make"](state, key, forward_step, torch.compiler.is_exporting, _op_ready, _token, _drop_hook,
                             traced_here)


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
        self, on_forward: Callable[[nn.Module, Any], None], on_compiled: Callable[[bool], None], target: nn.Module,
        after_call: Callable[[], None] | None = None,
    ) -> None:
        key = next(_keys)
        self.key = key
        _counted[key] = weakref.WeakMethod(on_compiled)
        self._state: dict[str, Any] = {
            "on_forward": on_forward, "target": weakref.ref(target), "after_call": after_call}
        name = f"actviz_step_hook_{key}"
        hook = _make_hook(name, _forward_input_type(target), self._state, key)
        hook.__module__ = __name__
        hook.__qualname__ = name
        _hook_functions[name] = hook
        self.function = hook

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.function(module, args)

    def after_call(self) -> None:
        """The model's compiled call (``model.compile()``, wrapped by actviz) has returned."""
        after = self._state.get("after_call")
        if after is not None:
            after()

    def forget(self) -> None:
        """Make the function a no-op for good (copies may still hold it) and let the watcher go."""
        _counted.pop(self.key, None)
        self._state.clear()
