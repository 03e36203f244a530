"""Two counts the health rules need from the device, made in a layer's hook beside its summary.

* ReLU-family outputs with channels (3-D and up): the fraction of channels that are zero
  for the whole batch (three ops: ``amax`` over every dim but the channels', ``eq``, ``mean``).
* Tanh and Sigmoid outputs: the fraction within :data:`SATURATION_MARGIN` of a bound
  (three or four ops).

Each is a 0-dim tensor carried to the host with the step (``PendingStep.add_scalar``) under
``health/...``; :class:`~actviz.diagnosis.alerts.HealthMonitor` takes them out of the results before
they are written, so they make no TensorBoard card.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..common.distributed_types import is_dtensor

__all__ = ["COUNTED_LAYERS", "DEAD_CHANNELS", "SATURATED", "SATURATION_MARGIN", "is_relu_family", "unit_counts"]

logger = logging.getLogger(__name__)

DEAD_CHANNELS = "health/dead_channels"
SATURATED = "health/saturated"
#: Distance from a Tanh's (±1) or Sigmoid's (0, 1) bound counted as saturated: the slope there is
#: below 0.06 (Tanh) or 0.03 (Sigmoid), under a sixteenth of its slope at 0.
SATURATION_MARGIN = 0.03


def is_relu_family(module: nn.Module) -> bool:
    """ReLU, ReLU6, or LeakyReLU with slope 0: outputs exactly zero for every negative input.

    Example:
        >>> is_relu_family(nn.ReLU()), is_relu_family(nn.LeakyReLU(0.0)), is_relu_family(nn.LeakyReLU())
        (True, True, False)
    """
    if isinstance(module, nn.LeakyReLU):
        return module.negative_slope == 0
    return isinstance(module, (nn.ReLU, nn.ReLU6))


#: The layer types counted here: every other layer costs one ``isinstance``.
COUNTED_LAYERS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Tanh, nn.Sigmoid)


def unit_counts(module: nn.Module, tag: str, tensor: torch.Tensor, pending: Any) -> None:
    """Add the device counts of one layer output to ``pending`` (a :class:`~actviz.output.pending_step.PendingStep`).

    Example:
        >>> from actviz.output.pending_step import PendingStep
        >>> pending = PendingStep(0, bins=8)
        >>> unit_counts(nn.Tanh(), "act", torch.tensor([0.999, -0.999, 0.0, 0.5]), pending)
        >>> pending.resolve().scalars
        {'health/saturated/act': 0.5}
    """
    if not isinstance(module, COUNTED_LAYERS) or not tensor.is_floating_point() or tensor.numel() == 0:
        return  # most layers (convolutions, norms, linears): one isinstance
    try:
        _count(module, tag, tensor, pending)
    except Exception:
        logger.debug("no unit counts for %s", tag, exc_info=True)


def _count(module: nn.Module, tag: str, tensor: torch.Tensor, pending: Any) -> None:
    values = tensor.detach()
    if is_dtensor(values):  # its local shard, as summaries.local_shard: no collective on one rank
        values = values.to_local()
    if is_relu_family(module) and values.dim() >= 3:
        dims = [dim for dim in range(values.dim()) if dim != 1]
        pending.add_scalar(f"{DEAD_CHANNELS}/{tag}", torch.mean(values.amax(dim=dims).eq(0), dtype=torch.float32))
    elif isinstance(module, nn.Tanh):
        pending.add_scalar(f"{SATURATED}/{tag}", torch.mean(values.abs().gt(1 - SATURATION_MARGIN), dtype=torch.float32))
    elif isinstance(module, nn.Sigmoid):
        distance = (values - 0.5).abs()
        pending.add_scalar(f"{SATURATED}/{tag}", torch.mean(distance.gt(0.5 - SATURATION_MARGIN), dtype=torch.float32))
