"""Every parameter of the model, and everything known about it: the one table.

Each `Rule` names an on-disk HF tensor (relative to its scope), the parameter path it fills,
its HF (torch `[out, in]`) shape as a function of the config, the transform between the two (a
transpose, or none), and the facts the rest of the code derives from it: the logical axes that
`moe_jax.sharding` maps onto a mesh, the dtype policy (the router stays float32), whether it is
trained and weight-decayed, its random init, DeepSeek's FP8 storage, and tied copies. The scope
decides the prefix and which stacked index a tensor fills: decoder layers are stacked per kind
(`dense`, `moe`, `mtp`) so that the forward can `lax.scan` over them, and routed experts are
stacked along a second axis.

`entries(cfg)` expands the table into concrete tensors; import (`converters.load`), export,
torch interop and the tiny-checkpoint writer run over the same entries, so no direction has a
hand-written inverse. `rule_of(path)` finds the rule of a leaf of the tree (sharding, the
optimizer's decay mask, dtype casts).

Parameter tree (`[L]` = stacked layers of that kind, `[E]` = routed experts; `[in, out]`):

    params/embed [V, H]   params/final_norm [H]   params/lm_head [H, V]
    params/{dense,moe}/input_norm [L, H], post_norm [L, H]
    params/{dense,moe}/attn/{q_a_proj, q_norm, q_b_proj | q_proj, kv_a_proj, kv_norm, kv_b_proj, o_proj}
    params/{dense,moe}/attn/indexer/{wq_b, wk, k_norm, k_bias, weights_proj} (DeepSeek-V3.2)
    params/dense/mlp/{gate, up, down}
    params/moe/router [L, H, E] (float32)    buffers/moe/router_bias [L, E] (float32, not trained)
    params/moe/experts/{gate, up} [L, E, H, I], down [L, E, I, H]
    params/moe/shared/{gate, up, down}
    params/mtp/{enorm, hnorm, head_norm} [N, H], eh_proj [N, 2H, H], params/mtp/layer/... (a moe layer)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import ml_dtypes
import numpy as np

from moe_jax.config import ModelConfig

Shape = Callable[[ModelConfig], tuple[int, ...]]
PARAM_DTYPES = ("float32", "bfloat16", "float16")  # what parameters may be kept in
Axes = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str  # HF name relative to the scope prefix; "{e}" stands for the expert index
    path: str  # parameter path relative to the scope, "/"-separated
    shape: Shape  # the HF tensor's shape (torch Linear layout [out, in])
    transpose: bool = False  # param = hf.T (Linear weights)
    fp8: bool = False  # DeepSeek stores it as e4m3 with a `_scale_inv` per 128x128 block
    axes: Axes = ()  # logical names of the param's own dimensions (`moe_jax.sharding.RULES`); () = replicated
    init: str = "normal"  # random init: normal | ones | zeros
    buffer: bool = False  # not trained (lives under `buffers/`)
    decay: bool = True  # AdamW weight decay applies (matrices; not norms)
    float32: bool = False  # kept in float32 whatever the param dtype (router, as transformers)
    tied_to: str | None = None  # on disk a copy of this top-level param (MTP embed/head)

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf


@dataclasses.dataclass(frozen=True)
class Entry:
    """One concrete HF tensor and the slot of the parameter tree it fills."""

    hf_name: str
    path: tuple[str, ...]  # full path in the tree, e.g. ("params", "moe", "attn", "o_proj")
    index: tuple[int, ...]  # (layer,) or (layer, expert) within the stacked param; () at top
    stack: tuple[int, ...]  # leading stacked dims of the param: (), (L,) or (L, E)
    rule: Rule
    hf_shape: tuple[int, ...]

    @property
    def param_shape(self) -> tuple[int, ...]:
        s = self.hf_shape
        return self.stack + (tuple(reversed(s)) if self.rule.transpose else s)


def _h(c: ModelConfig) -> int:
    return c.hidden_size


def _norm(hf: str, path: str, size: Shape) -> Rule:
    """An RMSNorm scale: starts at one, replicated, no weight decay."""
    return Rule(hf, path, size, init="ones", decay=False)


def _linear(hf: str, path: str, shape: Shape, axes: Axes) -> Rule:
    """A projection DeepSeek stores in FP8: torch [out, in] on disk, [in, out] here."""
    return Rule(hf, path, shape, transpose=True, fp8=True, axes=axes)


GLOBAL = [
    Rule("model.embed_tokens.weight", "embed", lambda c: (c.vocab_size, _h(c)), axes=("vocab", "embed")),
    _norm("model.norm.weight", "final_norm", lambda c: (_h(c),)),
    Rule("lm_head.weight", "lm_head", lambda c: (c.vocab_size, _h(c)), transpose=True, axes=("embed", "vocab")),
]

NORMS = [
    _norm("input_layernorm.weight", "input_norm", lambda c: (_h(c),)),
    _norm("post_attention_layernorm.weight", "post_norm", lambda c: (_h(c),)),
]

_A = "self_attn."
ATTN_Q_LORA = [
    _linear(_A + "q_a_proj.weight", "attn/q_a_proj", lambda c: (c.q_lora_rank, _h(c)), ("embed", None)),
    _norm(_A + "q_a_layernorm.weight", "attn/q_norm", lambda c: (c.q_lora_rank,)),
    _linear(
        _A + "q_b_proj.weight",
        "attn/q_b_proj",
        lambda c: (c.num_attention_heads * c.qk_head_dim, c.q_lora_rank),
        ("lora", "heads"),
    ),
]
ATTN_Q_FULL = [
    _linear(
        _A + "q_proj.weight",
        "attn/q_proj",
        lambda c: (c.num_attention_heads * c.qk_head_dim, _h(c)),
        ("embed", "heads"),
    ),
]
ATTN_KV = [
    _linear(
        _A + "kv_a_proj_with_mqa.weight",
        "attn/kv_a_proj",
        lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, _h(c)),
        ("embed", None),
    ),
    _norm(_A + "kv_a_layernorm.weight", "attn/kv_norm", lambda c: (c.kv_lora_rank,)),
    _linear(
        _A + "kv_b_proj.weight",
        "attn/kv_b_proj",
        lambda c: (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        ("lora", "heads"),
    ),
    _linear(
        _A + "o_proj.weight", "attn/o_proj", lambda c: (_h(c), c.num_attention_heads * c.v_head_dim), ("heads", "embed")
    ),
]

# DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): its queries from MLA's q latent,
# one key a token shared by its heads (a LayerNorm with a bias), and a weight a head; stored as
# DeepSeek ships them (wq_b and wk in FP8, weights_proj in bf16, the norm in float32)
_I = _A + "indexer."
ATTN_INDEXER = [
    _linear(
        _I + "wq_b.weight",
        "attn/indexer/wq_b",
        lambda c: (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
        ("lora", "heads"),
    ),
    _linear(_I + "wk.weight", "attn/indexer/wk", lambda c: (c.index_head_dim, _h(c)), ("embed", None)),
    _norm(_I + "k_norm.weight", "attn/indexer/k_norm", lambda c: (c.index_head_dim,)),
    Rule(_I + "k_norm.bias", "attn/indexer/k_bias", lambda c: (c.index_head_dim,), init="zeros", decay=False),
    Rule(
        _I + "weights_proj.weight",
        "attn/indexer/weights_proj",
        lambda c: (c.index_n_heads, _h(c)),
        transpose=True,
        axes=("embed", None),
    ),
]


def _ffn(hf: str, path: str, width: Shape) -> list[Rule]:
    return [
        _linear(f"{hf}.gate_proj.weight", f"{path}/gate", lambda c: (width(c), _h(c)), ("embed", "mlp")),
        _linear(f"{hf}.up_proj.weight", f"{path}/up", lambda c: (width(c), _h(c)), ("embed", "mlp")),
        _linear(f"{hf}.down_proj.weight", f"{path}/down", lambda c: (_h(c), width(c)), ("mlp", "embed")),
    ]


DENSE_MLP = _ffn("mlp", "mlp", lambda c: c.intermediate_size)
MOE_MLP = [
    # the router is small and read by every token: replicated, float32 (as transformers computes it)
    Rule("mlp.gate.weight", "router", lambda c: (c.n_routed_experts, _h(c)), transpose=True, float32=True),
    Rule(
        "mlp.gate.e_score_correction_bias",
        "router_bias",
        lambda c: (c.n_routed_experts,),
        init="zeros",
        buffer=True,
        decay=False,
        float32=True,
    ),
    *_ffn("mlp.experts.{e}", "experts", lambda c: c.moe_intermediate_size),
    *_ffn("mlp.shared_experts", "shared", lambda c: c.shared_intermediate_size),
]
MTP_EXTRA = [
    _norm("enorm.weight", "enorm", lambda c: (_h(c),)),
    _norm("hnorm.weight", "hnorm", lambda c: (_h(c),)),
    Rule("eh_proj.weight", "eh_proj", lambda c: (_h(c), 2 * _h(c)), transpose=True, axes=(None, "embed")),
    _norm("shared_head.norm.weight", "head_norm", lambda c: (_h(c),)),
    # DeepSeek writes copies of the main embedding and head into the MTP layer; the MTP
    # module shares them (paper, section 2.2), so they map onto the main parameters.
    Rule("embed_tokens.weight", "", lambda c: (c.vocab_size, _h(c)), tied_to="embed"),
    Rule("shared_head.head.weight", "", lambda c: (c.vocab_size, _h(c)), transpose=True, tied_to="lm_head"),
]
TIED_NAMES = {rule.path: rule.hf for rule in GLOBAL}  # the top-level tensors that MTP layers copy


def decoder_rules(cfg: ModelConfig, moe: bool) -> list[Rule]:
    attn = (ATTN_Q_LORA if cfg.q_lora_rank is not None else ATTN_Q_FULL) + ATTN_KV + (ATTN_INDEXER if cfg.dsa else [])
    return NORMS + attn + (MOE_MLP if moe else DENSE_MLP)


def layer_stack(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """(stack name, index in it) of HF layer number `layer` (MTP layers follow the main ones)."""
    if layer < cfg.num_dense_layers:
        return "dense", layer
    if layer < cfg.num_hidden_layers:
        return "moe", layer - cfg.num_dense_layers
    return "mtp", layer - cfg.num_hidden_layers


def layer_prefix(layer: int) -> str:
    """The HF name prefix of decoder layer `layer` (MTP layers are numbered after the main ones)."""
    return f"model.layers.{layer}."


def has_mtp_tensors(names, cfg: ModelConfig) -> bool:
    """Whether a checkpoint's tensor names include the MTP layers that `cfg` declares."""
    prefix = layer_prefix(cfg.num_hidden_layers)
    return cfg.num_nextn_predict_layers > 0 and any(n.startswith(prefix) for n in names)


def entries(cfg: ModelConfig, mtp: bool = True) -> list[Entry]:
    """Every HF tensor of a checkpoint with this config (no `_scale_inv`), in file order."""
    out: list[Entry] = []

    def add(rule: Rule, hf_prefix: str, scope: tuple[str, ...], index: tuple[int, ...], stack: tuple[int, ...]):
        top = "buffers" if rule.buffer else "params"
        if rule.tied_to:
            path, index, stack = (top, rule.tied_to), (), ()
        else:
            path = (top, *scope, *rule.path.split("/"))
        shape = tuple(int(d) for d in rule.shape(cfg))
        if rule.per_expert:
            for e in range(cfg.n_routed_experts):
                name = hf_prefix + rule.hf.format(e=e)
                out.append(Entry(name, path, index + (e,), stack + (cfg.n_routed_experts,), rule, shape))
        else:
            out.append(Entry(hf_prefix + rule.hf, path, index, stack, rule, shape))

    for rule in GLOBAL[:1]:
        add(rule, "", (), (), ())
    n_mtp = cfg.num_nextn_predict_layers if mtp else 0
    sizes = {"dense": cfg.num_dense_layers, "moe": cfg.num_moe_layers, "mtp": n_mtp}
    for layer in range(cfg.num_hidden_layers + n_mtp):
        kind, i = layer_stack(cfg, layer)
        prefix = layer_prefix(layer)
        scope = ("mtp", "layer") if kind == "mtp" else (kind,)
        is_moe = layer >= cfg.first_k_dense_replace
        for rule in decoder_rules(cfg, is_moe):
            add(rule, prefix, scope, (i,), (sizes[kind],))
        if kind == "mtp":
            for rule in MTP_EXTRA:
                add(rule, prefix, ("mtp",), (i,), (sizes[kind],))
    for rule in GLOBAL[1:]:
        add(rule, "", (), (), ())
    return out


def param_shapes(cfg: ModelConfig, mtp: bool = True) -> dict[tuple[str, ...], tuple[tuple[int, ...], Rule]]:
    """Full shape (and the rule) of every leaf of the parameter tree."""
    shapes: dict[tuple[str, ...], tuple[tuple[int, ...], Rule]] = {}
    for e in entries(cfg, mtp):
        if not e.rule.tied_to:
            shapes[e.path] = (e.param_shape, e.rule)
    return shapes


def _index_rules() -> dict[tuple[str, ...], tuple[Rule, int]]:
    """Every leaf path any config can have -> (its rule, how many stacked dims lead its shape)."""
    index: dict[tuple[str, ...], tuple[Rule, int]] = {}

    def add(scope: tuple[str, ...], rules: list[Rule], stacked: int) -> None:
        for rule in rules:
            if not rule.tied_to:
                path = ("buffers" if rule.buffer else "params", *scope, *rule.path.split("/"))
                index[path] = (rule, stacked + rule.per_expert)

    decoder = NORMS + ATTN_Q_LORA + ATTN_Q_FULL + ATTN_KV + ATTN_INDEXER
    add((), GLOBAL, 0)
    add(("dense",), decoder + DENSE_MLP, 1)
    add(("moe",), decoder + MOE_MLP, 1)
    add(("mtp", "layer"), decoder + DENSE_MLP + MOE_MLP, 1)
    add(("mtp",), MTP_EXTRA, 1)
    return index


_RULES_BY_PATH = _index_rules()


def rule_of(path: tuple[str, ...]) -> Rule:
    """The rule of the tree leaf at `path`, e.g. ("params", "moe", "experts", "gate")."""
    try:
        return _RULES_BY_PATH[tuple(path)][0]
    except KeyError:
        raise KeyError(f"{'/'.join(path)} is not a parameter of the model") from None


def logical_axes(path: tuple[str, ...], ndim: int) -> Axes:
    """Logical name of each dimension of the leaf at `path` (None: not sharded): layer stacks
    lead unsharded, routed experts are split over "expert", the rest is the rule's own axes."""
    rule, stacked = _RULES_BY_PATH[tuple(path)]
    own = ("expert",) if rule.per_expert else ()
    return (None,) * (ndim - len(own) - len(rule.axes)) + own + rule.axes


def leaf_dtype(rule: Rule, dtype) -> np.dtype:
    """The dtype a parameter is kept in when the model's parameters are `dtype`."""
    return np.dtype(np.float32) if rule.float32 else np_dtype(dtype)


def np_dtype(name) -> np.dtype:
    """numpy dtype from a name or dtype ("bfloat16" is ml_dtypes')."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def init_tree(cfg: ModelConfig, seed: int = 0, dtype: str = "float32", mtp: bool = True) -> dict:
    """Random weights for every parameter of the table (normal(0, initializer_range), norms one,
    router biases zero), as numpy arrays: for training from scratch and tests."""
    rng = np.random.default_rng(seed)
    tree: dict = {}
    for path, (shape, rule) in param_shapes(cfg, mtp).items():
        if rule.init == "ones":
            value = np.ones(shape, np.float32)
        elif rule.init == "zeros":
            value = np.zeros(shape, np.float32)
        else:
            value = cfg.initializer_range * rng.standard_normal(shape, np.float32)
        set_path(tree, path, value.astype(leaf_dtype(rule, dtype)))
    return tree


def set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_path(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree
