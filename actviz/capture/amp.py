"""Mixed precision: reading a ``torch.amp.GradScaler`` without making the GPU wait.

During ``scaler.scale(loss).backward()`` every gradient is the true one times the loss
scale. actviz copies the scale tensor on the device when a logging step's backward pass
starts and divides the logged gradients by it on the host. GradScaler keeps its scale and
its per-optimizer stage in private attributes, read through :mod:`actviz.common._internals`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..common._internals import grad_scaler_scale, grad_scaler_unscaled
from ..options import check_grad_scaler

__all__ = ["check_grad_scaler", "loss_scale_of", "unscaled_by"]


def loss_scale_of(grad_scaler: Any) -> torch.Tensor | None:
    """The scaler's scale as a device tensor, or ``None`` when it scales nothing (disabled or not yet used).

    Example:
        >>> loss_scale_of(None) is None, loss_scale_of(torch.amp.GradScaler("cpu", enabled=False)) is None
        (True, True)
    """
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    return grad_scaler_scale(grad_scaler)  # get_scale() would read it on the host: a sync


def unscaled_by(grad_scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """True if the scaler has already divided ``optimizer``'s gradients by its scale (``scaler.unscale_``).

    ``scaler.step(optimizer)`` unscales before it calls ``optimizer.step()``, so this is True
    in the optimizer's step pre-hook of an AMP loop that uses the scaler as documented.
    """
    return grad_scaler is not None and grad_scaler_unscaled(grad_scaler, optimizer)
