"""Causal attention within packed documents, for MLA: the S x S reference, a memory-linear
blockwise (FlashAttention-2) form, and cuDNN's fused attention on NVIDIA GPUs.

q, k [B, S, N, Dqk]; v [B, S, N, Dv] (Dqk != Dv in MLA); segment_ids [B, S]. A query attends to
the keys at or before its position in its document: its run of equal segment ids (packed
documents never see each other). Returns [B, S, N, Dv] in the input dtype.

Implementations (`IMPLEMENTATIONS`; `attention(..., impl=None)` takes `default_impl`: cuDNN on
Hopper and later GPUs for 16-bit inputs, blockwise elsewhere):
- `naive`: [B, N, S, S] float32 logits and a boolean mask; the reference.
- `blockwise`: an online softmax over key blocks with float32 running max, sum and output; a
  custom VJP whose residuals are q, k, v, segment_ids, the output and each row's logsumexp, and
  whose backward recomputes each block's probabilities. Nothing of size S x S exists, forward or
  backward; block pairs whose keys all lie in the queries' causal future are skipped, forward
  and backward. S need not be a multiple of the blocks: the inputs are padded at the end, where
  causality hides the padding from every real query.
- `cudnn`: cuDNN's fused flash attention, forward and backward, through jax's cuDNN binding (the
  public `jax.nn.dot_product_attention` refuses MLA's 192/128 head dims; the binding accepts them
  with cuDNN >= 9.10 on Hopper or later), documents in cuDNN's packed layout (see `cudnn_attention`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dot_product_attention

from moe_jax import gpu

IMPLEMENTATIONS = ("naive", "blockwise", "cudnn")
# Forward+backward on CPU (scripts/bench_attention.py, 4 heads) at S=4096 / 8192, by block size:
# 128: 0.45 / 2.08 s, 256: 0.40 / 1.33 s, 512: 0.33 / 1.16 s, 1024: 0.46 / 1.74 s.
BLOCK_Q = 512
BLOCK_K = 512


def attention(q, k, v, segment_ids, scale: float, impl: str | None = None) -> jax.Array:
    """Causal attention within documents by `impl` (one of IMPLEMENTATIONS; None: `default_impl`)."""
    impl = default_impl(q, v) if impl is None else impl
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {impl!r} (have: {', '.join(IMPLEMENTATIONS)})")
    documents = document_ids(segment_ids)
    if impl == "naive":
        return naive_attention(q, k, v, documents, scale)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, documents, scale)
    return cudnn_attention(q, k, v, documents, scale)


def default_impl(q, v) -> str:
    """cudnn on NVIDIA GPUs of compute capability 9.0 or later (a real one, or the deviceless
    target being compiled for) for bf16/fp16 inputs whose head dims cuDNN takes (multiples of 8,
    at most 256); blockwise otherwise."""
    cc = gpu.capability()
    dims = (q.shape[-1], v.shape[-1])
    if cc and cc >= (9, 0) and q.dtype in (jnp.bfloat16, jnp.float16) and all(d % 8 == 0 and d <= 256 for d in dims):
        return "cudnn"
    return "blockwise"


def document_ids(segment_ids) -> jax.Array:
    """[B, S] segment ids -> the index of each token's run of equal ids in its row: a document
    is a run, so an id that comes back later in a row starts another document."""
    changes = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), jnp.cumsum(changes, axis=1, dtype=jnp.int32)], axis=1)


def naive_attention(q, k, v, segment_ids, scale: float) -> jax.Array:
    """Logits in the input dtype times `scale`, a float32 masked softmax, probabilities cast back
    to the input dtype, times v."""
    dt = q.dtype
    positions = jnp.arange(q.shape[1])
    mask = allowed(positions, positions, segment_ids, segment_ids)[:, None]  # [B, 1, S, S]
    logits = jnp.einsum("bqnd,bknd->bnqk", q, k) * jnp.asarray(scale, dt)  # [B, N, S, S]
    logits = jnp.where(mask, logits.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    return jnp.einsum("bnqk,bknd->bqnd", probs, v)


def allowed(q_pos, k_pos, q_segments, k_segments) -> jax.Array:
    """[B, Q, K] bool: key at or before the query, in the query's segment."""
    causal = q_pos[:, None] >= k_pos[None, :]
    return causal[None] & (q_segments[:, :, None] == k_segments[:, None, :])


# ---- blockwise ---------------------------------------------------------------------------------
def blockwise_attention(
    q, k, v, segment_ids, scale: float, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
) -> jax.Array:
    """FlashAttention-2 over [block_q] query rows x [block_k] key columns at a time (each capped
    at S, so short sequences run as one block)."""
    return _blockwise(q, k, v, segment_ids, float(scale), block_q, block_k)


def _geometry(s: int, block_q: int, block_k: int) -> tuple[int, int, int]:
    """(query block, key block, padded length: a multiple of both)."""
    bq, bk = min(block_q, s), min(block_k, s)
    step = math.lcm(bq, bk)
    return bq, bk, -(-s // step) * step


def _blocked(x: jax.Array, padded: int) -> jax.Array:
    """[B, S, N, D] -> [B, N, padded, D] (zeros after S)."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, padded - x.shape[2]), (0, 0)))


def _unblocked(x: jax.Array, s: int) -> jax.Array:
    """[B, N, padded, D] -> [B, S, N, D]."""
    return jnp.swapaxes(x[:, :, :s], 1, 2)


def _rows(x: jax.Array, start, size: int, axis: int = 2) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _block_logits(q_blk, k_blk, q_seg, k_seg, q_start, k_start, scale: float) -> jax.Array:
    """[B, N, bq, bk] float32 scaled logits of one block pair, -inf where the mask forbids."""
    logits = jnp.einsum("bnqd,bnkd->bnqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    q_pos = q_start + jnp.arange(q_blk.shape[2])
    k_pos = k_start + jnp.arange(k_blk.shape[2])
    return jnp.where(allowed(q_pos, k_pos, q_seg, k_seg)[:, None], logits, -jnp.inf)


def _forward(q, k, v, segment_ids, scale: float, block_q: int, block_k: int):
    """(out [B, S, N, Dv] in v's dtype, logsumexp [B, N, S] float32)."""
    b, s, n, dv = v.shape
    bq, bk, padded = _geometry(s, block_q, block_k)
    qp, kp, vp = (_blocked(x, padded) for x in (q, k, v))
    seg = jnp.pad(segment_ids, ((0, 0), (0, padded - s)))

    def query_block(_, i):
        q_start = i * bq
        q_blk, q_seg = _rows(qp, q_start, bq), _rows(seg, q_start, bq, axis=1)

        def key_block(j, carry):
            row_max, row_sum, acc = carry
            k_start = j * bk
            logits = _block_logits(
                q_blk, _rows(kp, k_start, bk), q_seg, _rows(seg, k_start, bk, axis=1), q_start, k_start, scale
            )
            new_max = jnp.maximum(row_max, logits.max(axis=-1))
            probs = jnp.exp(logits - new_max[..., None])
            rescale = jnp.exp(row_max - new_max)
            pv = jnp.einsum(
                "bnqk,bnkd->bnqd", probs.astype(v.dtype), _rows(vp, k_start, bk), preferred_element_type=jnp.float32
            )
            return new_max, rescale * row_sum + probs.sum(axis=-1), rescale[..., None] * acc + pv

        # a finite start: a row with no allowed key yet gets probabilities exp(-inf) = 0, not NaN
        init = (
            jnp.full((b, n, bq), jnp.finfo(jnp.float32).min),
            jnp.zeros((b, n, bq), jnp.float32),
            jnp.zeros((b, n, bq, dv), jnp.float32),
        )
        last_key_block = (q_start + bq - 1) // bk  # later key blocks are all in the causal future
        row_max, row_sum, acc = jax.lax.fori_loop(0, last_key_block + 1, key_block, init)
        return None, ((acc / row_sum[..., None]).astype(v.dtype), row_max + jnp.log(row_sum))

    _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(padded // bq))  # [nq, B, N, bq, ...]
    out = jnp.moveaxis(out, 0, 2).reshape(b, n, padded, dv)
    lse = jnp.moveaxis(lse, 0, 2).reshape(b, n, padded)
    return _unblocked(out, s), lse[:, :, :s]


def _backward(q, k, v, segment_ids, out, lse, d_out, scale: float, block_q: int, block_k: int):
    """(dq, dk, dv): for each key block, a loop over the query blocks that can see it; dk and dv
    accumulate in the loop, dq in one [B, N, S, Dqk] float32 array across loops."""
    b, s, n, dqk = q.shape
    bq, bk, padded = _geometry(s, block_q, block_k)
    qp, kp, vp, dop = (_blocked(x, padded) for x in (q, k, v, d_out))
    seg = jnp.pad(segment_ids, ((0, 0), (0, padded - s)))
    # padded rows: logsumexp +inf makes their probabilities 0 (their output cotangent is 0 too)
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, padded - s)), constant_values=jnp.inf)
    # rowsum(dO * O): the softmax backward's correction term per query row
    delta = jnp.einsum("bsnd,bsnd->bns", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, padded - s)))

    def key_block(dq, j):
        k_start = j * bk
        k_blk, v_blk, k_seg = _rows(kp, k_start, bk), _rows(vp, k_start, bk), _rows(seg, k_start, bk, axis=1)

        def query_block(i, carry):
            dq, dk, dv = carry
            q_start = i * bq
            q_blk, do_blk = _rows(qp, q_start, bq), _rows(dop, q_start, bq)
            logits = _block_logits(q_blk, k_blk, _rows(seg, q_start, bq, axis=1), k_seg, q_start, k_start, scale)
            probs = jnp.exp(logits - _rows(lse, q_start, bq)[..., None])
            dv = dv + jnp.einsum("bnqk,bnqd->bnkd", probs.astype(v.dtype), do_blk, preferred_element_type=jnp.float32)
            d_probs = jnp.einsum("bnqd,bnkd->bnqk", do_blk, v_blk, preferred_element_type=jnp.float32)
            d_logits = (probs * (d_probs - _rows(delta, q_start, bq)[..., None])).astype(q.dtype)
            dq_blk = jnp.einsum("bnqk,bnkd->bnqd", d_logits, k_blk, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _rows(dq, q_start, bq) + dq_blk, q_start, axis=2)
            dk = dk + jnp.einsum("bnqk,bnqd->bnkd", d_logits, q_blk, preferred_element_type=jnp.float32)
            return dq, dk, dv

        init = (dq, jnp.zeros((b, n, bk, dqk), jnp.float32), jnp.zeros((b, n, bk, v.shape[-1]), jnp.float32))
        first_query_block = k_start // bq  # earlier query blocks see none of these keys (their future)
        dq, dk, dv = jax.lax.fori_loop(first_query_block, padded // bq, query_block, init)
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros((b, n, padded, dqk), jnp.float32), jnp.arange(padded // bk))
    dk = jnp.moveaxis(dk, 0, 2).reshape(b, n, padded, dqk)
    dv = jnp.moveaxis(dv, 0, 2).reshape(b, n, padded, v.shape[-1])
    return tuple(_unblocked(g * c, s).astype(x.dtype) for g, c, x in ((dq, scale, q), (dk, scale, k), (dv, 1.0, v)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _blockwise(q, k, v, segment_ids, scale, block_q, block_k):
    return _forward(q, k, v, segment_ids, scale, block_q, block_k)[0]


def _blockwise_fwd(q, k, v, segment_ids, scale, block_q, block_k):
    out, lse = _forward(q, k, v, segment_ids, scale, block_q, block_k)
    return out, (q, k, v, segment_ids, out, lse)


def _blockwise_bwd(scale, block_q, block_k, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    return (*_backward(q, k, v, segment_ids, out, lse, d_out, scale, block_q, block_k), None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# ---- cuDNN (NVIDIA GPUs) -----------------------------------------------------------------------
# cuDNN's fused attention (FlashAttention in cuDNN), through jax's own cuDNN binding: the public
# jax.nn.dot_product_attention refuses MLA's q/k and v head dims (192 and 128); the binding
# underneath accepts them (cuDNN >= 9.10, Hopper or later). Packed documents go in cuDNN's
# packed layout: per row, the offsets and lengths of its documents, for a fixed number of them
# (MAX_SEGMENTS); its softmax statistics take [MAX_SEGMENTS, N, S] floats. A batch with a row of
# more documents takes the blockwise path (both are compiled; the choice is made on the device).
MAX_SEGMENTS = 64


def packed_segments(segment_ids, max_segments: int = MAX_SEGMENTS):
    """[B, S] segment ids -> (lengths [B, M], offsets [B, M + 1], fits): the lengths and first
    positions of each row's runs of equal ids in cuDNN's packed layout (-1 past the last), and
    whether every row has at most M runs."""
    b, s = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    index = jnp.cumsum(starts, axis=1) - 1  # [B, S]: the run each token is in
    count = index[:, -1] + 1
    rows = jnp.arange(b)[:, None]
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    offsets = jnp.full((b, max_segments + 1), -1, jnp.int32)
    offsets = offsets.at[rows, jnp.where(starts, index, max_segments + 1)].set(positions, mode="drop")
    lengths = jnp.zeros((b, max_segments), jnp.int32).at[rows, index].add(1, mode="drop")
    lengths = jnp.where(jnp.arange(max_segments)[None] < count[:, None], lengths, -1)
    return lengths, offsets, jnp.all(count <= max_segments)


def cudnn_attention(q, k, v, segment_ids, scale: float) -> jax.Array:
    """cuDNN's fused causal attention within packed documents (bf16 or fp16 inputs)."""
    lengths, offsets, fits = packed_segments(segment_ids)

    def fused(q, k, v, segment_ids):
        return cudnn_dot_product_attention(
            q,
            k,
            v,
            q_seqlen=lengths,
            kv_seqlen=lengths,
            q_offsets=offsets,
            kv_offsets=offsets,
            scale=float(scale),
            mask_type=MaskType.CAUSAL,
        )

    def blockwise(q, k, v, segment_ids):
        return blockwise_attention(q, k, v, segment_ids, scale)

    return jax.lax.cond(fits, fused, blockwise, q, k, v, segment_ids)
