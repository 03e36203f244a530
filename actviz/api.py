"""``actviz.watch(model, log_dir)``: check every argument, then compose a :class:`~actviz.watcher.Watcher`.

Everything is checked before the model or the disk is touched, so a bad argument
leaves no hook and no run folder behind.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .diagnosis.alerts import Alert, check_alerts
from .capture.amp import check_grad_scaler
from .capture.compiled_model import unwrap_compiled
from .diagnosis.step_diagnosis import make_diagnosis
from .output.open_watchers import watching
from .options import DEFAULT_BINS, DEFAULT_MAX_CHANNELS, DEFAULT_SAMPLE_SIZE, CaptureOptions
from .common.results import StepResults
from .output.sink import FanOutSink, Sink, check_sink
from .output.step_callbacks import StepCallbacks
from .output.tensorboard import TensorBoardSink, use_fast_crc
from .capture.probe import Probe, check_probe, gradcam_layers, try_probe
from .output.run_folders import warn_if_reused, warn_if_shared
from .schedule import Schedule, ScheduleSpec
from .selection import LayerSpec, layer_display_name, select_layers
from .statistics import LayerStatistic, check_statistics
from .watcher import Watcher

__all__ = ["watch"]


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


def watch(
    model: nn.Module,
    log_dir: str | os.PathLike[str] | None = None,
    *,
    writer: Any = None,
    sink: Sink | None = None,
    every: ScheduleSpec = 100,
    image_every: ScheduleSpec | None = None,
    layers: LayerSpec | Iterable[LayerSpec] | None = None,
    max_channels: int = DEFAULT_MAX_CHANNELS,
    bins: int = DEFAULT_BINS,
    histogram_sample_size: int | None = DEFAULT_SAMPLE_SIZE,
    outputs: Literal["first", "all"] = "first",
    auto_step: bool = True,
    strict: bool = False,
    grad_scaler: Any = None,
    merge_ranks: bool = False,
    transformer_stats: bool | None = None,
    moe: bool | None = None,
    statistics: Sequence[str | LayerStatistic] | None = None,
    on_step: Callable[[StepResults], None] | None = None,
    probe: Any = None,
    gradcam: bool | str | list[str] | None = None,
    update_ratio: bool = False,
    alerts: bool | dict[str, float] = True,
    on_alert: Callable[[Alert], None] | None = None,
    spikes: bool = False,
    gradient_noise: bool = False,
    flow_pictures: bool = False,
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
        log_dir: Folder for a new ``SummaryWriter``; closed by :meth:`Watcher.close`. Not empty,
            and encodable as UTF-8.
            Give this or ``writer``, not both. With neither (and no ``sink``),
            ``SummaryWriter()``'s default ``runs/<date>_<host>`` is used.
        writer: A ``SummaryWriter`` you own. actviz writes to it and never closes it.
        sink: Any object (an instance, not a class) with ``write(results)``, ``flush()`` and ``close()`` (:class:`actviz.output.sink.Sink`):
            it gets each step's :class:`~actviz.common.results.StepResults` on the writer thread, as
            TensorBoard does, and ``close()`` when the watcher closes. Alone, only it is written to
            (no ``SummaryWriter``, no folder); with ``log_dir`` or ``writer``, both are. A sink
            that raises is warned about once; training goes on.
        every: When to log histograms and scalars: every N steps (step 0 included), a collection
            of step numbers (a ``range`` of any length), a function ``step -> bool``, or ``False`` for
            never. Python ints, not tensors.
        image_every: When to log feature maps; same forms as ``every``, which it defaults to.
            ``image_every=False`` turns pictures off.
        layers: Which layers to watch. ``None`` means every module that owns parameters
            (Conv, Linear, norms, Embedding, RNNs, attention). Otherwise one or a list of:
            a module type (``nn.Conv2d``), a keyword (``"conv"``, ``"relu"``, ``"all"``: see
            :data:`actviz.selection.LAYER_KEYWORDS`), a name (``"features.0"``), a glob on
            names (``"classifier.*"``), a module object, or a predicate ``(name, module) -> bool``.
        max_channels: Most channels drawn per feature-map grid; the strongest are kept.
        bins: Number of histogram buckets, 1 to 4096.
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
        grad_scaler: The ``torch.amp.GradScaler`` of a mixed-precision loop. Gradients flow
            back multiplied by its scale; with the scaler given, every logged gradient is the
            true one, and each stats step also writes its scale as ``amp/grad_scale``.
        merge_ranks: Under ``torch.distributed``, log every rank's data, not rank 0's
            alone: every rank hooks the same logging steps, and a few collectives per step
            merge the activations, output gradients and sharded (FSDP2) parameters of all
            ranks before rank 0 writes. Every rank must then call :func:`watch`,
            ``viz.flush()`` and ``viz.close()`` alike. The default (``False``) runs no
            collective at all: rank 0 logs its own share.
        on_step: Called with each written step's :class:`~actviz.common.results.StepResults`, on
            the writer thread: ``results.statistics()`` maps every tag to its count, mean,
            std, min, max, norm and NaN/Inf count. For early stopping on NaN, tests, or
            another tracker, without reading event files. :attr:`Watcher.latest` keeps the
            last one. What it raises, ``SystemExit`` included, is warned about once (raised with
            ``strict=True``); the step is written before it runs.
        transformer_stats: Attention, output-logit and outlier statistics (docs/transformers.md): ``None``
            (the default) for models with an attention module, ``True`` always, ``False`` never.
        moe: Mixture-of-experts router health (docs/moe.md): per router, the load of the busiest expert over
            the mean, the experts no token chose, the router's entropy and top-k margin, and the tokens per expert.
            ``None`` (the default) for models with a module whose class name says MoE, router, gate or expert,
            ``True`` always, ``False`` never.
        statistics: The per-layer statistics (:mod:`actviz.statistics`): ``None`` (the default) runs each
            built-in one where it is on by default; a list of built-in names (``"moments"``, ``"dead_channels"``,
            ``"saturation"``, ``"outliers"``, ``"logits"``) and :class:`~actviz.statistics.layer_statistic.LayerStatistic`
            objects of your own runs exactly those, on every watched layer they apply to (kurtosis of a CNN:
            ``["moments", "dead_channels", "saturation", "outliers"]``). A list without ``"moments"`` writes no
            ``activation_stats/{layer}/mean``, ``/std``, ``/zero_fraction`` or ``/nonfinite``.
        probe: A fixed batch the model takes (a tensor, or a tuple or dict of tensors), e.g.
            ``actviz.load_images(["cat.jpg"])``. On image steps it goes once through the model
            (no grad, eval mode, not a step) and ``feature_maps/*`` are drawn from its sample
            0, so the same picture moves through training; ``probe/input`` shows it.
            ``watch()`` sends it through once itself, the same way, so that a probe the model
            cannot take (a wrong shape or device) raises here; that forward changes nothing
            of the model (:func:`actviz.capture.probe.try_probe` says how).
        gradcam: With an image ``probe``: ``True`` draws Grad-CAM of the last ``Conv2d`` over probe
            sample 0 as ``gradcam/{layer}`` on image steps; a layer name or a list picks others.
            Each must be a layer that the probe's forward runs and whose output is ``(N, C, h, w)``.
        update_ratio: Log ``update_ratio/{param}`` = ||w_after - w_before|| / ||w_before|| across
            the optimizer step that follows each stats step, under that step's number: the
            per-layer learning-rate check (around 1e-3 is healthy). It holds a copy of the
            watched parameters for one step, which is why it is off by default.
        alerts: Health alerts per layer (non-finite values, vanishing and exploding gradients, dead
            units, saturation, update ratio; see docs/diagnosis.md): ``True``, ``False``, or a dict
            that overrides thresholds of :data:`actviz.diagnosis.alerts.DEFAULT_THRESHOLDS` (fractions in
            (0, 1], step counts whole numbers; :func:`~actviz.diagnosis.alerts.check_alerts`). Each alert is a
            ``RuntimeWarning``, a line of the ``alerts`` text and an entry of :attr:`Watcher.alerts`.
        on_alert: Called with each :class:`~actviz.diagnosis.alerts.Alert`, on the writer thread, once
            the step the alert was found in is written to every sink: a callback that raises or calls
            ``sys.exit()`` leaves that step on disk. An exception it raises is warned about; ``SystemExit``
            and ``KeyboardInterrupt`` are warned about once, or raised on the training thread with ``strict=True``.
        spikes: Check the global gradient norm at every optimizer step (a few ops, no sync); on a
            spike, name the layers, write their last 16 gradient norms and log the next 3 steps in full.
        gradient_noise: Log the gradient noise scale of each stats step, ``gradient_noise/simple`` (B_simple of
            McCandlish et al. 2018) with ``/grad_squared`` and ``/trace_sigma``, from the per-example gradient
            norms of the watched ``nn.Linear``, ``nn.LayerNorm`` and ``nn.RMSNorm`` layers, taken in their hooks
            (:mod:`actviz.statistics.gradient_noise`; docs/gradient-noise.md). A few ops per such layer and step.
        flow_pictures: Also draw the ``flow/*`` pictures on image steps (docs/diagnosis.md). Off by default:
            TensorBoard's actviz tab and ``actviz export`` show every layer over time from the scalars.

    Returns:
        The open :class:`Watcher`. It is also a context manager.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or is a TorchScript module, or an option has the wrong
            type (a tensor as a schedule, a sink class instead of an instance).
        ValueError: An option is out of range, both ``log_dir`` and ``writer`` are given,
            a layer spec matches nothing, ``model`` is already watched, the model cannot
            take ``probe``, or a ``gradcam`` layer does not exist or gives no ``(N, C, h, w)`` output.
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
    _check_not_scripted(model)
    options = CaptureOptions(
        bins=bins, histogram_sample_size=histogram_sample_size, max_channels=max_channels, outputs=outputs,
        update_ratio=update_ratio, merge_ranks=merge_ranks, unit_counts=alerts is not False,
        transformer_stats=transformer_stats, moe=moe, statistics=check_statistics(statistics),
        gradient_noise=gradient_noise, flow_pictures=flow_pictures,
    )
    if merge_ranks and _world_size() == 1:
        options = dataclasses.replace(options, merge_ranks=False)  # one process: nothing to merge
    for flag_name, flag in (("auto_step", auto_step), ("strict", strict)):
        if not isinstance(flag, bool):
            raise TypeError(f"{flag_name} must be True or False, got {flag!r}")
    check_grad_scaler(grad_scaler)
    check_alerts(alerts)
    if on_alert is not None and not callable(on_alert):
        raise TypeError(f"on_alert must be a function alert -> None, got {type(on_alert).__name__}: {on_alert!r}")
    if not isinstance(spikes, bool):
        raise TypeError(f"spikes must be True or False, got {spikes!r}")
    if spikes and options.merge_ranks:  # rank 0 alone would log the steps after a spike: the ranks would wait
        raise ValueError("spikes=True cannot be combined with merge_ranks=True; use one or the other")
    stats_schedule = Schedule.parse(every, "every")
    image_schedule = stats_schedule if image_every is None else Schedule.parse(image_every, "image_every")
    if stats_schedule.never and image_schedule.never:
        raise ValueError(
            "every=False with image_every left out or False logs nothing; turn off one kind only: "
            "every=False, image_every=100 for pictures alone, or image_every=False for histograms and scalars alone"
        )
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be a function results -> None, got {type(on_step).__name__}: {on_step!r}")
    if log_dir is not None and writer is not None:
        raise ValueError("give log_dir or writer, not both: actviz writes to one SummaryWriter")
    if writer is not None and not _is_summary_writer(writer):
        raise TypeError(f"writer must be a torch.utils.tensorboard.SummaryWriter, got {type(writer).__name__}")
    if log_dir is not None:
        _check_log_dir(log_dir)
    if isinstance(sink, type):
        raise TypeError(f"sink must be an object, got the class {sink.__name__}; for example sink={sink.__name__}()")
    if sink is not None:
        check_sink(sink)
    chosen = select_layers(unwrap_compiled(model), layers)  # plain names for torch.compile(model)
    check_probe(probe, model)
    cam_layers = gradcam_layers(unwrap_compiled(model), gradcam, probe)
    if watching(model) is not None:
        raise ValueError(
            f"this {type(model).__name__} is already watched; close the first watcher "
            "(viz.close()) before watching it again"
        )
    if probe is not None:
        try_probe(model, probe, cam_layers)  # one no-grad eval forward that leaves the model as it was

    user_sink, sink = sink, None
    if _is_logging_rank():  # created last, so a bad argument leaves no folder behind
        if writer is not None or log_dir is not None or user_sink is None:  # TensorBoard
            use_fast_crc()  # process-wide and fail-safe: see actviz.output.tensorboard.use_fast_crc
            if writer is None:
                from torch.utils.tensorboard import SummaryWriter

                if log_dir is not None:
                    warn_if_reused(log_dir)  # before the new writer adds its own file
                owned = SummaryWriter(_prepare_log_dir(log_dir) if log_dir is not None else None)
                sink = TensorBoardSink(owned, owns_writer=True, layout=True)
            else:
                sink = TensorBoardSink(writer, owns_writer=False, layout=True)
        if user_sink is not None:  # after TensorBoard's; its errors are warned about, never raised
            sink = FanOutSink([sink, user_sink], guard_from=1) if sink is not None else FanOutSink([user_sink])
    callbacks = StepCallbacks(on_step, on_alert)  # called once their step is written
    viz = Watcher(
        model, chosen, sink, stats_schedule, image_schedule, options, auto_step, strict,
        grad_scaler=grad_scaler, callbacks=callbacks, diagnosis=None if sink is None else make_diagnosis(
            sink, unwrap_compiled(model), [(layer_display_name(n), m) for n, m in chosen], alerts, callbacks.hold,
            spikes, update_ratio, image_schedule, options.flow_pictures),
        probe=None if probe is None else Probe(
            probe, [(layer_display_name(name), module) for name, module in chosen], options.max_channels, cam_layers
        ),
    )
    if sink is not None and sink.writer is not None:
        warn_if_shared(sink.writer.get_logdir(), viz, type(unwrap_compiled(model)).__name__)
    return viz
