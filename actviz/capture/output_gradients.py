"""The output gradients of a logging step: a pre-hook on the op that made each watched output, and its reduction.

:class:`OutputGradients` is the backward half of :class:`~actviz.capture.step_capture.StepCapture`. The
gradient flowing into a layer is the gradient with respect to its output: a pre-hook on the
output's ``grad_fn`` receives it (the op's ``grad_outputs[output_nr]``), as a tensor hook
(``output.register_hook``) would, without a hook dict on every output (half the host time). It
is the gradient with respect to the output as the layer made it, also when a later op changes
the output in place (an in-place ReLU). A leaf output gets a tensor hook. Module backward hooks
are never used: they raise on in-place ReLUs (pytorch#61519). A layer run without grad inside a
training forward (``checkpoint``) is hooked when the backward pass runs it again.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from .layer_outputs import output_tensors
from ..summaries.one_tensor import reduce_tensor

__all__ = ["OutputGradients"]


class OutputGradients:
    """Mixed into :class:`~actviz.capture.step_capture.StepCapture`: hooking and reducing the gradients of the layers' outputs.

    Example:
        >>> import tempfile, actviz
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
        >>> with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False) as viz:
        ...     model(torch.ones(2, 3)).sum().backward()
        ...     viz.flush()
        >>> sorted(viz.latest.gradients)  # the Linears' outputs, the first one before its in-place ReLU
        ['0', '2']
    """

    done: bool
    expects_backward: bool
    options: Any
    _hooks: Any
    _pending: Any
    _parameters: Any
    _seen_grads: set[str]
    _pass_reached: bool
    _grad_hook: Any
    _node_hook: Any
    _backward_handles: list[Any]
    _guarded: Callable[..., Any]
    _on_error: Callable[[str, BaseException], None]
    _queue_backward_callback: Callable[[], None]
    _callback_queued: bool

    def _hook_gradient(self, name: str, tag: str, tensor: torch.Tensor) -> None:
        """Hook the gradient with respect to ``tensor``, a watched layer's output (reported as ``tag``)."""
        if tensor.requires_grad:  # a pre-hook on the op that made it: no hook dict on the tensor (half the cost)
            node = tensor.grad_fn
            if node is not None:  # a partial of the one shared hook: a C object, no weak reference per output
                self._backward_handles.append(node.register_prehook(partial(self._node_hook, name, tag, tensor.output_nr)))
            else:  # a leaf
                self._backward_handles.append(tensor.register_hook(partial(self._grad_hook, name, tag)))
            self.expects_backward = True

    def _on_node_grad(self, name: str, tag: str, index: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """The gradient with respect to a layer's output, ``grads[index]``, as a tensor hook gets it: summarized once."""
        grad = grads[index]
        if grad is None or self.done or tag in self._seen_grads:
            return
        self._seen_grads.add(tag)
        self._pass_reached = True
        if not self._callback_queued:
            self._queue_backward_callback()
        small = self._pending.small
        try:  # a small gradient is a row of the step's batch (no object); any other is reduced now
            copy = small.whole_copy(grad, self.options.histogram_sample_size)
            reduction = small.add_copy(copy) if copy is not None else reduce_tensor(grad, self.options.histogram_sample_size, False)
        except Exception as error:  # noqa: BLE001 - a hook must never stop training
            self._on_error(name, error)
            return
        self._pending.gradients.add(tag, reduction, scaled=self._parameters.scale_taken, mergeable=True)

    def _on_recomputed(self, name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        """A checkpointed layer run again by the backward pass: hook its output's gradient now."""
        if self.done or not torch.is_grad_enabled():
            return
        for suffix, tensor in output_tensors(output, self.options.outputs):
            if name + suffix not in self._seen_grads:
                self._guarded(name, self._hook_gradient, name, name + suffix, tensor)

    def _on_output_grad(self, name: str, tag: str, grad: torch.Tensor) -> None:
        """A leaf output's gradient, from its tensor hook."""
        self._on_node_grad(name, tag, 0, (grad,))
