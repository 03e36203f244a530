"""torch.compile and actviz: logging steps run eagerly, so no actviz code is ever traced.

A model compiled with ``torch.compile(model)`` is an ``OptimizedModule`` wrapping the
original as ``_orig_mod``: actviz watches the original's layers, under their own names
(no ``_orig_mod.`` prefix), and keeps its step hook on the wrapper, which runs eagerly.
A model compiled in place with ``model.compile()`` compiles its own ``__call__``,
forward hooks included, so actviz wraps that compiled call instead of adding a hook
inside it. On a logging step the capture sets ``torch.compiler.set_stance("force_eager")``
for the forward (once torch.compile is imported; before, nothing is compiled anyway): the layer hooks then run in plain Python, nothing new is compiled, and
the steps that log nothing run the graphs compiled without actviz. The two private
attributes this takes are read through :mod:`actviz._internals`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._internals import compiled_call, compiled_original, set_compiled_call

__all__ = ["StepHookHandle", "attach_step_hook", "eager", "outside_graphs", "unwrap_compiled"]


def _dynamo_loaded() -> bool:
    """Whether torch.compile has been imported: until then nothing can be compiled or traced."""
    return "torch._dynamo" in sys.modules


def outside_graphs(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, never traced by torch.compile (``torch.compiler.disable``) once torch.compile is loaded.

    Importing ``torch._dynamo`` takes a second or two, so a process that never compiles skips it.
    """
    return torch.compiler.disable(function) if _dynamo_loaded() else function


def eager() -> contextlib.AbstractContextManager[Any]:
    """A context in which compiled functions run eagerly (``set_stance("force_eager")``), or a no-op."""
    return torch.compiler.set_stance("force_eager") if _dynamo_loaded() else contextlib.nullcontext()


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` wraps (``_orig_mod``), or ``model`` itself.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
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


def attach_step_hook(model: nn.Module, hook: Callable[[nn.Module, Any], None]) -> StepHookHandle:
    """Call ``hook(model, args)`` eagerly before every forward of ``model``.

    A forward pre-hook, except for a model compiled in place with ``model.compile()``: its
    compiled ``__call__`` would trace a pre-hook (a graph break, and new graphs whenever
    the hooks change), so the compiled call itself is wrapped.
    """
    compiled = compiled_call(model)
    if compiled is None:
        return StepHookHandle(model.register_forward_pre_hook(outside_graphs(hook)).remove)

    def call(*args: Any, **kwargs: Any) -> Any:
        hook(model, args)
        return compiled(*args, **kwargs)

    set_compiled_call(model, call)

    def remove() -> None:
        if compiled_call(model) is call:  # unless someone compiled it again since
            set_compiled_call(model, compiled)

    return StepHookHandle(remove)
