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
QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [BLOCK, BLOCK],
    "activation_scheme": "dynamic",
}


def scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    rows, cols = shape
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def dequantize(q: np.ndarray, scale: np.ndarray, transpose: bool = False, dtype=np.float32) -> tuple[np.ndarray, bool]:
    """(weight, every value finite) from e4m3 values [out, in] and their block scales: each value
    times its block's scale (partial edge blocks included) as a float32 product with XLA's
    semantics (denormals flushed), optionally transposed, cast to `dtype`. By table lookup where
    it can, else in one XLA pass: the same bits."""
    if q.ndim != 2 or scale.shape != scale_shape(q.shape):
        raise ValueError(f"scale shape {scale.shape} does not match weight {q.shape} in {BLOCK}-blocks")
    dtype, scale = np.dtype(dtype), scale.astype(np.float32)
    if dtype.itemsize in UINT_OF_SIZE:
        table, finite = _fp8_table(scale, dtype)
        if np.asarray(finite)[:, _NOT_NAN].all():  # else an overflowing scale: rare, let XLA say
            return _dequantize_table(q, np.asarray(table), transpose)
    w, finite = _dequantize_xla(q, scale, transpose, dtype)
    return np.asarray(w), bool(finite)


@functools.partial(jax.jit, static_argnames=("transpose", "dtype"))
def _dequantize_xla(q, scale, transpose: bool, dtype):
    if transpose:  # transposing the 1-byte values first is twice as fast as transposing the output
        q, scale = q.T, scale.T
    rows, cols = q.shape
    r, c = scale.shape
    w = q.astype(jnp.float32)
    if (rows, cols) != (r * BLOCK, c * BLOCK):
        w = jnp.pad(w, ((0, r * BLOCK - rows), (0, c * BLOCK - cols)))
    w = (w.reshape(r, BLOCK, c, BLOCK) * scale[:, None, :, None]).reshape(r * BLOCK, c * BLOCK)[:rows, :cols]
    return w.astype(dtype), jnp.isfinite(w).all()


# A 128x128 block of e4m3 codes shares one scale, so it takes at most 256 distinct values: XLA
# computes those (block x code) products exactly as `_dequantize_xla` computes every element
# (float32 product, denormals flushed as XLA does, rounded to the target dtype), and numpy
# gathers them into place tile by tile, transposing in cache. Same bits, 2-3x less CPU than the
# fused XLA transpose (the converter's largest CPU cost on this 2-core machine).
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(FP8_DTYPE).astype(np.float32)
_NAN_CODE = 0x7F  # e4m3fn's only NaN, with either sign; it has no Inf
_NOT_NAN = np.arange(256) & _NAN_CODE != _NAN_CODE  # codes of numbers
UINT_OF_SIZE = {2: np.uint16, 4: np.uint32}  # same-size unsigned views, for fast copies
_TILE = 2048  # columns per tile: 128 x 2048 codes and their int32 indices stay in L2


@functools.partial(jax.jit, static_argnames="dtype")
def _fp8_table(scale, dtype):
    """[blocks, 256]: every code's value in every block, in `dtype`; and which are finite."""
    w = jnp.asarray(_E4M3_VALUES)[None, :] * scale.reshape(-1, 1)
    return w.astype(dtype), jnp.isfinite(w)


def _dequantize_table(q: np.ndarray, table: np.ndarray, transpose: bool) -> tuple[np.ndarray, bool]:
    """q's values gathered from `_fp8_table` (of a finite-valued scale); False if q has a NaN code."""
    dtype, uint = table.dtype, UINT_OF_SIZE[table.dtype.itemsize]
    table = table.view(uint).reshape(-1)
    rows, cols = q.shape
    blocks_per_row = -(-cols // BLOCK)
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


def _blocks(w: np.ndarray) -> np.ndarray:
    """w [rows, cols] as float32 blocks [R, 128, C, 128], zero-padded at the edges."""
    rows, cols = w.shape
    r, c = scale_shape(w.shape)
    padded = np.zeros((r * BLOCK, c * BLOCK), np.float32)
    padded[:rows, :cols] = w.astype(np.float32)
    return padded.reshape(r, BLOCK, c, BLOCK)


def quantize_with_scale(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3(w / scale) per block (scale 0, an all-zero block, divides by 1), saturating at 448."""
    rows, cols = w.shape
    safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.clip(_blocks(w) / safe[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    return q.reshape(safe.shape[0] * BLOCK, safe.shape[1] * BLOCK)[:rows, :cols].astype(FP8_DTYPE)


def quant_config(scale_fmt: str | None = None) -> dict:
    """config.json's quantization_config of a DeepSeek FP8 checkpoint, with its scale format."""
    return {**QUANT_CONFIG, "scale_fmt": scale_fmt} if scale_fmt else dict(QUANT_CONFIG)


def power_of_two_at_least(scale: np.ndarray) -> np.ndarray:
    """Each scale rounded up to a power of two (UE8M0, as DeepSeek's `scale_fmt: ue8m0` rounds
    its scales: the block's amax still fits e4m3); zero stays zero."""
    scale = np.asarray(scale, np.float32)
    with np.errstate(divide="ignore"):
        return np.where(scale > 0, np.exp2(np.ceil(np.log2(scale))), np.float32(0)).astype(np.float32)


def quantize(w: np.ndarray, scale_fmt: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's block quantization: scale = amax(block) / 448 (with `scale_fmt` "ue8m0", rounded
    up to a power of two), q = e4m3(w / scale)."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    scale = (np.abs(_blocks(w)).max(axis=(1, 3)) / E4M3_MAX).astype(np.float32)
    if scale_fmt == "ue8m0":
        scale = power_of_two_at_least(scale)
    return quantize_with_scale(w, scale), scale


def requantize(
    w: np.ndarray, scale_hint: np.ndarray | None, scale_fmt: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize `w` back to FP8, reusing `scale_hint` (the source's scales) for every block whose
    values it reproduces exactly: dequantize(q, hint) cast to w's dtype == w. Such blocks get
    their original e4m3 bytes back; blocks that changed get a fresh scale (`quantize`)."""
    fresh_q, fresh_scale = quantize(w, scale_fmt)
    if scale_hint is None:
        return fresh_q, fresh_scale
    hint_q = quantize_with_scale(w, scale_hint)
    same = dequantize(hint_q, scale_hint)[0].astype(w.dtype) == w
    rows, cols = w.shape
    r, c = scale_shape(w.shape)
    padded = np.ones((r * BLOCK, c * BLOCK), bool)
    padded[:rows, :cols] = same
    keep = padded.reshape(r, BLOCK, c, BLOCK).all(axis=(1, 3))  # [R, C]
    keep_rows = np.repeat(np.repeat(keep, BLOCK, 0), BLOCK, 1)[:rows, :cols]
    q = np.where(keep_rows, hint_q.view(np.uint8), fresh_q.view(np.uint8)).view(FP8_DTYPE)
    return q, np.where(keep, scale_hint, fresh_scale).astype(np.float32)
