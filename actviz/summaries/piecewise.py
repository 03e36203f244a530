"""Reductions a slice at a time, so that a widened copy never adds a tensor's whole size to memory.

* :func:`reduce_in_pieces`: a floating tensor over :data:`PIECE` elements (a language model's logits, a
  large batch's activations): each piece is bounded (min and max of its finite elements; ``+inf``/``-inf``
  where it has none), copied in float64, counted and ``var_mean``-ed; the pieces' moments are
  merged on the device (Chan et al.'s parallel variance), no host sync.
* :func:`reduce_integers`: integers and bools, counted and bounded as they are, summed a slice
  of half their bytes at a time in float64.

Both write the header row of :mod:`actviz.summaries.header` and the strided sample behind it.

Example:
    >>> from actviz.summaries.one_tensor import finish
    >>> summary = finish(reduce_integers(torch.tensor([0, 3, 5], dtype=torch.uint8), 1, torch.float64))
    >>> summary.num, summary.zeros, summary.min, summary.max, summary.sum
    (3, 1, 0.0, 5.0, 8.0)
"""

from __future__ import annotations


import torch

from .header import HEADER, Reduction, finite_bounds

__all__ = ["PIECE", "reduce_in_pieces", "reduce_integers"]

#: Floating tensors larger than this are reduced this many elements at a time (16 MB of float32).
PIECE = 1 << 22


def reduce_in_pieces(values: torch.Tensor, stride: int, wide: torch.dtype) -> Reduction:
    """A large floating tensor, a piece at a time (counts, ``var_mean`` and bounds), merged as Chan et al. do.

    Nine kernels a piece and none that waits for the device: the pieces' sizes stay Python numbers, so
    nothing is copied from the host to weigh them (on a GPU such a copy is a sync, once per tensor).
    """
    found: list[list[torch.Tensor]] = [[], [], [], [], [], []]
    pieces = values.split(PIECE)
    for piece in pieces:
        low, high = finite_bounds(piece)  # exact in any dtype, and its scratch is the piece's size, not widened
        found[4].append(low)
        found[5].append(high)
        zeroed = piece.to(wide, copy=True)  # float64 moments per piece: merging float32 ones would lose digits
        found[0].extend(torch._foreach_norm([zeroed], 0))  # non-zeros, NaN and ±Inf included: exact in float64
        zeroed.nan_to_num_(0.0, 0.0, 0.0)
        found[1].extend(torch._foreach_norm([zeroed], 0))
        for at, result in enumerate(torch.var_mean(zeroed, correction=0), 2):
            found[at].append(result)
        del zeroed
    numel, last = values.numel(), len(pieces) - 1  # every piece holds PIECE elements but the last
    last_size = numel - PIECE * last
    variances, means = torch.stack(found[2]), torch.stack(found[3])
    mean = (means[:last].sum() * PIECE + means[last] * last_size) / numel
    spread = (means - mean).square_().add_(variances)  # each piece's variance about the whole tensor's mean
    variance = (spread[:last].sum() * PIECE + spread[last] * last_size) / numel
    parts = [torch.stack(found[0]).sum(), torch.stack(found[1]).sum(), mean, variance]
    parts += [torch.stack(found[4]).amin().to(wide), torch.stack(found[5]).amax().to(wide)]
    row = torch.cat([part.view(1) for part in parts] + [values[::stride].to(wide)])
    return Reduction(numel, stride, row, 0, row, HEADER, row.numel())


def reduce_integers(values: torch.Tensor, stride: int, wide: torch.dtype) -> Reduction:
    """Integers and bools: counted and bounded as they are, summed a slice at a time in ``wide``."""
    if values.dtype == torch.bool:
        values = values.view(torch.uint8)
    numel = values.numel()
    nonzero = torch.count_nonzero(values)
    low, high = torch.aminmax(values)
    piece = max(1, (numel * values.element_size()) // (2 * torch.finfo(wide).bits // 8)) if numel > 4096 else numel
    total = squares = None
    for chunk in values.split(piece):
        widened = chunk.to(wide)
        chunk_sum, chunk_squares = widened.sum(), torch.dot(widened, widened)
        total = chunk_sum if total is None else total + chunk_sum
        squares = chunk_squares if squares is None else squares + chunk_squares
        del widened  # before the next slice is widened: one at a time
    mean = total / numel
    variance = (squares / numel - mean * mean).clamp_min(0)
    counts = nonzero.to(wide).view(1)
    row = torch.cat([counts, counts, mean.view(1), variance.view(1), low.view(1), high.view(1), values[::stride]])
    return Reduction(numel, stride, row, 0, row, HEADER, row.numel())
