"""``merge_ranks=True``: one step's summaries over every rank's data, merged before rank 0 writes.

Every rank reduces its own tensors; then five collectives per logging step, whatever the
number of tensors, give each summary over the union of all ranks' tensors:

1. a checksum of the step's tags, so that ranks that disagree (a layer skipped on one of
   them) merge nothing instead of mixing numbers or waiting on each other, read with the
   summed element counts in this mode's one host sync per logging step;
2. a sum of the counts, sums and sums of squares;
3. a max of the maxima and of the negated minima;
4. a sum of the bucket counts, each rank counting its own sample between the merged min
   and max, so that all use the same edges.

Only what differs between ranks is merged: activations, output gradients, and parameters
sharded across ranks (FSDP2's DTensors), whose shards merge into the whole parameter's
summary with no all-gather. Replicated parameters (DDP) are the same on every rank, so
rank 0's are logged as they are.

The gradient norms of sharded parameters (:mod:`actviz.diagnosis.rank_sums`) are summed over the ranks
with :func:`sum_over_ranks`, each rank's squares weighted by :func:`counted_share`, whether or not
``merge_ranks`` is on.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..common.distributed_types import is_dtensor
from .header import Reduction
from .one_tensor import wide_dtype

__all__ = ["counted_share", "is_sharded", "merge_across_ranks", "sum_over_ranks"]


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a DTensor split across ranks (FSDP2's parameters), whose local shard is only a part.

    Example:
        >>> is_sharded(torch.zeros(3))
        False
    """
    placements = getattr(tensor, "placements", None)
    return is_dtensor(tensor) and any(placement.is_shard() for placement in placements or ())


def counted_share(tensor: torch.Tensor) -> float:
    """The weight of this rank's copy of ``tensor`` in a sum over all ranks that counts each element once.

    A shard is held by this rank alone along the mesh dimensions it is split on (weight 1); along the others
    (HSDP's replicas) only the mesh coordinate 0 counts. A plain tensor (replicated, as DDP keeps it) counts
    on rank 0 alone. A mesh smaller than the world counts once per mesh: its share of the world.

    Example:
        >>> counted_share(torch.zeros(3))  # one process: its own copy
        1.0
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not is_dtensor(tensor):
        return 1.0 if world == 1 or dist.get_rank() == 0 else 0.0
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # not in the mesh: holds none of it
        return 0.0
    if any(index != 0 for index, placement in zip(coordinate, tensor.placements) if not placement.is_shard()):  # type: ignore[attr-defined]
        return 0.0
    return mesh.size() / world


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, and return it. Every rank must call it, at the same point.

    One ``all_reduce``, ordered on the device's stream: on a GPU (NCCL) the host does not wait for it.

    Example:
        >>> sum_over_ranks(torch.ones(2))  # one process: as it is
        tensor([1., 1.])
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def merge_across_ranks(entries: Sequence[tuple[str, Reduction]], bins: int) -> bool:
    """Merge ``(tag, reduction)`` pairs across all ranks, in place, and return True. Every rank must call it.

    Raises:
        RuntimeError: The ranks disagree on the tags (a layer skipped on some); nothing is merged.
    """
    if not entries:
        return True
    reductions = [reduction for _, reduction in entries]
    device = _device_of(reductions[0])
    wide = wide_dtype(device)
    signature = zlib.crc32("\n".join(tag for tag, _ in entries).encode()) - (1 << 31)
    check = torch.tensor([signature, -signature], dtype=torch.int64, device=device)
    local = [reduction.numel for reduction in reductions]
    numels = torch.tensor(local, dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    dist.all_reduce(numels, op=dist.ReduceOp.SUM)
    read = torch.cat([check, numels]).tolist()  # this mode's one host sync
    if read[0] != -read[1]:  # max == min: every rank sent the same checksum
        raise RuntimeError("the ranks disagree on this step's tags (a layer skipped on some), so it is not merged")
    merged = read[2:]
    rows = torch.stack([_row(reduction, device, wide) for reduction in reductions])  # FIELDS, one row each
    own = torch.tensor(local, dtype=wide, device=device)
    mean, variance = rows[:, 2], rows[:, 3]
    totals = torch.stack([rows[:, 0], rows[:, 1], mean * own, (variance + mean * mean) * own], dim=1)
    extremes = torch.stack([rows[:, 5], -rows[:, 4]], dim=1)
    own_finite = own - (rows[:, 0] - rows[:, 1]).nan_to_num(0.0)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    counts = _bucket_counts(reductions, -extremes[:, 1], extremes[:, 0], own_finite, bins, device, wide)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    everyone = torch.tensor(merged, dtype=wide, device=device)
    merged_mean = totals[:, 2] / everyone
    header = torch.stack([
        totals[:, 0], totals[:, 1], merged_mean, (totals[:, 3] / everyone - merged_mean * merged_mean).clamp_min(0),
        -extremes[:, 1], extremes[:, 0],
    ], dim=1)
    for index, reduction in enumerate(reductions):
        reduction.numel, reduction.header, reduction.index, reduction.counts = merged[index], header, index, counts
    return True


def _device_of(reduction: Reduction) -> torch.device:
    sample = reduction.sample
    return sample.device if isinstance(sample, torch.Tensor) else torch.device("cpu")


def _row(reduction: Reduction, device: torch.device, wide: torch.dtype) -> torch.Tensor:
    """One reduction's header row (:data:`~actviz.summaries.header.FIELDS`) on ``device``."""
    header = reduction.header
    if not isinstance(header, torch.Tensor):  # the CPU shortcut's host numbers
        return torch.tensor([float(value) for value in header], dtype=wide, device=device)
    return reduction.row_tensor().to(device=device, dtype=wide)


def _bucket_counts(
    reductions: Sequence[Reduction], lows: torch.Tensor, highs: torch.Tensor, finite: torch.Tensor, bins: int,
    device: torch.device, wide: torch.dtype,
) -> torch.Tensor:
    """Each reduction's sample counted between common edges, scaled to its finite count: ``(R, bins)``."""
    sizes = [reduction.stop - reduction.start for reduction in reductions]
    samples = torch.cat([reduction.sample_values().to(device) for reduction in reductions])
    samples = samples.to(wide)
    count = len(reductions)
    segment = torch.repeat_interleave(
        torch.arange(count, device=device), torch.tensor(sizes, device=device), output_size=sum(sizes)
    )
    weight = torch.isfinite(samples).to(wide)
    spans = highs - lows
    widths = torch.where(spans > 0, spans / bins, torch.ones_like(spans))
    position = torch.nan_to_num((samples - lows[segment]) / widths[segment], nan=0.0, posinf=0.0, neginf=0.0)
    index = segment * bins + position.floor().clamp(0, bins - 1).long()
    counts = torch.zeros(count * bins, dtype=wide, device=device).index_add_(0, index, weight).view(count, bins)
    sampled = torch.zeros(count, dtype=wide, device=device).index_add_(0, segment, weight)
    return counts * (finite / sampled.clamp(min=1)).unsqueeze(1)
