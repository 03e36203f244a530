"""The output gradients of a logging step: a pre-hook on the op that made each watched output, and its reduction.

:class:`OutputGradients` holds the backward hooks of one :class:`~actviz.capture.step_capture.StepCapture`.
The gradient flowing into a layer is the gradient with respect to its output: a pre-hook on the
output's ``grad_fn`` receives it (the op's ``grad_outputs[output_nr]``), as a tensor hook
(``output.register_hook``) would, without a hook dict on every output (half the host time). It
is the gradient with respect to the output as the layer made it, also when a later op changes
the output in place (an in-place ReLU). A leaf output gets a tensor hook. Module backward hooks
are never used: they raise on in-place ReLUs (pytorch#61519). A layer run without grad inside a
training forward (``checkpoint``) is hooked when the backward pass runs it again.

Only the backward pass that trains is logged. A pass whose result goes to ``torch.autograd.grad`` (a WGAN-GP
gradient penalty, R1, input gradients) or to ``backward(inputs=...)`` without the parameters is not the layer's
training gradient: it is skipped, feeds no alert, and the training pass that follows is logged instead. The
first gradient of a pass asks the autograd engine, once: the pass trains if it accumulates into a trainable
watched parameter (:func:`~actviz.common._internals.backward_accumulates`), or else if it runs every node the
output's node leads to, as ``loss.backward()`` does and those two do not (the layer's weight is not on their
way: :func:`~actviz.common._internals.backward_runs_every_edge`). The second test covers a ``.backward()``
whose leaves are not the parameters actviz sees: FSDP's gathered copies, a frozen network's input.

The first gradient of a training pass queues a callback on the autograd engine (as DDP does), which
tells the step's :class:`~actviz.capture.step_end.StepEnd` when that pass is over. With ``"loss"`` in the
statistics, the first training pass of a step also keeps the tensor it started from
(:func:`~actviz.common._internals.backward_root`, read from the training thread's ``torch.autograd.backward``
frame): a one-element float tensor, the loss of ``loss.backward()``, is written as ``loss/backward_root``
(divided by the AMP scale where the pass carries one).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from ..common._internals import backward_accumulates, backward_pass_id, backward_runs_every_edge
from ..common._internals import backward_root, queue_end_of_backward
from ..common.owned_hooks import OwnedHook, Removable
from ..options import CaptureOptions
from ..output.pending_step import PendingStep
from ..statistics.gradient_noise import GradientNoise
from ..statistics.layer_statistic import summary_request, take_values
from ..summaries.one_tensor import start_summary
from ..tags import LOSS
from .layer_outputs import output_tensors
from .step_end import Stage, StepEnd
from .step_parameters import StepParameters

__all__ = ["OutputGradients"]

logger = logging.getLogger(__name__)


class OutputGradients:
    """The hooks on a logging step's layer outputs' gradients, and their reductions.

    Args:
        end: The step's end: told when a backward pass that reached a watched output is over.
        pending: Where the reduced gradients go (``gradients/{layer}``).
        parameters: The step's parameters: the loss scale is taken from them when a pass starts.
        options: The histogram sample size and which outputs of a layer count.
        on_error: Called with the layer's name when a hook fails.
        handles: The list the hooks' handles go into, removed with the step's other hooks.
        noise: With ``statistics=[..., "gradient_noise"]``, what takes each output gradient's per-example norms
            (:class:`~actviz.statistics.gradient_noise.GradientNoise`).

    Attributes:
        seen: The tags whose gradient was logged: a second call (a layer run twice) logs nothing.

    Example:
        >>> import tempfile, actviz
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
        >>> with actviz.watch(model, tempfile.mkdtemp(), every=1, image_every=False) as viz:
        ...     model(torch.ones(2, 3)).sum().backward()
        ...     viz.flush()
        >>> sorted(viz.latest.gradients)  # the Linears' outputs, the first one before its in-place ReLU
        ['0', '2']
    """

    def __init__(self, end: StepEnd, pending: PendingStep, parameters: StepParameters, options: CaptureOptions,
                 on_error: Callable[[str, BaseException], None], handles: list[Removable],
                 noise: GradientNoise | None = None) -> None:
        self.seen: set[str] = set()
        self._end = end
        self._pending = pending
        self._parameters = parameters
        self._options = options
        self._on_error = on_error
        self._handles = handles
        self._noise = noise
        # layer name -> (its module, the statistics of target "output_gradient" that apply to it)
        self.statistics: dict[str, tuple[nn.Module, tuple[Any, ...]]] = {}
        # One hook object for all output gradients, partials of it per output: few Python objects per logging step.
        self._grad_hook, self._node_hook = OwnedHook(self._on_output_grad), OwnedHook(self._on_node_grad)
        self._callback_queued = False  # a backward pass under way reached a watched output: its end is awaited
        self._pass: int | None = None  # the backward pass last judged (backward_pass_id), and whether it trains
        self._pass_trains = True
        self._root_taken = not options.loss  # the first training pass's root is the step's loss/backward_root
        self._thread = threading.get_ident()  # the training thread, which calls backward(): where its root is read

    @property
    def hooked(self) -> bool:
        """Whether a watched output's gradient is hooked: the step waits for a backward pass."""
        return bool(self._handles)

    def hook(self, name: str, tag: str, tensor: torch.Tensor) -> None:
        """Hook the gradient with respect to ``tensor``, a watched layer's output (reported as ``tag``)."""
        if tensor.requires_grad:  # a pre-hook on the op that made it: no hook dict on the tensor (half the cost)
            node = tensor.grad_fn
            if node is not None:  # a partial of the one shared hook: a C object, no weak reference per output
                self._handles.append(node.register_prehook(partial(self._node_hook, name, tag, tensor.output_nr)))
            else:  # a leaf
                self._handles.append(tensor.register_hook(partial(self._grad_hook, name, tag)))

    def hook_recomputed(self, layers: dict[str, nn.Module], names: set[str]) -> None:
        """Hook the layers of ``names``, run without grad in the forward (checkpointed), when the backward pass runs them again."""
        for name in names:
            hook = OwnedHook(self._on_recomputed, layers[name], name)
            self._handles.append(layers[name].register_forward_hook(hook))

    def _on_node_grad(self, name: str, tag: str, index: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        """The gradient with respect to a layer's output, ``grads[index]``, as a tensor hook gets it: summarized once."""
        grad = grads[index]
        if grad is None or self._end.stage is Stage.DONE or tag in self.seen or not self._trains():
            return
        self.seen.add(tag)
        if not self._callback_queued:
            self._queue_backward_callback()
        module, statistics = self.statistics.get(name, (None, ()))  # most steps: none
        try:  # a small gradient is a row of the step's batch (no object but its handle); any other is reduced now
            outliers, units = summary_request(statistics, grad, module) if statistics else (False, ())
            summary = start_summary(grad, self._options.histogram_sample_size, self._pending.small, False,
                                    outliers=outliers, units=units)
        except Exception as error:  # noqa: BLE001 - a hook must never stop training
            self._on_error(name, error)
            return
        summary.tag, summary.scaled, summary.mergeable = tag, self._parameters.scale_taken, True
        self._pending.gradients.append(summary)
        if statistics:
            take_values(statistics, tag, module, grad, summary, self._pending.layer_values, self._options)
        if self._noise is not None:
            self._noise.take_gradient(tag, grad)

    def _trains(self) -> bool:
        """Whether the backward pass now running trains (the module docstring's rule), judged once per pass."""
        try:
            current = backward_pass_id()
        except Exception:  # noqa: BLE001 - no such engine query: every pass is logged
            return True
        if current != self._pass:
            self._pass, self._pass_trains = current, self._judge_pass()
        return self._pass_trains

    def _judge_pass(self) -> bool:
        leaves = [param for _, param in reversed(self._parameters.trainable) if param.requires_grad]  # the last layers'
        try:  # first: most passes that train reach them
            if backward_accumulates(leaves) is not False:
                return True
            return backward_runs_every_edge() is not False
        except Exception:  # noqa: BLE001 - a hook must never stop training: logged, as when the engine cannot be asked
            return True

    def _on_output_grad(self, name: str, tag: str, grad: torch.Tensor) -> None:
        """A leaf output's gradient, from its tensor hook."""
        self._on_node_grad(name, tag, 0, (grad,))

    def _on_recomputed(self, name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        """A checkpointed layer run again by the backward pass: hook its output's gradient now."""
        if self._end.stage is Stage.DONE or not torch.is_grad_enabled():
            return
        for suffix, tensor in output_tensors(output, self._options.outputs):
            if name + suffix not in self.seen:
                try:
                    self.hook(name, name + suffix, tensor)
                except Exception as error:  # noqa: BLE001 - a hook must never stop training
                    self._on_error(name, error)

    def _queue_backward_callback(self) -> None:
        """Ask autograd to tell the step's end when this backward pass ends (as DDP does)."""
        self._callback_queued = True
        self._parameters.take_loss_scale()
        if not self._root_taken:
            self._root_taken = True
            self._take_root()
        try:
            queue_end_of_backward(self._on_backward_end)
        except Exception:
            logger.debug("could not queue an end-of-backward callback", exc_info=True)

    def _take_root(self) -> None:
        """Keep the tensor this training pass started from, a one-element float tensor (the loss), as the step's
        ``loss/backward_root``: a view of it goes with the step's one copy to the host (no op, no sync here)."""
        root = backward_root(self._thread)
        if root is not None and root.numel() == 1 and root.is_floating_point() and not root.is_nested:
            self._pending.add_scalar(LOSS, root.detach().reshape(()), self._parameters.scale_taken, join_small=True)

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        self._end.backward_done()
