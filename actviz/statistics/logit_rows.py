"""The device half of the logit statistics as one op, ``torch.ops.actviz.logit_rows``: each row of the logits read once.

``logit_rows(rows)`` takes ``(n, classes)`` logits and returns ``(3, n)`` float32 numbers per row: its max,
``log Z = logsumexp(row)`` and ``Σ p log p`` (``p = softmax(row)``; the entropy is its negative). It is a
``torch.library`` op, so a ``TorchDispatchMode`` sees one op with the logits as its input. Its bodies:

* on CUDA with Triton (and on the CPU where ``TRITON_INTERPRET=1`` was set before actviz was imported): one
  Triton kernel that reads each row once with an online softmax (:mod:`actviz.statistics.logit_rows_triton`);
* elsewhere, :func:`eager_logit_rows`: ``logsumexp``, ``softmax``, ``xlogy`` and ``amax``, a vocabulary's rows
  :data:`~actviz.summaries.piecewise.PIECE` elements at a time so that the temporaries stay about that size.

Example:
    >>> [round(v, 4) for v in torch.ops.actviz.logit_rows(torch.zeros(1, 4)).view(-1).tolist()]  # uniform: log 4
    [0.0, 1.3863, -1.3863]
"""

from __future__ import annotations

import functools

import torch

from ..common.torch_ops import define_op, triton_runs_on
from ..summaries.piecewise import PIECE

__all__ = ["LOGIT_ROWS", "eager_logit_rows", "logit_rows"]


@functools.cache
def _triton_body():
    try:
        from .logit_rows_triton import logit_rows as body
    except Exception:  # noqa: BLE001 - no Triton (or a broken one): the eager body
        return None
    return body


def _takes_triton(rows: torch.Tensor) -> bool:
    if rows.dtype not in (torch.float16, torch.bfloat16, torch.float32) or rows.stride(-1) != 1:
        return False
    return triton_runs_on(rows.device) and _triton_body() is not None


def logit_rows(rows: torch.Tensor) -> torch.Tensor:
    """``(3, n)`` float32: each row's max, ``log Z`` and ``Σ p log p`` of ``(n, classes)`` logits."""
    if rows.shape[0] and _takes_triton(rows):
        return _triton_body()(rows)
    return eager_logit_rows(rows)


def eager_logit_rows(rows: torch.Tensor) -> torch.Tensor:
    """The op's eager body: a vocabulary's rows a piece at a time (float64 logits are summed in float64)."""
    step = max(1, PIECE // max(1, rows.shape[1])) if rows.numel() > PIECE else max(1, rows.shape[0])
    found = [_row_numbers(chunk) for chunk in rows.split(step)]
    return (found[0] if len(found) == 1 else torch.cat(found, dim=1)).float()


def _row_numbers(rows: torch.Tensor) -> torch.Tensor:
    """``[max, log Z, Σ p log p]`` of each row of ``(n, classes)`` logits, float32 or float64."""
    if rows.dtype not in (torch.float32, torch.float64):
        rows = rows.float()
    log_z = torch.logsumexp(rows, dim=-1)
    probabilities = torch.softmax(rows, dim=-1)
    entropy = torch.special.xlogy(probabilities, probabilities).sum(dim=-1)
    return torch.stack([rows.amax(dim=-1), log_z, entropy])


def _fake_logit_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((3, rows.shape[0]), dtype=torch.float32)


#: The op, as the logit statistic calls it (:func:`~actviz.common.torch_ops.define_op`).
LOGIT_ROWS = define_op("logit_rows", "logit_rows(Tensor rows) -> Tensor", logit_rows, _fake_logit_rows)
