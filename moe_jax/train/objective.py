"""The training objective (DeepSeek-V3 paper, sections 2.1.2 and 2.2) and its bookkeeping:
next-token cross-entropy, the MTP loss, the sequence-wise balance loss, expert loads, the
auxiliary-loss-free bias update, and model FLOPs per token for MFU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.config import ModelConfig
from moe_jax.moe import Routing


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over mask of -log p(target); logits [..., V] (float32 softmax)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def targets_at(tokens: jax.Array, segment_ids: jax.Array, offset: int) -> tuple[jax.Array, jax.Array]:
    """For rows tokens [B, S+1]: the token `offset` places ahead of each input position (inputs are
    tokens[:, :S]), and whether it exists in the same document."""
    s = tokens.shape[1] - 1
    pad = offset - 1  # positions whose target lies past the row
    tgt = jnp.pad(tokens[:, offset:], ((0, 0), (0, pad)))[:, :s]
    seg_t = jnp.pad(segment_ids[:, offset:], ((0, 0), (0, pad)), constant_values=-1)[:, :s]
    return tgt, (seg_t == segment_ids[:, :s]) & (segment_ids[:, :s] > 0)


def expert_loads(routing: list[Routing], n_experts: int) -> jax.Array:
    """Tokens routed to each expert, per MoE layer (MTP layers last): [layers, E] float32."""
    loads = []
    for r in routing:  # each [L, T, k]
        loads.append(jax.nn.one_hot(r.experts, n_experts, dtype=jnp.float32).sum(axis=(1, 2)))
    return jnp.concatenate(loads, axis=0)


def balance_loss(routing: list[Routing], batch: int, cfg: ModelConfig) -> jax.Array:
    """Sequence-wise balance loss (paper eq. 17-20), summed over MoE layers, mean over sequences:
    sum_i f_i P_i with f_i = E/(K*S) * (tokens of the sequence choosing i) and P_i the mean over
    the sequence of the affinity s_i normalised over all experts."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    total = jnp.zeros((), jnp.float32)
    for r in routing:
        layers, t = r.experts.shape[:2]
        chosen = jax.nn.one_hot(r.experts, e, dtype=jnp.float32).sum(2).reshape(layers, batch, t // batch, e)
        f = chosen.mean(2) * (e / k)  # [L, B, E]
        scores = r.scores.reshape(layers, batch, t // batch, e)
        p = (scores / scores.sum(-1, keepdims=True)).mean(2)
        total = total + (f * p).sum(-1).mean(-1).sum()
    return total


def imbalance(loads: jax.Array) -> jax.Array:
    """max / mean expert load per layer (1 = perfectly balanced)."""
    return loads.max(-1) / jnp.maximum(loads.mean(-1), 1e-9)


def update_router_bias(buffers: dict, loads: jax.Array, gamma: float | jax.Array) -> dict:
    """Auxiliary-loss-free balancing: bias_i += gamma * sign(mean load - load_i), per layer (gamma
    may be traced: 0 leaves the biases as they are). `loads` rows follow the order of
    expert_loads: the MoE stack, then the MTP layers."""
    step = gamma * jnp.sign(loads.mean(-1, keepdims=True) - loads)
    out = dict(buffers)
    n = 0
    if "moe" in buffers:
        bias = buffers["moe"]["router_bias"]
        out["moe"] = {**buffers["moe"], "router_bias": bias + step[n : n + bias.shape[0]].astype(bias.dtype)}
        n += bias.shape[0]
    if "mtp" in buffers and "router_bias" in buffers["mtp"].get("layer", {}) and n < loads.shape[0]:
        bias = buffers["mtp"]["layer"]["router_bias"]
        out["mtp"] = {
            **buffers["mtp"],
            "layer": {**buffers["mtp"]["layer"], "router_bias": bias + step[n:].astype(bias.dtype)},
        }
    return out


def flops_per_token(cfg: ModelConfig, seq_len: int, mtp: bool) -> float:
    """Model FLOPs of one training token (forward + backward = 3x forward): 2 per weight of every
    matmul a token goes through (routed experts: the k it uses) plus causal attention scores."""
    h = cfg.hidden_size
    n, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = h * n * (nope + rope) if cfg.q_lora_rank is None else h * cfg.q_lora_rank + cfg.q_lora_rank * n * (nope + rope)
    attn = q + h * (cfg.kv_lora_rank + rope) + cfg.kv_lora_rank * n * (nope + vd) + n * vd * h
    score = n * (nope + rope + vd) * seq_len  # QK^T and PV, halved by the causal mask, x2 flops
    dense_mlp = 3 * h * cfg.intermediate_size
    moe_mlp = (
        3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) + h * cfg.n_routed_experts
    )
    dense = cfg.first_k_dense_replace
    moe = cfg.num_hidden_layers - dense
    weights = dense * (attn + dense_mlp) + moe * (attn + moe_mlp) + h * cfg.vocab_size
    scores = cfg.num_hidden_layers * score
    if mtp and cfg.num_nextn_predict_layers:
        d = cfg.num_nextn_predict_layers
        weights += d * (attn + moe_mlp + 2 * h * h + h * cfg.vocab_size)
        scores += d * score
    return 3.0 * (2.0 * weights + scores)
