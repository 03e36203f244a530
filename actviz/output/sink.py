"""The ``Sink`` interface: what ``watch(sink=...)`` accepts, and how actviz writes to several sinks.

A sink is any object with three methods, called on actviz's writer thread, one step at a time,
in step order:

* ``write(results)``: one step's :class:`~actviz.common.results.StepResults` (the numbers, not the
  tags: :func:`actviz.tags.step_items` gives every ``(kind, tag, value)`` TensorBoard gets);
* ``flush()``: make what was written durable (``viz.flush()``);
* ``close()``: the watcher is closed; nothing is written after.

:class:`~actviz.output.tensorboard.TensorBoardSink` is one. A sink of yours that raises is warned about once
and skipped: it never stops training nor the other sinks. One that does not answer is waited for a bounded
time (:data:`~actviz.output.writer_thread.WRITE_TIMEOUT_SECONDS` for a step,
:data:`~actviz.output.writer_thread.CLOSE_TIMEOUT_SECONDS` for its close), then warned about once: the steps
it cannot take are dropped and counted (``viz.dropped_steps``), and training goes on.

Example:
    >>> from actviz.common.results import StepResults
    >>> class ListSink:
    ...     def __init__(self): self.steps = []
    ...     def write(self, results): self.steps.append(results.step)
    ...     def flush(self): pass
    ...     def close(self): pass
    >>> mine = ListSink()
    >>> both = FanOutSink([check_sink(mine), check_sink(ListSink())])
    >>> both.write(StepResults(4, scalars={"loss": 1.0})); both.close()
    >>> mine.steps
    [4]
    >>> check_sink(object())
    Traceback (most recent call last):
    TypeError: sink must have the methods write(results), flush() and close(); object has no write, flush, close
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ..common.safe_warnings import warn_once
from ..common.results import StepResults

__all__ = ["FanOutSink", "Sink", "check_sink", "failure_cause", "sink_name"]

logger = logging.getLogger(__name__)

METHODS = ("write", "flush", "close")


@runtime_checkable
class Sink(Protocol):
    """Where a watcher's steps go: see the module docstring."""

    def write(self, results: StepResults) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def check_sink(sink: Any) -> Sink:
    """``sink`` itself, checked to have ``write``, ``flush`` and ``close``; else a ``TypeError`` naming the missing ones."""
    missing = [name for name in METHODS if not callable(getattr(sink, name, None))]
    if missing:
        raise TypeError(
            f"sink must have the methods write(results), flush() and close(); {type(sink).__name__} has no "
            f"{', '.join(missing)}"
        )
    return sink


class FanOutSink:
    """Writes each step to every sink in order: actviz's own first, then ``watch(sink=...)``'s.

    Every sink gets every call. A sink from index ``guard_from`` on (the user's) that raises is
    warned about once per method and cause (one full disk is one warning) and goes on getting steps; an error of one before it is raised
    once all have been called (the caller, :class:`~actviz.output.writer_thread.Writer`, reports it).

    Args:
        sinks: The sinks.
        guard_from: Index of the first sink whose errors are warned about instead of raised.
    """

    def __init__(self, sinks: Sequence[Sink], guard_from: int = 0) -> None:
        self.sinks = list(sinks)
        self.guard_from = guard_from
        self.calling: Sink | None = None  # the sink whose method runs now, for a message about one that hangs
        self._warned: set[tuple[int, str]] = set()

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter`` of the first sink that has one, or ``None``."""
        return next((sink.writer for sink in self.sinks if getattr(sink, "writer", None) is not None), None)

    def write(self, results: StepResults) -> None:
        self._each("write", results)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args: Any) -> None:
        failed: Exception | None = None
        for index, sink in enumerate(self.sinks):
            self.calling = sink
            try:
                getattr(sink, method)(*args)
            except Exception as error:  # the user's sink must not stop training
                if index < self.guard_from:
                    failed = failed or error  # raised once every sink had the step
                    continue
                warn_once(self._warned, (index, failure_cause(error, method)), f"actviz's sink {type(sink).__name__}."
                          f"{method}() raised {type(error).__name__}: {error}. Training goes on; actviz keeps calling it")
                logger.debug("sink %s.%s() failed", type(sink).__name__, method, exc_info=True)
        self.calling = None
        if failed is not None:
            raise failed


def failure_cause(error: BaseException, what: str) -> str:
    """What a failure is warned once for: its OS error (a full disk fails the write, the flush and the
    close alike, and is one cause), else what failed.

    Example:
        >>> import errno
        >>> full = OSError(errno.ENOSPC, "No space left on device")
        >>> failure_cause(full, "write") == failure_cause(full, "flush"), failure_cause(ValueError("bad"), "write")
        (True, 'write')
    """
    number = getattr(error, "errno", None)
    return f"errno {number}" if isinstance(error, OSError) and number is not None else what


def sink_name(sink: Any) -> str:
    """The class name a message gives ``sink``: for a :class:`FanOutSink`, that of the sink it is calling now.

    Example:
        >>> class ListSink:
        ...     def write(self, results): pass
        ...     def flush(self): pass
        ...     def close(self): pass
        >>> both = FanOutSink([ListSink()])
        >>> sink_name(both), sink_name(ListSink())
        ('FanOutSink', 'ListSink')
        >>> both.calling = both.sinks[0]  # while its write, flush or close runs
        >>> sink_name(both)
        'ListSink'
    """
    inner = getattr(sink, "calling", None)
    return type(sink if inner is None else inner).__name__
