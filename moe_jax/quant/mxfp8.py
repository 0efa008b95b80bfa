"""MXFP8 (OCP microscaling) in pure JAX: e4m3 values, one E8M0 power-of-two scale per 32
consecutive elements along the contraction axis, as Blackwell tensor cores and Transformer
Engine's MXFP8BlockScaling use them.

The scale of a block is the smallest power of two with amax / scale <= 448 (rounded up, so
nothing overflows e4m3); an all-zero block gets scale 1. Quantizing along the token axis is
group-aware: blocks restart at every expert boundary, so no block mixes two experts' rows (the
rows are laid out with every group padded to a multiple of the block, `tile_plan`; Transformer
Engine's grouped GEMM pads its groups the same way).

The grouped GEMM that quantizes where TE does is `moe_jax.kernels.grouped_gemm`'s "+mxfp8".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127


def _scale_exponent(amax: jax.Array) -> jax.Array:
    """ceil(log2(amax / 448)) exactly (via frexp), 0 for an all-zero block; int32."""
    mantissa, exponent = jnp.frexp(amax.astype(jnp.float32) / E4M3_MAX)  # v = m * 2^e, m in [0.5, 1)
    exp = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # exact powers of two need no rounding up
    return jnp.where(amax > 0, jnp.clip(exp, -E8M0_BIAS, E8M0_BIAS), 0).astype(jnp.int32)


def _blocks_last(x: jax.Array, block: int = BLOCK) -> tuple[jax.Array, int]:
    """x [..., K] -> [..., ceil(K/block), block] (zero-padded), and K."""
    k = x.shape[-1]
    pad = -k % block
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, block), k


def quantize(x: jax.Array, axis: int = -1, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """(e4m3 values shaped like x, E8M0 scales as uint8 [.., ceil(K/block)] along `axis`). MXFP8
    is block 32; the expert-parallel FP8 dispatch also uses 128 (DeepSeek-V3's 1x128 tiles)."""
    xm = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    blocks, k = _blocks_last(xm, block)
    exp = _scale_exponent(jnp.abs(blocks).max(-1))
    q = jnp.ldexp(blocks, -exp[..., None]).astype(jnp.float8_e4m3fn)  # exact scaling by 2^-e
    q = q.reshape(*q.shape[:-2], -1)[..., :k]
    return jnp.moveaxis(q, -1, axis), jnp.moveaxis((exp + E8M0_BIAS).astype(jnp.uint8), -1, axis)


def dequantize(q: jax.Array, scales: jax.Array, axis: int = -1, dtype=jnp.float32, block: int = BLOCK) -> jax.Array:
    qm = jnp.moveaxis(q, axis, -1)
    blocks, k = _blocks_last(qm.astype(jnp.float32), block)
    exp = jnp.moveaxis(scales, axis, -1).astype(jnp.int32) - E8M0_BIAS
    out = jnp.ldexp(blocks, exp[..., None]).reshape(*blocks.shape[:-2], -1)[..., :k]
    return jnp.moveaxis(out, -1, axis).astype(dtype)


def qdq(x: jax.Array, axis: int = -1) -> jax.Array:
    """Quantize to MXFP8 along `axis` and back, in x's dtype."""
    return dequantize(*quantize(x, axis), axis=axis, dtype=x.dtype)


# ---- rows sorted by group, every group padded to a multiple of `tile` rows ---------------------
def tile_plan(group_sizes: jax.Array, m: int, tile: int):
    """Where each sorted row goes when every group is padded to a multiple of `tile` rows.

    Returns (dest [M] int32: row in the padded layout, or num_tiles*tile if past the groups;
    num_tiles). num_tiles = ceil(M / tile) + G bounds sum(ceil(g / tile))."""
    num_groups = group_sizes.shape[0]
    num_tiles = -(-m // tile) + num_groups
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    padded = (sizes + tile - 1) // tile * tile
    padded_ends = jnp.cumsum(padded)
    row = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(ends, row, side="right")  # [M], G for rows past the groups
    g = jnp.minimum(group, num_groups - 1)
    dest = padded_ends[g] - padded[g] + row - (ends[g] - sizes[g])
    return jnp.where(group < num_groups, dest, num_tiles * tile).astype(jnp.int32), num_tiles


def to_padded(x: jax.Array, dest: jax.Array, num_rows: int) -> jax.Array:
    return jnp.zeros((num_rows, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")


def from_padded(y: jax.Array, dest: jax.Array) -> jax.Array:
    return y.at[dest].get(mode="fill", fill_value=0)


def qdq_rows_grouped(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """qdq along the row (token) axis of x [M, K] sorted by group; blocks never span groups."""
    dest, num_tiles = tile_plan(group_sizes, x.shape[0], BLOCK)
    return from_padded(qdq(to_padded(x, dest, num_tiles * BLOCK), axis=0), dest)
