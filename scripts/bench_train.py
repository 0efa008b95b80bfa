"""Training throughput: step time, tokens/s, model TFLOP/s per device and MFU.

    .venv/bin/python scripts/bench_train.py --json runs/bench_train.json            # tiny + cpu
    python scripts/bench_train.py --models full-width --json runs/gpu/bench_train.json   # on a GPU

- tiny, cpu: whole training steps of `moe-jax train` (forward with MTP, loss, backward, AdamW,
  bias update; float32 master weights) on the built-in text, medians over the steps after the
  first (compilation). MFU against the device's peak: the datasheet BF16 figure on known GPUs,
  a measured float32 matmul on CPU.
- full-width: DeepSeek-V3's real widths (hidden 7168, 128 heads, MLA, 256 experts of 2048, top-8,
  vocab 129280) at reduced depth (one dense and `--moe-layers` MoE layers), BF16 weights made on
  the device, forward+backward only (the optimizer state of 11B parameters per MoE layer would
  not fit one GPU beside them). For a GPU; on CPU check that it runs with
  --moe-layers 1 --experts 16 --vocab 1024 --full-seq 64 --full-batch 1 --steps 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from converters.synthetic import full_width_config
from converters.tiny import tiny_config
from moe_jax.config import DEEPSEEK_V3, ModelConfig
from moe_jax.model import forward
from moe_jax.params import leaf_dtype, param_shapes, set_path
from moe_jax.train import objective as obj
from moe_jax.train.config import load_config
from moe_jax.train.loop import train
from moe_jax.train.metrics.store import read_metrics
from moe_jax.train.throughput import peak_tflops

# A CPU-sized model: 23M parameters, 16 experts of 256, top-4.
CPU_CONFIG = tiny_config(
    "base",
    hidden_size=384,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=6,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    vocab_size=256,
    max_position_embeddings=1024,
    initializer_range=0.02,
)


def bench_training(name: str, init: str, steps: int, seq_len: int, batch: int, work: Path) -> dict:
    cfg = load_config(
        None,
        [
            f"run_dir={work / name}",
            f"steps={steps}",
            f"model.init={init}",
            "tensorboard=false",
            f"data.seq_len={seq_len}",
            f"data.batch_size={batch}",
            "checkpoint.every=100000",
            "model.compute_dtype=float32",
        ],
    )
    train(cfg, progress=False, log=lambda *a: None)
    records = read_metrics(work / name)[1:]  # the first step compiles
    med = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    model_cfg = ModelConfig.from_hf_dict(tiny_config("base") if init == "tiny" else json.loads(Path(init).read_text()))
    return dict(
        model=name,
        params_m=_count(model_cfg, True) / 1e6,
        tokens_per_step=batch * seq_len,
        steps=len(records),
        step_ms=med("step_time_s") * 1e3,
        tokens_per_s=med("tokens_per_s"),
        tflops_per_device=med("tflops_per_device"),
        mfu=med("mfu"),
        final_loss=records[-1]["loss"],
        kind="train step (fwd+MTP+bwd+AdamW+bias update), float32",
    )


def _count(cfg: ModelConfig, mtp: bool) -> int:
    return sum(int(np.prod(shape)) for shape, _ in param_shapes(cfg, mtp).values())


def device_init(cfg: ModelConfig, key: jax.Array, dtype: str = "bfloat16") -> dict:
    """`moe_jax.params.init_tree`'s tree (the table's shapes, inits and dtype policy, no MTP),
    drawn on the device under jit. init_tree draws in numpy on the host: for the 13.9B parameters
    of 1 dense + 1 MoE layer of 256 experts that is about 5 minutes of one core (38M normals/s)
    and over 40 GB of host memory before the first step."""
    tree: dict = {}
    for i, (path, (shape, rule)) in enumerate(sorted(param_shapes(cfg, False).items())):
        dt = leaf_dtype(rule, dtype)
        if rule.init == "ones":
            value = jnp.ones(shape, dt)
        elif rule.init == "zeros":
            value = jnp.zeros(shape, dt)
        else:
            value = (cfg.initializer_range * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dt)
        set_path(tree, path, value)
    return tree


def bench_full_width(
    moe_layers: int, experts: int, vocab: int, seq_len: int, batch: int, repeats: int, peak: float
) -> dict:
    cfg = ModelConfig.from_hf_dict(full_width_config(moe_layers, experts, vocab))
    tree = jax.jit(lambda key: device_init(cfg, key))(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch, seq_len + 1), 0, cfg.vocab_size)

    def loss(params, buffers, tokens):
        out = forward(params, buffers, tokens[:, :-1], cfg, dtype=jnp.bfloat16, remat="full")
        return obj.masked_cross_entropy(out.logits, tokens[:, 1:], jnp.ones_like(tokens[:, 1:], bool))

    step = jax.jit(jax.value_and_grad(loss))
    args = (tree["params"], tree["buffers"], tokens)
    t = time.perf_counter()
    jax.block_until_ready(step(*args))
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - t)
    dt = statistics.median(times)
    flops = obj.flops_per_token(cfg, seq_len, False) * batch * seq_len
    return dict(
        model=f"full-width, 1 dense + {moe_layers} MoE, {experts} experts, vocab {vocab}",
        params_m=_count(cfg, False) / 1e6,
        tokens_per_step=batch * seq_len,
        steps=repeats,
        step_ms=dt * 1e3,
        tokens_per_s=batch * seq_len / dt,
        tflops_per_device=flops / dt / 1e12,
        mfu=flops / dt / 1e12 / peak,
        first_call_s=compile_s,
        kind="forward+backward (remat full), bfloat16, one device",
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,cpu", help="comma list of tiny, cpu, full-width")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--moe-layers", type=int, default=1)
    p.add_argument("--experts", type=int, default=DEEPSEEK_V3["n_routed_experts"])
    p.add_argument("--vocab", type=int, default=DEEPSEEK_V3["vocab_size"])
    p.add_argument("--full-seq", type=int, default=4096)
    p.add_argument("--full-batch", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    peak, peak_source = peak_tflops(None)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            if name == "tiny":
                rows.append(bench_training("tiny", "tiny", args.steps, 128, 8, work))
            elif name == "cpu":
                path = work / "cpu_config.json"
                path.write_text(json.dumps(CPU_CONFIG))
                rows.append(bench_training("cpu", str(path), args.steps, 256, 8, work))
            elif name == "full-width":
                rows.append(
                    bench_full_width(
                        args.moe_layers, args.experts, args.vocab, args.full_seq, args.full_batch, args.steps, peak
                    )
                )
            else:
                raise SystemExit(f"unknown model {name!r}")
    device = jax.devices()[0]
    print(f"device: {device.device_kind} x {jax.device_count()}; peak {peak:.3g} TFLOP/s per device ({peak_source})")
    print("| model | params | tokens/step | step ms | tokens/s | model TFLOP/s per device | MFU | what |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params_m']:.1f}M | {r['tokens_per_step']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.4g} | {r['mfu']:.1%} | {r['kind']} |"
        )
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "device": device.device_kind,
                    "devices": jax.device_count(),
                    "peak_tflops": peak,
                    "peak_source": peak_source,
                    "results": rows,
                },
                indent=2,
            )
        )
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
