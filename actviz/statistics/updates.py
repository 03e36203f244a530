"""Statistics of the update an optimizer step applies to each watched parameter: target ``"parameter_update"``.

On a logging step that names one of them, the step keeps a copy of the trainable watched parameters when the
optimizer is about to step (with the gradients it applies, as ``update_ratio`` does), and, where
``update_lost`` runs, which elements had a gradient other than 0; when the update is done (the next forward,
or ``flush()``), each statistic's device half gets the update applied, ``after - before`` in the parameter's
own dtype, and an :class:`AppliedUpdate` with the rest. All on the device, no sync:

* ``update_rms`` (``update_stats/rms@{param}``): the RMS of the update applied, ‖after - before‖ / √n; for Adam
  ``lr·m̂/(√v̂+ε)`` plus the decay, measured rather than recomputed, so it holds for any optimizer; 1 kernel;
* ``update_lost`` (``update_stats/lost_fraction@{param}``): of the elements whose gradient was not 0, the fraction
  that did not change: their update was below half a step of their float format at their value (bfloat16,
  float16, float32), and rounding dropped it; 6 kernels;
* ``adam_epsilon`` (``update_stats/epsilon_fraction@{param}``): for an optimizer whose state has ``exp_avg_sq``
  and whose group has ``eps`` and ``betas`` (Adam, AdamW, NAdam, RAdam...): the fraction of elements where ε
  exceeds √v̂, ``v̂ = v / (1 - β₂ᵗ)`` with the step count ``t`` of the state after the step, where ε, not the
  gradient, sets the step size; 2 kernels (read as ``v < ε²·(1 - β₂ᵗ)``: one pass over ``v``).

None is in the default set (each costs a copy of the parameters and a pass over it); name them:
``statistics=["default", "update_rms", "update_lost", "adam_epsilon"]``. ``frozen_parameter`` reads
``update_lost`` where it runs.

Example:
    >>> update = torch.tensor([0.0, 0.0, 3.0, 4.0])
    >>> applied = AppliedUpdate(torch.ones(4), torch.tensor([True, True, True, False]))
    >>> UpdateRMS().host(UpdateRMS().device(update, applied, None).tolist(), 4, torch.float32)
    {'rms': 2.5}
    >>> UpdateLost().host(UpdateLost().device(update, applied, None).tolist(), 4, torch.float32)
    {'lost_fraction': 0.6666666666666666}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .layer_statistic import LayerStatistic

__all__ = ["AdamEpsilon", "AppliedUpdate", "UpdateLost", "UpdateRMS", "UpdateStatistic"]


@dataclass
class AppliedUpdate:
    """What an update statistic gets besides the update (as ``module``): the parameter after the update, which
    elements had a gradient other than 0 when the optimizer stepped (``None`` where no statistic asked), and the
    optimizer's state and group of the parameter (``None`` where it has none)."""

    after: torch.Tensor
    had_gradient: torch.Tensor | None = None
    state: Any = None
    group: Any = None


class UpdateStatistic(LayerStatistic):
    """A statistic of target ``"parameter_update"``: :meth:`device` gets the update applied and an
    :class:`AppliedUpdate`; ``needs_gradient_mask`` asks the step to keep which elements had a gradient."""

    target = "parameter_update"
    needs_gradient_mask = False

    def on_by_default(self, model: Any, options: Any) -> bool:
        return False


class UpdateRMS(UpdateStatistic):
    """``update_stats/rms@{param}``: the RMS of the update the optimizer step applied."""

    name, names = "update_rms", ("rms",)
    cost = "1 kernel per parameter (its norm) after the copy the update statistics share; no sync"

    def device(self, tensor: torch.Tensor, module: Any, options: Any) -> torch.Tensor | None:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return None
        return torch.linalg.vector_norm(tensor, dtype=torch.float32).reshape(1)

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return {"rms": numbers[0] / math.sqrt(numel)}


class UpdateLost(UpdateStatistic):
    """``update_stats/lost_fraction@{param}``: of the elements with a gradient other than 0, the fraction the step
    left unchanged (their update was below half a float step of their value)."""

    name, names = "update_lost", ("lost_fraction",)
    cost = "6 kernels per parameter (1 when the optimizer steps, 5 after), a byte per element kept; no sync"
    needs_gradient_mask = True

    def device(self, tensor: torch.Tensor, module: Any, options: Any) -> torch.Tensor | None:
        mask = getattr(module, "had_gradient", None)
        if mask is None or mask.shape != tensor.shape or not tensor.is_floating_point():
            return None
        lost = torch.logical_and(tensor.eq(0), mask)
        return torch.stack([lost.sum(dtype=torch.float32), mask.sum(dtype=torch.float32)])

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        lost, with_gradient = numbers
        return {"lost_fraction": lost / with_gradient if with_gradient > 0 else math.nan}


class AdamEpsilon(UpdateStatistic):
    """``update_stats/epsilon_fraction@{param}``: the fraction of elements where Adam's ε exceeds √v̂.

    Example:
        >>> state = {"exp_avg_sq": torch.tensor([1e-20, 1e-10, 1.0]), "step": torch.tensor(1.0)}
        >>> group = {"eps": 1e-8, "betas": (0.9, 0.999)}
        >>> numbers = AdamEpsilon().device(torch.zeros(3), AppliedUpdate(torch.zeros(3), None, state, group), None)
        >>> AdamEpsilon().host(numbers.tolist(), 3, torch.float32)  # √v̂ = 3.2e-9, 3.2e-4, 31.6
        {'epsilon_fraction': 0.3333333432674408}
    """

    name, names = "adam_epsilon", ("epsilon_fraction",)
    cost = "2 kernels per parameter (one pass over exp_avg_sq); no sync (a CPU step count is read through numpy)"

    def device(self, tensor: torch.Tensor, module: Any, options: Any) -> torch.Tensor | None:
        state, group = getattr(module, "state", None), getattr(module, "group", None)
        if not isinstance(state, dict) or not isinstance(group, dict):
            return None
        second = state.get("max_exp_avg_sq") if group.get("amsgrad") else None
        second = state.get("exp_avg_sq") if second is None else second
        step, eps, betas = state.get("step"), group.get("eps"), group.get("betas")
        if not isinstance(second, torch.Tensor) or step is None or not isinstance(eps, (int, float)):
            return None
        if not isinstance(betas, (tuple, list)) or len(betas) < 2:
            return None
        beta2 = float(betas[1])
        if isinstance(step, torch.Tensor) and step.device.type != "cpu":  # capturable, fused: no read on the host
            limit = (1 - torch.pow(beta2, step.to(torch.float64))) * (float(eps) ** 2)
            return torch.mean(second.lt(limit.to(second.device).reshape(())), dtype=torch.float32).reshape(1)
        # a CPU step count (Adam's default) read through numpy: no aten op, no device involved
        count = float(step.detach().numpy().reshape(-1)[0]) if isinstance(step, torch.Tensor) else float(step)
        limit_number = (1 - beta2 ** count) * float(eps) ** 2
        return torch.mean(second.lt(limit_number), dtype=torch.float32).reshape(1)

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return {"epsilon_fraction": numbers[0]}
