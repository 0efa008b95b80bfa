"""compressed-tensors' pack-quantized INT4 weights (Kimi-K2-Thinking, Kimi-K2.5's routed experts).

A weight `W` [out, in] is stored as three tensors beside where `W` would be:
- `W_packed` int32 [out, ceil(in / 8)]: signed 4-bit codes q in [-8, 7], stored as q + 8, eight per
  int32 along the input dimension, the first in the lowest bits;
- `W_scale` (bf16, f16 or f32) [out, in / group]: one scale per `group` consecutive inputs;
- `W_shape` int32 (or int64) [2]: [out, in].
The weight is q * scale in the scale's dtype (the exact product rounded once, as the library
decompresses it), then cast to the dtype asked for. Fresh quantization follows the library's min-max observer: scale =
max|w| / 7.5 over the group, q = clamp(round_half_even(w / scale), -8, 7).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

PACKED, SCALE, SHAPE = "_packed", "_scale", "_shape"
SUFFIXES = (PACKED, SCALE, SHAPE)
DTYPE = "I4"  # the pseudo safetensors dtype a reader gives a packed weight (safetensors has none)
PER_WORD = 8
Q_MIN, Q_MAX = -8, 7
SCALE_DTYPES = ("BF16", "F16", "F32")
SHAPE_DTYPES = ("I32", "I64")


def components(name: str) -> list[str]:
    """The stored tensors of packed weight `name` (e.g. `...gate_proj.weight`)."""
    return [name + s for s in SUFFIXES]


def packed_base(name: str) -> str | None:
    """`...weight` for `...weight_packed`, else None."""
    return name[: -len(PACKED)] if name.endswith(PACKED) else None


def packed_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return shape[0], -(-shape[1] // PER_WORD)


def scale_shape(shape: tuple[int, int], group: int) -> tuple[int, int]:
    return shape[0], shape[1] // group


def unpack(packed: np.ndarray, cols: int) -> np.ndarray:
    """int8 codes [out, cols] from int32 words [out, ceil(cols / 8)] (little-endian bytes)."""
    data = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8)  # [out, words * 4]
    codes = np.empty((*data.shape, 2), np.int8)  # a byte's low nibble first
    np.bitwise_and(data, 0xF, out=codes[..., 0], casting="unsafe")
    np.right_shift(data, 4, out=codes[..., 1], casting="unsafe")
    codes -= 8
    return codes.reshape(data.shape[0], -1)[:, :cols]


def pack(codes: np.ndarray) -> np.ndarray:
    """int32 words from int8 codes [out, in] in [-8, 7] (zero codes pad the last word)."""
    rows, cols = codes.shape
    padded = np.zeros((rows, -(-cols // PER_WORD) * PER_WORD), np.uint32)
    padded[:, :cols] = (codes.astype(np.int32) + 8).astype(np.uint32)
    nibbles = padded.reshape(rows, -1, PER_WORD) << (4 * np.arange(PER_WORD, dtype=np.uint32))
    return np.bitwise_or.reduce(nibbles, axis=2).view(np.int32)


def dequantize(
    packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int], dtype=np.float32
) -> tuple[np.ndarray, bool]:
    """(weight [out, in] in `dtype`; every scale finite)."""
    w = times_scale(unpack(packed, shape[1]), scale).astype(dtype)
    return w, bool(np.isfinite(scale.astype(np.float32)).all())


def times_scale(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """codes [out, in] times their groups' scales, in the scales' dtype (exact in float32 first:
    a 4-bit code times a scale of 24 bits or fewer)."""
    rows, cols = codes.shape
    group = cols // scale.shape[1]
    product = codes.reshape(rows, -1, group).astype(np.float32) * scale.astype(np.float32)[:, :, None]
    return product.reshape(rows, cols).astype(scale.dtype)


def fresh_scale(w: np.ndarray, group: int, scale_dtype) -> np.ndarray:
    """The library's min-max scale: max|w| / 7.5 per group (an all-zero group gets the dtype's eps)."""
    rows, cols = w.shape
    amax = np.abs(w.astype(np.float32).reshape(rows, cols // group, group)).max(axis=2)
    scale = (amax / np.float32(7.5)).astype(scale_dtype)
    return np.where(scale == 0, ml_dtypes.finfo(scale_dtype).eps, scale).astype(scale_dtype)


def codes_for(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """clamp(round_half_even(w / scale), -8, 7) per group, in float32."""
    rows, cols = w.shape
    group = cols // scale.shape[1]
    x = w.astype(np.float32).reshape(rows, -1, group) / scale.astype(np.float32)[:, :, None]
    return np.clip(np.rint(x), Q_MIN, Q_MAX).astype(np.int8).reshape(rows, cols)


def quantize(w: np.ndarray, group: int, scale_dtype) -> tuple[np.ndarray, np.ndarray]:
    """(packed int32, scales) of `w` [out, in], freshly quantized."""
    scale = fresh_scale(w, group, scale_dtype)
    return pack(codes_for(w, scale)), scale


def requantize(w: np.ndarray, hint: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed, scales): each group whose values `hint` (the source's scales)
    reproduces exactly keeps its scale and so its original codes; a group that moved is
    quantized afresh. `w` is in the dtype the weights were loaded in."""
    rows, cols = w.shape
    hint_codes = codes_for(w, hint)
    same = (times_scale(hint_codes, hint).astype(w.dtype) == w).reshape(rows, -1, group).all(axis=2)
    if same.all():
        return pack(hint_codes), hint
    scale = np.where(same, hint, fresh_scale(w, group, hint.dtype)).astype(hint.dtype)
    return pack(codes_for(w, scale)), scale
