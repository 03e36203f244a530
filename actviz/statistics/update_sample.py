"""The elements of each parameter that the update statistics compare across an optimizer step: a fixed strided sample.

A parameter of ``n`` elements is read at the elements ``0, s, 2s, ...`` of its flat (row-major) order, with
``s = sample_stride(shape)``: every element (``s = 1``) where ``n <= UPDATE_SAMPLE_SIZE``, else at most
``UPDATE_SAMPLE_SIZE`` of them, ``s`` being the smallest stride of at least ``n / UPDATE_SAMPLE_SIZE`` that shares
no factor with the product of the trailing dimensions, so that the sample visits every position of a kernel, a
row or a column (a stride of 9 would read one tap of every 3x3 kernel). The same elements are read of the
parameter when the optimizer is about to step, of its gradient then, of the parameter after the step and of the
optimizer's state: every update statistic of a parameter with more than ``UPDATE_SAMPLE_SIZE`` elements is an
estimate from that sample, and of a smaller one exact.

The samples of all the parameters of one device and dtype are packed into one buffer by one ``torch.cat`` of
their strided views: the copy before the step is one op for all of them, the gradient mask two, the copy after
and the difference two, whatever the number of parameters. A parameter not contiguous in memory
(``channels_last``) is flattened by ``reshape``, which copies it: one op more of its own.

Example:
    >>> sample_stride((512, 512, 3, 3)), sample_stride((64,))  # 2,359,296 elements: 16,270 of them read
    (145, 1)
    >>> weight, grad = torch.ones(4, 3), torch.tensor([[0.0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    >>> taken = UpdateSample([weight], [grad], with_mask=True)
    >>> (packed,) = taken.updates([weight + 0.5])
    >>> packed.update.tolist()[:3], packed.had_gradient.tolist()[:3], packed.lengths
    ([0.5, 0.5, 0.5], [False, True, True], [12])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .updates import PackedUpdates, flat_sample

__all__ = ["UPDATE_SAMPLE_SIZE", "UpdateSample", "flat_sample", "optimizer_entries", "sample_stride"]

#: The most elements of one parameter that the update statistics read (a parameter with at most this many is read
#: whole): the strided sample's size. As many as the histograms sample of a tensor.
UPDATE_SAMPLE_SIZE = 16384


def sample_stride(shape: Sequence[int], size: int = UPDATE_SAMPLE_SIZE) -> int:
    """The stride of a parameter's sample (module docstring): 1 for at most ``size`` elements, else the smallest
    stride of at least ``numel / size`` that shares no factor with the product of ``shape[1:]``.

    Example:
        >>> sample_stride((1000, 2048)), sample_stride((10, 10), size=30)
        (125, 7)
    """
    numel = math.prod(shape)
    if numel <= size:
        return 1
    stride, inner = -(-numel // size), math.prod(shape[1:])
    while math.gcd(stride, inner) != 1:
        stride += 1
    return stride


def optimizer_entries(optimizer: Any, params: Sequence[torch.Tensor]) -> tuple[list[Any], list[Any]]:
    """Each of ``params``' state and parameter group in ``optimizer`` (``None`` where it holds none, or for no
    optimizer): what :meth:`UpdateSample.updates` gives the statistics.

    Example:
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> optimizer_entries(torch.optim.SGD([weight], lr=0.1), [weight, torch.ones(1)])[1][1] is None
        True
    """
    groups: dict[int, Any] = {}
    state: Any = getattr(optimizer, "state", {}) if optimizer is not None else {}
    for group in getattr(optimizer, "param_groups", ()) if optimizer is not None else ():
        for param in group.get("params", ()) if isinstance(group, dict) else ():
            groups[id(param)] = group
    return ([state.get(param) if id(param) in groups else None for param in params],
            [groups.get(id(param)) for param in params])


class UpdateSample:
    """The samples of a step's trainable parameters, taken when the optimizer is about to step, and, with
    ``with_mask``, which of their elements had a gradient other than 0 (``update_lost``); :meth:`updates` compares
    them with the parameters after the step.

    Args:
        params: The parameters (their local shards) as they are before the step.
        grads: Their gradients as the optimizer is about to apply them (``None`` for one without).
        with_mask: Whether to keep which sampled elements had a gradient other than 0.
    """

    def __init__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], with_mask: bool) -> None:
        self.strides = [sample_stride(param.shape) for param in params]
        self.layouts = [(param.shape, param.device, param.dtype) for param in params]
        self.lengths = [len(range(0, param.numel(), stride)) for param, stride in zip(params, self.strides)]
        self.groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, param in enumerate(params):
            self.groups.setdefault((param.device, param.dtype), []).append(index)
        self.before = {key: torch.cat([flat_sample(params[i], self.strides[i]) for i in indices])
                       for key, indices in self.groups.items()}
        self.masks: dict[Any, torch.Tensor] = {}
        if with_mask:
            for key, indices in self.groups.items():
                parts = [torch.zeros(self.lengths[i], dtype=torch.bool, device=key[0]) if grads[i] is None
                         else flat_sample(grads[i], self.strides[i]) for i in indices]
                self.masks[key] = torch.cat(parts).ne(0)

    def updates(self, params: Sequence[torch.Tensor], states: Sequence[Any] = (),
                groups: Sequence[Any] = ()) -> list[PackedUpdates]:
        """The update of each device and dtype's parameters (``params`` as they are now, in the order given at
        construction; ``states``, ``groups``: their optimizer state and group, or ``None``), packed. A parameter
        resized, moved or cast since is left out (:attr:`PackedUpdates.indices` are those kept)."""
        found = []
        for key, indices in self.groups.items():
            before, parts, kept, offset = self.before[key], [], [], 0
            for index in indices:
                length = self.lengths[index]
                now = params[index]
                if (now.shape, now.device, now.dtype) == self.layouts[index]:
                    parts.append(flat_sample(now, self.strides[index]))
                    kept.append(index)
                else:  # its own values before: an update of 0, not reported
                    parts.append(before[offset:offset + length])
                offset += length
            if not kept:
                continue
            after = torch.cat(parts)
            found.append(PackedUpdates(
                update=torch.sub(after, before), after=after, had_gradient=self.masks.get(key),
                lengths=[self.lengths[i] for i in indices], strides=[self.strides[i] for i in indices],
                indices=list(indices), kept=kept,
                states=[states[i] if i < len(states) else None for i in indices],
                groups=[groups[i] if i < len(groups) else None for i in indices]))
        return found
