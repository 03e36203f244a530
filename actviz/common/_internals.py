"""Every private PyTorch and torchvision API actviz uses, each behind one small function.

Those of TensorBoard are in :mod:`actviz.common._tensorboard_internals`. Nothing else in actviz reaches past a
public API. Each function says why the public
API is not enough, and ``tests/test_internals.py`` checks each assumption, so that a
release of PyTorch, TensorBoard or torchvision that changes one fails the suite loudly
instead of changing what actviz logs.

=====================================  ===========================================
function                               private API
=====================================  ===========================================
:func:`queue_end_of_backward`          the autograd engine's ``queue_callback``
:func:`default_store`                  ``torch.distributed.distributed_c10d._get_default_store``
:func:`backward_pass_id`               ``torch._C._current_graph_task_id``
:func:`backward_accumulates`           ``torch._C._will_engine_execute_node``
:func:`backward_runs_every_edge`       ``torch._C._current_autograd_node``, ``_will_engine_execute_node``
:func:`tensor_version`                 ``Tensor._version``
:func:`batch_and_instance_norm_types`  ``torch.nn.modules.batchnorm._NormBase``
:func:`image_classification`           ``torchvision.transforms._presets``
:func:`grad_scaler_scale`              ``GradScaler._scale``
:func:`grad_scaler_unscaled`           ``GradScaler._per_optimizer_states``
:func:`compiled_original`              ``OptimizedModule._orig_mod``
:func:`compiled_call`, its setter      ``nn.Module._compiled_call_impl`` (``model.compile()`` sets it)
:func:`inductor_backend`               ``torch._dynamo.lookup_backend``
:func:`mark_size_unbacked`             ``torch._dynamo.decorators.mark_unbacked``
:func:`compiler_stance`                ``torch._dynamo.eval_frame._stance``
:func:`swap_stance`                    ``torch._dynamo.eval_frame._stance`` (set)
:func:`mark_trace_time_constant`       ``fn._dynamo_marked_constant``
:func:`exporting_now`                  ``torch.compiler._is_exporting_flag``
:func:`functorch_wrapped`              ``torch._C._functorch.is_functorch_wrapped_tensor``
:func:`inside_functorch_transform`     ``torch._C._functorch.maybe_current_level``
:func:`forward_hooks`                  ``Module._forward_hooks``, ``_forward_pre_hooks``
:func:`flatten_copy`                   ``torch._C._nn.flatten_dense_tensors``
:func:`child_modules`                  ``Module._modules``
:func:`forward_depth`                  ``Module._call_impl``'s frames (``sys._getframe``)
:func:`traced_here`                    ``torch._guards.CompileContext.try_get``
:func:`frame_outside`                  ``sys._getframe``
:func:`backward_root`                  ``torch.autograd.backward``'s frame and its ``tensors`` (``sys._current_frames``)
:func:`attention_kernels`              ``torch.utils._python_dispatch.TorchDispatchMode``; the SDPA kernels' aten ops
=====================================  ===========================================

The summaries also call ``_foreach`` ops (``torch._foreach_norm``, ``_foreach_max``...) directly: aten operators
taking a list of tensors in one dispatch (PyTorch's optimizers are built on them), not private attributes.
``tests/test_internals.py`` checks what actviz relies on (an L0 norm counts NaN and Inf as non-zero, a float64 ``dtype=``).
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "attention_kernels", "backward_accumulates", "backward_pass_id", "backward_root", "frame_outside", "backward_runs_every_edge", "batch_and_instance_norm_types",
    "child_modules", "compiled_call", "compiled_original", "compiler_stance", "default_store",
    "exporting_now", "flatten_copy", "forward_depth", "forward_hooks", "traced_here", "functorch_wrapped", "grad_scaler_scale",
    "grad_scaler_unscaled", "image_classification", "inductor_backend", "inside_functorch_transform",
    "mark_size_unbacked", "mark_trace_time_constant", "queue_end_of_backward", "set_compiled_call", "swap_stance", "tensor_version",
]


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Ask autograd to call ``callback`` once, when the backward pass now running ends.

    Why private: no public "backward finished" hook; DDP uses this call to start its last all-reduce.
    Raises ``RuntimeError`` outside a backward pass.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def default_store() -> Any:
    """The default process group's key-value store, or ``None``. Why private: no public getter; the ranks agree through
    it, with no collective, whether all of them sum their gradient norms (:mod:`actviz.diagnosis.rank_sums`)."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # no process group (tests/test_internals.py checks the rest)
        return None


def backward_pass_id() -> int:
    """A number for the backward pass now running (``-1`` outside one): a new pass, a new number.

    Why private: no public API names the backward pass a hook runs in.
    """
    return int(torch._C._current_graph_task_id())


def backward_accumulates(leaves: Sequence[torch.Tensor]) -> bool | None:
    """Whether the backward pass now running accumulates a gradient into one of ``leaves`` (parameters):
    ``True`` for ``loss.backward()``, ``False`` for ``torch.autograd.grad`` and for ``backward(inputs=...)``
    without them, ``None`` where the engine cannot tell. Call it from a hook of the pass.

    Why private: a hook sees a gradient, not what the pass does with it. The engine knows which nodes the pass
    runs; a leaf's ``AccumulateGrad`` runs only in a pass that adds to its ``.grad``. It refuses to answer for a
    leaf whose gradient ``torch.autograd.grad`` returns ("A leaf node was passed ..."): that pass does not add to it.
    """
    try:
        will_run, gradient_edge = torch._C._will_engine_execute_node, torch.autograd.graph.get_gradient_edge
    except AttributeError:
        return None
    for leaf in leaves:
        try:
            if will_run(gradient_edge(leaf).node):
                return True
        except RuntimeError as error:
            if "autograd.grad" not in str(error):
                return None
    return False


def backward_runs_every_edge() -> bool | None:
    """Whether the backward pass now running runs every node the node it runs now leads to, as ``loss.backward()``
    does; ``torch.autograd.grad`` and ``backward(inputs=...)`` run only those on the way to their inputs (a
    layer's output leads to its weight's, which they skip). ``None`` where the engine cannot tell.

    Why private: as :func:`backward_accumulates`, for a pass whose leaves are not the parameters actviz sees
    (FSDP's gathered copies).
    """
    try:
        will_run, node = torch._C._will_engine_execute_node, torch._C._current_autograd_node()
    except (AttributeError, RuntimeError):
        return None
    if node is None:
        return None
    for next_node, _ in node.next_functions:
        try:
            if next_node is not None and not will_run(next_node):
                return False
        except RuntimeError as error:
            return False if "autograd.grad" in str(error) else None
    return True


#: The code of ``torch.autograd.backward`` (``Tensor.backward`` calls it), unwrapped: the frame that holds a pass's roots.
_AUTOGRAD_BACKWARD = inspect.unwrap(torch.autograd.backward).__code__


def backward_root(thread: int | None = None) -> torch.Tensor | None:
    """The one tensor the ``torch.autograd.backward`` call now running on ``thread`` (a thread id; this thread by
    default) started from, the innermost call where they nest: the loss, in ``loss.backward()``. ``None`` where no
    such call runs there, or it started from several tensors.

    Why private: the autograd engine starts from the loss's ``grad_fn`` with a gradient of 1 and keeps no
    reference to the loss; the frame of ``torch.autograd.backward`` on the thread that called it does, as its
    local ``tensors``. A hook of the pass reads it there (``sys._current_frames`` where the hook runs on one of
    autograd's device threads while the caller waits): nothing is wrapped or patched, no op, no sync.

    Example:
        >>> found = []
        >>> weight = torch.ones(2, requires_grad=True)
        >>> _ = weight.register_hook(lambda grad: found.append(backward_root()))
        >>> loss = (weight * 3).sum()
        >>> loss.backward()
        >>> found[0] is loss, backward_root()
        (True, None)
    """
    frame = sys._getframe() if thread is None or thread == threading.get_ident() else sys._current_frames().get(thread)
    while frame is not None and frame.f_code is not _AUTOGRAD_BACKWARD:
        frame = frame.f_back
    if frame is None:
        return None
    root = frame.f_locals.get("tensors")
    if isinstance(root, (tuple, list)):
        root = root[0] if len(root) == 1 else None
    return root if isinstance(root, torch.Tensor) else None


def tensor_version(tensor: torch.Tensor) -> int:
    """The counter that every in-place operation on ``tensor`` (or a view of it) increases.

    Why private: no public API tells whether a tensor changed in place since last seen; autograd reads it too.

    Example:
        >>> t = torch.zeros(2)
        >>> before = tensor_version(t); _ = t.add_(1)
        >>> tensor_version(t) - before
        1
    """
    return tensor._version


def batch_and_instance_norm_types() -> tuple[type[nn.Module], ...]:
    """The module types that normalise each channel on its own: BatchNorm, SyncBatchNorm, InstanceNorm.

    Why private: their one common base class, ``_NormBase``, covers the lazy variants and
    subclasses too. If it is ever renamed, the public classes below are used instead.

    Example:
        >>> isinstance(nn.BatchNorm2d(3), batch_and_instance_norm_types())
        True
    """
    try:
        from torch.nn.modules.batchnorm import _NormBase
    except ImportError:  # tests/test_internals.py fails loudly on this branch
        return (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
                nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
    return (_NormBase,)


def image_classification(
    crop_size: int, resize_size: int, mean: Sequence[float], std: Sequence[float], interpolation: Any = None
) -> Any:
    """torchvision's classification preprocessing: resize, center-crop, scale to [0, 1], normalise.

    Why private: it is the class that pretrained weights' ``transforms()`` return, so a
    report at another input size preprocesses exactly as the weights do, scaled. Its
    ``crop_size``, ``resize_size``, ``mean`` and ``std`` attributes say what it does.

    Example:
        >>> t = image_classification(crop_size=64, resize_size=73, mean=(0.5,) * 3, std=(0.25,) * 3)
        >>> t.crop_size, t.resize_size
        ([64], [73])
    """
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms._presets import ImageClassification

    return ImageClassification(
        crop_size=crop_size, resize_size=resize_size, mean=tuple(mean), std=tuple(std),
        interpolation=InterpolationMode.BILINEAR if interpolation is None else interpolation,
    )


def grad_scaler_scale(grad_scaler: Any) -> torch.Tensor | None:
    """The device tensor a ``GradScaler`` multiplies losses by, or ``None`` before its first ``scale()``.

    Why private: the public ``get_scale()`` returns a float, read on the host: a GPU sync in each logging step's backward.
    """
    return getattr(grad_scaler, "_scale", None)


def grad_scaler_unscaled(grad_scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """True once ``grad_scaler.unscale_(optimizer)`` ran for this iteration (``scaler.step`` runs it).

    Why private: GradScaler records it only in its per-optimizer state, as the stage
    ``OptState.UNSCALED``; no public method tells whether gradients are unscaled yet.
    """
    states = getattr(grad_scaler, "_per_optimizer_states", None)
    state = states.get(id(optimizer)) if isinstance(states, dict) else None  # .get: don't create one
    stage = state.get("stage") if isinstance(state, dict) else None
    return getattr(stage, "name", None) == "UNSCALED"


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module ``torch.compile(model)`` wraps, or ``None`` for a module that is no such wrapper.

    Why private: ``OptimizedModule`` keeps it as ``_orig_mod`` (hence its ``state_dict`` keys' prefix), with no accessor.
    """
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else None


def compiled_call(model: nn.Module) -> Callable[..., Any] | None:
    """The compiled ``__call__`` that ``model.compile()`` installed, or ``None``.

    Why private: ``Module.compile()`` compiles ``_call_impl``, hooks included, and stores
    it as ``_compiled_call_impl``; actviz wraps it to keep its step hook out of the graph.
    """
    return getattr(model, "_compiled_call_impl", None)


def set_compiled_call(model: nn.Module, call: Callable[..., Any] | None) -> None:
    """Replace what :func:`compiled_call` returns (to wrap it, then to put it back)."""
    model._compiled_call_impl = call


def inductor_backend() -> Callable[..., Any]:
    """Inductor as a ``torch.compile`` backend function, to wrap (actviz.summaries.fused counts its graphs).

    Why private: ``torch.compile(backend="inductor")`` takes the name only; wrapping the
    backend needs the function, which ``lookup_backend`` returns.
    """
    import torch._dynamo

    return torch._dynamo.lookup_backend("inductor")


def mark_size_unbacked(tensor: torch.Tensor, dim: int, size_hint: int) -> None:
    """Make ``tensor``'s size at ``dim`` dynamic for every value, 0 and 1 included, tuned for ``size_hint``.

    Why private: the public ``torch._dynamo.mark_dynamic`` still specializes sizes 0 and 1
    and tunes for the first size seen; one graph per size class needs the unbacked form.
    """
    import torch._dynamo

    torch._dynamo.decorators.mark_unbacked(tensor, dim, hint_override=size_hint)


def compiler_stance() -> str | None:
    """The stance ``torch.compiler.set_stance`` last set (``"default"``, ``"force_eager"``, ...), or ``None``.

    Why private: torch has a setter and no getter; reading it skips a needless switch.
    """
    import torch._dynamo

    return getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", None)


def swap_stance(stance: Any) -> Any:
    """Set torch.compile's stance (a name, or what this returned) and return the prior one.

    Why private: ``torch.compiler.set_stance`` refuses to run in a compiled region; actviz sets it from there.
    """
    from torch._dynamo import eval_frame

    prior = eval_frame._stance
    eval_frame._stance = stance if isinstance(stance, eval_frame.DynamoStance) else eval_frame.DynamoStance(stance)
    return prior


def mark_trace_time_constant(function: Callable[[], Any]) -> None:
    """Make Dynamo call ``function`` while it traces and use its result as a constant.

    Why private: it is what ``torch._dynamo.assume_constant_result`` sets, without importing Dynamo (seconds).
    """
    function._dynamo_marked_constant = True  # type: ignore[attr-defined]


def exporting_now() -> bool:
    """Whether ``torch.export`` is tracing now: the flag ``torch.compiler.is_exporting()`` returns.

    Why private: called while Dynamo traces, the public function is folded to a constant, and torch 2.11's
    Dynamo folds it to True under ``torch.compile`` too (2.14's reads this flag); the flag is right in both.
    """
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.func`` transform's wrapper (inside ``vmap``, ``grad``): no public test."""
    return bool(torch._C._functorch.is_functorch_wrapped_tensor(tensor))


def inside_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform runs now: only functorch's C++ stack knows."""
    return torch._C._functorch.maybe_current_level() is not None


def forward_depth(module: nn.Module) -> int:
    """Calls of ``module`` on this thread's stack (``Module._call_impl`` frames): 2+ when its forward calls it again."""
    depth, frame, code = 0, sys._getframe(1), nn.Module._call_impl.__code__
    while frame is not None:
        depth, frame = depth + (frame.f_code is code and frame.f_locals.get("self") is module), frame.f_back
    return depth


def frame_outside(prefixes: tuple[str, ...]) -> Any:
    """The innermost frame of this thread's stack, from the caller's caller out, whose file does not start with one
    of ``prefixes``; ``None`` if every frame's does. What a warning points at: the user's line."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame = frame.f_back
    return frame


def traced_here() -> bool:
    """Whether this thread compiles: ``torch.compiler.is_compiling()`` is one flag, true while any thread compiles."""
    return torch._guards.CompileContext.try_get() is not None  # Dynamo calls it as it traces (a trace-time constant)


mark_trace_time_constant(traced_here)


def child_modules(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s children by attribute name, the live dict: one lookup, where ``getattr`` runs ``Module.__getattr__``."""
    return module._modules


def forward_hooks(module: nn.Module, pre: bool = False) -> dict[int, Any]:
    """``module``'s forward (or pre-) hooks by key: all a copy keeps of them; ``owned_hooks.ForwardHooks`` fills it."""
    return module._forward_pre_hooks if pre else module._forward_hooks


def flatten_copy(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor of every element of ``tensors``, in order (a ``cat`` of their flat views), not on autograd's tape.

    Why private: ``torch.cat`` takes 1-D views made one by one in Python; this is the same ``cat`` with the views
    made in C++ (what DDP and ``torch._utils._flatten_dense_tensors`` use), one call for a model's parameters.

    Example:
        >>> flatten_copy([torch.ones(2, 2, requires_grad=True), torch.zeros(1)])
        tensor([1., 1., 1., 1., 0.])
    """
    with torch.no_grad():
        return torch._C._nn.flatten_dense_tensors(list(tensors))



def attention_kernels() -> tuple[tuple[Any, ...], type]:
    """The aten ops of SDPA's fused kernels, whose output 1 is each query row's log-sum-exp, and
    ``TorchDispatchMode``, the base of a mode that sees them: public APIs see only SDPA's output."""
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    ops = tuple(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))
    return ops, torch.utils._python_dispatch.TorchDispatchMode
