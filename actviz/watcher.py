"""The watcher: the schedule, the step count and the one hook that stays on the model.

Between logging steps the model carries one light forward pre-hook on its root and
nothing else. On a step the schedule picks, that hook starts a
:class:`~actviz.capture.StepCapture`, which hooks the watched layers, decides when
the step is over and hands it to ``deliver``: the sink, on the writer thread (or on the
training thread with ``strict=True``). Data flows one way, model → hook → capture →
deliver → sink; the watcher is never called back for it. :func:`actviz.watch` makes one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._internals import inside_functorch_transform
from .capture import StepCapture
from .step_parameters import LoopHistory
from .compiled import StepHook, StepHookHandle, attach_step_hook, eager_ahead, take_eager_ahead, unwrap_compiled
from .options import CaptureOptions
from .results import StepResults
from .schedule import Schedule
from .layer_slots import LayerSlots, parameters_of
from .delivery import Delivery
from .open_watchers import register, unregister
from .probe import Probe, unwrap_for_probe
from .safe_warnings import warn_safely
from .sinks import TensorBoardSink

__all__ = ["Watcher"]

logger = logging.getLogger(__name__)

#: Most steps kept open while they wait for a backward pass that has not come yet.
MAX_WAITING = 4



class Watcher:
    """Logs what happens inside a model while it trains. Make one with :func:`actviz.watch`.

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
        grad_scaler: Any = None,
        on_step: Callable[[StepResults], None] | None = None,
        probe: Probe | None = None,
    ) -> None:
        self.model = model
        self.grad_scaler = grad_scaler
        self._probe = probe
        self._slots = LayerSlots(unwrap_compiled(model), layers)
        self._layers = self._slots.layers
        self._parameters = parameters_of(unwrap_compiled(model), [module for _, module in layers])
        self._delivery = None if sink is None else Delivery(sink, strict, on_step)
        self._stats_schedule = stats_schedule
        self._image_schedule = image_schedule
        self._options = options
        self.auto_step = auto_step
        self.strict = strict
        self._next_step = 0
        self._last_started_step: int | None = None
        self._captures: list[StepCapture] = []  # open steps: in their forward, or waiting to end
        self._warned_no_backward = False
        self._warned_compiled = False
        self._warned_forked = False
        self._warned_dropped = False
        self._history = LoopHistory()
        self._ready: list[Any] = []  # finished steps waiting for an earlier one to finish
        self._layers_described = False
        self._skipped: set[str] = set()
        self._closed = False
        self._pid = os.getpid()  # a forked child logs nothing: its writer thread stayed in the parent
        self._root_handle: StepHookHandle | None = None
        if sink is not None or options.merge_ranks:  # other ranks attach nothing unless they merge into rank 0's
            self._root_handle = attach_step_hook(
                model, StepHook(self._on_model_forward, self._on_compiled_forward, model))
            if self._logs(0):
                eager_ahead()  # a model compiled after watch() runs its first forward eagerly, and logs it
        register(model, self)

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
        return None if self._delivery is None else self._delivery.writer

    @property
    def merge_ranks(self) -> bool:
        """Whether every rank's summaries are merged into rank 0's (``watch(merge_ranks=True)``)."""
        return self._options.merge_ranks

    @property
    def step(self) -> int:
        """The step number the next training forward will get."""
        return self._next_step

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def latest(self) -> StepResults | None:
        """The results of the last step written, or ``None`` before the first.

        ``viz.latest.statistics()`` gives every tag's count, mean, std, min, max, norm and
        NaN/Inf count. Call :meth:`flush` first to be sure the step just taken is in.
        """
        return None if self._delivery is None else self._delivery.latest

    @property
    def layer_table(self) -> str | None:
        """The watched layers as a markdown table (name, type, output shape, parameters), once a step logged.

        The same table is written as the text summary ``layers`` at the first stats step.
        """
        return None if self._delivery is None else self._delivery.layer_table

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
        if self._logs(step) and step != self._last_started_step:
            eager_ahead()  # for a model compiled after watch(): see actviz.compiled

    def flush(self) -> None:
        """Write the pending step, if any, and wait until everything is in the writer. Never raises a write error."""
        if not self._on_writer_thread():  # from on_step: the training thread owns the open steps
            self._end_capture()
        if self._delivery is not None:
            self._delivery.flush()

    def close(self) -> None:
        """Remove every hook, write what is pending, flush, and close the writer if :func:`watch` made it.

        Safe to call more than once; called again after an interrupted close (Ctrl-C), it
        still writes what was queued. Never raises a write error (it warns).
        """
        if os.getpid() != self._pid:  # a forked child: nothing of the parent's to end, no thread to wait on
            self._closed, self._captures = True, []
            return
        if not self._closed:
            self._closed = True
            if self._on_writer_thread():  # from on_step: the hooks go at the next forward, on the training thread
                self._delivery.close()  # type: ignore[union-attr]
                return
            try:
                self._remove_root_hook()
                self._end_capture()
            finally:
                unregister(self.model, self)
        if self._delivery is not None:
            self._delivery.close()

    def _remove_root_hook(self) -> None:
        handle, self._root_handle = self._root_handle, None
        if handle is not None:
            handle.remove()
            take_eager_ahead().exit()

    def _on_writer_thread(self) -> bool:
        return self._delivery is not None and self._delivery.on_writer_thread()

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

    # -- the root hook -----------------------------------------------------------------------

    def _logs(self, step: int) -> bool:
        return self._root_handle is not None and (
            self._stats_schedule(step) or (self._image_schedule(step) and self._delivery is not None))

    def _on_model_forward(self, model: nn.Module, args: Any) -> None:
        if self._closed:  # by on_step, on the writer thread: finish closing here, on the training thread
            self._remove_root_hook()
            self._end_capture()
            unregister(self.model, self)
            return
        if not (model.training and torch.is_grad_enabled()) or inside_functorch_transform():
            return  # eval and no-grad forwards are not steps, nor a torch.func transform's calls
        if os.getpid() != self._pid:
            self._warn_forked()
            return
        try:
            self._start_step(model)
        except Exception as error:  # noqa: BLE001 - never stop training
            self._report("(watcher)", error)

    def _on_compiled_forward(self, training: bool) -> None:
        """A forward compiled with the root hook in it has run (replayed after its graph): count the step."""
        if self._closed or not training:
            return
        try:
            step = self._next_step
            if not self.auto_step and step == self._last_started_step:
                return
            self._end_finished_steps()
            if self.auto_step:
                self._next_step += 1
            self._last_started_step = step
            if self._logs(step) and not self._warned_compiled:
                self._warned_compiled = True
                warn_safely(f"actviz could not log step {step}: the model ran compiled. It was compiled after "
                            "watch() in a process that had not imported torch.compile yet; later logging steps run "
                            "eagerly and log. Compile before watch() to log this step too.", RuntimeWarning)
            if self.auto_step and self._logs(self._next_step):
                eager_ahead()  # the next forward runs eagerly, through the root hook
        except Exception as error:  # noqa: BLE001 - never stop training
            self._report("(watcher)", error)

    def _end_finished_steps(self) -> None:
        for capture in self._captures:
            capture.next_forward()  # ends unless it still waits for its backward pass
        waiting = [capture for capture in self._captures if not capture.done]
        for capture in waiting[:-MAX_WAITING]:  # forwards whose backward, or optimizer step, never comes
            capture.give_up()
        self._captures = waiting[-MAX_WAITING:]
        self._release_ready()

    def _start_step(self, model: nn.Module) -> None:
        if any(capture.in_forward for capture in self._captures):
            return  # the model called itself inside a logging forward: same step
        step = self._next_step
        if not self.auto_step and step == self._last_started_step:
            # A later micro-batch, a second forward before one backward (siamese models) or a
            # nested call: same step, and its pending gradients are still to come.
            return
        self._end_finished_steps()
        if self.auto_step:
            self._next_step += 1
        self._last_started_step = step
        want_stats, want_images = self._stats_schedule(step), self._image_schedule(step)
        writes = self._delivery is not None  # rank 0, or the only process
        want_images = want_images and writes  # only rank 0 draws: its own sample 0
        if not (want_stats or want_images):
            return
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
        self._captures.append(StepCapture(
            step,
            model,
            [(name, module) for name, module in self._layers if name not in self._skipped],
            [(name, param) for name, param in self._parameters if name not in self._skipped],
            want_stats=want_stats,
            want_images=want_images,
            options=self._options,
            deliver=self._deliver_in_order if writes else None,
            on_error=self._report,
            on_no_backward=self._warn_no_backward,
            grad_scaler=self.grad_scaler,
            describe_layers=want_stats and writes and not self._layers_described,
            pictures=pictures,
            stance=take_eager_ahead(),
            history=self._history,
        ))
        self._layers_described = self._layers_described or (want_stats and writes)

    def _end_capture(self) -> None:
        captures, self._captures = self._captures, []
        for capture in captures:
            capture.finish()
        self._release_ready()

    def _deliver_in_order(self, pending: Any) -> None:
        """Deliver a finished step once every earlier step has been (a step may wait for its optimizer step)."""
        self._ready.append(pending)
        self._release_ready()

    def _release_ready(self) -> None:
        first_open = min((capture.step for capture in self._captures if not capture.done), default=None)
        ready = sorted(self._ready, key=lambda pending: pending.step)
        self._ready = [pending for pending in ready if first_open is not None and pending.step >= first_open]
        for pending in ready[:len(ready) - len(self._ready)]:
            self._delivery.deliver(pending)  # type: ignore[union-attr]

    def _warn_forked(self) -> None:
        if not self._warned_forked:
            self._warned_forked = True
            warn_safely("actviz logs nothing in this process: it was forked from the process that called watch() "
                        "(Hogwild, os.fork()). Call actviz.watch() in each process that should log, with its own "
                        "log_dir. Warned once.", RuntimeWarning)

    def _warn_no_backward(self, capture: StepCapture) -> None:
        if capture.dropped_gradients:
            if not self._warned_dropped:
                self._warned_dropped = True
                warn_safely(f"actviz logs no weight_grads for step {capture.step}: no optimizer that holds them applied "
                            "the gradients its backward made (they were zeroed by zero_grad() first, as in a GAN "
                            "generator's update through the discriminator, or the run ended). Warned once per run.")
            return
        if self._warned_no_backward:
            return
        self._warned_no_backward = True
        warn_safely(
            f"actviz logs no gradients for step {capture.step}: its forward got no backward pass (another "
            "backward updated the watched parameters first, or more forwards ran). If your loop calls the model "
            "more than once per optimizer step, call it under torch.no_grad() where its output is not "
            "backpropagated (a GAN generator's forward for the discriminator step), or number the steps yourself "
            "with actviz.watch(..., auto_step=False) and viz.set_step(step) before the forward you want logged. "
            "Warned once per run.",
            RuntimeWarning,
        )

    def _report(self, name: str, error: BaseException) -> None:
        """A hook failed: re-raise if strict, else warn once and skip ``name`` from now on."""
        if self.strict:
            raise error
        if name in self._skipped:
            return
        self._skipped.add(name)
        warn_safely(f"actviz skips {name!r} from now on: its hook raised {type(error).__name__}: {error}",
                    RuntimeWarning)

