"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer, each query's top-k keys, MLA
over those keys only, and the indexer's training loss.

The indexer (transformers' `DeepseekV32Indexer`): queries q [B, S, H, D] from MLA's q latent
(`wq_b`), one key k [B, S, D] a token from the attention input (`wk`, then a LayerNorm with a
bias), both turned by RoPE on their first `qk_rope_head_dim` dims in halves (not interleaved, as
MLA's are), and a weight a head w [B, S, H] (`weights_proj`, times H^-1/2). The score of key t for
query s is sum_h w[s, h] relu(q[s, h] . k[t] D^-1/2), in float32; each query keeps the
`index_topk` keys of highest score among those it may see (causal, its own document), and MLA
attends to those alone. A sequence of at most `index_topk` tokens keeps every key: dense causal
attention. DeepSeek's kernels score in FP8 after a Hadamard rotation (which leaves dot products
as they are); like transformers, we score in float, so the keys chosen differ from theirs only
where two scores are within FP8's rounding of each other.

Memory is linear in the sequence: queries go by blocks of `block` (the scores of a block,
[B, block, S], are the largest array), and a block's attention gathers its queries' chosen
latents ([B, block, k, kv_lora_rank + qk_rope_head_dim]) and runs MLA in its absorbed form (the
query's no-RoPE part taken into the latent space through kv_b's key half, the output back through
its value half), so no key or value is ever expanded per head. Each block is recomputed in the
backward pass (`jax.checkpoint`).

Training (DeepSeek-V3.2's report, section 2.1): the indexer learns to match the main attention.
The target of query s is MLA's attention probabilities summed over heads and normalized over
its keys; the loss is KL(target || softmax(indexer scores)), summed over queries: over every key
the query may see in the dense warm-up stage, over its chosen keys in the sparse stage. The
indexer's inputs are detached from the model and the target from both, so the indexer learns
from this loss alone and the model from the language-model loss alone.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.config import ModelConfig
from moe_jax.kernels.attention import allowed

BLOCK = 64  # queries a block: a block's chosen latents are [B, 64, index_topk, 576] (151 MB at 2,048 in bf16)
STRIPES = 4  # runs of query blocks in `select`, each scoring only the keys before its last query
INDEX_NORM_EPS = 1e-6  # the key's LayerNorm (transformers' and DeepSeek's)


class Index(NamedTuple):
    """The indexer's projections of a sequence."""

    q: jax.Array  # [B, S, H, D]
    k: jax.Array  # [B, S, D]
    w: jax.Array  # [B, S, H] float32, times H^-1/2


class Latents(NamedTuple):
    """MLA's side of the attention, in the latent (absorbed) form."""

    q_nope: jax.Array  # [B, S, N, dn]
    q_rope: jax.Array  # [B, S, N, R] (turned)
    c_kv: jax.Array  # [B, S, C] (normed)
    k_rope: jax.Array  # [B, S, R] (turned), shared by the heads
    w_k: jax.Array  # [C, N, dn]: kv_b's key half
    w_v: jax.Array  # [C, N, dv]: kv_b's value half


def layer_norm(x, w, b, eps: float) -> jax.Array:
    """LayerNorm over the last dim, in float32, back in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def indexer(p: dict, x: jax.Array, q_latent: jax.Array, cos, sin, cfg: ModelConfig, rope) -> Index:
    """The indexer's queries, keys and head weights for attention input x [B, S, H] and MLA's q
    latent [B, S, q_lora_rank]; `rope(x, cos, sin, interleave)` turns the last dim of x."""
    dt = x.dtype
    b, s, _ = x.shape
    h, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = (q_latent @ p["wq_b"].astype(dt)).reshape(b, s, h, d)  # [B, S, H, D]
    k = layer_norm(x @ p["wk"].astype(dt), p["k_norm"], p["k_bias"], INDEX_NORM_EPS)[:, :, None]  # [B, S, 1, D]
    q = jnp.concatenate([rope(q[..., :r], cos, sin, False), q[..., r:]], axis=-1)
    k = jnp.concatenate([rope(k[..., :r], cos, sin, False), k[..., r:]], axis=-1)[:, :, 0]
    w = (x @ p["weights_proj"].astype(dt)).astype(jnp.float32) * h**-0.5  # [B, S, H], as transformers rounds it
    return Index(q, k, w)


def scores(q, w, k) -> jax.Array:
    """Index scores [B, Q, T] float32 of queries q [B, Q, H, D] (weights w [B, Q, H]) for keys
    k [B, T, D] (or each query's own keys [B, Q, T, D])."""
    dots = (
        jnp.einsum("bqhd,btd->bqht", q.astype(jnp.float32), k.astype(jnp.float32))
        if k.ndim == 3
        else jnp.einsum("bqhd,bqtd->bqht", q.astype(jnp.float32), k.astype(jnp.float32))
    )
    return jnp.einsum("bqh,bqht->bqt", w, jax.nn.relu(dots * q.shape[-1] ** -0.5))


def _blocks(s: int, block: int) -> tuple[int, int]:
    """(block size, number of blocks) for S queries."""
    size = min(block, s)
    return size, -(-s // size)


def _padded(x: jax.Array, rows: int) -> jax.Array:
    """x [B, S, ...] with zero rows after S up to `rows`."""
    return jnp.pad(x, [(0, 0), (0, rows - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _query_blocks(fn, s: int, block: int, *per_query):
    """fn(positions [block], *blocks of the per-query arrays [B, block, ...]) over the blocks of
    queries (the last one padded past S: positions >= S), in a loop whose body is recomputed in
    the backward pass. The blocks are the loop's inputs, not slices of arrays it closes over, so
    the backward pass gives each block's gradient as an output of its own rather than adding it
    into a whole [B, S, ...] array at every block. Returns fn's outputs stacked over the blocks."""
    size, n = _blocks(s, block)
    blocked = [jnp.moveaxis(_padded(a, size * n).reshape(a.shape[0], n, size, *a.shape[2:]), 1, 0) for a in per_query]

    @jax.checkpoint
    def body(_, xs):
        i, *blocks = xs
        return None, fn(i * size + jnp.arange(size), *blocks)

    return jax.lax.scan(body, None, (jnp.arange(n), *blocked))[1]


def _joined(stacked: jax.Array, s: int) -> jax.Array:
    """[blocks, B, block, ...] -> [B, S, ...]."""
    n, b, size = stacked.shape[:3]
    return jnp.moveaxis(stacked, 0, 1).reshape(b, n * size, *stacked.shape[3:])[:, :s]


def select(
    index: Index, documents: jax.Array, topk: int, block: int = BLOCK, stripes: int = STRIPES
) -> tuple[jax.Array, jax.Array]:
    """Each query's chosen keys: (positions [B, S, k] int32, valid [B, S, k] bool), k =
    min(topk, S): the keys of highest index score among those the query may see (at or before
    it, in its document). A query that may see fewer than k keys fills the rest with keys it may
    not see, marked not valid.

    The blocks of queries run in `stripes` runs of consecutive blocks, each scoring only the keys
    before its last query (a static length per run): (stripes + 1) / (2 stripes) of the scores
    of scoring every key (5/8 with 4), where causality wastes half."""
    index = jax.tree.map(jax.lax.stop_gradient, index)
    s = index.q.shape[1]
    size, n = _blocks(s, block)
    runs = [(int(r[0]) * size, min(int(r[-1] + 1) * size, s)) for r in np.array_split(np.arange(n), min(stripes, n))]
    chosen, valid = zip(*(_select_run(index, documents, first, end, min(topk, s), block) for first, end in runs))
    return jnp.concatenate(chosen, axis=1), jnp.concatenate(valid, axis=1)


def _select_run(index: Index, documents, first: int, end: int, keep: int, block: int):
    """`select` for the queries [first, end), which see no key at or after `end`: only those
    before are scored, and the keys past them fill what a query cannot choose."""
    k, key_docs, key_pos, got = index.k[:, :end], documents[:, :end], jnp.arange(end), min(keep, end)

    def block_fn(q_pos, q_blk, w_blk, docs_blk):
        ok = allowed(q_pos + first, key_pos, docs_blk, key_docs)  # [B, Q, end]
        top = jax.lax.top_k(jnp.where(ok, scores(q_blk, w_blk, k), -jnp.inf), got)[1]  # [B, Q, got]
        fill = jnp.broadcast_to(end + jnp.arange(keep - got), (*top.shape[:2], keep - got))  # none seen
        keys = jnp.concatenate([top, fill], -1).astype(jnp.int32)
        return keys, jnp.concatenate([jnp.take_along_axis(ok, top, axis=-1), jnp.zeros(fill.shape, bool)], -1)

    rows = slice(first, end)
    keys, valid = _query_blocks(block_fn, end - first, block, index.q[:, rows], index.w[:, rows], documents[:, rows])
    return _joined(keys, end - first), _joined(valid, end - first)


def _gather(x: jax.Array, keys: jax.Array) -> jax.Array:
    """x [B, S, ...] at each query's keys [B, Q, k] -> [B, Q, k, ...]."""
    b = jnp.arange(x.shape[0])[:, None, None]
    return x[b, keys]


MASKED = -1e30  # a masked logit: finite, so that a row with nothing valid (padding) stays finite


def _kl(target: jax.Array, logits: jax.Array, valid: jax.Array) -> jax.Array:
    """sum over queries of KL(target || softmax(logits)) over the valid keys ([B, Q, K] each)."""
    log_q = jax.nn.log_softmax(jnp.where(valid, logits, MASKED), axis=-1)
    terms = jnp.where(valid & (target > 0), target * (jnp.log(jnp.where(target > 0, target, 1.0)) - log_q), 0.0)
    return terms.sum()


def _target(probs: jax.Array) -> jax.Array:
    """The indexer's target from attention probabilities [B, Q, N, K]: summed over heads,
    normalized over the keys, detached."""
    total = jax.lax.stop_gradient(probs).sum(2)
    return total / jnp.maximum(total.sum(-1, keepdims=True), 1e-30)


def sparse_attention(
    lat: Latents, keys, valid, scale: float, index: Index | None = None, block: int = BLOCK
) -> tuple[jax.Array, jax.Array]:
    """MLA over each query's chosen keys: (out [B, S, N, dv] in the latents' dtype, the indexer's
    loss: the sum over queries of KL(attention over the chosen keys summed over heads || softmax
    of the index scores of those keys), 0 without `index`)."""
    s = lat.q_nope.shape[1]
    dt = lat.q_nope.dtype

    def block_fn(q_pos, q_nope, q_rope, keys_blk, valid_blk, *index_blk):
        valid_blk = valid_blk & (q_pos < s)[None, :, None]  # the last block's padding: nothing
        c_kv, k_rope = _gather(lat.c_kv, keys_blk), _gather(lat.k_rope, keys_blk)  # [B, Q, k, C], [B, Q, k, R]
        q_lat = jnp.einsum("bqnd,cnd->bqnc", q_nope, lat.w_k.astype(dt))  # [B, Q, N, C]
        logits = jnp.einsum("bqnc,bqkc->bqnk", q_lat, c_kv, preferred_element_type=jnp.float32)
        logits += jnp.einsum("bqnr,bqkr->bqnk", q_rope, k_rope, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(jnp.where(valid_blk[:, :, None], logits * scale, MASKED), axis=-1)  # [B, Q, N, k]
        out_lat = jnp.einsum("bqnk,bqkc->bqnc", probs.astype(dt), c_kv)
        out = jnp.einsum("bqnc,cnv->bqnv", out_lat, lat.w_v.astype(dt))
        loss = jnp.zeros((), jnp.float32)
        if index_blk:
            iq, iw = index_blk
            student = scores(iq, iw, _gather(index.k, keys_blk))  # [B, Q, k]
            loss = _kl(_target(probs), student, valid_blk)
        return out, loss

    extra = (index.q, index.w) if index is not None else ()
    out, losses = _query_blocks(block_fn, s, block, lat.q_nope, lat.q_rope, keys, valid, *extra)
    return _joined(out, s), losses.sum()


def dense_index_loss(lat: Latents, index: Index, documents, scale: float, block: int = BLOCK) -> jax.Array:
    """The warm-up stage's loss: the sum over queries of KL(MLA's attention over every key the
    query may see, summed over heads || softmax of the index scores of those keys), the attention
    recomputed by blocks of queries (its probabilities [B, block, N, S] at a time)."""
    s = lat.q_nope.shape[1]
    dt = lat.q_nope.dtype
    key_pos = jnp.arange(s)

    def block_fn(q_pos, q_nope, q_rope, docs_blk, iq, iw):
        ok = allowed(q_pos, key_pos, docs_blk, documents) & (q_pos < s)[None, :, None]  # [B, Q, S]
        q_lat = jnp.einsum("bqnd,cnd->bqnc", q_nope, lat.w_k.astype(dt))
        logits = jnp.einsum("bqnc,btc->bqnt", q_lat, lat.c_kv, preferred_element_type=jnp.float32)
        logits += jnp.einsum("bqnr,btr->bqnt", q_rope, lat.k_rope, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(jnp.where(ok[:, :, None], logits * scale, MASKED), axis=-1)
        return _kl(_target(probs), scores(iq, iw, index.k), ok)

    lat = jax.tree.map(jax.lax.stop_gradient, lat)
    return _query_blocks(block_fn, s, block, lat.q_nope, lat.q_rope, documents, index.q, index.w).sum()
