"""A small PNG encoder for the pictures actviz draws: 8-bit grayscale, RGB, and RGB drawn from a palette.

TensorBoard wants PNG bytes. PIL is the fallback to switch to for anything beyond
8-bit gray and RGB (16-bit, alpha); this encoder covers what actviz makes,
faster, because its pictures are enlarged by repeating pixels. A heat map's colours all
come from one palette (viridis): given it, the picture is stored as one byte per pixel, an
index into the palette (PNG's colour type 3), which decodes to the same RGB pixels.
"""

from __future__ import annotations

import functools
import struct
import zlib

import numpy as np
import torch

__all__ = ["encode_png"]


def encode_png(image: torch.Tensor, compress_level: int = 1, palette: torch.Tensor | None = None) -> bytes:
    """Encode a ``(1 or 3, H, W)`` ``uint8`` tensor as a grayscale or RGB PNG.

    A minimal encoder for pictures enlarged by repeating pixels. A row equal to the
    one above it is stored with PNG's "Up" filter, which turns it into zeros; other
    rows use the "Sub" filter, which turns a repeated pixel into zeros. zlib then
    compresses with run-length matching only, at a fast level. On feature-map grids
    and heat maps the files are within about 10% of PIL's level-1 PNGs, made in
    under half the time.

    ``palette``: ``(P, 3)`` ``uint8`` colours. An RGB image whose every pixel is one of them is
    stored as palette indices, a third of the bytes to compress (a 1,024 × 768 heat map: about
    5 times faster, half the file); the decoded pixels are the same. Any other image is stored as RGB.

    Example:
        >>> encode_png(torch.zeros(1, 2, 3, dtype=torch.uint8))[:8]
        b'\\x89PNG\\r\\n\\x1a\\n'
        >>> colours = torch.tensor([[68, 1, 84], [253, 231, 37]], dtype=torch.uint8)
        >>> image = colours[torch.tensor([[0, 1], [1, 1]])].permute(2, 0, 1)
        >>> encode_png(image, palette=colours)[25]  # colour type 3: indexed
        3
    """
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"expected a (1 or 3, H, W) uint8 image, got {tuple(image.shape)} {image.dtype}")
    channels, height, width = image.shape
    pixels = image.cpu().permute(1, 2, 0).numpy()
    if channels == 3 and palette is not None:
        lookup = _palette_lookup(bytes(palette.to(torch.uint8).contiguous().numpy()))
        indices = None if lookup is None else _indices(pixels, *lookup)
        if indices is not None:
            return _encode(indices, 1, 3, compress_level, plte=lookup[0].tobytes())
    return _encode(pixels.reshape(height, width * channels), channels, 0 if channels == 1 else 2, compress_level)


def _encode(pixels: np.ndarray, channels: int, colour_type: int, compress_level: int, plte: bytes | None = None) -> bytes:
    """PNG bytes of ``(H, W * channels)`` samples: "Up" for a row equal to the one above, else "Sub"."""
    height, width = pixels.shape[0], pixels.shape[1] // channels
    rows = np.empty((height, width * channels + 1), dtype=np.uint8)  # a filter-type byte, then the row
    # "Sub": each byte minus the same byte of the pixel to its left (wrapping, as PNG wants).
    rows[:, 1 : 1 + channels] = pixels[:, :channels]
    np.subtract(pixels[:, channels:], pixels[:, :-channels], out=rows[:, 1 + channels :])
    repeated = np.zeros(height, dtype=bool)
    repeated[1:] = (pixels[1:] == pixels[:-1]).all(axis=1)
    rows[:, 0] = np.where(repeated, _FILTER_UP, _FILTER_SUB)
    rows[repeated, 1:] = 0  # "Up": each byte minus the byte above it
    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    compressor = zlib.compressobj(compress_level, zlib.DEFLATED, zlib.MAX_WBITS, 9, zlib.Z_RLE)
    return b"".join([
        _PNG_SIGNATURE,
        _png_chunk(b"IHDR", header),
        *([_png_chunk(b"PLTE", plte)] if plte is not None else []),
        _png_chunk(b"IDAT", compressor.compress(rows.tobytes()) + compressor.flush()),
        _png_chunk(b"IEND", b""),
    ])


@functools.lru_cache(maxsize=4)
def _palette_lookup(palette: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(colours, index by red and green, blue by index)`` of a palette's distinct colours, or ``None``
    where two of them share red and green (no one-table lookup) or there are more than 256."""
    colours = np.unique(np.frombuffer(palette, dtype=np.uint8).reshape(-1, 3), axis=0)
    keys = (colours[:, 0].astype(np.int32) << 8) | colours[:, 1]
    if len(colours) > 256 or len(np.unique(keys)) != len(colours):
        return None
    by_red_green = np.zeros(1 << 16, dtype=np.uint16)  # index + 1; 0: no colour of the palette
    by_red_green[keys] = np.arange(1, len(colours) + 1, dtype=np.uint16)
    return colours, by_red_green, colours[:, 2].copy()


def _indices(pixels: np.ndarray, colours: np.ndarray, by_red_green: np.ndarray, blue: np.ndarray) -> np.ndarray | None:
    """``(H, W)`` palette indices of ``(H, W, 3)`` pixels, or ``None`` if one is not a palette colour."""
    found = by_red_green[(pixels[..., 0].astype(np.int32) << 8) | pixels[..., 1]]
    if not found.all():
        return None
    indices = (found - 1).astype(np.uint8)
    return indices if np.array_equal(blue[indices], pixels[..., 2]) else None


_FILTER_SUB, _FILTER_UP = 1, 2
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
