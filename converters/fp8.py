"""DeepSeek's FP8 weight format: float8_e4m3fn values, one float32 scale per 128x128 block.

The stored `<name>_scale_inv` has shape [ceil(out/128), ceil(in/128)] and, despite its name,
multiplies: weight = e4m3 value * scale of its block. Edge blocks are partial.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

BLOCK = 128
E4M3_MAX = 448.0
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
SCALE_SUFFIX = "_scale_inv"
# config.json's quantization_config of a DeepSeek FP8 checkpoint
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic"}


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
    out = _blocks(q, block) * scale_inv.astype(np.float32)[:, None, :, None]
    return out.reshape(r * block, c * block)[:rows, :cols]


@functools.partial(jax.jit, static_argnames=("transpose", "dtype"))
def _dequantize_jit(q, scale, transpose: bool, dtype):
    if transpose:  # transposing the 1-byte values first is twice as fast as transposing the output
        q, scale = q.T, scale.T
    rows, cols = q.shape
    r, c = scale.shape
    w = q.astype(jnp.float32)
    if (rows, cols) != (r * BLOCK, c * BLOCK):
        w = jnp.pad(w, ((0, r * BLOCK - rows), (0, c * BLOCK - cols)))
    w = (w.reshape(r, BLOCK, c, BLOCK) * scale[:, None, :, None]).reshape(r * BLOCK, c * BLOCK)[:rows, :cols]
    return w.astype(dtype), jnp.isfinite(w).all()


def dequantize_fused(q: np.ndarray, scale: np.ndarray, transpose: bool, dtype) -> tuple[np.ndarray, bool]:
    """dequantize(q, scale), optionally transposed, cast to `dtype`, in one XLA pass (several
    times faster than numpy, bit-identical); also returns whether every value is finite."""
    if q.ndim != 2 or scale.shape != scale_shape(q.shape):
        raise ValueError(f"scale shape {scale.shape} does not match weight {q.shape} in {BLOCK}-blocks")
    w, finite = _dequantize_jit(q, scale.astype(np.float32), transpose, np.dtype(dtype))
    return np.asarray(w), bool(finite)


# A 128x128 block of e4m3 codes shares one scale, so it takes at most 256 distinct values: XLA
# computes those (block x code) products exactly as `dequantize_fused` computes every
# element (float32 product, denormals flushed as XLA does, rounded to the target dtype), and
# numpy gathers them into place tile by tile, transposing in cache. Same bits, 2-3x less CPU
# than the fused XLA transpose (the converter's largest CPU cost on this 2-core machine).
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(FP8_DTYPE).astype(np.float32)
_NAN_CODE = 0x7F  # e4m3fn's only NaN, with either sign; it has no Inf
UINT_OF_SIZE = {2: np.uint16, 4: np.uint32}  # same-size unsigned views, for fast copies
_TILE = 2048  # columns per tile: 128 x 2048 codes and their int32 indices stay in L2


@functools.partial(jax.jit, static_argnames="dtype")
def _fp8_table(scale, dtype):
    w = jnp.asarray(_E4M3_VALUES)[None, :] * scale.reshape(-1, 1)
    return w.astype(dtype), jnp.isfinite(w)


def dequantize_table(q: np.ndarray, scale: np.ndarray, transpose: bool, dtype) -> tuple[np.ndarray, bool]:
    """`dequantize_fused(q, scale, transpose, dtype)`, bit for bit, by table lookup (2-3x less CPU)."""
    dtype = np.dtype(dtype)
    uint = UINT_OF_SIZE.get(dtype.itemsize)
    if uint is None or q.ndim != 2 or scale.shape != scale_shape(q.shape):
        return dequantize_fused(q, scale, transpose, dtype)
    table, finite = _fp8_table(scale.astype(np.float32), dtype)
    finite = np.asarray(finite)
    if not finite[:, np.arange(256) & _NAN_CODE != _NAN_CODE].all():
        return dequantize_fused(q, scale, transpose, dtype)  # overflowing scales: rare, let XLA say
    table = np.asarray(table).view(uint).reshape(-1)
    rows, cols = q.shape
    blocks_per_row = scale.shape[1]
    codes = q.view(np.uint8)
    out = np.empty((cols, rows) if transpose else (rows, cols), uint)
    col_base = (np.arange(cols, dtype=np.int32) // BLOCK) * 256
    tile_cols = min(_TILE, cols)
    idx = np.empty((tile_cols, BLOCK) if transpose else (BLOCK, tile_cols), np.int32)
    vals = np.empty(idx.shape, uint)
    low = np.empty((BLOCK, tile_cols), np.uint8)
    nan = False
    for i in range(0, rows, BLOCK):
        row_base = (i // BLOCK) * blocks_per_row * 256
        for j in range(0, cols, tile_cols):
            tile = codes[i : i + BLOCK, j : j + tile_cols]
            n, m = tile.shape
            base = col_base[j : j + m] + row_base
            t = low[:n, :m]
            np.bitwise_and(tile, _NAN_CODE, out=t)
            nan = nan or bool(t.max() == _NAN_CODE)
            if transpose:
                np.add(base[:, None], tile.T, out=idx[:m, :n])
                np.take(table, idx[:m, :n], out=vals[:m, :n], mode="clip")
                out[j : j + m, i : i + n] = vals[:m, :n]
            else:
                np.add(base[None, :], tile, out=idx[:n, :m])
                np.take(table, idx[:n, :m], out=vals[:n, :m], mode="clip")
                out[i : i + n, j : j + m] = vals[:n, :m]
    return out.view(dtype), not nan



def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    """w [rows, cols] as float32 blocks [R, block, C, block], zero-padded at the edges."""
    rows, cols = w.shape
    r, _, c, _ = _blocked(w.shape, block)
    padded = np.zeros((r * block, c * block), np.float32)
    padded[:rows, :cols] = w.astype(np.float32)
    return padded.reshape(r, block, c, block)


def quantize_with_scale(w: np.ndarray, scale: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """e4m3(w / scale) per block (scale 0, an all-zero block, divides by 1), saturating at 448."""
    rows, cols = w.shape
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.clip(_blocks(w, block) / safe[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    return q.reshape(safe.shape[0] * block, safe.shape[1] * block)[:rows, :cols].astype(FP8_DTYPE)


def quantize(w: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's block quantization: scale = amax(block) / 448, q = e4m3(w / scale)."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    scale = (np.abs(_blocks(w, block)).max(axis=(1, 3)) / E4M3_MAX).astype(np.float32)
    return quantize_with_scale(w, scale, block), scale


def requantize(w: np.ndarray, scale_hint: np.ndarray | None, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Quantize `w` back to FP8, reusing `scale_hint` (the source's scales) for every block whose
    values it reproduces exactly: dequantize(q, hint) cast to w's dtype == w. Such blocks get
    their original e4m3 bytes back; blocks that changed get a fresh amax / 448 scale."""
    fresh_q, fresh_scale = quantize(w, block)
    if scale_hint is None:
        return fresh_q, fresh_scale
    hint_q = quantize_with_scale(w, scale_hint, block)
    same = dequantize(hint_q, scale_hint, block).astype(w.dtype) == w
    rows, cols = w.shape
    r, _, c, _ = _blocked(w.shape, block)
    padded = np.ones((r * block, c * block), bool)
    padded[:rows, :cols] = same
    keep = padded.reshape(r, block, c, block).all(axis=(1, 3))  # [R, C]
    keep_rows = np.repeat(np.repeat(keep, block, 0), block, 1)[:rows, :cols]
    q = np.where(keep_rows, hint_q.view(np.uint8), fresh_q.view(np.uint8)).view(FP8_DTYPE)
    return q, np.where(keep, scale_hint, fresh_scale).astype(np.float32)
