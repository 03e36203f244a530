"""``actviz.watch(model, log_dir)``: check every argument, then compose a :class:`~actviz.watcher.Watcher`.

Everything is checked before the model or the disk is touched, so a bad argument
leaves no hook and no run folder behind.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .options import DEFAULT_BINS, DEFAULT_MAX_CHANNELS, DEFAULT_SAMPLE_SIZE, CaptureOptions
from .schedule import Schedule, ScheduleSpec
from .selection import LayerSpec, select_layers
from .sinks import TensorBoardSink, use_fast_crc
from .watcher import Watcher, open_watchers

__all__ = ["watch"]


def _is_logging_rank() -> bool:
    """Only rank 0 writes when torch.distributed is initialised."""
    distributed = torch.distributed
    return not (distributed.is_available() and distributed.is_initialized()) or distributed.get_rank() == 0


def _is_summary_writer(writer: Any) -> bool:
    from torch.utils.tensorboard import SummaryWriter

    return isinstance(writer, SummaryWriter)


def _prepare_log_dir(log_dir: str | os.PathLike[str]) -> str:
    path = Path(log_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(f"cannot create log_dir '{path}': {reason}") from error
    return str(path)


def watch(
    model: nn.Module,
    log_dir: str | os.PathLike[str] | None = None,
    *,
    writer: Any = None,
    every: ScheduleSpec = 100,
    image_every: ScheduleSpec | None = None,
    layers: LayerSpec | Iterable[LayerSpec] | None = None,
    max_channels: int = DEFAULT_MAX_CHANNELS,
    bins: int = DEFAULT_BINS,
    histogram_sample_size: int | None = DEFAULT_SAMPLE_SIZE,
    outputs: Literal["first", "all"] = "first",
    auto_step: bool = True,
    strict: bool = False,
) -> Watcher:
    """Watch ``model`` while it trains and log what happens inside it to TensorBoard.

    Each forward call of ``model`` in training mode with grad enabled is one step,
    counted from 0. On steps picked by ``every`` the watched layers get histograms of
    their outputs and of the gradients flowing back into them, histograms of their
    parameters and parameter gradients, and scalars (mean, std, zero fraction,
    gradient norm, NaN/Inf counts). On steps picked by ``image_every`` their outputs
    are drawn as feature-map grids. Other steps carry no layer hooks at all.

    Args:
        model: The ``nn.Module`` to watch (a DDP wrapper works too).
        log_dir: Folder for a new ``SummaryWriter``; closed by :meth:`Watcher.close`.
            Give this or ``writer``, not both. With neither, ``SummaryWriter()``'s
            default ``runs/<date>_<host>`` is used.
        writer: A ``SummaryWriter`` you own. actviz writes to it and never closes it.
        every: When to log histograms and scalars: every N steps (step 0 included),
            a collection of step numbers, or a function ``step -> bool``.
        image_every: When to log feature maps; same forms as ``every``, which it defaults to.
        layers: Which layers to watch. ``None`` means every module that owns parameters
            (Conv, Linear, norms, Embedding, RNNs, attention). Otherwise one or a list of:
            a module type (``nn.Conv2d``), a keyword (``"conv"``, ``"relu"``, ``"all"``: see
            :data:`actviz.selection.LAYER_KEYWORDS`), a name (``"features.0"``), a glob on
            names (``"classifier.*"``), a module object, or a predicate ``(name, module) -> bool``.
        max_channels: Most channels drawn per feature-map grid; the strongest are kept.
        bins: Number of histogram buckets.
        histogram_sample_size: Bucket counts come from a strided sample of at most this
            many elements, scaled to the full count; ``None`` counts every element. The
            count, sum, sum of squares, min, max and all scalars always use every element.
        outputs: For modules that return tuples, lists or dicts: ``"first"`` logs the first
            tensor under the layer's name; ``"all"`` logs each tensor with its position as
            a suffix, e.g. ``lstm/0``, ``lstm/1.0``, ``lstm/1.1`` for ``(out, (h, c))``.
        auto_step: Count steps by training forwards. Set ``False`` to drive them yourself
            with :meth:`Watcher.set_step`.
        strict: Re-raise errors from actviz's hooks instead of warning once and skipping
            the layer.

    Returns:
        The open :class:`Watcher`. It is also a context manager.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or an option has the wrong type.
        ValueError: An option is out of range, both ``log_dir`` and ``writer`` are given,
            a layer spec matches nothing, or ``model`` is already watched.
        OSError: ``log_dir`` cannot be created.

    Example:
        >>> import actviz, tempfile, torch
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        ...                             torch.nn.Linear(144, 2))
        >>> with actviz.watch(model, tempfile.mkdtemp(), every=10) as viz:
        ...     loss = model(torch.randn(8, 3, 8, 8)).sum()
        ...     loss.backward()
        >>> viz.layer_names
        ['0', '3']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    options = CaptureOptions(
        bins=bins, histogram_sample_size=histogram_sample_size, max_channels=max_channels, outputs=outputs
    )
    for flag_name, flag in (("auto_step", auto_step), ("strict", strict)):
        if not isinstance(flag, bool):
            raise TypeError(f"{flag_name} must be True or False, got {flag!r}")
    stats_schedule = Schedule.parse(every, "every")
    image_schedule = stats_schedule if image_every is None else Schedule.parse(image_every, "image_every")
    if log_dir is not None and writer is not None:
        raise ValueError("give log_dir or writer, not both: actviz writes to one SummaryWriter")
    if writer is not None and not _is_summary_writer(writer):
        raise TypeError(f"writer must be a torch.utils.tensorboard.SummaryWriter, got {type(writer).__name__}")
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"log_dir must be a path, got {type(log_dir).__name__}: {log_dir!r}")
    chosen = select_layers(model, layers)
    existing = open_watchers.get(model)
    if existing is not None and existing() is not None and not existing().closed:
        raise ValueError(
            f"this {type(model).__name__} is already watched; close the first watcher "
            "(viz.close()) before watching it again"
        )

    sink = None
    if _is_logging_rank():  # created last, so a bad argument leaves no folder behind
        use_fast_crc()  # process-wide and fail-safe: see actviz.sinks.use_fast_crc
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            owned = SummaryWriter(_prepare_log_dir(log_dir) if log_dir is not None else None)
            sink = TensorBoardSink(owned, owns_writer=True)
        else:
            sink = TensorBoardSink(writer, owns_writer=False)
    return Watcher(model, chosen, sink, stats_schedule, image_schedule, options, auto_step, strict)
