"""A fixed probe input: the same picture through training, and Grad-CAM over it.

Feature maps of the training batch show a different input at every image step. With
``watch(..., probe=inputs)`` each image step instead sends the probe once through the
model, under ``torch.no_grad()`` in eval mode, and draws the watched layers' outputs for
probe sample 0: the slider in TensorBoard then shows one input's features evolving.
The probe forward is not a step: it changes no parameter, gradient or BatchNorm statistic,
puts every module's training flag back, and runs through the unwrapped module (not DDP's
wrapper, which would run a collective on rank 0 alone). With ``gradcam=`` it also draws
Grad-CAM of the probe's top class over probe sample 0, computed with
``torch.autograd.grad`` so that training's gradients are untouched. A model with attention
also gets its probe's attention maps and, for a ViT, attention rollout
(:mod:`actviz.attention_maps`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .attention_maps import attention_pictures, record_attention
from .compiled_model import eager, unwrap_compiled
from .distributed_types import is_ddp, is_fsdp_parameter
from .gradcam import call_model, grad_cam, gradcam_overlay, last_conv_name
from .layer_outputs import DrawnTensors, batch_dim_of, output_tensors
from .owned_hooks import HookHandles
from .pixels import to_uint8
from .rendering import _normalize, picture_source
from .selection import find_layer
from .tags import GRADCAM, PROBE_INPUT

__all__ = ["Probe", "check_probe", "gradcam_layers", "probe_image", "unwrap_for_probe"]

#: ``(tag, draw, sources, full_tag)``: what PendingStep.add_picture takes.
Picture = tuple[str, Any, tuple[torch.Tensor, ...], bool]


def check_probe(probe: Any, model: nn.Module) -> None:
    """Raise a ``TypeError`` or ``ValueError`` naming ``probe=`` unless the model can take it here."""
    if probe is None:
        return
    values = probe.values() if isinstance(probe, Mapping) else probe if isinstance(probe, (tuple, list)) else [probe]
    if not values or not all(isinstance(value, torch.Tensor) for value in values):
        raise TypeError(
            "probe= must be a batch the model takes: a tensor, or a tuple or dict of tensors passed as its "
            f"arguments; got {type(probe).__name__}. For pictures, probe=actviz.load_images(['cat.jpg'])"
        )
    if any(is_fsdp_parameter(param) for param in model.parameters()):
        raise ValueError(
            "probe= does not work with FSDP: its forward gathers the parameters with collectives, which rank 0 "
            "alone would wait on; leave probe= out (feature maps then come from the training batch)"
        )


def gradcam_layers(model: nn.Module, gradcam: Any, probe: Any) -> list[tuple[str, nn.Module]]:
    """Resolve ``gradcam=``: ``True`` for the last ``Conv2d``, a name or a list of names, ``None``/``False`` for none."""
    if gradcam is None or gradcam is False:
        return []
    if probe is None:
        raise ValueError("gradcam= draws over the probe input: give probe= too, e.g. probe=actviz.load_images(['cat.jpg'])")
    if gradcam is True:
        names = [last_conv_name(model)]
    elif isinstance(gradcam, str):
        names = [gradcam]
    elif isinstance(gradcam, (list, tuple)) and all(isinstance(name, str) for name in gradcam):
        names = list(gradcam)
    else:
        raise TypeError(f"gradcam= must be True, a layer name or a list of names, got {type(gradcam).__name__}: {gradcam!r}")
    return [(name, find_layer(model, name, f" in gradcam={gradcam!r}")) for name in names]


def unwrap_for_probe(model: nn.Module) -> nn.Module:
    """The module a probe runs through: DDP's and torch.compile's wrapped module, else ``model``."""
    if is_ddp(model):
        model = model.module
    return unwrap_compiled(model)


def probe_image(probe: Any) -> torch.Tensor | None:
    """Probe sample 0 as a picture, if the probe looks like images: a ``(1 or 3, H, W)`` float tensor.

    Example:
        >>> probe_image(torch.zeros(2, 3, 4, 4)).shape, probe_image(torch.zeros(2, 10)) is None
        (torch.Size([3, 4, 4]), True)
    """
    first = probe if isinstance(probe, torch.Tensor) else None
    if isinstance(probe, (tuple, list)) and probe:
        first = probe[0]
    elif isinstance(probe, Mapping) and probe:
        first = next(iter(probe.values()))
    if isinstance(first, torch.Tensor) and first.dim() == 4 and first.shape[1] in (1, 3) and first.is_floating_point():
        return first[0].detach().clone()
    return None


@torch.no_grad()
def draw_probe_input(image: torch.Tensor) -> torch.Tensor:
    """A ``(1 or 3, H, W)`` image normalised over all its channels together, as ``uint8``."""
    return to_uint8(_normalize(image.float(), dims=(0, 1, 2)))


class Probe:
    """Runs the probe on image steps and returns the pictures for the step's results.

    Args:
        inputs: What the model takes: a tensor, or a tuple or dict of tensors.
        layers: ``(tag name, module)`` pairs whose outputs are drawn.
        max_channels: Most channels per grid.
        gradcam: ``(tag name, module)`` pairs to draw Grad-CAM for.
    """

    def __init__(self, inputs: Any, layers: list[tuple[str, nn.Module]], max_channels: int,
                 gradcam: list[tuple[str, nn.Module]] | None = None) -> None:
        self.inputs = inputs
        self._layers = layers
        self._max_channels = max_channels
        self.gradcam = gradcam or []

    def pictures(self, model: nn.Module) -> list[Picture]:
        """Send the probe through ``model`` (the unwrapped module) and return its pictures."""
        found: list[Picture] = []
        drawn = DrawnTensors()
        seen: set[str] = set()

        def hook(name: str, batch_dim: int, module: nn.Module, args: Any, output: Any) -> None:
            if name in seen:
                return
            seen.add(name)
            first = next(iter(output_tensors(output)), None)
            if first is None or drawn.would_repeat(module, args):
                return
            picture = picture_source(first[1], self._max_channels, batch_dim)
            if picture is not None:
                found.append((name, picture[0], (picture[1],), False))
                drawn.add(first[1])

        modes = {module: module.training for module in model.modules()}
        handles = HookHandles()
        try:
            for name, module in self._layers:
                handles.add("forward", module.register_forward_hook(
                    lambda *a, name=name, dim=batch_dim_of(module): hook(name, dim, *a)))
            with eager(), torch.no_grad(), record_attention(model) as maps:
                model.eval()
                call_model(model, self.inputs)
            image = probe_image(self.inputs)
            found += attention_pictures(maps, image)
            if image is not None:
                found.append((PROBE_INPUT, draw_probe_input, (image,), True))
                for name, layer in self.gradcam:
                    with eager():
                        cam = grad_cam(model, layer, self.inputs)[0]
                    found.append((GRADCAM.format(layer=name), gradcam_overlay, (image, cam), True))
        finally:
            handles.remove()
            for module, training in modes.items():
                module.training = training
        return found
