"""Reductions a slice at a time, so that a copy never adds a tensor's whole size to memory.

* :func:`reduce_in_pieces`: a floating tensor over :data:`PIECE` elements (a language model's logits, a
  large batch's activations), a piece of at most :data:`PIECE_BYTES` at a time: each piece is copied
  into one scratch buffer in its own dtype (as ``z``, then filled for its bounds) and summed there
  in float64 without a widened copy; the pieces' numbers are added up into the header row on the device
  (:func:`merge_pieces`), no host sync. It is the one-pass op's eager body for such a tensor.
* :func:`reduce_integers`: integers and bools, counted and bounded as they are, summed a slice
  of half their bytes at a time in float64.

Both give a header row (:mod:`actviz.summaries.header`); :func:`reduce_integers` leaves the strided sample behind it.

Example:
    >>> from actviz.summaries.one_tensor import finish
    >>> summary = finish(reduce_integers(torch.tensor([0, 3, 5], dtype=torch.uint8), 1, torch.float64))
    >>> summary.num, summary.zeros, summary.min, summary.max, summary.sum
    (3, 1, 0.0, 5.0, 8.0)
"""

from __future__ import annotations

import math

import torch

from .header import HEADER, Reduction

__all__ = ["PIECE", "PIECE_FIELDS", "merge_pieces", "reduce_in_pieces", "reduce_integers"]

#: Floating tensors larger than this are reduced a piece at a time (the eager path's float64 copy of a
#: 16-bit tensor stays under 32 MB).
PIECE = 1 << 22
#: Most bytes of one piece, in the tensor's own dtype: the size of the one scratch buffer that every piece reuses.
PIECE_BYTES = 32 << 20

#: A tensor reduced in pieces (:func:`~actviz.summaries.piecewise.reduce_in_pieces`) leaves a shift and then these
#: numbers of each piece, about ``z - shift`` (in float64: counts, sum, 2-norm; bounds of the finite values), added up by
#: :func:`merge_pieces`.
PIECE_FIELDS = ("nonzero", "finite_nonzero", "sum", "norm", "min", "max")


def reduce_in_pieces(values: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """The header row of a large floating 1-D tensor, :data:`PIECE_BYTES` at a time: eight kernels a piece (nine in
    float32 and float64), a few for the tensor, and no host sync.

    Each piece is copied into one scratch buffer of its own dtype as ``z`` (NaN and ±Inf replaced by 0): its
    non-zeros are counted, and its sum and sum of squares accumulated in ``wide`` (float64) by the reductions
    themselves, with no widened copy. A float32 or float64 piece is first shifted by ``z``'s first element,
    so that a large offset cancels nothing (``z - first`` is exact near ``first``; values beyond ±1.7e38 of
    both signs overflow it, as the eager path's float32 squares do from 1.8e19); a 16-bit one is summed
    as it is, since float64 sums of its 8- or 11-bit values cancel nothing it can hold. The buffer is then
    filled with ``+inf`` and ``-inf`` where not finite, for exact bounds in the tensor's dtype. The pieces'
    sums (:data:`PIECE_FIELDS`) are added up into the row by :func:`merge_pieces`, on the device.

    Example:
        >>> reduce_in_pieces(torch.tensor([1.0, 3.0, float("nan"), 3.0]), torch.float64).tolist()
        [4.0, 3.0, 1.75, 1.6875, 1.0, 3.0]
    """
    numel = values.numel()
    piece_size = max(1, PIECE_BYTES // values.element_size())
    scratch = torch.empty(min(piece_size, numel), dtype=values.dtype, device=values.device)
    if values.dtype in (torch.float32, torch.float64):
        shift: torch.Tensor | None = torch.nan_to_num(values[:1], 0.0, 0.0, 0.0)  # z's first element
        partials = [shift.view(())]
    else:
        shift, partials = None, [torch.zeros((), dtype=wide, device=values.device)]
    for piece in values.split(piece_size):
        buffer = scratch[: piece.numel()]
        torch.nan_to_num(piece, 0.0, 0.0, 0.0, out=buffer)
        partials += torch._foreach_norm([piece, buffer], 0, dtype=wide)  # NaN and ±Inf are non-zero in piece only
        if shift is not None:
            buffer.sub_(shift)
        partials += [buffer.sum(dtype=wide), torch.linalg.vector_norm(buffer, dtype=wide)]  # squared in merge_pieces
        torch.nan_to_num(piece, math.inf, math.inf, math.inf, out=buffer)
        partials.append(buffer.amin())
        torch.nan_to_num(piece, -math.inf, -math.inf, -math.inf, out=buffer)
        partials.append(buffer.amax())
    del scratch, buffer  # free again before the row is made
    return merge_pieces(torch.stack(partials).to(wide), numel)  # stack promotes the bounds to ``wide``


def merge_pieces(partials: torch.Tensor, numel: int) -> torch.Tensor:
    """The header row of a tensor of ``numel`` elements reduced in pieces, from ``partials``: its shift, then each
    piece's :data:`PIECE_FIELDS`. Moments about the shift, so that a large offset cancels nothing.

    Example:
        >>> # [1, 2] and [NaN, 1], shifted by 1: z - 1 is [0, 1] and [-1, 0]
        >>> pieces = [[2, 2, 1.0, 1.0, 1.0, 2.0], [2, 1, -1.0, 1.0, 1.0, 1.0]]
        >>> merge_pieces(torch.tensor([1.0] + pieces[0] + pieces[1], dtype=torch.float64), 4).tolist()
        [4.0, 3.0, 1.0, 0.5, 1.0, 2.0]
    """
    shift, table = partials[0], partials[1:].view(-1, len(PIECE_FIELDS))
    nonzero, finite_nonzero, total = table[:, :3].sum(0)
    squares = torch.dot(table[:, 3], table[:, 3])  # the norms squared, added
    offset = total / numel
    variance = (squares / numel - offset * offset).clamp_min(0)
    return torch.stack([nonzero, finite_nonzero, shift + offset, variance, table[:, 4].amin(), table[:, 5].amax()])


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
