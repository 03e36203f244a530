"""``merge_ranks=True``: one step's summaries over every rank's data, merged before rank 0 writes.

Every rank reduces its own tensors; then four collectives per logging step, whatever the
number of tensors, give each summary over the union of all ranks' tensors:

1. a checksum of the step's tags, so that ranks that disagree (a layer skipped on one of
   them) merge nothing instead of mixing numbers or waiting on each other; reading it is
   this mode's one host sync per logging step;
2. a sum of the counts, sums and sums of squares;
3. a max of the maxima and of the negated minima;
4. a sum of the bucket counts, each rank counting its own sample between the merged min
   and max, so that all use the same edges.

Only what differs between ranks is merged: activations, output gradients, and parameters
sharded across ranks (FSDP2's DTensors), whose shards merge into the whole parameter's
summary with no all-gather. Replicated parameters (DDP) are the same on every rank, so
rank 0's are logged as they are.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .summaries import Reduction, wide_dtype

__all__ = ["is_sharded", "merge_across_ranks"]


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a DTensor split across ranks (FSDP2's parameters), whose local shard is only a part.

    Example:
        >>> is_sharded(torch.zeros(3))
        False
    """
    placements = getattr(tensor, "placements", None)
    return type(tensor).__name__ == "DTensor" and any(placement.is_shard() for placement in placements or ())


def merge_across_ranks(entries: Sequence[tuple[str, Reduction]], bins: int) -> bool:
    """Merge ``(tag, reduction)`` pairs across all ranks, in place, and return True. Every rank must call it.

    Raises:
        RuntimeError: The ranks disagree on the tags (a layer skipped on some); nothing is merged.
    """
    if not entries:
        return True
    device = _device_of(entries[0][1])
    wide = wide_dtype(device)
    signature = zlib.crc32("\n".join(tag for tag, _ in entries).encode()) - (1 << 31)
    check = torch.tensor([signature, -signature], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    if int(check[0]) != -int(check[1]):  # max == min: every rank sent the same checksum
        raise RuntimeError("the ranks disagree on this step's tags (a layer skipped on some), so it is not merged")
    reductions = [reduction for _, reduction in entries]
    rows = torch.stack([_sums_row(reduction, device, wide) for reduction in reductions])
    # rows: numel, nonzero, finite_nonzero, sum, sum of squares, min, max
    totals = rows[:, :5].contiguous()
    extremes = torch.stack([rows[:, 6], -rows[:, 5]], dim=1)
    own_finite = rows[:, 2] + rows[:, 0] - rows[:, 1]  # finite = finite non-zero + zeros
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    counts = _bucket_counts(reductions, -extremes[:, 1], extremes[:, 0], own_finite, bins, device, wide)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    for index, reduction in enumerate(reductions):
        reduction.form = "merged"
        reduction.header = [*totals[index].unbind(), -extremes[index, 1], extremes[index, 0]]
        reduction.counts = counts[index]
    return True


def _device_of(reduction: Reduction) -> torch.device:
    sample = reduction.sample
    return sample.device if isinstance(sample, torch.Tensor) else torch.device("cpu")


def _sums_row(reduction: Reduction, device: torch.device, wide: torch.dtype) -> torch.Tensor:
    """``[numel, nonzero, finite_nonzero, sum, sum_squares, min, max]`` of one reduction, on ``device``."""
    numel = float(reduction.numel)
    header = reduction.header
    if reduction.form == "numbers":  # the CPU shortcut's host numbers: finite, zeros maybe uncounted
        nonfinite, zeros, low, high, total, squares = header
        nonzero = numel - (zeros if zeros is not None else 0)
        values = [numel, nonzero, nonzero - nonfinite, total, squares, low, high]
        return torch.tensor([float(value) for value in values], dtype=wide, device=device)
    parts = torch.stack([value.to(device) for value in header]).to(wide)
    if reduction.form == "var_mean":  # variance, mean of z over numel elements
        total = parts[3] * numel
        squares = (parts[2] + parts[3] * parts[3]) * numel
        low, high = parts[4], parts[5]
    elif reduction.form == "sums":
        total, squares, low, high = parts[2], parts[3], parts[4], parts[5]
    else:  # "split_sums": sum = 2 * sum(relu) - sum(abs)
        total, squares, low, high = 2 * parts[2] - parts[3], parts[4], -parts[6], parts[5]
    return torch.stack([parts.new_tensor(numel), parts[0], parts[1], total, squares, low, high])


def _bucket_counts(
    reductions: Sequence[Reduction], lows: torch.Tensor, highs: torch.Tensor, finite: torch.Tensor, bins: int,
    device: torch.device, wide: torch.dtype,
) -> torch.Tensor:
    """Each reduction's sample counted between common edges, scaled to its finite count: ``(R, bins)``."""
    sizes = [int(reduction.sample.numel()) for reduction in reductions]
    samples = torch.cat([torch.as_tensor(reduction.sample).reshape(-1).to(device) for reduction in reductions])
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
