"""TensorBoard ``Summary.Value`` protos of the tagged items of :func:`actviz.tags.step_items`.

Pure functions, so that :class:`~actviz.output.tensorboard.TensorBoardSink` only decides where they go.

Example:
    >>> from actviz.summaries.one_tensor import finish, reduce_tensor
    >>> from actviz.tags import step_items
    >>> results = StepResults(3, gradients={"fc": finish(reduce_tensor(torch.tensor([3.0, -4.0]), None), 2)},
    ...                       scalars={"gradient_stats/fc/norm": 5.0})
    >>> values = [value for item in step_items(results) for value in _values(*item)]
    >>> [(value.tag, round(value.simple_value, 3)) for value in values if value.HasField("simple_value")]
    [('gradient_stats/fc/norm', 5.0)]
    >>> [value.tag for value in values if value.HasField("histo")]
    ['gradients/fc']
"""

from __future__ import annotations

from typing import Any

import torch
from tensorboard.compat.proto.summary_pb2 import HistogramProto
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto
from torch.utils.tensorboard.summary import text as text_summary

from ..common.histogram_buckets import merge_empty_buckets
from ..common.pixels import PaletteImage
from .png import encode_png
from ..common.results import StepResults, Summary  # noqa: F401 - StepResults for the example

__all__: list[str] = []  # used by actviz.output.tensorboard


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
