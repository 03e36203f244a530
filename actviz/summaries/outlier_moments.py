"""The outlier numbers of a tensor by eager torch ops: the eager body of the one-pass op's ``outliers=True`` fields.

:func:`outlier_moments` gives, of a 1-D floating tensor ``x`` (``z``: ``x`` with NaN and ±Inf replaced by 0,
``μ`` its mean): ``max |x|`` (NaN left out; ±Inf counts), the count of ``|x| >=`` :data:`OUTLIER_THRESHOLD`,
``Σ(z-μ)²`` and ``Σ(z-μ)⁴``, in float64 (float32 on MPS). A tensor over
:data:`~actviz.summaries.piecewise.PIECE` elements is read a piece at a time, so that its temporaries stay
about a piece's size. :class:`~actviz.statistics.outliers.Outliers` turns them into kurtosis, outlier
fraction and headroom.

Example:
    >>> outlier_moments(torch.tensor([1.0, -7.0, 2.0, 0.0])).tolist()  # μ = -1
    [7.0, 1.0, 50.0, 1394.0]
"""

from __future__ import annotations

import math

import torch

from .header import wide_dtype
from .piecewise import PIECE

__all__ = ["OUTLIER_THRESHOLD", "outlier_moments"]

#: ``|x|`` at or above this counts as an outlier (Dettmers et al. 2022, LLM.int8()).
OUTLIER_THRESHOLD = 6.0


@torch.no_grad()
def outlier_moments(values: torch.Tensor) -> torch.Tensor:
    """``[max|x|, count(|x| >= 6), Σ(z-μ)², Σ(z-μ)⁴]`` of a 1-D floating tensor, on its device, no host sync."""
    wide = wide_dtype(values.device)
    pieces = [_readable(piece) for piece in values.split(PIECE)]  # a vocabulary's logits: temporaries a piece's size
    mean = torch.stack([torch.nan_to_num(piece, 0.0, 0.0, 0.0).sum(dtype=wide) for piece in pieces]).sum() / values.numel()
    found = []
    for piece in pieces:
        magnitude = piece.abs()
        centred = torch.nan_to_num(piece, 0.0, 0.0, 0.0) - mean.to(piece.dtype)
        # Σ(z-μ)² and Σ((z-μ)²)² in one op: a 4th power in float64 is slow on a CPU.
        squares, fourths = torch._foreach_powsum([centred, centred.square()], 2, dtype=wide)
        found.append(torch.stack([torch.nan_to_num(magnitude, 0.0, math.inf).amax().to(wide),
                                  (magnitude >= OUTLIER_THRESHOLD).sum().to(wide), squares, fourths]))
    parts = torch.stack(found)
    return torch.cat([parts[:, 0].amax().view(1), parts[:, 1:].sum(0)])


def _readable(piece: torch.Tensor) -> torch.Tensor:
    """16-bit and float8 pieces in float32: moments in float32 at least (and float8 has no ``nan_to_num``)."""
    return piece.float() if piece.dtype not in (torch.float32, torch.float64) else piece
