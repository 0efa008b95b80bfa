"""One validated model config, read from a Hugging Face DeepSeek-V3 `config.json`.

The same object serves the model, the converters and the validator. Anything we do not
implement exactly is refused with a clear error instead of being silently approximated.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from moe_jax.errors import ConfigError  # noqa: F401  (re-exported)


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
    int4_group_size: int | None = None  # compressed-tensors INT4 checkpoints: inputs per scale
    fp8_scale_fmt: str | None = None  # FP8 checkpoints: "ue8m0" where their scales are powers of two
    # DeepSeek Sparse Attention (DeepSeek-V3.2, `deepseek_v32`): the lightning indexer's heads and
    # width, and the keys each query keeps (None: DeepSeek-V3's dense attention)
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    tensor_prefix: str = ""  # a wrapper's prefix of the language model's tensor names
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
    def dsa(self) -> bool:
        """Whether attention is DeepSeek Sparse Attention (each query attends to the `index_topk`
        keys its lightning indexer scores highest)."""
        return self.index_topk is not None

    @property
    def architecture(self) -> str:
        """transformers' class of this language model."""
        return DEEPSEEK_V32_ARCHITECTURE if self.dsa else DEEPSEEK_V3_ARCHITECTURE

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
        """The config in `path` (a config.json, or the directory holding one)."""
        return read_config(path)[0]

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config dict this was read from (kept verbatim, so export writes it back)."""
        return dict(self.raw)

    def transformers_fields(self) -> dict[str, Any]:
        """The language model's config as keyword arguments of transformers' config class of
        `architecture` (DeepseekV3Config, DeepseekV32Config): without the model type, its (remote)
        code, and its quantization (and for V3.2 rope_interleave, which its MLA has fixed)."""
        dropped = NOT_MODEL_FIELDS + (("rope_interleave",) if self.dsa else ())
        return {k: v for k, v in self.text_config.items() if k not in dropped}

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config: the file itself, or a wrapper's text config."""
        return _text_model(self.raw)[0]

    def with_quantization(self, qc: dict | None) -> dict[str, Any]:
        """The HF config dict with `qc` as its quantization_config (None: removed), where the
        checkpoint keeps it: at the top, and in a wrapper's text config."""
        raw = copy.deepcopy(self.raw)
        places = [raw]
        if self.tensor_prefix:
            key = WRAPPERS[raw["model_type"]][0]
            places = [raw[key]] + ([raw] if "quantization_config" in raw else [])
        for d in places:
            if qc is None:
                d.pop("quantization_config", None)
            else:
                d["quantization_config"] = copy.deepcopy(qc)
        return raw


def read_config(path: str | Path) -> tuple[ModelConfig, str]:
    """(the config, the text it was parsed from) of a config.json or the directory holding one:
    for writers that copy the file as it is, checked, in one read."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text()
        d = json.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config.json not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    except OSError as e:  # a directory of that name, no permission, ...
        raise ConfigError(f"{path}: cannot read config.json ({e.strerror or e})") from None
    try:
        return _from_hf_dict(d), text
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _read_rope(d: dict[str, Any]) -> RopeConfig:
    # transformers v5 writes `rope_parameters` (theta inside); v4 and the original checkpoints
    # write `rope_scaling` (may be null) plus a top-level `rope_theta`. Read as transformers
    # reads them: `rope_scaling` first where both are given.
    key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    params = d.get(key) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{key} must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError("per-layer-type rope_parameters are not supported for deepseek_v3")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if "rope_theta" in params:
        theta = _number(params["rope_theta"], f"{key}.rope_theta", positive=True)
    else:
        theta = _number(d.get("rope_theta", 10000.0), "rope_theta", positive=True)
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=theta)
    if rope_type != "yarn":
        raise ConfigError(f"unsupported rope type {rope_type!r} (supported: default, yarn)")
    # transformers: a top-level original_max_position_embeddings overrides the rope's own, and
    # without either the pretraining length is max_position_embeddings
    if d.get("original_max_position_embeddings") is not None:
        orig = _integer(d["original_max_position_embeddings"], "original_max_position_embeddings")
    elif params.get("original_max_position_embeddings") is not None:
        orig = _integer(params["original_max_position_embeddings"], f"{key}.original_max_position_embeddings")
    else:
        orig = _integer(d["max_position_embeddings"], "max_position_embeddings")
    factor = params.get("factor")
    if factor is None:  # transformers: fall back to the ratio of context lengths
        factor = d["max_position_embeddings"] / orig
    factor = _number(factor, f"{key}.factor", positive=True)

    def optional(name: str, default: float) -> float:  # transformers reads these with `or`
        value = params.get(name)
        return default if value is None else (_number(value, f"{key}.{name}") or default)

    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _number(attention_factor, f"{key}.attention_factor")
    truncate = params.get("truncate", True)
    if truncate is not None:  # null: false, as transformers tests it
        _require(isinstance(truncate, bool), f"{key}.truncate={truncate!r} must be true or false")
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=factor,
        original_max_position_embeddings=orig,
        beta_fast=optional("beta_fast", 32.0),
        beta_slow=optional("beta_slow", 1.0),
        mscale=optional("mscale", 0.0),
        mscale_all_dim=optional("mscale_all_dim", 0.0),
        attention_factor=attention_factor,
        truncate=bool(truncate),
    )


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# No size of a real model comes near this; larger values are typos or hostile input (and token
# ids and positions are int32).
MAX_SIZE = 2**31 - 1


def _integer(value: Any, key: str, low: int = 1) -> int:
    """A JSON integer (not a bool, not a float) in [low, MAX_SIZE]."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    _require(ok, f"{key}={value!r} must be an integer")
    _require(value >= low, f"{key}={value} must be at least {low}")
    _require(value <= MAX_SIZE, f"{key}={value} is too large (at most {MAX_SIZE})")
    return int(value)


def _dense_layers(types: Any, layers: int) -> int:
    """How many dense layers `mlp_layer_types` lists; they must come first, the MoE layers after."""
    valid = isinstance(types, list) and len(types) == layers and all(t in ("dense", "sparse") for t in types)
    _require(valid, f"mlp_layer_types={types!r} must give 'dense' or 'sparse' for each of the {layers} layers")
    dense = types.count("dense")
    _require(
        types[:dense] == ["dense"] * dense,
        f"mlp_layer_types={types!r}: dense layers after MoE layers are not supported",
    )
    return dense


def _number(value: Any, key: str, positive: bool = False) -> float:
    """A finite JSON number (not a bool); > 0 with `positive`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    _require(ok, f"{key}={value!r} must be a finite number")
    _require(not positive or value > 0, f"{key}={value!r} must be positive")
    return float(value)


def _boolean(value: Any, key: str) -> bool:
    _require(isinstance(value, bool), f"{key}={value!r} must be true or false")
    return value


# transformers' DeepseekV3Config defaults, used for keys a config.json leaves out, so that a
# sparse config means here what it means to the reference.
HF_DEFAULTS: dict[str, Any] = {
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_interleave": True,
    "initializer_range": 0.02,
}

# DeepSeek's FP8 (converters.fp8.QUANT_CONFIG). Keys left out take transformers' FP8 defaults (its
# FineGrainedFP8Config writes no `fmt`); quant_method is required.
SUPPORTED_FP8: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}
# compressed-tensors' pack-quantized INT4 (Kimi-K2-Thinking, Kimi-K2.5): weights only, symmetric
# signed 4-bit integers, one scale per `group_size` inputs (converters.int4). Every key listed must
# have this value (group_size: any positive integer); keys not listed are not read.
SUPPORTED_INT4_WEIGHTS: dict[str, Any] = {
    "num_bits": 4,
    "type": "int",
    "symmetric": True,
    "strategy": "group",
    "dynamic": False,
    "actorder": None,
    "block_structure": None,
}


def _same(got: Any, want: Any) -> bool:
    """Compared as JSON text, so that 128.0 or true do not pass for 128 or 1."""
    return json.dumps(got) == json.dumps(want)


# FP8 scale formats (quantization_config.scale_fmt): "ue8m0" (DeepSeek-V3.1, V3.2) stores scales
# that are powers of two; absent, any float32 scale
FP8_SCALE_FORMATS = ("ue8m0",)


def _check_fp8(qc: dict) -> str | None:
    """The FP8 config's scale format, every setting checked."""
    for key, want in SUPPORTED_FP8.items():
        got = qc.get(key, want)
        if not _same(got, want):
            raise ConfigError(f"unsupported quantization_config.{key}={got!r} (supported: {want!r})")
    fmt = qc.get("scale_fmt")
    _require(
        fmt is None or fmt in FP8_SCALE_FORMATS,
        f"unsupported quantization_config.scale_fmt={fmt!r} (supported: {', '.join(map(repr, FP8_SCALE_FORMATS))})",
    )
    return fmt


def _int4_group_size(qc: dict) -> int:
    """The group size of a compressed-tensors INT4 config, every other setting checked."""
    for key, want in (("format", "pack-quantized"), ("quantization_status", "compressed")):
        got = qc.get(key)
        _require(_same(got, want), f"unsupported quantization_config.{key}={got!r} (supported: {want!r})")
    groups = qc.get("config_groups")
    _require(
        isinstance(groups, dict) and len(groups) == 1,
        f"quantization_config.config_groups must hold exactly one group, got {groups!r:.80}",
    )
    ((name, group),) = groups.items()
    _require(isinstance(group, dict), f"quantization_config.config_groups.{name} must be an object")
    for key in ("input_activations", "output_activations"):
        _require(group.get(key) is None, f"unsupported quantization_config.config_groups.{name}.{key} (weights only)")
    weights = group.get("weights")
    _require(isinstance(weights, dict), f"quantization_config.config_groups.{name}.weights must be an object")
    for key, want in SUPPORTED_INT4_WEIGHTS.items():
        got = weights.get(key)
        if not _same(got, want):
            raise ConfigError(
                f"unsupported quantization_config.config_groups.{name}.weights.{key}={got!r} (supported: {want!r})"
            )
    size = weights.get("group_size")
    return _integer(size, f"quantization_config.config_groups.{name}.weights.group_size")


def _read_quantization(qc: Any) -> dict[str, Any]:
    """The ModelConfig fields a quantization_config sets: null or absent, none (FP8 is told by the
    tensors' dtype); DeepSeek's FP8: its scale format; compressed-tensors INT4: its group size.
    Anything else is refused."""
    if qc is None:
        return {}
    _require(isinstance(qc, dict), f"quantization_config must be an object or null, got {qc!r}")
    method = qc.get("quant_method")
    _require("quant_method" in qc, f"quantization_config {qc!r:.80} has no quant_method")
    if method == "compressed-tensors":
        return {"int4_group_size": _int4_group_size(qc)}
    return {"fp8_scale_fmt": _check_fp8(qc)}


# config.json keys that are no DeepseekV3Config field: the model type, its code, its quantization
NOT_MODEL_FIELDS = ("model_type", "quantization_config", "architectures", "auto_map")
# config.json model types that are DeepSeek-V3's architecture (transformers' DeepseekV3ForCausalLM)
# under another name; any config whose `architectures` names it is read as one too. DeepSeek-V3.2 is
# the same model with DeepSeek Sparse Attention (transformers' DeepseekV32ForCausalLM).
DEEPSEEK_V3_TYPES = ("deepseek_v3", "kimi_k2")
DEEPSEEK_V3_ARCHITECTURE = "DeepseekV3ForCausalLM"
DEEPSEEK_V32_TYPES = ("deepseek_v32",)
DEEPSEEK_V32_ARCHITECTURE = "DeepseekV32ForCausalLM"
# transformers' DeepseekV32Config defaults for the indexer, used for keys a V3.2 config.json leaves out
DSA_DEFAULTS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
# Checkpoints that wrap a DeepSeek-V3 language model with more (a vision tower, a projector):
# model_type -> (the key of the text model's config, the prefix of its tensors). The rest of their
# tensors is carried through untouched.
WRAPPERS: dict[str, tuple[str, str]] = {"kimi_k25": ("text_config", "language_model.")}


def _is_deepseek_v32(d: dict) -> bool:
    arch = d.get("architectures")
    return d.get("model_type") in DEEPSEEK_V32_TYPES or (isinstance(arch, list) and DEEPSEEK_V32_ARCHITECTURE in arch)


def _is_deepseek_v3(d: dict) -> bool:
    """DeepSeek-V3's architecture, V3.2's included."""
    arch = d.get("architectures")
    v3 = d.get("model_type") in DEEPSEEK_V3_TYPES or (isinstance(arch, list) and DEEPSEEK_V3_ARCHITECTURE in arch)
    return v3 or _is_deepseek_v32(d)


def _text_model(raw: dict) -> tuple[dict, str]:
    """(the DeepSeek-V3 config, its tensors' name prefix) of a config.json: itself, or the text
    model of a known wrapper."""
    if _is_deepseek_v3(raw):
        return raw, ""
    mt = raw.get("model_type")
    if mt in WRAPPERS:
        key, prefix = WRAPPERS[mt]
        text = raw.get(key)
        _require(isinstance(text, dict), f"model_type {mt!r} needs a {key} object")
        _require(
            _is_deepseek_v3(text),
            f"{key}: unsupported model_type {text.get('model_type')!r} "
            f"(expected one of {', '.join(DEEPSEEK_V3_TYPES + DEEPSEEK_V32_TYPES)})",
        )
        outer = raw.get("quantization_config")
        if outer is not None and text.get("quantization_config") is not None:
            _require(
                _same(outer, text["quantization_config"]),
                f"quantization_config differs from {key}.quantization_config",
            )
        return {**text, "quantization_config": text.get("quantization_config", outer)}, prefix
    arch = raw.get("architectures")
    known = ", ".join((*DEEPSEEK_V3_TYPES, *DEEPSEEK_V32_TYPES, *WRAPPERS))
    raise ConfigError(
        f"unsupported model_type {mt!r} with architectures {arch!r} (supported: model_type {known}, "
        f"or architectures [{DEEPSEEK_V3_ARCHITECTURE!r}] or [{DEEPSEEK_V32_ARCHITECTURE!r}])"
    )


def _from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    if not isinstance(raw, dict):
        kind = "null" if raw is None else {list: "an array", str: "a string"}.get(type(raw), "a number")
        raise ConfigError(f"config.json must hold a JSON object, not {kind}")
    text, prefix = _text_model(raw)
    d = {**HF_DEFAULTS, **text}
    required = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
    ]
    missing = [k for k in required if d.get(k) is None]
    _require(not missing, f"config.json lacks {', '.join(missing)}")
    # Types and ranges first, so that every later check compares numbers.
    sizes = {k: _integer(d[k], k) for k in required + ["max_position_embeddings"]}
    # null means: none (q_lora_rank: Moonlight), 0 / 1 group, no MTP
    q_lora = None if d.get("q_lora_rank") is None else _integer(d["q_lora_rank"], "q_lora_rank")
    counts = {
        k: 0 if d.get(k) is None else _integer(d[k], k, low=0) for k in ("n_shared_experts", "first_k_dense_replace")
    }
    if _is_deepseek_v32(d) and d.get("mlp_layer_types") is not None:  # transformers' V3.2: it decides
        counts["first_k_dense_replace"] = _dense_layers(d["mlp_layer_types"], sizes["num_hidden_layers"])
    n_mtp = d.get("num_nextn_predict_layers", d.get("num_mtp_layers"))
    n_mtp = 0 if n_mtp is None else _integer(n_mtp, "num_nextn_predict_layers", low=0)
    n_group = 1 if d.get("n_group") is None else _integer(d["n_group"], "n_group")
    topk_group = n_group if d.get("topk_group") is None else _integer(d["topk_group"], "topk_group")
    nkv = d.get("num_key_value_heads")
    nkv = None if nkv is None else _integer(nkv, "num_key_value_heads")
    floats = {
        k: _number(d[k], k, positive=k != "initializer_range")
        for k in ("routed_scaling_factor", "rms_norm_eps", "initializer_range")
    }
    flags = {k: _boolean(d[k], k) for k in ("norm_topk_prob", "rope_interleave")}

    # Values that would change the computation in ways we do not implement.
    checks = {
        "scoring_func": ("sigmoid",),
        "topk_method": ("noaux_tc",),
        "hidden_act": ("silu",),
        "moe_layer_freq": (1,),
        "attention_bias": (False,),
        "tie_word_embeddings": (False,),
    }
    for key, allowed in checks.items():  # same type too: 1 is not False, true is not 1
        if key in d and (d[key] not in allowed or type(d[key]) is not type(allowed[0])):
            raise ConfigError(f"unsupported {key}={d[key]!r} (supported: {allowed[0]!r})")
    _require(
        nkv in (None, sizes["num_attention_heads"]),
        f"num_key_value_heads={nkv} must equal num_attention_heads (MLA has one latent KV)",
    )
    quantization = _read_quantization(d.get("quantization_config"))
    dsa = _read_dsa(d, sizes, q_lora) if _is_deepseek_v32(text) else {}

    e, k = sizes["n_routed_experts"], sizes["num_experts_per_tok"]
    _require(k <= e, f"num_experts_per_tok={k} exceeds n_routed_experts={e}")
    _require(e % n_group == 0, f"n_routed_experts={e} is not divisible by n_group={n_group}")
    _require(topk_group <= n_group, f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    per_group = e // n_group
    _require(
        n_group == 1 or per_group >= 2,
        f"group scores take the top-2 experts of each group; {per_group} expert(s) per group",
    )
    kept = topk_group * per_group
    _require(k <= kept, f"num_experts_per_tok={k} exceeds the {kept} experts in kept groups")
    _require(sizes["qk_rope_head_dim"] % 2 == 0, "qk_rope_head_dim must be even")

    return ModelConfig(
        **sizes,
        q_lora_rank=q_lora,
        **counts,
        n_group=n_group,
        topk_group=topk_group,
        **floats,
        **flags,
        rope=_read_rope(d),
        num_nextn_predict_layers=n_mtp,
        **quantization,
        **dsa,
        tensor_prefix=prefix,
        raw=dict(raw),
    )


def _read_dsa(d: dict[str, Any], sizes: dict[str, int], q_lora: int | None) -> dict[str, int]:
    """DeepSeek-V3.2's indexer sizes (transformers' defaults for keys left out), checked: its query
    projection reads MLA's q latent, and its RoPE turns the first qk_rope_head_dim of its dims."""
    out = {k: _integer(default if d.get(k) is None else d[k], k) for k, default in DSA_DEFAULTS.items()}
    _require(q_lora is not None, "deepseek_v32 needs q_lora_rank (its indexer's queries come from MLA's q latent)")
    rope = sizes["qk_rope_head_dim"]
    _require(
        out["index_head_dim"] >= rope,
        f"index_head_dim={out['index_head_dim']} is smaller than qk_rope_head_dim={rope} (its RoPE turns that many dims)",
    )
    _require(
        d.get("rope_interleave", True) is True,
        "deepseek_v32 takes no rope_interleave=false (its MLA rope is interleaved)",
    )
    return out


# config.json of deepseek-ai/DeepSeek-V3 (671B) as it ships: benchmarks and cluster plans start
# here (with depth or experts reduced by overrides), so the real widths live in one place.
DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "initializer_range": 0.006,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    },
}

# DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2, 671B): DeepSeek-V3's config with DeepSeek Sparse Attention
DEEPSEEK_V32: dict[str, Any] = {
    **DEEPSEEK_V3,
    "model_type": "deepseek_v32",
    "architectures": ["DeepseekV32ForCausalLM"],
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
}
