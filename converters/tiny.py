"""Tiny DeepSeek-V3 checkpoints in the real on-disk format, built offline with transformers.

transformers builds the model (random init), we write it as DeepSeek does: per-expert tensor
names, optionally FP8 with 128x128 block scales, optionally sharded, and with the MTP layer
(`model.layers.{num_hidden_layers}.*`) that transformers itself neither loads nor writes.
Used by the README's quick start and by the tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from converters import fp8
from converters.safetensors_io import write_hf_directory
from converters.torch_interop import StateDictSource
from moe_jax.config import ModelConfig
from moe_jax.params import MTP_EXTRA, TIED_NAMES, decoder_rules, entries, layer_prefix, np_dtype

# A DeepSeek-V3 at toy widths: every feature on (grouped routing, q_lora, YaRN, MTP, a dense layer).
# fmt: off
BASE = dict(
    model_type="deepseek_v3", vocab_size=256, num_hidden_layers=3, first_k_dense_replace=1,
    num_nextn_predict_layers=1, tie_word_embeddings=False, initializer_range=0.1, rms_norm_eps=1e-6,
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
    n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=256, rope_interleave=True,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                         beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
)

# Configs the tests (and `moe-jax make-tiny --variant`) cover; each differs from BASE where named.
VARIANTS: dict[str, dict] = {
    "base": {},
    "flat": dict(  # no groups, q_lora_rank null, plain rope, non-interleaved, 2 shared experts, no dense layer
        n_group=1, topk_group=1, q_lora_rank=None, rope_parameters=dict(rope_type="default", rope_theta=5000.0),
        rope_interleave=False, norm_topk_prob=False, n_shared_experts=2, routed_scaling_factor=1.0,
        first_k_dense_replace=0, num_experts_per_tok=2, num_nextn_predict_layers=0,
    ),
    "wide": dict(  # widths that are not multiples of 128, so FP8 blocks are partial at the edges
        hidden_size=200, intermediate_size=264, moe_intermediate_size=136, q_lora_rank=144, kv_lora_rank=80,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=300, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, num_hidden_layers=2,
        rope_parameters={**BASE["rope_parameters"], "factor": 40.0, "original_max_position_embeddings": 16},
        max_position_embeddings=640, initializer_range=0.05,
    ),
}
# fmt: on


def tiny_config(variant: str = "base", **overrides) -> dict:
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r} (have: {', '.join(VARIANTS)})")
    return {**BASE, **VARIANTS[variant], **overrides}


@torch.no_grad()
def _randomize(module: torch.nn.Module, cfg: ModelConfig, std: float, gen: torch.Generator) -> None:
    """Random weights everywhere, norms near 1 and router biases non-zero so that every
    parameter (the correction bias included) visibly changes the output. What a tensor is comes
    from its rule in the table (fused experts, absent from it under their torch names, are weights)."""
    rules = {e.hf_name: e.rule for e in entries(cfg, mtp=False)}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if "inv_freq" in name:  # rotary frequencies: computed, not weights
            continue
        rule = rules.get(name)
        if rule is not None and rule.init == "ones":
            t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=gen))
        elif rule is not None and rule.buffer:
            t.copy_(0.1 * torch.randn(t.shape, generator=gen))
        else:
            t.copy_(std * torch.randn(t.shape, generator=gen))


def build_torch_model(config: dict, seed: int = 0):
    """transformers' DeepseekV3ForCausalLM for `config`, float32, randomised deterministically."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_cfg = DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("model_type", "quantization_config")})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    _randomize(model, ModelConfig.from_hf_dict(config), config.get("initializer_range", 0.02), gen)
    return model


def mtp_tensors(config: dict, main: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Random MTP layers as DeepSeek stores them (embedding and head copied from the main model)."""
    cfg = ModelConfig.from_hf_dict(config)
    gen = np.random.default_rng(seed + 1)
    std = cfg.initializer_range
    out: dict[str, np.ndarray] = {}
    for j in range(cfg.num_nextn_predict_layers):
        prefix = layer_prefix(cfg.num_hidden_layers + j)
        layer_moe = cfg.num_hidden_layers + j >= cfg.first_k_dense_replace
        for rule in decoder_rules(cfg, layer_moe) + MTP_EXTRA:
            names = [rule.hf.format(e=e) for e in range(cfg.n_routed_experts)] if rule.per_expert else [rule.hf]
            shape = rule.shape(cfg)
            for name in names:
                if rule.tied_to:
                    value = main[TIED_NAMES[rule.tied_to]]
                elif rule.init == "ones":
                    value = 1.0 + 0.2 * gen.standard_normal(shape)
                elif rule.buffer:
                    value = 0.1 * gen.standard_normal(shape)
                else:
                    value = std * gen.standard_normal(shape)
                out[prefix + name] = np.asarray(value, np.float32)
    return out


def checkpoint_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """All float32 tensors of a tiny checkpoint, under their on-disk names, MTP included."""
    model = build_torch_model(config, seed)
    source = StateDictSource(model.state_dict())
    tensors = {n: np.array(source.get(n), np.float32) for n in source.names()}
    tensors.update(mtp_tensors(config, tensors, seed))
    return tensors


def shard_limit(sizes: list[int], shards: int) -> int:
    """The smallest shard size for which `write_checkpoint`'s in-order filling makes at most
    `shards` files: as even as that order allows (exactly `shards` for the tiny models)."""
    if not 1 <= shards <= len(sizes):
        raise ValueError(f"shards must be between 1 and the number of tensors ({len(sizes)}), got {shards}")

    def files(limit: int) -> int:
        count, filled = 1, 0
        for size in sizes:
            if filled and filled + size > limit:
                count, filled = count + 1, 0
            filled += size
        return count

    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if files(mid) <= shards else (mid + 1, high)
    return low


def write_hf_checkpoint(
    out: str | os.PathLike,
    config: dict,
    tensors: dict[str, np.ndarray],
    dtype: str = "float32",
    fp8_weights: bool = False,
    shards: int = 1,
    force: bool = False,
) -> Path:
    """Write `tensors` in DeepSeek's layout (atomically; a non-empty `out` needs `force` and must
    hold an HF checkpoint). With `fp8_weights`, exactly the projections that
    DeepSeek stores in FP8 become e4m3 + `_scale_inv`; the rest is stored as `dtype`, except
    the correction bias, which stays float32 (as in the real checkpoint)."""
    out = Path(out)
    cfg = ModelConfig.from_hf_dict(config)
    rules = {e.hf_name: e.rule for e in entries(cfg)}
    config = dict(config)
    if fp8_weights:
        config["quantization_config"] = dict(fp8.QUANT_CONFIG)

    def stored():
        for name, value in tensors.items():
            rule = rules[name]
            if fp8_weights and rule.fp8:
                q, scale = fp8.quantize(value)
                yield name, q
                yield name + fp8.SCALE_SUFFIX, scale
            elif rule.buffer:
                yield name, value.astype(np.float32)
            else:
                yield name, value.astype(np_dtype(dtype))

    items = list(stored())
    write_hf_directory(out, items, config, shard_limit([v.nbytes for _, v in items], shards), force)
    return out


def make_tiny(
    out: str | os.PathLike,
    variant: str = "base",
    fp8_weights: bool = False,
    dtype: str | None = None,
    shards: int = 1,
    seed: int = 0,
    force: bool = False,
    **overrides,
) -> Path:
    """Build and write a tiny checkpoint; returns its directory. Tensors not in FP8 are stored
    as `dtype` (default: bfloat16 beside FP8, as DeepSeek ships it, else float32)."""
    dtype = dtype or ("bfloat16" if fp8_weights else "float32")
    config = tiny_config(variant, **overrides)
    return write_hf_checkpoint(out, config, checkpoint_tensors(config, seed), dtype, fp8_weights, shards, force)
