"""``actviz.watch(model, log_dir)``: check every argument, then compose a :class:`~actviz.watcher.Watcher`.

Everything is checked before the model or the disk is touched, so a bad argument
leaves no hook and no run folder behind.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .diagnosis.alerts import Alert, check_alerts
from .capture.compiled_model import unwrap_compiled
from .diagnosis.step_diagnosis import make_diagnosis
from .output.open_watchers import watching
from .extras import Probe as ActvizProbe
from .extras import Spikes, check_extras
from .options import CaptureOptions, Options
from .common.results import StepResults
from .output.sink import FanOutSink, check_sink
from .output.step_callbacks import StepCallbacks
from .output.tensorboard import TensorBoardSink, use_fast_crc
from .capture.probe import ProbeForward, check_probe, gradcam_layers, try_probe
from .output.run_notes import RunNotes
from .output.run_folders import check_name_lengths, warn_if_reused, warn_if_shared
from .schedule import DEFAULT_IMAGE_PERIOD, Schedule, ScheduleSpec
from .selection import LayerSpec, layer_display_name, layer_tag_names, select_layers
from .statistics import LayerStatistic, resolve_statistics
from .watcher import Watcher

__all__ = ["REMOVED_KEYWORDS", "watch"]


def _is_logging_rank() -> bool:
    """Only rank 0 writes when torch.distributed is initialised."""
    distributed = torch.distributed
    return not (distributed.is_available() and distributed.is_initialized()) or distributed.get_rank() == 0


def _world_size() -> int:
    distributed = torch.distributed
    return distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1


def _is_summary_writer(writer: Any) -> bool:
    from torch.utils.tensorboard import SummaryWriter

    return isinstance(writer, SummaryWriter)


def _check_log_dir(log_dir: Any) -> None:
    """A non-empty path that TensorBoard can write: it puts the folder's name in UTF-8 into its files."""
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(f"log_dir must be a path, got {type(log_dir).__name__}: {log_dir!r}; for example log_dir='runs/exp1'")
    path = os.fspath(log_dir)
    if not isinstance(path, str):
        raise TypeError(f"log_dir must be a str path, got bytes: {path!r}; for example log_dir='runs/exp1'")
    if not path:
        raise ValueError("log_dir must not be empty (it would write into the current folder); for example "
                         "log_dir='runs/exp1', or leave it out for runs/<date>_<host>")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"log_dir must be encodable as UTF-8 (TensorBoard writes the folder's name in UTF-8), got "
                         f"{path!r}; for example log_dir='runs/exp1'") from None
    check_name_lengths(path)


def _check_not_scripted(model: nn.Module) -> None:
    """TorchScript runs its modules without Python hooks: nothing would be logged, or hooks fail to attach."""
    for name, module in unwrap_compiled(model).named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            where = "model" if not name else f"model's submodule {name!r}"
            raise TypeError(
                f"the {where} is a {type(module).__name__} (torch.jit.script or torch.jit.trace), which runs "
                "without the Python hooks actviz needs; watch the nn.Module itself, for example "
                "actviz.watch(model, 'runs/exp1') before torch.jit.script(model)"
            )


def _prepare_log_dir(log_dir: str | os.PathLike[str]) -> str:
    path = Path(log_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(f"cannot create log_dir '{path}': {reason}") from error
    return str(path)


#: Each keyword :func:`watch` no longer takes -> its new spelling, as the ``TypeError`` names it.
REMOVED_KEYWORDS: dict[str, str] = {
    "writer": "sink=writer (a SummaryWriter given as a sink is written to and never closed)",
    **{name: f"options=actviz.Options({name}=...)" for name in (
        "max_channels", "bins", "histogram_sample_size", "outputs", "auto_step", "strict", "grad_scaler",
        "merge_ranks")},
    "transformer_stats": "statistics=['default', 'transformer'] to turn them on, or a list without 'transformer' "
                         "(e.g. statistics=['moments', 'dead_channels', 'saturation']) to turn them off",
    "moe": "statistics=['default', 'moe'] to turn it on, or a list without 'moe' to turn it off",
    "update_ratio": "statistics=['default', 'update_ratio']",
    "gradient_noise": "statistics=['default', 'gradient_noise']",
    "probe": "extras=[actviz.Probe(batch)]",
    "gradcam": "extras=[actviz.Probe(batch, gradcam=...)]",
    "spikes": "extras=[actviz.Spikes()]",
}


def removed_keyword_error(name: str, owner: str = "watch()") -> TypeError:
    """The ``TypeError`` for a keyword :func:`watch` no longer takes.

    Example:
        >>> print(removed_keyword_error("spikes"))
        watch() no longer takes spikes=; pass extras=[actviz.Spikes()]
    """
    return TypeError(f"{owner} no longer takes {name}=; pass {REMOVED_KEYWORDS[name]}")


def _reject_removed_keywords(function: Callable[..., Watcher]) -> Callable[..., Watcher]:
    """``function``, raising :func:`removed_keyword_error` for an old keyword instead of Python's own message."""

    @functools.wraps(function)
    def checked(*args: Any, **kwargs: Any) -> Watcher:
        for name in kwargs:
            if name in REMOVED_KEYWORDS:
                raise removed_keyword_error(name)
        return function(*args, **kwargs)

    return checked


def _sinks(sink: Any) -> tuple[Any, list[Any]]:
    """``watch(sink=...)`` -> ``(the SummaryWriter given, the other sinks)``, each checked."""
    if sink is None:
        return None, []
    given = list(sink) if isinstance(sink, (list, tuple)) else [sink]
    writers = [item for item in given if _is_summary_writer(item)]
    if len(writers) > 1:
        raise ValueError("sink= holds two SummaryWriters; actviz writes to one, give one")
    others = [item for item in given if not _is_summary_writer(item)]
    for item in others:
        if isinstance(item, type):
            raise TypeError(f"sink must be an object, got the class {item.__name__}; for example "
                            f"sink={item.__name__}()")
        check_sink(item)
    return (writers[0] if writers else None), others


@_reject_removed_keywords
def watch(
    model: nn.Module,
    log_dir: str | os.PathLike[str] | None = None,
    *,
    sink: Any = None,
    every: ScheduleSpec | None = None,
    image_every: ScheduleSpec | None = None,
    layers: LayerSpec | Iterable[LayerSpec] | None = None,
    statistics: Sequence[str | LayerStatistic] | None = None,
    extras: Sequence[ActvizProbe | Spikes] | None = None,
    alerts: bool | dict[str, float] = True,
    on_step: Callable[[StepResults], None] | None = None,
    on_alert: Callable[[Alert], None] | None = None,
    options: Options | None = None,
) -> Watcher:
    """Watch ``model`` while it trains and log what happens inside it to TensorBoard.

    Each forward call of ``model`` in training mode with grad enabled is one step,
    counted from 0. On steps picked by ``every`` the watched layers get histograms of
    their outputs and of the gradients flowing back into them, histograms of their
    parameters and parameter gradients, and the statistics of ``statistics``. On steps
    picked by ``image_every`` their outputs are drawn as feature-map grids. Other steps
    carry no layer hooks at all.

    Args:
        model: The ``nn.Module`` to watch (a DDP wrapper works too).
        log_dir: Folder for a new ``SummaryWriter``; closed by :meth:`Watcher.close`. Not empty,
            and encodable as UTF-8. With neither it nor ``sink``, ``SummaryWriter()``'s default
            ``runs/<date>_<host>`` is used.
        sink: Where else to write, one or a list of: a ``SummaryWriter`` you own (actviz writes to it and
            never closes it; not with ``log_dir``), or any object with ``write(results)``, ``flush()`` and
            ``close()`` (:class:`actviz.output.sink.Sink`), which gets each step's
            :class:`~actviz.common.results.StepResults` on the writer thread and ``close()`` when the watcher
            closes; one that raises is warned about once and training goes on. Sinks alone write no folder.
        every: When to log histograms and statistics: every N steps (step 0 included, exactly every N), a
            collection of step numbers (a ``range`` of any length), a function ``step -> bool``, or ``False``
            for never. Python ints, not tensors. ``None``, the default, is dense at first, then every 100:
            steps 0 to 9, every 10th up to 990, then every 100th (:func:`actviz.schedule.default_step`), so
            that a short run draws a curve and a long one logs as ``every=100`` would.
        image_every: When to log feature maps; same forms as ``every``. ``None`` is ``every``'s schedule when
            ``every`` is given, and every 100 steps (step 0 included) when it is not: the default's dense
            start logs no pictures. ``image_every=False`` turns pictures off.
        layers: Which layers to watch. ``None`` means every module that owns parameters
            (Conv, Linear, norms, Embedding, RNNs, attention). Otherwise one or a list of:
            a module type (``nn.Conv2d``), a keyword (``"conv"``, ``"relu"``, ``"all"``: see
            :data:`actviz.selection.LAYER_KEYWORDS`), a name (``"features.0"``), a glob on
            names (``"classifier.*"``), a module object, or a predicate ``(name, module) -> bool``.
        statistics: Every per-step number besides the histograms (:mod:`actviz.statistics.registry`):
            ``None`` for the default set, or a list of names and
            :class:`~actviz.statistics.layer_statistic.LayerStatistic` objects of your own, which runs only
            what it names. ``"default"`` is the default set: add to it in one line,
            ``["default", "update_ratio", "gradient_noise"]``. Names: ``"moments"`` (mean, std, zero fraction,
            NaN/Inf), ``"dead_channels"``, ``"saturation"``, ``"outliers"``, ``"logits"``, ``"attention"``,
            ``"moe"`` (docs/moe.md), ``"update_ratio"`` (‖w_after - w_before‖ / ‖w_before‖ across the update
            after each stats step; it holds a copy of the watched parameters for one step),
            ``"update_rms"``, ``"update_lost"``, ``"adam_epsilon"`` (of the update each stats step's optimizer
            step applies: its RMS, the fraction rounding dropped, the fraction where Adam's ε exceeds √v̂;
            docs/diagnosis.md), ``"gradient_noise"`` (docs/gradient-noise.md), ``"loss"`` (the value of the tensor
            each stats step's backward pass starts from, as ``loss/backward_root``: the loss; in the default set
            unless ``sink`` is a ``SummaryWriter`` of yours, where your own loss is), and ``"transformer"`` for ``"attention"``,
            ``"outliers"`` and ``"logits"``. The default set runs the transformer ones on models with an
            attention module and ``"moe"`` on models with a MoE, router, gate or expert module; named, they
            run on any model.
        extras: Features that are not numbers, in a list: ``actviz.Probe(batch, gradcam=...)``, a fixed batch
            drawn on image steps with Grad-CAM over it (:class:`actviz.extras.Probe`), and
            ``actviz.Spikes()``, the gradient-spike recorder (:class:`actviz.extras.Spikes`).
        alerts: Health alerts per layer (non-finite values, vanishing and exploding gradients, dead
            units, saturation, update ratio, and the optimizer audit's findings; see docs/diagnosis.md):
            ``True``, ``False``, or a dict
            that overrides thresholds of :data:`actviz.diagnosis.alerts.DEFAULT_THRESHOLDS` (fractions in
            (0, 1], step counts whole numbers; :func:`~actviz.diagnosis.alerts.check_alerts`). Each alert is a
            ``RuntimeWarning``, a line of the ``alerts`` text and an entry of :attr:`Watcher.alerts`.
        on_step: Called with each written step's :class:`~actviz.common.results.StepResults`, on
            the writer thread: ``results.statistics()`` maps every tag to its count, mean,
            std, min, max, norm and NaN/Inf count. For early stopping on NaN, tests, or
            another tracker, without reading event files. :attr:`Watcher.latest` keeps the
            last one. What it raises, ``SystemExit`` included, is warned about once (raised with
            ``Options(strict=True)``); the step is written before it runs.
        on_alert: Called with each :class:`~actviz.diagnosis.alerts.Alert`, on the writer thread, once
            the step the alert was found in is written to every sink: a callback that raises or calls
            ``sys.exit()`` leaves that step on disk. An exception it raises is warned about; ``SystemExit``
            and ``KeyboardInterrupt`` are warned about once, or raised on the training thread with
            ``Options(strict=True)``.
        options: Sizes and mechanics, an :class:`actviz.Options`: histogram bins and sample size, channels
            per grid, tuple outputs, ``auto_step``, ``strict``, the AMP ``grad_scaler``, ``merge_ranks``, and
            ``flow_pictures`` (the ``flow/*`` pictures, off by default: TensorBoard's actviz tab and ``actviz export``
            show every layer over time from the scalars), and ``quiet`` (no line at the start and end of the run).

    Returns:
        The open :class:`Watcher`. It is also a context manager.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or is a TorchScript module, an argument has the wrong
            type (a tensor as a schedule, a sink class instead of an instance), or a keyword this function no
            longer takes (the message names the new spelling: :data:`REMOVED_KEYWORDS`).
        ValueError: An option is out of range, both ``log_dir`` and a ``SummaryWriter`` are given,
            a layer spec matches nothing, ``model`` is already watched, the model cannot
            take the probe, or a Grad-CAM layer does not exist or gives no ``(N, C, h, w)`` output.
        OSError: ``log_dir`` cannot be created.

    Example:
        >>> import actviz, tempfile, torch
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        ...                             torch.nn.Linear(144, 2))
        >>> with actviz.watch(model, tempfile.mkdtemp(), every=10, statistics=["default", "update_ratio"],
        ...                   options=actviz.Options(bins=32)) as viz:
        ...     loss = model(torch.randn(8, 3, 8, 8)).sum()
        ...     loss.backward()
        >>> viz.layer_names
        ['0', '3']
        >>> actviz.watch(model, spikes=True)
        Traceback (most recent call last):
        ...
        TypeError: watch() no longer takes spikes=; pass extras=[actviz.Spikes()]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_not_scripted(model)
    if options is None:
        options = Options()
    elif not isinstance(options, Options):
        raise TypeError(f"options must be an actviz.Options, got {type(options).__name__}: {options!r}; for example "
                        "options=actviz.Options(bins=32)")
    chosen_statistics = resolve_statistics(statistics)
    merge_ranks = options.merge_ranks and _world_size() > 1  # one process: nothing to merge
    capture = CaptureOptions(
        bins=options.bins, histogram_sample_size=options.histogram_sample_size, max_channels=options.max_channels,
        outputs=options.outputs, merge_ranks=merge_ranks, unit_counts=alerts is not False,
        flow_pictures=options.flow_pictures, **chosen_statistics,
    )
    update_ratio = capture.update_ratio
    writer, user_sinks = _sinks(sink)
    if capture.loss is None:  # auto: a SummaryWriter of the user's has the user's own loss
        capture = dataclasses.replace(capture, loss=writer is None)
    probe_extra, spikes_extra = check_extras(extras)
    probe = None if probe_extra is None else probe_extra.batch
    gradcam = None if probe_extra is None else probe_extra.gradcam
    spikes = spikes_extra is not None
    check_alerts(alerts)
    if on_alert is not None and not callable(on_alert):
        raise TypeError(f"on_alert must be a function alert -> None, got {type(on_alert).__name__}: {on_alert!r}")
    if spikes and capture.merge_ranks:  # rank 0 alone would log the steps after a spike: the ranks would wait
        raise ValueError("extras=[actviz.Spikes()] cannot be combined with Options(merge_ranks=True); use one or the other")
    stats_schedule = Schedule.default() if every is None else Schedule.parse(every, "every")
    if image_every is not None:
        image_schedule = Schedule.parse(image_every, "image_every")
    else:  # the default's dense start draws no pictures: they are the dear part of a step
        image_schedule = Schedule.parse(DEFAULT_IMAGE_PERIOD) if every is None else stats_schedule
    if stats_schedule.never and image_schedule.never:
        raise ValueError(
            "every=False with image_every left out or False logs nothing; turn off one kind only: "
            "every=False, image_every=100 for pictures alone, or image_every=False for histograms and scalars alone"
        )
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be a function results -> None, got {type(on_step).__name__}: {on_step!r}")
    if log_dir is not None and writer is not None:
        raise ValueError("give log_dir or a SummaryWriter as sink=, not both: actviz writes to one SummaryWriter")
    if log_dir is not None:
        _check_log_dir(log_dir)
    chosen = select_layers(unwrap_compiled(model), layers)  # plain names for torch.compile(model)
    tag_names = layer_tag_names(unwrap_compiled(model))
    check_probe(probe, model)
    cam_layers = gradcam_layers(unwrap_compiled(model), gradcam, probe)
    if watching(model) is not None:
        raise ValueError(
            f"this {type(model).__name__} is already watched; close the first watcher "
            "(viz.close()) before watching it again"
        )
    if probe is not None:
        try_probe(model, probe, cam_layers)  # one no-grad eval forward that leaves the model as it was

    sink = None
    if _is_logging_rank():  # created last, so a bad argument leaves no folder behind
        if writer is not None or log_dir is not None or not user_sinks:  # TensorBoard
            use_fast_crc()  # process-wide and fail-safe: see actviz.output.tensorboard.use_fast_crc
            if writer is None:
                from torch.utils.tensorboard import SummaryWriter

                if log_dir is not None:
                    warn_if_reused(log_dir)  # before the new writer adds its own file
                owned = SummaryWriter(_prepare_log_dir(log_dir) if log_dir is not None else None)
                sink = TensorBoardSink(owned, owns_writer=True, layout=True)
            else:
                sink = TensorBoardSink(writer, owns_writer=False, layout=True)
        if user_sinks:  # after TensorBoard's; their errors are warned about, never raised
            sink = FanOutSink([sink, *user_sinks], guard_from=1) if sink is not None else FanOutSink(user_sinks)
    callbacks = StepCallbacks(on_step, on_alert)  # called once their step is written
    # every rank reads its shards' gradient norms where rank 0 reads the norms (FSDP2: they are summed over the ranks)
    reads_norms = capture.gradient_clipping or spikes or check_alerts(alerts) is not None
    viz = Watcher(
        model, chosen, sink, stats_schedule, image_schedule, capture, options.auto_step, options.strict, reads_norms=reads_norms,
        grad_scaler=options.grad_scaler, callbacks=callbacks, diagnosis=None if sink is None else make_diagnosis(
            sink, unwrap_compiled(model), [(tag_names.get(n, layer_display_name(n)), m) for n, m in chosen], alerts, callbacks.hold,
            spikes, update_ratio, image_schedule, capture.flow_pictures),
        probe=None if probe is None else ProbeForward(
            probe, [(tag_names.get(name, layer_display_name(name)), module) for name, module in chosen], capture.max_channels, cam_layers
        ),
    )
    if sink is not None and sink.writer is not None:
        warn_if_shared(sink.writer.get_logdir(), viz, type(unwrap_compiled(model)).__name__)
    if sink is not None:  # the logging rank: a word on what is watched and where it goes
        viz.notes = RunNotes(type(unwrap_compiled(model)).__name__, len(viz.layer_names),
                             None if sink.writer is None else str(sink.writer.get_logdir()), stats_schedule,
                             image_schedule, options.quiet, tuple(type(item).__name__ for item in user_sinks))
        viz.notes.start()
    return viz
