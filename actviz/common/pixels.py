"""Pictures from values in [0, 1] to 8-bit pixels: one rounding rule for every picture actviz writes.

Every feature-map grid, heat map, Grad-CAM overlay, probe input and report image is turned
into ``uint8`` here, so a value becomes the same pixel wherever it is drawn: times 255,
rounded half to even (as :func:`torch.round` does), clamped to 0..255. ``tests/test_idioms.py``
checks that no other module spells the conversion out again.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

__all__ = ["PaletteImage", "to_uint8"]


def to_uint8(values: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """``values`` in [0, 1] as ``uint8`` pixels 0 to 255: a new tensor (or array), ``values`` untouched.

    Out-of-range values are clamped; NaN must have been replaced before (it has no pixel).

    Example:
        >>> to_uint8(torch.tensor([0.0, 0.5, 1.0, 1.5, -0.2])).tolist()
        [0, 128, 255, 255, 0]
        >>> to_uint8(np.array([0.25, 1.0])).tolist()
        [64, 255]
    """
    if isinstance(values, np.ndarray):
        return np.clip(np.round(values * 255), 0, 255).astype(np.uint8)
    return values.mul(255).round_().clamp_(0, 255).to(torch.uint8)


class PaletteImage(NamedTuple):
    """An RGB picture kept as one byte per pixel: ``indices`` ``(H, W)`` ``uint8`` into ``palette`` ``(P, 3)`` ``uint8``.

    A heat map's colours all come from one palette (viridis, 256 levels), so it is drawn,
    kept and PNG-encoded as its levels (PNG's indexed colour type): a third of the bytes
    of RGB, and the same pixels once decoded. :meth:`rgb` gives the ``(3, H, W)`` picture.

    Example:
        >>> colours = torch.tensor([[68, 1, 84], [253, 231, 37]], dtype=torch.uint8)
        >>> image = PaletteImage(torch.tensor([[0, 1, 1]], dtype=torch.uint8), colours)
        >>> image.shape, image.rgb()[:, 0, 1].tolist()
        ((3, 1, 3), [253, 231, 37])
    """

    indices: torch.Tensor
    palette: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(3, H, W)``, as the RGB picture's."""
        return (3, *self.indices.shape)

    def rgb(self) -> torch.Tensor:
        """The ``(3, H, W)`` ``uint8`` RGB picture, on the indices' device, stored channels-last (as a PNG wants)."""
        return self.palette.to(self.indices.device)[self.indices.long()].permute(2, 0, 1)
