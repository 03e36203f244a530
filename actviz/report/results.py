"""What a report found: one :class:`LayerRecord` per layer and image, and the :class:`ReportResult`.

Plain dataclasses on the host, made by :func:`actviz.report` and read by its writers
(:mod:`actviz.report.html`) and by you. Nothing here imports the rest of the report,
so every part of it can import this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..options import DEFAULT_MAX_CHANNELS
from ..common.results import Summary

__all__ = ["ImageReport", "LayerRecord", "ReportResult"]


@dataclass(frozen=True)
class LayerRecord:
    """What one layer produced for one image.

    Attributes:
        name: Qualified name from ``named_modules()`` (``"features.0"``).
        type: Class name of the module (``"Conv2d"``).
        shape: Shape of the output, batch of one included (``(1, 64, 55, 55)``).
        summary: Mean, std, zero fraction, min, max and histogram of the whole output.
        channels: Number of channels (dim 1 of a 4-D output, else the last dim).
        dead_channels: Channels with no positive value anywhere in this image's output (all zero
            after a ReLU); ``None`` for outputs without spatial or token positions (a ``Linear``'s),
            where one value per channel says nothing about being dead.
        grid: The feature-map picture as a ``(1 or 3, H, W)`` ``uint8`` tensor, or ``None``
            for outputs that are not 3-D or 4-D (a ``Linear``'s logits).
        shown_channels: How many channels the grid draws (at most ``max_channels``).
        relu_zero_fraction: The share of the output at or below zero, which a ReLU sets to zero
            (:func:`actviz.report.capture.relu_zero_fraction`): for a conv recorded before its
            in-place ReLU, the share that ReLU zeroes; for a ReLU's output, ``summary.zero_fraction``.
    """

    name: str
    type: str
    shape: tuple[int, ...]
    summary: Summary
    channels: int
    dead_channels: int | None
    grid: torch.Tensor | None
    shown_channels: int
    relu_zero_fraction: float = math.nan


@dataclass
class ImageReport:
    """One image's results.

    Attributes:
        path: The image file as given.
        run: Name of its TensorBoard run and HTML section (the file stem, made unique).
        source_size: ``(width, height)`` of the file.
        input_image: What the model saw, after resize and crop, as a ``(3, H, W)`` ``uint8`` tensor.
        layers: One record per selected layer, in ``named_modules()`` order.
        predictions: ``(class name, probability)`` of the top 5 classes; empty when the
            class names are unknown (random weights or your own model).
        run_dir: Its TensorBoard run, ``{logdir}/{model}/{run}``, or ``None`` when none was written.
        gradcam: With ``gradcam=``: ``(layer, picture)``, Grad-CAM of the top class at that layer
            over the input, as a ``(3, H, W)`` ``uint8`` tensor; else ``None``.
    """

    path: Path
    run: str
    source_size: tuple[int, int]
    input_image: torch.Tensor
    layers: list[LayerRecord] = field(default_factory=list)
    predictions: list[tuple[str, float]] = field(default_factory=list)
    run_dir: Path | None = None
    gradcam: tuple[str, torch.Tensor] | None = None


@dataclass
class ReportResult:
    """What :func:`actviz.report` did.

    Attributes:
        model: Model name (``"alexnet"``, or the class name of a module passed in).
        weights: Description of the weights (``"DEFAULT (AlexNet_Weights.IMAGENET1K_V1)"``, ``"none"``, a path).
        layer_names: The selected layers.
        images: Results of the images that worked, in the order given.
        failed: Path of each image that failed, mapped to the reason.
        logdir: The folder given for TensorBoard (it holds ``{model}/{image}`` runs), or ``None``.
        html: Path of ``index.html``, or ``None``.
        random_weights: True when the model's weights are a random initialisation
            (``weights="none"`` with a model name): not a trained network.
        input_size: Side of the square model input, in pixels.
        max_channels: Most channels drawn per grid.

    Example:
        >>> ReportResult("alexnet", "none", ["features.0"], failed={"a.jpg": "not an image"}).ok
        False
    """

    model: str
    weights: str
    layer_names: list[str]
    images: list[ImageReport] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    logdir: Path | None = None
    html: Path | None = None
    random_weights: bool = False
    input_size: int = 224
    max_channels: int = DEFAULT_MAX_CHANNELS

    @property
    def ok(self) -> bool:
        """True if every image was processed."""
        return not self.failed
