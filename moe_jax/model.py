"""DeepSeek-V3 in JAX: MLA attention, dense and MoE layers, MTP, as pure functions of a
parameter tree (layout in `moe_jax.params`).

Why functions over a pytree rather than Flax NNX modules: the tree *is* the checkpoint layout
(one mapping table reads and writes it), decoder layers are stacked arrays that `lax.scan`
walks directly, and sharding rules, Orbax and optax act on the same tree without split/merge.

Shapes: B batch, S sequence, T = B*S tokens, H hidden, N heads, D head dims, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from moe_jax import dsa
from moe_jax.config import ModelConfig, yarn_mscale
from moe_jax.kernels.attention import attention, document_ids
from moe_jax.moe import Routing, moe_layer
from moe_jax.parallel.ep import DISPATCHED, ExpertParallel, ep_moe, expert_axes
from moe_jax.params import logical_axes
from moe_jax.sharding import axes_of, batch_sharding, constrain_batch, gathered_for_use, place, shard_tree, spec_for


class Output(NamedTuple):
    logits: jax.Array  # [B, S, V] float32
    hidden_states: jax.Array | None  # [L+1, B, S, H]: embeddings, then each layer's output
    mtp_logits: jax.Array | None  # [n_mtp, B, S, V]; depth j at position i predicts token i+2+j
    routing: list[Routing] | None  # per MoE stack (main, then MTP): stacked over its layers
    mtp_hidden_states: jax.Array | None = None  # [n_mtp, B, S, H]: each MTP depth's output (before its head norm)
    index_loss: jax.Array | None = (
        None  # DeepSeek-V3.2 with Sparse.loss: the indexers' KL, summed over layers and queries
    )


@dataclasses.dataclass(frozen=True)
class Sparse:
    """How a DeepSeek-V3.2 model (DeepSeek Sparse Attention, `moe_jax.dsa`) attends, and whether
    it computes its indexers' training loss."""

    dense: bool = False  # the warm-up stage: dense attention whatever the length (else each query's top-k keys)
    loss: bool = False  # also the indexers' KL loss (Output.index_loss)


# ---- building blocks -------------------------------------------------------------------------
def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * y.astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [R/2] float32, cos/sin scale), as transformers' default and yarn rope."""
    r, dim = cfg.rope, cfg.qk_rope_head_dim
    pos_freqs = np.float32(r.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if r.rope_type == "default":
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (np.float32(r.factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * np.log(r.original_max_position_embeddings / (rotations * 2 * np.pi))) / (2 * np.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (1 - ramp).astype(np.float32)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    if r.attention_factor is not None:
        attention_factor = float(r.attention_factor)
    elif r.mscale and r.mscale_all_dim:
        attention_factor = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(r.factor)
    return inv_freq.astype(np.float32), attention_factor


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    inv_freq, scale = rope_frequencies(cfg)
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, S, R/2]
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """x: [B, S, N, R]. Interleaved pairs (x0, x1), (x2, x3)... as DeepSeek; the output keeps
    transformers' layout [rotated evens, rotated odds] (q and k alike, so q.k is unchanged)."""
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# The latent norms inside MLA (q_a_layernorm, kv_a_layernorm) use RMSNorm's default eps, not
# config.rms_norm_eps, in both DeepSeek's inference code and transformers.
LATENT_NORM_EPS = 1e-6


def sharded_attention(q, k, v, segment_ids, scale: float, mesh=None) -> jax.Array:
    """`attention` of each device's own rows (and, over a `tensor` axis, heads), in shard_map:
    XLA's partitioner cannot split a kernel such as cuDNN's, and would gather the whole batch's
    q, k and v onto every device to run it."""
    if mesh is None:
        return attention(q, k, v, segment_ids, scale)
    rows = batch_sharding(mesh, q.shape).spec[0]
    tensor = mesh.shape.get("tensor", 1)
    spec = PartitionSpec(rows, None, "tensor" if tensor > 1 and q.shape[2] % tensor == 0 else None, None)
    fn = jax.shard_map(
        lambda q, k, v, seg: attention(q, k, v, seg, scale),
        mesh=mesh,
        in_specs=(spec, spec, spec, PartitionSpec(rows, None)),
        out_specs=spec,
        check_vma=False,
    )
    return fn(q, k, v, segment_ids)


def mla_attention(
    p: dict, x: jax.Array, cos, sin, segment_ids, cfg: ModelConfig, mesh=None, sparse: Sparse = Sparse()
) -> tuple[jax.Array, jax.Array]:
    """Causal within packed documents (`segment_ids` [B, S]), by `moe_jax.kernels.attention`; for
    DeepSeek-V3.2, each query over the keys its indexer chooses (`moe_jax.dsa`). Returns (the
    attention's output [B, S, H], the indexers' loss: 0 unless `sparse.loss`)."""
    dt, eps = x.dtype, LATENT_NORM_EPS
    b, s, _ = x.shape
    n, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = x @ p["q_proj"].astype(dt)
    else:
        q_latent = rms_norm(x @ p["q_a_proj"].astype(dt), p["q_norm"], eps)  # [B, S, q_lora_rank]
        q = q_latent @ p["q_b_proj"].astype(dt)
    q = checkpoint_name(q.reshape(b, s, n, nope + rope), "query_proj")  # [B, S, N, Dqk]
    q_nope, q_rot = q[..., :nope], q[..., nope:]

    kv_a = x @ p["kv_a_proj"].astype(dt)  # [B, S, C + R]
    c_kv = rms_norm(kv_a[..., : cfg.kv_lora_rank], p["kv_norm"], eps)  # [B, S, C]
    k_rot = kv_a[..., None, cfg.kv_lora_rank :]  # [B, S, 1, R], shared by all heads
    q_rot = apply_rope(q_rot, cos, sin, cfg.rope_interleave)
    k_rot = apply_rope(k_rot, cos, sin, cfg.rope_interleave)
    index_loss = jnp.zeros((), jnp.float32)

    if cfg.dsa and (sparse.loss or (s > cfg.index_topk and not sparse.dense)):
        index = attention_index(p, x, cos, sin, cfg, q_latent)
        w_kv = p["kv_b_proj"].astype(dt).reshape(cfg.kv_lora_rank, n, nope + vd)
        lat = dsa.Latents(q_nope, q_rot, c_kv, k_rot[:, :, 0], w_kv[..., :nope], w_kv[..., nope:])
        out, index_loss = sharded_sparse_attention(lat, index, segment_ids, cfg, sparse, mesh)
        if out is not None:
            return out.reshape(b, s, n * vd) @ p["o_proj"].astype(dt), index_loss

    kv = (c_kv @ p["kv_b_proj"].astype(dt)).reshape(b, s, n, nope + vd)  # [B, S, N, nope + V]
    k_nope, v = kv[..., :nope], checkpoint_name(kv[..., nope:], "value_proj")
    q = jnp.concatenate([q_nope, q_rot], axis=-1)  # [B, S, N, Dqk]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (b, s, n, rope))], axis=-1)

    out = sharded_attention(q, k, v, segment_ids, cfg.softmax_scale, mesh).reshape(b, s, n * vd)  # [B, S, N*V]
    return out @ p["o_proj"].astype(dt), index_loss


def attention_index(p: dict, x: jax.Array, cos, sin, cfg: ModelConfig, q_latent=None) -> "dsa.Index":
    """DeepSeek-V3.2's indexer of an attention layer (`p`: its weights) for input x [B, S, H]
    (MLA's q latent computed here unless given). It reads its inputs detached: it learns from
    its own loss alone."""
    if q_latent is None:
        q_latent = rms_norm(x @ p["q_a_proj"].astype(x.dtype), p["q_norm"], LATENT_NORM_EPS)
    detached = jax.lax.stop_gradient
    return dsa.indexer(p["indexer"], detached(x), detached(q_latent), cos, sin, cfg, apply_rope)


def sharded_sparse_attention(
    lat: "dsa.Latents", index: "dsa.Index", segment_ids, cfg: ModelConfig, sparse: Sparse, mesh=None
):
    """DeepSeek Sparse Attention of each device's own rows (in shard_map over the batch axes, as
    `sharded_attention`): (out [B, S, N, dv], or None where attention stays dense (the warm-up
    stage, or a sequence no longer than index_topk: every key chosen), the indexers' loss)."""
    attend = lat.q_nope.shape[1] > cfg.index_topk and not sparse.dense

    def local(lat, index, segment_ids):
        documents = document_ids(segment_ids)
        if not attend:
            return None, dsa.dense_index_loss(lat, index, documents, cfg.softmax_scale)
        keys, valid = dsa.select(index, documents, cfg.index_topk)
        return dsa.sparse_attention(lat, keys, valid, cfg.softmax_scale, index if sparse.loss else None)

    if mesh is None:
        return local(lat, index, segment_ids)
    rows = batch_sharding(mesh, segment_ids.shape).spec[0]
    per_row = lambda x: PartitionSpec(rows, *([None] * (x.ndim - 1)))  # noqa: E731
    specs = (dsa.Latents(*map(per_row, lat[:4]), PartitionSpec(), PartitionSpec()), jax.tree.map(per_row, index))
    total = axes_of(rows)  # the axes that split the rows: the loss sums over them

    def on_device(lat, index, segment_ids):
        out, loss = local(lat, index, segment_ids)
        return out, jax.lax.psum(loss, total) if total else loss  # the same total on every device

    out_spec = PartitionSpec(rows, None, None, None) if attend else None
    return jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(*specs, PartitionSpec(rows, None)),
        out_specs=(out_spec, PartitionSpec()),
        check_vma=False,
    )(lat, index, segment_ids)


def mlp(p: dict, x: jax.Array) -> jax.Array:
    dt = x.dtype
    return (jax.nn.silu(x @ p["gate"].astype(dt)) * (x @ p["up"].astype(dt))) @ p["down"].astype(dt)


class Context(NamedTuple):
    """What every layer needs besides its parameters (a pytree, so it passes through jit)."""

    cos: jax.Array
    sin: jax.Array
    segment_ids: jax.Array  # [B, S]: attention stays within a segment


def decoder_layer(
    p: dict,
    buf: dict,
    h: jax.Array,
    ctx: Context,
    cfg: ModelConfig,
    backend: str,
    mesh=None,
    ep: ExpertParallel | None = None,
    sparse: Sparse = Sparse(),
):
    """Pre-norm residual block: MLA, then a dense MLP or the MoE (expert-parallel, as `ep` says,
    when the mesh has expert axes). Returns (h, Routing|None, the indexer's loss: 0 unless
    `sparse.loss`)."""
    eps = cfg.rms_norm_eps
    with jax.named_scope("attention"):
        x = rms_norm(h, p["input_norm"], eps)
        attended, index_loss = mla_attention(p["attn"], x, ctx.cos, ctx.sin, ctx.segment_ids, cfg, mesh, sparse)
        h = h + attended
    x = rms_norm(h, p["post_norm"], eps)
    if "router" not in p:
        with jax.named_scope("mlp"):
            return h + mlp(p["mlp"], x), None, index_loss
    b, s, hid = x.shape
    flat = x.reshape(b * s, hid)  # [T, H]
    bias = jax.lax.stop_gradient(buf["router_bias"])
    if mesh is not None and expert_axes(mesh):
        routed, routing = ep_moe(p, bias, flat, cfg, mesh, backend=backend, options=ep)
    else:
        routed, routing = moe_layer(p, bias, flat, cfg, x.dtype, backend)
    if cfg.n_shared_experts:
        with jax.named_scope("shared_experts"):
            routed = routed + mlp(p["shared"], flat)
    return h + routed.reshape(b, s, hid), routing, index_loss


_policies = jax.checkpoint_policies
# What the backward pass keeps of each layer's forward (the rest is recomputed):
REMAT_POLICIES = {
    "none": None,  # keep everything (no rematerialisation)
    "full": _policies.nothing_saveable,  # keep only the layer inputs
    "dots": _policies.dots_with_no_batch_dims_saveable,  # keep the weight matmuls' outputs
    "save_qv": _policies.save_only_these_names("query_proj", "value_proj"),  # keep q and v in device memory
    # "full", but each MoE layer keeps what its dispatch received over the expert-parallel exchange's
    # outer stage (between nodes: the network), so that the backward does not send it again
    "save_dispatch": _policies.save_only_these_names(DISPATCHED),
    "offload_qv": _policies.save_and_offload_only_these_names(  # keep q and v in host memory
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["query_proj", "value_proj"],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def remat_policy(remat: str | bool):
    """ "none" | "full" | "dots" | "save_qv" | "offload_qv" | "save_dispatch" (True = "full", False = "none")."""
    name = {True: "full", False: "none"}.get(remat, remat)
    if name not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r} (have: {', '.join(REMAT_POLICIES)})")
    return name


def scan_layers(
    params: dict,
    buffers: dict,
    h: jax.Array,
    ctx: Context,
    cfg,
    backend: str,
    remat,
    mesh=None,
    kind: str = "moe",
    ep=None,
    sparse: Sparse = Sparse(),
    sums: dict | None = None,
):
    """Run a stack of identical layers (params[kind]) with lax.scan (compile time independent of
    depth). Returns (h, (each layer's h, routing, indexer loss)).

    With `sums` (float32, shaped as `params`; remat "full"): the backward adds each layer's
    weight gradients into `sums` as it computes them (`accumulating_scan`), and the gradient
    with respect to `sums` is `sums` plus them; the gradient with respect to `params` is not
    formed (pass them without one)."""

    def body(h, layer, ctx):
        p, buf = layer
        p = gathered_for_use(p, mesh, ("params", kind), dtype=h.dtype)
        h, routing, index_loss = decoder_layer(p, buf, h, ctx, cfg, backend, mesh, ep, sparse)
        h = constrain_batch(h, mesh)
        return h, (h, routing, index_loss)

    name = remat_policy(remat)
    if sums is not None:
        if name not in ACCUMULATING:
            raise ValueError(
                f"accumulating the weight gradients in the layer loop needs remat {' or '.join(ACCUMULATING)}, got {remat!r}"
            )
        return accumulating_scan(body, params, buffers, h, ctx, sums, REMAT_POLICIES[name])
    if name != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[name])
    return jax.lax.scan(lambda h, layer: body(h, layer, ctx), h, (params, buffers))


# the remat policies whose layer loops can add their weight gradients into the sums (accumulating_scan)
ACCUMULATING = ("full", "save_dispatch")


def accumulating_scan(body, params, buffers, h, ctx, sums, policy=_policies.nothing_saveable):
    """`lax.scan` of `body(h, (p, buf), ctx) -> (h, ys)` over the layers, with a backward written
    out: a reverse loop that recomputes each layer from its input (remat "full") and adds its
    weight gradients into `sums` in place (gradient-accumulation fusion, as Megatron calls it).
    With a remat `policy` that saves named values ("save_dispatch"), the forward keeps them, a
    stack over the layers, and each layer's recomputation starts from them.
    jax's own backward of a scan returns a layer stack's gradient stacked, a second copy of the
    stack (in the compute dtype) beside the float32 sums it is then added into. Returns what the
    scan returns; its gradient with respect to `sums` is `sums` plus this pass's weight
    gradients; with respect to `params`, `buffers` and `ctx`, none (zero). That "gradient" is not
    linear in the loss: take it once, with `sums` differentiated, `params` not, and the scan's
    outputs reaching the loss (else jax never runs the backward and it comes back zero), as
    `moe_jax.train.step.accumulated` does."""

    @jax.custom_vjp
    def run(params, buffers, h, ctx, sums):
        return jax.lax.scan(lambda h, layer: body(h, layer, ctx), h, (params, buffers))

    def layer(p, h, buf, ctx):
        return body(h, (p, buf), ctx)

    rebuilt = []  # how to rebuild a layer's pullback from its inputs and what it saved (set in run_fwd)

    def run_fwd(params, buffers, h, ctx, sums):
        if policy is _policies.nothing_saveable:
            out = run(params, buffers, h, ctx, sums)
            return out, (params, buffers, h, out[1][0], ctx, sums, None)

        def forward_keeping(h, xs):
            p, buf = xs
            out, pullback = jax.vjp(jax.checkpoint(layer, policy=policy), p, h, buf, ctx)
            saved, rebuild = split_pullback(pullback, (p, h, buf, ctx))
            rebuilt[:] = [rebuild]
            return out[0], (out[1], saved)

        h_out, (ys, saved) = jax.lax.scan(forward_keeping, h, (params, buffers))
        return (h_out, ys), (params, buffers, h, ys[0], ctx, sums, saved)

    def run_bwd(res, cts):
        params, buffers, h0, hs, ctx, sums, saved = res
        ct_h, ct_ys = cts
        one_layer = jax.tree.map(lambda x: x[0], (params, buffers))
        shapes = jax.eval_shape(lambda h, layer: body(h, layer, ctx)[1], h0, one_layer)
        ct_leaves, ct_tree = jax.tree.flatten(ct_ys)
        floats = [i for i, s in enumerate(jax.tree.leaves(shapes)) if jnp.issubdtype(s.dtype, jnp.inexact)]

        def layer_cotangent(sliced):  # one layer's ys cotangent: float0 zeros for its integer outputs
            leaves = [np.zeros(s.shape, jax.dtypes.float0) for s in jax.tree.leaves(shapes)]
            for i, x in zip(floats, sliced):
                leaves[i] = x
            return jax.tree.unflatten(ct_tree, leaves)

        def back(carry, xs):
            ct_h, acc = carry
            i, p, buf, ct_y, kept = xs
            h_in = jnp.where(i == 0, h0, jax.lax.dynamic_index_in_dim(hs, jnp.maximum(i - 1, 0), keepdims=False))
            if saved is None:
                _, pullback = jax.vjp(lambda p, h: layer(p, h, buf, ctx), p, h_in)
            else:
                pullback = rebuilt[0]((p, h_in, buf, ctx), kept)
            ct_p, ct_h = pullback((ct_h, layer_cotangent(ct_y)))[:2]
            acc = jax.tree.map(lambda a, g: add_at(a, i, g), acc, ct_p)
            return (ct_h, acc), None

        xs = (jnp.arange(hs.shape[0]), params, buffers, [ct_leaves[i] for i in floats], saved)
        (ct_h0, acc), _ = jax.lax.scan(back, (ct_h, sums), xs, reverse=True)
        return None, None, ct_h0, None, acc

    run.defvjp(run_fwd, run_bwd)
    return run(params, buffers, h, ctx, sums)


def split_pullback(pullback, inputs):
    """(what `pullback`, from `jax.vjp` of a checkpointed function, holds besides the leaves of
    `inputs`, the function's arguments: what its remat policy saved; a function of (inputs,
    saved) that gives the pullback back, for other values of both)."""
    leaves, tree = jax.tree.flatten(pullback)
    where = {id(x): j for j, x in enumerate(jax.tree.leaves(inputs))}
    sources = [where.get(id(x)) for x in leaves]  # an input's position, or None: saved
    saved = [x for x, j in zip(leaves, sources) if j is None]

    def rebuild(inputs, saved):
        given, kept = jax.tree.leaves(inputs), iter(saved)
        return jax.tree.unflatten(tree, [next(kept) if j is None else given[j] for j in sources])

    return saved, rebuild


def add_at(a: jax.Array, i, term: jax.Array) -> jax.Array:
    """a with term added to a[i], as an update of a in place (jnp's .at[i].add is a scatter)."""
    new = jax.lax.dynamic_index_in_dim(a, i, keepdims=False) + term.astype(a.dtype)
    return jax.lax.dynamic_update_index_in_dim(a, new, i, 0)


# ---- the model -------------------------------------------------------------------------------
def embed_tokens(table: jax.Array, tokens: jax.Array, dtype, mesh=None) -> jax.Array:
    """The embeddings of `tokens` [B, S]: [B, S, H] in `dtype`. On a mesh the table stays split as
    it is kept (hidden over the FSDP axes, vocabulary over `tensor`): each device looks up its
    hidden slice for the tokens of every device along those axes, and one all-to-all hands each
    device its own tokens' whole rows. That moves T x H values a device where gathering the table
    moves V x H (DeepSeek-V3: 129,280 x 7,168, 3.5 GiB in float32) and scatters its gradient."""
    if mesh is None:
        return table[tokens].astype(dtype)
    vocab_axes, hidden_axes = spec_for(mesh, logical_axes(("params", "embed"), 2), table.shape)
    rows = batch_sharding(mesh, tokens.shape).spec[0]
    if not vocab_axes and not hidden_axes:
        return table[tokens].astype(dtype)

    def lookup(table, tokens):  # one device's slice of the table; its rows of tokens
        if hidden_axes:  # every token of the devices that hold the other hidden slices
            tokens = jax.lax.all_gather(tokens, hidden_axes, axis=0, tiled=True)
        if vocab_axes:  # the rows of this device's vocabulary range; zeros for the rest, summed
            index = tokens - jax.lax.axis_index(vocab_axes) * table.shape[0]
            inside = (index >= 0) & (index < table.shape[0])
            x = jnp.where(inside[..., None], table[jnp.clip(index, 0, table.shape[0] - 1)].astype(dtype), 0)
            x = jax.lax.psum(x, vocab_axes)
        else:
            x = table[tokens].astype(dtype)
        if hidden_axes:  # device i's tokens, every hidden slice: [B/rows, S, H]
            x = jax.lax.all_to_all(x, hidden_axes, split_axis=0, concat_axis=2, tiled=True)
        return x

    return jax.shard_map(
        lookup,
        mesh=mesh,
        in_specs=(PartitionSpec(vocab_axes, hidden_axes), PartitionSpec(rows, None)),
        out_specs=PartitionSpec(rows, None, None),
        check_vma=False,
    )(table, tokens)


def forward(
    params: dict,
    buffers: dict,
    tokens: jax.Array,
    cfg: ModelConfig,
    *,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    dtype=jnp.float32,
    mtp: bool = False,
    backend: str | None = None,
    remat: str | bool = "none",
    mesh=None,
    ep: ExpertParallel | None = None,
    logits: bool = True,
    sparse: Sparse = Sparse(),
    sums: dict | None = None,
) -> Output:
    """tokens [B, S] int32 -> Output. `positions` default to 0..S-1 per row; with packed
    sequences pass per-document positions and `segment_ids` (attention stays within a segment).
    `logits=False` leaves the heads out (Output.logits and mtp_logits None): the training loss
    applies them to the hidden states itself (moe_jax.train.objective.head_cross_entropy).
    `sparse`: how a DeepSeek-V3.2 model attends (`Sparse`). `sums` ({"dense", "moe"} -> float32
    sums shaped as those layer stacks; remat "full"): their backward adds the stacks' weight
    gradients into them (`scan_layers`), for gradient accumulation (moe_jax.train.step)."""
    b, s = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    if segment_ids is None:
        segment_ids = jnp.zeros((b, s), jnp.int32)
    cos, sin = rope_tables(cfg, positions)
    ctx = Context(cos, sin, segment_ids)
    h = constrain_batch(embed_tokens(params["embed"], tokens, dtype, mesh), mesh)  # [B, S, H]
    hidden = [h[None]]
    routing = []
    index_loss = jnp.zeros((), jnp.float32)
    for kind in ("dense", "moe"):
        if kind in params:
            stack = params[kind], buffers.get(kind, {})
            acc = None if sums is None else sums[kind]
            h, (hs, r, losses) = scan_layers(*stack, h, ctx, cfg, backend, remat, mesh, kind, ep, sparse, acc)
            hidden.append(hs)
            index_loss += losses.sum()
            if r is not None:
                routing.append(r)
    out_logits = head(params, params["final_norm"], h, cfg, mesh) if logits else None

    mtp_logits = mtp_hidden = None
    if mtp:
        if "mtp" not in params:
            raise ValueError("this model has no MTP layers (num_nextn_predict_layers = 0 or not loaded)")
        with jax.named_scope("mtp"):
            mtp_logits, mtp_hidden, mtp_routing, mtp_loss = mtp_forward(
                params, buffers, tokens, h, ctx, cfg, backend, mesh, ep, logits, sparse
            )
        routing += mtp_routing
        index_loss += mtp_loss
    loss = index_loss if cfg.dsa and sparse.loss else None
    return Output(out_logits, jnp.concatenate(hidden, axis=0), mtp_logits, routing, mtp_hidden, loss)


def head(params: dict, norm_w: jax.Array, h: jax.Array, cfg: ModelConfig, mesh=None) -> jax.Array:
    """Float32 logits [..., V] of hidden states h (before the norm `norm_w`). (Training applies the
    head inside its loss a vocabulary chunk at a time: moe_jax.train.objective.head_cross_entropy.)"""
    x = rms_norm(h, norm_w, cfg.rms_norm_eps)
    w = gathered_for_use({"lm_head": params["lm_head"]}, mesh, ("params",), stacked=False, dtype=h.dtype)["lm_head"]
    return jnp.dot(x, w.astype(h.dtype), preferred_element_type=jnp.float32)


def mtp_forward(
    params,
    buffers,
    tokens,
    h,
    ctx: Context,
    cfg: ModelConfig,
    backend: str,
    mesh=None,
    ep=None,
    logits: bool = True,
    sparse: Sparse = Sparse(),
):
    """DeepSeek-V3 multi-token prediction (paper 2.2): depth j combines the previous depth's
    hidden state at i (the main model's last layer output, before the final norm, for j = 0)
    with the embedding of token i+1+j, runs one decoder layer and the shared head.
    Returns (logits [n_mtp, B, S, V] or None without `logits`, hidden states [n_mtp, B, S, H],
    routing, the indexers' loss)."""
    p, buf = params["mtp"], buffers.get("mtp", {})
    eps = cfg.rms_norm_eps
    out_logits, hidden, routing = [], [], []
    index_loss = jnp.zeros((), jnp.float32)
    shifted = tokens
    for j in range(p["enorm"].shape[0]):
        shifted = jnp.concatenate([shifted[:, 1:], jnp.zeros_like(shifted[:, :1])], axis=1)
        layer = gathered_for_use(
            jax.tree.map(lambda a: a[j], p["layer"]), mesh, ("params", "mtp", "layer"), dtype=h.dtype
        )
        layer_buf = jax.tree.map(lambda a: a[j], buf.get("layer", {}))
        e = rms_norm(embed_tokens(params["embed"], shifted, h.dtype, mesh), p["enorm"][j], eps)
        x = jnp.concatenate([e, rms_norm(h, p["hnorm"][j], eps)], axis=-1) @ p["eh_proj"][j].astype(h.dtype)
        h, r, loss = decoder_layer(layer, layer_buf, x, ctx, cfg, backend, mesh, ep, sparse)
        index_loss += loss
        hidden.append(h)
        if logits:
            out_logits.append(head(params, p["head_norm"][j], h, cfg, mesh))
        if r is not None:
            routing.append(jax.tree.map(lambda a: a[None], r))
    return (jnp.stack(out_logits) if logits else None), jnp.stack(hidden), routing, index_loss


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "mtp", "backend", "remat", "mesh", "ep"))
def _jit_forward(params, buffers, tokens, segment_ids, positions, cfg, dtype, mtp, backend, remat, mesh, ep):
    return forward(
        params,
        buffers,
        tokens,
        cfg,
        segment_ids=segment_ids,
        positions=positions,
        dtype=dtype,
        mtp=mtp,
        backend=backend,
        remat=remat,
        mesh=mesh,
        ep=ep,
    )


@dataclasses.dataclass
class DeepseekV3:
    """A config plus its weights. `model(tokens)` gives logits; `model.apply(...)` gives all."""

    config: ModelConfig
    params: dict  # trainable weights
    buffers: dict  # non-trainable state (router correction biases)
    dtype: jnp.dtype = jnp.float32  # compute dtype; params keep their own (param) dtype
    backend: str | None = None
    mesh: jax.sharding.Mesh | None = None  # with expert axes (`expert`, `expert_node`) > 1: expert-parallel MoE
    ep: ExpertParallel | None = None  # how (None: ExpertParallel's defaults)

    def __call__(self, tokens, segment_ids=None, positions=None) -> jax.Array:
        return self.apply(tokens, segment_ids=segment_ids, positions=positions).logits

    def apply(
        self, tokens, *, segment_ids=None, positions=None, mtp: bool = False, remat: str | bool = "none"
    ) -> Output:
        check_batch(tokens, segment_ids, positions, self.config.vocab_size)
        if self.mesh is not None and expert_axes(self.mesh) and math.prod(np.shape(tokens)) % self.mesh.size:
            b, s = np.shape(tokens)
            raise ValueError(
                f"tokens: {b} x {s} = {b * s} do not split over the mesh's {self.mesh.size} devices (the "
                f"expert-parallel MoE layers split every token over every device): use a multiple of {self.mesh.size}"
            )
        tokens, segment_ids, positions = (
            None if a is None else self.place_batch(a) for a in (tokens, segment_ids, positions)
        )
        return _jit_forward(
            self.params,
            self.buffers,
            tokens,
            segment_ids,
            positions,
            self.config,
            jnp.dtype(self.dtype),
            mtp,
            self.backend,
            remat,
            self.mesh,
            self.ep,
        )

    def place_batch(self, x) -> jax.Array:
        """An int32 [B, ...] host batch, the same in every process, as a device array (split
        over the mesh's batch axes when there is a mesh). Device arrays pass through."""
        if self.mesh is None or isinstance(x, jax.Array):
            return jnp.asarray(x, jnp.int32)
        return place(np.asarray(x, np.int32), batch_sharding(self.mesh, np.shape(x)))

    @property
    def param_dtype(self):
        return self.params["embed"].dtype


def check_batch(tokens, segment_ids, positions, vocab_size: int) -> None:
    """ValueError naming the argument unless tokens are integer ids in [0, vocab_size) shaped
    [batch, sequence] (both >= 1) and segment_ids / positions, where given, integers of that shape.
    (Values are checked where they are on this host: not inside a trace, not across processes.)"""
    shape = np.shape(tokens)
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"tokens: expected token ids shaped [batch, sequence], both >= 1; got shape {shape}")
    for name, a in (("tokens", tokens), ("segment_ids", segment_ids), ("positions", positions)):
        if a is None:
            continue
        if np.shape(a) != shape:
            raise ValueError(f"{name}: shape {np.shape(a)}, expected the tokens' {shape}")
        dtype = np.result_type(a) if not isinstance(a, jax.Array) else a.dtype
        if not np.issubdtype(dtype, np.integer):
            raise ValueError(f"{name}: expected integers, got {dtype}")
    if isinstance(tokens, jax.core.Tracer) or (isinstance(tokens, jax.Array) and not tokens.is_fully_addressable):
        return
    ids = np.asarray(tokens)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"tokens: ids must be in [0, {vocab_size}) (the model's vocab_size), got {ids.min()}..{ids.max()}"
        )


def model_from_tree(
    cfg: ModelConfig, tree: dict, compute_dtype=None, backend: str | None = None, mesh=None
) -> DeepseekV3:
    """A model from host (numpy) or device arrays; placed onto `mesh` when given."""
    tree = {"params": tree["params"], "buffers": tree.get("buffers", {})}
    if mesh is not None:
        tree = shard_tree(tree, mesh)
    else:
        tree = jax.tree.map(jnp.asarray, tree)
    dtype = compute_dtype or tree["params"]["embed"].dtype
    return DeepseekV3(cfg, tree["params"], tree["buffers"], dtype=jnp.dtype(dtype), backend=backend, mesh=mesh)
