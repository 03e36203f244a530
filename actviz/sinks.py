"""Sinks: write one step's results to TensorBoard.

Tags (``layer`` from ``named_modules()``, ``param`` from ``named_parameters()``):

=========================================  ==============================================
``feature_maps/{layer}``                   image: channel grid (4-D) or heat map (3-D)
``activations/{layer}``                    histogram of the layer's output
``gradients/{layer}``                      histogram of the gradient w.r.t. that output
``weights/{param}``                        histogram of the parameter
``weight_grads/{param}``                   histogram of the parameter's gradient
``activation_stats/{layer}/mean``          also ``/std``, ``/zero_fraction``, ``/nonfinite``
``gradient_stats/{layer}/norm``            also ``/nonfinite``
=========================================  ==============================================
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from tensorboard.compat.proto.summary_pb2 import HistogramProto
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

from ._internals import event_file_writer, replace_record_checksum
from .png import encode_png
from .results import StepResults, Summary

__all__ = ["TensorBoardSink", "BackgroundSink", "use_fast_crc"]

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
    except Exception:  # noqa: BLE001 - a faster checksum is never worth an error
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
    """

    def __init__(self, writer: Any, owns_writer: bool) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        self._closed = False

    def write(self, results: StepResults) -> None:
        """Write every histogram, scalar and image of one step, as one TensorBoard event.

        One ``Summary`` with many values is what TensorFlow's merged summaries write, and
        every TensorBoard loader reads it; it saves an event, a checksum and a queue
        hand-off per value.
        """
        values = _step_values(results)
        values += [_image_value(f"feature_maps/{layer}", image) for layer, image in results.images.items()]
        event_file_writer(self.writer).add_summary(SummaryProto(value=values), results.step)

    def write_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """Write a ``(1 or 3, H, W)`` ``uint8`` picture under ``tag``, through the same PNG encoder.

        ``add_image`` would re-encode it through a LANCZOS resize at PNG level 6; a fast
        level is several times cheaper.
        """
        event_file_writer(self.writer).add_summary(SummaryProto(value=[_image_value(tag, image)]), step)

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


def _step_values(results: StepResults) -> list[SummaryProto.Value]:
    """The histogram and scalar ``Summary.Value`` protos of one step, tagged as in the module docstring."""
    values: list[SummaryProto.Value] = []
    for layer, summary in results.activations.items():
        values += _histogram_values(f"activations/{layer}", summary)
        values += _scalar_values({
            f"activation_stats/{layer}/mean": summary.mean,
            f"activation_stats/{layer}/std": summary.std,
            f"activation_stats/{layer}/zero_fraction": summary.zero_fraction,
            f"activation_stats/{layer}/nonfinite": summary.nonfinite,
        })
    for layer, summary in results.gradients.items():
        values += _histogram_values(f"gradients/{layer}", summary)
        values += _scalar_values({
            f"gradient_stats/{layer}/norm": summary.norm,
            f"gradient_stats/{layer}/nonfinite": summary.nonfinite,
        })
    for param, summary in results.weights.items():
        values += _histogram_values(f"weights/{param}", summary)
    for param, summary in results.weight_grads.items():
        values += _histogram_values(f"weight_grads/{param}", summary)
    return values


def _histogram_values(tag: str, summary: Summary) -> list[SummaryProto.Value]:
    if not summary.has_histogram:  # empty or all NaN/Inf: the scalars say so
        return []
    limits, counts = summary.histogram()
    histo = HistogramProto(
        min=summary.min, max=summary.max, num=summary.finite_count, sum=summary.sum,
        sum_squares=summary.sum_squares, bucket_limit=limits, bucket=counts,
    )
    return [SummaryProto.Value(tag=tag, histo=histo)]


def _scalar_values(scalars: dict[str, float]) -> list[SummaryProto.Value]:
    # simple_value, as SummaryWriter.add_scalar writes by default
    return [SummaryProto.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]


def _image_value(tag: str, image: torch.Tensor) -> SummaryProto.Value:
    channels, height, width = image.shape
    proto = SummaryProto.Image(height=height, width=width, colorspace=channels, encoded_image_string=encode_png(image))
    return SummaryProto.Value(tag=tag, image=proto)


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
    """

    def __init__(
        self,
        sink: TensorBoardSink,
        on_error: Callable[[Any, BaseException], None],
        max_pending: int = 2,
    ) -> None:
        self.sink = sink
        self._on_error = on_error
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
            _close_at_exit(self)
        self._queue.put(pending)

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            try:
                if pending is None:
                    return
                results = pending.resolve()
                if not results.is_empty():
                    self.sink.write(results)
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
        _open_sinks.discard(self)
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        self.sink.close()


#: Background sinks whose thread runs and that nobody closed yet.
_open_sinks: weakref.WeakSet[BackgroundSink] = weakref.WeakSet()
_atexit_lock = threading.Lock()
_atexit_registered = False


def _close_at_exit(sink: BackgroundSink) -> None:
    """Have ``sink`` closed at interpreter exit; one ``atexit`` entry serves every sink of the process."""
    global _atexit_registered
    with _atexit_lock:
        _open_sinks.add(sink)
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(_close_open_sinks)


def _close_open_sinks() -> None:
    # The writer thread is a daemon and dies with the interpreter: write what is queued if
    # nobody closed the watcher. Closed sinks have left the set; collected ones too.
    for sink in list(_open_sinks):
        try:
            sink.close()
        except Exception:  # noqa: BLE001 - close the others all the same
            logger.debug("closing a background sink at exit failed", exc_info=True)
