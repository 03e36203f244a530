"""Sinks: write one step's results to TensorBoard.

Every tag and what it holds is in :mod:`actviz.tags` (:func:`~actviz.tags.step_items`); this
module only maps those items to TensorBoard's values (pure functions at its end), under TensorBoard's names of the tags
(:func:`~actviz.tags.tensorboard_tag`: scalars, histograms and images after ``~``). Any object
with ``write(results)``, ``flush()`` and ``close()`` is a sink too (:class:`Sink`, ``watch(sink=...)``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from tensorboard.compat.proto.summary_pb2 import HistogramProto
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto
from torch.utils.tensorboard.summary import custom_scalars
from torch.utils.tensorboard.summary import text as text_summary

from ..common._tensorboard_internals import event_file_writer, replace_record_checksum
from .event_records import WholeRecords, guard_records
from ..tags import TENSORBOARD_PREFIX, step_items, tensorboard_tag
from ..common.histogram_buckets import merge_empty_buckets
from ..common.pixels import PaletteImage
from ..common.results import StepResults, Summary
from .png import encode_png
from .sink import Sink

_TAG = "^" + TENSORBOARD_PREFIX  # the start of TensorBoard's name of an actviz scalar ("~" is not special in a regex)
#: Custom Scalars charts (anchored regexes on TensorBoard's names of actviz's tags): each statistic across all layers.
DASHBOARD_LAYOUT = {
    "actviz: every layer on one chart": {
        "gradient norm": ["Multiline", [rf"{_TAG}gradient_stats/norm@.+$"]],
        "activation std": ["Multiline", [rf"{_TAG}activation_stats/std@.+$"]],
        "zero fraction": ["Multiline", [rf"{_TAG}activation_stats/zero_fraction@.+$"]],
        "non-finite counts": ["Multiline", [rf"{_TAG}activation_stats/nonfinite@.+$", rf"{_TAG}gradient_stats/nonfinite@.+$"]],
        "update ratio": ["Multiline", [rf"{_TAG}update_ratio/.*$"]],
    },
}

__all__ = ["DASHBOARD_LAYOUT", "Sink", "TensorBoardSink", "use_fast_crc"]

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
    """Writes :class:`~actviz.common.results.StepResults` through a ``SummaryWriter``.

    Args:
        writer: A ``torch.utils.tensorboard.SummaryWriter``.
        owns_writer: Close the writer in :meth:`close`. True only when actviz created it.
        layout: Write :data:`DASHBOARD_LAYOUT` for TensorBoard's Custom Scalars tab with the
            first step (TensorBoard keeps one layout per run: it replaces one written before).

    Scalars, histograms and images go under ``~`` + tag (:func:`~actviz.tags.tensorboard_tag`), so that
    TensorBoard lists them after the user's own tags; texts under their tags.

    Each step is in the event file when :meth:`write` returns. A write that fails (a full disk) leaves the event file
    ending with a whole record (:mod:`actviz.output.event_records`) and raises an ``OSError`` that names the
    step and the folder; the next steps are written once writing works again.
    """

    def __init__(self, writer: Any, owns_writer: bool, layout: bool = False) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        self.layout = layout
        self._layout_written = False
        self._closed = False
        self._shown: set[str] = set()  # tags written only once they are not zero: those that were
        self._file_writer: Any = None  # the writer's FileWriter that self._records guards
        self._records: WholeRecords | None = None
        self._failing = False  # the last record failed: the next one that is written says so in the log

    def write(self, results: StepResults) -> None:
        """Write every histogram, scalar and image of one step, as one TensorBoard event.

        One ``Summary`` with many values is what TensorFlow's merged summaries write, and
        every TensorBoard loader reads it; it saves an event, a checksum and a queue
        hand-off per value.
        """
        values = [value for kind, tag, item in step_items(results, self._shown)
                  for value in _values(kind, tensorboard_tag(kind, tag), item)]
        if self.layout and not self._layout_written:  # with the first step, as TensorBoard keeps one per run
            values += list(custom_scalars(DASHBOARD_LAYOUT).value)
        self._add(SummaryProto(value=values), results.step)
        self._layout_written = True

    def write_image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """Write a ``(1 or 3, H, W)`` ``uint8`` picture under ``tag`` (after ``~``), through the same PNG encoder.

        ``add_image`` would re-encode it through a LANCZOS resize at PNG level 6; a fast
        level is several times cheaper.
        """
        value = _image_value(tensorboard_tag("image", tag), image)
        self._add(SummaryProto(value=[value]), step)

    def write_values(self, step: int, scalars: dict[str, float], texts: dict[str, str] | None = None) -> None:
        """Write scalars (after ``~``) and texts (markdown) at ``step``, as one event."""
        values = _scalar_values({tensorboard_tag("scalar", tag): value for tag, value in scalars.items()})
        values += [_text_value(tag, text) for tag, text in (texts or {}).items()]
        self._add(SummaryProto(value=values), step)

    def _add(self, summary: SummaryProto, step: int) -> None:
        """Write one event at ``step`` and wait until it is on disk; raise an ``OSError`` if it could not be."""
        file_writer = event_file_writer(self.writer)
        if file_writer is not self._file_writer:  # the first write, or a SummaryWriter reopened after close()
            self._file_writer, self._records = file_writer, guard_records(file_writer)
        if self._records is None:
            file_writer.add_summary(summary, step)
            return
        before, _ = self._records.state()
        file_writer.add_summary(summary, step)
        file_writer.flush()  # its thread writes the record, or counts it as failed
        failures, error = self._records.state()
        if failures > before:
            self._failing = True
            raise _not_written(step, self.writer.get_logdir(), error)
        if self._failing:
            self._failing = False
            logger.warning("actviz writes to %s again from step %d (viz.dropped_steps counts the steps it could not "
                           "write)", self.writer.get_logdir(), step)

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


def _not_written(step: int, folder: str, error: OSError | None) -> OSError:
    """The error a step that is not on disk raises: the OS's reason, the folder and what to do."""
    reason = f"{getattr(error, 'strerror', None) or error}, writing step {step} to {folder}. Free space there (or " \
             "raise the file size limit): actviz counts the steps it cannot write in viz.dropped_steps and writes " \
             "the next ones once it can"
    number = getattr(error, "errno", None)
    return OSError(reason) if number is None else OSError(number, reason)


def _values(kind: str, tag: str, value: Any) -> list[SummaryProto.Value]:
    """The ``Summary.Value`` protos of one :func:`actviz.tags.step_items` item (none for an empty histogram)."""
    if kind == "histogram":
        return _histogram_values(tag, value)
    if kind == "scalar":
        return _scalar_values({tag: value})
    if kind == "text":
        return [_text_value(tag, value)]
    return [_image_value(tag, value)]


def _histogram_values(tag: str, summary: Summary) -> list[SummaryProto.Value]:
    if not summary.has_histogram:  # empty or all NaN/Inf: the scalars say so
        return []
    limits, counts = merge_empty_buckets(*summary.histogram())  # lossless: see actviz.common.histogram_buckets
    histo = HistogramProto(
        min=summary.min, max=summary.max, num=summary.finite_count, sum=summary.sum,
        sum_squares=summary.sum_squares, bucket_limit=limits, bucket=counts,
    )
    return [SummaryProto.Value(tag=tag, histo=histo)]


def _scalar_values(scalars: dict[str, float]) -> list[SummaryProto.Value]:
    # simple_value, as SummaryWriter.add_scalar writes by default
    return [SummaryProto.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]


def _text_value(tag: str, text: str) -> SummaryProto.Value:
    """A markdown text summary under ``tag`` itself (``SummaryWriter.add_text`` would add ``/text_summary``)."""
    value = text_summary(tag, text).value[0]
    value.tag = tag
    return value


def _image_value(tag: str, image: torch.Tensor | PaletteImage) -> SummaryProto.Value:
    channels, height, width = image.shape
    png = encode_png(image)  # a heat map (PaletteImage): one byte per pixel, decoded to RGB
    proto = SummaryProto.Image(height=height, width=width, colorspace=channels, encoded_image_string=png)
    return SummaryProto.Value(tag=tag, image=proto)
