"""FP8 and MX readiness of a higher-precision run: the per-layer statistics :class:`Fp8Readiness` (of each watched
output) and :class:`Fp8GradientReadiness` (of the gradient with respect to it).

For each element format of :data:`FORMATS` (``e4m3``: max 448, min normal 2⁻⁶, min subnormal 2⁻⁹; ``e5m2``: max
57344, min normal 2⁻¹⁴, min subnormal 2⁻¹⁶), the fraction of a tensor's elements that a cast to it would lose:

* ``fp8_{format}_underflow``: with **per-tensor scaling**, ``y = x · max / amax`` (``amax`` of the whole tensor, as
  Transformer Engine's current scaling takes it; its delayed scaling takes a recent step's): the fraction of
  non-zero elements that round to 0 or to a subnormal (``|y| < min normal − min subnormal / 2``), losing precision
  or everything. Nothing saturates under this scale, which maps ``amax`` onto the format's max;
* ``mx_{format}_underflow`` and ``mx_{format}_saturated``: with **MX block scaling** (OCP Microscaling Formats
  v1.0): blocks of 32 consecutive elements along the last dimension share the power of two
  ``2^(floor(log2(block amax)) − emax)`` (an E8M0 scale; ``emax`` 8 for e4m3, 15 for e5m2); the fraction that
  underflows as above, and the fraction beyond the format's max by more than half its top step (over 464 for
  e4m3, 61440 for e5m2), which the cast clamps: the block's largest elements, whose scaled value lies in
  ``[2^emax, 2^(emax+1))``.

Written as ``activation_stats/fp8_e4m3_underflow@{layer}``, ``fp8_e5m2_underflow@``, ``mx_e4m3_underflow@``,
``mx_e4m3_saturated@``, ``mx_e5m2_underflow@``, ``mx_e5m2_saturated@`` (``gradient_stats/...`` for the
gradients), and each step the text ``fp8_readiness/keep_in_bf16`` (``keep_in_bf16_gradients``): the layers whose
underflow under per-tensor scaling in e4m3 (e5m2 for gradients, the format they are cast to) exceeds
:data:`KEEP_IN_BF16` (1 %).

The fractions are **estimated from a sample** of whole 32-element blocks: :data:`SAMPLE` (4,096) elements, evenly
strided rows of the tensor (all of it when smaller), so a fraction ``p`` carries a sampling error of about
``sqrt(p(1 − p) / 4096)`` (0.16 percentage points at 1 %); ``amax`` is of the whole tensor. NaN elements are left
out; a tensor whose ``amax`` is ±Inf gets no per-tensor fractions. Where the one-pass op summarizes the tensor
(:mod:`actviz.summaries.one_pass`), ``amax`` is its row's ``max_abs`` (NaN left out), from the read it makes anyway,
and the device half is two or three small ops gathering the sample; a small tensor batched with the step's others
(or on the CPU shortcut) takes one more, a reduction of the whole tensor (``vector_norm`` of order ∞, NaN
propagating: no per-tensor fractions then). No sync; the host half, on the writer thread, computes the fractions
in float64. Off by default:
``statistics=["default", "fp8_readiness", "fp8_gradients"]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..common.distributed_types import is_dtensor
from ..summaries.one_pass import OUTLIER_FIELDS
from .layer_statistic import LayerStatistic

__all__ = ["BLOCK", "FORMATS", "KEEP_IN_BF16", "SAMPLE", "Fp8Format", "Fp8GradientReadiness", "Fp8Readiness",
           "block_sample", "readiness"]

#: Elements sharing one MX scale, along the last dimension.
BLOCK = 32
#: Elements of the sample the fractions are estimated from (128 blocks).
SAMPLE = 4096
#: The share of a tensor's elements underflowing in FP8 under per-tensor scaling above which its layer is listed as
#: one to keep in bf16.
KEEP_IN_BF16 = 0.01


@dataclass(frozen=True)
class Fp8Format:
    """An FP8 element format: its largest value, smallest normal and subnormal, the step between its two largest
    values, and the largest exponent of a normal (``emax``, the MX scale's offset)."""

    name: str
    max: float
    min_normal: float
    min_subnormal: float
    top_step: float
    emax: int

    @property
    def underflow_below(self) -> float:
        """Scaled magnitudes below this round to 0 or a subnormal (round to nearest, ties to even)."""
        return self.min_normal - self.min_subnormal / 2

    @property
    def saturates_above(self) -> float:
        """Scaled magnitudes above this are beyond rounding to the max: a cast clamps them (or makes them ±Inf)."""
        return self.max + self.top_step / 2


#: The two FP8 element formats of the OCP FP8 and MX specifications.
FORMATS = (Fp8Format("e4m3", 448.0, 2.0**-6, 2.0**-9, 32.0, 8), Fp8Format("e5m2", 57344.0, 2.0**-14, 2.0**-16, 8192.0, 15))


def block_sample(values: torch.Tensor, size: int = SAMPLE) -> torch.Tensor:
    """About ``size`` elements of ``values`` in whole rows (evenly strided along the last dimension's rows), each
    row cut to at most ``size`` elements and padded with NaN to a multiple of :data:`BLOCK`, flat, in float32: its
    MX blocks. Only the picked part is copied.

    Example:
        >>> block_sample(torch.arange(6.0).view(3, 2), 4).view(-1, BLOCK)[:, :3].tolist()
        [[0.0, 1.0, nan], [2.0, 3.0, nan]]
    """
    width = values.shape[-1] if values.dim() else 1
    if values.dim() > 1 and not values.is_contiguous():  # pick along dim 0 first: no copy of the whole tensor
        keep = max(1, -(-size // values[0].numel()))
        values = values[:: max(1, values.shape[0] // keep)][:keep]
    rows = values.reshape(-1, width)
    wanted = max(1, size // width)
    picked = rows[:: max(1, rows.shape[0] // wanted)][:wanted, : -(-size // BLOCK) * BLOCK]
    padding = -picked.shape[1] % BLOCK
    return torch.nn.functional.pad(picked.float(), (0, padding), value=math.nan).reshape(-1)


def readiness(amax: float, sample: np.ndarray) -> dict[str, float]:
    """The host half: the whole tensor's ``amax`` and its :func:`block_sample` -> the fractions of the module
    docstring, in float64.

    Example:
        >>> sample = np.full(BLOCK, 1.0); sample[0] = 2.0**-20; sample[1] = 500.0 / 2.0**7   # block amax: 500 / 128
        >>> values = readiness(500.0 / 2.0**7, sample)
        >>> values["fp8_e4m3_underflow"], values["mx_e4m3_underflow"], values["mx_e4m3_saturated"]
        (0.03125, 0.03125, 0.03125)
    """
    magnitudes = np.abs(sample.reshape(-1, BLOCK).astype(np.float64))
    counted = ~np.isnan(magnitudes)
    total = counted.sum()
    if total == 0:
        return {}
    nonzero = counted & (magnitudes > 0)
    block_amax = np.where(counted, magnitudes, 0).max(axis=1, keepdims=True)
    values: dict[str, float] = {}
    for form in FORMATS:
        if math.isfinite(amax) and amax > 0:
            scale = float(np.float32(form.max) / np.float32(amax))  # in float32, as Transformer Engine takes it
            values[f"fp8_{form.name}_underflow"] = float((nonzero & (magnitudes * scale < form.underflow_below)).sum() / total)
        with np.errstate(divide="ignore", invalid="ignore"):
            exponent = np.floor(np.log2(block_amax)) - form.emax  # -inf for an all-zero block: nothing to count
            scaled = magnitudes / np.exp2(exponent)
        values[f"mx_{form.name}_underflow"] = float((nonzero & (scaled < form.underflow_below)).sum() / total)
        values[f"mx_{form.name}_saturated"] = float((counted & (scaled > form.saturates_above)).sum() / total)
    return values


class Fp8Readiness(LayerStatistic):
    """``activation_stats/fp8_e4m3_underflow@{layer}`` and the other fractions of the module docstring, of every
    watched layer's floating output, and the text ``fp8_readiness/keep_in_bf16``.

    Example:
        >>> numbers = Fp8Readiness().device(torch.randn(64, 64), nn.Identity(), None)
        >>> values = Fp8Readiness().host(numbers.tolist(), 4096, torch.float32)
        >>> values["fp8_e4m3_underflow"] < 0.01, values["mx_e4m3_saturated"] > 0
        (True, True)
    """

    name = "fp8_readiness"
    names = tuple(f"{kind}_{form.name}_{what}" for form in FORMATS
                  for kind, what in (("fp8", "underflow"), ("mx", "underflow"), ("mx", "saturated")))
    cost = ("2 or 3 small kernels gathering a 4,096-element sample, copied with the step's numbers, and the summary's "
            "max |x|; 1 more reading the whole tensor where it is batched with others; no sync")
    summary_fields = OUTLIER_FIELDS  # max |x| (NaN left out) from the summary's read
    keep_format = "e4m3"  # the format the keep-in-bf16 list judges by
    keep_tag = "fp8_readiness/keep_in_bf16"

    def on_by_default(self, model: nn.Module, options: Any) -> bool:
        return False

    def device(self, tensor: torch.Tensor, module: nn.Module, options: Any) -> torch.Tensor | None:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return None
        values = tensor.detach()
        values = values.to_local() if is_dtensor(values) else values
        amax = torch.linalg.vector_norm(values, math.inf, dtype=torch.float32)
        return torch.cat([amax.view(1), block_sample(values)])

    def from_summary_and_tensor(self, fields: torch.Tensor, sample: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        values = tensor.detach()
        values = values.to_local() if is_dtensor(values) else values
        return torch.cat([fields[:1].float(), block_sample(values)])  # the summary's max |x|: no read of its own

    def host(self, numbers: list[float], numel: int, dtype: torch.dtype) -> dict[str, float]:
        return readiness(numbers[0], np.asarray(numbers[1:], dtype=np.float64))

    def texts(self, values: dict[str, dict[str, Any]]) -> dict[str, str]:
        key = f"fp8_{self.keep_format}_underflow"
        judged = {layer: found[key] for layer, found in values.items() if key in found}  # a finite, non-zero amax
        kept = [(layer, fraction) for layer, fraction in judged.items() if fraction > KEEP_IN_BF16]
        if not judged:
            return {}
        if not kept:
            return {self.keep_tag: f"none: the {self.keep_format} underflow with per-tensor scaling of each of the "
                                   f"{len(judged)} layers with a finite amax is at most {KEEP_IN_BF16:.0%}"}
        listed = ", ".join(f"`{layer}` ({fraction:.1%})" for layer, fraction in kept)
        return {self.keep_tag: f"over {KEEP_IN_BF16:.0%} {self.keep_format} underflow with per-tensor scaling: {listed}"}


class Fp8GradientReadiness(Fp8Readiness):
    """The same fractions of the gradient with respect to each watched output, as ``gradient_stats/...@{layer}``, and
    the text ``fp8_readiness/keep_in_bf16_gradients``, judged by e5m2, the format gradients are cast to."""

    name = "fp8_gradients"
    target = "output_gradient"
    keep_format = "e5m2"
    keep_tag = "fp8_readiness/keep_in_bf16_gradients"
