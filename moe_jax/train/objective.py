"""The training objective (DeepSeek-V3 paper, sections 2.1.2 and 2.2) and its bookkeeping:
next-token cross-entropy, the MTP loss, the sequence-wise balance loss, expert loads, the
auxiliary-loss-free bias update, and model FLOPs per token for MFU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_jax.config import ModelConfig
from moe_jax.moe import Routing
from moe_jax.sharding import use_layout

# Vocabulary columns of the head per chunk of the training loss (DeepSeek-V3: 8 chunks of 16,160)
VOCAB_CHUNK = 16384


def masked_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over mask of -log p(target); logits [..., V] (float32 softmax)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def head_cross_entropy(
    x: jax.Array, lm_head: jax.Array, targets: jax.Array, weights: jax.Array, mesh=None, chunk: int = VOCAB_CHUNK
) -> jax.Array:
    """Per row of x [D, ..., H] (normalized hidden states in the compute dtype; D: the main head,
    then each MTP depth): sum(weights * -log softmax(x @ lm_head)[targets]) over its positions, [D]
    float32. lm_head [H, V] is the parameter as kept (float32, split over the FSDP axes).

    The head is applied `chunk` vocabulary columns at a time, with a running log-sum-exp (its
    backward recomputes each chunk's logits), so neither the [..., V] float32 logits, their
    softmax and gradient, nor the gathered [H, V] head ever exist whole: each chunk of the head is
    cast to the compute dtype on its shard and gathered (forward, and again in the backward), and
    its gradient, one [H, chunk] matmul over every position, is reduce-scattered in that dtype."""
    return _head_loss(x, lm_head, targets, weights, mesh, chunk)[0]


def _head_chunks(lm_head: jax.Array, chunk: int, mesh):
    """(n, width, column chunk c -> its slice of the head, gathered in the compute dtype)."""
    v = lm_head.shape[1]
    n = -(-v // chunk)
    width = -(-v // n)
    padded = jnp.pad(lm_head, ((0, 0), (0, n * width - v)))
    used = kept = None
    if mesh is not None:
        used, kept = use_layout(mesh, ("params", "lm_head"), (lm_head.shape[0], width))

    def columns(c, dtype):
        w = jax.lax.dynamic_slice_in_dim(padded, c * width, width, axis=1).astype(dtype)
        return w if mesh is None else jax.lax.with_sharding_constraint(jax.lax.optimization_barrier(w), used)

    return n, width, columns, kept


def _chunk_logits(x, w, c, width, v):
    """Float32 logits of column chunk c; -inf past the vocabulary (the padding of the last chunk)."""
    logits = jnp.einsum("...h,hv->...v", x, w, preferred_element_type=jnp.float32)
    return jnp.where(c * width + jnp.arange(width) < v, logits, -jnp.inf)


def _target_in_chunk(targets, c, width):
    local = targets - c * width
    return (local >= 0) & (local < width), jnp.clip(local, 0, width - 1)


def _head_loss(x, lm_head, targets, weights, mesh, chunk):
    n, width, columns, _ = _head_chunks(lm_head, chunk, mesh)
    v = lm_head.shape[1]

    def step(carry, c):
        top, total, picked = carry
        logits = _chunk_logits(x, columns(c, x.dtype), c, width, v)
        new_top = jnp.maximum(top, logits.max(-1))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[..., None]).sum(-1)
        inside, local = _target_in_chunk(targets, c, width)
        picked = picked + jnp.where(inside, jnp.take_along_axis(logits, local[..., None], -1)[..., 0], 0.0)
        return (new_top, total, picked), None

    zeros = jnp.zeros(x.shape[:-1], jnp.float32)
    (top, total, picked), _ = jax.lax.scan(step, (zeros - jnp.inf, zeros, zeros), jnp.arange(n))
    lse = top + jnp.log(total)
    nll = (weights * (lse - picked)).reshape(x.shape[0], -1).sum(-1)
    return nll, (x, lm_head, targets, weights, lse)


def _head_loss_backward(mesh, chunk, saved, g):
    x, lm_head, targets, weights, lse = saved
    n, width, columns, kept = _head_chunks(lm_head, chunk, mesh)
    v = lm_head.shape[1]
    scale = g.reshape((-1,) + (1,) * (weights.ndim - 1)) * weights  # d loss / d nll at each position

    def step(dx, c):
        w = columns(c, x.dtype)
        p = jnp.exp(_chunk_logits(x, w, c, width, v) - lse[..., None])  # softmax over the whole vocabulary
        inside, local = _target_in_chunk(targets, c, width)
        p = p - jax.nn.one_hot(jnp.where(inside, local, -1), width, dtype=p.dtype)
        dlogits = (scale[..., None] * p).astype(x.dtype)
        dx = dx + jnp.einsum("...v,hv->...h", dlogits, w, preferred_element_type=jnp.float32)
        dw = jnp.einsum("...h,...v->hv", x, dlogits)  # every position's share, in the compute dtype
        if kept is not None:
            dw = jax.lax.with_sharding_constraint(dw, kept)
        return dx, dw.astype(lm_head.dtype)

    dx, dw = jax.lax.scan(step, jnp.zeros(x.shape, jnp.float32), jnp.arange(n))  # dw [n, H, width]
    dw = jnp.moveaxis(dw, 0, 1).reshape(lm_head.shape[0], n * width)[:, :v]
    return dx.astype(x.dtype), dw, None, None


head_cross_entropy.defvjp(_head_loss, _head_loss_backward)


def targets_at(tokens: jax.Array, segment_ids: jax.Array, offset: int) -> tuple[jax.Array, jax.Array]:
    """For rows tokens [B, S+1]: the token `offset` places ahead of each input position (inputs are
    tokens[:, :S]), and whether it exists in the same document."""
    s = tokens.shape[1] - 1
    pad = offset - 1  # positions whose target lies past the row
    tgt = jnp.pad(tokens[:, offset:], ((0, 0), (0, pad)))[:, :s]
    seg_t = jnp.pad(segment_ids[:, offset:], ((0, 0), (0, pad)), constant_values=-1)[:, :s]
    return tgt, (seg_t == segment_ids[:, :s]) & (segment_ids[:, :s] > 0)


def loss_denominators(batch: dict, depths: int) -> dict:
    """What a batch's loss terms divide by: the targets of the main head and of each of `depths` MTP
    depths ("targets" [1 + depths]), the rows ("rows"; the balance loss is a mean over sequences)
    and the input positions ("positions")."""
    tokens, seg = batch["tokens"], batch["segment_ids"]
    counts = [targets_at(tokens, seg, 1 + j)[1].sum() for j in range(1 + depths)]
    rows, positions = tokens.shape[0], tokens.shape[1] - 1
    return {
        "targets": jnp.stack(counts).astype(jnp.float32),
        "rows": jnp.float32(rows),
        "positions": jnp.float32(rows * positions),  # the indexers' loss: a mean over positions
    }


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


def attended_keys(cfg: ModelConfig, seq_len: int, dsa_stage: str = "sparse") -> float:
    """Keys a query attends to, averaged over a sequence's positions, counted as the causal
    half: seq_len / 2; DeepSeek-V3.2's sparse stage caps each query at `index_topk`:
    k - k^2 / (2 seq_len) past k (the mean of min(t, k) over t in [0, seq_len])."""
    k = cfg.index_topk
    if not cfg.dsa or dsa_stage == "warmup" or seq_len <= k:
        return seq_len / 2
    return k - k * k / (2 * seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int, mtp: bool, dsa_stage: str = "sparse") -> float:
    """Model FLOPs of one training token (forward + backward = 3x forward): 2 per weight of every
    matmul a token goes through (routed experts: the k it uses) plus the attention scores of the
    keys it attends to (`attended_keys`). DeepSeek-V3.2 adds its indexers: their weights and their
    scores against every earlier key, trained (3x) in both stages; in the warm-up stage the rest of
    the model runs forward only (1x: no gradient reaches it)."""
    h = cfg.hidden_size
    n, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q = h * n * (nope + rope) if cfg.q_lora_rank is None else h * cfg.q_lora_rank + cfg.q_lora_rank * n * (nope + rope)
    attn = q + h * (cfg.kv_lora_rank + rope) + cfg.kv_lora_rank * n * (nope + vd) + n * vd * h
    score = 2 * n * (nope + rope + vd) * attended_keys(cfg, seq_len, dsa_stage)  # QK^T and PV, 2 flops a term
    dense_mlp = 3 * h * cfg.intermediate_size
    moe_mlp = (
        3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) + h * cfg.n_routed_experts
    )
    dense = cfg.first_k_dense_replace
    moe = cfg.num_hidden_layers - dense
    weights = dense * (attn + dense_mlp) + moe * (attn + moe_mlp) + h * cfg.vocab_size
    layers = cfg.num_hidden_layers
    if mtp and cfg.num_nextn_predict_layers:
        d = cfg.num_nextn_predict_layers
        weights += d * (attn + moe_mlp + 2 * h * h + h * cfg.vocab_size)
        layers += d
    model = 2.0 * weights + layers * score
    indexers = 0.0
    if cfg.dsa:
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        index_weights = (cfg.q_lora_rank or h) * heads * dim + h * dim + h * heads
        indexers = layers * (2.0 * index_weights + 2 * heads * dim * seq_len / 2)
    return (1.0 if cfg.dsa and dsa_stage == "warmup" else 3.0) * model + 3.0 * indexers
