"""Which layers the gradient noise scale counts, and the share of the gradient they hold (:mod:`.gradient_noise`).

:func:`layer_kind` tells a counted layer from its class: PyTorch's ``nn.Linear``, ``nn.LayerNorm`` and ``nn.RMSNorm``,
and Hugging Face's ``Conv1D`` and ``*RMSNorm`` classes, by name (the core imports no ``transformers``).
:func:`counted_fraction` is ``gradient_noise/counted_fraction``: the counted parameters' share of the step's
squared gradient norm.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["counted_fraction", "layer_kind", "rms_epsilon"]


def _class_names(module: nn.Module) -> list[tuple[str, str]]:
    return [(cls.__name__, cls.__module__) for cls in type(module).__mro__]


def layer_kind(module: nn.Module) -> str | None:
    """How a layer's parameters count: ``"linear"``, ``"layer_norm"``, ``"rms_norm"`` or ``None`` (not counted).

    ``"linear"``: ``nn.Linear``, and Hugging Face's ``Conv1D`` (``transformers.pytorch_utils``, GPT-2's attention
    and MLP: ``y = x @ W + b`` with ``W`` of shape ``(in, out)``, the same norms as a Linear's). ``"rms_norm"``:
    ``nn.RMSNorm``, and a class whose name ends in ``RMSNorm`` (Hugging Face's ``LlamaRMSNorm`` and its kin) with
    a 1-D ``weight``: ``y = weight · x / rms(x)``. Told from class names: the core imports no ``transformers``.

    Example:
        >>> layer_kind(nn.Linear(2, 3)), layer_kind(nn.LayerNorm(3)), layer_kind(nn.Conv1d(2, 3, 1))
        ('linear', 'layer_norm', None)
        >>> class LlamaRMSNorm(nn.Module):  # as Hugging Face writes it
        ...     def __init__(self, width):
        ...         super().__init__()
        ...         self.weight, self.variance_epsilon = nn.Parameter(torch.ones(width)), 1e-6
        >>> layer_kind(LlamaRMSNorm(4))
        'rms_norm'
    """
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.LayerNorm):
        return "layer_norm"
    if isinstance(module, nn.RMSNorm):
        return "rms_norm"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    names = _class_names(module)
    if weight.dim() == 2 and any(name == "Conv1D" and where.startswith("transformers") for name, where in names):
        return "linear"
    if weight.dim() == 1 and any(name.endswith("RMSNorm") for name, _ in names):
        return "rms_norm"
    return None


def rms_epsilon(module: nn.Module) -> float | None:
    """The epsilon an RMSNorm adds to the mean square: ``eps``, or Hugging Face's ``variance_epsilon``."""
    for name in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def counted_fraction(batch: float, pre_clip_norm: float | None, loss_scale: float = 1.0) -> float | None:
    """The share of the step's squared gradient norm that the counted parameters hold: ``‖Σ_b c_b‖²`` (the batch
    gradient over the counted parameters, a mean-reduced loss) over the squared norm of every trainable
    parameter's gradient before clipping (``gradient_clipping/pre_clip_norm``, already free of the loss scale,
    written earlier on the same thread); ``None`` without that norm or where it is 0.

    Example:
        >>> counted_fraction(9.0, 5.0)  # the counted gradient's norm 3 of a whole gradient's 5
        0.36
        >>> print(counted_fraction(9.0, None))
        None
    """
    if pre_clip_norm is None or not (pre_clip_norm > 0 and math.isfinite(pre_clip_norm)):
        return None
    return batch / (loss_scale * loss_scale) / (pre_clip_norm * pre_clip_norm)
