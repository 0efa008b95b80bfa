"""Grouped GEMM backends, dispatch/combine and MXFP8 against naive loops and numpy."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_jax.config import ModelConfig
from moe_jax.kernels import mgpu
from moe_jax.kernels.grouped_gemm import (
    DEFAULT_TILES,
    aligned,
    aligned_ffn,
    capacity,
    capacity_dropped,
    capacity_slots,
    default_backend,
    grouped_ffn,
    grouped_matmul,
    ragged_dot,
    resolve_backend,
    tiled,
    tiled_grads,
    window_plan,
)
from moe_jax.moe import combine, dispatch, moe_layer, routed_experts
from moe_jax.quant import mxfp8


@pytest.fixture(autouse=True, scope="module")
def highest_matmul_precision():
    """Full float32 matmuls for this module's comparisons, for this module alone: set for the whole
    process, it would change every other test's compilations (and their cache keys) as well."""
    with jax.default_matmul_precision("highest"):
        yield


def naive(x, w, sizes):
    """Row by row: y[i] = x[i] @ w[group of i]; rows past the groups are zero."""
    y = np.zeros((x.shape[0], w.shape[2]))
    row = 0
    for g, n in enumerate(sizes):
        for _ in range(n):
            y[row] = x[row].astype(np.float64) @ w[g].astype(np.float64)
            row += 1
    return y


def naive_grads(x, w, sizes, dy):
    dx, dw = np.zeros(x.shape), np.zeros(w.shape)
    row = 0
    for g, n in enumerate(sizes):
        for _ in range(n):
            dx[row] = dy[row] @ w[g].T
            dw[g] += np.outer(x[row], dy[row])
            row += 1
    return dx, dw


ROUTINGS = {
    "random_with_empty": [7, 0, 13, 0, 1, 30, 2, 0],
    "one_takes_all": [0, 0, 53, 0, 0, 0, 0, 0],
    "tile_multiple": [16, 16, 0, 16, 0, 0, 0, 0],
    "short_of_m": [5, 3, 0, 9, 0, 0, 1, 0],  # rows past sum(group_sizes) must come back as zeros
}
# (mgpu is ragged_dot on the CPU and for shapes its kernels do not tile; its kernels are checked in
# the Pallas interpreter below, compiled in tests/test_gpu_compile.py, run by scripts/gpu_check.sh)
BACKENDS = ["ragged_dot", "tiled", "tiled4", "tiled8,3", "capacity_ample", "aligned128"]


def run(backend, x, w, sizes):
    if backend.startswith("tiled") and backend != "tiled":  # window sizes forced: one, or 8 then 3
        return tiled(x, w, sizes, tiles=tuple(int(t) for t in backend[5:].split(",")))
    if backend == "capacity_ample":  # enough slots that nothing drops
        return capacity(x, w, sizes, capacity_factor=float(w.shape[0]))
    if backend == "aligned128":  # the padding the TE backend applies, around ragged_dot
        return aligned(ragged_dot, 128)(x, w, sizes)
    return grouped_matmul(x, w, sizes, backend)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_equals_naive_loop(backend, routing):
    sizes = np.array(ROUTINGS[routing], np.int32)
    rng = np.random.default_rng(0)
    m = 53  # not a multiple of any tile
    x = rng.standard_normal((m, 12)).astype(np.float32)
    w = rng.standard_normal((8, 12, 5)).astype(np.float32)
    dy = rng.standard_normal((m, 5)).astype(np.float32)
    f = jax.jit(lambda x, w, s: run(backend, x, w, s))
    np.testing.assert_allclose(np.asarray(f(x, w, sizes)), naive(x, w, sizes), atol=1e-4, rtol=1e-5)
    dx, dw = jax.grad(lambda x, w: (f(x, w, sizes) * dy).sum(), argnums=(0, 1))(x, w)
    want_dx, want_dw = naive_grads(x, w, sizes, dy)
    np.testing.assert_allclose(np.asarray(dx), want_dx, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), want_dw, atol=1e-4, rtol=1e-5)


def test_tiled_weight_gradient_alone():
    """The weight gradient without the input gradient's GEMMs (Blackwell's mgpu backward runs it)."""
    sizes = np.array(ROUTINGS["random_with_empty"], np.int32)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((53, 12)).astype(np.float32), rng.standard_normal((8, 12, 5)).astype(np.float32)
    dy = rng.standard_normal((53, 5)).astype(np.float32)
    dx, dw = jax.jit(lambda x, w, s, dy: tiled_grads(x, w, s, dy, tiles=(8, 3), input_grad=False))(x, w, sizes, dy)
    assert dx is None
    np.testing.assert_allclose(np.asarray(dw), naive_grads(x, w, sizes, dy)[1], atol=1e-4, rtol=1e-5)


def test_capacity_drops_overflow_and_counts_it():
    sizes = np.array([40, 2, 0, 6], np.int32)
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((48, 6)).astype(np.float32), rng.standard_normal((4, 6, 3)).astype(np.float32)
    cap = capacity_slots(48, 4, 1.0)  # 12 slots per expert
    y = np.asarray(capacity(x, w, sizes, capacity_factor=1.0))
    want = naive(x, w, sizes)
    kept = np.r_[np.arange(12), np.arange(40, 48)]
    np.testing.assert_allclose(y[kept], want[kept], atol=1e-4)
    assert np.all(y[12:40] == 0)
    assert int(capacity_dropped(sizes, cap)) == 28


def test_group_sizes_stay_on_device():
    """Jit with abstract group sizes: no host round trip is possible, and none is needed."""
    x, w = jnp.ones((20, 4)), jnp.ones((3, 4, 2))
    for backend in ("ragged_dot", "tiled", "capacity"):
        jaxpr = jax.make_jaxpr(lambda s: grouped_matmul(x, w, s, backend))(jnp.array([5, 5, 10], jnp.int32))
        assert "callback" not in str(jaxpr)


def test_backend_names_resolve_in_one_place():
    assert resolve_backend(None) == (default_backend(), False)
    assert resolve_backend("tiled+mxfp8") == ("tiled", True)
    x, w, sizes = jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.array([2, 2], jnp.int32)
    for bad in ("tiledd", "tiled+fp4", "tiled+"):
        for call in (lambda: grouped_matmul(x, w, sizes, bad), lambda: grouped_ffn(x, w, w, w, sizes, bad)):
            with pytest.raises(ValueError, match=r"valid: ragged_dot, tiled, mgpu, capacity, te, ragged_dot\+mxfp8, "):
                call()


# ---- dispatch and combine ---------------------------------------------------------------------
def test_moe_layer_equals_per_token_loop():
    cfg = ModelConfig.from_hf_dict(
        dict(
            model_type="deepseek_v3",
            vocab_size=16,
            hidden_size=8,
            intermediate_size=8,
            moe_intermediate_size=6,
            num_hidden_layers=1,
            num_attention_heads=1,
            kv_lora_rank=4,
            qk_nope_head_dim=4,
            qk_rope_head_dim=2,
            v_head_dim=4,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=0,
            n_shared_experts=0,
            routed_scaling_factor=2.5,
        )
    )
    rng = np.random.default_rng(2)
    p = {
        "router": rng.standard_normal((8, 8)).astype(np.float32),
        "experts": {
            k: rng.standard_normal(s).astype(np.float32) * 0.5
            for k, s in (("gate", (8, 8, 6)), ("up", (8, 8, 6)), ("down", (8, 6, 8)))
        },
    }
    bias = rng.standard_normal(8).astype(np.float32) * 0.1
    x = rng.standard_normal((37, 8)).astype(np.float32)
    for backend in ("ragged_dot", "tiled"):
        y, r = moe_layer(p, bias, x, cfg, jnp.float32, backend)
        want = np.zeros((37, 8))
        for t in range(37):
            for e, wt in zip(np.asarray(r.experts[t]), np.asarray(r.weights[t])):
                h = x[t] @ p["experts"]["gate"][e]
                h = h / (1 + np.exp(-h)) * (x[t] @ p["experts"]["up"][e])
                want[t] += wt * (h @ p["experts"]["down"][e])
        np.testing.assert_allclose(np.asarray(y), want, atol=1e-4, rtol=1e-4)


def test_dispatch_sorts_by_expert_and_combine_inverts_it():
    experts = jnp.array([[3, 0], [1, 3], [0, 2]], jnp.int32)
    x = jnp.arange(3 * 2, dtype=jnp.float32).reshape(3, 2)
    xs, d = dispatch(x, experts, 4)
    np.testing.assert_array_equal(np.asarray(d.group_sizes), [2, 1, 1, 2])
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(x)[[0, 2, 1, 2, 0, 1]])
    weights = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out = combine(xs, d, weights)  # identity experts: each token gets sum(weights) * itself
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * np.asarray(weights).sum(1, keepdims=True))
    # an id of -1 (an expert on another rank, under expert parallelism) sorts last, in no group
    xs, d = dispatch(x, jnp.array([[3, -1], [1, 3], [-1, 2]], jnp.int32), 4)
    np.testing.assert_array_equal(np.asarray(d.group_sizes), [0, 1, 1, 2])
    np.testing.assert_array_equal(np.asarray(xs)[:4], np.asarray(x)[[1, 2, 0, 1]])


# ---- MXFP8 -------------------------------------------------------------------------------------
def numpy_mxfp8(x: np.ndarray):
    """Reference: per block of 32 along the last axis, scale = 2^ceil(log2(amax / 448))."""
    rows, k = x.shape
    q = np.zeros(x.shape, ml_dtypes.float8_e4m3fn)
    scales = np.zeros((rows, -(-k // 32)), np.uint8)
    for r in range(rows):
        for b in range(scales.shape[1]):
            blk = x[r, b * 32 : (b + 1) * 32].astype(np.float32)
            amax = float(np.abs(blk).max())
            if amax == 0:
                e = 0
            else:
                m, e = math.frexp(np.float32(amax / np.float32(448.0)))
                e = e - 1 if m == 0.5 else e
            scales[r, b] = e + 127
            q[r, b * 32 : (b + 1) * 32] = (blk * np.float32(2.0**-e)).astype(ml_dtypes.float8_e4m3fn)
    return q, scales


def test_mxfp8_quantize_matches_numpy_bit_for_bit():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((9, 70)) * np.exp(rng.uniform(-12, 12, (9, 1)))).astype(np.float32)
    x[2, :32] = 0  # an all-zero block
    x[4, 5] = 448.0 * 2.0**3  # an exact power-of-two amax
    q, s = mxfp8.quantize(jnp.asarray(x))
    want_q, want_s = numpy_mxfp8(x)
    np.testing.assert_array_equal(np.asarray(s), want_s)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    assert np.isfinite(np.asarray(q).astype(np.float32)).all()  # nothing overflowed e4m3
    deq = np.asarray(mxfp8.dequantize(q, s))
    np.testing.assert_array_equal(
        deq, want_q.astype(np.float32) * np.exp2(want_s.astype(np.float32) - 127).repeat(32, 1)[:, :70]
    )


def test_mxfp8_row_blocks_restart_at_group_boundaries():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, 3)).astype(np.float32)
    x[:10] *= 1000.0  # group 0 is large; a block spanning into group 1 would crush its values
    sizes = jnp.array([10, 30], jnp.int32)
    got = np.asarray(mxfp8.qdq_rows_grouped(jnp.asarray(x), sizes))
    want = np.concatenate(
        [np.asarray(mxfp8.qdq(jnp.asarray(x[:10]), axis=0)), np.asarray(mxfp8.qdq(jnp.asarray(x[10:]), axis=0))]
    )
    np.testing.assert_array_equal(got, want)
    assert np.abs(got[10:] - x[10:]).max() < 0.1


def test_mxfp8_gemm_forward_and_gradients():
    sizes = np.array([7, 0, 20, 5], np.int32)
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((4, 64, 48)).astype(np.float32)
    dy = rng.standard_normal((32, 48)).astype(np.float32)
    f = jax.jit(lambda x, w: grouped_matmul(x, w, sizes, "tiled+mxfp8"))  # one compilation, not one per op
    y = np.asarray(f(x, w))
    want = naive(np.asarray(mxfp8.qdq(jnp.asarray(x), 1)), np.asarray(mxfp8.qdq(jnp.asarray(w), 1)), sizes)
    np.testing.assert_allclose(y, want, atol=1e-3, rtol=1e-5)
    exact = naive(x, w, sizes)
    rel = np.abs(y - exact).max() / np.abs(exact).max()
    assert 1e-4 < rel < 0.1  # quantized, and only by e4m3's precision
    dx, dw = jax.grad(lambda x, w: (f(x, w) * dy).sum(), argnums=(0, 1))(x, w)
    want_dx, want_dw = naive_grads(x, w, sizes, dy)
    for got, ref in ((dx, want_dx), (dw, want_dw)):
        rel = np.abs(np.asarray(got) - ref).max() / np.abs(ref).max()
        assert 1e-4 < rel < 0.1


def plan_windows(plan, m):
    """(group, size, lo, hi) of every window of a `window_plan`, in the order the loop runs them."""
    first, count, end = (np.asarray(a) for a in (plan.first, plan.count, plan.end))
    for g in np.asarray(plan.order)[: int(plan.used)]:
        for level, size in enumerate(plan.tiles):
            for i in range(count[g, level]):
                lo = first[g, level] + i * size
                yield g, size, lo, min(lo + size, end[g])


@pytest.mark.parametrize("seed", range(4))
def test_window_plan_covers_each_group_once_with_little_waste(seed):
    """Every row of every group is owned by exactly one window of its group; a window wastes under
    a quarter of its size (under the smallest size, for the smallest); rows past the groups are
    owned by none; the loop visits only groups with rows, each once, in row order."""
    rng = np.random.default_rng(seed)
    m, g = 5000, 16
    sizes = np.floor(rng.dirichlet(np.full(g, 0.3)) * (m - 7)).astype(np.int32)  # some rows past the groups
    sizes[seed] = 0  # an empty group
    owner = np.full(m, -1)
    plan = window_plan(jnp.asarray(sizes), m, DEFAULT_TILES)
    for group, size, lo, hi in plan_windows(plan, m):
        assert 0 < hi - lo <= size and np.all(owner[lo:hi] == -1)
        owner[lo:hi] = group
        assert size - (hi - lo) < (size if size == min(DEFAULT_TILES) else size / 4)
    np.testing.assert_array_equal(owner[: sizes.sum()], np.repeat(np.arange(g), sizes))
    assert np.all(owner[sizes.sum() :] == -1)
    np.testing.assert_array_equal(np.asarray(plan.order)[: int(plan.used)], np.flatnonzero(sizes))


def naive_ffn(x, ws, sizes, dy):
    """Row by row in float64: y = down_g(silu(x gate_g) * x up_g), and its gradients for dy."""
    gate, up, down = (w.astype(np.float64) for w in ws)
    y, dx, grads = np.zeros(dy.shape), np.zeros(x.shape), [np.zeros(w.shape) for w in ws]
    group = np.repeat(np.arange(len(sizes)), sizes)
    for row, g in enumerate(group):
        xr = x[row].astype(np.float64)
        a, b = xr @ gate[g], xr @ up[g]
        s = 1 / (1 + np.exp(-a))
        h = a * s * b
        y[row] = h @ down[g]
        dh = dy[row] @ down[g].T
        da, db = dh * b * s * (1 + a * (1 - s)), dh * a * s
        grads[2][g] += np.outer(h, dy[row])
        grads[0][g] += np.outer(xr, da)
        grads[1][g] += np.outer(xr, db)
        dx[row] = da @ gate[g].T + db @ up[g].T
    return y, dx, grads


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("tiles", [DEFAULT_TILES, (4,), (8, 3), (16, 8, 4, 2)])
def test_tiled_ffn_equals_naive_loop(tiles, routing):
    """The fused expert FFN (one loop step per window for all three GEMMs, custom VJP)."""
    sizes = np.array(ROUTINGS[routing], np.int32)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((53, 16)).astype(np.float32)
    ws = [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in ((8, 16, 6), (8, 16, 6), (8, 6, 16))]
    dy = rng.standard_normal((53, 16)).astype(np.float32)
    # the group sizes an argument, as in the model (not a constant): one compilation per `tiles`
    f = jax.jit(lambda x, *ws, sizes: grouped_ffn(x, *ws, sizes, "tiled", tiles=tiles))
    y, pullback = jax.vjp(functools.partial(f, sizes=sizes), x, *ws)
    want_y, want_dx, want_dws = naive_ffn(x, ws, sizes, dy)
    np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-4, rtol=1e-5)
    for got, want in zip(pullback(dy), [want_dx, *want_dws]):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_aligned_ffn_equals_naive_loop(routing):
    """The FFN as the TE backend runs it (rows padded to the group alignment once for all three
    GEMMs), around ragged_dot: equal to the row-by-row loop, and with row weights to the FFN
    whose down projection takes the weighted rows."""
    sizes = np.array(ROUTINGS[routing], np.int32)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((53, 16)).astype(np.float32)
    ws = [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in ((8, 16, 6), (8, 16, 6), (8, 6, 16))]
    dy = rng.standard_normal((53, 16)).astype(np.float32)
    f = jax.jit(lambda x, *ws, sizes: aligned_ffn(ragged_dot, 8)(x, *ws, sizes))
    y, pullback = jax.vjp(functools.partial(f, sizes=sizes), x, *ws)
    want_y, want_dx, want_dws = naive_ffn(x, ws, sizes, dy)
    np.testing.assert_allclose(np.asarray(y), want_y, atol=1e-4, rtol=1e-5)
    for got, want in zip(pullback(dy), [want_dx, *want_dws]):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-5)
    rw = rng.uniform(0.1, 2, 53).astype(np.float32)
    got = jax.jit(lambda *a: aligned_ffn(ragged_dot, 8)(*a, row_weights=rw))(x, *ws, sizes)
    np.testing.assert_allclose(np.asarray(got), grouped_ffn(x, *ws, sizes, "ragged_dot", row_weights=rw), atol=1e-5)


def test_tiled_bf16_weights_stay_16_bit():
    """bf16 experts: same result as the composed ragged_dot path, and no float32 copy of the
    stacked weights in the compiled loop (XLA:CPU would otherwise convert all of them)."""
    sizes = jnp.array([9, 0, 30, 1, 0, 13, 0, 0], jnp.int32)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((53, 16)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.3, jnp.bfloat16) for s in ((8, 16, 6), (8, 16, 6), (8, 6, 16))]
    f = jax.jit(lambda x, *ws: grouped_ffn(x, *ws, sizes, "tiled", tiles=(8, 3)))
    want = grouped_ffn(x, *ws, sizes, "ragged_dot")
    np.testing.assert_allclose(np.asarray(f(x, *ws), np.float32), np.asarray(want, np.float32), atol=0.05, rtol=0.02)
    hlo = f.lower(x, *ws).compile().as_text()
    assert "f32[8,16,6]" not in hlo and "f32[8,6,16]" not in hlo


def test_hopper_kernel_in_the_pallas_gpu_interpreter(monkeypatch):
    """The forward kernel of backend "mgpu" on Hopper (jax's Mosaic GPU `ragged_dot_mgpu`, our block
    configuration) run by Pallas's GPU interpreter on the CPU: against the row-by-row loop, with an
    empty group and rows past the last group. (In jax 0.10.2 the interpreter lacks operations the
    input- and weight-gradient kernels and Blackwell's use; scripts/gpu_check.sh checks those on
    a GPU, and tests/test_gpu_compile.py that they compile.)"""
    monkeypatch.setattr(plgpu, "kernel", functools.partial(plgpu.kernel, interpret=InterpretGPUParams()))
    rng = np.random.default_rng(7)
    sizes = np.array([100, 0, 56, 90])  # 246 of 256 rows
    x = rng.standard_normal((256, 128)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((4, 128, 256)).astype(ml_dtypes.bfloat16)
    got = np.asarray(mgpu.hopper_ragged_dot(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes, jnp.int32)), np.float32)
    want = naive(x.astype(np.float32), w.astype(np.float32), sizes)
    # bf16 output: rounding of 2^-8 relative (measured 0.125 on values up to 55)
    np.testing.assert_allclose(got[: sizes.sum()], want[: sizes.sum()], atol=2**-8 * np.abs(want).max())


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("routing", ["random", "one_expert_takes_all", "held_elsewhere"])
def test_receiver_dispatch_straight_into_aligned_groups_equals_per_token_loop(routing, align):
    """An expert-parallel receiver's rows (moe_jax.moe.routed_experts with `pairs`), dispatched
    straight into groups that start at multiples of `align` (as Transformer Engine's grouped GEMM
    takes them, 128 there): outputs and gradients against the per-token loop, on a routing where
    one expert takes every row and one where most choices are held by other ranks (-1)."""
    rng = np.random.default_rng(3)
    t, k, e, h, f = 23, 3, 5, 8, 6
    experts = np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    if routing == "one_expert_takes_all":
        experts[:, 0], experts[:, 1:] = 2, -1
    if routing == "held_elsewhere":
        experts[rng.random((t, k)) < 0.7] = -1
    pairs = int((experts >= 0).sum())
    weights = rng.uniform(0.1, 1, (t, k)).astype(np.float32)
    x = rng.standard_normal((t, h)).astype(np.float32)
    p = {
        n: (rng.standard_normal(s) * 0.4).astype(np.float32)
        for n, s in (("gate", (e, h, f)), ("up", (e, h, f)), ("down", (e, f, h)))
    }
    dy = rng.standard_normal((t, h)).astype(np.float32)

    def loop(x, p):
        out = jnp.zeros((t, h))
        for i in range(t):
            for j in range(k):
                if experts[i, j] >= 0:
                    g = experts[i, j]
                    act = jax.nn.silu(x[i] @ p["gate"][g]) * (x[i] @ p["up"][g])
                    out = out.at[i].add(weights[i, j] * (act @ p["down"][g]))
        return out

    def ours(x, p):
        return routed_experts(
            x, jnp.asarray(experts), jnp.asarray(weights), p, e, jnp.float32, "ragged_dot", pairs, align
        )

    y, pull = jax.vjp(jax.jit(ours), x, p)
    want, want_pull = jax.vjp(loop, x, p)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), atol=1e-5, rtol=1e-5)
    for got, ref in zip(jax.tree.leaves(pull(dy)), jax.tree.leaves(want_pull(dy))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-5)
    xs, d = dispatch(jnp.asarray(x), jnp.asarray(experts), e, pairs, align)
    starts = np.concatenate([[0], np.cumsum(np.asarray(d.group_sizes))[:-1]])
    assert (starts % align == 0).all() and xs.shape[0] % align == 0
