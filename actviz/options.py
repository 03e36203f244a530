"""Options: the one home of actviz's defaults and of their checks.

* :class:`Options` (``actviz.Options``): the sizes and mechanics a user sets, ``watch(options=...)``.
* :class:`CaptureOptions`: what capture reads, built by :func:`actviz.watch` from :class:`Options` and
  ``statistics=``; the ``actviz`` command and ``actviz report`` build one too, so a bad value gets the same
  message wherever it is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

__all__ = [
    "Options", "CaptureOptions", "DEFAULT_BINS", "check_grad_scaler", "DEFAULT_MAX_CHANNELS", "DEFAULT_SAMPLE_SIZE", "MAX_BINS", "cpu_shortcuts",
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
class Options:
    """Sizes and mechanics of a watcher, ``actviz.watch(model, options=actviz.Options(...))``. Checked when made.

    Args:
        bins: Histogram buckets, 1 to :data:`MAX_BINS` (4096).
        max_channels: Most channels drawn per feature-map grid; the strongest are kept.
        histogram_sample_size: Bucket counts come from an evenly strided sample of at most this many
            elements, scaled to the full count; ``None`` counts every element. The count, sum, sum of
            squares, min, max and all scalars always use every element.
        outputs: For modules that return tuples, lists or dicts: ``"first"`` logs the first tensor under the
            layer's name; ``"all"`` logs each tensor with its position as a suffix, e.g. ``lstm/0``,
            ``lstm/1.0``, ``lstm/1.1`` for ``(out, (h, c))``.
        auto_step: Count steps by training forwards. ``False`` to drive them yourself with
            :meth:`actviz.Watcher.set_step` (the Lightning and Hugging Face callbacks do).
        strict: Re-raise errors from actviz's hooks and callbacks instead of warning once and going on.
        grad_scaler: The ``torch.amp.GradScaler`` of a mixed-precision loop: every logged gradient is then the
            true one, and each stats step also writes its scale as ``amp/grad_scale``.
        merge_ranks: Under ``torch.distributed``, log every rank's data, not rank 0's alone: every rank hooks
            the same logging steps and a few collectives per step merge them before rank 0 writes. Every rank
            must then call :func:`actviz.watch`, ``viz.flush()`` and ``viz.close()`` alike. The default runs
            no collective at all.
        flow_pictures: Also draw the ``flow/*`` pictures, every layer over time as a PNG, on image steps
            (docs/diagnosis.md). Off by default: TensorBoard's actviz tab and ``actviz export`` draw the same view
            from the scalars; turn them on for a sink of your own or a TensorBoard without the tab.
        quiet: Say nothing at the start and end of the run (:mod:`actviz.output.run_notes`): no line saying what is
            watched and where it goes, none with the steps logged and the commands that show them. The
            environment variable ``ACTVIZ_QUIET=1`` does the same for every watcher. Warnings and alerts are not
            affected.

    Raises:
        TypeError: A value of the wrong type, named.
        ValueError: A value out of range, named with an example of a good one.

    Example:
        >>> Options(bins=32, strict=True).bins
        32
        >>> Options(bins=0)
        Traceback (most recent call last):
        ...
        ValueError: bins must be positive, got 0; for example bins=64
        >>> Options(strict="yes")
        Traceback (most recent call last):
        ...
        TypeError: strict must be True or False, got 'yes'
    """

    bins: int = DEFAULT_BINS
    max_channels: int = DEFAULT_MAX_CHANNELS
    histogram_sample_size: int | None = DEFAULT_SAMPLE_SIZE
    outputs: Literal["first", "all"] = "first"
    auto_step: bool = True
    strict: bool = False
    grad_scaler: Any = None
    merge_ranks: bool = False
    flow_pictures: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        check_sizes(self.bins, self.max_channels, self.histogram_sample_size, self.outputs)
        for name in ("auto_step", "strict", "merge_ranks", "flow_pictures", "quiet"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_grad_scaler(self.grad_scaler)


def check_grad_scaler(grad_scaler: Any) -> None:
    """Raise a ``TypeError`` unless ``grad_scaler`` is ``None`` or a ``torch.amp.GradScaler``.

    Example:
        >>> check_grad_scaler(torch.amp.GradScaler("cpu"))
        >>> check_grad_scaler(2.0**16)
        Traceback (most recent call last):
        TypeError: grad_scaler must be a torch.amp.GradScaler (or torch.cuda.amp.GradScaler), got float; ...
    """
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(
            f"grad_scaler must be a torch.amp.GradScaler (or torch.cuda.amp.GradScaler), "
            f"got {type(grad_scaler).__name__}; pass the scaler your loop calls scaler.scale(loss) on"
        )


def check_sizes(bins: Any, max_channels: Any, histogram_sample_size: Any, outputs: Any) -> None:
    """The checks of the sizes :class:`Options` and :class:`CaptureOptions` share."""
    check_positive_int("bins", bins, DEFAULT_BINS, MAX_BINS)
    check_positive_int("max_channels", max_channels, DEFAULT_MAX_CHANNELS)
    if histogram_sample_size is not None:
        check_positive_int("histogram_sample_size", histogram_sample_size, DEFAULT_SAMPLE_SIZE)
    if outputs not in ("first", "all"):
        raise ValueError(f"outputs must be 'first' or 'all', got {outputs!r}")


@dataclass(frozen=True)
class CaptureOptions:
    """What a logging step reduces each tensor to: what capture reads. Checked when made.

    :func:`actviz.watch` builds it from :class:`Options` and ``statistics=``
    (:func:`actviz.statistics.registry.resolve_statistics`).

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
        gradient_clipping: Log the global gradient norm before and after clipping, the clip coefficient and each
            layer's share on stats steps (:mod:`actviz.capture.clip_norms`); on by default.
        with_defaults: With ``statistics`` a tuple: run the built-ins on by default too (``statistics=["default", ...]``).
        loss: Log the value of the tensor each stats step's backward pass starts from as ``loss/backward_root``
            (:mod:`actviz.capture.output_gradients`): ``None`` where actviz writes its own folder (and not into
            a ``SummaryWriter`` the user owns, where the user logs a loss), ``True`` always, ``False`` never.
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
    gradient_clipping: bool = True
    with_defaults: bool = False
    flow_pictures: bool = False
    loss: bool | None = None

    def __post_init__(self) -> None:
        check_sizes(self.bins, self.max_channels, self.histogram_sample_size, self.outputs)
        if self.loss not in (None, True, False):
            raise TypeError(f"loss must be None (auto), True or False, got {self.loss!r}")
        for name in ("update_ratio", "merge_ranks", "unit_counts", "gradient_noise", "gradient_clipping", "with_defaults",
                     "flow_pictures"):
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
