"""DeepSeek-V3.2's attention at long context, compiled for GPUs on a machine without one (XLA's GPU
compiler, deviceless; moe_jax.gpu): how its memory grows with the sequence.

One attention layer at DeepSeek-V3.2 671B's widths (MLA: 128 heads, q latent 1536, kv latent 512;
the indexer: 64 heads of 128, 2,048 keys a query), one sequence of S tokens, bf16, forward and
backward, as training runs it:
- `sparse`: the sparse stage: each query's top-2,048 keys (moe_jax.dsa: scores and selection by
  blocks of queries, MLA over each block's chosen latents), with the indexer's KL loss;
- `warmup`: the warm-up stage: dense causal attention (cuDNN on these targets) and the indexer's
  KL over every visible key, by blocks of queries;
at S = 8K, 32K and 128K. For each: XLA's temporaries (what the runtime allocates for the layer, its
inputs and outputs aside), the largest array, and the matmul FLOPs and bytes its kernels move
(moe_jax.hlo.program_costs: loop bodies times their trip count; custom calls, cuDNN's attention,
count 0). Each target compiles in its own process. Prints a
table, writes JSON and a plot of the temporaries against S.

    .venv/bin/python scripts/bench_dsa.py --out runs/bench_dsa.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from bench_gpu_compile import plot_temporaries  # a sibling script: scripts/ is on the path when run

from moe_jax import gpu, hlo
from moe_jax.config import DEEPSEEK_V32, ModelConfig
from moe_jax.measure import GiB, benchmark_parser
from moe_jax.model import Sparse, mla_attention, rope_tables
from moe_jax.params import param_shapes

LENGTHS = (8192, 32768, 131072)
STAGES = {"sparse": Sparse(loss=True), "warmup": Sparse(dense=True, loss=True)}


def attention_shapes(cfg: ModelConfig) -> dict:
    """One layer's attention weights {name: shape} (the first MoE layer's, unstacked)."""
    out = {}
    for path, (shape, _) in param_shapes(cfg, mtp=False).items():
        if path[:3] == ("params", "moe", "attn"):
            keys = path[3:]
            out.setdefault(keys[0], {} if len(keys) > 1 else shape[1:])
            if len(keys) > 1:
                out[keys[0]][keys[1]] = shape[1:]
    return out


def layer_fn(cfg: ModelConfig, sparse: Sparse):
    """(attention output summed with the indexer's loss) and its gradient in the weights and the input."""

    def loss(p, x, positions, segments):
        cos, sin = rope_tables(cfg, positions)
        out, index_loss = mla_attention(p, x, cos, sin, segments, cfg, sparse=sparse)
        return out.astype(jnp.float32).sum() + index_loss

    return jax.value_and_grad(loss, argnums=(0, 1))


def measure_target(target: str, lengths) -> dict:
    topo = gpu.topology(target)
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V32)
    weights = jax.tree.map(
        lambda shape: gpu.abstract(topo, shape, jnp.bfloat16),
        attention_shapes(cfg),
        is_leaf=lambda s: isinstance(s, tuple),
    )
    out = {}
    for stage, sparse in STAGES.items():
        for s in lengths:
            args = (
                weights,
                gpu.abstract(topo, (1, s, cfg.hidden_size), jnp.bfloat16),
                gpu.abstract(topo, (1, s), jnp.int32),
                gpu.abstract(topo, (1, s), jnp.int32),
            )
            with gpu.compiling_for(topo.devices):
                compiled = jax.jit(layer_fn(cfg, sparse)).lower(*args).compile()
            stats = gpu.describe(compiled)
            costs = hlo.program_costs(compiled.as_text())  # loop bodies times their trip count
            stats["flops"], stats["hbm_bytes"] = costs["flops"], costs["bytes"]
            out.setdefault(stage, {})[s] = stats
            print(f"  {target} {stage} S={s}: {stats['temp_bytes'] / GiB:.2f} GiB", file=sys.stderr, flush=True)
    return out


def print_table(results: dict, lengths) -> None:
    print("\nOne DeepSeek-V3.2 attention layer (671B widths), forward+backward, one sequence, bf16: temporaries GiB")
    head = "".join(f"{'S=' + str(s):>11}" for s in lengths)
    print(f"{'target':<7}{'stage':<8}{head}{'x4 tokens':>11}  largest array at the longest")
    for target, out in results.items():
        for stage, by_s in out.items():
            temp = [by_s[s]["temp_bytes"] for s in lengths]
            growth = temp[-1] / temp[-2] if len(temp) > 1 else float("nan")
            cells = "".join(f"{t / GiB:>11.2f}" for t in temp)
            print(f"{target:<7}{stage:<8}{cells}{growth:>10.2f}x  {by_s[lengths[-1]]['largest_array']}")
    print(f"\nMatmul FLOPs (custom calls count 0) and HBM bytes moved, at S = {', '.join(map(str, lengths))}")
    for target, out in results.items():
        for stage, by_s in out.items():
            flops = ", ".join(f"{by_s[s]['flops'] / 1e12:.1f}" for s in lengths)
            moved = ", ".join(f"{by_s[s]['hbm_bytes'] / 1e12:.2f}" for s in lengths)
            print(f"{target:<7}{stage:<8}TFLOP {flops}; TB {moved}")


def plot(results: dict, path: Path) -> None:
    series = {
        f"{target} {stage}": {s: r["temp_bytes"] for s, r in by_s.items()}
        for target, out in results.items()
        for stage, by_s in out.items()
    }
    plot_temporaries(series, path, "sequence length S (tokens)", "DeepSeek-V3.2 attention layer, forward+backward")


def main() -> None:
    parser = benchmark_parser(__doc__, "bench_dsa")
    parser.add_argument("--targets", default="h100,b200", help=f"comma-separated, of {', '.join(gpu.TARGETS)}")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="sequence lengths, comma-separated")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(s) for s in args.lengths.split(",")]
    if args.one:  # a child: one target, JSON on stdout
        print(json.dumps(measure_target(args.one, lengths)))
        return
    results = {}
    for target in args.targets.split(","):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, __file__, "--one", target, "--lengths", args.lengths]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
        if proc.returncode:
            sys.exit(f"compiling for {target} failed (exit {proc.returncode})")
        results[target] = {
            stage: {int(s): v for s, v in by_s.items()} for stage, by_s in json.loads(proc.stdout).items()
        }
    print_table(results, lengths)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
