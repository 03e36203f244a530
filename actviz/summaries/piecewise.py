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

    Nine kernels a piece and fifteen to merge, none of which waits for the device: the pieces' sizes stay
    Python numbers, never copied from the host (on a GPU such a copy is a sync, once per tensor).
    """
    moments: list[torch.Tensor] = []  # per piece: non-zeros, finite non-zeros, variance, mean (float64)
    bounds: list[torch.Tensor] = []  # per piece: finite min, finite max (the tensor's dtype)
    pieces = values.split(PIECE)
    for piece in pieces:
        bounds += finite_bounds(piece)  # exact in any dtype, and its scratch is the piece's size, not widened
        zeroed = piece.to(wide, copy=True)  # float64 moments per piece: merging float32 ones would lose digits
        moments += torch._foreach_norm([zeroed], 0)  # non-zeros, NaN and ±Inf included: exact in float64
        zeroed.nan_to_num_(0.0, 0.0, 0.0)
        moments += torch._foreach_norm([zeroed], 0)
        moments += torch.var_mean(zeroed, correction=0)
        del zeroed
    numel, last = values.numel(), len(pieces) - 1  # every piece holds PIECE elements but the last
    share, last_share = PIECE / numel, (numel - PIECE * last) / numel - PIECE / numel
    table = torch.stack(moments).view(-1, 4)
    counts, variances, means = table[:, :2].sum(0), table[:, 2], table[:, 3]
    mean = torch.add(means.sum().mul_(share), means[last], alpha=last_share)  # weighted by the pieces' sizes
    spread = (means - mean).square_().add_(variances)  # each piece's variance about the whole tensor's mean
    variance = torch.add(spread.sum().mul_(share), spread[last], alpha=last_share)
    lows_and_highs = torch.cat(bounds)
    parts = [counts, mean.view(1), variance.view(1), lows_and_highs[0::2].amin(0, True), lows_and_highs[1::2].amax(0, True)]
    row = torch.cat([*parts, values[::stride]])  # in ``wide``: cat promotes the bounds and the sample to it
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
