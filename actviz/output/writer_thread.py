"""The writer thread: finishes and writes steps in order, and is never waited on when it cannot answer.

Training hands a finished step to :meth:`BackgroundSink.write` and goes on. Nothing here
may hang or stop the training thread: every wait is a loop of short timeouts that checks
the thread is still alive; a forked child (the pid changed: Hogwild, ``os.fork()``),
a writer thread that is gone, or a closed sink make writes no-ops with one warning; the
user's ``on_step`` may call ``flush()`` or ``close()`` from the writer thread itself, or
raise anything, ``SystemExit`` included; and ``flush()``/``close()`` warn about a write
error instead of raising it. A ``close()`` interrupted (Ctrl-C) can be called again and
still writes what was queued.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..common.safe_warnings import warn_safely
from ..common.results import StepResults
from .sink import Sink

__all__ = ["BackgroundSink", "PendingResults"]

logger = logging.getLogger(__name__)

#: Seconds between two checks that the writer thread is still there, while waiting on it.
POLL_SECONDS = 0.2

#: Queued by :meth:`BackgroundSink.flush`: the writer thread flushes the sink when it comes to it.
_FLUSH: Any = object()


class PendingResults(Protocol):
    """A step on its way to the host (:class:`actviz.output.pending_step.PendingStep`)."""

    step: int

    def resolve(self) -> StepResults: ...


class BackgroundSink:
    """Finishes steps and runs another sink's writes on one worker thread, in order.

    Waiting for a step's copy from the device, counting its buckets, drawing and
    PNG-encoding its pictures and building protobufs then overlap the next training
    steps instead of lengthening the logging step. At most ``max_pending`` steps wait;
    a further :meth:`write` waits until one is written, so memory stays bounded.

    Args:
        sink: The sink doing the writing, e.g. a :class:`~actviz.output.tensorboard.TensorBoardSink`.
        on_error: Called on the worker thread with the pending step and the exception
            when finishing or writing it fails. The thread goes on with the next step.
        max_pending: Most steps queued at once.
        resolve: Turns a pending step into its results on the worker thread; by default
            ``pending.resolve()``.
        after_write: Called on the worker thread with each step's results once written.

    Example:
        >>> class ListSink:  # any object with write, flush and close
        ...     def __init__(self): self.steps = []
        ...     def write(self, results): self.steps.append(results.step)
        ...     def flush(self): pass
        ...     def close(self): pass
        >>> class Ready:  # a step already on the host
        ...     def __init__(self, step): self.step = step
        ...     def resolve(self): return StepResults(self.step, scalars={"loss": 1.0})
        >>> background = BackgroundSink(ListSink(), on_error=print)
        >>> for step in (0, 5, 10):
        ...     background.write(Ready(step))
        >>> background.close(); background.close()
        >>> background.sink.steps
        [0, 5, 10]
    """

    def __init__(
        self,
        sink: Sink,
        on_error: Callable[[Any, BaseException], None],
        max_pending: int = 2,
        resolve: Callable[[Any], StepResults] | None = None,
        after_write: Callable[[StepResults], None] | None = None,
    ) -> None:
        self.sink = sink
        self._on_error = on_error
        self._resolve = resolve or (lambda pending: pending.resolve())
        self._after_write = after_write
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)  # steps, _FLUSH, or None: stop
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._stop_sent = False  # the thread was asked to stop once the queue is drained
        self._closed = False
        self._warned: set[str] = set()

    @property
    def writer(self) -> Any:
        return getattr(self.sink, "writer", None)

    # -- the training thread's side ---------------------------------------------------------------

    def write(self, pending: PendingResults) -> None:
        """Queue one step for finishing and writing; a no-op, with one warning, where no writer can answer."""
        if self._closed or self._stop_sent:
            self._warn_once("closed", f"actviz dropped step {pending.step}: the watcher is closed")
            return
        if not self._usable():
            return
        if self.on_thread():  # on_step ran the model: queue it if there is room, never wait on this thread
            try:
                self._queue.put_nowait(pending)
            except queue.Full:
                self._warn_once("full", f"actviz dropped step {pending.step}, logged from inside on_step")
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="actviz-writer", daemon=True)
            self._thread.start()
        self._put(pending)

    def flush(self) -> None:
        """Wait until every queued step is written and the writer flushed. Never raises a write error.

        The writer thread flushes, after the steps queued before: the training thread does no file I/O.
        """
        if not self._usable() or self.on_thread():
            return  # on the writer thread, the steps before this one are written already
        if self._thread is None:  # nothing was ever queued
            self._guarded("flush", self.sink.flush)
            return
        self._put(_FLUSH)
        self._wait_until_written()

    def close(self) -> None:
        """Write what is queued, stop the thread and close the sink. Safe to call more than once, and again
        after an interrupted close."""
        if self._closed:
            return
        if os.getpid() != self._pid:  # a forked child: the thread and the writer's file belong to the parent
            self._closed = True
            return
        if self.on_thread():  # on_step called close(): the thread closes the sink once the queue is drained
            self._stop_sent = True
            return
        if self._thread is not None and self._thread.is_alive():
            if not self._stop_sent:
                self._put(None)
                self._stop_sent = True
            while self._thread.is_alive():
                self._thread.join(POLL_SECONDS)
        self._closed = True
        self._guarded("close", self.sink.close)

    def _usable(self) -> bool:
        if os.getpid() != self._pid:
            self._warn_once("fork", "actviz writes nothing in this process: it was forked from the one that called "
                                    "watch(), whose writer thread it does not have. Call actviz.watch() in each "
                                    "process that should log (with its own log_dir).")
            return False
        if self._thread is not None and not self._thread.is_alive() and not self._stop_sent:
            self._warn_once("dead", "actviz's writer thread is gone (the interpreter is shutting down?): "
                                    "later steps are not written")
            return False
        return True

    def on_thread(self) -> bool:
        """Whether the caller runs on the writer thread (in ``on_step``)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _put(self, item: PendingResults | None) -> None:
        while True:
            try:
                self._queue.put(item, timeout=POLL_SECONDS)
                return
            except queue.Full:
                if self._thread is None or not self._thread.is_alive():
                    return

    def _wait_until_written(self) -> None:
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                if self._thread is None or not self._thread.is_alive():
                    return
                done.wait(POLL_SECONDS)

    def _guarded(self, what: str, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as error:  # noqa: BLE001 - a full disk must not end the with-block with an error
            self._warn_once(what, f"actviz could not {what} its writer: {type(error).__name__}: {error}")

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warn_safely(message + ". Training goes on.", RuntimeWarning)

    # -- the writer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                pending = self._queue.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._stop_sent and not self._closed:  # close() came from on_step, on this thread
                    self._closed = True
                    self._guarded("close", self.sink.close)
                    return
                continue
            try:
                if pending is None:
                    return
                if pending is _FLUSH:
                    self._guarded("flush", self.sink.flush)
                else:
                    self._process(pending)
            finally:
                self._queue.task_done()

    def _process(self, pending: PendingResults) -> None:
        try:
            results = self._resolve(pending)
            if not results.is_empty():
                self.sink.write(results)
                if self._after_write is not None:
                    self._after_write(results)
        except BaseException as error:  # noqa: BLE001 - SystemExit would end the thread, hanging the next put
            try:
                self._on_error(pending, error)
            except BaseException:
                logger.debug("reporting a failed write failed", exc_info=True)
