"""The watchers open in this process: one per model at a time, and closed when Python exits.

A second :func:`actviz.watch` on a model already watched fails loudly instead of doubling
every hook. At exit, one ``atexit`` entry closes every watcher still open: the writer
thread is a daemon that dies with the interpreter, and a step may still wait for its end,
so closing ends it and writes it. A watcher that merges ranks is left as it is, since its
last step would wait on collectives with ranks that may be gone.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any

from torch import nn

__all__ = ["register", "steps_apart", "unregister", "watching"]

#: Two watchers of one process whose step counts differ by this factor or more count different things.
STEPS_APART = 1.5

logger = logging.getLogger(__name__)

_open: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = weakref.WeakKeyDictionary()
_exit_hook_registered = False


def watching(model: nn.Module) -> Any:
    """The open watcher of ``model``, or ``None``.

    Example:
        >>> watching(nn.Linear(2, 2)) is None
        True
    """
    found = _open.get(model)
    watcher = found() if found is not None else None
    return watcher if watcher is not None and not watcher.closed else None


def register(model: nn.Module, watcher: Any) -> None:
    """Note ``watcher`` as ``model``'s, and make sure it is closed at exit if nobody closes it."""
    global _exit_hook_registered
    _open[model] = weakref.ref(watcher)
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_close_open_watchers)


def unregister(model: nn.Module, watcher: Any) -> None:
    """Forget ``watcher``, if it is still ``model``'s."""
    found = _open.get(model)
    if found is not None and found() is watcher:
        del _open[model]


def steps_apart(watcher: Any, steps: int) -> tuple[str, int] | None:
    """Another open watcher numbering its own steps (``auto_step``) whose count is :data:`STEPS_APART` x or more
    from ``watcher``'s ``steps``: ``(its model's class name, its count)``. Their step axes do not match: a GAN's
    discriminator counts two forwards an iteration, its generator one. ``None`` if there is none."""
    if not watcher.auto_step or steps < 10:
        return None
    for ref in list(_open.values()):
        other = ref()
        if other is None or other is watcher or other.closed or not other.auto_step:
            continue
        counted = other.counted_steps
        if counted >= 10 and max(counted, steps) >= STEPS_APART * min(counted, steps):
            return type(other.model).__name__, counted
    return None


def _close_open_watchers() -> None:
    for ref in list(_open.values()):
        watcher = ref()
        if watcher is not None and not watcher.closed and not watcher.merge_ranks:
            try:
                watcher.close()
            except Exception:  # close the others all the same
                logger.debug("closing a watcher at exit failed", exc_info=True)
