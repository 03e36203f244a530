"""The watcher: the schedule, the step count and the one hook that stays on the model.

Between logging steps the model carries one light forward pre-hook on its root
(:mod:`actviz.capture.root_hook`), and its parameters the hooks of the gradient norms before clipping
(:mod:`actviz.diagnosis.step_norms`). On a step the schedule picks, that hook starts
a :class:`~actviz.capture.step_capture.StepCapture`, which hooks the watched layers, decides when the
step is over and hands it to ``deliver`` (:mod:`actviz.capture.open_steps`, then the sink on the
writer thread). Data flows one way: model → hook → capture → deliver → sink.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .common._internals import forward_depth, inside_functorch_transform
from .capture.step_capture import StepCapture
from .capture.compiled_model import StepHookHandle, attach_step_hook, eager_ahead, take_eager_ahead, unwrap_compiled
from .diagnosis.step_diagnosis import Alert, Diagnosis, norms_of_rank
from .capture.layer_slots import LayerSlots, parameters_of
from .common.notices import Notices
from .common.safe_warnings import done_speaking_for, speak_for
from .capture.open_steps import OpenSteps
from .output.open_watchers import register, unregister
from .output.run_notes import RunNotes, end_of_run, subject_of
from .options import CaptureOptions
from .output.pending_step import PendingStep
from .common.results import StepResults
from .output.sink import Sink
from .output.step_callbacks import StepCallbacks
from .output.writer_thread import Writer
from .capture.probe import ProbeForward, unwrap_for_probe
from .capture.root_hook import StepHook
from .schedule import Schedule
from .diagnosis.silences import Silences
from .diagnosis.step_norms import StepNorms, weak_clock
from .statistics.gradient_noise import FAILED as GRADIENT_NOISE_FAILED
from .capture.step_parameters import LoopHistory

__all__ = ["Watcher"]


class Watcher:
    """Logs what happens inside a model while it trains. Make one with :func:`actviz.watch`.

    Use it as a context manager or call :meth:`close` when done. Attributes worth
    reading: :attr:`layer_names`, :attr:`parameter_names`, :attr:`step`, :attr:`writer`,
    :attr:`dropped_steps`.
    """

    def __init__(
        self, model: nn.Module, layers: list[tuple[str, nn.Module]], sink: Sink | None,
        stats_schedule: Schedule, image_schedule: Schedule, options: CaptureOptions, auto_step: bool, strict: bool,
        grad_scaler: Any = None, callbacks: StepCallbacks | None = None, probe: ProbeForward | None = None,
        diagnosis: Diagnosis | None = None, reads_norms: bool = False,
    ) -> None:
        self.model = model
        self.grad_scaler = grad_scaler
        self._probe = probe
        self._slots = LayerSlots(unwrap_compiled(model), layers)
        self._layers = self._slots.layers
        self._parameters = parameters_of(unwrap_compiled(model), [module for _, module in layers])
        self._diagnosis = diagnosis  # alerts, flow pictures and the spike recorder: actviz.diagnosis.step_diagnosis
        self._history = LoopHistory()  # every optimizer step's gradient norms (gradient_clipping/*, spikes), on rank 0
        self._norms = norms_of_rank(diagnosis, unwrap_compiled(model), self._layers, clock := weak_clock(
            self, "_last_started_step"), options.gradient_clipping, grad_scaler, reads_norms)  # another rank: FSDP2's
        self._history.step_norms = self._norms if options.gradient_clipping else None
        self._spikes = diagnosis and diagnosis.spikes
        self._audit = diagnosis and diagnosis.optimizer_audit(unwrap_compiled(model), clock)
        self._subject = subject_of(type(unwrap_compiled(model)).__name__, sink)  # what its warnings name: "Net → runs/x"
        self._writer = None if sink is None else Writer(sink, strict, diagnose=diagnosis, callbacks=callbacks,
                                                        subject=self._subject)
        self._stats_schedule = stats_schedule
        self._image_schedule = image_schedule
        self._options = options
        self.auto_step = auto_step
        self.strict = strict
        self._next_step = 0
        self._last_started_step: int | None = None
        self._open = OpenSteps(None if self._writer is None else self._writer.deliver)
        self._notices = Notices(self._subject)
        self._layers_described = False
        self._skipped: set[str] = set()
        self._lazy = any(is_lazy(param) for _, param in self._parameters)  # nn.LazyLinear before its first forward
        self._closed = False
        self.notes: RunNotes | None = None  # the start and end lines, set by actviz.watch on the logging rank
        self._pid = os.getpid()  # a forked child logs nothing: its writer thread stayed in the parent
        self._root_handle: StepHookHandle | None = None
        self._captures = sink is not None or options.merge_ranks  # other ranks capture only to merge into rank 0's
        if self._captures or (self._norms is not None and self._norms.sharded):  # FSDP2: every rank counts the steps
            self._root_handle = attach_step_hook(
                model, StepHook(self._on_model_forward, self._on_compiled_forward, model, self._open.release_stances))
            if self._logs(0):
                eager_ahead()  # a model compiled after watch() runs its first forward eagerly, and logs it
        self._silences = Silences(unwrap_compiled(model), stats_schedule, image_schedule, self._captures)
        register(model, self)
        # Dropped without close() (its model gone too): the writer thread writes what is queued and ends.
        self._finalizer = weakref.finalize(self, _end_dropped, self._writer, self._norms)
        self._finalizer.atexit = False  # at exit, open_watchers closes the watchers still alive

    @property
    def layer_names(self) -> list[str]:
        """Tag names of the watched layers, in model order (:func:`actviz.selection.layer_tag_names`)."""
        return [name for name, _ in self._layers]

    @property
    def parameter_names(self) -> list[str]:
        """Tag names of the watched parameters: their layer's tag name and their own (``0.query.weight``)."""
        return [name for name, _ in self._parameters]

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter`` written to, or ``None`` on ranks other than 0."""
        return None if self._writer is None else self._writer.writer

    @property
    def merge_ranks(self) -> bool:
        """Whether every rank's summaries are merged into rank 0's (``Options(merge_ranks=True)``)."""
        return self._options.merge_ranks

    @property
    def step(self) -> int:
        """The step number the next training forward will get."""
        return self._next_step

    @property
    def counted_steps(self) -> int:
        """How many training forwards started a step (eval, no-grad and later micro-batch forwards are not counted)."""
        return self._silences.steps

    @property
    def alerts(self) -> list[Alert]:
        """Every health alert so far, oldest first (:class:`~actviz.diagnosis.alerts.Alert`); call :meth:`flush` first."""
        return [] if self._diagnosis is None else list(self._diagnosis.alerts)

    closed = property(lambda self: self._closed, doc="Whether :meth:`close` ran.")

    @property
    def dropped_steps(self) -> int:
        """Logging steps not written (a sink that did not return within ``WRITE_TIMEOUT_SECONDS``, an event file that
        could not take them: ``ENOSPC``, ``EFBIG``, ``EIO``, each warned once; steps after :meth:`close`). Call
        :meth:`close` (or :meth:`flush`) first to count the last ones."""
        return 0 if self._writer is None else self._writer.dropped_steps

    @property
    def latest(self) -> StepResults | None:
        """The results of the last step written, or ``None`` before the first: ``viz.latest.statistics()`` gives every
        tag's count, mean, std, min, max, norm and NaN/Inf count. Call :meth:`flush` first for the step just taken."""
        return None if self._writer is None else self._writer.latest

    @property
    def layer_table(self) -> str | None:
        """The watched layers as a markdown table, once a step logged (the text summary ``layers``)."""
        return None if self._writer is None else self._writer.layer_table

    def show(self, height: int = 900) -> Any:
        """The run so far as TensorBoard's actviz tab shows it, inline in a notebook (:func:`actviz.view.show`)."""
        if self.writer is None:
            raise ValueError("viz.show() needs the run's TensorBoard folder: watch(model, log_dir) on this rank")
        self.flush()
        from .view import show

        return show(self.writer.get_logdir(), height)

    def set_step(self, step: int) -> None:
        """Set the step number of the next training forward.

        With ``Options(auto_step=True)`` (the default) the count goes on from there. With ``auto_step=False``
        call it before each forward; only the first training forward of a step logs (gradient accumulation).

        Example:
            >>> import actviz, tempfile, torch
            >>> with actviz.watch(torch.nn.Linear(4, 2), tempfile.mkdtemp(),
            ...                   options=actviz.Options(auto_step=False)) as viz:
            ...     viz.set_step(1000)
            ...     viz.step
            1000
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._next_step = step
        if self._logs(step) and step != self._last_started_step:
            eager_ahead()  # for a model compiled after watch(): see actviz.capture.compiled_model

    def flush(self) -> None:
        """Write the pending step, if any, and wait until everything is in the writer. Never raises a write error."""
        if not self._on_writer_thread():  # from on_step: the training thread owns the open steps
            self._open.finish_all()
            self._silences.check(closing=False)  # a run that logs nothing says why (actviz.diagnosis.silences)
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Remove every hook, write what is pending and close the writer if :func:`watch` made it.

        Safe to call again, also after an interrupted close (Ctrl-C). Never raises: an error while a step
        ends (or in the writer) is warned about and the rest is written all the same; with ``strict=True``
        the first such error raises once the rest is written.
        """
        if os.getpid() != self._pid:  # a forked child: nothing of the parent's to end, no thread to wait on
            self._closed = self._open.forget() or True
            return
        self._closed = True
        speak_for(self._subject)
        if self._on_writer_thread():  # from on_step: the hooks go later, on the training thread
            self._writer.close()  # type: ignore[union-attr]
            return
        errors: list[Exception] = []
        try:  # each part idempotent: a second close() finishes what an interrupted one left
            for part in (self._remove_root_hook, self._audit and self._audit.close, self._end_open_steps,
                         self._write_last_spikes, self._norms and self._norms.close,
                         lambda: self._silences.check(closing=True)):
                if part:
                    _collect(errors, part)
        finally:
            self._silences.close()
            unregister(self.model, self)
            done_speaking_for(self._subject)
        if self._writer is not None:
            self._writer.close()
        self._finalizer.detach()
        _collect(errors, lambda: end_of_run(self, self._silences.logging_steps, self._notices))
        if errors and self.strict:
            raise errors[0]
        for error in errors:
            self._notices.once_text(f"close {type(error).__name__}", f"actviz could not end a step at close(): "
                                    f"{type(error).__name__}: {error}; the rest is written")

    def _end_open_steps(self) -> None:
        """End each open step, one failing not keeping the others from being written, then hand them over."""
        errors: list[Exception] = []
        for capture in list(self._open.captures):
            _collect(errors, capture.end.close)  # idempotent: finish_all() below skips the ones ended
        self._open.finish_all()
        if errors:
            raise errors[0]

    def _write_last_spikes(self) -> None:
        """Judge the steps since the last logging step; a spike among them goes with a step of its own: the last."""
        step = self._last_started_step
        if self._spikes and step is not None and self._writer is not None and self._spikes.judge_the_rest(step):
            self._writer.deliver(PendingStep(step, self._options.bins))

    def _remove_root_hook(self) -> None:
        if (handle := self._root_handle) is not None:
            self._root_handle = handle.remove() or take_eager_ahead().exit()

    def _on_writer_thread(self) -> bool:
        return self._writer is not None and self._writer.on_thread()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()  # errors from the with-block propagate

    def __repr__(self) -> str:
        return (f"Watcher(model={type(self.model).__name__}, layers={len(self._layers)}, log_dir="
                f"{getattr(self.writer, 'log_dir', None)!r}, step={self._next_step}, closed={self._closed})")

    def _logs(self, step: int) -> bool:
        return self._root_handle is not None and self._captures and (
            self._stats_schedule(step) or (self._image_schedule(step) and self._writer is not None))

    def _on_model_forward(self, model: nn.Module, args: Any) -> None:
        if self._closed:  # by on_step, on the writer thread: finish closing here, on the training thread
            self._remove_root_hook()
            self._open.finish_all()
            unregister(self.model, self)
            return
        self._silences.saw_forward(model)
        if not (model.training and torch.is_grad_enabled()) or inside_functorch_transform():
            return  # eval and no-grad forwards are not steps, nor a torch.func transform's calls
        if os.getpid() != self._pid:
            self._notices.once("forked")
            return
        try:
            self._start_step(model)
        except Exception as error:  # noqa: BLE001 - never stop training
            self._report("(watcher)", error)

    def _on_compiled_forward(self, training: bool) -> None:  # a forward compiled with the root hook in it ran
        if self._closed or not training:
            return
        try:
            with torch.enable_grad():  # the op may run where autograd is off: it was a training forward
                self._silences.saw_forward(self.model)
            if (step := self._count_step()) is not None and not self._silences.saw_step(step, self._logs(step)):
                self._logs(step) and self._notices.once("compiled", step=step)
            if self.auto_step and self._logs(self._next_step):
                eager_ahead()  # the next forward runs eagerly, through the root hook
        except Exception as error:  # noqa: BLE001 - never stop training
            self._report("(watcher)", error)

    def _count_step(self) -> int | None:
        """The number of the training forward starting now, or ``None`` if it continues the last step."""
        step = self._next_step
        if not self.auto_step and step == self._last_started_step:
            return None  # a later micro-batch, a siamese pair's second forward: same step, gradients to come
        self._open.next_forward()
        if self.auto_step:
            self._next_step += 1
        self._last_started_step = step
        self._norms and self._stats_schedule(step) and self._norms.logging_step_started()  # every rank alike (FSDP2)
        return step

    def _start_step(self, model: nn.Module) -> None:
        if self._open.in_forward():
            if forward_depth(model) > 1:
                return  # the model called itself inside a logging forward: same step
            self._open.end_interrupted()  # a forward that Ctrl-C left: its step is abandoned
        if self._norms is not None:  # a loop that updates by hand: its last backward's norms, before its step ends
            self._norms.commit_unstepped()
        if (step := self._count_step()) is None or not self._captures:
            return  # the step goes on (a later micro-batch), or a rank that only counts the steps (FSDP2's norms)
        want_stats, want_images = self._stats_schedule(step), self._image_schedule(step)
        if self._spikes and self._spikes.forces(step, want_stats or want_images):  # the steps after a spike log in full
            want_stats = want_images = True
        self._silences.saw_step(step, want_stats or want_images)
        writes = self._writer is not None  # rank 0, or the only process
        want_images = want_images and writes  # only rank 0 draws: its own sample 0 (stats alone from others)
        if not (want_stats or want_images):
            return
        speak_for(self._subject)  # the hooks' warnings on this thread name this watcher
        if self._slots.follow():  # a layer replaced since watch(): hook the new one, log its parameters
            self._parameters = parameters_of(self._slots.root, [module for _, module in self._layers])
        pictures = []
        if want_images and self._probe is not None:  # the probe's pictures instead of the batch's
            want_images = False
            try:
                pictures = self._probe.pictures(unwrap_for_probe(model))
            except Exception as error:  # noqa: BLE001 - never stop training
                self._probe = None  # pictures come from the training batch from now on
                self._report("(probe)", error)
        StepCapture(  # registered (register=) before its first hook: close() finds every hook, Ctrl-C or not
            step,
            model,
            # the same pairs (the capture copies the lists): no new tuples, and no list made while nothing is skipped
            [pair for pair in self._layers if pair[0] not in self._skipped] if self._skipped else self._layers,
            self._step_parameters(),
            want_stats=want_stats,
            want_images=want_images,
            options=self._options,
            deliver=self._open.deliver_in_order if writes else None,
            on_error=self._report,
            on_no_backward=self._warn_no_backward,
            grad_scaler=self.grad_scaler,
            describe_layers=want_stats and writes and not self._layers_described,
            pictures=pictures,
            stance=take_eager_ahead(),
            history=self._history, hold_stance=unwrap_compiled(self.model) is self.model,
            register=self._open.add,
        )
        self._layers_described = self._layers_described or (want_stats and writes)

    def _warn_no_backward(self, capture: StepCapture) -> None:
        self._notices.once("dropped" if capture.end.dropped_gradients else "no_backward", step=capture.step)

    def _step_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters a logging step watches: the same list while none is skipped or lazy (no new tuples).

        A lazy module's parameters (``nn.LazyLinear``) have no value before its first forward: they join the
        steps that start once they have one.
        """
        if self._lazy:
            self._lazy = any(is_lazy(param) for _, param in self._parameters)
        if not (self._skipped or self._lazy):
            return self._parameters
        return [pair for pair in self._parameters if pair[0] not in self._skipped and not is_lazy(pair[1])]

    def _report(self, name: str, error: BaseException) -> None:
        """A hook failed: re-raise if strict, else warn once and skip ``name`` from now on."""
        if self.strict:
            raise error
        self._skipped.add(name)
        self._notices.skipped(name, error)
        if name == GRADIENT_NOISE_FAILED:  # statistics=[..., "gradient_noise"]: off for the steps to come
            self._options = dataclasses.replace(self._options, gradient_noise=False)


def _collect(errors: list[Exception], part: Callable[[], object]) -> None:
    """Run ``part``; an ``Exception`` it raises goes to ``errors`` (``close()`` goes on with the next part)."""
    try:
        part()
    except Exception as error:  # noqa: BLE001 - close() writes the rest all the same
        errors.append(error)


def _end_dropped(writer: Writer | None, norms: StepNorms | None) -> None:
    """A watcher garbage-collected unclosed: its writer thread writes what is queued, closes the sink, takes the
    norms' hooks off and ends. Inside the garbage collector: it sets flags, waits for nothing."""
    if writer is not None:
        writer.end_when_idle(then=norms.close if norms else None)
