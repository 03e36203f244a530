"""Output-logit health, the statistic :class:`Logits`: how large and how sure the model's output logits are.

For a classifier or language-model head, a floating tensor whose last dimension holds the
classes (every other dimension a row: each position of each sample):

* ``logits/max``: the largest logit in the batch;
* ``logits/logsumexp``: the mean over rows of ``log Z = logsumexp(row)``: what PaLM's and
  OLMo 2's z-loss keeps near 0; a drift means the logits drift;
* ``logits/entropy``: the mean over rows of the softmax entropy ``-Σ p log p`` (nats): ``log C``
  for a uniform guess, near 0 for a confident (or collapsed) one.

Which output is a head's: :func:`find_logits`. :func:`logit_vector` is the device half: one op that reads
each row once (:mod:`actviz.statistics.logit_rows`), then five small ones over the rows' numbers; no host sync.

:class:`Logits` takes them of the model's output once per logging step (``target = "model_output"``). It is on by
default for models with an attention module (``watch(statistics=None)``; naming ``"logits"`` turns it on for any
model, ``False`` off), or wherever ``watch(statistics=[..., "logits"])`` names it: a CNN classifier's logits, say.
Cost: 6 ops a step, the logits read once on CUDA with Triton; no sync.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..summaries.one_tensor import local_shard
from ..tags import LOGITS
from .layer_statistic import LayerStatistic
from .logit_rows import LOGIT_ROWS
from .outliers import on_for_transformers

__all__ = ["LOGIT_TAGS", "Logits", "find_logits", "last_linear_width", "logit_vector"]

#: Tags of :func:`logit_vector`'s entries, in order.
LOGIT_TAGS = LOGITS


def last_linear_width(model: nn.Module) -> int | None:
    """``out_features`` of the model's last ``nn.Linear`` in ``named_modules()`` order: its head, if it has one."""
    width = None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            width = module.out_features
    return width


def find_logits(output: Any, head_width: int | None) -> torch.Tensor | None:
    """The logits in a model's output, or ``None``.

    A mapping's (a Hugging Face ``ModelOutput``'s) ``logits`` entry, else a floating output
    tensor of at least 2 dimensions whose last one is ``head_width`` classes (the last
    ``nn.Linear``'s width: a hidden state of another width is not taken for logits).

    Example:
        >>> find_logits({"loss": torch.tensor(1.0), "logits": torch.zeros(2, 5)}, None).shape
        torch.Size([2, 5])
        >>> find_logits(torch.zeros(2, 5), 5).shape, find_logits(torch.zeros(2, 7), 5)
        (torch.Size([2, 5]), None)
    """
    if isinstance(output, Mapping):
        tensor = output.get("logits")
    elif isinstance(output, torch.Tensor):
        tensor = output if head_width is not None and output.dim() >= 2 and output.shape[-1] == head_width else None
    else:
        tensor = None
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() < 2 or tensor.numel() == 0:
        return None
    return tensor if tensor.shape[-1] >= 2 else None


@torch.no_grad()
def logit_vector(logits: torch.Tensor) -> torch.Tensor:
    """``[max logit, mean log Z, mean entropy]`` of ``(..., classes)`` logits, float32, on their device: each row
    read once by ``torch.ops.actviz.logit_rows`` (:mod:`actviz.statistics.logit_rows`), then three small reductions.

    Example:
        >>> [round(v, 4) for v in logit_vector(torch.zeros(3, 4)).tolist()]   # uniform: log 4
        [0.0, 1.3863, 1.3863]
    """
    values = local_shard(logits)  # detached; a DTensor's local shard
    rows = values.reshape(-1, values.shape[-1]) if values.dim() else values.reshape(1, 1)
    parts = LOGIT_ROWS(rows)
    return torch.stack([parts[0].amax(), parts[1].mean(), parts[2].mean().neg()])



class Logits(LayerStatistic):
    """``logits/max``, ``logits/logsumexp`` and ``logits/entropy`` of the model's output (see the module docstring).

    Example:
        >>> model = nn.Linear(3, 4)
        >>> numbers = Logits().device(Logits().select(model, torch.zeros(2, 4)), model, None).tolist()
        >>> [round(value, 4) for value in Logits().host(numbers, 8, torch.float32).values()]
        [0.0, 1.3863, 1.3863]
    """

    name, names, target = "logits", ("max", "logsumexp", "entropy"), "model_output"
    cost = "11 kernels a logging step (the model's output, one block of rows); no sync"

    def __init__(self) -> None:
        self._head_widths: weakref.WeakKeyDictionary[nn.Module, int | None] = weakref.WeakKeyDictionary()

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        return on_for_transformers(model, options)

    def select(self, model: nn.Module, output: Any) -> torch.Tensor | None:
        if model not in self._head_widths:  # found once per model
            self._head_widths[model] = last_linear_width(model)
        return find_logits(output, self._head_widths[model])

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        return logit_vector(tensor)

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return dict(zip(self.names, numbers))

    def tag(self, layer: str, name: str) -> str:
        """``logits/{name}``: one model output, no layer in the tag."""
        return f"logits/{name}"
