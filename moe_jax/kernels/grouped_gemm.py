"""The one grouped-GEMM interface that every MoE expert matmul goes through.

`grouped_matmul(x[M, K], w[G, K, N], group_sizes[G]) -> [M, N]`: rows of `x` are sorted by
group; rows `[start_g, start_g + group_sizes[g])` are multiplied by `w[g]`. Group sizes stay
on the device (no host sync, jit-safe); rows past `sum(group_sizes)` come back as zeros.
Differentiable in `x` and `w`.

Backends (`BACKENDS`; `default_backend()` picks per platform, `resolve_backend` checks a name):
- `mgpu`: jax's Pallas Mosaic GPU grouped GEMMs (moe_jax.kernels.mgpu: Hopper and Blackwell,
  forward, input and weight gradients); the default on NVIDIA GPUs. Shapes or GPUs they do not
  fit run as `ragged_dot`.
- `ragged_dot`: XLA's `jax.lax.ragged_dot`; the default on TPU. On GPUs XLA lowers it as a dense
  dot over every group, masked (G times the useful FLOPs, an [M, G, K] temporary).
- `tiled`: a loop over the groups, and in each over windows of its sorted rows, each
  `[window, K] @ w[g]` with the group's weight; windows of 1024 rows, and of 512 down to 8 for
  what is left of a group, so little is computed and discarded (see below), and nothing is copied
  into a padded layout. Custom VJPs; the expert FFN runs gate, up and down of a window in one
  loop step (`tiled_ffn`). The default on CPU, where ragged_dot is lowered as a masked dense dot
  over every group.
- `te`: Transformer Engine's `grouped_dense` (moe_jax.kernels.te: TE >= 2.20, NVIDIA GPUs or a
  deviceless target; imported only when used). `te+mxfp8` is TE's own MXFP8 grouped GEMM
  (Blackwell), quantizing in TE's kernels.
- `capacity`: the capacity-factor baseline: fixed `capacity` rows per group, overflow dropped
  (zeros). For comparison only; `capacity_dropped` counts the dropped rows.
Each also as "<name>+mxfp8" (e.g. "tiled+mxfp8"): the same GEMMs on MXFP8 quantize-dequantized
operands where Transformer Engine quantizes (`mxfp8_grouped_matmul`, moe_jax.quant.mxfp8); for
`te` it is TE's real MXFP8 GEMM.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax import gpu
from moe_jax.kernels import mgpu, te
from moe_jax.quant import mxfp8


# ---- ragged_dot --------------------------------------------------------------------------------
def rows_in_groups(y: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """y with the rows past the last group zeroed (kernels leave them unwritten)."""
    valid = jnp.arange(y.shape[0]) < group_sizes.sum()
    return jnp.where(valid[:, None], y, 0).astype(y.dtype)


def ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return rows_in_groups(jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32)), group_sizes)


# ---- tiled -------------------------------------------------------------------------------------
# Windows of rows of the expert-sorted x, each multiplied by its expert's weight in a loop. Window
# sizes come in classes (1024, 512, ..., 8): a group's rows go in as many windows of the largest
# size as they fill, and what is left goes down the classes, one window of a class taking the rest
# if it fills three quarters of it; the smallest class takes whatever is left. So a group wastes at
# most a quarter of a window of compute (under 8 rows at the smallest class), and it takes few
# windows: each window of the backward adds its weight gradient into the group's, an [K, N] read
# and write that costs as much as a 64-row GEMM, so small windows are dear. Nothing is copied into
# a padded layout: a window is a slice of x at the group's offset, and its result is merged back
# under a mask of the rows it owns.
#
# The loop runs over the groups that have rows, and inside a group over its windows (trip counts
# computed on the device). XLA:CPU copies a dynamically indexed slice before a dot reads it, so an
# expert's weights are sliced once per group, not once per window: with skewed routing a group
# takes several windows (a big one and a small one for what is left), and those copies (6 MB per
# window for an expert FFN at width 1024 x 512, float32) were the largest memory-bound part of
# the loop, which does not speed up with more cores as its GEMMs do.
DEFAULT_TILES = (1024, 512, 256, 128, 64, 32, 16, 8)


class Plan(NamedTuple):
    tiles: tuple[int, ...]  # window sizes, descending (static)
    order: jax.Array  # [G] int32: the groups that have rows first, in row order
    used: jax.Array  # int32 scalar: how many groups have rows
    first: jax.Array  # [G, len(tiles)] int32: first row of a group's windows of each size
    count: jax.Array  # [G, len(tiles)] int32: how many windows of each size a group takes
    end: jax.Array  # [G] int32: one past a group's last row


def window_plan(group_sizes: jax.Array, m: int, tiles=DEFAULT_TILES) -> Plan:
    """The windows that cover every group: per group, how many of each size and where they start."""
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    tiles = tuple(sorted({t for t in tiles if t <= m} or {max(m, 1)}, reverse=True))  # a window never exceeds x
    covered = jnp.zeros_like(sizes)  # rows of each group taken by larger windows
    first, count = [], []
    for level, size in enumerate(tiles):
        left = sizes - covered
        full, rest = left // size, left % size
        last_window = rest > 0 if level == len(tiles) - 1 else 4 * rest > 3 * size  # one more takes the rest
        first.append(starts + covered)
        count.append(full + last_window)
        covered = covered + full * size + last_window * rest
    order = jnp.argsort(sizes == 0, stable=True).astype(jnp.int32)
    return Plan(tiles, order, (sizes > 0).sum(), jnp.stack(first, 1), jnp.stack(count, 1), starts + sizes)


def for_each_group(plan: Plan, m: int, body, carry):
    """carry = body(g, windows, carry) for every group g that has rows. `windows(window_body,
    carry)` runs carry = window_body(start, mask, carry) over the group's windows: rows [start,
    start + size) of x, of which `mask` [size, 1] marks those the window owns (a window at the end
    of x starts earlier so that it fits; its extra rows are not its own)."""
    if m == 0:
        return carry

    def group_step(j, carry):
        g = plan.order[j]

        def windows(window_body, carry):
            for level, size in enumerate(plan.tiles):

                def step(i, carry, level=level, size=size):
                    lo = plan.first[g, level] + i * size
                    start = jnp.minimum(lo, m - size)
                    row = start + jnp.arange(size)
                    mask = (row >= lo) & (row < jnp.minimum(lo + size, plan.end[g]))
                    return window_body(start, mask[:, None], carry)

                carry = jax.lax.fori_loop(0, plan.count[g, level], step, carry)
            return carry

        return body(g, windows, carry)

    return jax.lax.fori_loop(0, plan.used, group_step, carry)


def rows(a: jax.Array, start, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(a, start, size)


def merge(buf: jax.Array, start, mask: jax.Array, new: jax.Array) -> jax.Array:
    """buf with the masked rows of the window at `start` replaced by `new`."""
    old = rows(buf, start, new.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(mask, new.astype(buf.dtype), old), start, 0)


def summed_over_windows(windows, window_body, carry, sums: tuple[jax.Array, ...], g):
    """Run `windows` with window_body(start, mask, carry, group_sums) -> (carry, group_sums), the
    group's sums (one [K, N] float32 per array of `sums`, from zero) carried through its windows,
    then written into sums[i][g] once. (Adding each window into sums[i][g] in place made XLA:GPU
    copy the expert's slice out before every add: 1.6 s a step of the B200 671B plan.)"""
    zeros = tuple(jnp.zeros(a.shape[1:], a.dtype) for a in sums)
    carry, group_sums = windows(lambda start, mask, c: window_body(start, mask, *c), (carry, zeros))
    return carry, tuple(jax.lax.dynamic_update_index_in_dim(a, s, g, 0) for a, s in zip(sums, group_sums))


def expert_weights(w: jax.Array):
    """w[g] for a traced g, without a float32 copy of every expert.

    XLA:CPU computes bf16 dots in float32 and, left alone, converts the whole [G, K, N] weight to
    float32 before the loop. Carrying 16-bit weights as raw integers and converting one expert's
    slice per group keeps memory at the weight itself."""
    if jax.default_backend() != "cpu" or w.dtype.itemsize != 2:
        return lambda g: jax.lax.dynamic_index_in_dim(w, g, keepdims=False)
    raw = jax.lax.bitcast_convert_type(w, jnp.uint16)
    return lambda g: jax.lax.bitcast_convert_type(jax.lax.dynamic_index_in_dim(raw, g, keepdims=False), w.dtype)


def dot(a, b, contract=(1, 0)):
    """a @ b contracting a's axis contract[0] with b's contract[1]; float32 accumulation."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x, w, group_sizes, tiles):
    m, weight = x.shape[0], expert_weights(w)

    def group(g, windows, y):
        w_g = weight(g)

        def window(start, mask, y):
            return merge(y, start, mask, dot(rows(x, start, mask.shape[0]), w_g).astype(x.dtype))

        return windows(window, y)

    return for_each_group(window_plan(group_sizes, m, tiles), m, group, jnp.zeros((m, w.shape[2]), x.dtype))


def _tiled_fwd(x, w, group_sizes, tiles):
    return _tiled(x, w, group_sizes, tiles), (x, w, group_sizes)


def _tiled_bwd(tiles, res, dy):
    x, w, group_sizes = res
    dx, dw = tiled_grads(x, w, group_sizes, dy, tiles)
    return dx, dw.astype(w.dtype), None


def tiled_grads(x, w, group_sizes, dy, tiles=DEFAULT_TILES, input_grad: bool = True):
    """(dx, dw in float32) of `tiled(x, w, group_sizes)` for the cotangent dy; dx is None without
    `input_grad` (its GEMMs are not run: XLA does not drop them from the nested loops by itself)."""
    m, weight = x.shape[0], expert_weights(w)

    def group(g, windows, carry):
        w_g = weight(g) if input_grad else None
        dx, dw = carry

        def window(start, mask, dx, sums):
            (dw_g,) = sums
            dy_w = jnp.where(mask, rows(dy, start, mask.shape[0]), 0)  # rows the window owns, others 0
            if input_grad:
                dx = merge(dx, start, mask, dot(dy_w, w_g, (1, 1)))
            return dx, (dw_g + dot(rows(x, start, mask.shape[0]), dy_w, (0, 0)),)

        dx, (dw,) = summed_over_windows(windows, window, dx, (dw,), g)
        return dx, dw

    carry = (jnp.zeros_like(x) if input_grad else None, jnp.zeros(w.shape, jnp.float32))
    return for_each_group(window_plan(group_sizes, m, tiles), m, group, carry)


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def tiled(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tiles=DEFAULT_TILES) -> jax.Array:
    return _tiled(x, w, group_sizes, tuple(tiles))


def _silu_grad(a):
    s = jax.nn.sigmoid(a)
    return s * (1 + a * (1 - s))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def tiled_ffn(x, gate, up, down, group_sizes, tiles):
    """down_g(silu(x gate_g) * x up_g) with all three GEMMs of a window in one loop step."""
    return _tiled_ffn_forward(x, gate, up, down, group_sizes, tiles, keep=False)[0]


def _tiled_ffn_forward(x, gate, up, down, group_sizes, tiles, keep: bool):
    """The FFN; with keep, also the gate and up projections [M, N] for the backward."""
    m, n = x.shape[0], gate.shape[2]
    weights = [expert_weights(w) for w in (gate, up, down)]

    def group(g, windows, carry):
        wg, wu, wd = (weight(g) for weight in weights)

        def window(start, mask, carry):
            y, a_all, b_all = carry
            x_w = rows(x, start, mask.shape[0])
            a, b = dot(x_w, wg).astype(x.dtype), dot(x_w, wu).astype(x.dtype)
            y = merge(y, start, mask, dot(jax.nn.silu(a) * b, wd))
            if keep:
                a_all, b_all = merge(a_all, start, mask, a), merge(b_all, start, mask, b)
            return y, a_all, b_all

        return windows(window, carry)

    kept = jnp.zeros((m, n) if keep else (0, n), x.dtype)
    carry = (jnp.zeros((m, down.shape[2]), x.dtype), kept, kept)
    return for_each_group(window_plan(group_sizes, m, tiles), m, group, carry)


def _tiled_ffn_fwd(x, gate, up, down, group_sizes, tiles):
    y, a, b = _tiled_ffn_forward(x, gate, up, down, group_sizes, tiles, keep=True)
    return y, (x, gate, up, down, group_sizes, a, b)


def _tiled_ffn_bwd(tiles, res, dy):
    x, gate, up, down, group_sizes, a_all, b_all = res
    m = x.shape[0]
    weights = [expert_weights(w) for w in (gate, up, down)]

    def group(g, windows, carry):
        wg, wu, wd = (weight(g) for weight in weights)
        dx, *sums = carry

        def window(start, mask, dx, sums):
            dgate, dup, ddown = sums
            size = mask.shape[0]
            dy_w = jnp.where(mask, rows(dy, start, size), 0)  # rows the window owns, others 0
            x_w, a, b = rows(x, start, size), rows(a_all, start, size), rows(b_all, start, size)
            silu = jax.nn.silu(a)
            ddown = ddown + dot((silu * b).astype(x.dtype), dy_w, (0, 0))
            dh = dot(dy_w, wd, (1, 1))
            da, db = (dh * b * _silu_grad(a)).astype(x.dtype), (dh * silu).astype(x.dtype)
            dgate, dup = dgate + dot(x_w, da, (0, 0)), dup + dot(x_w, db, (0, 0))
            dx = merge(dx, start, mask, dot(da, wg, (1, 1)) + dot(db, wu, (1, 1)))
            return dx, (dgate, dup, ddown)

        dx, sums = summed_over_windows(windows, window, dx, tuple(sums), g)
        return (dx, *sums)

    carry = (jnp.zeros_like(x), *(jnp.zeros(w.shape, jnp.float32) for w in (gate, up, down)))
    dx, dgate, dup, ddown = for_each_group(window_plan(group_sizes, m, tiles), m, group, carry)
    return dx, dgate.astype(gate.dtype), dup.astype(up.dtype), ddown.astype(down.dtype), None


tiled_ffn.defvjp(_tiled_ffn_fwd, _tiled_ffn_bwd)


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
def aligned_rows(group_sizes: jax.Array, m: int, align: int):
    """(pad, unpad, padded group sizes): rows [M, ...] sorted by group to the layout where every
    group is padded to a multiple of `align` rows (zeros), and back."""
    dest, num_tiles = mxfp8.tile_plan(group_sizes, m, align)
    sizes = (group_sizes.astype(jnp.int32) + align - 1) // align * align
    return (lambda a: mxfp8.to_padded(a, dest, num_tiles * align)), (lambda a: mxfp8.from_padded(a, dest)), sizes


def aligned(fn, align: int):
    """Run grouped GEMM `fn` with every group padded to a multiple of `align` rows (zeros)."""

    def run(x, w, group_sizes):
        pad, unpad, sizes = aligned_rows(group_sizes, x.shape[0], align)
        return unpad(fn(pad(x), w, sizes))

    return run


def aligned_ffn(fn, align: int):
    """The SwiGLU expert FFN (`grouped_ffn`) on grouped GEMM `fn`, which needs every group padded
    to a multiple of `align` rows: the rows padded once for all three GEMMs and unpadded once at
    the end (zero rows stay zero through the FFN), where padding each GEMM's input and unpadding
    its output took three scatters and three gathers over the rows, and as many in the backward."""

    def run(x, gate, up, down, group_sizes, row_weights=None):
        pad, unpad, sizes = aligned_rows(group_sizes, x.shape[0], align)
        padded_weights = None if row_weights is None else pad(row_weights[:, None])[:, 0]
        return unpad(swiglu(fn, pad(x), gate, up, down, sizes, padded_weights))

    return run


def swiglu(fn, x, gate, up, down, group_sizes, row_weights=None):
    """down_g(silu(x gate_g) * x up_g) with grouped GEMM `fn`, each row of the down projection's
    input times its `row_weights` where given."""
    h = jax.nn.silu(fn(x, gate, group_sizes)) * fn(x, up, group_sizes)
    if row_weights is not None:
        h = (h * row_weights[:, None]).astype(x.dtype)
    return fn(h, down, group_sizes)


def te_grouped_dense(x: jax.Array, w: jax.Array, group_sizes: jax.Array, mxfp8: bool = False) -> jax.Array:
    """Transformer Engine's grouped GEMM (moe_jax.kernels.te: cuBLASLt, its own custom VJP; MXFP8
    on Blackwell with `mxfp8`), each group padded to te.GROUP_ALIGN rows."""
    return aligned(functools.partial(te.grouped_dense, mxfp8=mxfp8), te.GROUP_ALIGN)(x, w, group_sizes)


# ---- Pallas Mosaic GPU -------------------------------------------------------------------------
def mgpu_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """jax's Pallas Mosaic GPU grouped GEMMs (moe_jax.kernels.mgpu) where the GPU and the shape
    suit them; XLA's `ragged_dot` elsewhere."""
    if not mgpu.supports(x, w):
        return ragged_dot(x, w, group_sizes)
    return _mgpu(x, w, group_sizes)


@jax.custom_vjp
def _mgpu(x, w, group_sizes):
    sizes = group_sizes.astype(jnp.int32)
    gemm = mgpu.hopper_ragged_dot if mgpu.architecture() == "hopper" else mgpu.blackwell_ragged_dot
    return rows_in_groups(gemm(x, w, sizes), sizes)


def _mgpu_fwd(x, w, group_sizes):
    return _mgpu(x, w, group_sizes), (x, w, group_sizes)


def _mgpu_bwd(res, dy):
    x, w, group_sizes = res
    sizes = group_sizes.astype(jnp.int32)
    dy = rows_in_groups(dy, sizes)
    if mgpu.architecture() == "hopper":
        dx = mgpu.hopper_ragged_dot(dy, w, sizes, transpose_rhs=True)
        dw = mgpu.hopper_weight_grad(x, dy, sizes)
    else:  # no Blackwell weight-gradient kernel in jax: tiled's windows compute it
        dx = mgpu.blackwell_ragged_dot(dy, jnp.swapaxes(w, 1, 2), sizes)
        dw = tiled_grads(x, w, sizes, dy, input_grad=False)[1]
    return rows_in_groups(dx, sizes), dw.astype(w.dtype), None


_mgpu.defvjp(_mgpu_fwd, _mgpu_bwd)


BACKENDS = {
    "ragged_dot": ragged_dot,
    "tiled": tiled,
    "mgpu": mgpu_grouped_matmul,
    "capacity": capacity,
    "te": te_grouped_dense,
}


# ---- +mxfp8 ------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def mxfp8_grouped_matmul(x, w, group_sizes, name: str):
    """BACKENDS[name] with MXFP8 quantize-dequantize in the places TE quantizes: forward x and w
    along K; backward dgrad dy and w along N, wgrad x and dy along the token axis (group-aware).
    It lets the numerical effect of an MXFP8 run be studied on any machine."""
    return BACKENDS[name](mxfp8.qdq(x, axis=1), mxfp8.qdq(w, axis=1), group_sizes)


def _mxfp8_fwd(x, w, group_sizes, name):
    return mxfp8_grouped_matmul(x, w, group_sizes, name), (x, w, group_sizes)


def _mxfp8_bwd(name, res, dy):
    x, w, group_sizes = res
    gemm = BACKENDS[name]
    # dgrad: dy [M, N] @ w^T, both quantized along N
    dx = gemm(mxfp8.qdq(dy, axis=1), jnp.swapaxes(mxfp8.qdq(w, axis=2), 1, 2), group_sizes)
    # wgrad: x^T dy per group, both quantized along the token axis, blocks within each group
    xq, dyq = mxfp8.qdq_rows_grouped(x, group_sizes), mxfp8.qdq_rows_grouped(dy, group_sizes)
    _, pullback = jax.vjp(lambda w_: gemm(xq, w_, group_sizes), w)
    (dw,) = pullback(dyq)
    return dx, dw, None


mxfp8_grouped_matmul.defvjp(_mxfp8_fwd, _mxfp8_bwd)


# ---- the interface -----------------------------------------------------------------------------
def default_backend() -> str:
    """The fastest correct backend here: `mgpu` on NVIDIA GPUs (a real one or the deviceless
    target being compiled for, moe_jax.gpu), `tiled` on CPU (see docs/gpu.md, bench_moe), `ragged_dot`
    elsewhere."""
    if gpu.capability() is not None:
        return "mgpu"
    return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"


def resolve_backend(backend: str | None = None) -> tuple[str, bool]:
    """(name in BACKENDS, whether to quantize to MXFP8) for a backend name such as "tiled" or
    "tiled+mxfp8"; None is the platform's default. ValueError naming the valid ones otherwise."""
    backend = backend or default_backend()
    name, plus, quant = backend.partition("+")
    if name not in BACKENDS or (plus and quant != "mxfp8"):
        valid = ", ".join([*BACKENDS, *(f"{n}+mxfp8" for n in BACKENDS)])
        raise ValueError(f"unknown grouped-GEMM backend {backend!r}; valid: {valid}")
    return name, bool(plus)


def row_alignment(backend: str | None) -> int:
    """Rows each expert's group must start at a multiple of for `backend`'s grouped GEMM."""
    return te.GROUP_ALIGN if resolve_backend(backend)[0] == "te" else 1


def check_runs_here(backend: str | None) -> None:
    """ValueError if `backend` cannot run on this machine's devices: Transformer Engine needs an
    NVIDIA GPU (without one it only compiles for a deviceless target, moe_jax.gpu), and its MXFP8
    a Blackwell one."""
    name, quantized = resolve_backend(backend)
    cc = gpu.capability()
    if name == "te" and cc is None:
        raise ValueError(
            f"{backend!r} runs Transformer Engine, which needs an NVIDIA GPU; this machine has none "
            "(it can only compile for a deviceless GPU target, moe_jax.gpu)"
        )
    if name == "te" and quantized:
        te.require_mxfp8(cc, f"{backend!r} (TE's MXFP8 grouped GEMM)")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, backend: str | None = None) -> jax.Array:
    """x [M, K] sorted by group, w [G, K, N], group_sizes [G] -> [M, N] with `backend`
    (`resolve_backend`)."""
    name, quantized = resolve_backend(backend)
    x, w, group_sizes = jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes)
    if name == "te":  # TE quantizes itself, in its own kernels
        return te_grouped_dense(x, w, group_sizes, mxfp8=quantized)
    if quantized:
        return mxfp8_grouped_matmul(x, w, group_sizes, name)
    return BACKENDS[name](x, w, group_sizes)


def grouped_ffn(
    x: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    group_sizes: jax.Array,
    backend: str | None = None,
    tiles=DEFAULT_TILES,
    row_weights: jax.Array | None = None,
    rows_aligned: bool = False,
) -> jax.Array:
    """SwiGLU expert FFN over rows sorted by expert: down_g(silu(x gate_g) * x up_g), each row
    times its `row_weights` [M] where given. The weight scales the down projection's input (the
    projection is linear), so the backward needs no copy of the output to differentiate it.

    With `tiled`, one loop runs all three GEMMs of each window (`tiled_ffn`); with Transformer
    Engine, the rows are padded to its group alignment once for all three (`aligned_ffn`), unless
    `rows_aligned`: every group already starts at a multiple of `row_alignment(backend)` rows
    (as `moe_jax.moe.dispatch(..., align)` lays them)."""
    name, quantized = resolve_backend(backend)
    x, gate, up, down, group_sizes = map(jnp.asarray, (x, gate, up, down, group_sizes))
    if name == "tiled" and not quantized:
        y = tiled_ffn(x, gate, up, down, group_sizes, tuple(tiles))
        return y if row_weights is None else (y * row_weights[:, None]).astype(y.dtype)
    if name == "te":
        te_gemm = functools.partial(te.grouped_dense, mxfp8=quantized)
        if rows_aligned:
            return swiglu(te_gemm, x, gate, up, down, group_sizes, row_weights)
        return aligned_ffn(te_gemm, te.GROUP_ALIGN)(x, gate, up, down, group_sizes, row_weights)
    return swiglu(functools.partial(grouped_matmul, backend=backend), x, gate, up, down, group_sizes, row_weights)
