"""The watcher: ``actviz.watch(model, log_dir)`` composes selection, capture and a sink.

Between logging steps the model carries one light forward pre-hook on its root
and nothing else. On a step the schedule picks, that hook attaches a
:class:`~actviz.capture.StepCapture` to the watched layers; the capture's
forward hooks come off when the model's forward returns, and its gradient
hooks when the backward pass ends, at which point the step is written.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .capture import CaptureOptions, StepCapture, StepResults
from .rendering import DEFAULT_MAX_CHANNELS
from .schedule import Schedule, ScheduleSpec
from .selection import LayerSpec, layer_display_name, select_layers
from .sinks import BackgroundSink, TensorBoardSink
from .summaries import DEFAULT_SAMPLE_SIZE

__all__ = ["Watcher", "watch"]

logger = logging.getLogger(__name__)

# Models with an open watcher, so that a second watch() on the same model fails loudly.
_open_watchers: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Watcher]] = weakref.WeakKeyDictionary()


def _check_positive(name: str, value: object, example: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}; for example {name}={example}")


def _is_logging_rank() -> bool:
    """Only rank 0 writes when torch.distributed is initialised."""
    distributed = torch.distributed
    return not (distributed.is_available() and distributed.is_initialized()) or distributed.get_rank() == 0


def _prepare_log_dir(log_dir: str | os.PathLike[str]) -> str:
    path = Path(log_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(f"cannot create log_dir '{path}': {reason}") from error
    return str(path)


class Watcher:
    """Logs what happens inside a model while it trains. Make one with :func:`watch`.

    Use it as a context manager or call :meth:`close` when done. Attributes worth
    reading: :attr:`layer_names`, :attr:`parameter_names`, :attr:`step`, :attr:`writer`.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[tuple[str, nn.Module]],
        sink: TensorBoardSink | None,
        stats_schedule: Schedule,
        image_schedule: Schedule,
        options: CaptureOptions,
        auto_step: bool,
        strict: bool,
    ) -> None:
        self.model = model
        self._layers = [(layer_display_name(name), module) for name, module in layers]
        self._parameters = _parameters_of(model, [module for _, module in layers])
        # strict writes on the training thread, so that a failed write raises there.
        self._sink: TensorBoardSink | BackgroundSink | None = sink
        if sink is not None and not strict:
            self._sink = BackgroundSink(sink, on_error=self._on_background_write_error)
        self._stats_schedule = stats_schedule
        self._image_schedule = image_schedule
        self._options = options
        self.auto_step = auto_step
        self.strict = strict
        self._next_step = 0
        self._last_started_step: int | None = None
        self._capture: StepCapture | None = None
        self._done_handle: RemovableHandle | None = None
        self._skipped: set[str] = set()
        self._warned_sink = False
        self._closed = False
        self._root_handle: RemovableHandle | None = None
        if sink is not None:  # ranks other than 0 attach nothing
            self._root_handle = model.register_forward_pre_hook(self._on_model_forward)
        _open_watchers[model] = weakref.ref(self)

    # -- public ------------------------------------------------------------------------------

    @property
    def layer_names(self) -> list[str]:
        """Tag names of the watched layers, in model order."""
        return [name for name, _ in self._layers]

    @property
    def parameter_names(self) -> list[str]:
        """Names of the watched parameters, as ``named_parameters()`` gives them."""
        return [name for name, _ in self._parameters]

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter`` written to, or ``None`` on ranks other than 0."""
        return None if self._sink is None else self._sink.writer

    @property
    def step(self) -> int:
        """The step number the next training forward will get."""
        return self._next_step

    @property
    def closed(self) -> bool:
        return self._closed

    def set_step(self, step: int) -> None:
        """Set the step number of the next training forward.

        With ``auto_step=True`` (the default) the count goes on from there. With
        ``auto_step=False`` forwards never advance it: call ``set_step`` with your
        trainer's global step before each forward, and only the first training
        forward of a scheduled step logs (the right thing for gradient accumulation).

        Example:
            >>> import actviz, tempfile, torch
            >>> with actviz.watch(torch.nn.Linear(4, 2), tempfile.mkdtemp(), auto_step=False) as viz:
            ...     viz.set_step(1000)
            ...     viz.step
            1000
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._next_step = step

    def flush(self) -> None:
        """Write the pending step, if any, and flush the writer."""
        self._finish_capture()
        if self._sink is not None:
            self._sink.flush()

    def close(self) -> None:
        """Remove every hook, write what is pending, flush, and close the writer if :func:`watch` made it.

        Safe to call more than once.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._root_handle is not None:
                self._root_handle.remove()
            self._finish_capture()
        finally:
            if _open_watchers.get(self.model) is not None and _open_watchers[self.model]() is self:
                del _open_watchers[self.model]
            if self._sink is not None:
                self._sink.close()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()  # errors from the with-block propagate

    def __repr__(self) -> str:
        log_dir = getattr(self.writer, "log_dir", None)
        return (
            f"Watcher(model={type(self.model).__name__}, layers={len(self._layers)}, "
            f"log_dir={log_dir!r}, step={self._next_step}, closed={self._closed})"
        )

    # -- hooks -------------------------------------------------------------------------------

    def _on_model_forward(self, model: nn.Module, args: Any) -> None:
        if not (model.training and torch.is_grad_enabled()):
            return  # eval and no-grad forwards are not steps
        try:
            self._start_step(model)
        except Exception as error:  # noqa: BLE001 - never stop training
            self._report("(watcher)", error)

    def _start_step(self, model: nn.Module) -> None:
        if self._done_handle is not None:
            return  # the model called itself inside a logging forward: same step
        step = self._next_step
        if not self.auto_step and step == self._last_started_step:
            # A later micro-batch, a second forward before one backward (siamese models) or a
            # nested call: same step, and its pending gradients are still to come.
            return
        self._finish_capture()  # a step whose backward never came
        if self.auto_step:
            self._next_step += 1
        self._last_started_step = step
        want_stats = self._stats_schedule(step)
        want_images = self._image_schedule(step)
        if not (want_stats or want_images):
            return
        self._capture = StepCapture(
            step,
            [(name, module) for name, module in self._layers if name not in self._skipped],
            [(name, param) for name, param in self._parameters if name not in self._skipped],
            want_stats=want_stats,
            want_images=want_images,
            options=self._options,
            on_error=self._report,
            on_backward_done=self._on_backward_done,
        )
        self._done_handle = model.register_forward_hook(self._on_model_forward_done, always_call=True)

    def _on_model_forward_done(self, model: nn.Module, args: Any, output: Any) -> None:
        if self._done_handle is not None:
            self._done_handle.remove()
            self._done_handle = None
        capture = self._capture
        if capture is None:
            return
        capture.detach_layer_hooks()
        if not capture.expects_backward or output is None:  # None: the forward raised
            self._finish_capture()

    def _on_backward_done(self, capture: StepCapture) -> None:
        if capture is self._capture:
            self._finish_capture()

    def _finish_capture(self) -> None:
        """Remove the current capture's hooks and write its results."""
        if self._done_handle is not None:
            self._done_handle.remove()
            self._done_handle = None
        capture, self._capture = self._capture, None
        if capture is None:
            return
        try:
            results = capture.collect()
            if self._sink is not None and not results.is_empty():
                self._sink.write(results)
        except Exception as error:  # noqa: BLE001 - a full disk must not stop training
            if self.strict:
                raise
            self._report_write_error(capture.step, error)
        finally:
            capture.close()

    def _on_background_write_error(self, results: StepResults, error: BaseException) -> None:
        self._report_write_error(results.step, error)

    def _report_write_error(self, step: int, error: BaseException) -> None:
        if not self._warned_sink:
            self._warned_sink = True
            warnings.warn(
                f"actviz could not write step {step}: {type(error).__name__}: {error}. "
                "Training goes on; later failures are logged at DEBUG level.",
                RuntimeWarning,
                stacklevel=2,
            )
        logger.debug("write failed", exc_info=error)

    def _report(self, name: str, error: BaseException) -> None:
        """A hook failed: re-raise if strict, else warn once and skip ``name`` from now on."""
        if self.strict:
            raise error
        if name in self._skipped:
            return
        self._skipped.add(name)
        warnings.warn(
            f"actviz skips {name!r} from now on: its hook raised {type(error).__name__}: {error}",
            RuntimeWarning,
            stacklevel=2,
        )


def _parameters_of(model: nn.Module, modules: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """The parameters of ``modules`` (with their children's), named as ``model.named_parameters()`` names them."""
    wanted: set[int] = set()
    for module in modules:
        wanted.update(id(param) for param in module.parameters())
    return [(name, param) for name, param in model.named_parameters() if id(param) in wanted]


def watch(
    model: nn.Module,
    log_dir: str | os.PathLike[str] | None = None,
    *,
    writer: Any = None,
    every: ScheduleSpec = 100,
    image_every: ScheduleSpec | None = None,
    layers: LayerSpec | Iterable[LayerSpec] | None = None,
    max_channels: int = DEFAULT_MAX_CHANNELS,
    bins: int = 64,
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
            a module type (``nn.Conv2d``), a name (``"features.0"``), a glob on names
            (``"classifier.*"``), a module object, or a predicate ``(name, module) -> bool``.
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
    _check_positive("max_channels", max_channels, DEFAULT_MAX_CHANNELS)
    _check_positive("bins", bins, 64)
    if histogram_sample_size is not None:
        _check_positive("histogram_sample_size", histogram_sample_size, DEFAULT_SAMPLE_SIZE)
    if outputs not in ("first", "all"):
        raise ValueError(f"outputs must be 'first' or 'all', got {outputs!r}")
    for flag_name, flag in (("auto_step", auto_step), ("strict", strict)):
        if not isinstance(flag, bool):
            raise TypeError(f"{flag_name} must be True or False, got {flag!r}")
    stats_schedule = Schedule.parse(every, "every")
    image_schedule = stats_schedule if image_every is None else Schedule.parse(image_every, "image_every")
    if log_dir is not None and writer is not None:
        raise ValueError("give log_dir or writer, not both: actviz writes to one SummaryWriter")
    if writer is not None and not callable(getattr(writer, "add_histogram_raw", None)):
        raise TypeError(f"writer must be a torch.utils.tensorboard.SummaryWriter, got {type(writer).__name__}")
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"log_dir must be a path, got {type(log_dir).__name__}: {log_dir!r}")
    chosen = select_layers(model, layers)
    existing = _open_watchers.get(model)
    if existing is not None and existing() is not None and not existing().closed:
        raise ValueError(
            f"this {type(model).__name__} is already watched; close the first watcher "
            "(viz.close()) before watching it again"
        )

    sink = None
    if _is_logging_rank():  # created last, so a bad argument leaves no folder behind
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            owned = SummaryWriter(_prepare_log_dir(log_dir) if log_dir is not None else None)
            sink = TensorBoardSink(owned, owns_writer=True)
        else:
            sink = TensorBoardSink(writer, owns_writer=False)
    options = CaptureOptions(
        bins=bins, sample_size=histogram_sample_size, max_channels=max_channels, outputs=outputs
    )
    return Watcher(model, chosen, sink, stats_schedule, image_schedule, options, auto_step, strict)
