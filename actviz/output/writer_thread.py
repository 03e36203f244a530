"""The writer: the writer half of a step's path, on one thread that is never waited on when it cannot answer.

:class:`Writer` takes each finished :class:`~actviz.output.pending_step.PendingStep` from the
training thread (:meth:`Writer.deliver`) and goes on. Its :meth:`Writer.process` is the whole
writer half, one step at a time and in step order: finish the step on the host, diagnose it
(alerts, flow pictures, spikes: :class:`~actviz.diagnosis.step_diagnosis.Diagnosis`), write it
to the sink, keep it as :attr:`Writer.latest`, and only then call the user's ``on_alert`` and
``on_step`` (:mod:`actviz.output.step_callbacks`). It runs on the writer thread, or with
``strict=True`` at once on the training thread, so that an error raises there.

Nothing here may hang or stop the training thread. At most two steps wait in the queue, and the
training thread waits for the writer thread only while it answers: while each thing it does (a
sink's write or flush, a step's diagnosis, ``on_step``) returns within :data:`WRITE_TIMEOUT_SECONDS`,
and the sink's ``close()`` within :data:`CLOSE_TIMEOUT_SECONDS`. Past a limit it warns once, naming
the method and the limit, and goes on: the steps it cannot hand over are dropped and counted in
:attr:`Writer.dropped_steps`, and a sink that answers again gets the steps after. The thread is a
daemon: one stuck in a sink does not hold up the interpreter's exit. A forked child (the pid
changed: Hogwild, ``os.fork()``), a writer thread that is gone, or a closed writer make
:meth:`~Writer.deliver` a no-op with one warning; the user's ``on_step`` may call ``flush()`` or
``close()`` from the writer thread itself, or raise anything, ``SystemExit`` included; a step that
fails to finish or write, and ``flush()``/``close()`` that fail, warn once instead of raising
(:mod:`actviz.output.once_warnings`). A watcher dropped without ``close()`` ends its thread
(:meth:`Writer.end_when_idle`). A ``close()`` interrupted (Ctrl-C) can be called again and still
writes what was queued. With ``strict=True`` the sink runs on the training thread, unbounded.

The limits are module attributes, read at each wait: ``WRITE_TIMEOUT_SECONDS = 120.0`` for a slow tracker.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..common.results import StepResults
from ..common.safe_warnings import speak_for, user_site
from ..tags import LAYERS
from .once_warnings import OnceWarnings
from .pending_step import PendingStep
from .sink import METHODS, Sink, sink_name
from .step_callbacks import StepCallbacks

__all__ = ["Writer"]

logger = logging.getLogger(__name__)

#: Seconds between two checks that the writer thread is still there, while waiting on it.
POLL_SECONDS = 0.2

#: Seconds the training thread waits for the writer thread to finish one thing (a sink's ``write()`` or
#: ``flush()``, a step's diagnosis, ``on_step``) before it stops waiting: one warning, and the steps it
#: cannot hand over are dropped and counted. A tracker's request that times out after 10 s fits well within.
WRITE_TIMEOUT_SECONDS = 30.0

#: Seconds ``close()`` waits for the sink's ``close()``, after the steps before are written.
CLOSE_TIMEOUT_SECONDS = 10.0

#: Queued by :meth:`Writer.flush`: the writer thread flushes the sink when it comes to it.
_FLUSH: Any = object()


class Writer:
    """Finishes steps, diagnoses them, writes them through a sink and hands them to ``on_step``, in order.

    Waiting for a step's copy from the device, counting its buckets, drawing and PNG-encoding its
    pictures and building protobufs then overlap the next training steps instead of lengthening
    the logging step. At most ``max_pending`` steps wait; a further :meth:`deliver` waits until
    one is written, so memory stays bounded, and drops the step if the writer thread has not answered
    for :data:`WRITE_TIMEOUT_SECONDS` (see the module docstring).

    Args:
        sink: The sink (:class:`~actviz.output.tensorboard.TensorBoardSink`, or a fan-out to the user's too).
        strict: Process each step on the training thread as it is delivered, and let errors raise.
        on_step: Called with each step's results once written.
        callbacks: The user's ``on_alert`` and ``on_step`` (instead of ``on_step``), called once a step is written.
        diagnose: Called with each step's results before they are written
            (:class:`~actviz.diagnosis.step_diagnosis.Diagnosis`).
        max_pending: Most steps queued at once.

    Example:
        >>> class ListSink:  # any object with write, flush and close
        ...     def __init__(self): self.steps = []
        ...     def write(self, results): self.steps.append(results.step)
        ...     def flush(self): pass
        ...     def close(self): pass
        >>> writer = Writer(ListSink())
        >>> for step in (0, 5, 10):
        ...     pending = PendingStep(step, bins=8)
        ...     pending.add_text("note", f"step {step}")
        ...     writer.deliver(pending)
        >>> writer.close(); writer.close()
        >>> writer.sink.steps, writer.latest.texts, writer.dropped_steps
        ([0, 5, 10], {'note': 'step 10'}, 0)
    """

    def __init__(
        self, sink: Sink, strict: bool = False, on_step: Callable[[StepResults], None] | None = None,
        diagnose: Callable[[StepResults], None] | None = None, max_pending: int = 2,
        callbacks: StepCallbacks | None = None, subject: str | None = None,
    ) -> None:
        self.sink = sink
        self.subject = subject  # what its warnings name ("Net → runs/x"), and the user's watch() line they point at
        self._site = user_site()
        self.strict = strict
        self.latest: StepResults | None = None
        self.layer_table: str | None = None
        self.dropped_steps = 0  # steps delivered that were not written: see deliver() and process()
        self.callbacks = callbacks or StepCallbacks(on_step=on_step)
        self._diagnose = diagnose
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)  # steps, _FLUSH, or None: stop
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._stop_sent = False  # the thread was asked to stop once the queue is drained
        self._closed = False
        self._sink_closed = False  # the sink's close() was called
        self._warnings = OnceWarnings()  # each kind once; training goes on
        self._last_answer = time.monotonic()  # when the writer thread last showed that it answers
        self._doing: tuple[str, int | None] = ("waiting", None)  # a sink method or what else it does, and the step
        self._closing_since: float | None = None  # when the writer thread called the sink's close()
        self._then: Callable[[], None] | None = None  # called by the thread after the sink's close (end_when_idle)
        if not strict:  # from the start, so that a watcher dropped unclosed ends it without starting one
            try:
                self._start()
            except RuntimeError:  # no new thread at interpreter shutdown: started at the first step, if ever
                pass

    @property
    def writer(self) -> Any:
        """The sink's ``SummaryWriter``, or ``None`` for ``watch(sink=...)`` alone."""
        return getattr(self.sink, "writer", None)

    # -- the writer half of the path ------------------------------------------------------------------

    def process(self, pending: PendingStep) -> None:
        """Finish one step on the host, diagnose it, write it, keep it as :attr:`latest`, then call the callbacks.

        Runs on the writer thread, or on the training thread with ``strict=True``. A step with nothing
        in it is not written. ``on_alert`` and ``on_step`` run once the step is written, whatever happened
        before (:mod:`actviz.output.step_callbacks`).
        """
        self._doing = (f"the host half of step {pending.step} (its copy from the device, its statistics)", None)
        results = pending.resolve()
        written = False
        try:
            if self._diagnose is not None:
                self._doing = (f"the alerts, flow pictures and spikes of step {results.step}", None)
                self._diagnose(results)
            if not results.is_empty():
                self._doing = ("write", results.step)
                try:
                    self.sink.write(results)
                except BaseException:  # not on disk (a full disk): counted, then reported as any failure
                    self.dropped_steps += 1
                    raise
                written = True
                self.latest = results
                if LAYERS in results.texts:
                    self.layer_table = results.texts[LAYERS]
        finally:
            self._doing = (f"on_alert and on_step with step {results.step}", None)
            self.callbacks.after_write(results if written else None, self.strict, self._warnings.warn)

    # -- the training thread's side ---------------------------------------------------------------

    def deliver(self, pending: PendingStep) -> None:
        """Hand a finished step on: queued for the writer thread, or processed now if strict.

        Not strict, it never raises a write error, and it is a no-op, with one warning, where no writer
        thread can answer (in time): the step is dropped and counted in :attr:`dropped_steps`.
        """
        if self.strict:
            self.process(pending)
            return
        try:
            self._queue_step(pending)
        except Exception as error:  # noqa: BLE001 - no thread at interpreter shutdown must not stop training
            self.dropped_steps += 1
            self._warnings.failed(pending.step, error)

    def flush(self) -> None:
        """Wait, while the writer thread answers, until every queued step is written and the sink flushed.

        The writer thread flushes, after the steps queued before: the training thread does no file I/O.
        Not strict, it never raises a write error.
        """
        if self.strict:
            self.sink.flush()
            return
        if not self._usable() or self.on_thread():
            return  # on the writer thread, the steps before this one are written already
        if self._thread is None:  # nothing was ever queued: the thread flushes all the same, so that a flush that hangs is bounded
            try:
                self._start()
            except RuntimeError:  # no new thread at interpreter shutdown, and nothing written to flush
                return
        if self._put(_FLUSH):
            self._wait_until_written()

    def close(self) -> None:
        """Write what is queued, stop the thread and close the sink (and the writer, if actviz made it).

        Bounded: it waits while the writer thread answers (:data:`WRITE_TIMEOUT_SECONDS` for each thing it
        does), then :data:`CLOSE_TIMEOUT_SECONDS` for the sink's ``close()``; past either it warns once and
        returns, and the steps still queued are dropped and counted. Safe to call more than once, and again
        after an interrupted close.
        """
        if self._closed:
            return
        if self.strict:
            self.sink.close()
            self._closed = True
            return
        if os.getpid() != self._pid:  # a forked child: the thread and the writer's file belong to the parent
            self._closed = True
            return
        if self.on_thread():  # on_step called close(): the thread closes the sink once the queue is drained
            self._stop_sent = True
            return
        if not self._sink_closed and not self._running():  # the writer thread closes the sink, so that its close is bounded
            try:
                self._start()
            except RuntimeError:  # no new thread at interpreter shutdown: close it here
                self._closed = True
                self._close_sink()
                return
        if not self._stop_sent:
            self._put(None)  # if it cannot be queued, the thread closes the sink when it answers again and the queue is empty
            self._stop_sent = True
        self._wait_for_thread()
        self._closed = True
        if self.dropped_steps:
            logger.warning("actviz dropped %d logging steps that its writer could not take (viz.dropped_steps)",
                           self.dropped_steps)

    def end_when_idle(self, then: Callable[[], None] | None = None) -> None:
        """Let the thread write what is queued, close the sink, call ``then`` and end, without waiting for it.

        For a watcher dropped without :meth:`close` (:mod:`actviz.watcher`'s finalizer), so it runs inside
        the garbage collector, on any thread: it sets two attributes, and takes no lock and starts no thread
        (the thread runs from the start unless ``strict``). Never raises.
        """
        if not (self._closed or self._stop_sent):
            self._then = then
            self._stop_sent = True  # the thread closes the sink once the queue is empty

    def on_thread(self) -> bool:
        """Whether the caller runs on the writer thread (in ``on_step``)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _queue_step(self, pending: PendingStep) -> None:
        if self._closed or self._stop_sent:
            self.dropped_steps += 1
            self._warnings.warn("closed", f"actviz dropped step {pending.step}: the watcher is closed")
            return
        if not self._usable():
            self.dropped_steps += 1
            return
        if self.on_thread():  # on_step ran the model: queue it if there is room, never wait on this thread
            try:
                self._queue.put_nowait(pending)
            except queue.Full:
                self.dropped_steps += 1
                self._warnings.warn("full", f"actviz dropped step {pending.step}, logged from inside on_step")
            return
        if self._thread is None:
            self._start()
        if not self._put(pending):
            self.dropped_steps += 1

    def _start(self) -> None:
        """Start a writer thread: a daemon, so that one stuck in a sink does not hold up the interpreter's exit."""
        thread = threading.Thread(target=self._run, name="actviz-writer", daemon=True)
        self._answered()
        thread.start()
        self._thread = thread

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _usable(self) -> bool:
        if os.getpid() != self._pid:
            self._warnings.warn("fork", "actviz writes nothing in this process: it was forked from the one that called "
                                    "watch(), whose writer thread it does not have. Call actviz.watch() in each "
                                    "process that should log (with its own log_dir).")
            return False
        if self._thread is not None and not self._thread.is_alive() and not self._stop_sent:
            self._warnings.warn("dead", "actviz's writer thread is gone (the interpreter is shutting down?): "
                                    "later steps are not written")
            return False
        return True

    # -- the bounded waits ------------------------------------------------------------------------------

    def _answered(self) -> None:
        self._last_answer = time.monotonic()

    def _time_left(self) -> float:
        """Seconds until the writer thread has not answered for :data:`WRITE_TIMEOUT_SECONDS`; 0 or less: it has not."""
        return self._last_answer + WRITE_TIMEOUT_SECONDS - time.monotonic()

    def _put(self, item: Any) -> bool:
        """Queue ``item`` once there is room; False if the writer thread is gone or has not answered in time."""
        while True:
            left = self._time_left()
            try:
                self._queue.put(item, timeout=max(0.0, min(POLL_SECONDS, left)))
                return True
            except queue.Full:
                if not self._running():
                    return False
                if left <= 0:
                    self._not_answering(closing=False)
                    return False

    def _wait_until_written(self) -> None:
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks and self._running() and (left := self._time_left()) > 0:
                done.wait(min(POLL_SECONDS, left))
            gave_up = self._queue.unfinished_tasks and self._running()
        if gave_up:  # warned outside the queue's lock, which the writer thread needs to go on
            self._not_answering(closing=False)

    def _wait_for_thread(self) -> None:
        """Join the writer thread while it answers: each thing it does within its limit, the sink's close within its own."""
        while self._running():
            closing = self._closing_since
            left = self._time_left() if closing is None else closing + CLOSE_TIMEOUT_SECONDS - time.monotonic()
            if left <= 0:
                self._not_answering(closing=closing is not None)
                self._drop_queued()
                return
            self._thread.join(min(POLL_SECONDS, left))  # type: ignore[union-attr]

    def _drop_queued(self) -> None:
        """Take what is still queued off the queue, counting its steps as dropped (close() gave up on the thread)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, PendingStep):
                self.dropped_steps += 1
            self._queue.task_done()

    def _not_answering(self, closing: bool) -> None:
        limit, name = (CLOSE_TIMEOUT_SECONDS, "CLOSE") if closing else (WRITE_TIMEOUT_SECONDS, "WRITE")
        doing, step = self._doing
        waited_for = f"{sink_name(self.sink)}.{doing}()" if doing in METHODS else doing
        if step is not None:
            waited_for += f" with step {step}"
        then = "close() returns without it" if closing else "the steps it cannot take are dropped, counted in viz.dropped_steps"
        self._warnings.warn(f"{name} limit", f"actviz's writer has waited {limit:g} s for {waited_for}, which has not returned: "
                                         f"{then} (the limit is actviz.output.writer_thread.{name}_TIMEOUT_SECONDS)")

    # -- the writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        speak_for(self.subject, self._site)  # this thread runs no user code: its warnings point at watch()
        while True:
            try:
                pending = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._answered()
                if self._stop_sent:  # close() came from on_step, on this thread, or could not queue its stop
                    self._close_sink()
                    return
                continue
            self._answered()
            try:
                if pending is None:
                    self._close_sink()
                    return
                if pending is _FLUSH:
                    self._doing = ("flush", None)
                    self._warnings.guarded("flush", self.sink.flush)
                else:
                    try:
                        self.process(pending)
                    except BaseException as error:  # noqa: BLE001 - SystemExit would end the thread, hanging the next put
                        self._warnings.failed(pending.step, error)
            finally:
                self._doing = ("waiting", None)
                self._answered()
                self._queue.task_done()

    def _close_sink(self) -> None:
        if self._sink_closed:
            return
        self._sink_closed = True
        self._doing = ("close", None)
        self._closing_since = time.monotonic()
        self._warnings.guarded("close", self.sink.close)
        if self._then is not None:
            self._warnings.guarded("end", self._then)
