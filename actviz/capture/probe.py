"""A fixed probe input: the same picture through training, and Grad-CAM over it.

Feature maps of the training batch show a different input at every image step. With
``watch(..., extras=[actviz.Probe(inputs)])`` each image step instead sends the probe once through the
model, under ``torch.no_grad()`` in eval mode, and draws the watched layers' outputs for
probe sample 0: the slider in TensorBoard then shows one input's features evolving.
The probe forward is not a step: it changes no parameter, gradient or BatchNorm statistic,
puts every module's training flag back, and runs through the unwrapped module (not DDP's
wrapper, which would run a collective on rank 0 alone). With ``gradcam=`` it also draws
Grad-CAM of the probe's top class over probe sample 0, computed with
``torch.autograd.grad`` so that training's gradients are untouched. A model with attention
also gets its probe's attention maps and, for a ViT, attention rollout
(:mod:`actviz.transformers.attention_maps`). :func:`try_probe` runs the same forward once in ``watch()``,
so that a probe the model cannot take, or a Grad-CAM layer that cannot work, fails there.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ..transformers.attention_maps import attention_pictures, record_attention
from .compiled_model import eager, unwrap_compiled
from ..common.distributed_types import is_ddp, is_fsdp_parameter
from ..pictures.gradcam import call_model, grad_cam, gradcam_overlay, last_conv_name
from .layer_outputs import DrawnTensors, batch_dim_of, output_tensors
from ..common.owned_hooks import HookHandles
from ..common.pixels import to_uint8
from ..pictures.rendering import Picture, _normalize, picture_source
from ..selection import find_layer
from ..tags import GRADCAM, PROBE_INPUT

__all__ = ["ProbeForward", "check_probe", "gradcam_layers", "probe_image", "try_probe", "unwrap_for_probe"]

#: ``(tag, draw, sources, full_tag)``: what PendingStep.add_picture takes.


def check_probe(probe: Any, model: nn.Module) -> None:
    """Raise a ``TypeError`` or ``ValueError`` naming ``actviz.Probe`` unless the model can take it here."""
    if probe is None:
        return
    values = probe.values() if isinstance(probe, Mapping) else probe if isinstance(probe, (tuple, list)) else [probe]
    if not values or not all(isinstance(value, torch.Tensor) for value in values):
        raise TypeError(
            "actviz.Probe(batch) takes a batch the model takes: a tensor, or a tuple or dict of tensors passed as "
            f"its arguments; got {type(probe).__name__}. For pictures, actviz.Probe(actviz.load_images(['cat.jpg']))"
        )
    if any(value.numel() == 0 for value in values):  # an empty batch fails at the first image step, later
        raise ValueError(f"actviz.Probe(batch) got an empty batch ({_shapes(probe)}): nothing to draw; give at least one "
                         "sample, such as the first of a training batch: actviz.Probe(inputs[:1])")
    if any(is_fsdp_parameter(param) for param in model.parameters()):
        raise ValueError(
            "actviz.Probe does not work with FSDP: its forward gathers the parameters with collectives, which rank 0 "
            "alone would wait on; leave it out of extras= (feature maps then come from the training batch)"
        )


def gradcam_layers(model: nn.Module, gradcam: Any, probe: Any) -> list[tuple[str, nn.Module]]:
    """Resolve ``gradcam=``: ``True`` for the last ``Conv2d``, a name or a list of names, ``None``/``False`` for none."""
    if gradcam is None or gradcam is False:
        return []
    if probe is None:
        raise ValueError("gradcam= draws over the probe input: give a probe, e.g. "
                         "extras=[actviz.Probe(actviz.load_images(['cat.jpg']), gradcam=True)]")
    if probe_image(probe) is None:  # Grad-CAM is drawn over probe sample 0 as a picture: none, no Grad-CAM
        raise ValueError(
            f"gradcam={gradcam!r} draws over probe sample 0 as a picture, so the probe must be a batch of images, "
            f"(N, 1 or 3, H, W) floats, first if it is a tuple or dict; got {_shapes(probe)}. For example "
            "actviz.Probe(actviz.load_images(['cat.jpg']), gradcam=True)"
        )
    if gradcam is True:
        names = [last_conv_name(model)]
    elif isinstance(gradcam, str):
        names = [gradcam]
    elif isinstance(gradcam, (list, tuple)) and all(isinstance(name, str) for name in gradcam):
        names = list(gradcam)
    else:
        raise TypeError(f"gradcam= must be True, a layer name or a list of names, got {type(gradcam).__name__}: {gradcam!r}")
    return [(name, find_layer(model, name, f" in gradcam={gradcam!r}")) for name in names]


def _shapes(probe: Any) -> str:
    """The probe's shapes for a message: ``shape (1, 3, 8, 8)``, or one per tuple item or dict key."""
    def one(value: Any) -> str:
        return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__

    if isinstance(probe, Mapping):
        return "shapes {" + ", ".join(f"{key!r}: {one(value)}" for key, value in probe.items()) + "}"
    if isinstance(probe, (tuple, list)):
        return "shapes (" + ", ".join(one(value) for value in probe) + ")"
    return f"shape {one(probe)}"


def try_probe(model: nn.Module, probe: Any, gradcam: list[tuple[str, nn.Module]]) -> None:
    """Send ``probe`` once through ``model`` at ``watch()``, so that a probe the model cannot take fails there.

    The forward is the image steps' own: through :func:`unwrap_for_probe`, under
    ``torch.no_grad()``, in eval mode, with the probe's tensors where they are (a probe on
    another device than the model fails here as it would at every image step). Nothing of
    the model changes: in eval mode BatchNorm reads its running statistics without updating
    them and Dropout draws no random numbers; every module's training flag is put back
    afterwards; no parameter, gradient or buffer is written; and the random state of the CPU
    and of the CUDA devices involved is restored, so a model that samples in eval mode leaves
    the training's random stream where it was. The model's own hooks run, as on any forward.
    It costs one forward of the probe. A model with lazy modules (``nn.LazyLinear``) that have
    not run yet is not tried: that forward would create their parameters.

    The layers of ``gradcam`` are checked to be reached and to give the ``(N, C, h, w)``
    output Grad-CAM needs; Grad-CAM's backward is left to the image steps.

    Args:
        model: The watched model (a DDP or compiled wrapper is unwrapped as on image steps).
        probe: What :func:`check_probe` accepted.
        gradcam: ``(name, module)`` pairs from :func:`gradcam_layers`.

    Raises:
        ValueError: The forward raised (the message names ``actviz.Probe``, its shapes and torch's
            error), or a Grad-CAM layer is not reached or gives another output (it names ``gradcam=``).

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
        >>> try_probe(net, torch.zeros(1, 5, 8, 8), [])
        Traceback (most recent call last):
        ...
        ValueError: actviz.Probe(batch) of shape (1, 5, 8, 8) does not go through the Sequential: RuntimeError: ...channels...
    """
    target = unwrap_for_probe(model)
    parameters = list(target.parameters())
    if any(is_lazy(param) for param in parameters):
        return
    tensors = list(probe.values()) if isinstance(probe, Mapping) else list(probe) if isinstance(probe, (tuple, list)) \
        else [probe]
    probe_devices, model_devices = {tensor.device for tensor in tensors}, {param.device for param in parameters}
    # With gradcam=: every module's first output shape (or type), in the order they finish, to name a good layer.
    seen: dict[str, tuple[nn.Module, tuple[int, ...] | str]] = {}

    def keep(name: str, module: nn.Module, args: Any, output: Any) -> None:
        if name not in seen:
            seen[name] = (module, tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__)

    modes = {module: module.training for module in target.modules()}
    handles = HookHandles()
    try:
        for name, module in unwrap_compiled(model).named_modules() if gradcam else ():
            handles.add("forward", module.register_forward_hook(partial(keep, name)))
        cuda = sorted({device.index or 0 for device in probe_devices | model_devices if device.type == "cuda"})
        with torch.random.fork_rng(devices=cuda), eager(), torch.no_grad():
            target.eval()
            call_model(target, probe)
    except Exception as error:
        where = ""
        if model_devices and not probe_devices <= model_devices:
            where = (f" The probe is on {', '.join(sorted(map(str, probe_devices)))} and the model on "
                     f"{', '.join(sorted(map(str, model_devices)))}: move it, e.g. actviz.Probe(batch.to(device)).")
        raise ValueError(
            f"actviz.Probe(batch) of {_shapes(probe)} does not go through the {type(target).__name__}: {type(error).__name__}: "
            f"{error}.{where} Give a batch it takes, such as the first sample of a training batch: actviz.Probe(inputs[:1])"
        ) from error
    finally:
        handles.remove()
        for module, training in modes.items():
            module.training = training
    shapes = {id(module): shape for module, shape in seen.values()}
    for name, layer in gradcam:
        shape = shapes.get(id(layer))
        if isinstance(shape, tuple) and len(shape) == 4:
            continue
        found = ("is not run by the probe's forward" if shape is None
                 else f"gives an output of shape {shape}" if isinstance(shape, tuple) else f"gives a {shape}")
        good = next((other for other, (module, other_shape) in reversed(seen.items())
                     if isinstance(module, nn.Conv2d) and isinstance(other_shape, tuple) and len(other_shape) == 4), None)
        raise ValueError(
            f"gradcam={name!r}: this layer {found}; Grad-CAM needs a layer whose output is (N, C, h, w)"
            + (f", e.g. gradcam={good!r}, the last Conv2d the probe runs" if good else "")
        )


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


class ProbeForward:
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
                found.append(Picture(name, picture[0], (picture[1],)))
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
                found.append(Picture(PROBE_INPUT, draw_probe_input, (image,), True))
                for name, layer in self.gradcam:
                    with eager():
                        cam = grad_cam(model, layer, self.inputs)[0]
                    found.append(Picture(GRADCAM.format(layer=name), gradcam_overlay, (image, cam), True))
        finally:
            handles.remove()
            for module, training in modes.items():
                module.training = training
        return found
