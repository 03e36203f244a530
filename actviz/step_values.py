"""The ``Summary.Value`` protos of one step, tagged as :mod:`actviz.sinks` documents.

Pure functions from :class:`~actviz.results.StepResults` to TensorBoard protobufs, so
that a sink only decides where they go.
"""

from __future__ import annotations

import torch
from tensorboard.compat.proto.summary_pb2 import HistogramProto
from tensorboard.compat.proto.summary_pb2 import Summary as SummaryProto
from torch.utils.tensorboard.summary import text as text_summary

from .png import encode_png
from .results import StepResults, Summary

__all__: list[str] = []  # used by actviz.sinks


def _step_values(results: StepResults, shown: set[str] | None = None) -> list[SummaryProto.Value]:
    """The histogram and scalar ``Summary.Value`` protos of one step, tagged as in the module docstring.

    ``shown``: the tags written only once they are not zero (``nonfinite``, ``zero_fraction``) that
    were, updated here; ``None`` writes them all.
    """
    values: list[SummaryProto.Value] = []
    for layer, summary in results.activations.items():
        values += _histogram_values(f"activations/{layer}", summary)
        values += _scalar_values({
            f"activation_stats/{layer}/mean": summary.mean,
            f"activation_stats/{layer}/std": summary.std,
            **_once_not_zero(shown, {
                f"activation_stats/{layer}/zero_fraction": summary.zero_fraction,
                f"activation_stats/{layer}/nonfinite": summary.nonfinite,
            }),
        })
    for layer, summary in results.gradients.items():
        values += _histogram_values(f"gradients/{layer}", summary)
        values += _scalar_values({
            f"gradient_stats/{layer}/norm": summary.norm,
            **_once_not_zero(shown, {f"gradient_stats/{layer}/nonfinite": summary.nonfinite}),
        })
    for param, summary in results.weights.items():
        values += _histogram_values(f"weights/{param}", summary)
    for param, summary in results.weight_grads.items():
        values += _histogram_values(f"weight_grads/{param}", summary)
    for tag, summary in results.histograms.items():  # full tags, e.g. attention/{layer}/head_max_logit
        values += _histogram_values(tag, summary)
    values += _scalar_values(results.scalars)
    values += [_text_value(tag, text) for tag, text in results.texts.items()]
    return values


def _once_not_zero(shown: set[str] | None, scalars: dict[str, float]) -> dict[str, float]:
    """The scalars that are not zero, or were at an earlier step (a chart that goes back to 0 shows it)."""
    if shown is None:
        return scalars
    shown.update(tag for tag, value in scalars.items() if value != 0)
    return {tag: value for tag, value in scalars.items() if tag in shown}


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
