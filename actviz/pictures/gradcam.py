"""Grad-CAM: where a classifier looks, at one layer's resolution.

For a layer with activations ``A`` (``N × C × h × w``) and a class score ``y``, Grad-CAM is
``ReLU(Σ_c α_c A_c)`` with ``α_c`` the spatial mean of ``∂y/∂A_c`` (Selvaraju et al., 2017),
here divided by each sample's max so that it lies in [0, 1]. :func:`grad_cam` computes it
with ``torch.autograd.grad``, so no parameter's ``.grad`` changes, and takes off every hook
it adds and puts the model's mode back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..common.pixels import to_uint8
from ..selection import find_layer

__all__ = ["call_model", "grad_cam", "gradcam_overlay", "last_conv_name"]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(inputs)``, ``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a dict."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def last_conv_name(model: nn.Module) -> str:
    """The name of the model's last ``Conv2d`` in ``named_modules()`` order: Grad-CAM's usual layer.

    Raises:
        ValueError: The model has no ``Conv2d``.
    """
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Conv2d)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no Conv2d for Grad-CAM; name a layer, e.g. gradcam='features.10'")
    return names[-1]


def _layer(model: nn.Module, layer: str | nn.Module) -> nn.Module:
    if isinstance(layer, nn.Module):
        if not any(module is layer for module in model.modules()):
            raise ValueError(f"the {type(layer).__name__} given as layer is not part of the model")
        return layer
    return find_layer(model, layer, " for Grad-CAM")


def grad_cam(
    model: nn.Module, layer: str | nn.Module, inputs: Any, target: int | Sequence[int] | torch.Tensor | None = None
) -> torch.Tensor:
    """Grad-CAM maps of ``layer`` for ``inputs``: an ``(N, h, w)`` tensor in [0, 1], at the layer's resolution.

    The model runs in eval mode (its mode is put back after). Each sample's map is divided
    by its max; a sample whose map is all zero stays zero.

    Args:
        model: A classifier whose output is ``(N, classes)`` logits (or a tuple or dict whose
            first tensor is).
        layer: The layer, by name (``"features.10"``) or module. Its output must be ``(N, C, h, w)``.
        inputs: What the model takes: a tensor, or a tuple or dict of tensors.
        target: The class per sample (an int for all, a list or a tensor), or ``None`` for each
            sample's top class.

    Example:
        >>> torch.manual_seed(0) and None
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
        >>> cams = grad_cam(net, "0", torch.randn(2, 3, 8, 8))
        >>> tuple(cams.shape), float(cams.max()) <= 1.0
        ((2, 6, 6), True)
    """
    module = _layer(model, layer)
    found: dict[str, torch.Tensor] = {}

    def keep_first_output(module: nn.Module, args: Any, output: Any) -> None:
        found.setdefault("activations", output)

    handle = module.register_forward_hook(keep_first_output)
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            output = call_model(model, inputs)
            logits = output if isinstance(output, torch.Tensor) else next(_tensors(output))
            activations = found.get("activations")
            if not isinstance(activations, torch.Tensor) or activations.dim() != 4:
                shape = None if activations is None else tuple(getattr(activations, "shape", ()))
                raise ValueError(f"Grad-CAM needs a layer with an (N, C, h, w) output; this one gave {shape}")
            if not activations.requires_grad:
                raise ValueError("Grad-CAM needs gradients: the layer's output does not require grad")
            chosen = _targets(target, logits)
            score = logits.gather(1, chosen[:, None]).sum()
            (gradients,) = torch.autograd.grad(score, activations)
    finally:
        handle.remove()
        model.train(was_training)
    weights = gradients.mean(dim=(2, 3), keepdim=True)
    cam = torch.relu((weights * activations.detach()).sum(dim=1))
    peak = cam.amax(dim=(1, 2), keepdim=True)
    return torch.where(peak > 0, cam / torch.where(peak > 0, peak, torch.ones_like(peak)), torch.zeros_like(cam))


def _tensors(value: Any):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _targets(target: Any, logits: torch.Tensor) -> torch.Tensor:
    count = logits.shape[0]
    if target is None:
        return logits.detach().argmax(dim=1)
    chosen = torch.as_tensor(target, device=logits.device).long().reshape(-1)
    return chosen.expand(count) if chosen.numel() == 1 else chosen


@torch.no_grad()
def gradcam_overlay(image: torch.Tensor, cam: torch.Tensor, strength: float = 0.5) -> torch.Tensor:
    """The picture ``image`` with ``cam`` upsampled over it in viridis: a ``(3, H, W)`` ``uint8`` tensor.

    Args:
        image: ``(C, H, W)`` with 1 or 3 channels, any range (normalised to [0, 1] over the whole image).
        cam: ``(h, w)`` in [0, 1].
        strength: How much of the map shows over the image, 0 to 1.
    """
    from .rendering import _normalize, _viridis

    picture = _normalize(image.detach().float().cpu(), dims=(0, 1, 2))
    if picture.shape[0] == 1:
        picture = picture.expand(3, -1, -1)
    height, width = picture.shape[-2:]
    heat = F.interpolate(cam.detach().float().cpu()[None, None], size=(height, width), mode="bilinear",
                         align_corners=False)[0, 0].clamp(0, 1)
    colours = _viridis(heat).permute(2, 0, 1).float() / 255
    blended = (1 - strength) * picture[:3] + strength * colours
    return to_uint8(blended)
