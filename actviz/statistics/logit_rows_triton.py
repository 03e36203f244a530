"""The logit statistics' rows as one Triton kernel: each row of a model's logits read once, with an online softmax.

:func:`logit_rows` gives, for each row of ``(n, classes)`` logits, ``[max, log Z, Σ p log p]`` (``Z = Σ exp x``,
``p = exp x / Z``), from one program per row that reads it :data:`BLOCK` classes at a time and keeps a running
maximum ``m``, ``Σ exp(x - m)`` and ``Σ exp(x - m)·(x - m)``, rescaled whenever ``m`` grows (the online softmax of
Milakov and Gimelshein, 2018). ``-inf`` logits (masked classes) add nothing. One launch, no host sync. Triton
compiles it for CUDA; with ``TRITON_INTERPRET=1`` set before this module is imported it runs on CPU tensors,
which is how the test suite checks it.

Example:
    >>> BLOCK  # classes a program reads per turn
    1024
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "logit_rows"]

#: Classes one program reads per loop turn.
BLOCK = 1024


@triton.jit
def _row_kernel(logits, out, rows, classes, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = logits + row * row_stride
    # Per lane: its running max m, Σ exp(x - m) and Σ exp(x - m)·(x - m), all about m so that nothing cancels.
    running_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    weighted = tl.zeros((BLOCK,), tl.float32)
    for first in range(0, classes, BLOCK):
        columns = first + tl.arange(0, BLOCK)
        x = tl.load(start + columns, mask=columns < classes, other=float("-inf")).to(tl.float32)
        grown = tl.maximum(running_max, x)
        reference = tl.where(grown == float("-inf"), 0.0, grown)  # a lane that saw only -inf: no -inf - -inf
        scale = tl.exp(running_max - reference)
        moved = tl.where(running_max == float("-inf"), 0.0, reference - running_max)
        term = tl.exp(x - reference)
        centred = tl.where(x == float("-inf"), 0.0, x - reference)  # -inf adds nothing: exp(-inf)·(-inf) is 0
        weighted = scale * (weighted - moved * total) + term * centred
        total = total * scale + term
        running_max = grown
    largest = tl.max(running_max, 0)
    reference = tl.where(largest == float("-inf"), 0.0, largest)
    lane_scale = tl.exp(running_max - reference)
    lane_moved = tl.where(running_max == float("-inf"), 0.0, reference - running_max)
    z = tl.sum(total * lane_scale, 0)
    centred_sum = tl.sum(lane_scale * (weighted - lane_moved * total), 0)  # Σ exp(x - L)·(x - L)
    tl.store(out + row, largest)
    tl.store(out + rows + row, largest + tl.log(z))
    tl.store(out + 2 * rows + row, centred_sum / z - tl.log(z))  # Σ p log p = Σ p (x - L) - log(Σ exp(x - L))


def logit_rows(rows: torch.Tensor) -> torch.Tensor:
    """``(3, n)`` float32: each row's max, ``log Z`` and ``Σ p log p`` of ``(n, classes)`` logits (rows contiguous)."""
    count, classes = rows.shape
    out = torch.empty(3 * count, dtype=torch.float32, device=rows.device)
    with torch.cuda.device(rows.device) if rows.device.type == "cuda" else contextlib.nullcontext():  # its own GPU
        _row_kernel[(count,)](rows, out, count, classes, rows.stride(0), BLOCK=BLOCK)
    return out.view(3, count)
