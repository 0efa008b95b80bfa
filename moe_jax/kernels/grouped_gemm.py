"""The one grouped-GEMM interface that every MoE expert matmul goes through.

`grouped_matmul(x[M, K], w[G, K, N], group_sizes[G]) -> [M, N]`: rows of `x` are sorted by
group; rows `[start_g, start_g + group_sizes[g])` are multiplied by `w[g]`. Group sizes stay
on the device (no host sync, jit-safe); rows past `sum(group_sizes)` come back as zeros.
Differentiable in `x` and `w`.

Backends (`BACKENDS`; `default_backend()` picks per platform):
- `ragged_dot`: XLA's `jax.lax.ragged_dot`; the default on GPU and TPU.
- `tiled`: rows scattered into fixed-size tiles, each group padded to a whole number of tiles
  (at most tile-1 padding rows per group), then one `[tile, K] @ w[g]` per tile in a scan;
  custom VJP (dx is the same kernel on w^T, dw accumulates tile by tile). The default on CPU,
  where ragged_dot is lowered as a masked dense dot over every group.
- `te`: Transformer Engine's `grouped_dense` (TE >= 2.20, GPU only, imported lazily).
- `capacity`: the capacity-factor baseline: fixed `capacity` rows per group, overflow dropped
  (zeros). For comparison only; `capacity_dropped` counts the dropped rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

DEFAULT_TILE = 128


# ---- ragged_dot --------------------------------------------------------------------------------
def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    out = jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))
    rows = jnp.arange(x.shape[0]) < group_sizes.sum()  # ragged_dot leaves rows past the groups unset
    return jnp.where(rows[:, None], out, 0).astype(out.dtype)


# ---- tiled -------------------------------------------------------------------------------------
def tile_plan(group_sizes: jax.Array, m: int, tile: int):
    """Where each sorted row goes in the tiled layout, and which group each tile belongs to.

    Returns (dest [M] int32: row in the padded layout, or num_tiles*tile if past the groups;
    tile_group [num_tiles] int32). num_tiles = ceil(M / tile) + G bounds sum(ceil(g / tile))."""
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
    dest = jnp.where(group < num_groups, dest, num_tiles * tile)
    tile_start = jnp.arange(num_tiles, dtype=jnp.int32) * tile
    tile_group = jnp.minimum(jnp.searchsorted(padded_ends, tile_start, side="right"), num_groups - 1)
    return dest.astype(jnp.int32), tile_group.astype(jnp.int32), num_tiles


def _tile_matmul_impl(xt: jax.Array, w: jax.Array, tile_group: jax.Array, transpose_w: bool = False) -> jax.Array:
    # XLA:CPU computes bf16 dots in float32 and, left alone, converts the whole [G, K, N] weight
    # to float32 before the loop (a float32 copy of every expert). Carrying the weight as raw
    # 16-bit integers and converting one expert's slice per tile keeps memory at the weight itself.
    narrow = jax.default_backend() == "cpu" and w.dtype.itemsize == 2
    w_loop = jax.lax.bitcast_convert_type(w, jnp.uint16) if narrow else w

    def body(_, inputs):
        x_tile, g = inputs
        w_g = jax.lax.dynamic_index_in_dim(w_loop, g, keepdims=False)
        if narrow:
            w_g = jax.lax.bitcast_convert_type(w_g, w.dtype).astype(jnp.float32)
        dims = (((1,), (1,) if transpose_w else (0,)), ((), ()))  # x_tile @ w_g (or @ w_g.T)
        y = jax.lax.dot_general(x_tile, w_g, dims, preferred_element_type=jnp.float32)
        return None, y.astype(xt.dtype)

    return jax.lax.scan(body, None, (xt, tile_group))[1]


def _tile_wgrad(xt: jax.Array, dyt: jax.Array, tile_group: jax.Array, num_groups: int) -> jax.Array:
    """sum over tiles of group g of xt^T @ dyt -> [G, K, N], accumulated in float32."""
    k, n = xt.shape[-1], dyt.shape[-1]

    def body(dw, inputs):
        x_tile, dy_tile, g = inputs
        contrib = jax.lax.dot_general(x_tile, dy_tile, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dw.at[g].add(contrib), None  # x_tile^T @ dy_tile, accumulated in place

    dw0 = jnp.zeros((num_groups, k, n), jnp.float32)
    return jax.lax.scan(body, dw0, (xt, dyt, tile_group))[0]


@jax.custom_vjp
def tile_matmul(xt: jax.Array, w: jax.Array, tile_group: jax.Array) -> jax.Array:
    """Rows already in the tiled layout: xt [T, tile, K] @ w[tile_group[t]] -> [T, tile, N]."""
    return _tile_matmul_impl(xt, w, tile_group)


def _tile_matmul_fwd(xt, w, tile_group):
    return _tile_matmul_impl(xt, w, tile_group), (xt, w, tile_group)


def _tile_matmul_bwd(res, dyt):
    xt, w, tile_group = res
    dx = _tile_matmul_impl(dyt, w, tile_group, transpose_w=True)  # no transposed copy of w
    dw = _tile_wgrad(xt, dyt, tile_group, w.shape[0]).astype(w.dtype)
    return dx, dw, None


tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)


def to_tiles(x: jax.Array, dest: jax.Array, num_tiles: int, tile: int) -> jax.Array:
    padded = jnp.zeros((num_tiles * tile, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
    return padded.reshape(num_tiles, tile, x.shape[1])


def from_tiles(yt: jax.Array, dest: jax.Array) -> jax.Array:
    return yt.reshape(-1, yt.shape[-1]).at[dest].get(mode="fill", fill_value=0)


def tiled(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int = DEFAULT_TILE) -> jax.Array:
    dest, tile_group, num_tiles = tile_plan(jnp.asarray(group_sizes), x.shape[0], tile)
    return from_tiles(tile_matmul(to_tiles(jnp.asarray(x), dest, num_tiles, tile), jnp.asarray(w), tile_group), dest)


# ---- capacity (baseline) -----------------------------------------------------------------------
def capacity_slots(m: int, num_groups: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * m / num_groups))


def capacity_dropped(group_sizes: jax.Array, capacity: int) -> jax.Array:
    """Rows the capacity baseline drops: those past `capacity` in their group."""
    return jnp.maximum(group_sizes - capacity, 0).sum()


def capacity(x: jax.Array, w: jax.Array, group_sizes: jax.Array, capacity_factor: float = 1.25) -> jax.Array:
    """Fixed `capacity_slots` rows per group in a batched matmul; rows past them are dropped."""
    m, num_groups = x.shape[0], w.shape[0]
    cap = capacity_slots(m, num_groups, capacity_factor)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    row = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(ends, row, side="right")
    g = jnp.minimum(group, num_groups - 1)
    pos = row - (ends[g] - sizes[g])
    slot = jnp.where((group < num_groups) & (pos < cap), g * cap + pos, num_groups * cap)
    xs = jnp.zeros((num_groups * cap, x.shape[1]), x.dtype).at[slot].set(x, mode="drop")
    ys = jnp.einsum("gck,gkn->gcn", xs.reshape(num_groups, cap, -1), w, preferred_element_type=jnp.float32)
    return ys.reshape(num_groups * cap, -1).astype(x.dtype).at[slot].get(mode="fill", fill_value=0)


# ---- Transformer Engine ------------------------------------------------------------------------
def aligned(fn, align: int):
    """Run grouped GEMM `fn` with every group padded to a multiple of `align` rows (zeros)."""

    def run(x, w, group_sizes):
        dest, _, num_tiles = tile_plan(group_sizes, x.shape[0], align)
        padded = jnp.zeros((num_tiles * align, x.shape[1]), x.dtype).at[dest].set(x, mode="drop")
        sizes = (group_sizes.astype(jnp.int32) + align - 1) // align * align
        return fn(padded, w, sizes).at[dest].get(mode="fill", fill_value=0)

    return run


def te_grouped_dense(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Transformer Engine's grouped GEMM (cuBLASLt; custom VJP with grouped dgrad and wgrad).

    Needs `transformer-engine[jax]` >= 2.20 and an NVIDIA GPU. Groups are padded to 128 rows,
    which TE's MXFP8 grouped GEMM requires (and BF16 tolerates). TE's FP8 recipes apply through
    its own autocast context around the step: Float8CurrentScaling on Hopper (the multi-stream
    "v1" path, which copies group sizes to the host), MXFP8BlockScaling on Blackwell (the
    cuBLASLt "v2" path: group sizes stay on the device, no bias).
    """
    try:
        from transformer_engine.jax.dense import grouped_dense
    except ImportError as e:
        raise RuntimeError("backend 'te' needs transformer-engine[jax] >= 2.20 on a CUDA machine") from e

    def call(x, w, sizes):
        return grouped_dense(x, w, sizes, contracting_dims=((1,), (1,)))

    return aligned(call, 128)(x, w, group_sizes)


BACKENDS = {"ragged_dot": ragged_dot, "tiled": tiled, "capacity": capacity, "te": te_grouped_dense}


def default_backend(platform: str | None = None) -> str:
    """The fastest correct backend we measured for the platform (see README, bench_moe)."""
    platform = platform or jax.default_backend()
    return "tiled" if platform == "cpu" else "ragged_dot"


def grouped_ffn(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, group_sizes: jax.Array,
                backend: str | None = None, tile: int = DEFAULT_TILE) -> jax.Array:
    """SwiGLU expert FFN over rows sorted by expert: down_g(silu(x gate_g) * x up_g).

    With `tiled`, rows are moved into the tiled layout once for all three GEMMs."""
    backend = backend or default_backend()
    x, gate, up, down, group_sizes = map(jnp.asarray, (x, gate, up, down, group_sizes))
    if backend == "tiled":
        dest, tile_group, num_tiles = tile_plan(group_sizes, x.shape[0], tile)
        xt = to_tiles(x, dest, num_tiles, tile)
        h = jax.nn.silu(tile_matmul(xt, gate, tile_group)) * tile_matmul(xt, up, tile_group)
        return from_tiles(tile_matmul(h, down, tile_group), dest)
    h = jax.nn.silu(grouped_matmul(x, gate, group_sizes, backend)) * grouped_matmul(x, up, group_sizes, backend)
    return grouped_matmul(h, down, group_sizes, backend)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, backend: str | None = None) -> jax.Array:
    """`backend`: a name from BACKENDS, optionally with "+mxfp8" (e.g. "tiled+mxfp8") to run it
    with MXFP8 quantize-dequantize where Transformer Engine quantizes (moe_jax.quant.mxfp8)."""
    backend = backend or default_backend()
    name, _, quant = backend.partition("+")
    if name not in BACKENDS or quant not in ("", "mxfp8"):
        raise ValueError(f"unknown grouped-GEMM backend {backend!r} (have: {', '.join(BACKENDS)}, each +mxfp8)")
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    if quant == "mxfp8":
        from moe_jax.quant.mxfp8 import mxfp8_grouped_matmul

        return mxfp8_grouped_matmul(x, w, group_sizes, name)
    return BACKENDS[name](x, w, group_sizes)
