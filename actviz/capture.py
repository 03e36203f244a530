"""The hooks of one logging step, and the small results they leave.

A :class:`StepCapture` exists only for a step that logs. It hooks the watched layers
and their parameters, reduces every tensor inside its hook, on the tensor's device,
decides itself when the step is over, and then hands the step on with one call of
``deliver``. The path of one activation, from hook to event file:

1. :meth:`StepCapture._on_layer_output` (a forward hook) calls
   :func:`~actviz.summaries.reduce_tensor` and :func:`~actviz.rendering.picture_source`;
   their small tensors stay on the device in a :class:`~actviz.transfer.PendingStep`;
2. when the backward pass ends (or the forward, when no backward is coming, or at
   :meth:`StepCapture.finish`), :meth:`~actviz.transfer.PendingStep.send` starts one
   copy to the host and ``deliver(pending)`` hands the step to the watcher's sink;
3. on the writer thread, :meth:`~actviz.transfer.PendingStep.resolve` finishes the
   summaries and pictures and :class:`~actviz.sinks.TensorBoardSink` writes them.

No hook holds a batch: activations are reduced before the next layer runs, so a later
in-place op cannot change what was logged. Gradients with respect to a layer's output
come from ``output.register_hook`` called inside the forward hook; module backward hooks
raise on the in-place ReLU that follows every conv in AlexNet and VGG (pytorch#61519).
Parameters and their gradients are reduced together: the weights when the step starts,
the gradients when the backward pass ends.

A BatchNorm, InstanceNorm or GroupNorm fed directly by a tensor drawn in the same step
gets no picture: it shifts and scales each channel, and every channel is normalised on
its own when drawn, so its grid would repeat its input's.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._internals import queue_end_of_backward, tensor_version
from .batch_summaries import reduce_tensors
from .layer_outputs import PER_CHANNEL_AFFINE, batch_dim_of, output_tensors, reduce_output
from .options import CaptureOptions
from .summaries import reduce_tensor
from .transfer import PendingStep

__all__ = ["HookHandles", "StepCapture"]

logger = logging.getLogger(__name__)

#: Called with (what failed, the exception) when a hook raises.
ErrorHandler = Callable[[str, BaseException], None]


class HookHandles:
    """Every hook handle of one capture, in named groups. :meth:`remove` is safe to call again.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> handles = HookHandles()
        >>> handles.add("forward", layer.register_forward_hook(lambda *args: None))
        >>> handles.remove(); handles.remove()
        >>> len(layer._forward_hooks)
        0
    """

    def __init__(self) -> None:
        self._groups: dict[str, list[RemovableHandle]] = {}

    def add(self, group: str, handle: RemovableHandle) -> None:
        self._groups.setdefault(group, []).append(handle)

    def remove(self, group: str | None = None) -> None:
        """Remove the hooks of ``group``, or all of them."""
        for name in [group] if group is not None else list(self._groups):
            for handle in self._groups.pop(name, []):
                handle.remove()


class StepCapture:
    """Hooks and results for one logging step.

    Args:
        step: The step number the results belong to.
        model: The watched model; a forward hook on it marks the end of the forward pass.
        layers: ``(tag name, module)`` pairs to hook.
        parameters: ``(tag name, parameter)`` pairs whose values and gradients to summarize.
        want_stats: Summarize activations, output gradients, weights and weight gradients.
        want_images: Draw feature maps.
        options: Bins, sampling and channel limits.
        deliver: Called once, with the :class:`~actviz.transfer.PendingStep`, when the step
            ends and logged something.
        on_error: Called with the failing layer or parameter name; it may re-raise.
    """

    def __init__(
        self,
        step: int,
        model: nn.Module,
        layers: Sequence[tuple[str, nn.Module]],
        parameters: Sequence[tuple[str, nn.Parameter]],
        *,
        want_stats: bool,
        want_images: bool,
        options: CaptureOptions,
        deliver: Callable[[PendingStep], None],
        on_error: ErrorHandler,
    ) -> None:
        self.step = step
        self.want_stats = want_stats
        self.want_images = want_images
        self.options = options
        self.done = False
        self.in_forward = True
        self.expects_backward = False
        self._deliver = deliver
        self._on_error = on_error
        self._pending = PendingStep(step, options.bins)
        self._hooks = HookHandles()
        self._seen: set[str] = set()  # layers and gradients already logged: a second call logs nothing
        self._weight_grads: dict[str, torch.Tensor] = {}  # held, not copied, until the backward pass ends
        # id -> (weak reference, version) of each tensor drawn this step, to spot a repeat picture.
        self._drawn: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._backward_callback_queued = False
        self._attach(model, layers, parameters)

    # -- hooks -------------------------------------------------------------------------------

    def _attach(
        self, model: nn.Module, layers: Sequence[tuple[str, nn.Module]], parameters: Sequence[tuple[str, nn.Parameter]]
    ) -> None:
        for name, module in layers:
            hook = partial(self._on_layer_output, name, batch_dim_of(module))
            self._hooks.add("forward", module.register_forward_hook(hook))
        self._hooks.add("forward", model.register_forward_hook(self._on_forward_done, always_call=True))
        if not self.want_stats:
            return
        self._reduce_together("weights", dict(parameters))
        for name, param in parameters:
            if param.requires_grad:
                hook = partial(self._on_param_grad, name)
                self._hooks.add("backward", param.register_post_accumulate_grad_hook(hook))
                self.expects_backward = True

    def _guarded(self, name: str, function: Callable[..., None], *args: Any) -> None:
        try:
            function(*args)
        except Exception as error:  # noqa: BLE001 - a hook must never stop training
            self._on_error(name, error)

    def _reduce_together(self, kind: str, named: dict[str, torch.Tensor]) -> None:
        """Reduce many tensors in a fixed number of ops (most parameters are small)."""
        try:
            reductions = reduce_tensors(list(named.values()), self.options.histogram_sample_size)
        except Exception:  # noqa: BLE001 - find the one that fails, and report it by name
            for tag, tensor in named.items():
                self._guarded(tag, self._reduce_one, kind, tag, tensor)
            return
        for tag, reduction in zip(named, reductions):
            self._pending.add(kind, tag, reduction)

    def _reduce_one(self, kind: str, tag: str, tensor: torch.Tensor) -> None:
        reduction = reduce_tensor(tensor, self.options.histogram_sample_size, count_zeros=kind == "activations")
        self._pending.add(kind, tag, reduction)

    def _on_layer_output(self, name: str, batch_dim: int, module: nn.Module, inputs: Any, output: Any) -> None:
        if self.done or name in self._seen:  # a module called twice logs its first call
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
        return drawn is not None and drawn[0]() is first and drawn[1] == tensor_version(first)

    def _capture_output(self, name: str, batch_dim: int, output: Any, draw: bool = True) -> None:
        for position, (suffix, tensor) in enumerate(output_tensors(output, self.options.outputs)):
            tag = name + suffix
            # Only the first tensor is drawn: later ones (an LSTM's h and c) are not batch-first.
            reduction, picture = reduce_output(
                tensor, self.options, stats=self.want_stats, draw=self.want_images and draw and position == 0,
                batch_dim=batch_dim,
            )
            if reduction is not None:
                self._pending.add("activations", tag, reduction)
                if tensor.requires_grad:
                    hook = partial(self._on_output_grad, name, tag)
                    self._hooks.add("backward", tensor.register_hook(hook))
                    self.expects_backward = True
            if picture is not None:
                self._pending.add_picture(tag, *picture)
                self._drawn[id(tensor)] = (weakref.ref(tensor), tensor_version(tensor))

    def _on_output_grad(self, name: str, tag: str, grad: torch.Tensor) -> None:
        if self.done or "grad:" + tag in self._seen:
            return
        self._seen.add("grad:" + tag)
        self._queue_backward_callback()
        self._guarded(name, self._reduce_one, "gradients", tag, grad)

    def _on_param_grad(self, name: str, param: nn.Parameter) -> None:
        # Held until the backward pass ends, then reduced together.
        if self.done or name in self._weight_grads or param.grad is None:
            return
        self._queue_backward_callback()
        self._weight_grads[name] = param.grad

    def _on_forward_done(self, model: nn.Module, args: Any, output: Any) -> None:
        self._hooks.remove("forward")
        self.in_forward = False
        if not self.expects_backward or output is None:  # None: the forward raised
            self.finish()

    def _queue_backward_callback(self) -> None:
        """Ask autograd to call :meth:`finish` when this backward pass ends (as DDP does)."""
        if self._backward_callback_queued:
            return
        self._backward_callback_queued = True
        try:
            queue_end_of_backward(self.finish)
        except Exception:  # noqa: BLE001 - without it, the step is handed on at the next step or close()
            logger.debug("could not queue an end-of-backward callback", exc_info=True)

    # -- the end -----------------------------------------------------------------------------

    def finish(self) -> None:
        """Remove every hook, start the copy to the host and deliver the step, once.

        Called at the end of the backward pass, at the end of a forward that expects none,
        or by the watcher when the step must end (the next step, or ``close()``). Safe to
        call more than once.
        """
        if self.done:
            return
        self.done = True
        self.in_forward = False
        self._hooks.remove()
        weight_grads, self._weight_grads = self._weight_grads, {}
        self._drawn = {}
        if weight_grads:
            self._reduce_together("weight_grads", weight_grads)
        if self._pending.empty:
            return
        try:
            self._pending.send()
        except Exception as error:  # noqa: BLE001 - a failed copy loses this step, not the run
            self._on_error("(step)", error)
            return
        self._deliver(self._pending)
