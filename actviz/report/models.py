"""The report's model: a torchvision classification model or your own, its weights and its preprocessing.

:func:`build_model` returns a :class:`BuiltModel`. torchvision is imported here only
when a model is built, so that ``import actviz`` (and :func:`actviz.watch`) does not
import it.

Weights files are read with ``torch.load(..., weights_only=True)``, which refuses to
unpickle arbitrary objects, so a checkpoint from the internet cannot run code.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..common._internals import image_classification
from ..common.suggestions import did_you_mean
from .errors import ReportError, WeightsError

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["BuiltModel", "DEFAULT_SIZE", "IMAGENET_MEAN", "IMAGENET_STD", "Preprocess", "RANDOM_WEIGHTS_NOTE", "SEED",
           "build_model", "make_preprocess"]

#: Size of the model input when neither ``size`` nor the weights give one.
DEFAULT_SIZE = 224
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: Seed of the random initialisation for ``weights="none"``.
SEED = 0
#: What the page, the command and TensorBoard say when the weights are random.
RANDOM_WEIGHTS_NOTE = (
    f"Random weights (seed {SEED}): this network was not trained. An untrained network shows edges "
    "and colours, not learned features. Pass --weights DEFAULT (weights='DEFAULT' in Python) to see "
    "what a trained one sees."
)


class Preprocess(Protocol):
    """A PIL image in, the normalised ``(3, size, size)`` model input out (torchvision's preset transform)."""

    crop_size: list[int]
    resize_size: list[int]
    mean: list[float]
    std: list[float]

    def __call__(self, image: Image.Image) -> torch.Tensor: ...


@dataclass(frozen=True)
class BuiltModel:
    """A model ready for a report.

    Attributes:
        module: The model, in eval mode.
        name: The torchvision name (``"alexnet"``), or the class name of your module.
        weights: What its weights are, in words: ``"DEFAULT (AlexNet_Weights.IMAGENET1K_V1)"``,
            ``"none"`` (random), ``"its own"`` (a module passed in), a path.
        preprocess: From a PIL image to the model input.
        categories: Class names of the outputs, or ``None`` when unknown.
        random_weights: True for a torchvision model built with ``weights="none"``: a random
            initialisation (seed :data:`SEED`), not a trained network.
    """

    module: nn.Module
    name: str
    weights: str
    preprocess: Preprocess
    categories: list[str] | None
    random_weights: bool = False

    @property
    def input_size(self) -> int:
        """Side of the square model input, in pixels."""
        return self.preprocess.crop_size[0]


def build_model(
    model: str | nn.Module, weights: str | os.PathLike[str] = "none", size: int | None = None
) -> BuiltModel:
    """Build (or take) a model, load its weights and choose its preprocessing.

    Args:
        model: A torchvision classification model name, or your own module.
        weights: ``"DEFAULT"`` (torchvision's pretrained weights, downloaded once), a
            torchvision weights name such as ``"IMAGENET1K_V1"``, ``"none"`` (random
            weights, seeded, or a module's own weights), or the path of a state_dict file.
        size: Side of the square model input; ``None`` for the weights' own crop size, else 224.

    Returns:
        A :class:`BuiltModel`, its module in eval mode.

    Raises:
        ReportError: Unknown model name.
        WeightsError: Weights that cannot be downloaded, read or matched.

    Example:
        >>> built = build_model("alexnet", "none", size=64)
        >>> built.name, built.input_size, built.categories, built.weights, built.random_weights
        ('alexnet', 64, None, 'none', True)
    """
    import torchvision

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
        if weights_text == "none":
            return BuiltModel(model.eval(), type(model).__name__, "its own", make_preprocess(None, size), None)
        _load_state_dict(model, type(model).__name__, Path(weights_text))
        return BuiltModel(model.eval(), type(model).__name__, weights_text, make_preprocess(None, size), None)
    if not isinstance(model, str):
        raise TypeError(f"model must be a torchvision model name or an nn.Module, got {type(model).__name__}")
    name = _check_model_name(model)
    if weights_text == "none":
        with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
            torch.manual_seed(SEED)
            module = torchvision.models.get_model(name, weights=None)
        return BuiltModel(module.eval(), name, "none", make_preprocess(None, size), None, random_weights=True)
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
        return BuiltModel(
            module.eval(), name, described, make_preprocess(pretrained, size), list(pretrained.meta["categories"])
        )
    # A state_dict file for a torchvision architecture: class names are ImageNet's when the
    # classifier has ImageNet's 1000 outputs, which a matching state_dict guarantees.
    module = torchvision.models.get_model(name, weights=None)
    _load_state_dict(module, name, Path(weights_text))
    default = torchvision.models.get_model_weights(name).DEFAULT
    return BuiltModel(
        module.eval(), name, f"state_dict {weights_text} (ImageNet class names)", make_preprocess(None, size),
        list(default.meta["categories"]),
    )


def make_preprocess(pretrained: Any | None = None, size: int | None = None) -> Preprocess:
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


def _classification_models() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def _check_model_name(name: str) -> str:
    known = _classification_models()
    key = name.strip().lower()
    if key in known:
        return key
    hint = did_you_mean(key, known, n=4, sep=", ")
    raise ReportError(
        f"unknown model {name!r}{hint} Any torchvision classification model works, for example "
        "alexnet, vgg16, vgg16_bn or resnet18 (see torchvision.models.list_models(torchvision.models))"
    )


def _pretrained(name: str, weights: str) -> Any | None:
    """The torchvision weights enum for ``"DEFAULT"`` or a member name like ``"IMAGENET1K_V1"``, else None."""
    import torchvision

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
