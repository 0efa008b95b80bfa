"""Expert FFN (gate, up, down with SiLU) on every grouped-GEMM backend, beside one dense GEMM
of the same FLOPs measured in the same run; balanced and skewed routings; forward and
forward+backward (gradients for a random cotangent, in both); medians of back-to-back ratios.
Also the capacity baseline's dropped rows, and the MXFP8 mode's logit error against BF16 on the
tiny model. Prints tables, writes JSON.

The ratios depend on the cores XLA gets: the dense GEMM speeds up with every core, while the
grouped loop also copies rows and weights and fills buffers, work bound by memory that does not.
The same code measures 5 to 10 points higher against dense on one core than on two idle ones,
so the JSON and the table's header give the CPUs this process ran on and the load average
before and after; `--cpus N` runs on the first N of them.

    .venv/bin/python scripts/bench_moe.py --out runs/bench_moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax
from converters.tiny import make_tiny
from moe_jax.kernels.grouped_gemm import capacity_dropped, capacity_slots, grouped_ffn
from moe_jax.measure import benchmark_parser
from validation.parity import logit_metrics

ROUTINGS = ("balanced", "dirichlet0.3", "one_takes_half", "balanced_plus8")


def routing(name: str, m: int, g: int, rng) -> np.ndarray:
    if name == "balanced_plus8":  # balanced but for 8 rows: every other group takes an extra 8-row window
        return np.resize([m // g + 8, m // g - 8], g).astype(np.int32)
    if name == "balanced":
        p = np.full(g, 1 / g)
    elif name == "dirichlet0.3":
        p = rng.dirichlet(np.full(g, 0.3))
    elif name == "one_takes_half":
        p = np.full(g, 0.5 / (g - 1))
        p[0] = 0.5
    else:
        raise ValueError(name)
    sizes = np.floor(p * m).astype(np.int64)
    sizes[np.argmax(p)] += m - sizes.sum()
    return sizes.astype(np.int32)


def elapsed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))  # numpy's results pass through
    return time.perf_counter() - t0


def side_by_side(dense, dense_args, fn, args, repeats: int) -> tuple[float, float, float]:
    """Medians of (dense time, fn time, dense/fn) over `repeats` back-to-back pairs, so that the
    machine's drift hits both sides of each ratio alike."""
    jax.block_until_ready(dense(*dense_args)), jax.block_until_ready(fn(*args))  # compile, warm up
    pairs = [(elapsed(dense, *dense_args), elapsed(fn, *args)) for _ in range(repeats)]
    dense_s, fn_s = statistics.median(d for d, _ in pairs), statistics.median(f for _, f in pairs)
    return dense_s, fn_s, statistics.median(d / f for d, f in pairs)


def with_backward(f, num_diff: int):
    """f's output and its gradients in its first `num_diff` arguments for a random cotangent, as
    a training step needs them. (With `f(...).sum()` the cotangent is all ones and XLA folds the
    dense GEMM's backward into row and column sums: 30% faster than a real one, measured.)"""

    def run(dy, *args):
        out, pullback = jax.vjp(lambda *diff: f(*diff, *args[num_diff:]), *args[:num_diff])
        return out, pullback(dy)

    return jax.jit(run)


def ffn(backend):
    """The expert FFN as the MoE layer runs it; "tiled512/64" forces window sizes 512 then 64."""
    if backend.startswith("tiled") and backend[5:]:
        tiles = tuple(int(t) for t in backend[5:].split("/"))
        return lambda x, a, b, c, s: grouped_ffn(x, a, b, c, s, "tiled", tiles=tiles)
    return lambda x, a, b, c, s: grouped_ffn(x, a, b, c, s, backend)


def equal_groups_loops(g: int):
    """XLA:CPU's best case for a loop over groups, the ceilings `tiled` is measured against
    (`--references`): equal groups (rows split evenly by a reshape), no windows or masks. Returns
    jitted (forward, forward+backward in one pass, forward then backward): one pass runs each
    group's forward and backward in one loop step, sharing its gate and up projections, which no
    autodiff can do (it runs the whole forward first); forward then backward keeps them in a
    forward loop for a backward loop, as a custom VJP must. Signatures as `ffn`'s."""

    def silu_and_slope(a):
        s = jax.nn.sigmoid(a)
        return a * s, s * (1 + a * (1 - s))

    def split(x, dy):
        return x.reshape(g, -1, x.shape[1]), dy.reshape(g, -1, dy.shape[1])

    def forward(x, gate, up, down, i):
        a, b = x[i] @ gate[i], x[i] @ up[i]
        return a, b, (silu_and_slope(a)[0] * b) @ down[i]

    def backward(x, dy, gate, up, down, i, a, b):
        """dx, dgate, dup, ddown of group i."""
        silu, slope = silu_and_slope(a)
        dh = dy[i] @ down[i].T
        da, db = dh * b * slope, dh * silu
        return da @ gate[i].T + db @ up[i].T, x[i].T @ da, x[i].T @ db, (silu * b).T @ dy[i]

    def forward_loop(x, gate, up, down):
        """(y, gate projections, up projections), all [g, rows, .]."""
        xs = x.reshape(g, -1, x.shape[1])

        def step(i, carry):
            return tuple(acc.at[i].set(v) for acc, v in zip(carry, forward(xs, gate, up, down, i)))

        kept = jnp.zeros((g, xs.shape[1], gate.shape[2]), x.dtype)
        a_all, b_all, y = jax.lax.fori_loop(0, g, step, (kept, kept, jnp.zeros_like(xs)))
        return y, a_all, b_all

    def grads_init(xs, gate, up, down):
        return (jnp.zeros_like(xs), jnp.zeros_like(gate), jnp.zeros_like(up), jnp.zeros_like(down))

    def one_pass(dy, x, gate, up, down, sizes):
        xs, dys = split(x, dy)

        def step(i, carry):
            y, grads = carry
            a, b, y_i = forward(xs, gate, up, down, i)
            new = backward(xs, dys, gate, up, down, i, a, b)
            return y.at[i].set(y_i), tuple(acc.at[i].set(v) for acc, v in zip(grads, new))

        return jax.lax.fori_loop(0, g, step, (jnp.zeros_like(xs), grads_init(xs, gate, up, down)))

    def forward_then_backward(dy, x, gate, up, down, sizes):
        xs, dys = split(x, dy)
        y, a_all, b_all = forward_loop(x, gate, up, down)

        def step(i, grads):
            new = backward(xs, dys, gate, up, down, i, a_all[i], b_all[i])
            return tuple(acc.at[i].set(v) for acc, v in zip(grads, new))

        return y, jax.lax.fori_loop(0, g, step, grads_init(xs, gate, up, down))

    def forward_only(x, gate, up, down, sizes):
        return forward_loop(x, gate, up, down)[0]

    return jax.jit(forward_only), jax.jit(one_pass), jax.jit(forward_then_backward)


def dense_ffn(x, gate, up, down, sizes):
    """The FFN as three dense GEMMs and the SiLU, no groups (weights [K, N], [K, N], [N, K]; sizes
    unused). Its ratio to the dense GEMM is what the FFN's own element-wise work costs, whatever
    the routing. With expert 0's weights it computes what `tiled` does with every row routed to
    expert 0 (checked)."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def blas_per_group(x, ws, dy, sizes):
    """numpy's BLAS on exact groups: the FFN's nine GEMMs (forward: gate, up, down; backward: the
    input and weight gradients), each one BLAS call on row views of its group (no windows, masks
    or copies), beside one dense GEMM of the same FLOPs by the same BLAS. GEMMs only, on both
    sides: what grouping alone costs a well-kept GEMM library on this machine. Returns (dense,
    grouped), each called with `backward` (False: the forward's GEMMs only)."""
    x, dy = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    gate, up, down = (np.asarray(w, np.float32) for w in ws)
    (m, k), n = x.shape, gate.shape[2]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rng = np.random.default_rng(1)
    w3, dy3 = rng.standard_normal((k, 3 * n), dtype=np.float32), rng.standard_normal((m, 3 * n), dtype=np.float32)
    h = rng.standard_normal((m, n), dtype=np.float32)  # stands for silu(a) * b: its values do not matter
    a, b, dh = (np.empty((m, n), np.float32) for _ in range(3))
    y, dx_gate, dx_up = (np.empty((m, k), np.float32) for _ in range(3))
    grads = [np.empty_like(w) for w in (gate, up, down)]

    def dense(backward: bool):
        x @ w3
        if backward:
            dy3 @ w3.T, x.T @ dy3

    def grouped(backward: bool):
        for e in range(len(gate)):
            r = slice(starts[e], starts[e + 1])
            np.matmul(x[r], gate[e], out=a[r]), np.matmul(x[r], up[e], out=b[r]), np.matmul(h[r], down[e], out=y[r])
            if backward:
                np.matmul(dy[r], down[e].T, out=dh[r]), np.matmul(h[r].T, dy[r], out=grads[2][e])
                np.matmul(x[r].T, a[r], out=grads[0][e]), np.matmul(x[r].T, b[r], out=grads[1][e])
                np.matmul(a[r], gate[e].T, out=dx_gate[r]), np.matmul(b[r], up[e].T, out=dx_up[r])

    return dense, grouped


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    ap = benchmark_parser(__doc__, "bench_moe")
    ap.add_argument("--tokens", type=int, default=16384, help="token-expert rows (tokens x top-k)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=512, help="expert intermediate width")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7, help="back-to-back (dense, backend) pairs per figure")
    ap.add_argument(
        "--backends",
        default="tiled,tiled1024/512/256/128/64/32,tiled512/256/128/64/32,tiled256/32,ragged_dot,capacity",
        help="tiled = the default windows; tiledA/B/.. forces window sizes A, then B, ...",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--routings",
        default="balanced,dirichlet0.3,one_takes_half",
        help=f"comma-separated, of {', '.join(ROUTINGS)} (balanced_plus8: the cost of small windows)",
    )
    ap.add_argument("--cpus", type=int, help="run on the first N CPUs this process may use (default: all)")
    ap.add_argument(
        "--references",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the references: with balanced routing XLA:CPU's best-case loops over equal groups "
        "(equal_groups_loops) and the FFN without experts (dense_ffn); with every routing numpy's BLAS "
        "on exact groups (blas_per_group)",
    )
    args = ap.parse_args()
    routes = args.routings.split(",")
    for route in routes:
        if route not in ROUTINGS:
            ap.error(f"--routings: unknown routing {route!r} (one of {', '.join(ROUTINGS)})")
    if args.cpus:  # before jax starts its CPU client and thread pools
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpus])
    machine = {"cpus": len(os.sched_getaffinity(0)), "load_avg_before": os.getloadavg()[0]}
    m, k, n, g = args.tokens, args.hidden, args.width, args.experts
    dt = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    ws = [jnp.asarray(rng.standard_normal(s) * 0.03, dt) for s in ((g, k, n), (g, k, n), (g, n, k))]
    dense_w = jnp.asarray(rng.standard_normal((k, 3 * n)) * 0.03, dt)  # one GEMM, same FLOPs as the FFN
    dense_dy, dy = (jnp.asarray(rng.standard_normal(s), dt) for s in ((m, 3 * n), (m, k)))
    flops = 6 * m * k * n

    def dense(x, w):
        return x @ w

    # each program compiled once: group sizes are an argument, as in the model (nothing about the
    # routing is known at compile time), so every routing runs the same programs
    dense_fwd, dense_fwdbwd = jax.jit(dense), with_backward(dense, 2)
    backends = {b: (jax.jit(ffn(b)), with_backward(ffn(b), 4)) for b in args.backends.split(",")}
    references = {}  # name: (forward, forward+backward, the group sizes at which it computes what tiled does)
    if args.references and "balanced" in routes:
        if m % g:
            ap.error(f"--references: {m} rows do not split into {g} equal groups")
        forward_only, one_pass, forward_then_backward = equal_groups_loops(g)
        balanced = jnp.asarray(routing("balanced", m, g, rng))
        references = {  # name: (forward, forward+backward, weights); the loops share one forward, timed once
            "loop, fwd then bwd": (forward_only, forward_then_backward, ws),
            "loop, one pass": (None, one_pass, ws),
            "dense FFN, no experts": (jax.jit(dense_ffn), with_backward(dense_ffn, 4), [w[0] for w in ws]),
        }
        # each computes what tiled computes: the loops with balanced routing, the dense FFN with expert 0's
        # weights what tiled does with every row routed to expert 0 (its weight gradients, tiled's [0])
        tiled_fwdbwd = backends.get("tiled", (None, with_backward(ffn("tiled"), 4)))[1]
        all_to_first = jnp.zeros(g, jnp.int32).at[0].set(m)
        tolerance = max(2e-3, 4 * float(jnp.finfo(dt).eps))  # float32, or 4 ulps
        for name, (_, fwdbwd, weights) in references.items():
            sizes = all_to_first if name == "dense FFN, no experts" else balanced
            y, (dx, *dws) = tiled_fwdbwd(dy, x, *ws, sizes)
            expected = [y, dx, *(d[0] for d in dws)] if weights is not ws else [y, dx, *dws]
            got = jax.tree.leaves(fwdbwd(dy, x, *weights, sizes))
            for have, want in zip(got, expected, strict=True):
                want = np.asarray(want, np.float32)
                have = np.asarray(have, np.float32).reshape(want.shape)
                np.testing.assert_allclose(have, want, rtol=tolerance, atol=tolerance * np.abs(want).max())
    rows = []

    def add_row(route, backend, sizes, fwd_times, fwdbwd_times):
        (t_dense_f, t_f, fwd_ratio), (t_dense_b, t_b, fwdbwd_ratio) = fwd_times, fwdbwd_times
        row = {
            "routing": route,
            "backend": backend,
            "group_sizes": sizes.tolist(),
            "max_group": int(sizes.max()),
            "fwd_s": t_f,
            "fwdbwd_s": t_b,
            "dense_fwd_s": t_dense_f,
            "dense_fwdbwd_s": t_dense_b,
            "fwd_vs_dense": fwd_ratio,
            "fwdbwd_vs_dense": fwdbwd_ratio,
            "fwd_gflops": flops / t_f / 1e9 if t_f else None,
            "dense_gflops": flops / t_dense_f / 1e9 if t_dense_f else None,
        }
        if backend == "capacity":
            row["dropped_rows"] = int(capacity_dropped(sizes, capacity_slots(m, g, 1.25)))
        rows.append(row)
        print(
            f"{route:15s} {backend:11s} fwd {ratio(row['fwd_vs_dense'])} of dense, fwd+bwd {row['fwdbwd_vs_dense']:.2f}"
            + (f", dropped {row['dropped_rows']} of {m} rows" if "dropped_rows" in row else ""),
            flush=True,
        )

    for route in routes:
        sizes = jnp.asarray(routing(route, m, g, rng))
        measured = dict(backends)
        if references and route == "balanced":
            measured.update(references)
        for backend, (fwd, fwdbwd, *weights) in measured.items():
            weights = weights[0] if weights else ws
            reps = max(2, args.repeats // 3) if backend == "ragged_dot" else args.repeats  # 6 s and 18 s a call
            no_forward = (None, None, None)  # a reference whose forward is the other's
            fwd_times = (
                no_forward if fwd is None else side_by_side(dense_fwd, (x, dense_w), fwd, (x, *weights, sizes), reps)
            )
            fwdbwd_times = side_by_side(dense_fwdbwd, (dense_dy, x, dense_w), fwdbwd, (dy, x, *weights, sizes), reps)
            add_row(route, backend, sizes, fwd_times, fwdbwd_times)
    # numpy's BLAS last: its idle threads spin for a while after each call, slowing what runs next
    for route in routes if args.references else ():
        sizes = next(np.array(r["group_sizes"]) for r in rows if r["routing"] == route)
        blas_dense, blas_grouped = blas_per_group(x, ws, dy, sizes)
        add_row(
            route,
            "BLAS per group, GEMMs only (vs BLAS dense)",
            sizes,
            *(
                side_by_side(blas_dense, (backward,), blas_grouped, (backward,), args.repeats)
                for backward in (False, True)
            ),
        )

    machine["load_avg_after"] = os.getloadavg()[0]
    mx = mxfp8_logit_error()
    print(
        f"\nexpert FFN, {m} rows x hidden {k} x width {n}, {g} experts, {args.dtype}; "
        "achieved FLOP/s as a fraction of one dense GEMM of the same FLOPs (same run, medians); "
        f"CPUs: {machine['cpus']}, load average {machine['load_avg_before']:.1f} before, "
        f"{machine['load_avg_after']:.1f} after\n"
    )
    print("| routing | backend | forward | forward+backward | dropped rows |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['routing']} | {r['backend']} | {ratio(r['fwd_vs_dense'])} | {r['fwdbwd_vs_dense']:.2f} | "
            f"{r.get('dropped_rows', 0)} |"
        )
    print(f"\nMXFP8 expert GEMMs vs BF16 on the tiny model's logits: {json.dumps(mx)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "machine": machine, "rows": rows, "mxfp8_logits": mx}, indent=2)
    )
    print(f"wrote {args.out}")


def mxfp8_logit_error() -> dict:
    """Tiny model, bf16 compute: expert GEMMs in MXFP8 (quantize-dequantize) vs in BF16."""
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "tiny", "base")
        tokens = np.random.default_rng(0).integers(0, 256, (8, 64)).astype(np.int32)
        f32 = np.asarray(moe_jax.from_pretrained(path, backend="tiled")(tokens))
        bf16 = np.asarray(moe_jax.from_pretrained(path, dtype="bfloat16", backend="tiled")(tokens))
        mx = np.asarray(moe_jax.from_pretrained(path, dtype="bfloat16", backend="tiled+mxfp8")(tokens))
    keep = ("max_abs", "kl_mean", "kl_max", "top1")
    return {
        "mxfp8_vs_bf16": {k: v for k, v in logit_metrics(bf16, mx).items() if k in keep},
        "bf16_vs_f32": {k: v for k, v in logit_metrics(f32, bf16).items() if k in keep},
        "mxfp8_vs_f32": {k: v for k, v in logit_metrics(f32, mx).items() if k in keep},
    }


if __name__ == "__main__":
    main()
