"""MXFP8 (OCP microscaling) in pure JAX: e4m3 values, one E8M0 power-of-two scale per 32
consecutive elements along the contraction axis, as Blackwell tensor cores and Transformer
Engine's MXFP8BlockScaling use them.

The scale of a block is the smallest power of two with amax / scale <= 448 (rounded up, so
nothing overflows e4m3); an all-zero block gets scale 1. Quantizing along the token axis is
group-aware: blocks restart at every expert boundary, so no block mixes two experts' rows.

`mxfp8_grouped_matmul` runs the expert GEMMs with quantize-dequantize in the places TE
quantizes: forward x and w along K; backward dgrad dy and w along N, wgrad x and dy along the
token axis (group-aware). It lets the numerical effect of an MXFP8 run be studied on any machine.
"""

from __future__ import annotations

import functools

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


def _blocks_last(x: jax.Array) -> tuple[jax.Array, int]:
    """x [..., K] -> [..., ceil(K/32), 32] (zero-padded), and K."""
    k = x.shape[-1]
    pad = -k % BLOCK
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, BLOCK), k


def quantize(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """(e4m3 values shaped like x, E8M0 scales as uint8 [.., ceil(K/32)] along `axis`)."""
    xm = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    blocks, k = _blocks_last(xm)
    exp = _scale_exponent(jnp.abs(blocks).max(-1))
    q = jnp.ldexp(blocks, -exp[..., None]).astype(jnp.float8_e4m3fn)  # exact scaling by 2^-e
    q = q.reshape(*q.shape[:-2], -1)[..., :k]
    return jnp.moveaxis(q, -1, axis), jnp.moveaxis((exp + E8M0_BIAS).astype(jnp.uint8), -1, axis)


def dequantize(q: jax.Array, scales: jax.Array, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    qm = jnp.moveaxis(q, axis, -1)
    blocks, k = _blocks_last(qm.astype(jnp.float32))
    exp = jnp.moveaxis(scales, axis, -1).astype(jnp.int32) - E8M0_BIAS
    out = jnp.ldexp(blocks, exp[..., None]).reshape(*blocks.shape[:-2], -1)[..., :k]
    return jnp.moveaxis(out, -1, axis).astype(dtype)


def qdq(x: jax.Array, axis: int = -1) -> jax.Array:
    """Quantize to MXFP8 along `axis` and back, in x's dtype."""
    return dequantize(*quantize(x, axis), axis=axis, dtype=x.dtype)


def qdq_rows_grouped(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """qdq along the row (token) axis of x [M, K] sorted by group; blocks never span groups."""
    from moe_jax.kernels.grouped_gemm import from_padded, tile_plan, to_padded

    dest, num_tiles = tile_plan(group_sizes, x.shape[0], BLOCK)
    return from_padded(qdq(to_padded(x, dest, num_tiles * BLOCK), axis=0), dest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def mxfp8_grouped_matmul(x, w, group_sizes, backend: str):
    from moe_jax.kernels.grouped_gemm import grouped_matmul

    return grouped_matmul(qdq(x, axis=1), qdq(w, axis=1), group_sizes, backend)


def _fwd(x, w, group_sizes, backend):
    return mxfp8_grouped_matmul(x, w, group_sizes, backend), (x, w, group_sizes)


def _bwd(backend, res, dy):
    from moe_jax.kernels.grouped_gemm import grouped_matmul

    x, w, group_sizes = res
    # dgrad: dy [M, N] @ w^T, both quantized along N
    dx = grouped_matmul(qdq(dy, axis=1), jnp.swapaxes(qdq(w, axis=2), 1, 2), group_sizes, backend)
    # wgrad: x^T dy per group, both quantized along the token axis, blocks within each group
    xq, dyq = qdq_rows_grouped(x, group_sizes), qdq_rows_grouped(dy, group_sizes)
    _, pullback = jax.vjp(lambda w_: grouped_matmul(xq, w_, group_sizes, backend), w)
    (dw,) = pullback(dyq)
    return dx, dw, None


mxfp8_grouped_matmul.defvjp(_fwd, _bwd)
