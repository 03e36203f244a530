"""torch.compile and actviz: logging steps run eagerly, so no actviz code is ever traced.

A model compiled with ``torch.compile(model)`` is an ``OptimizedModule`` wrapping the
original as ``_orig_mod``: actviz watches the original's layers, under their own names
(no ``_orig_mod.`` prefix), and keeps its step hook on the wrapper, which runs eagerly.
A model compiled in place with ``model.compile()`` compiles its own ``__call__``,
forward hooks included, so actviz wraps that compiled call instead of adding a hook
inside it. On a logging step the capture sets ``torch.compiler.set_stance("force_eager")``
for the forward: the layer hooks then run in plain Python, nothing new is compiled, and
the steps that log nothing run the graphs compiled without actviz. These are the two
private attributes of ``torch.nn.Module`` actviz relies on for compiled models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["StepHookHandle", "attach_step_hook", "unwrap_compiled"]


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(model)`` wraps (``_orig_mod``), or ``model`` itself.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> unwrap_compiled(layer) is layer
        True
    """
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else model


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
    compiled = getattr(model, "_compiled_call_impl", None)
    if compiled is None:
        return StepHookHandle(model.register_forward_pre_hook(torch.compiler.disable(hook)).remove)

    def call(*args: Any, **kwargs: Any) -> Any:
        hook(model, args)
        return compiled(*args, **kwargs)

    model._compiled_call_impl = call

    def remove() -> None:
        if model._compiled_call_impl is call:  # unless someone compiled it again since
            model._compiled_call_impl = compiled

    return StepHookHandle(remove)
