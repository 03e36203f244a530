"""Sinks: write one step's results to TensorBoard.

Tags (``layer`` from ``named_modules()``, ``param`` from ``named_parameters()``):

=========================================  ==============================================
``feature_maps/{layer}``                   image: channel grid (4-D) or heat map (3-D)
``activations/{layer}``                    histogram of the layer's output
``gradients/{layer}``                      histogram of the gradient w.r.t. that output
``weights/{param}``                        histogram of the parameter
``weight_grads/{param}``                   histogram of the parameter's gradient
``activation_stats/{layer}/mean``          also ``/std``, ``/zero_fraction`` (a), ``/nonfinite`` (a)
``gradient_stats/{layer}/norm``            also ``/nonfinite`` (a)
``amp/grad_scale``                         scalar: the AMP loss scale (with ``grad_scaler=``)
``layers``                                 text: the watched layers, at the first stats step
``alerts``                                 text: health alerts at their step (actviz.alerts)
``flow/{statistic}``                       image: every layer over time (actviz.flow)
``probe/input``, ``gradcam/{layer}``       images: the probe's sample 0, Grad-CAM over it
``update_ratio/{param}``                   scalar: ||w_after - w_before|| / ||w_before|| (opt-in)
``spikes/...``                             scalars: gradient norms around a spike (opt-in)
=========================================  ==============================================

(a) Written from the first step where they are not zero on: a healthy run never shows a
card that stays at zero (``nonfinite``; ``zero_fraction`` of a layer that is not a ReLU).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto
from torch.utils.tensorboard.summary import custom_scalars

from ._internals import event_file_writer, replace_record_checksum
from .results import StepResults
from .step_values import _image_value, _scalar_values, _step_values, _text_value

#: Custom Scalars charts (anchored regexes on the tags above): each statistic across all layers.
DASHBOARD_LAYOUT = {
    "actviz: every layer on one chart": {
        "gradient norm": ["Multiline", [r"^gradient_stats/.*/norm$"]],
        "activation std": ["Multiline", [r"^activation_stats/.*/std$"]],
        "zero fraction": ["Multiline", [r"^activation_stats/.*/zero_fraction$"]],
        "non-finite counts": ["Multiline", [r"^activation_stats/.*/nonfinite$", r"^gradient_stats/.*/nonfinite$"]],
        "update ratio": ["Multiline", [r"^update_ratio/.*$"]],
    },
}

__all__ = ["DASHBOARD_LAYOUT", "TensorBoardSink", "BackgroundSink", "use_fast_crc"]

logger = logging.getLogger(__name__)


def use_fast_crc() -> bool:
    """Make TensorBoard's event writer checksum records in C instead of pure Python, process-wide.

    Without TensorFlow, ``tensorboard`` computes the CRC-32C of every record it writes
    with a Python loop over the bytes: about 7 ms for one 34 KB feature-map PNG, on the
    writer's thread but holding the GIL, so it slows training more than the PNG encoding.
    With the ``crc32c`` package installed this swaps in the same checksum from C (the
    values are identical, and checked on a probe before the swap; tensorboardX does the
    same).

    This changes a module of ``tensorboard``, so it holds for every ``SummaryWriter`` in
    the process, yours included. :func:`actviz.watch` and :func:`actviz.report` call it
    once each, explicitly; no sink does. It is idempotent and fail-safe: if anything goes
    wrong (``crc32c`` missing, TensorBoard renamed what is swapped), TensorBoard is left as
    it was, the reason is logged once at DEBUG level, and it returns False.

    Example:
        >>> use_fast_crc(), use_fast_crc()
        (True, True)
    """
    global _fast_crc_failure_logged
    try:
        import crc32c

        return replace_record_checksum(_masked_crc32c(crc32c.crc32c))
    except Exception:  # a faster checksum is never worth an error
        if not _fast_crc_failure_logged:
            _fast_crc_failure_logged = True
            logger.debug("TensorBoard records stay checksummed in pure Python", exc_info=True)
        return False


_fast_crc_failure_logged = False


def _masked_crc32c(crc32c: Callable[[bytes], int]) -> Callable[[bytes], int]:
    def masked_crc32c(data: bytes) -> int:
        # TFRecord's masking, as tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c
        crc = crc32c(data) & 0xFFFFFFFF
        return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF

    return masked_crc32c


class TensorBoardSink:
    """Writes :class:`~actviz.results.StepResults` through a ``SummaryWriter``.

    Args:
        writer: A ``torch.utils.tensorboard.SummaryWriter``.
        owns_writer: Close the writer in :meth:`close`. True only when actviz created it.
        layout: Write :data:`DASHBOARD_LAYOUT` for TensorBoard's Custom Scalars tab with the
            first step (TensorBoard keeps one layout per run: it replaces one written before).
    """

    def __init__(self, writer: Any, owns_writer: bool, layout: bool = False) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        self.layout = layout
        self._layout_written = False
        self._closed = False
        self._shown: set[str] = set()  # tags written only once they are not zero: those that were

    def write(self, results: StepResults) -> None:
        """Write every histogram, scalar and image of one step, as one TensorBoard event.

        One ``Summary`` with many values is what TensorFlow's merged summaries write, and
        every TensorBoard loader reads it; it saves an event, a checksum and a queue
        hand-off per value.
        """
        values = _step_values(results, self._shown)
        values += [_image_value(f"feature_maps/{layer}", image) for layer, image in results.images.items()]
        values += [_image_value(tag, image) for tag, image in results.pictures.items()]
        if self.layout and not self._layout_written:  # with the first step, as TensorBoard keeps one per run
            values += list(custom_scalars(DASHBOARD_LAYOUT).value)
        event_file_writer(self.writer).add_summary(SummaryProto(value=values), results.step)
        self._layout_written = True

    def write_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """Write a ``(1 or 3, H, W)`` ``uint8`` picture under ``tag``, through the same PNG encoder.

        ``add_image`` would re-encode it through a LANCZOS resize at PNG level 6; a fast
        level is several times cheaper.
        """
        event_file_writer(self.writer).add_summary(SummaryProto(value=[_image_value(tag, image)]), step)

    def write_values(self, step: int, scalars: dict[str, float], texts: dict[str, str] | None = None) -> None:
        """Write scalars and texts (markdown) at ``step``, as one event."""
        values = _scalar_values(scalars) + [_text_value(tag, text) for tag, text in (texts or {}).items()]
        event_file_writer(self.writer).add_summary(SummaryProto(value=values), step)

    def flush(self) -> None:
        if not self._closed:
            self.writer.flush()

    def close(self) -> None:
        """Flush, and close the writer if this sink owns it. Safe to call more than once."""
        if self._closed:
            return
        self.writer.flush()
        if self.owns_writer:
            self.writer.close()
        self._closed = True


class PendingResults(Protocol):
    """A step on its way to the host (:class:`actviz.transfer.PendingStep`)."""

    step: int

    def resolve(self) -> StepResults: ...


class BackgroundSink:
    """Finishes steps and runs another sink's writes on one worker thread, in order.

    Waiting for a step's copy from the device, counting its buckets, drawing and
    PNG-encoding its pictures and building protobufs then overlap the next training
    steps instead of lengthening the logging step; on a GPU machine the CPU is mostly
    idle while the device computes, so they come almost for free. At most
    ``max_pending`` steps wait; a further :meth:`write` blocks until one is written, so
    memory stays bounded.

    Args:
        sink: The sink doing the writing, e.g. a :class:`TensorBoardSink`.
        on_error: Called on the worker thread with the pending step and the exception
            when finishing or writing it fails. The thread goes on with the next step.
        max_pending: Most steps queued at once.
        resolve: Turns a pending step into its results on the worker thread; by default
            ``pending.resolve()``.
        after_write: Called on the worker thread with each step's results once written.
    """

    def __init__(
        self,
        sink: TensorBoardSink,
        on_error: Callable[[Any, BaseException], None],
        max_pending: int = 2,
        resolve: Callable[[Any], StepResults] | None = None,
        after_write: Callable[[StepResults], None] | None = None,
    ) -> None:
        self.sink = sink
        self._on_error = on_error
        self._resolve = resolve or (lambda pending: pending.resolve())
        self._after_write = after_write
        self._queue: queue.Queue[PendingResults | None] = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def writer(self) -> Any:
        return self.sink.writer

    def write(self, pending: PendingResults) -> None:
        """Queue one step for finishing and writing."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="actviz-writer", daemon=True)
            self._thread.start()
        self._queue.put(pending)

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                if pending is None:
                    return
                results = self._resolve(pending)
                if not results.is_empty():
                    self.sink.write(results)
                    if self._after_write is not None:
                        self._after_write(results)
            except Exception as error:  # noqa: BLE001 - the thread must outlive a failed write
                with contextlib.suppress(Exception):  # e.g. its warning turned into an error by a filter
                    self._on_error(pending, error)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued step is written, then flush the writer."""
        self._queue.join()
        self.sink.flush()

    def close(self) -> None:
        """Write what is queued, stop the thread and close the sink. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        self.sink.close()
