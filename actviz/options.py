"""Capture options: the one home of actviz's defaults and of their checks.

:func:`actviz.watch`, the Lightning and Hugging Face callbacks and the ``actviz``
command all build a :class:`CaptureOptions`, so a bad value gets the same message
wherever it is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = [
    "CaptureOptions", "DEFAULT_BINS", "DEFAULT_MAX_CHANNELS", "DEFAULT_SAMPLE_SIZE", "MAX_BINS", "cpu_shortcuts",
]

DEFAULT_BINS = 64
#: Most histogram buckets: each is three float64 per tensor and step in the event file (4096 makes a
#: histogram of about 100 KB), and TensorBoard's histogram view draws at most 30 of them anyway.
MAX_BINS = 4096
DEFAULT_MAX_CHANNELS = 64
#: Bucket counts come from at most this many elements, taken with a fixed stride; the
#: moments, min and max always use every element. At 64 bins that is 256 sampled values
#: per bucket on average: a bucket holding 1/64 of the values is counted within about 6%
#: (one standard error).
DEFAULT_SAMPLE_SIZE = 1 << 14


def cpu_shortcuts() -> bool:
    """False when the environment sets ``ACTVIZ_CPU_SHORTCUTS=0``.

    Then CPU tensors take the code path of GPU tensors (the same torch ops, packing and
    copy), so that the suite tests that path and anyone can count its ops on a CPU.
    """
    return os.environ.get("ACTVIZ_CPU_SHORTCUTS", "1") != "0"


def check_positive_int(name: str, value: Any, example: int, most: int | None = None) -> None:
    """Raise a ``TypeError`` or ``ValueError`` that names ``name`` unless ``value`` is an int > 0 (and <= ``most``)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}; for example {name}={example}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}; for example {name}={example}")
    if most is not None and value > most:
        raise ValueError(f"{name} must be at most {most}, got {value}; for example {name}={example}")


@dataclass(frozen=True)
class CaptureOptions:
    """What a logging step reduces each tensor to. Checked when made.

    Args:
        bins: Histogram buckets, 1 to :data:`MAX_BINS` (4096).
        histogram_sample_size: Bucket counts come from an evenly strided sample of at most
            this many elements, scaled to the full count; ``None`` counts every element.
        max_channels: Most channels drawn per feature-map grid; the strongest are kept.
        outputs: ``"first"`` logs the first tensor of a tuple, list or dict output under the
            layer's name; ``"all"`` logs each with its position as a suffix.
        update_ratio: Log each parameter's relative change across the update after a stats step.
        merge_ranks: Merge every rank's summaries into rank 0's (see :mod:`actviz.summaries.merge_ranks`).
        unit_counts: Count dead ReLU channels and saturated Tanh/Sigmoid outputs (:mod:`actviz.statistics.unit_counts`)
            where ``statistics`` is ``None``: their default, set by ``watch(alerts=...)``.
        transformer_stats: Attention, output-logit and outlier statistics (:mod:`actviz.capture.transformer_step`):
            ``None`` for models with an attention module, ``True`` always, ``False`` never.
        moe: Mixture-of-experts router statistics (:mod:`actviz.transformers.moe`): ``None`` for models with a
            module whose class name says MoE, router, gate or expert, ``True`` always, ``False`` never.
        statistics: The per-layer statistics to run (:mod:`actviz.statistics`): ``None`` for each built-in
            one where it is on by default, or a tuple of :class:`~actviz.statistics.layer_statistic.LayerStatistic`
            objects, checked by :func:`actviz.statistics.registry.check_statistics`.
        gradient_noise: Log the gradient noise scale from per-example gradient norms (:mod:`actviz.statistics.gradient_noise`).
        flow_pictures: Draw the ``flow/*`` pictures (:mod:`actviz.diagnosis.flow`) on image steps. Off by default:
            TensorBoard's actviz tab (:mod:`actviz.view`) draws the same layers x steps view from the scalars;
            turn them on for a sink of your own or a TensorBoard without the tab.

    Raises:
        TypeError: A value of the wrong type, named.
        ValueError: A value out of range, named with an example of a good one.

    Example:
        >>> CaptureOptions(bins=32).bins
        32
        >>> CaptureOptions(bins=0)
        Traceback (most recent call last):
        ...
        ValueError: bins must be positive, got 0; for example bins=64
    """

    bins: int = DEFAULT_BINS
    histogram_sample_size: int | None = DEFAULT_SAMPLE_SIZE
    max_channels: int = DEFAULT_MAX_CHANNELS
    outputs: Literal["first", "all"] = "first"
    update_ratio: bool = False
    merge_ranks: bool = False
    unit_counts: bool = False  # set by watch(alerts=...): the default of actviz.statistics.unit_counts
    transformer_stats: bool | None = None
    moe: bool | None = None
    statistics: tuple[Any, ...] | None = None
    gradient_noise: bool = False
    flow_pictures: bool = False

    def __post_init__(self) -> None:
        check_positive_int("bins", self.bins, DEFAULT_BINS, MAX_BINS)
        check_positive_int("max_channels", self.max_channels, DEFAULT_MAX_CHANNELS)
        if self.histogram_sample_size is not None:
            check_positive_int("histogram_sample_size", self.histogram_sample_size, DEFAULT_SAMPLE_SIZE)
        if self.outputs not in ("first", "all"):
            raise ValueError(f"outputs must be 'first' or 'all', got {self.outputs!r}")
        for name in ("update_ratio", "merge_ranks", "unit_counts", "gradient_noise", "flow_pictures"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.transformer_stats not in (None, True, False):
            raise TypeError(f"transformer_stats must be None (auto), True or False, got {self.transformer_stats!r}")
        if self.moe is not None and not isinstance(self.moe, bool):
            raise TypeError(f"moe must be None (auto), True or False, got {type(self.moe).__name__}: {self.moe!r}; "
                            "for example moe=True")
        if self.statistics is not None and not isinstance(self.statistics, tuple):
            raise TypeError(f"statistics must be None or a tuple of LayerStatistic objects, got {self.statistics!r}")

    @classmethod
    def names(cls) -> list[str]:
        """The option names, as :func:`actviz.watch` takes them."""
        return [option.name for option in fields(cls)]
