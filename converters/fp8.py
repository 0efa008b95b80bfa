"""DeepSeek's FP8 weight format: float8_e4m3fn values, one float32 scale per 128x128 block.

The stored `<name>_scale_inv` has shape [ceil(out/128), ceil(in/128)] and, despite its name,
multiplies: weight = e4m3 value * scale of its block. Edge blocks are partial.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 128
E4M3_MAX = 448.0
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SUFFIX = "_scale_inv"


def scale_shape(shape: tuple[int, int], block: int = BLOCK) -> tuple[int, int]:
    rows, cols = shape
    return (-(-rows // block), -(-cols // block))


def _blocked(shape: tuple[int, int], block: int) -> tuple[int, int, int, int]:
    r, c = scale_shape(shape, block)
    return r, block, c, block


def dequantize(q: np.ndarray, scale_inv: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """float32 weight from e4m3 values and per-block scales (partial edge blocks included)."""
    if q.ndim != 2 or scale_inv.shape != scale_shape(q.shape, block):
        raise ValueError(f"scale shape {scale_inv.shape} does not match weight {q.shape} in {block}-blocks")
    rows, cols = q.shape
    r, _, c, _ = _blocked(q.shape, block)
    padded = np.zeros((r * block, c * block), np.float32)
    padded[:rows, :cols] = q.astype(np.float32)
    padded = padded.reshape(r, block, c, block) * scale_inv.astype(np.float32)[:, None, :, None]
    return padded.reshape(r * block, c * block)[:rows, :cols]


def quantize(w: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's block quantization: scale = amax(block) / 448, q = e4m3(w / scale)."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    rows, cols = w.shape
    r, _, c, _ = _blocked(w.shape, block)
    padded = np.zeros((r * block, c * block), np.float32)
    padded[:rows, :cols] = w.astype(np.float32)
    blocks = padded.reshape(r, block, c, block)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = (amax / E4M3_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.clip(blocks / safe[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    q = q.reshape(r * block, c * block)[:rows, :cols].astype(FP8_DTYPE)
    return q, scale
