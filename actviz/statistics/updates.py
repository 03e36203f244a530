"""Statistics of the update an optimizer step applies to each watched parameter: target ``"parameter_update"``.

On a logging step that names one of them, the step keeps, when the optimizer is about to step, a fixed strided
sample of each trainable watched parameter (all of it up to :data:`~actviz.statistics.update_sample.UPDATE_SAMPLE_SIZE`,
16,384 elements, else at most that many, evenly spread: :mod:`actviz.statistics.update_sample`) and, where
``update_lost`` runs, which of those elements had a gradient other than 0; when the update is done (the next
forward, or ``flush()``), it reads the same elements again and each statistic gets the update applied to them,
``after - before`` in the parameter's own dtype, packed with the other parameters of its device and dtype in one
:class:`PackedUpdates`. So the numbers of a parameter of at most 16,384 elements are exact, and those of a larger
one are estimates from its sample. All on the device, no sync, a handful of ops for all the parameters together:

* ``update_rms`` (``update_stats/rms@{param}``): the RMS of the update applied, ‖after - before‖ / √n over the
  sample; for Adam ``lr·m̂/(√v̂+ε)`` plus the decay, measured rather than recomputed, so it holds for any optimizer;
* ``update_lost`` (``update_stats/lost_fraction@{param}``): of the sampled elements whose gradient was not 0, the
  fraction that did not change: their update was below half a step of their float format at their value
  (bfloat16, float16, float32), and rounding dropped it;
* ``adam_epsilon`` (``update_stats/epsilon_fraction@{param}``): for an optimizer whose state has ``exp_avg_sq``
  and whose group has ``eps`` and ``betas`` (Adam, AdamW, NAdam, RAdam...): the fraction of the sampled elements
  where ε exceeds √v̂, ``v̂ = v / (1 - β₂ᵗ)`` with the step count ``t`` of the state after the step, where ε, not
  the gradient, sets the step size (read as ``v < ε²·(1 - β₂ᵗ)``: one pass over the sample of ``v``).

None is in the default set; name them: ``statistics=["default", "update_rms", "update_lost", "adam_epsilon"]``.
``frozen_parameter`` reads ``update_lost`` where it runs.

A statistic of this target that is not an :class:`UpdateStatistic` (one of a user's) gets, per parameter, the
update of its sample and an :class:`AppliedUpdate` (:meth:`UpdateStatistic.device_packed`).

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
from dataclasses import dataclass, field
from typing import Any

import torch

from .layer_statistic import LayerStatistic

__all__ = ["AdamEpsilon", "AppliedUpdate", "PackedUpdates", "UpdateLost", "UpdateRMS", "UpdateStatistic", "flat_sample"]


@dataclass
class AppliedUpdate:
    """What a statistic of one parameter's update gets besides the update (as ``module``): the parameter after the
    update, which elements had a gradient other than 0 when the optimizer stepped (``None`` where no statistic
    asked), and the optimizer's state and group of the parameter (``None`` where it has none). Of a sampled
    parameter, ``after`` and ``had_gradient`` are of its sample, as the update is."""

    after: torch.Tensor
    had_gradient: torch.Tensor | None = None
    state: Any = None
    group: Any = None


@dataclass
class PackedUpdates:
    """The sampled updates of the parameters of one device and dtype, end to end in flat buffers.

    Parameter ``j`` of the pack (``indices[j]`` in the step's list of trainable parameters) holds ``lengths[j]``
    elements of each buffer, its elements ``0, strides[j], 2 * strides[j], ...`` in flat order: ``update`` (after -
    before, in the parameter's dtype), ``after``, and ``had_gradient`` (bool, or ``None``). ``kept``: the indices
    whose statistics are reported (one resized since the optimizer stepped is not). ``states``, ``groups``: each
    one's optimizer state and parameter group, or ``None``.
    """

    update: torch.Tensor
    after: torch.Tensor
    had_gradient: torch.Tensor | None
    lengths: list[int]
    strides: list[int]
    indices: list[int]
    kept: list[int] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)

    @classmethod
    def of_one(cls, update: torch.Tensor, applied: AppliedUpdate) -> PackedUpdates:
        """One parameter's whole update as a pack of one (what :meth:`UpdateStatistic.device` measures)."""
        mask = applied.had_gradient
        mask = mask.reshape(-1) if mask is not None and mask.shape == update.shape else None
        return cls(update.reshape(-1), applied.after.reshape(-1), mask, [update.numel()], [1], [0], [0],
                   [applied.state], [applied.group])

    def segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (one of the buffers, or one as long) cut into each parameter's elements: views, no op."""
        return list(flat.split(self.lengths))


class UpdateStatistic(LayerStatistic):
    """A statistic of target ``"parameter_update"``. :meth:`device_packed` gets the sampled updates of many
    parameters at once and gives each its numbers; ``needs_gradient_mask`` asks the step to keep which elements had a
    gradient. The ``numel`` its :meth:`host` gets is the number of elements its numbers were taken of (the
    parameter's, or its sample's)."""

    target = "parameter_update"
    needs_gradient_mask = False

    def on_by_default(self, model: Any, options: Any) -> bool:
        return False

    def device_packed(self, packed: PackedUpdates, options: Any) -> list[torch.Tensor | None]:
        """Each parameter's numbers (``None`` for one it does not measure), in the pack's order, as views of one
        small tensor. By default :meth:`device` per parameter, of its segment of the pack (a user's statistic)."""
        found: list[torch.Tensor | None] = []
        mask = packed.had_gradient
        for j, (update, after) in enumerate(zip(packed.segments(packed.update), packed.segments(packed.after))):
            applied = AppliedUpdate(after, None if mask is None else packed.segments(mask)[j],
                                    packed.states[j] if j < len(packed.states) else None,
                                    packed.groups[j] if j < len(packed.groups) else None)
            found.append(self.device(update, applied, options))
        return found

    def device(self, tensor: torch.Tensor, module: Any, options: Any) -> torch.Tensor | None:
        """One parameter's whole update ``tensor`` and its :class:`AppliedUpdate` (``module``): the numbers
        :meth:`device_packed` gives it in a pack of one."""
        if not isinstance(module, AppliedUpdate) or not tensor.is_floating_point() or tensor.numel() == 0:
            return None
        return self.device_packed(PackedUpdates.of_one(tensor, module), options)[0]


def _rows(stacked: torch.Tensor) -> list[torch.Tensor | None]:
    """The rows of a ``[parameters, numbers]`` tensor, views."""
    return list(stacked.unbind(0))


class UpdateRMS(UpdateStatistic):
    """``update_stats/rms@{param}``: the RMS of the update the optimizer step applied (of its sample)."""

    name, names = "update_rms", ("rms",)
    cost = "2 ops for all the parameters of a dtype (their norms, then a stack) after the sample's copies; no sync"

    def device_packed(self, packed: PackedUpdates, options: Any) -> list[torch.Tensor | None]:
        norms = torch._foreach_norm(packed.segments(packed.update), 2, dtype=torch.float32)
        return _rows(torch.stack(norms).reshape(-1, 1))

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return {"rms": numbers[0] / math.sqrt(numel)} if numel else {}


class UpdateLost(UpdateStatistic):
    """``update_stats/lost_fraction@{param}``: of the (sampled) elements with a gradient other than 0, the fraction
    the step left unchanged (their update was below half a float step of their value)."""

    name, names = "update_lost", ("lost_fraction",)
    cost = ("2 ops for all the parameters of a dtype when the optimizer steps (the gradients' sample, compared with 0; "
            "a byte per sampled element kept), 6 after; no sync")
    needs_gradient_mask = True

    def device_packed(self, packed: PackedUpdates, options: Any) -> list[torch.Tensor | None]:
        mask = packed.had_gradient
        if mask is None or mask.shape != packed.update.shape:
            return [None] * len(packed.lengths)
        lost = torch.logical_and(packed.update.eq(0), mask)
        flags = torch.cat([lost, mask]).float()  # each parameter's lost, then with-gradient, elements: one pass
        counts = torch.stack(torch._foreach_norm(list(flags.split(packed.lengths * 2)), 1))
        return _rows(counts.reshape(2, -1).t())

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        lost, with_gradient = numbers
        return {"lost_fraction": lost / with_gradient if with_gradient > 0 else math.nan}


class AdamEpsilon(UpdateStatistic):
    """``update_stats/epsilon_fraction@{param}``: the fraction of (sampled) elements where Adam's ε exceeds √v̂.

    Example:
        >>> state = {"exp_avg_sq": torch.tensor([1e-20, 1e-10, 1.0]), "step": torch.tensor(1.0)}
        >>> group = {"eps": 1e-8, "betas": (0.9, 0.999)}
        >>> numbers = AdamEpsilon().device(torch.zeros(3), AppliedUpdate(torch.zeros(3), None, state, group), None)
        >>> AdamEpsilon().host(numbers.tolist(), 3, torch.float32)  # √v̂ = 3.2e-9, 3.2e-4, 31.6
        {'epsilon_fraction': 0.3333333333333333}
    """

    name, names = "adam_epsilon", ("epsilon_fraction",)
    cost = ("5 ops for all the parameters that share a step count and ε (the sample of exp_avg_sq, one compare, "
            "the counts); no sync (a CPU step count is read through numpy); 4 more per parameter whose step count "
            "is on the device (fused, capturable)")

    def device_packed(self, packed: PackedUpdates, options: Any) -> list[torch.Tensor | None]:
        by_limit: dict[float, list[int]] = {}  # a CPU step count: the limit ε²·(1 - β₂ᵗ) as a number
        counts: dict[int, torch.Tensor] = {}
        seconds: dict[int, torch.Tensor] = {}
        for j, length in enumerate(packed.lengths):
            found = _second_moment(packed.states[j] if j < len(packed.states) else None,
                                   packed.groups[j] if j < len(packed.groups) else None)
            if found is None:
                continue
            second, limit = found
            if len(range(0, second.numel(), packed.strides[j])) != length:
                continue
            seconds[j] = flat_sample(second, packed.strides[j])
            if isinstance(limit, torch.Tensor):  # capturable, fused: no read on the host
                counts[j] = seconds[j].lt(limit.to(second.device, second.dtype)).sum(dtype=torch.float32)
            else:
                by_limit.setdefault(limit, []).append(j)
        for limit, positions in by_limit.items():
            below = torch.cat([seconds[j] for j in positions]).lt(limit).float()
            sums = torch._foreach_norm(list(below.split([packed.lengths[j] for j in positions])), 1)
            counts.update(zip(positions, sums))
        if not counts:
            return [None] * len(packed.lengths)
        rows = _rows(torch.stack([counts[j] for j in sorted(counts)]).reshape(-1, 1))
        found_rows: list[torch.Tensor | None] = [None] * len(packed.lengths)
        for j, row in zip(sorted(counts), rows):
            found_rows[j] = row
        return found_rows

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return {"epsilon_fraction": numbers[0] / numel} if numel else {}


def flat_sample(tensor: torch.Tensor, stride: int) -> torch.Tensor:
    """The elements ``0, stride, 2 * stride, ...`` of ``tensor`` in its flat row-major order: a view where it is
    contiguous, else of a flattened copy.

    Example:
        >>> flat_sample(torch.arange(12).reshape(3, 4), 5).tolist(), flat_sample(torch.arange(6).reshape(2, 3).t(), 2).tolist()
        ([0, 5, 10], [0, 1, 2])
    """
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
    return flat[::stride]


def _second_moment(state: Any, group: Any) -> tuple[torch.Tensor, float | torch.Tensor] | None:
    """An Adam-like parameter's second moment (``exp_avg_sq``, or ``max_exp_avg_sq`` under AMSGrad) and the limit
    ``ε²·(1 - β₂ᵗ)`` below which ε exceeds √v̂: a number for a step count on the CPU (read through numpy: no aten
    op), a tensor on the device for one there; ``None`` for another optimizer."""
    if not isinstance(state, dict) or not isinstance(group, dict):
        return None
    second = state.get("max_exp_avg_sq") if group.get("amsgrad") else None
    second = state.get("exp_avg_sq") if second is None else second
    step, eps, betas = state.get("step"), group.get("eps"), group.get("betas")
    if not isinstance(second, torch.Tensor) or step is None or not isinstance(eps, (int, float)):
        return None
    if not isinstance(betas, (tuple, list)) or len(betas) < 2:
        return None
    to_local = getattr(second, "to_local", None)
    second = (to_local() if callable(to_local) else second).detach()
    beta2 = float(betas[1])
    if isinstance(step, torch.Tensor) and step.device.type != "cpu":
        return second, (1 - torch.pow(beta2, step.to(torch.float64))) * (float(eps) ** 2)
    count = float(step.detach().numpy().reshape(-1)[0]) if isinstance(step, torch.Tensor) else float(step)
    return second, (1 - beta2 ** count) * float(eps) ** 2
