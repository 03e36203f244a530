"""Reports: what every layer of a trained CNN sees in a few images, in one call.

:func:`report` is a thin client of actviz's core. It builds the model
(:mod:`~actviz.report.models`), selects layers with :func:`actviz.selection.select_layers`
(the keywords ``conv``, ``relu`` and ``all`` are the watcher's too), and runs each image
(:mod:`~actviz.report.images`) through the model **once**. On that pass each selected
layer's output goes through :func:`actviz.capture.layer_outputs.reduce_output`, the watcher's own
per-layer work, in a forward hook (:mod:`~actviz.report.capture`), which adds only the
report's dead-channel count. The results (:mod:`~actviz.report.results`) are written by
the watcher's :class:`~actviz.output.tensorboard.TensorBoardSink`, one run per image, and, if asked, as
a static HTML page (:mod:`~actviz.report.html`).

torchvision and tqdm are imported when a report runs, not by ``import actviz``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..pictures.gradcam import grad_cam, gradcam_overlay, last_conv_name
from ..capture.layer_outputs import output_tensors
from ..options import DEFAULT_MAX_CHANNELS, CaptureOptions
from ..common.results import StepResults
from ..output.tensorboard import TensorBoardSink, use_fast_crc
from ..output.pending_step import record_values
from ..statistics.moments import Moments
from ..capture.probe import gradcam_layers
from ..selection import LayerSpec, layer_display_name, select_layers
from .capture import capture_layers
from .errors import ImageError, ReportError, WeightsError
from .images import display_image, folder_name, load_image, run_names
from .models import RANDOM_WEIGHTS_NOTE, BuiltModel, build_model, make_preprocess
from .results import ImageReport, LayerRecord, ReportResult

__all__ = [
    "BuiltModel",
    "ImageError",
    "ImageReport",
    "LayerRecord",
    "ReportError",
    "ReportResult",
    "WeightsError",
    "build_model",
    "capture_layers",
    "load_image",
    "make_preprocess",
    "report",
]

logger = logging.getLogger(__name__)

TOP_K = 5


def report(
    model: str | nn.Module,
    images: Sequence[str | os.PathLike[str]],
    *,
    weights: str | os.PathLike[str] = "none",
    logdir: str | os.PathLike[str] | None = "runs/report",
    html: str | os.PathLike[str] | None = None,
    layers: LayerSpec | Iterable[LayerSpec] = "conv",
    max_channels: int = DEFAULT_MAX_CHANNELS,
    size: int | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    gradcam: bool | str = False,
) -> ReportResult:
    """Show what every selected layer of a CNN sees in each image: TensorBoard runs and an HTML page.

    Each image goes through the model once. Forward hooks on the selected layers draw
    each output's feature-map grid exactly as :func:`actviz.watch` does and summarise it.

    TensorBoard layout: one run per model and image, ``{logdir}/{model}/{image stem}``, all
    at step 0, with ``~feature_maps/{layer}`` (grid), ``~activations/{layer}`` (histogram),
    ``~activation_stats/{mean,std,zero_fraction,nonfinite}@{layer}``, ``~input`` (the image
    as the model saw it), ``image`` (text: the file, the model and its weights) and, when
    class names are known, ``predictions`` (text: top-5 table). A run folder that already
    holds events (the same model and image reported before) gets a warning.

    Args:
        model: A torchvision classification model name (``"alexnet"``, ``"vgg16_bn"``,
            ``"resnet18"``, ...) or your own ``nn.Module``.
        images: Image files. One that cannot be read is logged and listed in
            ``result.failed``; the others are still processed.
        weights: ``"DEFAULT"`` for torchvision's pretrained weights (downloaded on first
            use), ``"none"`` for random weights with a fixed seed (a module passed in keeps
            its own), or the path of a ``state_dict`` file, read with
            ``torch.load(weights_only=True)``.
        logdir: Folder for the TensorBoard runs; ``None`` writes none.
        html: Folder for ``index.html`` and its PNG files; ``None`` writes none.
        layers: What :func:`actviz.watch` takes: the keywords ``"conv"`` (every ``Conv2d``),
            ``"relu"`` (every ``ReLU``) and ``"all"`` (every leaf module), layer names or
            globs, module types, or a list of these.
        max_channels: Most channels drawn per layer; the strongest are kept.
        size: Side of the square model input. ``None``: the pretrained weights' own crop
            size (224 for AlexNet and VGG), else 224.
        device: ``"cpu"`` or ``"cuda"``.
        progress: Show a tqdm progress bar over images × layers.
        gradcam: ``True`` adds Grad-CAM of each image's top-1 class at the last ``Conv2d``,
            drawn over the input, to the page and as ``~gradcam/{layer}`` in TensorBoard; a
            layer name picks another layer.

    Returns:
        A :class:`ReportResult`; ``result.ok`` is False if any image failed.

    Raises:
        ReportError: Unknown model or layer, bad option, or unusable weights (:class:`WeightsError`).

    Example:
        >>> result = report("alexnet", ["tests/data/chelsea.jpg"], weights="none", logdir=None,
        ...                 size=128, progress=False)
        >>> [(r.name, r.shape) for r in result.images[0].layers][:2]
        [('features.0', (1, 64, 31, 31)), ('features.3', (1, 192, 15, 15))]
    """
    if isinstance(images, (str, os.PathLike)):
        images = [images]
    if not images:
        raise ReportError("no images given; pass at least one image file")
    options = _checked(CaptureOptions, max_channels=max_channels)
    resolved_device = _check_device(device)
    built = build_model(model, weights, size)
    selected = _checked(select_layers, built.module, layers)
    cam_layer = _checked(_gradcam_layer, built.module, gradcam)
    built.module.to(resolved_device)  # in place: modules move their own parameters
    paths = [Path(image) for image in images]
    result = ReportResult(
        model=built.name,
        weights=built.weights,
        layer_names=[layer_display_name(name) for name, _ in selected],
        logdir=None if logdir is None else Path(logdir),
        random_weights=built.random_weights,
        input_size=built.input_size,
        max_channels=options.max_channels,
    )
    if result.logdir is not None:
        result.logdir.mkdir(parents=True, exist_ok=True)
        use_fast_crc()  # process-wide and fail-safe: see actviz.output.tensorboard.use_fast_crc
    model_dir = None if result.logdir is None else result.logdir / folder_name(built.name, "model")
    with _progress_bar(len(paths) * len(selected), progress, f"{built.name} report") as bar:
        for path, run in zip(paths, run_names(paths)):
            done_before = bar.n
            try:
                item = _report_one(path, run, built, selected, options, resolved_device, bar.update, cam_layer)
            except ImageError as error:
                result.failed[str(path)] = str(error)
                logger.error("%s", error)
            except Exception as error:  # noqa: BLE001 - one bad image must not stop the others
                message = f"{built.name} failed on '{path}': {type(error).__name__}: {error}"
                result.failed[str(path)] = message
                logger.error("%s", message)
            else:
                result.images.append(item)
                if model_dir is not None:
                    _write_tensorboard(model_dir / run, item, built)
            bar.update(done_before + len(selected) - bar.n)  # layers not reached, or an image that failed
    if html is not None:
        from .html import write_html

        result.html = write_html(result, html)
    return result


def _report_one(
    path: Path,
    run: str,
    built: BuiltModel,
    selected: Sequence[tuple[str, nn.Module]],
    options: CaptureOptions,
    device: torch.device,
    on_layer: Callable[[], None],
    cam_layer: str | None = None,
) -> ImageReport:
    picture = load_image(path)
    batch = built.preprocess(picture).unsqueeze(0)
    records, output = capture_layers(built.module, batch.to(device), selected, options.max_channels, on_layer)
    shown = display_image(batch, built.preprocess)
    cam = None
    if cam_layer is not None:  # the top-1 class, the model's mode and .grad left as they were
        cam = (cam_layer, gradcam_overlay(shown.float() / 255, grad_cam(built.module, cam_layer, batch.to(device))[0]))
    return ImageReport(
        path=path,
        run=run,
        source_size=picture.size,
        input_image=shown,
        layers=records,
        predictions=_top_k(output, built.categories),
        gradcam=cam,
    )


def _gradcam_layer(model: nn.Module, gradcam: bool | str) -> str | None:
    if gradcam is False or gradcam is None:
        return None
    if gradcam is True:
        return last_conv_name(model)
    if not isinstance(gradcam, str):
        raise TypeError(f"gradcam= must be True, False or a layer name, got {type(gradcam).__name__}: {gradcam!r}")
    return gradcam_layers(model, gradcam, probe=True)[0][0]  # checks the name, with a "did you mean"


def _top_k(output: Any, categories: list[str] | None, k: int = TOP_K) -> list[tuple[str, float]]:
    logits = next((t for _, t in output_tensors(output, "first")), None)
    if categories is None or logits is None or logits.dim() != 2 or logits.shape[1] != len(categories):
        return []
    probabilities = logits[0].float().softmax(dim=0)
    values, indices = probabilities.topk(min(k, len(categories)))
    return [(categories[i], float(p)) for p, i in zip(values.tolist(), indices.tolist())]


def _predictions_markdown(predictions: list[tuple[str, float]]) -> str:
    rows = "\n".join(f"| {rank} | {label} | {p:.1%} |" for rank, (label, p) in enumerate(predictions, 1))
    return "| rank | class | probability |\n|---:|---|---:|\n" + rows


def _image_text(item: ImageReport, built: BuiltModel) -> str:
    """The ``image`` text of a run: which file, and which model and weights saw it."""
    width, height = item.source_size
    text = f"`{item.path}` ({width}×{height}), model `{built.name}`, weights {built.weights}"
    return text + (f"\n\n**{RANDOM_WEIGHTS_NOTE}**" if built.random_weights else "")


def _write_tensorboard(run_dir: Path, item: ImageReport, built: BuiltModel) -> None:
    from torch.utils.tensorboard import SummaryWriter

    if any(run_dir.glob("events.out.tfevents.*")):
        logger.warning(
            "%s already holds the events of an earlier report; TensorBoard shows both at step 0. "
            "Delete the folder, or pass another --logdir (logdir=) to keep the reports apart", run_dir,
        )
    item.run_dir = run_dir
    writer = SummaryWriter(log_dir=str(run_dir))
    sink = TensorBoardSink(writer, owns_writer=True)
    try:
        results, moments = StepResults(step=0), Moments()
        for record in item.layers:
            results.activations[record.name] = record.summary
            record_values(results, moments, record.name, moments.from_layer_summary(record.summary))
            if record.grid is not None:
                results.images[record.name] = record.grid
        sink.write(results)
        sink.write_image("input", item.input_image, 0)  # the same fast PNG path as the feature maps
        writer.add_text("image", _image_text(item, built), 0)
        if item.predictions:
            writer.add_text("predictions", _predictions_markdown(item.predictions), 0)
        if item.gradcam is not None:
            sink.write_image(f"gradcam/{item.gradcam[0]}", item.gradcam[1], 0)
    finally:
        sink.close()


def _checked(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, its ``ValueError`` or ``TypeError`` raised as a :class:`ReportError`."""
    try:
        return function(*args, **kwargs)
    except (ValueError, TypeError) as error:
        raise ReportError(str(error)) from None


def _check_device(device: object) -> torch.device:
    try:
        resolved = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ReportError(f"unknown device {device!r}; use 'cpu' or 'cuda'") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ReportError(f"device {device!r} asked for, but CUDA is not available here; use device='cpu'")
    return resolved


@contextlib.contextmanager
def _progress_bar(total: int, enabled: bool, desc: str) -> Iterator[Any]:
    from tqdm import tqdm  # not tqdm.auto: it warns on import in Jupyter without ipywidgets

    bar = tqdm(total=total, disable=not enabled, unit="layer", desc=desc, dynamic_ncols=True)
    try:
        if enabled:
            from tqdm.contrib.logging import logging_redirect_tqdm

            # Messages print above the bar instead of through it (the CLI's handler is on "actviz").
            with logging_redirect_tqdm(loggers=[logging.root, logging.getLogger("actviz")]):
                yield bar
        else:
            yield bar
    finally:
        bar.close()
