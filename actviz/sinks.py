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
``amp/grad_scale``                         scalar: the AMP loss scale (with ``grad_scaler=``)
``layers``                                 text: the watched layers, at the first stats step
``alerts``                                 text: where NaN or Inf first showed (once per run)
``probe/input``, ``gradcam/{layer}``       images: the probe's sample 0, Grad-CAM over it
``update_ratio/{param}``                   scalar: ||w_after - w_before|| / ||w_before|| (opt-in)
=========================================  ==============================================
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

from ._internals import event_file_writer, replace_record_checksum
from .png import encode_png
from .results import StepResults, Summary

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

__all__ = ["DASHBOARD_LAYOUT", "BackgroundSink", "TensorBoardSink", "use_fast_crc"]

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
        layout: Write :data:`DASHBOARD_LAYOUT` for TensorBoard's Custom Scalars tab with the
            first step (TensorBoard keeps one layout per run: it replaces one written before).
    """

    def __init__(self, writer: Any, owns_writer: bool, layout: bool = False) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        self.layout = layout
        self._layout_written = False
        self._closed = False

    def write(self, results: StepResults) -> None:
        """Write every histogram, scalar and image of one step, as one TensorBoard event.

        One ``Summary`` with many values is what TensorFlow's merged summaries write, and
        every TensorBoard loader reads it; it saves an event, a checksum and a queue
        hand-off per value.
        """
        values = _step_values(results)
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
    values += _scalar_values(results.scalars)
    values += [_text_value(tag, text) for tag, text in results.texts.items()]
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


def _text_value(tag: str, text: str) -> SummaryProto.Value:
    """A markdown text summary under ``tag`` itself (``SummaryWriter.add_text`` would add ``/text_summary``)."""
    value = text_summary(tag, text).value[0]
    value.tag = tag
    return value


def _image_value(tag: str, image: torch.Tensor) -> SummaryProto.Value:
    channels, height, width = image.shape
    proto = SummaryProto.Image(height=height, width=width, colorspace=channels, encoded_image_string=encode_png(image))
    return SummaryProto.Value(tag=tag, image=proto)


from .background import BackgroundSink  # noqa: E402 - re-exported: it was defined here
