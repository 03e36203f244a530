"""PyTorch's distributed types, recognised by class name: the only place actviz does that.

A DTensor (FSDP2's parameters, tensor parallelism), FSDP1's ``FlatParameter`` and a
``DistributedDataParallel`` wrapper are recognised by the name of their class, so that
actviz imports no ``torch.distributed`` internals to check a type (they may be missing
from a build, and importing them costs time at ``import actviz``). A rename in PyTorch
would turn these checks off silently, which is why they are listed among actviz's side
effects (docs/how-it-works.md) and ``tests/test_distributed.py`` runs DDP, FSDP1 and FSDP2
through them. ``tests/test_idioms.py`` checks that no other module compares class names: so the one other
check by name, of norm layers (:func:`is_norm_by_class_name`), is here too.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_ddp", "is_dtensor", "is_fsdp_parameter", "is_norm_by_class_name"]


def is_dtensor(value: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``, whose ops may run collectives.

    Example:
        >>> import torch
        >>> is_dtensor(torch.zeros(2))
        False
    """
    return type(value).__name__ == "DTensor"  # called per tensor: kept to one attribute read


def is_fsdp_parameter(value: Any) -> bool:
    """True for a parameter that FSDP gathers in its forward: a DTensor (FSDP2) or a ``FlatParameter`` (FSDP1).

    Example:
        >>> import torch
        >>> is_fsdp_parameter(torch.nn.Parameter(torch.zeros(2)))
        False
    """
    return is_dtensor(value) or "FlatParameter" in type(value).__name__


def is_ddp(model: Any) -> bool:
    """True for a ``torch.nn.parallel.DistributedDataParallel`` wrapper (its ``.module`` is the model).

    Example:
        >>> import torch
        >>> is_ddp(torch.nn.Linear(2, 2))
        False
    """
    return type(model).__name__ == "DistributedDataParallel"


def is_norm_by_class_name(module: Any) -> bool:
    """True for a module whose class name holds ``Norm`` (``LayerNorm``, ``RMSNorm``, the batch norms, Hugging
    Face's ``LlamaRMSNorm``...): they share no base class, so nanoGPT's parameter groups and the optimizer audit
    tell them by name.

    Example:
        >>> import torch
        >>> is_norm_by_class_name(torch.nn.LayerNorm(2)), is_norm_by_class_name(torch.nn.Linear(2, 2))
        (True, False)
    """
    return "Norm" in type(module).__name__
