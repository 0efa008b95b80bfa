"""One validated model config, read from a Hugging Face DeepSeek-V3 `config.json`.

The same object serves the model, the converters and the validator. Anything we do not
implement exactly is refused with a clear error instead of being silently approximated.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """An HF config that this implementation cannot reproduce exactly."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: `default` or `yarn`, as transformers computes it."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 0
    initializer_range: float = 0.02
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.num_dense_layers

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for yarn (as transformers)."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.rope_type == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return _from_hf_dict(d)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        try:
            return _from_hf_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config dict this was read from (kept verbatim, so export writes it back)."""
        return dict(self.raw)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _read_rope(d: dict[str, Any]) -> RopeConfig:
    # transformers v5 writes `rope_parameters` (theta inside); v4 and the original checkpoints
    # write `rope_scaling` (may be null) plus a top-level `rope_theta`.
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters/rope_scaling must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported for deepseek_v3")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=theta)
    if rope_type != "yarn":
        raise ConfigError(f"unsupported rope type {rope_type!r} (supported: default, yarn)")
    orig = params.get("original_max_position_embeddings")
    if orig is None:
        raise ConfigError("yarn rope needs original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:  # transformers: fall back to the ratio of context lengths
        factor = d.get("max_position_embeddings", 4096) / orig
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# transformers' DeepseekV3Config defaults, used for keys a config.json leaves out, so that a
# sparse config means here what it means to the reference.
HF_DEFAULTS: dict[str, Any] = {
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "rope_interleave": True, "initializer_range": 0.02,
}  # fmt: skip


def _from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    d = {**HF_DEFAULTS, **raw}
    mt = d.get("model_type")
    _require(mt == "deepseek_v3", f"unsupported model_type {mt!r} (expected 'deepseek_v3')")
    required = [
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
    ]  # fmt: skip
    missing = [k for k in required if d.get(k) is None]
    _require(not missing, f"config.json lacks {', '.join(missing)}")

    # Values that would change the computation in ways we do not implement.
    checks = {
        "scoring_func": ("sigmoid",),
        "topk_method": ("noaux_tc",),
        "hidden_act": ("silu",),
        "moe_layer_freq": (1,),
        "attention_bias": (False,),
        "tie_word_embeddings": (False,),
    }
    for key, allowed in checks.items():
        if key in d and d[key] not in allowed:
            raise ConfigError(f"unsupported {key}={d[key]!r} (supported: {allowed[0]!r})")
    nkv = d.get("num_key_value_heads")
    _require(
        nkv in (None, d["num_attention_heads"]),
        f"num_key_value_heads={nkv} must equal num_attention_heads (MLA has one latent KV)",
    )
    qc = d.get("quantization_config")
    if qc:
        _require(
            qc.get("quant_method") == "fp8" and list(qc.get("weight_block_size", [128, 128])) == [128, 128],
            f"unsupported quantization_config {qc!r} (supported: fp8 with 128x128 blocks)",
        )

    n_group = d.get("n_group") or 1
    topk_group = d.get("topk_group") or n_group
    e, k = d["n_routed_experts"], d["num_experts_per_tok"]
    _require(e % n_group == 0, f"n_routed_experts={e} is not divisible by n_group={n_group}")
    _require(1 <= topk_group <= n_group, f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    per_group = e // n_group
    _require(
        n_group == 1 or per_group >= 2,
        f"group scores take the top-2 experts of each group; {per_group} expert(s) per group",
    )
    _require(1 <= k <= topk_group * per_group, f"num_experts_per_tok={k} exceeds the experts in kept groups")
    _require(d["qk_rope_head_dim"] % 2 == 0, "qk_rope_head_dim must be even")

    q_lora = d.get("q_lora_rank")
    return ModelConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=int(d["num_attention_heads"]),
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(d["kv_lora_rank"]),
        qk_nope_head_dim=int(d["qk_nope_head_dim"]),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
        n_routed_experts=int(e),
        num_experts_per_tok=int(k),
        n_shared_experts=int(d["n_shared_experts"] or 0),
        n_group=int(n_group),
        topk_group=int(topk_group),
        first_k_dense_replace=int(d["first_k_dense_replace"] or 0),
        routed_scaling_factor=float(d["routed_scaling_factor"]),
        norm_topk_prob=bool(d["norm_topk_prob"]),
        rms_norm_eps=float(d["rms_norm_eps"]),
        max_position_embeddings=int(d["max_position_embeddings"]),
        rope=_read_rope(d),
        rope_interleave=bool(d["rope_interleave"]),
        num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0),
        initializer_range=float(d["initializer_range"]),
        raw=dict(raw),
    )
