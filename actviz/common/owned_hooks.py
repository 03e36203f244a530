"""Every hook actviz puts on a model, and the one holder of a capture's handles.

A watched model belongs to the user: it is deep-copied (EMA teachers, ``AveragedModel``),
pickled (``torch.save(model)``, spawned workers) and compiled while watched. So every
hook actviz registers is an :class:`OwnedHook`: a small object that holds its owner only
by weak reference, does nothing when called on another module than the one it was
attached to (``copy.deepcopy`` may share the hook dicts by reference), and copies or
pickles to an :class:`InertHook`, a no-op. A copy never runs, and never keeps alive,
anything of the watcher's.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from torch import nn

from ._internals import forward_hooks

__all__ = ["ForwardHooks", "HookHandles", "InertHook", "OwnedHook", "Removable"]


class Removable(Protocol):
    """A ``torch.utils.hooks.RemovableHandle``, or anything else with an idempotent ``remove()``."""

    def remove(self) -> None: ...


class InertHook:
    """What an actviz hook becomes in a copy or an unpickled model: called, it takes itself off and does nothing.

    Example:
        >>> InertHook()(object(), (1,)) is None
        True
    """

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        hooks = forward_hooks(args[0]) if args and isinstance(args[0], nn.Module) else None  # torch iterates a copy
        if hooks is not None:
            for key in [key for key, value in hooks.items() if isinstance(value, InertHook)]:
                del hooks[key]

    def __repr__(self) -> str:
        return "actviz.InertHook()"


class OwnedHook:
    """``method(*bound, *call_args)`` while ``method``'s object lives, when called on ``target`` only.

    Args:
        method: A bound method of the hook's owner (a watcher or a capture); the owner is held weakly.
        target: The module or tensor the hook is registered on, passed first by torch to
            module and parameter hooks; ``None`` for tensor gradient hooks (called with the gradient).
        bound: Arguments put before torch's.

    Hundreds of hooks that share one method share one ``OwnedHook``: ``functools.partial(hook, *more)``
    puts more arguments first, with no new weak reference (an output's gradient hook).

    Example:
        >>> import copy, pickle, torch
        >>> class Owner:
        ...     def seen(self, tag, module, args): return tag
        >>> owner, layer = Owner(), torch.nn.Linear(2, 2)
        >>> hook = OwnedHook(owner.seen, layer, "a")
        >>> hook(layer, ()), hook(torch.nn.Linear(2, 2), ())
        ('a', None)
        >>> copy.deepcopy(hook), pickle.loads(pickle.dumps(hook))
        (actviz.InertHook(), actviz.InertHook())
        >>> del owner; hook(layer, ()) is None
        True
    """

    __slots__ = ("__weakref__", "_bound", "_function", "_owner", "_target")

    def __init__(self, method: Callable[..., Any], target: Any = None, *bound: Any) -> None:
        # The owner by weak reference and the plain function apart: a call makes no bound method (weakref.WeakMethod does).
        self._owner = weakref.ref(method.__self__)  # type: ignore[attr-defined]
        self._function = method.__func__  # type: ignore[attr-defined]
        self._target = None if target is None else weakref.ref(target)
        self._bound = bound

    def __call__(self, *args: Any) -> Any:
        if self._target is not None and (not args or args[0] is not self._target()):
            return None  # a copy's module, sharing this hook through a shallow-copied dict
        owner = self._owner()
        if owner is None:
            return None
        return self._function(owner, *self._bound, *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return (InertHook, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __copy__(self) -> InertHook:
        return InertHook()


class ForwardHooks:
    """One hook put on many modules' forward, straight into their hook dicts, under one key of actviz's own.

    A logging step hooks a hundred layers or more: ``register_forward_hook`` makes a handle and
    three weak references per module, this one dict entry. The key is negative, so that it never
    meets one of torch's (which count up from 0); torch runs the hook as one it registered.
    :meth:`remove` takes every entry out again, and is safe to call again.

    Example:
        >>> import torch
        >>> from actviz.common._internals import forward_hooks
        >>> layer, seen = torch.nn.Linear(2, 2), []
        >>> hooks = ForwardHooks(lambda module, args, output: seen.append(output.shape))
        >>> hooks.add_to([forward_hooks(layer)])
        >>> _ = layer(torch.ones(1, 2)); hooks.remove(); hooks.remove(); _ = layer(torch.ones(1, 2))
        >>> seen, len(layer._forward_hooks)
        ([torch.Size([1, 2])], 0)
    """

    __slots__ = ("_dicts", "_hook", "_key")
    _keys = itertools.count(1)

    def __init__(self, hook: Callable[..., Any]) -> None:
        self._hook = hook
        self._key = -next(ForwardHooks._keys)
        self._dicts: list[dict[int, Any]] = []  # the modules' hook dicts: taken out again without a call per module

    def add_to(self, hook_dicts: list[dict[int, Any]]) -> None:
        """Put the hook into each of ``hook_dicts``, modules' forward hook dicts (``_internals.forward_hooks``)."""
        key, hook = self._key, self._hook
        self._dicts.extend(hook_dicts)  # known before they are filled: remove() finds them after a Ctrl-C here
        for hooks in hook_dicts:
            hooks[key] = hook

    def remove(self) -> None:
        dicts, key = self._dicts, self._key
        while dicts:  # one at a time: a Ctrl-C here leaves the rest for the next call
            dicts[-1].pop(key, None)
            dicts.pop()


class HookHandles:
    """Every hook handle of one capture, in named groups. :meth:`remove` is safe to call again.

    The one way actviz keeps hook handles: ``with HookHandles() as handles:`` removes them all
    when the block ends, by an exception too.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> handles = HookHandles()
        >>> handles.add("forward", layer.register_forward_hook(lambda *args: None))
        >>> handles.remove(); handles.remove()
        >>> with HookHandles() as handles:
        ...     handles.add("forward", layer.register_forward_hook(lambda *args: None))
        >>> len(layer._forward_hooks)
        0
    """

    def __init__(self) -> None:
        self._groups: dict[str, list[Removable]] = {}

    def add(self, group: str, handle: Removable) -> None:
        self._groups.setdefault(group, []).append(handle)

    def group(self, name: str) -> list[Removable]:
        """The list that holds group ``name``'s handles: a hook that adds many appends to it directly."""
        return self._groups.setdefault(name, [])

    def remove(self, group: str | None = None) -> None:
        """Remove the hooks of ``group``, or all of them."""
        for name in [group] if group is not None else list(self._groups):
            handles = self._groups.get(name, [])
            while handles:  # one at a time, each remove() idempotent: a Ctrl-C here leaves the rest for the next call
                handles[-1].remove()
                handles.pop()  # a hook that appended to the list itself (group()) holds it no longer
            self._groups.pop(name, None)

    def __enter__(self) -> HookHandles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()
