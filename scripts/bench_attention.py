"""Attention memory and time: forward+backward of one MLA-shaped causal attention (by default small
widths: 4 heads, Dqk 48, Dv 32, float32, batch 1, one document) for the S x S reference
("naive"), the blockwise (flash) form and, on NVIDIA GPUs, cuDNN's ("cudnn"; bf16), at several
sequence lengths. With --model tiny: the whole tiny DeepSeek-V3 (converters/tiny.py, base: 3
layers, MTP, float32) forward and backward on one row of S tokens, its attention substituted by
the implementation measured. Each configuration runs in its own process:
peak RSS from resource.getrusage (ru_maxrss) over the process's RSS once its inputs exist, the
peak RssAnon sampled from /proc, XLA's planned scratch memory (`temp_size_in_bytes`), compile
time and the median step time. A configuration whose peak would exceed --max-gib (estimated as
twice its planned scratch memory: the S x S form peaked at 1.8x) is compiled but not run. Prints
a table, writes JSON.

    .venv/bin/python scripts/bench_attention.py --out runs/bench_attention.json
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax.model
from converters.tiny import tiny_config
from moe_jax.config import ModelConfig
from moe_jax.kernels.attention import BLOCK_Q, attention, blockwise_attention
from moe_jax.measure import GiB, benchmark_parser, run_sampled
from moe_jax.params import init_tree


def attention_fn(impl: str, block: int):
    if impl == "blockwise":
        return lambda *a: blockwise_attention(*a, block_q=block, block_k=block)
    return lambda *a: attention(*a, impl=impl)


def attention_step(impl: str, seq: int, args, rng):
    """One attention's forward and backward, and its inputs."""
    dtype, heads, dqk, dv = jnp.dtype(args.dtype), args.heads, args.dqk, args.dv
    q, k = (jnp.asarray(rng.normal(size=(1, seq, heads, dqk)), dtype) for _ in range(2))
    v, d_out = (jnp.asarray(rng.normal(size=(1, seq, heads, dv)), dtype) for _ in range(2))
    segments = jnp.zeros((1, seq), jnp.int32)
    fn = attention_fn(impl, args.block)

    def step(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, segments, dqk**-0.5), q, k, v)
        return out, pullback(d_out)

    return step, (q, k, v)


def tiny_model_step(impl: str, seq: int, rng):
    """The tiny model's forward (with MTP) and backward on one row of `seq` tokens, its attention
    `impl` (substituted in moe_jax.model for this process), and its inputs."""
    moe_jax.model.attention = functools.partial(attention, impl=impl)
    cfg = ModelConfig.from_hf_dict(tiny_config("base"))
    tree = jax.tree.map(jnp.asarray, init_tree(cfg))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, seq)), jnp.int32)

    def step(params, tokens):
        def loss(params):
            out = moe_jax.model.forward(params, tree["buffers"], tokens, cfg, mtp=True)
            return out.logits.mean() + out.mtp_logits[0].mean()

        return jax.grad(loss)(params)

    return step, (tree["params"], tokens)


def measure(impl: str, seq: int, args) -> dict:
    """One configuration, in this process: the child side of `main`."""
    rng = np.random.default_rng(0)
    if args.model == "tiny":
        step, inputs = tiny_model_step(impl, seq, rng)
    else:
        step, inputs = attention_step(impl, seq, args, rng)
    jax.block_until_ready(inputs)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(*inputs).compile()
    result = {
        "compile_seconds": time.perf_counter() - t0,
        "temp_size_in_bytes": compiled.memory_analysis().temp_size_in_bytes,
    }
    if 2 * result["temp_size_in_bytes"] > args.max_gib * GiB:
        return {**result, "skipped": f"twice the planned scratch memory is over --max-gib {args.max_gib}"}
    times = []
    for _ in range(args.repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {**result, "step_seconds": statistics.median(times[1:]), "peak_rss_over_baseline": peak - baseline}


def main() -> None:
    ap = benchmark_parser(__doc__, "bench_attention")
    ap.add_argument("--seq", default="2048,4096,8192", help="sequence lengths")
    ap.add_argument("--impls", default="naive,blockwise")
    ap.add_argument("--block", type=int, default=BLOCK_Q, help="blockwise query and key block")
    ap.add_argument("--model", choices=["tiny"], help="the whole tiny model instead of one attention")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dqk", type=int, default=48, help="query and key head dim")
    ap.add_argument("--dv", type=int, default=32, help="value head dim")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-gib", type=float, default=6.0, help="estimated peak memory over which not to run")
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "SEQ"), help=argparse.SUPPRESS)  # one configuration
    args = ap.parse_args()
    if args.child:
        impl, seq = args.child
        print(json.dumps(measure(impl, int(seq), args)))
        return

    rows = []
    print(
        f"{'impl':>10} {'S':>6} {'peak RSS GiB':>13} {'peak anon GiB':>14} {'XLA temp GiB':>13} {'step s':>8} {'compile s':>10}"
    )
    for seq in [int(s) for s in args.seq.split(",")]:
        for impl in args.impls.split(","):
            child = [sys.executable, __file__, "--child", impl, str(seq), "--block", str(args.block)]
            child += ["--repeats", str(args.repeats), "--max-gib", str(args.max_gib), "--dtype", args.dtype]
            child += ["--heads", str(args.heads), "--dqk", str(args.dqk), "--dv", str(args.dv)]
            child += ["--model", args.model] if args.model else []
            run = run_sampled(child)
            row = {"impl": impl, "seq": seq, **json.loads(run["stdout"]), "peak_anon": run["peak_anon"]}
            rows.append(row)
            if "skipped" in row:
                print(
                    f"{impl:>10} {seq:>6} skipped: {row['skipped']} (XLA temp {row['temp_size_in_bytes'] / GiB:.2f} GiB)"
                )
                continue
            print(
                f"{impl:>10} {seq:>6} {row['peak_rss_over_baseline'] / GiB:>13.3f} {row['peak_anon'] / GiB:>14.3f} "
                f"{row['temp_size_in_bytes'] / GiB:>13.3f} {row['step_seconds']:>8.3f} {row['compile_seconds']:>10.2f}",
                flush=True,
            )
    config = {"batch": 1, "heads": args.heads, "qk_head_dim": args.dqk, "v_head_dim": args.dv, "block": args.block}
    config["dtype"] = args.dtype
    config["model"] = args.model or "one attention"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": config, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
