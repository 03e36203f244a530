"""Reports: what every layer of a trained CNN sees in a few images, in one call.

:func:`report` loads a torchvision classification model (or takes your own),
runs each image through it **once**, and on that single forward pass forward
hooks reduce every selected layer's output at once: a feature-map grid drawn by
:func:`actviz.rendering.feature_map_grid` (the same picture the watcher logs),
a :func:`actviz.summaries.summarize` vector and a dead-channel count. The
results go to TensorBoard (one run per image) and, if asked, to a
self-contained HTML page (:mod:`actviz.report_html`).

The parts stay apart as in the watcher: :func:`resolve_layers` selects,
:func:`capture_layers` captures, and :class:`~actviz.sinks.TensorBoardSink` and
:func:`~actviz.report_html.write_html` write.

Weights files are read with ``torch.load(..., weights_only=True)``, which
refuses to unpickle arbitrary objects, so a checkpoint from the internet
cannot run code.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import nn
from tqdm import tqdm  # not tqdm.auto: it warns on import in Jupyter without ipywidgets

from ._internals import image_classification
from .layer_outputs import output_tensors
from .options import DEFAULT_MAX_CHANNELS
from .rendering import render_output
from .results import StepResults, Summary
from .selection import LayerSpec, layer_display_name, select_layers
from .sinks import TensorBoardSink, use_fast_crc
from .summaries import summarize

__all__ = [
    "ReportError",
    "WeightsError",
    "ImageError",
    "LayerRecord",
    "ImageReport",
    "ReportResult",
    "report",
    "build_model",
    "load_image",
    "make_preprocess",
    "resolve_layers",
    "capture_layers",
]

logger = logging.getLogger(__name__)

#: Size of the model input when neither ``size`` nor the weights give one.
DEFAULT_SIZE = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: Seed of the random initialisation for ``weights="none"``.
SEED = 0
TOP_K = 5


class ReportError(Exception):
    """The report cannot start: unknown model, bad option or unusable weights."""


class WeightsError(ReportError):
    """Weights could not be downloaded, read or matched to the model."""


class ImageError(ReportError):
    """One image could not be read; the report goes on with the others."""


# -- results -----------------------------------------------------------------------------------


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
    """

    name: str
    type: str
    shape: tuple[int, ...]
    summary: Summary
    channels: int
    dead_channels: int | None
    grid: torch.Tensor | None
    shown_channels: int


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
    """

    path: Path
    run: str
    source_size: tuple[int, int]
    input_image: torch.Tensor
    layers: list[LayerRecord] = field(default_factory=list)
    predictions: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class ReportResult:
    """What :func:`report` did.

    Attributes:
        model: Model name (``"alexnet"``, or the class name of a module passed in).
        weights: Description of the weights (``"DEFAULT (AlexNet_Weights.IMAGENET1K_V1)"``, ``"none"``, a path).
        layer_names: The selected layers.
        images: Results of the images that worked, in the order given.
        failed: Path of each image that failed, mapped to the reason.
        logdir: Folder holding one TensorBoard run per image, or ``None``.
        html: Path of ``index.html``, or ``None``.
    """

    model: str
    weights: str
    layer_names: list[str]
    images: list[ImageReport] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    logdir: Path | None = None
    html: Path | None = None

    @property
    def ok(self) -> bool:
        """True if every image was processed."""
        return not self.failed


# -- models and weights -----------------------------------------------------------------------


def _classification_models() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


def _check_model_name(name: str) -> str:
    known = _classification_models()
    key = name.strip().lower()
    if key in known:
        return key
    close = difflib.get_close_matches(key, known, n=4, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ReportError(
        f"unknown model {name!r}{hint} Any torchvision classification model works, for example "
        "alexnet, vgg16, vgg16_bn or resnet18 (see torchvision.models.list_models(torchvision.models))"
    )


def _pretrained(name: str, weights: str) -> Any | None:
    """The torchvision weights enum for ``"DEFAULT"`` or a member name like ``"IMAGENET1K_V1"``, else None."""
    enum = torchvision.models.get_model_weights(name)
    if weights == "DEFAULT":
        return enum.DEFAULT
    return enum.__members__.get(weights)


def _download_error(name: str, weights: Any, error: BaseException) -> WeightsError:
    reason = str(getattr(error, "reason", "") or error).splitlines()[0] if str(error) else type(error).__name__
    return WeightsError(
        f"could not download the pretrained weights for {name} ({weights}) from {weights.url}: {reason}.\n"
        f"If you are offline, pass --weights PATH with a state_dict file (download {weights.url} on "
        f"another machine), or --weights none for random weights (weights='none' in Python)."
    )


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a state_dict without unpickling arbitrary objects, unwrapping ``{"state_dict": ...}`` checkpoints."""
    if not path.is_file():
        raise WeightsError(
            f"weights file {str(path)!r} does not exist; pass DEFAULT for torchvision's pretrained "
            "weights, none for random weights, or the path of a state_dict file"
        )
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols before refusing; the error says enough
            warnings.simplefilter("ignore", UserWarning)
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else "unsafe content"
        raise WeightsError(
            f"refusing to load {str(path)!r}: it is not a plain state_dict of tensors ({first}). "
            "actviz loads weights with torch.load(weights_only=True) and never unpickles arbitrary "
            "objects, because a pickle can run code. Save plain weights with "
            "torch.save(model.state_dict(), path)."
        ) from None
    except Exception as error:  # noqa: BLE001 - zip, EOF and format errors all mean "not a torch file"
        raise WeightsError(f"cannot read weights file {str(path)!r}: {str(error).splitlines()[0]}") from None
    state = loaded
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(key), Mapping):
            state = state[key]
            break
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(
            f"{str(path)!r} holds a {type(loaded).__name__}, not a state_dict (a dict of tensors, or a "
            "checkpoint dict with a 'state_dict' or 'model' key)"
        )
    state = dict(state)
    if state and all(key.startswith("module.") for key in state):  # saved from DataParallel
        state = {key[len("module."):]: value for key, value in state.items()}
    return state


def _preview(keys: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _load_state_dict(model: nn.Module, model_name: str, path: Path) -> None:
    state = _read_state_dict(path)
    expected = model.state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    mismatched = [
        f"{key}: file {tuple(state[key].shape)}, model {tuple(expected[key].shape)}"
        for key in expected
        if key in state and state[key].shape != expected[key].shape
    ]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing keys ({len(missing)}): {_preview(missing)}")
        if unexpected:
            parts.append(f"unexpected keys ({len(unexpected)}): {_preview(unexpected)}")
        if mismatched:
            parts.append(f"shape mismatches ({len(mismatched)}): {'; '.join(mismatched[:4])}")
        raise WeightsError(
            f"{str(path)!r} is not a state_dict for {model_name}: " + "; ".join(parts)
            + ". Was it saved from a different architecture?"
        )
    model.load_state_dict(state)


@dataclass
class _Model:
    module: nn.Module
    name: str
    weights: str
    preprocess: Any
    categories: list[str] | None


def build_model(
    model: str | nn.Module, weights: str | os.PathLike[str] = "none", size: int | None = None
) -> tuple[nn.Module, Any, list[str] | None, str]:
    """Build (or take) a model, load its weights and choose its preprocessing.

    Args:
        model: A torchvision classification model name, or your own module.
        weights: ``"DEFAULT"`` (torchvision's pretrained weights, downloaded once), a
            torchvision weights name such as ``"IMAGENET1K_V1"``, ``"none"`` (random
            weights, seeded, or a module's own weights), or the path of a state_dict file.
        size: Side of the square model input; ``None`` for the weights' own crop size, else 224.

    Returns:
        ``(module in eval mode, preprocessing transform, class names or None, weights description)``.

    Raises:
        ReportError: Unknown model name.
        WeightsError: Weights that cannot be downloaded, read or matched.

    Example:
        >>> net, preprocess, categories, described = build_model("alexnet", "none", size=64)
        >>> preprocess.crop_size, categories, described
        ([64], None, 'none')
    """
    built = _build(model, weights, size)
    return built.module, built.preprocess, built.categories, built.weights


def _build(model: str | nn.Module, weights: str | os.PathLike[str], size: int | None) -> _Model:
    weights_text = os.fspath(weights)
    is_keyword = weights_text in ("DEFAULT", "none") or (
        isinstance(model, str) and not Path(weights_text).exists() and re.fullmatch(r"[A-Z0-9_]+", weights_text)
    )
    if isinstance(model, nn.Module):
        if weights_text == "DEFAULT" or (is_keyword and weights_text != "none"):
            raise WeightsError(
                f"weights={weights_text!r} needs a torchvision model name; for your own "
                f"{type(model).__name__} pass weights='none' (keep its weights) or a state_dict path"
            )
        if weights_text != "none":
            _load_state_dict(model, type(model).__name__, Path(weights_text))
        return _Model(model.eval(), type(model).__name__, weights_text, make_preprocess(None, size), None)
    if not isinstance(model, str):
        raise TypeError(f"model must be a torchvision model name or an nn.Module, got {type(model).__name__}")
    name = _check_model_name(model)
    if weights_text == "none":
        with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
            torch.manual_seed(SEED)
            module = torchvision.models.get_model(name, weights=None)
        return _Model(module.eval(), name, "none", make_preprocess(None, size), None)
    if is_keyword:
        pretrained = _pretrained(name, weights_text)
        if pretrained is None:
            members = list(torchvision.models.get_model_weights(name).__members__)
            raise WeightsError(
                f"unknown weights {weights_text!r} for {name}; pass DEFAULT, none, a state_dict path, "
                f"or one of {', '.join(members)}"
            )
        try:
            module = torchvision.models.get_model(name, weights=pretrained)
        except Exception as error:  # noqa: BLE001 - URLError, timeouts, hash mismatch: all mean "no weights"
            raise _download_error(name, pretrained, error) from None
        described = f"{weights_text} ({pretrained})" if weights_text == "DEFAULT" else str(pretrained)
        return _Model(
            module.eval(), name, described, make_preprocess(pretrained, size), list(pretrained.meta["categories"])
        )
    # A state_dict file for a torchvision architecture: class names are ImageNet's when the
    # classifier has ImageNet's 1000 outputs, which a matching state_dict guarantees.
    module = torchvision.models.get_model(name, weights=None)
    _load_state_dict(module, name, Path(weights_text))
    default = torchvision.models.get_model_weights(name).DEFAULT
    return _Model(
        module.eval(), name, f"state_dict {weights_text} (ImageNet class names)", make_preprocess(None, size),
        list(default.meta["categories"]),
    )


def make_preprocess(pretrained: Any | None = None, size: int | None = None) -> Any:
    """The transform from a PIL image to the model input.

    With known weights it is their own ``transforms()``; a ``size`` that differs from their
    crop size scales the resize step in proportion. Otherwise: resize the shorter side to
    ``size * 256 / 224``, center-crop ``size``, and normalise with ImageNet's mean and std.

    Example:
        >>> t = make_preprocess(None, 128)
        >>> t.resize_size, t.crop_size
        ([146], [128])
    """
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 16):
        raise ReportError(f"size must be an int of at least 16 pixels, got {size!r}; for example size=224")
    if pretrained is not None:
        preset = pretrained.transforms()
        if size is None or [size] == list(preset.crop_size):
            return preset
        resize = round(size * preset.resize_size[0] / preset.crop_size[0])
        return image_classification(
            crop_size=size, resize_size=resize, mean=preset.mean, std=preset.std, interpolation=preset.interpolation
        )
    size = DEFAULT_SIZE if size is None else size
    return image_classification(crop_size=size, resize_size=round(size * 256 / 224), mean=IMAGENET_MEAN, std=IMAGENET_STD)


# -- images -------------------------------------------------------------------------------------


def _to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode to 8-bit RGB: 16-bit and float scaled (not clipped), alpha composited on white."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        values = np.asarray(image).astype(np.float64)
        peak = 65535.0 if values.max(initial=0) <= 65535 else float(values.max())
        gray = np.clip(np.round(values / peak * 255.0), 0, 255).astype(np.uint8)
        return Image.fromarray(gray).convert("RGB")
    if image.mode == "F":
        values = np.nan_to_num(np.asarray(image, dtype=np.float64))
        low, high = float(values.min(initial=0)), float(values.max(initial=0))
        if low >= 0 and high <= 1:
            scaled = values
        else:
            scaled = (values - low) / (high - low) if high > low else np.zeros_like(values)
        return Image.fromarray(np.round(scaled * 255).astype(np.uint8)).convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(path: str | os.PathLike[str]) -> Image.Image:
    """Read an image file as 8-bit RGB, following its EXIF orientation.

    Grayscale is repeated on three channels, 16-bit images are scaled to 8 bits,
    and transparent pixels are drawn on white.

    Raises:
        ImageError: The file is missing, unreadable, truncated or not an image; the message names it.

    Example:
        >>> load_image("tests/data/chelsea.jpg").size
        (451, 300)
    """
    path = Path(path)
    try:
        with Image.open(path) as opened:
            opened.load()  # decode now, so a truncated file fails here and not later
            image = ImageOps.exif_transpose(opened)
            return _to_rgb(image)
    except FileNotFoundError:
        raise ImageError(f"cannot read image '{path}': no such file") from None
    except UnidentifiedImageError:
        raise ImageError(f"cannot read image '{path}': not an image file Pillow can read") from None
    except (OSError, ValueError, SyntaxError) as error:
        raise ImageError(f"cannot read image '{path}': {error}") from None


def _display_image(batch: torch.Tensor, preprocess: Any) -> torch.Tensor:
    """Undo the normalisation of a ``(1, 3, H, W)`` model input: what the model saw, as ``uint8``."""
    mean = torch.tensor(preprocess.mean, dtype=batch.dtype).view(3, 1, 1)
    std = torch.tensor(preprocess.std, dtype=batch.dtype).view(3, 1, 1)
    return (batch[0].cpu() * std + mean).mul(255).round().clamp(0, 255).to(torch.uint8)


# -- selection ----------------------------------------------------------------------------------


def resolve_layers(model: nn.Module, layers: LayerSpec | Sequence[LayerSpec] = "conv") -> list[tuple[str, nn.Module]]:
    """:func:`actviz.selection.select_layers`, with its errors as :class:`ReportError`.

    Example:
        >>> net = torchvision.models.alexnet()
        >>> [name for name, _ in resolve_layers(net, ["conv", "classifier.6"])][:2], len(resolve_layers(net, "all"))
        (['features.0', 'features.3'], 21)
    """
    try:
        return select_layers(model, layers)
    except (ValueError, TypeError) as error:
        raise ReportError(str(error)) from None


# -- capture ------------------------------------------------------------------------------------


def _dead_channels(tensor: torch.Tensor) -> tuple[int, int | None]:
    """``(channels, channels with no positive value)``; channels are dim 1 of 4-D+ outputs, else the last dim."""
    if tensor.dim() < 2 or tensor.numel() == 0 or tensor.is_complex():
        return 0, None
    if tensor.dim() == 2:
        return tensor.shape[1], None
    channel_dim = 1 if tensor.dim() >= 4 else tensor.dim() - 1
    per_channel = tensor.detach().transpose(0, channel_dim).reshape(tensor.shape[channel_dim], -1)
    peak = torch.nan_to_num(per_channel.float(), nan=0.0).amax(dim=1)
    return per_channel.shape[0], int((peak <= 0).sum())


class _Recorder:
    """Forward hooks that reduce each selected layer's output inside the hook, once per forward pass."""

    def __init__(
        self, layers: Sequence[tuple[str, nn.Module]], max_channels: int, on_layer: Callable[[], None] | None
    ) -> None:
        self.max_channels = max_channels
        self.on_layer = on_layer
        self.records: dict[str, LayerRecord] = {}
        self._handles = [module.register_forward_hook(partial(self._hook, name)) for name, module in layers]

    def _hook(self, name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        if name in self.records:  # a module called twice (ResNet's shared ReLU) keeps its first call
            return
        tensor = next((t for _, t in output_tensors(output, "first")), None)
        if tensor is None:
            return
        # Reduce now: the in-place ReLU after a conv would otherwise change what we read later.
        vector = summarize(tensor).cpu()
        channels, dead = _dead_channels(tensor)
        grid = render_output(tensor, self.max_channels)
        shown = min(channels, self.max_channels) if tensor.dim() == 4 else (0 if grid is None else channels)
        self.records[name] = LayerRecord(
            name=layer_display_name(name),
            type=type(module).__name__,
            shape=tuple(tensor.shape),
            summary=Summary.from_vector(vector.tolist()),
            channels=channels,
            dead_channels=dead,
            grid=None if grid is None else grid.cpu(),
            shown_channels=shown,
        )
        if self.on_layer is not None:
            self.on_layer()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@torch.no_grad()
def capture_layers(
    model: nn.Module,
    batch: torch.Tensor,
    layers: Sequence[tuple[str, nn.Module]],
    max_channels: int = DEFAULT_MAX_CHANNELS,
    on_layer: Callable[[], None] | None = None,
) -> tuple[list[LayerRecord], Any]:
    """Run ``model`` once on ``batch`` and record every layer in ``layers``.

    Hooks are attached for this one call and removed in ``finally``. Only the first
    sample of the batch is drawn; the statistics cover the whole output.

    Args:
        model: The model, in the mode you want (``eval()`` for a report).
        batch: Its input.
        layers: ``(name, module)`` pairs, for example from :func:`resolve_layers`.
        max_channels: Most channels in one grid (the strongest, by mean |activation|).
        on_layer: Called after each layer is recorded (a progress bar's ``update``).

    Returns:
        ``(records in layer order, the model's output)``. A layer the forward pass did not reach has no record.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True))
        >>> records, _ = capture_layers(net, torch.randn(1, 3, 8, 8), [("0", net[0])])
        >>> records[0].shape, records[0].grid.shape
        ((1, 4, 6, 6), torch.Size([1, 78, 78]))
    """
    recorder = _Recorder(layers, max_channels, on_layer)
    try:
        output = model(batch)
    finally:
        recorder.remove()
    records = [recorder.records[name] for name, _ in layers if name in recorder.records]
    return records, output


def _top_k(output: Any, categories: list[str] | None, k: int = TOP_K) -> list[tuple[str, float]]:
    logits = next((t for _, t in output_tensors(output, "first")), None)
    if categories is None or logits is None or logits.dim() != 2 or logits.shape[1] != len(categories):
        return []
    probabilities = logits[0].float().softmax(dim=0)
    values, indices = probabilities.topk(min(k, len(categories)))
    return [(categories[i], float(p)) for p, i in zip(values.tolist(), indices.tolist())]


# -- writing ------------------------------------------------------------------------------------


def _run_names(paths: Sequence[Path]) -> list[str]:
    """A folder-safe, unique name per image: its stem, then ``-2``, ``-3`` for repeats."""
    names: list[str] = []
    for path in paths:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", path.stem).strip("._") or "image"
        name, count = base, 1
        while name in names:
            count += 1
            name = f"{base}-{count}"
        names.append(name)
    return names


def _predictions_markdown(predictions: list[tuple[str, float]]) -> str:
    rows = "\n".join(f"| {rank} | {label} | {p:.1%} |" for rank, (label, p) in enumerate(predictions, 1))
    return "| rank | class | probability |\n|---:|---|---:|\n" + rows


def _write_tensorboard(logdir: Path, item: ImageReport) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(logdir / item.run))
    sink = TensorBoardSink(writer, owns_writer=True)
    try:
        results = StepResults(step=0)
        for record in item.layers:
            results.activations[record.name] = record.summary
            if record.grid is not None:
                results.images[record.name] = record.grid
        sink.write(results)
        sink.write_image("input", item.input_image, 0)  # the same fast PNG path as the feature maps
        writer.add_text("image", f"`{item.path}` ({item.source_size[0]}×{item.source_size[1]})", 0)
        if item.predictions:
            writer.add_text("predictions", _predictions_markdown(item.predictions), 0)
    finally:
        sink.close()


def _check_options(max_channels: object, device: object) -> torch.device:
    if not isinstance(max_channels, int) or isinstance(max_channels, bool) or max_channels <= 0:
        raise ReportError(f"max_channels must be a positive int, got {max_channels!r}; for example max_channels=64")
    try:
        resolved = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        raise ReportError(f"unknown device {device!r}; use 'cpu' or 'cuda'") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ReportError(f"device {device!r} asked for, but CUDA is not available here; use device='cpu'")
    return resolved


@contextlib.contextmanager
def _progress_bar(total: int, enabled: bool, desc: str) -> Iterator[Any]:
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


def report(
    model: str | nn.Module,
    images: Sequence[str | os.PathLike[str]],
    *,
    weights: str | os.PathLike[str] = "none",
    logdir: str | os.PathLike[str] | None = "runs/report",
    html: str | os.PathLike[str] | None = None,
    layers: str | Sequence[str] = "conv",
    max_channels: int = DEFAULT_MAX_CHANNELS,
    size: int | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> ReportResult:
    """Show what every selected layer of a CNN sees in each image: TensorBoard runs and an HTML page.

    Each image goes through the model once. Forward hooks on the selected layers draw
    each output's feature-map grid exactly as :func:`actviz.watch` does and summarise it.

    TensorBoard layout: one run per image, ``{logdir}/{image stem}``, all at step 0, with
    ``feature_maps/{layer}`` (grid), ``activations/{layer}`` (histogram),
    ``activation_stats/{layer}/{mean,std,zero_fraction,nonfinite}``, ``input`` (the
    image as the model saw it), ``image`` (text: the file) and, when class names are
    known, ``predictions`` (text: top-5 table).

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
        layers: ``"conv"``, ``"relu"``, ``"all"`` (every leaf module), layer names or globs,
            or a list of these.
        max_channels: Most channels drawn per layer; the strongest are kept.
        size: Side of the square model input. ``None``: the pretrained weights' own crop
            size (224 for AlexNet and VGG), else 224.
        device: ``"cpu"`` or ``"cuda"``.
        progress: Show a tqdm progress bar over images × layers.

    Returns:
        A :class:`ReportResult`; ``result.ok`` is False if any image failed.

    Raises:
        ReportError: Unknown model, bad option, or unusable weights (:class:`WeightsError`).

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
    resolved_device = _check_options(max_channels, device)
    built = _build(model, weights, size)
    selected = resolve_layers(built.module, layers)
    built.module.to(resolved_device)  # in place: modules move their own parameters
    paths = [Path(image) for image in images]
    result = ReportResult(
        model=built.name,
        weights=built.weights,
        layer_names=[layer_display_name(name) for name, _ in selected],
        logdir=None if logdir is None else Path(logdir),
    )
    if logdir is not None:
        result.logdir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
        use_fast_crc()  # process-wide and fail-safe: see actviz.sinks.use_fast_crc
    with _progress_bar(len(paths) * len(selected), progress, f"{built.name} report") as bar:
        for path, run in zip(paths, _run_names(paths)):
            done_before = bar.n
            try:
                item = _report_one(path, run, built, selected, max_channels, resolved_device, bar.update)
            except ImageError as error:
                result.failed[str(path)] = str(error)
                logger.error("%s", error)
            except Exception as error:  # noqa: BLE001 - one bad image must not stop the others
                message = f"{built.name} failed on '{path}': {type(error).__name__}: {error}"
                result.failed[str(path)] = message
                logger.error("%s", message)
            else:
                result.images.append(item)
                if result.logdir is not None:
                    _write_tensorboard(result.logdir, item)
            bar.update(done_before + len(selected) - bar.n)  # layers not reached, or an image that failed
    if html is not None:
        from .report_html import write_html

        result.html = write_html(result, html, size=built.preprocess.crop_size[0], max_channels=max_channels)
    return result


def _report_one(
    path: Path,
    run: str,
    built: _Model,
    selected: Sequence[tuple[str, nn.Module]],
    max_channels: int,
    device: torch.device,
    on_layer: Callable[[], None],
) -> ImageReport:
    picture = load_image(path)
    batch = built.preprocess(picture).unsqueeze(0)
    records, output = capture_layers(built.module, batch.to(device), selected, max_channels, on_layer)
    return ImageReport(
        path=path,
        run=run,
        source_size=picture.size,
        input_image=_display_image(batch, built.preprocess),
        layers=records,
        predictions=_top_k(output, built.categories),
    )

