"""The residual stream, per block: the statistic :class:`Residual` (``statistics=["default", "residual"]``).

A transformer block writes ``y = x + f(x)`` into the stream it reads. For each block, its input ``x`` (the first
tensor of the block's positional arguments) and its output ``y`` (the first tensor of its output), it writes,
of the same sampled token rows of each (below; all of them up to :data:`ROWS`, ``N`` elements):

* ``residual/rms@{block}``: the RMS of the output, ``‖y‖ / √N``; over the blocks, the stream's norm growth;
* ``residual/growth@{block}``: ``rms(y) / rms(x)``, the growth across the block (its input is the previous
  block's output in a stack, so the product over blocks is the growth from the first block's input);
* ``residual/write_ratio@{block}``: ``‖y − x‖ / ‖x‖``, which is ``‖f(x)‖ / ‖x‖`` for ``y = x + f(x)``: 0 for a
  block that writes nothing, 1 for one that adds its input again (NaN where ``y`` and ``x`` differ in shape);
* ``residual/effective_rank@{block}``: the effective rank (Roy & Vetterli 2007), ``exp(−Σ pᵢ log pᵢ)`` with
  ``pᵢ = σᵢ / Σσ`` the normalized singular values of ``R`` token rows of the output, **not centered**: 1 for rows
  that are multiples of one vector, ``R`` for ``R`` orthogonal rows of one norm (singular values below
  ``√(R·ε)·σmax``, ``ε = 2⁻²³``, count as 0: the float32 Gram matrix resolves no smaller ones);
* ``residual/mean_cosine@{block}``: the mean cosine similarity of those rows over all ``R (R − 1)`` ordered pairs
  (rows of norm 0 left out): near 1 when the tokens collapse to one direction (rank collapse).

The rows are the output's last dimension as features and every other dimension as tokens (``B·T`` rows of a
``(B, T, D)`` output), at most :data:`ROWS` of them, every ``s``-th from row 0 with ``s = ceil(B·T / ROWS)``.
On the device it takes the three norms and the ``R × R`` Gram matrix of those rows (one small matrix product),
ten kernels per block, reading only the sampled rows, and no sync; the writer thread takes the Gram matrix's
eigenvalues in float64.

Blocks (:func:`residual_blocks`) are the outermost modules that are children of an ``nn.ModuleList``, or repeated
children (two or more of one class) of an ``nn.Sequential``, and not ``torch.nn``'s own leaf layers or containers
(``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer`` are blocks): GPT-2's ``h.0 … h.11``, BERT's
``encoder.layer.N``, torchvision ViT's ``encoder.layers.encoder_layer_N``. It applies to sequence models: a block
whose output is not 2-D or 3-D (a ResNet bottleneck's ``(N, C, H, W)``) is skipped, at no cost.

Example:
    >>> class Block(nn.Module):
    ...     def forward(self, x):
    ...         return x + x       # f(x) = x: write ratio 1, growth 2
    >>> model = nn.Sequential(nn.ModuleList([Block(), Block()]))
    >>> sorted(residual_blocks(model))
    ['0.0', '0.1']
    >>> x = torch.eye(4)[:, None, :].expand(4, 2, 4)  # 8 rows: 4 orthogonal directions, twice each
    >>> numbers = Residual().device_with_input(2 * x, x, model[0][0], None)
    >>> values = Residual().host(numbers.tolist(), x.numel(), torch.float32)
    >>> {name: round(values[name], 3) for name in ("growth", "write_ratio", "effective_rank")}
    {'growth': 2.0, 'write_ratio': 1.0, 'effective_rank': 4.0}
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from ..tags import RESIDUAL
from .layer_statistic import LayerStatistic

__all__ = ["ROWS", "Residual", "residual_blocks"]

#: The most token rows of a block's output its effective rank and mean cosine are taken of.
ROWS = 128

#: float32's machine epsilon, the Gram matrix's precision.
FLOAT32_EPSILON = 2.0**-23

_BLOCK_CLASSES = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)  # torch.nn's own blocks
_blocks_of: weakref.WeakKeyDictionary[nn.Module, frozenset[int]] = weakref.WeakKeyDictionary()


def _may_be_block(module: nn.Module) -> bool:
    return isinstance(module, _BLOCK_CLASSES) or not type(module).__module__.startswith("torch.nn.")


def residual_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The model's residual blocks by ``named_modules()`` name (see the module docstring), outermost only.

    Example:
        >>> encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2), 2, enable_nested_tensor=False)
        >>> list(residual_blocks(encoder))
        ['layers.0', 'layers.1']
    """
    found: dict[str, nn.Module] = {}
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.named_children())
        for child_name, child in children:
            repeated = isinstance(container, nn.ModuleList) or sum(type(other) is type(child) for _, other in children) > 1
            full = f"{name}.{child_name}" if name else child_name
            if repeated and _may_be_block(child) and not any(full.startswith(outer + ".") for outer in found):
                found[full] = child
    return found


def _sampled_rows(tensor: torch.Tensor) -> torch.Tensor:
    """At most :data:`ROWS` rows of ``tensor`` seen as ``(tokens, features)``, every ``s``-th from row 0, as float32."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    step = max(1, -(-rows.shape[0] // ROWS))
    return rows[::step].float()


class Residual(LayerStatistic):
    """The residual stream of each block: RMS, growth, write ratio, effective rank and mean cosine of its output.

    Off by default: ``statistics=["default", "residual"]``. Runs on the blocks whether watched or not.
    """

    name = "residual"
    names = ("rms", "growth", "write_ratio", "effective_rank", "mean_cosine")
    reads_input = True
    unwatched_layers = True
    cost = "ten kernels per block (three norms, a difference, a matrix product), on at most 128 rows; no sync"

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        return False

    def applies_in(self, model: nn.Module, module: nn.Module) -> bool:
        blocks = _blocks_of.get(model)
        if blocks is None:
            blocks = _blocks_of[model] = frozenset(id(block) for block in residual_blocks(model).values())
        return id(module) in blocks

    def device_with_input(self, tensor: torch.Tensor, layer_input: torch.Tensor | None, module: nn.Module,
                          options: Any) -> torch.Tensor | None:
        if (layer_input is None or tensor.dim() not in (2, 3) or not tensor.is_floating_point()
                or not layer_input.is_floating_point() or tensor.numel() == 0 or layer_input.numel() == 0):
            return None
        rows_y, rows_x = _sampled_rows(tensor.detach()), _sampled_rows(layer_input.detach())  # the same rows
        norm_y, norm_x = torch.linalg.vector_norm(rows_y), torch.linalg.vector_norm(rows_x)
        if rows_y.shape == rows_x.shape and tensor.shape == layer_input.shape:
            written = torch.linalg.vector_norm(rows_y - rows_x)
        else:
            written = torch.full_like(norm_y, math.nan)
        gram = rows_y @ rows_y.T
        return torch.cat([torch.stack([norm_y * (1 / math.sqrt(rows_y.numel())),
                                       norm_x * (1 / math.sqrt(rows_x.numel())), written / norm_x]), gram.flatten()])

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        rms, input_rms, write_ratio = numbers[:3]
        count = math.isqrt(len(numbers) - 3)
        gram = np.asarray(numbers[3:], dtype=np.float64).reshape(count, count)
        return {"rms": rms, "growth": rms / input_rms if input_rms > 0 else math.nan, "write_ratio": write_ratio,
                "effective_rank": effective_rank(gram), "mean_cosine": mean_cosine(gram)}

    def tag(self, layer: str, name: str) -> str:
        return RESIDUAL.format(layer=layer, statistic=name)


def effective_rank(gram: np.ndarray) -> float:
    """``exp`` of the entropy of the normalized singular values of rows whose Gram matrix is ``gram``; NaN for none.

    Example:
        >>> round(effective_rank(np.eye(3)), 6), round(effective_rank(np.ones((3, 3))), 6)
        (3.0, 1.0)
    """
    if not np.all(np.isfinite(gram)):
        return math.nan
    eigenvalues = np.linalg.eigvalsh((gram + gram.T) / 2)
    # The Gram matrix comes in float32: its eigenvalues are known to about R·ε·λmax, and √ of that round-off
    # would read as many small singular values. Below it, they count as 0.
    eigenvalues[eigenvalues <= eigenvalues.max(initial=0.0) * len(gram) * FLOAT32_EPSILON] = 0.0
    singular = np.sqrt(eigenvalues)
    total = singular.sum()
    if total <= 0:
        return math.nan
    p = singular[singular > 0] / total
    return float(np.exp(-(p * np.log(p)).sum()))


def mean_cosine(gram: np.ndarray) -> float:
    """The mean cosine similarity over the ordered pairs of distinct rows of norm > 0; NaN for fewer than two.

    Example:
        >>> round(mean_cosine(np.eye(3)), 6), round(mean_cosine(np.ones((3, 3))), 6)
        (0.0, 1.0)
    """
    norms = np.sqrt(np.clip(np.diag(gram), 0.0, None))
    kept = norms > 0
    count = int(kept.sum())
    if count < 2 or not np.all(np.isfinite(gram)):
        return math.nan
    cosine = gram[np.ix_(kept, kept)] / np.outer(norms[kept], norms[kept])
    return float((cosine.sum() - np.trace(cosine)) / (count * (count - 1)))
