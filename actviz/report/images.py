"""The report's images: reading any image file as 8-bit RGB, and naming each image's run."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..common.pixels import to_uint8
from .errors import ImageError

if TYPE_CHECKING:
    from .models import Preprocess

__all__ = ["display_image", "folder_name", "load_image", "load_images", "run_names"]


def _to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL mode to 8-bit RGB: 16-bit and float scaled (not clipped), alpha composited on white."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        values = np.asarray(image).astype(np.float64)
        peak = 65535.0 if values.max(initial=0) <= 65535 else float(values.max())
        gray = to_uint8(values / peak)
        return Image.fromarray(gray).convert("RGB")
    if image.mode == "F":
        values = np.nan_to_num(np.asarray(image, dtype=np.float64))
        low, high = float(values.min(initial=0)), float(values.max(initial=0))
        if low >= 0 and high <= 1:
            scaled = values
        else:
            scaled = (values - low) / (high - low) if high > low else np.zeros_like(values)
        return Image.fromarray(to_uint8(scaled)).convert("RGB")
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


def load_images(paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str], size: int = 224) -> torch.Tensor:
    """Image files as one batch a torchvision classifier takes: ``(N, 3, size, size)`` float32.

    The report's preprocessing: resize the shorter side to ``size * 256 / 224``, center-crop
    ``size`` and normalise with ImageNet's mean and std (what torchvision's pretrained
    AlexNet, VGG and ResNet weights expect at ``size=224``). Made for
    ``actviz.watch(model, log_dir, extras=[actviz.Probe(actviz.load_images(["cat.jpg"]))])``.

    Args:
        paths: One path or a list of them.
        size: Side of the square input, at least 16.

    Raises:
        ImageError: A file cannot be read; the message names it.
        ReportError: ``size`` is not an int of at least 16.

    Example:
        >>> load_images(["tests/data/chelsea.jpg", "tests/data/coffee.jpg"], size=64).shape
        torch.Size([2, 3, 64, 64])
    """
    from .models import make_preprocess

    preprocess = make_preprocess(None, size)
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ImageError("load_images got no paths; give a list of image files, e.g. ['cat.jpg']")
    return torch.stack([preprocess(load_image(path)) for path in paths])


def display_image(batch: torch.Tensor, preprocess: Preprocess) -> torch.Tensor:
    """Undo the normalisation of a ``(1, 3, H, W)`` model input: what the model saw, as ``uint8``.

    Example:
        >>> from actviz.report.models import make_preprocess
        >>> preprocess = make_preprocess(None, 32)
        >>> batch = preprocess(Image.new("RGB", (40, 40), (255, 128, 0))).unsqueeze(0)
        >>> display_image(batch, preprocess)[:, 0, 0].tolist()
        [255, 128, 0]
    """
    mean = torch.tensor(preprocess.mean, dtype=batch.dtype).view(3, 1, 1)
    std = torch.tensor(preprocess.std, dtype=batch.dtype).view(3, 1, 1)
    return to_uint8(batch[0].cpu() * std + mean)


def folder_name(text: str, fallback: str) -> str:
    """``text`` with every run of characters other than letters, digits, ``.``, ``_`` and ``-`` made one ``_``.

    Example:
        >>> folder_name("my cat (1)", "image"), folder_name("..", "image")
        ('my_cat_1', 'image')
    """
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or fallback


def run_names(paths: Sequence[Path]) -> list[str]:
    """A folder-safe, unique name per image: its stem, then ``-2``, ``-3`` for repeats.

    Example:
        >>> run_names([Path("a/cat.jpg"), Path("b/cat.png"), Path("dog.jpg")])
        ['cat', 'cat-2', 'dog']
    """
    names: list[str] = []
    for path in paths:
        base = folder_name(path.stem, "image")
        name, count = base, 1
        while name in names:
            count += 1
            name = f"{base}-{count}"
        names.append(name)
    return names
