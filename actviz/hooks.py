"""The one holder of a capture's hook handles, so that taking every hook off is one idempotent call."""

from __future__ import annotations

from typing import Protocol

__all__ = ["HookHandles", "Removable"]


class Removable(Protocol):
    """A ``torch.utils.hooks.RemovableHandle``, or anything else with an idempotent ``remove()``."""

    def remove(self) -> None: ...


class HookHandles:
    """Every hook handle of one capture, in named groups. :meth:`remove` is safe to call again.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> handles = HookHandles()
        >>> handles.add("forward", layer.register_forward_hook(lambda *args: None))
        >>> handles.remove(); handles.remove()
        >>> len(layer._forward_hooks)
        0
    """

    def __init__(self) -> None:
        self._groups: dict[str, list[Removable]] = {}

    def add(self, group: str, handle: Removable) -> None:
        self._groups.setdefault(group, []).append(handle)

    def remove(self, group: str | None = None) -> None:
        """Remove the hooks of ``group``, or all of them."""
        for name in [group] if group is not None else list(self._groups):
            for handle in self._groups.pop(name, []):
                handle.remove()
