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

import logging
from typing import Any

import torch
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto

from .capture import StepResults
from .rendering import encode_png
from .summaries import Summary

__all__ = ["TensorBoardSink"]

logger = logging.getLogger(__name__)


class TensorBoardSink:
    """Writes :class:`~actviz.capture.StepResults` through a ``SummaryWriter``.

    Args:
        writer: A ``torch.utils.tensorboard.SummaryWriter``.
        owns_writer: Close the writer in :meth:`close`. True only when actviz created it.
    """

    def __init__(self, writer: Any, owns_writer: bool) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        self._closed = False

    def write(self, results: StepResults) -> None:
        """Write every histogram, scalar and image of one step."""
        step = results.step
        for layer, summary in results.activations.items():
            self._histogram(f"activations/{layer}", summary, step)
            self._scalar(f"activation_stats/{layer}/mean", summary.mean, step)
            self._scalar(f"activation_stats/{layer}/std", summary.std, step)
            self._scalar(f"activation_stats/{layer}/zero_fraction", summary.zero_fraction, step)
            self._scalar(f"activation_stats/{layer}/nonfinite", summary.nonfinite, step)
        for layer, summary in results.gradients.items():
            self._histogram(f"gradients/{layer}", summary, step)
            self._scalar(f"gradient_stats/{layer}/norm", summary.norm, step)
            self._scalar(f"gradient_stats/{layer}/nonfinite", summary.nonfinite, step)
        for param, summary in results.weights.items():
            self._histogram(f"weights/{param}", summary, step)
        for param, summary in results.weight_grads.items():
            self._histogram(f"weight_grads/{param}", summary, step)
        for layer, image in results.images.items():
            self._image(f"feature_maps/{layer}", image, step)

    def _histogram(self, tag: str, summary: Summary, step: int) -> None:
        if not summary.has_histogram:  # empty or all NaN/Inf: the scalars say so
            return
        limits, counts = summary.histogram()
        self.writer.add_histogram_raw(
            tag, min=summary.min, max=summary.max, num=summary.finite_count, sum=summary.sum,
            sum_squares=summary.sum_squares, bucket_limits=limits, bucket_counts=counts, global_step=step,
        )

    def _scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def _image(self, tag: str, image: torch.Tensor, step: int) -> None:
        # add_image would re-encode through a LANCZOS resize at PNG level 6; a fast level is
        # several times cheaper. Fall back to add_image for writers without a file writer.
        get_file_writer = getattr(self.writer, "_get_file_writer", None)
        if get_file_writer is None:
            self.writer.add_image(tag, image, step, dataformats="CHW")
            return
        channels, height, width = image.shape
        proto = SummaryProto.Image(
            height=height, width=width, colorspace=channels, encoded_image_string=encode_png(image)
        )
        get_file_writer().add_summary(SummaryProto(value=[SummaryProto.Value(tag=tag, image=proto)]), step)

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
