"""Capture: the hooks of one logging step, and the small results they leave.

A :class:`StepCapture` exists only for a step that logs. It attaches forward
hooks to the watched layers and post-accumulate-grad hooks to their parameters,
reduces every activation and output gradient inside its hook (see
:mod:`actviz.summaries` and :mod:`actviz.rendering`), and keeps one result per
tag. No hook holds a batch: activations are reduced before the next layer runs,
so a later in-place op cannot change what was logged. Parameters and their
gradients, mostly small tensors, are summarized together: the weights when the
step starts, the gradients (already held by the parameters) when the backward
pass ends.

A BatchNorm, InstanceNorm or GroupNorm layer fed directly by a tensor drawn in the
same step gets no picture: it shifts and scales each channel, and every channel is
normalised on its own when drawn, so its grid would repeat its input's.

Gradients with respect to a layer's output come from ``output.register_hook``
called inside the forward hook. Module backward hooks are not used: they raise
on the in-place ReLU that follows every conv in AlexNet and VGG
(pytorch/pytorch#61519).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .rendering import feature_map_grid, heatmap
from .summaries import DEFAULT_SAMPLE_SIZE, Summary, summarize, summarize_many

__all__ = ["CaptureOptions", "StepCapture", "StepResults", "output_tensors", "render_output"]

logger = logging.getLogger(__name__)

#: Called with (what failed, the exception) when a hook raises.
ErrorHandler = Callable[[str, BaseException], None]


@dataclass(frozen=True)
class CaptureOptions:
    """What a logging step reduces each tensor to."""

    bins: int = 64
    sample_size: int | None = DEFAULT_SAMPLE_SIZE
    max_channels: int = 64
    outputs: Literal["first", "all"] = "first"


@dataclass
class StepResults:
    """Everything one step logs, already on the host. Keys are tag suffixes (layer or parameter names)."""

    step: int
    activations: dict[str, Summary] = field(default_factory=dict)
    gradients: dict[str, Summary] = field(default_factory=dict)
    weights: dict[str, Summary] = field(default_factory=dict)
    weight_grads: dict[str, Summary] = field(default_factory=dict)
    images: dict[str, torch.Tensor] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.activations or self.gradients or self.weights or self.weight_grads or self.images)


def output_tensors(output: Any, mode: Literal["first", "all"] = "first") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(suffix, tensor)`` for the tensors in a module's output.

    A plain tensor yields ``("", tensor)``. Tuples, lists and dicts are searched depth
    first: ``mode="first"`` yields only the first tensor, with suffix ``""``;
    ``mode="all"`` yields each one with its path as suffix, such as ``"/0"``,
    ``"/1.0"`` or ``"/attn"``.

    Example:
        >>> out = torch.zeros(2), (torch.ones(1), torch.ones(3))   # like nn.LSTM's (output, (h, c))
        >>> [(s, t.numel()) for s, t in output_tensors(out, "all")]
        [('/0', 2), ('/1.0', 1), ('/1.1', 3)]
        >>> [(s, t.numel()) for s, t in output_tensors(out)]
        [('', 2)]
    """
    if isinstance(output, torch.Tensor):
        yield "", output
        return
    found = _walk(output, ())
    if mode == "first":
        for _, tensor in found:
            yield "", tensor
            return
    else:
        for path, tensor in found:
            yield "/" + ".".join(path), tensor


def _walk(value: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _walk(item, (*path, str(index)))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, (*path, str(key)))


def render_output(tensor: torch.Tensor, max_channels: int, batch_dim: int = 0) -> torch.Tensor | None:
    """Picture of one sample of a layer output: a channel grid for 4-D, a heat map for 3-D, else ``None``."""
    if tensor.numel() == 0 or tensor.dim() not in (3, 4) or tensor.is_complex():
        return None
    if tensor.dim() == 4:
        return feature_map_grid(tensor[0], max_channels=max_channels)
    return heatmap(tensor.select(batch_dim, 0))


#: Layers that map each channel of each sample through an affine function (BatchNorm in training
#: and eval, InstanceNorm, GroupNorm). With every channel normalised on its own, their grid is
#: their input's grid again, pixel for pixel (inverted where the weight is negative).
PER_CHANNEL_AFFINE: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase, nn.GroupNorm)


def _batch_dim(module: nn.Module) -> int:
    # nn.LSTM, nn.GRU, nn.MultiheadAttention and nn.Transformer* put time first unless batch_first=True.
    return 1 if getattr(module, "batch_first", True) is False else 0


class StepCapture:
    """Hooks and results for one logging step.

    Args:
        step: The step number the results belong to.
        layers: ``(tag name, module)`` pairs to hook.
        parameters: ``(tag name, parameter)`` pairs whose values and gradients to summarize.
        want_stats: Summarize activations, output gradients, weights and weight gradients.
        want_images: Render feature maps.
        options: Bins, sampling and channel limits.
        on_error: Called with the failing layer or parameter name; it may re-raise.
        on_backward_done: Called with this capture once, at the end of the first backward pass
            that reaches one of its hooks.
    """

    def __init__(
        self,
        step: int,
        layers: Sequence[tuple[str, nn.Module]],
        parameters: Sequence[tuple[str, nn.Parameter]],
        want_stats: bool,
        want_images: bool,
        options: CaptureOptions,
        on_error: ErrorHandler,
        on_backward_done: Callable[[StepCapture], None] | None = None,
    ) -> None:
        self.step = step
        self.want_stats = want_stats
        self.want_images = want_images
        self.options = options
        self._on_error = on_error
        self._on_backward_done = on_backward_done
        self._layer_handles: list[RemovableHandle] = []
        self._param_handles: list[RemovableHandle] = []
        self._seen: set[str] = set()
        self._backward_callback_queued = False
        self.closed = False
        self.expects_backward = False
        # One slot per tag, holding small tensors on the source device until collect().
        self._vectors: dict[str, dict[str, torch.Tensor]] = {
            "activations": {}, "gradients": {}, "weights": {}, "weight_grads": {}
        }
        self._images: dict[str, torch.Tensor] = {}
        # Parameter gradients as accumulated, summarized together in collect().
        self._weight_grads: dict[str, torch.Tensor] = {}
        # id -> (weak reference, version) of each tensor drawn this step, to spot a repeat picture.
        self._drawn: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._attach(layers, parameters)

    # -- hooks -------------------------------------------------------------------------------

    def _attach(self, layers: Sequence[tuple[str, nn.Module]], parameters: Sequence[tuple[str, nn.Parameter]]) -> None:
        for name, module in layers:
            hook = partial(self._on_layer_output, name, _batch_dim(module))
            self._layer_handles.append(module.register_forward_hook(hook))
        if not self.want_stats:
            return
        self._summarize_all("weights", parameters)
        for name, param in parameters:
            if param.requires_grad:
                self._param_handles.append(param.register_post_accumulate_grad_hook(partial(self._on_param_grad, name)))
                self.expects_backward = True

    def _guarded(self, name: str, function: Callable[..., None], *args: Any) -> None:
        try:
            function(*args)
        except Exception as error:  # noqa: BLE001 - a hook must never stop training
            self._on_error(name, error)

    def _summarize_all(self, kind: str, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Summarize many tensors in one call (most parameters are small: per-call cost dominates)."""
        options = self.options
        try:
            vectors = summarize_many([tensor for _, tensor in named], options.bins, options.sample_size, count_zeros=False)
        except Exception:  # noqa: BLE001 - find the one that fails, and report it by name
            for tag, tensor in named:
                self._guarded(tag, self._summarize_into, kind, tag, tensor)
            return
        self._vectors[kind].update(zip([tag for tag, _ in named], vectors))

    def _summarize_into(self, kind: str, tag: str, tensor: torch.Tensor) -> None:
        count_zeros = kind == "activations"  # the only kind whose zero fraction is logged
        self._vectors[kind][tag] = summarize(tensor, self.options.bins, self.options.sample_size, count_zeros)

    def _on_layer_output(self, name: str, batch_dim: int, module: nn.Module, inputs: Any, output: Any) -> None:
        if self.closed or name in self._seen:  # a module called twice logs its first call
            return
        self._seen.add(name)
        redraws_input = self.want_images and isinstance(module, PER_CHANNEL_AFFINE) and self._is_drawn(inputs)
        self._guarded(name, self._capture_output, name, batch_dim, output, not redraws_input)

    def _is_drawn(self, inputs: Any) -> bool:
        """True if the first input is a tensor drawn this step and not changed in place since."""
        first = inputs[0] if isinstance(inputs, tuple) and inputs else None
        if not isinstance(first, torch.Tensor) or first.dim() != 4:  # only grids repeat; heat maps do not
            return False
        drawn = self._drawn.get(id(first))
        return drawn is not None and drawn[0]() is first and drawn[1] == first._version

    def _capture_output(self, name: str, batch_dim: int, output: Any, draw: bool = True) -> None:
        for position, (suffix, tensor) in enumerate(output_tensors(output, self.options.outputs)):
            tag = name + suffix
            if self.want_stats:
                self._summarize_into("activations", tag, tensor)
                if tensor.requires_grad:
                    tensor.register_hook(partial(self._on_output_grad, name, tag))
                    self.expects_backward = True
            # Only the first tensor is drawn: later ones (an LSTM's h and c) are not batch-first.
            if self.want_images and draw and position == 0:
                image = render_output(tensor, self.options.max_channels, batch_dim)
                if image is not None:
                    self._images[tag] = image
                    self._drawn[id(tensor)] = (weakref.ref(tensor), tensor._version)

    def _on_output_grad(self, name: str, tag: str, grad: torch.Tensor) -> None:
        if self.closed or tag in self._vectors["gradients"]:
            return
        self._queue_backward_callback()
        self._guarded(name, self._summarize_into, "gradients", tag, grad)

    def _on_param_grad(self, name: str, param: nn.Parameter) -> None:
        # Kept until the backward pass ends, then summarized together (see collect).
        if self.closed or name in self._weight_grads or param.grad is None:
            return
        self._queue_backward_callback()
        self._weight_grads[name] = param.grad

    def _queue_backward_callback(self) -> None:
        """Ask autograd to call ``on_backward_done`` when this backward pass ends (as DDP does)."""
        if self._backward_callback_queued or self._on_backward_done is None:
            return
        self._backward_callback_queued = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._on_backward_done, self))
        except Exception:  # noqa: BLE001 - without it, results are written at the next step or close()
            logger.debug("could not queue an end-of-backward callback", exc_info=True)

    # -- lifetime ----------------------------------------------------------------------------

    def detach_layer_hooks(self) -> None:
        """Remove the forward hooks; output-gradient and parameter hooks stay for the backward pass."""
        for handle in self._layer_handles:
            handle.remove()
        self._layer_handles.clear()

    def close(self) -> None:
        """Remove every hook this capture attached. Safe to call more than once."""
        self.closed = True
        self.detach_layer_hooks()
        for handle in self._param_handles:
            handle.remove()
        self._param_handles.clear()

    def collect(self) -> StepResults:
        """Close, copy every result to the host in one transfer per device and dtype, and return them.

        Called when the backward pass ends, so the parameter gradients are still the ones it made.
        """
        self.close()
        self._summarize_all("weight_grads", list(self._weight_grads.items()))
        self._weight_grads = {}
        keyed = [(kind, tag, vector) for kind, slots in self._vectors.items() for tag, vector in slots.items()]
        host_vectors = _to_host([vector for _, _, vector in keyed])
        results = StepResults(self.step)
        for (kind, tag, _), vector in zip(keyed, host_vectors):
            getattr(results, kind)[tag] = Summary.from_vector(vector.tolist())
        results.images = dict(zip(self._images, _to_host(list(self._images.values()))))
        self._vectors = {kind: {} for kind in self._vectors}
        self._images = {}
        self._drawn = {}
        return results


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Move tensors to the CPU with one copy per (device, dtype) group instead of one per tensor."""
    result: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.device.type == "cpu":
            result[index] = tensor
        else:
            groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    for indices in groups.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices]).cpu()
        offset = 0
        for i in indices:
            size = tensors[i].numel()
            result[i] = flat[offset : offset + size].view(tensors[i].shape)
            offset += size
    return result  # type: ignore[return-value]
