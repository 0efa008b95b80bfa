"""Tiny DeepSeek-V3 checkpoints in the real on-disk format, built offline with transformers.

transformers builds the model (random init), we write it as DeepSeek does: per-expert tensor
names, optionally FP8 with 128x128 block scales, optionally sharded, and with the MTP layer
(`model.layers.{num_hidden_layers}.*`) that transformers itself neither loads nor writes.
Used by the README's quick start and by the tests.
torch and transformers are imported where a checkpoint is built: training the tiny model needs
only its config.
"""

from __future__ import annotations

import base64
import collections
import copy
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from converters import fp8
from converters.safetensors_io import write_hf_directory
from moe_jax.config import ModelConfig
from moe_jax.params import MTP_EXTRA, TIED_NAMES, decoder_rules, entries, layer_prefix, np_dtype

if TYPE_CHECKING:
    import torch

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
    "v32": dict(  # DeepSeek-V3.2: DeepSeek Sparse Attention, each query keeping 32 keys (16 index heads:
        # scores rarely tie at 0, where the choice between equal keys is the implementation's)
        model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
        index_n_heads=16, index_head_dim=16, index_topk=32,
    ),
}

# Kimi-K2's config.json as Moonshot ships it (model_type kimi_k2, remote-code auto_map, legacy
# rope_scaling, no MTP, one group), at BASE's toy widths; vocabulary: the tiny tiktoken BPE's 304
# tokens and 16 special ones.
KIMI_K2 = dict(
    architectures=["DeepseekV3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
    auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config", "AutoModel": "modeling_deepseek.DeepseekV3Model",
              "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    aux_loss_alpha=0.001, bos_token_id=304, eos_token_id=305, first_k_dense_replace=1, hidden_act="silu",
    hidden_size=64, initializer_range=0.1, intermediate_size=96, kv_lora_rank=32, max_position_embeddings=512,
    model_type="kimi_k2", moe_intermediate_size=32, moe_layer_freq=1, n_group=1, n_routed_experts=16,
    n_shared_experts=1, norm_topk_prob=True, num_attention_heads=4, num_experts_per_tok=4, num_hidden_layers=3,
    num_key_value_heads=4, num_nextn_predict_layers=0, pretraining_tp=1, q_lora_rank=48, qk_nope_head_dim=16,
    qk_rope_head_dim=8, rms_norm_eps=1e-6, rope_theta=50000.0, routed_scaling_factor=2.827,
    rope_scaling=dict(beta_fast=1.0, beta_slow=1.0, factor=32.0, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=16, type="yarn"),
    scoring_func="sigmoid", seq_aux=True, tie_word_embeddings=False, topk_group=1, topk_method="noaux_tc",
    torch_dtype="bfloat16", transformers_version="4.48.3", use_cache=True, v_head_dim=24, vocab_size=320,
)
# Kimi-K2-Thinking's quantization_config: routed experts in compressed-tensors INT4, groups of 32
KIMI_INT4 = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int"},
    }},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}
# Kimi-K2.5's wrapper around the text model: its config (the text model's under text_config) and
# a vision tower and projector at toy sizes, under Moonshot's names (carried through, not modeled)
KIMI_K25 = dict(
    architectures=["KimiK25ForConditionalGeneration"],
    auto_map={"AutoConfig": "configuration_kimi_k25.KimiK25Config",
              "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
              "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
    bos_token_id=304, eos_token_id=305, pad_token_id=319, ignore_index=-100, media_placeholder_token_id=310,
    model_type="kimi_k25", tie_word_embeddings=False,
    vision_config=dict(init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=4, merge_kernel_size=[2, 2],
                       mm_hidden_size=16, mm_projector_type="patchmerger", patch_size=14, text_hidden_size=64,
                       vt_hidden_size=16, vt_intermediate_size=24, vt_num_attention_heads=2, vt_num_hidden_layers=1),
)
VISION_TENSORS = {  # name -> shape (bf16, as shipped)
    "vision_tower.patch_embed.proj.weight": (16, 3, 14, 14), "vision_tower.patch_embed.proj.bias": (16,),
    "vision_tower.patch_embed.pos_emb.weight": (4, 4, 16),
    "vision_tower.encoder.blocks.0.norm0.weight": (16,), "vision_tower.encoder.blocks.0.norm0.bias": (16,),
    "vision_tower.encoder.blocks.0.wqkv.weight": (48, 16), "vision_tower.encoder.blocks.0.wqkv.bias": (48,),
    "vision_tower.encoder.blocks.0.wo.weight": (16, 16), "vision_tower.encoder.blocks.0.mlp.fc0.weight": (24, 16),
    "vision_tower.encoder.blocks.0.mlp.fc1.weight": (16, 24), "vision_tower.encoder.final_layernorm.weight": (16,),
    "mm_projector.pre_norm.weight": (16,), "mm_projector.proj.0.weight": (64, 64), "mm_projector.proj.2.weight": (64, 64),
}
# fmt: on
FAMILIES = {"kimi-k2": KIMI_K2}


def tiny_config(variant: str = "base", **overrides) -> dict:
    if variant in FAMILIES:
        return copy.deepcopy({**FAMILIES[variant], **overrides})
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny variant {variant!r} (have: {', '.join([*VARIANTS, *FAMILIES])})")
    return {**BASE, **VARIANTS[variant], **overrides}


def _randomize(module: torch.nn.Module, cfg: ModelConfig, std: float, gen: torch.Generator) -> None:
    """Random weights everywhere, norms near 1 and router biases non-zero so that every
    parameter (the correction bias included) visibly changes the output. What a tensor is comes
    from its rule in the table (fused experts, absent from it under their torch names, are weights)."""
    import torch

    rules = {e.hf_name: e.rule for e in entries(cfg, mtp=False)}
    with torch.no_grad():
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
    """transformers' DeepseekV3ForCausalLM (DeepseekV32ForCausalLM for V3.2) for `config`, float32,
    randomised deterministically."""
    import torch

    from converters.torch_interop import transformers_classes

    cfg = ModelConfig.from_hf_dict(config)
    config_class, model_class = transformers_classes(cfg)
    torch.manual_seed(seed)
    model = model_class(config_class(**cfg.transformers_fields())).eval()
    gen = torch.Generator().manual_seed(seed)
    _randomize(model, cfg, config.get("initializer_range", 0.02), gen)
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
    from converters.torch_interop import StateDictSource

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


def int4_compress(w: np.ndarray, quantization_config: dict) -> dict[str, np.ndarray]:
    """`weight_packed`, `weight_scale` (bf16) and `weight_shape` (int32, as Kimi ships it) of a
    weight [out, in], cast to bf16 and quantized by the compressed-tensors library (its min-max
    scales, its packing)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = next(iter(QuantizationConfig.model_validate(quantization_config).config_groups.values()))
    weight = torch.from_numpy(np.asarray(w, np.float32)).to(torch.bfloat16)
    groups = weight.unflatten(-1, (weight.shape[-1] // scheme.weights.group_size, scheme.weights.group_size))
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    parts = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
    out = BaseCompressor.get_value_from_registry("pack-quantized").compress(parts, scheme)
    return {
        "weight_packed": out["weight_packed"].numpy(),
        "weight_scale": out["weight_scale"].view(torch.int16).numpy().view(ml_dtypes.bfloat16),
        "weight_shape": out["weight_shape"].numpy().astype(np.int32),
    }


def write_hf_checkpoint(
    out: str | os.PathLike,
    config: dict,
    tensors: dict[str, np.ndarray],
    dtype: str = "float32",
    fp8_weights: bool = False,
    shards: int = 1,
    force: bool = False,
    int4_experts: bool = False,
    wrapper: str | None = None,
    files: dict[str, bytes] = {},
) -> Path:
    """Write `tensors` in DeepSeek's layout (atomically; a non-empty `out` needs `force` and must
    hold an HF checkpoint). With `fp8_weights`, exactly the projections that
    DeepSeek stores in FP8 become e4m3 + `_scale_inv`; with `int4_experts`, the routed experts
    are compressed-tensors INT4 as Kimi-K2-Thinking stores them; the rest is stored as `dtype`,
    except the correction bias, which stays float32 (as in the real checkpoint). `wrapper`
    ("kimi_k25"): the model inside Kimi-K2.5's multimodal wrapper, beside a (tiny, random)
    vision tower and projector. `files`: more files by name (a tokenizer)."""
    out = Path(out)
    cfg = ModelConfig.from_hf_dict(config)
    rules = {e.hf_name: e.rule for e in entries(cfg)}
    config = dict(config)
    if fp8_weights:
        config["quantization_config"] = dict(fp8.QUANT_CONFIG)
    if int4_experts:
        config["quantization_config"] = copy.deepcopy(KIMI_INT4)
    prefix = ""
    if wrapper is not None:
        if wrapper != "kimi_k25":
            raise ValueError(f"unknown wrapper {wrapper!r} (have: kimi_k25)")
        config, prefix = {**copy.deepcopy(KIMI_K25), "text_config": config}, "language_model."

    def stored():
        for name, value in tensors.items():
            rule = rules[name]
            if fp8_weights and rule.fp8:
                q, scale = fp8.quantize(value)
                yield name, q
                yield name + fp8.SCALE_SUFFIX, scale
            elif int4_experts and rule.per_expert:
                for part, array in int4_compress(value, KIMI_INT4).items():
                    yield name[: -len("weight")] + part, array
            elif rule.buffer:
                yield name, value.astype(np.float32)
            else:
                yield name, value.astype(np_dtype(dtype))

    items = [(prefix + name, value) for name, value in stored()]
    if wrapper is not None:
        gen = np.random.default_rng(1)
        items += [(n, (0.05 * gen.standard_normal(s)).astype(ml_dtypes.bfloat16)) for n, s in VISION_TENSORS.items()]
    limit = shard_limit([v.nbytes for _, v in items], shards)
    write_hf_directory(out, items, config, limit, force, files)
    return out


# ---- a tiny tiktoken tokenizer in Kimi's files ---------------------------------------------------
BPE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Experts route the tokens; the router picks the "
    "experts with the highest scores, and the experts process the tokens that they are given. "
    "模型的专家处理分配给它们的词元。 Mixture of experts models train faster than dense models of "
    "the same quality, and they serve the tokens at a lower cost per token."
)
KIMI_SPECIALS = {  # id -> content, as Kimi's tokenizer_config.json names them (the rest reserved)
    304: "[BOS]",
    305: "[EOS]",
    306: "<|im_end|>",
    307: "<|im_user|>",
    308: "<|im_assistant|>",
    310: "<|start_header_id|>",
    311: "<|end_header_id|>",
    313: "[EOT]",
    314: "<|im_system|>",
    318: "[UNK]",
    319: "[PAD]",
}


def train_bpe(text: str, vocab: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair merged, repeatedly
    (ties broken by the pair's bytes), within words (a word keeps its leading space)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in re.findall(r" ?\S+|\s+", text)]
    while len(ranks) < vocab:
        counts = collections.Counter(p for w in words for p in zip(w, w[1:]))
        if not counts:
            break
        pair = max(counts, key=lambda p: (counts[p], p))
        ranks[pair[0] + pair[1]] = len(ranks)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == pair:
                    w[i : i + 2] = [pair[0] + pair[1]]
                i += 1
    return ranks


def kimi_tokenizer_files(base_vocab: int = 304, specials: dict[int, str] = KIMI_SPECIALS) -> dict[str, bytes]:
    """`tiktoken.model` (base64 token, rank per line) and `tokenizer_config.json` as Kimi ships them."""
    ranks = train_bpe(BPE_TEXT, base_vocab)
    model = "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1]))
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
    config = {
        "added_tokens_decoder": {str(i): {"content": c, **flags} for i, c in specials.items()},
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    return {"tiktoken.model": model.encode(), "tokenizer_config.json": json.dumps(config, indent=2).encode()}


def make_tiny(
    out: str | os.PathLike,
    variant: str = "base",
    fp8_weights: bool = False,
    dtype: str | None = None,
    shards: int = 1,
    seed: int = 0,
    force: bool = False,
    int4_experts: bool = False,
    wrapper: str | None = None,
    **overrides,
) -> Path:
    """Build and write a tiny checkpoint; returns its directory. Tensors not in FP8 or INT4 are
    stored as `dtype` (default: bfloat16 beside FP8 or INT4, as DeepSeek and Kimi ship it, else
    float32). The Kimi family (`variant="kimi-k2"`) comes with Kimi's tiktoken tokenizer files."""
    if fp8_weights and int4_experts:
        raise ValueError("a checkpoint is FP8 or INT4, not both")
    dtype = dtype or ("bfloat16" if fp8_weights or int4_experts else "float32")
    config = tiny_config(variant, **overrides)
    files = kimi_tokenizer_files() if variant in FAMILIES else {}
    tensors = checkpoint_tensors(config, seed)
    return write_hf_checkpoint(out, config, tensors, dtype, fp8_weights, shards, force, int4_experts, wrapper, files)
