"""FP8 dispatch (`model.ep_dispatch: float8`) against bf16 dispatch: what rounding the dispatched
rows to e4m3 (one power-of-two scale per 128 values) costs in accuracy.

1. The built-in tiny model, bf16 compute, expert-parallel on 8 CPU devices (mesh expert_node=2,
   expert=4, the bounded exchange emulated on CPU): KL(bf16 dispatch || FP8 dispatch) of the
   next-token distributions, and both against the float32 single-device model.
2. One MoE layer at DeepSeek-V3 width (hidden 7168, expert FFN 2048, top-8 of 4 groups), with
   32 experts rather than 256 (the weights of 256 do not fit this machine; the error is per row
   and per expert, so the count does not change it), random weights of DeepSeek-V3's scale:
   relative RMS error of the routed output, bf16 and FP8 dispatch, against float32; and of its
   gradients (the input's and the experts' weights', for a random cotangent of the output; 16
   experts and 128 tokens: 22 GB of this machine's memory) with the gradients sent to the
   experts in bf16 and in FP8 (`model.ep_gradient_dispatch: float8`).

    .venv/bin/python scripts/bench_ep_fp8.py                 # writes runs/bench_ep_fp8.json
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

if __name__ == "__main__":  # 8 CPU devices, before jax starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from converters.tiny import tiny_config
from moe_jax.config import DEEPSEEK_V3, ModelConfig
from moe_jax.measure import benchmark_parser
from moe_jax.model import forward, model_from_tree
from moe_jax.moe import moe_layer
from moe_jax.parallel.ep import ExpertParallel, ep_moe
from moe_jax.params import init_tree


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("expert_node", "expert"))


def log_softmax(logits) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))


def kl(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    """KL(p || q) per position, nats."""
    return (np.exp(p_log) * (p_log - q_log)).sum(-1)


def tiny_model_report(batch: int, seq: int) -> dict:
    cfg = ModelConfig.from_hf_dict(tiny_config("base"))
    tree = init_tree(cfg, seed=0, mtp=False)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    reference = log_softmax(model_from_tree(cfg, tree)(tokens))  # float32, one device
    model = model_from_tree(cfg, tree, compute_dtype=jnp.bfloat16, mesh=mesh())
    out = {}
    for dispatch in ("bfloat16", "float8"):
        ep = ExpertParallel(transport="ragged_emulated", dispatch=dispatch)

        @jax.jit
        def logits(params, buffers, tokens, ep=ep):
            return forward(params, buffers, tokens, cfg, dtype=jnp.bfloat16, mesh=model.mesh, ep=ep).logits

        out[dispatch] = log_softmax(logits(model.params, model.buffers, model.place_batch(tokens)))
    fp8_vs_bf16 = kl(out["bfloat16"], out["float8"])
    return {
        "model": "tiny (converters.tiny base), bf16 compute, mesh expert_node=2,expert=4",
        "tokens": batch * seq,
        "kl_fp8_vs_bf16_mean": float(fp8_vs_bf16.mean()),
        "kl_fp8_vs_bf16_max": float(fp8_vs_bf16.max()),
        "kl_bf16_vs_float32_mean": float(kl(reference, out["bfloat16"]).mean()),
        "kl_fp8_vs_float32_mean": float(kl(reference, out["float8"]).mean()),
        "top1_agreement_fp8_bf16": float((out["float8"].argmax(-1) == out["bfloat16"].argmax(-1)).mean()),
    }


def wide_layer(tokens: int, experts: int):
    """(config, float32 weights, tokens' rows) of one MoE layer at DeepSeek-V3 width."""
    fields = {**DEEPSEEK_V3, "n_routed_experts": experts, "n_group": 8, "topk_group": 4}
    cfg = ModelConfig.from_hf_dict(fields)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    rng = np.random.default_rng(0)
    # DeepSeek-V3-like scales: unit-RMS normed activations with a few large channels, weights ~ N(0, 0.02)
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    x[:, rng.choice(h, 16, replace=False)] *= 20.0
    params = {
        "router": jnp.asarray(rng.standard_normal((h, experts)) * 0.02, jnp.float32),
        "experts": {
            k: jnp.asarray(rng.standard_normal(s) * 0.02, jnp.float32)
            for k, s in (("gate", (experts, h, i)), ("up", (experts, h, i)), ("down", (experts, i, h)))
        },
    }
    return cfg, params, x


def wide_layer_report(tokens: int, experts: int) -> dict:
    cfg, params, x = wide_layer(tokens, experts)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    bias = jnp.zeros(experts)
    want = np.asarray(jax.jit(lambda p, x: moe_layer(p, bias, x, cfg, jnp.float32, None)[0])(params, jnp.asarray(x)))
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params["experts"])
    params16 = {"router": params["router"], "experts": bf16}
    out = {"layer": f"hidden {h}, expert FFN {i}, {experts} experts, top-8 of 4 groups", "tokens": tokens}
    got = {}
    for dispatch in ("bfloat16", "float8"):
        ep = ExpertParallel(transport="ragged_emulated", dispatch=dispatch)
        layer = jax.jit(lambda p, x, ep=ep: ep_moe(p, bias, x, cfg, mesh(), options=ep)[0])
        got[dispatch] = np.asarray(layer(params16, jnp.asarray(x, jnp.bfloat16)), np.float32)
        out[f"rel_rms_{dispatch}_vs_float32"] = rel_rms(got[dispatch], want)
    # the same routing (both route the same bf16 rows): the dispatch's rounding alone
    out["rel_rms_float8_vs_bfloat16"] = rel_rms(got["float8"], got["bfloat16"])
    return out


def wide_layer_gradient_report(tokens: int, experts: int) -> dict:
    """The layer's gradients (the input's and the experts' weights', router fixed) for a random
    cotangent of its output, with the gradients sent to the experts in bf16 and in FP8, against
    float32 on one device."""
    cfg, params, x = wide_layer(tokens, experts)
    bias = jnp.zeros(experts)
    c = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)

    def gradients(layer, experts, x):
        _, pull = jax.vjp(layer, experts, x)
        g_experts, g_x = pull(jnp.asarray(c, x.dtype))
        return g_experts, g_x

    def squares(got, want) -> tuple[float, float]:  # sum of squared errors, sum of squares
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        return float(((got - want) ** 2).sum()), float((want**2).sum())

    def rel_rms_trees(got, want) -> float:
        err, norm = map(sum, zip(*(squares(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))))
        return float(np.sqrt(err / norm))

    def single(e, x):
        return moe_layer({"router": params["router"], "experts": e}, bias, x, cfg, jnp.float32, None)[0]

    want = jax.jit(lambda e, x: gradients(single, e, x))(params["experts"], jnp.asarray(x))
    want = jax.tree.map(np.asarray, want)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params["experts"])
    out = {
        "layer": f"hidden {cfg.hidden_size}, expert FFN {cfg.moe_intermediate_size}, {experts} experts",
        "tokens": tokens,
    }
    got = {}
    for payload in ("bfloat16", "float8"):
        ep = ExpertParallel(transport="ragged_emulated", gradient_dispatch=payload)

        def layer(e, x, ep=ep):
            return ep_moe({"router": params["router"], "experts": e}, bias, x, cfg, mesh(), options=ep)[0]

        got[payload] = jax.tree.map(
            np.asarray, jax.jit(lambda e, x, layer=layer: gradients(layer, e, x))(bf16, jnp.asarray(x, jnp.bfloat16))
        )
        for i, name in enumerate(("experts", "input")):
            out[f"rel_rms_{name}_grad_{payload}_vs_float32"] = rel_rms_trees(got[payload][i], want[i])
    for i, name in enumerate(("experts", "input")):
        out[f"rel_rms_{name}_grad_float8_vs_bfloat16"] = rel_rms_trees(got["float8"][i], got["bfloat16"][i])
    return out


def rel_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got - want) ** 2).mean() / (want**2).mean()))


def main() -> None:
    ap = benchmark_parser(__doc__, "bench_ep_fp8")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layer-tokens", type=int, default=512)
    ap.add_argument("--layer-experts", type=int, default=32)
    ap.add_argument("--gradient-tokens", type=int, default=128)
    ap.add_argument("--gradient-experts", type=int, default=16, help="experts of the gradients' layer (memory)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = {"tiny_model": tiny_model_report(args.batch, args.seq)}
    print("tiny model:", json.dumps(result["tiny_model"], indent=1), flush=True)
    result["deepseek_width_layer"] = wide_layer_report(args.layer_tokens, args.layer_experts)
    print("DeepSeek-V3-width layer:", json.dumps(result["deepseek_width_layer"], indent=1))
    jax.clear_caches()  # the gradients' layer needs most of this machine's memory
    gc.collect()
    result["deepseek_width_gradients"] = wide_layer_gradient_report(args.gradient_tokens, args.gradient_experts)
    print("DeepSeek-V3-width layer, gradients:", json.dumps(result["deepseek_width_gradients"], indent=1))
    t, w = result["tiny_model"], result["deepseek_width_layer"]
    print("\n| what | bf16 dispatch | FP8 dispatch |\n|---|---|---|")
    print(
        f"| tiny model: mean KL to float32 (nats) | {t['kl_bf16_vs_float32_mean']:.2e} | {t['kl_fp8_vs_float32_mean']:.2e} |"
    )
    print(
        f"| tiny model: KL(bf16 dispatch \\|\\| FP8 dispatch), mean / max | - | {t['kl_fp8_vs_bf16_mean']:.2e} / {t['kl_fp8_vs_bf16_max']:.2e} |"
    )
    print(f"| tiny model: top-1 agreement with bf16 dispatch | - | {t['top1_agreement_fp8_bf16']:.4f} |")
    print(
        f"| DeepSeek-V3-width layer: relative RMS error vs float32 (bf16 routing flips included) | "
        f"{w['rel_rms_bfloat16_vs_float32']:.2e} | {w['rel_rms_float8_vs_float32']:.2e} |"
    )
    print(
        "| DeepSeek-V3-width layer: relative RMS difference from bf16 dispatch (same routing) | - | "
        f"{w['rel_rms_float8_vs_bfloat16']:.2e} |"
    )
    g = result["deepseek_width_gradients"]
    for name in ("experts", "input"):
        print(
            f"| DeepSeek-V3-width layer: {name} gradient, relative RMS error vs float32 "
            f"(gradient sent to the experts in bf16 / FP8) | {g[f'rel_rms_{name}_grad_bfloat16_vs_float32']:.2e} | "
            f"{g[f'rel_rms_{name}_grad_float8_vs_float32']:.2e} |"
        )
    result["runtime_s"] = time.perf_counter() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nruntime {result['runtime_s']:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
