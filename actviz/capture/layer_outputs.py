"""What a layer's output becomes: its tensors, and the device halves of their summaries and pictures.

:func:`reduce_output` is the per-layer work that the watcher's hooks and
:func:`actviz.report` share; :func:`copied_picture` is the picture of an output a watcher's step
copied whole (most outputs: one copy is both the summary's row and the picture's source).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from ..common._internals import batch_and_instance_norm_types, tensor_version
from ..options import CaptureOptions
from ..output.pending_step import Draw
from ..pictures.rendering import draw_first_grid, picture_source
from ..summaries.header import Reduction
from ..summaries.one_tensor import reduce_tensor

__all__ = [
    "PER_CHANNEL_AFFINE",
    "DrawnTensors",
    "batch_dim_of",
    "copied_picture",
    "first_tensor",
    "layer_table",
    "layers_by_module",
    "nested_values",
    "output_tensors",
    "reduce_output",
    "shape_of",
]


def output_tensors(output: Any, mode: Literal["first", "all"] = "first") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(suffix, tensor)`` for the tensors in a module's output.

    A plain tensor yields ``("", tensor)``. Tuples, lists, dicts and dataclasses (by field
    name) are searched depth first: ``mode="first"`` yields only the first tensor, with suffix ``""``;
    ``mode="all"`` yields each one with its path as suffix, such as ``"/0"``,
    ``"/1.0"`` or ``"/attn"``.

    Example:
        >>> out = torch.zeros(2), (torch.ones(1), torch.ones(3))   # like nn.LSTM's (output, (h, c))
        >>> [(s, t.numel()) for s, t in output_tensors(out, "all")]
        [('/0', 2), ('/1.0', 1), ('/1.1', 3)]
        >>> [(s, t.numel()) for s, t in output_tensors(out)]
        [('', 2)]
    """
    if isinstance(output, torch.Tensor):
        yield "", output
        return
    found = _walk(output, ())
    if mode == "first":
        for _, tensor in found:
            yield "", tensor
            return
    else:
        for path, tensor in found:
            yield "/" + ".".join(path), tensor


def first_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor of a module's output (``output`` itself if it is one), or ``None``.

    Example:
        >>> first_tensor((None, [torch.ones(2)])).shape
        torch.Size([2])
    """
    if isinstance(output, torch.Tensor):
        return output
    for _, tensor in output_tensors(output):
        return tensor
    return None


def layers_by_module(layers: Iterable[tuple[str, nn.Module]]) -> dict[int, tuple[Any, ...]]:
    """``id(module) -> (module, name, batch dim, name, batch dim, ...)``: what one shared forward hook looks up.

    One tuple per module (a step allocates few objects); a module watched under two names is listed once, with both.

    Example:
        >>> lstm = nn.LSTM(2, 2)
        >>> [entry[1:] for entry in layers_by_module([("rnn", lstm), ("alias", lstm)]).values()]
        [('rnn', 1, 'alias', 1)]
    """
    found: dict[int, tuple[Any, ...]] = {}
    for name, module in layers:
        found[id(module)] = (*found.get(id(module), (module,)), name, batch_dim_of(module))
    return found


def _walk(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _walk(item, (*path, str(index)))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, (*path, str(key)))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _walk(getattr(value, field.name, None), (*path, field.name))


def nested_values(tensor: torch.Tensor) -> torch.Tensor:
    """Every element of a nested (ragged) tensor, as one flat tensor: what its statistics are taken over.

    Example:
        >>> nt = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
        >>> nested_values(nt).shape
        torch.Size([18])
    """
    if tensor.layout == torch.jagged:
        return tensor.values().reshape(-1)
    return torch.cat([part.reshape(-1) for part in tensor.unbind()])


def shape_of(tensor: torch.Tensor) -> tuple[Any, ...]:
    """``tuple(tensor.shape)``; a ragged dimension of a nested tensor shows as ``"*"``.

    Example:
        >>> shape_of(torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged))
        (2, '*', 3)
    """
    if not tensor.is_nested:
        return tuple(tensor.shape)
    try:
        return tuple(size if isinstance(size, int) else "*" for size in tensor.shape)
    except Exception:  # noqa: BLE001 - a strided nested tensor has no shape
        return (tensor.size(0), "*")


def reduce_output(
    tensor: torch.Tensor, options: CaptureOptions, *, stats: bool = True, draw: bool = True, batch_dim: int = 0,
    outliers: bool = False, units: tuple[float, ...] = (),
) -> tuple[Reduction | None, tuple[Draw, torch.Tensor] | None]:
    """The per-layer work on one output tensor, shared by the watcher's hooks and :func:`actviz.report`.

    Returns the device half of its summary (``None`` unless ``stats``) and of its picture
    (``None`` unless ``draw`` and the tensor is 3-D or 4-D; ``outliers`` and ``units`` add the outlier numbers
    and a unit fraction to the summary's row where the one-pass op makes it): see
    :func:`~actviz.summaries.one_tensor.reduce_tensor` and :func:`~actviz.pictures.rendering.picture_source`.
    :func:`~actviz.summaries.one_tensor.finish` and ``draw(source)`` complete them on the host.
    A watcher's hook does the same by :func:`~actviz.summaries.one_tensor.start_summary`, where a tensor its sample
    covers whole is copied once instead (:func:`copied_picture`).
    """
    # A grid of a few of many channels picks them by the strengths the summary's read gives (where the one-pass op makes it).
    many = draw and tensor.dim() == 4 and tensor.shape[1] > options.max_channels
    reduction = reduce_tensor(tensor, options.histogram_sample_size, outliers=outliers, units=units,
                              strengths=many) if stats else None
    strengths = reduction.strengths if reduction is not None else None
    picture = picture_source(tensor, options.max_channels, batch_dim, strengths=strengths) if draw else None
    return reduction, picture


def copied_picture(copy: torch.Tensor, max_channels: int, batch_dim: int) -> tuple[Draw, torch.Tensor] | None:
    """The picture of a layer output that a watcher's step copied whole (:func:`~actviz.summaries.one_tensor.start_summary`'s
    :attr:`~actviz.summaries.one_tensor.PendingSummary.copy`): a grid of every channel is drawn on the host from the copy
    itself (:func:`~actviz.pictures.rendering.draw_first_grid`), which goes there anyway; otherwise the source is taken
    from the copy, on its device.

    Example:
        >>> from actviz.summaries.one_tensor import start_summary
        >>> from actviz.summaries.small_tensors import SmallTensors
        >>> summary = start_summary(torch.rand(2, 3, 4, 4), None, SmallTensors(cpu_shortcut=False))
        >>> draw, source = copied_picture(summary.copy, max_channels=8, batch_dim=0)
        >>> source is summary.copy, draw(source).shape  # sample 0's 3 channels: 32-pixel tiles, 2 × 2
        (True, torch.Size([1, 70, 70]))
    """
    if copy.dim() == 4 and copy.shape[1] <= max_channels:  # every channel of sample 0: drawn from the copy itself
        return partial(draw_first_grid, tuple(copy.shape[1:])), copy
    return picture_source(copy, max_channels, batch_dim, copied=True)


#: Layers that map each channel of each sample through an affine function (BatchNorm in training
#: and eval, InstanceNorm, GroupNorm). With every channel normalised on its own, their grid is
#: their input's grid again, pixel for pixel (inverted where the weight is negative).
PER_CHANNEL_AFFINE: tuple[type[nn.Module], ...] = (*batch_and_instance_norm_types(), nn.GroupNorm)


def batch_dim_of(module: nn.Module) -> int:
    # nn.LSTM, nn.GRU, nn.MultiheadAttention and nn.Transformer* put time first unless batch_first=True.
    # Read from the instance's dict: a missing attribute would raise inside nn.Module.__getattr__ on every step.
    value = vars(module).get("batch_first", getattr(type(module), "batch_first", True))
    return 1 if value is False else 0


def layer_table(layers: list[tuple[str, nn.Module]], shapes: dict[str, tuple[int, ...]],
                module_names: dict[str, str] | None = None) -> str:
    """A markdown table of watched layers: tag name, type, output shape (``-`` if it did not run), parameters, and,
    where a tag name is shortened (:func:`actviz.selection.layer_tag_names`), each module's ``named_modules()`` name.

    Example:
        >>> print(layer_table([("fc", nn.Linear(3, 2))], {"fc": (8, 2)}))
        | layer | type | output shape | parameters |
        |---|---|---|---|
        | fc | Linear | 8 × 2 | 8 |
        >>> print(layer_table([("0.query", nn.Linear(3, 2))], {}, {"0.query": "encoder.layer.0.query"}))
        | layer | type | output shape | parameters | module |
        |---|---|---|---|---|
        | 0.query | Linear | - | 8 | encoder.layer.0.query |
    """
    full = {name: module_names[name] for name, _ in layers if module_names and module_names.get(name, name) != name}
    lines = ["| layer | type | output shape | parameters |" + (" module |" if full else ""),
             "|---|---|---|---|" + ("---|" if full else "")]
    for name, module in layers:
        shape = " × ".join(str(size) for size in shapes[name]) if name in shapes else "-"
        count = sum(param.numel() for param in module.parameters())
        lines.append(f"| {name} | {type(module).__name__} | {shape} | {count:,} |" +
                     (f" {full.get(name, name)} |" if full else ""))
    return "\n".join(lines)


class DrawnTensors:
    """The tensors drawn in one step, to skip a norm layer whose grid would repeat its input's.

    A BatchNorm, InstanceNorm or GroupNorm shifts and scales each channel, and every channel
    is normalised on its own when drawn, so its grid is its input's again, pixel for pixel
    (inverted where its weight is negative). Tensors are kept by weak reference and version,
    so an in-place change since (a ReLU) makes the input count as not drawn.
    """

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self._versions: dict[int, int] = {}  # apart from the references: no tuple per tensor

    def add(self, tensor: torch.Tensor) -> None:
        self._refs[id(tensor)] = weakref.ref(tensor)
        self._versions[id(tensor)] = tensor_version(tensor)

    def would_repeat(self, module: nn.Module, inputs: Any) -> bool:
        """True if ``module`` is per-channel affine and its first input is a grid drawn this step, unchanged."""
        if not isinstance(module, PER_CHANNEL_AFFINE):
            return False
        first = inputs[0] if isinstance(inputs, tuple) and inputs else None
        if not isinstance(first, torch.Tensor) or first.dim() != 4:  # only grids repeat; heat maps do not
            return False
        drawn = self._refs.get(id(first))
        return drawn is not None and drawn() is first and self._versions[id(first)] == tensor_version(first)
