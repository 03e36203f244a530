"""Where each watched layer sits in the model, to follow a layer replaced after ``watch()``.

Fine-tuning code swaps layers (``model.head = nn.Linear(...)``, ``model.fc = ...``). A
watcher that kept the old module would hook a layer that never runs and log the old
layer's weights. Each logging step checks, in one dict lookup per layer, that every
watched layer is still its parent's child; a replaced one is followed, with one warning.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..common._internals import child_modules
from ..common.safe_warnings import warn_once
from ..selection import find_layer, layer_display_name, layer_tag_names, parameter_tag_names

__all__ = ["LayerSlots", "parameters_of"]


class LayerSlots:
    """The watched layers, each with its parent module and attribute name.

    Args:
        root: The model (unwrapped from ``torch.compile``).
        layers: ``(named_modules() name, module)`` pairs.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> slots = LayerSlots(model, [("0", model[0])])
        >>> model[0] = nn.Linear(2, 3)
        >>> slots.follow(), slots.layers[0][1] is model[0]
        (True, True)
    """

    def __init__(self, root: nn.Module, layers: list[tuple[str, nn.Module]]) -> None:
        self.root = root
        tag_names = layer_tag_names(root)
        self.layers = [(tag_names.get(name, layer_display_name(name)), module) for name, module in layers]
        self._slots: list[tuple[dict[str, nn.Module | None], str] | None] = []  # (the parent's children, name there)
        for name, _ in layers:
            parent_name, _, key = name.rpartition(".")
            try:
                self._slots.append((child_modules(find_layer(root, parent_name)), key) if name else None)
            except ValueError:
                self._slots.append(None)
        self._warned: set[str] = set()

    def follow(self) -> bool:
        """Take each replaced layer's new module; True if any changed (warned once per layer)."""
        changed = False
        for index, slot in enumerate(self._slots):
            if slot is None:
                continue
            name, module = self.layers[index]
            current = slot[0].get(slot[1])
            if current is module or not isinstance(current, nn.Module):
                continue
            changed = True
            self.layers[index] = (name, current)
            warn_once(self._warned, name, f"actviz follows {name!r}: it was replaced after watch() (a "
                      f"{type(module).__name__} by a {type(current).__name__}); from now on it logs the new layer and "
                      "its parameters")
        return changed


def parameters_of(model: nn.Module, modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """The parameters of ``modules`` (with their children's), by tag name (:func:`~actviz.selection.parameter_tag_names`)."""
    wanted: set[int] = set()
    for module in modules:
        wanted.update(id(param) for param in module.parameters())
    tag_names = parameter_tag_names(model)
    return [(tag_names.get(name, name), param) for name, param in model.named_parameters() if id(param) in wanted]
