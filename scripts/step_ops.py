"""The aten ops of one training step, each with its owner (actviz or the model), bytes and FLOPs: used by
count_transformer_ops.py and gpu_step_model.py.

A ``TorchDispatchMode`` on the training thread sees every op. Per op that launches a kernel on a GPU (not a view,
not an allocation) it keeps: its name, the bytes of its tensor inputs (read) and outputs (written), as
``numel * element_size`` (the destination of ``copy_``/``fill_``/``zero_`` and ``out=`` tensors are written, not
read), its FLOPs where ``torch.utils.flop_counter`` has a formula (matmuls, convolutions, attention), and its owner.

An op is **actviz's** when a frame of the actviz package other than a ``__torch_function__`` is on the stack as it
is dispatched. The attention statistics' ``TorchFunctionMode`` (:class:`actviz.transformers.attention.AttentionMode`)
is active for a whole logging forward, so every torch call in that forward passes through its
``__torch_function__``: the model's own calls, and the calls of actviz's own forward hooks. Stopping at the innermost
actviz frame would count the hooks' ops as the model's; this walks past ``__torch_function__`` frames and keeps the
fact (``via_mode``).

Example:
    >>> import torch
    >>> with StepOps() as ops:
    ...     _ = torch.mm(torch.ones(2, 3), torch.ones(3, 4))
    >>> [(op.name, op.owner, op.read, op.written, op.flops) for op in ops.ops if op.name == "aten.mm.default"]
    [('aten.mm.default', 'model', 48, 32, 48)]
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

import actviz

PACKAGE = os.path.join(os.path.dirname(actviz.__file__), "")
#: Ops that only allocate: no kernel, no bytes.
ALLOCATIONS = frozenset({"aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
                         "aten.new_empty.default", "aten.new_empty_strided.default"})
WRITE_ONLY_SELF = frozenset({"aten.copy_.default", "aten.fill_.Scalar", "aten.fill_.Tensor", "aten.zero_.default"})


@dataclasses.dataclass
class Op:
    """One dispatched op that launches a kernel on a GPU."""

    name: str
    owner: str  # "actviz" or "model"
    via_mode: bool  # dispatched under actviz's attention mode (its __torch_function__ on the stack)
    read: int
    written: int
    flops: int
    call: tuple = ()  # actviz's one-pass ops: their arguments, as (numel, dtype) pairs and flags


def _nbytes(tree: object) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def owner_of_caller(depth: int = 2) -> tuple[str, bool]:
    """("actviz" or "model", whether a ``__torch_function__`` of actviz is on the stack) for the op being dispatched."""
    frame = sys._getframe(depth)
    via_mode = False
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE):
            if frame.f_code.co_name != "__torch_function__":
                return "actviz", via_mode
            via_mode = True
        frame = frame.f_back
    return "model", via_mode


def _one_pass_call(name: str, args: tuple) -> tuple:
    """The arguments of actviz's own ops that matter to a GPU model: sizes, dtypes, flags."""
    if name.startswith("actviz.summarize"):
        tensors, strides, outliers = args[0], args[1], args[2]
        units = tuple(args[3]) if len(args) > 3 else ()
        channels = tuple(args[4]) if len(args) > 4 else ()
        return ("summarize", tuple((t.numel(), str(t.dtype).split(".")[-1]) for t in tensors), tuple(strides),
                bool(outliers), units, channels)
    if name.startswith("actviz.logit_rows"):
        rows = args[0]
        return ("logit_rows", tuple(rows.shape), str(rows.dtype).split(".")[-1])
    if "scaled_dot_product" in name and isinstance(args[0], torch.Tensor):  # flop_counter has no CPU flash formula
        return ("sdpa", tuple(args[0].shape), tuple(args[1].shape))
    return ()


class StepOps(TorchDispatchMode):
    """Every kernel-launching op dispatched on this thread while entered, as :class:`Op` rows in ``ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func)
        if func.is_view or name in ALLOCATIONS:
            return out
        owner, via_mode = owner_of_caller()
        read_args = args[1:] if name in WRITE_ONLY_SELF else args
        read = _nbytes((read_args, {k: v for k, v in kwargs.items() if k != "out"}))
        written = _nbytes(kwargs["out"] if "out" in kwargs else out)
        flops = 0
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - an op the formula does not take: no FLOPs counted
                flops = 0
        self.ops.append(Op(name, owner, via_mode, read, written, flops, _one_pass_call(name, args)))
        return out

    def by_name(self, owner: str | None = None) -> dict[str, list[int]]:
        """``{op name: [count, bytes read + written]}`` for one owner (or all)."""
        found: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for op in self.ops:
            if owner is None or op.owner == owner:
                found[op.name][0] += 1
                found[op.name][1] += op.read + op.written
        return dict(found)
