"""The GPU compute path at DeepSeek-V3's width, compiled for H100 and B200 on a machine without a
GPU (XLA's GPU compiler, deviceless; moe_jax.gpu). Nothing runs, so no speed: for each target,
what XLA would compute and hold.

- Expert FFN (gate, up, down), forward and backward, M=8192 rows, hidden 7168, width 2048, 32
  local experts, bf16, per grouped-GEMM backend: XLA's FLOPs against the ideal (custom-call
  kernels count 0), the temporary memory, the largest array, the kernels.
- The MoE layer (router, dispatch, expert FFN, combine), forward and backward, 1024 tokens x
  top-8 = 8192 rows, the same widths and 32 experts, per backend: the same figures.
- One MLA attention, forward and backward (128 heads, q/k 192, v 128, bf16, one sequence), at
  S = 4k, 16k, 64k per implementation: temporary memory (naive only up to 16k).
Each target compiles in its own process (Mosaic GPU keeps one architecture per process). Prints
tables, writes JSON and a plot of attention memory against S.

    .venv/bin/python scripts/bench_gpu_compile.py --out runs/bench_gpu_compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from moe_jax import gpu
from moe_jax.config import DEEPSEEK_V3, ModelConfig
from moe_jax.kernels.attention import attention
from moe_jax.kernels.grouped_gemm import grouped_ffn
from moe_jax.measure import GiB, benchmark_parser
from moe_jax.moe import moe_layer

ROWS, EXPERTS = 8192, 32
HIDDEN, WIDTH = DEEPSEEK_V3["hidden_size"], DEEPSEEK_V3["moe_intermediate_size"]
HEADS = DEEPSEEK_V3["num_attention_heads"]
DQK = DEEPSEEK_V3["qk_nope_head_dim"] + DEEPSEEK_V3["qk_rope_head_dim"]
DV = DEEPSEEK_V3["v_head_dim"]
LENGTHS = (4096, 16384, 65536)
FFN_BACKENDS = ("ragged_dot", "tiled", "mgpu")
ATTENTION = {"naive": LENGTHS[:2], "blockwise": LENGTHS, "cudnn": LENGTHS}


def measure_target(target: str) -> dict:
    topo = gpu.topology(target)

    def spec(*shape, dtype=jnp.bfloat16):
        return gpu.abstract(topo, shape, dtype)

    ffn_args = (spec(ROWS, HIDDEN), spec(EXPERTS, HIDDEN, WIDTH), spec(EXPERTS, HIDDEN, WIDTH))
    ffn_args += (spec(EXPERTS, WIDTH, HIDDEN), spec(EXPERTS, dtype=jnp.int32))
    ideal = 3 * 3 * 2 * ROWS * HIDDEN * WIDTH
    out = {"ffn": {}, "moe": {}, "attention": {}, "ffn_ideal_flops": ideal}
    for backend in FFN_BACKENDS:
        ffn = gpu.forward_backward(lambda x, g, u, d, s, b=backend: grouped_ffn(x, g, u, d, s, b), (0, 1, 2, 3))
        stats = gpu.compile_and_describe(topo, ffn, *ffn_args)
        out["ffn"][backend] = stats
        print(f"  {target} ffn {backend}: {stats['flops'] / ideal:.2f}x ideal", file=sys.stderr, flush=True)
    cfg = ModelConfig.from_hf_dict({**DEEPSEEK_V3, "n_routed_experts": EXPERTS})  # 8 groups of 4 experts
    tokens = ROWS // cfg.num_experts_per_tok
    layer = (spec(HIDDEN, EXPERTS, dtype=jnp.float32), {"gate": ffn_args[1], "up": ffn_args[2], "down": ffn_args[3]})
    for backend in FFN_BACKENDS:
        moe = gpu.forward_backward(
            lambda x, router, experts, b=backend: moe_layer(
                {"router": router, "experts": experts}, jnp.zeros(EXPERTS), x, cfg, jnp.bfloat16, b
            )[0],
            (0, 1, 2),
        )
        out["moe"][backend] = gpu.compile_and_describe(topo, moe, spec(tokens, HIDDEN), *layer)
        print(f"  {target} moe layer {backend}", file=sys.stderr, flush=True)
    for impl, lengths in ATTENTION.items():
        for s in lengths:
            f = gpu.forward_backward(
                lambda q, k, v, ids, impl=impl: attention(q, k, v, ids, DQK**-0.5, impl=impl), (0, 1, 2)
            )
            args = (spec(1, s, HEADS, DQK), spec(1, s, HEADS, DQK), spec(1, s, HEADS, DV), spec(1, s, dtype=jnp.int32))
            out["attention"].setdefault(impl, {})[s] = gpu.compile_and_describe(topo, f, *args)
            print(f"  {target} attention {impl} S={s}", file=sys.stderr, flush=True)
    return out


def gemm_rows(title: str, results: dict, part: str) -> None:
    """A table of `part` ("ffn" or "moe"): XLA's FLOPs against the FFN's ideal, temporaries, the
    largest array, the kernels, per target and backend."""
    print(f"\n{title}")
    print(f"{'target':<7}{'backend':<12}{'XLA FLOPs/ideal':>17}{'temp GiB':>10}  {'largest array':<20}kernels")
    for target, out in results.items():
        for backend, st in out[part].items():
            kernels = ", ".join(f"{k} x{n}" for k, n in st["custom_calls"].items() if "cublas" not in k) or "-"
            ratio = st["flops"] / out["ffn_ideal_flops"]
            print(
                f"{target:<7}{backend:<12}{ratio:>17.2f}{st['temp_bytes'] / GiB:>10.2f}  {st['largest_array']:<20}{kernels}"
            )


def print_tables(results: dict) -> None:
    gemm_rows(
        f"Expert FFN forward+backward, {ROWS} rows x {HIDDEN} -> {WIDTH}, {EXPERTS} experts, bf16", results, "ffn"
    )
    title = f"MoE layer forward+backward, {ROWS // 8} tokens x top-8, same widths: router, dispatch, FFN, combine"
    gemm_rows(title, results, "moe")
    print(f"\nOne MLA attention forward+backward ({HEADS} heads, q/k {DQK}, v {DV}, bf16): temporary GiB")
    print(f"{'target':<7}{'implementation':<16}" + "".join(f"{'S=' + str(s):>12}" for s in LENGTHS))
    for target, out in results.items():
        for impl, by_s in out["attention"].items():
            cells = "".join(f"{by_s[s]['temp_bytes'] / GiB:>12.2f}" if s in by_s else f"{'-':>12}" for s in LENGTHS)
            print(f"{target:<7}{impl:<16}{cells}")


def plot_temporaries(series: dict[str, dict[int, int]], path: Path, xlabel: str, title: str) -> None:
    """Temporary bytes against sequence length, log-log, a line per label ({label: {S: bytes}})."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, by_s in series.items():
        lengths = sorted(by_s)
        ax.loglog(lengths, [by_s[s] / GiB for s in lengths], marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("temporary memory, GiB (compiled)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(results: dict, path: Path) -> None:
    series = {
        f"{target} {impl}": {s: r["temp_bytes"] for s, r in by_s.items()}
        for target, out in results.items()
        for impl, by_s in out["attention"].items()
    }
    plot_temporaries(series, path, "sequence length S", "One MLA attention, forward+backward")


def main() -> None:
    parser = benchmark_parser(__doc__, "bench_gpu_compile")
    parser.add_argument("--targets", default="h100,b200", help=f"comma-separated, of {', '.join(gpu.TARGETS)}")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a child: one target, JSON on stdout
        print(json.dumps(measure_target(args.one)))
        return
    results = {}
    for target in args.targets.split(","):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, __file__, "--one", target], stdout=subprocess.PIPE, text=True, env=env)
        if proc.returncode:
            sys.exit(f"compiling for {target} failed (exit {proc.returncode})")
        results[target] = {k: convert_keys(v) for k, v in json.loads(proc.stdout).items()}
    print_tables(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


def convert_keys(value):
    """JSON's string keys back to sequence lengths."""
    if isinstance(value, dict):
        return {int(k) if k.isdigit() else k: convert_keys(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    main()
