"""Delivery: where a finished step goes, the last part of the one-way path hook → capture → deliver → sink.

:class:`Delivery` hands each finished :class:`~actviz.output.pending_step.PendingStep` to the sink:
queued for the writer thread, or, with ``strict=True``, finished and written at once on
the training thread, so that a failed write raises there. Once a step is written it
becomes :attr:`Delivery.latest`, and the user's ``on_step`` callback gets it. A failed
write or callback warns once and training goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..common.safe_warnings import warn_safely
from ..tags import ALERTS, LAYERS
from .pending_step import PendingStep
from ..common.results import StepResults
from .sink import Sink
from .writer_thread import BackgroundSink

__all__ = ["Delivery"]

logger = logging.getLogger(__name__)


class Delivery:
    """Writes finished steps through a sink, keeps the last one and calls ``on_step``.

    Args:
        sink: The sink (:class:`actviz.output.tensorboard.TensorBoardSink`, or a fan-out to the user's too).
        strict: Write on the training thread and let errors raise.
        on_step: Called with each step's results once written.
        diagnose: Called with each step's results before they are written (:class:`actviz.diagnosis.step_diagnosis.Diagnosis`).
    """

    def __init__(
        self, sink: Sink, strict: bool, on_step: Callable[[StepResults], None] | None = None,
        diagnose: Callable[[StepResults], None] | None = None,
    ) -> None:
        self.sink = sink
        self.strict = strict
        self.latest: StepResults | None = None
        self.layer_table: str | None = None
        self._on_step = on_step
        self._diagnose = diagnose  # actviz.diagnosis.step_diagnosis.Diagnosis: alerts (the first NaN/Inf among them), flow, spikes
        self._warned: set[str] = set()
        self._alerted = False
        self._background = None if strict else BackgroundSink(
            sink, self._on_write_error, resolve=self._resolve, after_write=self._written
        )

    @property
    def writer(self) -> Any:
        return getattr(self.sink, "writer", None)  # None for watch(sink=...) alone

    def deliver(self, pending: PendingStep) -> None:
        """Hand a finished step on: queued for the writer thread, or written now if strict."""
        try:
            if self._background is not None:
                self._background.write(pending)
            else:
                results = self._resolve(pending)
                self.sink.write(results)
                self._written(results)
        except Exception as error:  # a full disk must not stop training
            if self.strict:
                raise
            self._on_write_error(pending, error)

    def on_writer_thread(self) -> bool:
        """Whether this runs on the writer thread (in ``on_step``)."""
        return self._background is not None and self._background.on_thread()

    def flush(self) -> None:
        """Wait until every step handed on is written, then flush the writer."""
        if self._background is not None:
            self._background.flush()
        else:
            self.sink.flush()

    def close(self) -> None:
        """Write what is queued and close the sink (and the writer, if actviz made it)."""
        if self._background is not None:
            self._background.close()
        else:
            self.sink.close()

    def _resolve(self, pending: PendingStep) -> StepResults:
        """Finish a step's results, and name where NaN or Inf first showed, once per run."""
        results = pending.resolve()
        if self._diagnose is not None:
            self._diagnose(results)
        elif not self._alerted:
            message = first_nonfinite(results)
            if message is not None:
                self._alerted = True
                results.texts[ALERTS] = "\n\n".join(filter(None, [message, results.texts.get(ALERTS)]))
                warn_safely(message, RuntimeWarning)
        return results

    def _written(self, results: StepResults) -> None:
        self.latest = results
        if LAYERS in results.texts:
            self.layer_table = results.texts[LAYERS]
        if self._on_step is None:
            return
        try:
            self._on_step(results)
        except BaseException as error:
            if self.strict:  # on the training thread
                raise
            self._warn_once("on_step", f"actviz's on_step callback raised {type(error).__name__}: {error} "
                                       f"(step {results.step})", error)

    def _on_write_error(self, pending: Any, error: BaseException) -> None:
        self._warn_once("write", f"actviz could not write step {pending.step}: {type(error).__name__}: {error}", error)

    def _warn_once(self, kind: str, message: str, error: BaseException) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warn_safely(f"{message}. Training goes on; later failures are logged at DEBUG level.", RuntimeWarning)
        logger.debug("%s failed", kind, exc_info=error)


def first_nonfinite(results: StepResults) -> str | None:
    """Where NaN or Inf first shows in a step: its first watched layer in forward order whose output is
    not finite, or else the first the backward pass reached with a gradient that is not; ``None`` if none.

    Example:
        >>> from actviz.common.results import Summary
        >>> finite, bad = Summary(4, 0, 0, 0.0, 1.0, 1.0, 1.0, [4.0]), Summary(4, 2, 0, 0.0, 1.0, 1.0, 1.0, [2.0])
        >>> first_nonfinite(StepResults(12, activations={"encoder.2": finite, "encoder.3": bad, "head": bad}))
        "actviz: NaN or Inf first at step 12, in the output of 'encoder.3' (the first watched layer, in forward order, whose output is not finite)"
    """
    for name, summary in results.activations.items():  # in forward order: the hooks ran in it
        if summary.nonfinite:
            return (f"actviz: NaN or Inf first at step {results.step}, in the output of {name!r} "
                    "(the first watched layer, in forward order, whose output is not finite)")
    for name, summary in results.gradients.items():  # in the order the backward pass reached them
        if summary.nonfinite:
            return (f"actviz: NaN or Inf first at step {results.step}, in the gradient flowing into {name!r} "
                    "(every output was finite; the backward pass reached this layer first with one that is not)")
    return None
