"""The gradient norms of sharded parameters (FSDP2) summed over the ranks, at logging steps only.

Under FSDP2 (``fully_shard``) each rank holds one shard of each parameter's gradient (a DTensor), and
:class:`~actviz.diagnosis.step_norms.StepNorms` reads the norms of this rank's shards into its ring, with
no collective. A parameter's whole norm is the square root of the sum, over the ranks, of its shards'
squared norms: what ``clip_grad_norm_`` computes on DTensor gradients. :class:`RankSums` keeps:

* per optimizer step, this rank's part of the two global squared norms (before and after clipping): the
  ring row squared, weighted by :func:`~actviz.summaries.merge_ranks.counted_share` (each element counted
  once: a replica along HSDP's replicate dimension, or a plain replicated parameter, counts on one rank)
  and summed over the parameters, into a buffer of the last :data:`STEPS` steps (2 ops, no collective);
* at the first optimizer step of each logging step, on every rank (the schedule is the same on every
  rank, so all of them take it): one ``all_reduce`` of those steps' squares and of the ring rows written
  since the last sum (:func:`~actviz.summaries.merge_ranks.sum_over_ranks`), and their square roots. The
  ring rows then hold every parameter's whole norm (``gradient_clipping/*``, a spike's per-layer norms),
  and the steps' global norms go to the host for the spike check.

On a GPU the ``all_reduce`` is ordered on the device's stream (NCCL): the host does not wait for it.

Every rank must call ``watch()`` for the sums: the Lightning and Hugging Face callbacks watch on rank 0 alone.
So each rank's :class:`RankSums` counts itself in the process group's key-value store when it is made, and at
the first sum rank 0 reads the count and tells the others (through the store, no collective) whether all of
them are there. If not, nothing is summed and nobody waits: the rows stay this rank's shards (no
``gradient_clipping/*``; the spike check reads rank 0's shards, in which a spike shows too), said once. The
ranks tell their watchers apart by the parameters' shapes and, for the same shapes, by the order they were
made in: a model watched on rank 0 alone, then one of the same shapes on every rank, in one process group,
sums nothing (rank 1's first such watcher answers to rank 0's second).

Example:
    >>> ring = torch.tensor([[[3.0, 4.0], [0.6, 0.8]]])  # one step: norms before, after clipping
    >>> sums = RankSums([torch.zeros(2), torch.zeros(1)], ring_size=1)
    >>> sums.add(ring[0], 0, 7)
    >>> steps, norms = sums.sum(ring, 0)  # one process: its own shards are the whole
    >>> steps, norms.tolist(), sums.summed
    ([7], [[5.0, 1.0]], [True])
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..common._internals import default_store
from ..common.safe_warnings import warn_safely
from ..summaries.merge_ranks import counted_share, sum_over_ranks

__all__ = ["STEPS", "RankSums"]

#: Optimizer steps whose global norms before and after clipping wait for the next logging step's sum: the
#: spike check judges the last STEPS steps before each logging step (every step with ``every=100``).
STEPS = 128

_MADE: Counter[int] = Counter()  # RankSums made in this process, by the parameters' shapes: alike on every rank


class RankSums:
    """This rank's parts of the gradient norms of sharded parameters, summed over the ranks at logging steps.

    Args:
        params: The parameters whose gradient norms the ring holds, in its order.
        ring_size: The ring's rows (:data:`~actviz.diagnosis.step_norms.RING`).

    Attributes:
        summed: Per ring slot, whether it holds sums over the ranks (else this rank's shards alone).
        due: A logging step started: the next step recorded is summed.
        agreed: Whether every rank sums (known at the first sum: ``None`` before).
        provisional: A sum was made for a step recorded as an update by hand before any optimizer step (the first
            micro-batch of gradient accumulation): the first optimizer step sums again.
    """

    def __init__(self, params: Sequence[torch.Tensor], ring_size: int) -> None:
        self._shares = [counted_share(param) for param in params]
        self._ring_size = ring_size
        self.summed = [False] * ring_size
        self.due = False
        self.provisional = False
        self._weights: torch.Tensor | None = None  # the shares on the ring's device, made once
        self._squares: torch.Tensor | None = None  # (STEPS, 2): this rank's part of each step's squared global norms
        self._steps = [-1] * STEPS  # the step of each row of _squares
        self._count = 0  # steps added since the last sum
        self._rows = 0  # ring rows written since the last sum
        self._world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.agreed: bool | None = True if self._world == 1 else None
        shapes = zlib.crc32(";".join(str(tuple(param.shape)) for param in params).encode())  # global shapes
        self._key = f"actviz/rank_sums/{shapes}/{_MADE[shapes]}"
        _MADE[shapes] += 1
        self._store = default_store() if self._world > 1 else None
        if self._store is not None:
            self._store.add(self._key, 1)  # this rank is here

    def add(self, row: torch.Tensor, slot: int, step: int) -> None:
        """Step ``step``'s ring ``row`` (the ring's ``slot``) is written: keep its part of the global squared norms
        (2 ops)."""
        if self._weights is None or self._squares is None:
            pinned = row.device.type == "cuda"  # once, and no wait: from pinned memory
            self._weights = torch.tensor(self._shares, dtype=row.dtype, pin_memory=pinned).to(row.device, non_blocking=True)
            self._squares = torch.zeros(STEPS, 2, dtype=row.dtype, device=row.device)
        index = self._count % STEPS
        torch.mv(row.square(), self._weights, out=self._squares[index])
        self._steps[index] = step
        self._count += 1
        self._rows += 1
        self.summed[slot] = False

    def sum(self, ring: torch.Tensor, last_slot: int) -> tuple[list[int], torch.Tensor]:
        """Sum over the ranks (one ``all_reduce``; every rank must call it at the same step) the steps added and
        the ring rows written (the last ending at ``last_slot``) since the last sum: the rows become whole norms,
        in place. Returns those steps and their global norms ``(steps, 2)`` (before, after clipping), in the
        buffer's order (it wraps after :data:`STEPS` steps: sort on the host)."""
        assert self._weights is not None and self._squares is not None, "add() comes first"
        if self.agreed is None:
            self.agreed = self._agree()
        rows, used = min(self._rows, self._ring_size), min(self._count, STEPS)
        first = (last_slot - rows + 1) % self._ring_size
        spans = ([(first, first + rows)] if first + rows <= self._ring_size
                 else [(first, self._ring_size), (0, first + rows - self._ring_size)])
        parts = [ring[start:stop] for start, stop in spans]
        flat = torch.cat([*(part.square().mul_(self._weights).reshape(-1) for part in parts),
                          self._squares[:used].reshape(-1)])
        if self.agreed:
            sum_over_ranks(flat)
        flat.sqrt_()
        offset = 0
        for part in parts:
            part.copy_(flat[offset:offset + part.numel()].view_as(part))
            offset += part.numel()
        for start, stop in spans:
            self.summed[start:stop] = [bool(self.agreed)] * (stop - start)
        self._count = self._rows = 0
        self.due = False
        return self._steps[:used], flat[offset:].view(used, 2)

    def _agree(self) -> bool:
        """Whether every rank made its RankSums: rank 0 reads the count and tells the others through the store."""
        store, answer = self._store, f"{self._key}/agreed"
        if store is not None and dist.get_rank() != 0:
            return store.get(answer) == b"1"  # rank 0 answers at this same logging step
        agreed = store is not None and store.add(self._key, 0) == self._world
        if store is not None:
            store.set(answer, "1" if agreed else "0")
        if not agreed and dist.get_rank() == 0:
            warn_safely("actviz sums the gradient norms of sharded parameters (FSDP2) over the ranks only when every rank "
                        "calls watch(): gradient_clipping/* is not written, and the spike check reads this rank's shards",
                        RuntimeWarning)
        return agreed
