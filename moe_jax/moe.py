"""Routing (noaux_tc), dropless dispatch and combine around the grouped GEMM."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from moe_jax.config import ModelConfig
from moe_jax.kernels.grouped_gemm import grouped_ffn, row_alignment
from moe_jax.quant import mxfp8


class Routing(NamedTuple):
    weights: jax.Array  # [T, k] float32: unbiased scores of the chosen experts, normalised, scaled
    experts: jax.Array  # [T, k] int32
    scores: jax.Array  # [T, E] float32 sigmoid scores (for balance losses)
    overflow: jax.Array  # [] int32: further rounds the expert-parallel exchange took (moe_jax.parallel.ep)


def route(x: jax.Array, router: jax.Array, bias: jax.Array, cfg: ModelConfig) -> Routing:
    """DeepSeek-V3 noaux_tc routing, as transformers computes it.

    Gate logits in float32 (transformers keeps the router weight in float32; DeepSeek's own
    inference code uses bf16 — we follow the reference we are checked against).
    """
    t, e = x.shape[0], cfg.n_routed_experts
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))  # [T, E]
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias.astype(jnp.float32)  # bias steers the choice only
    if cfg.topk_group < cfg.n_group:
        grouped = choice.reshape(t, cfg.n_group, e // cfg.n_group)  # [T, G, E/G]
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        _, kept = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
        group_mask = jax.nn.one_hot(kept, cfg.n_group, dtype=jnp.bool_).any(1)  # [T, G]
        expert_mask = jnp.repeat(group_mask, e // cfg.n_group, axis=1)  # [T, E]
        choice = jnp.where(expert_mask, choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)  # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return Routing(weights * cfg.routed_scaling_factor, experts.astype(jnp.int32), scores, jnp.zeros((), jnp.int32))


class Dispatch(NamedTuple):
    order: jax.Array  # [M] token-expert pair ids sorted by expert (T*k where a row is padding)
    group_sizes: jax.Array  # [E] int32, rows per expert (padding included)


def dispatch(
    x: jax.Array, experts: jax.Array, num_experts: int, pairs: int | None = None, align: int = 1
) -> tuple[jax.Array, Dispatch]:
    """Rows of `x` [T, H] repeated once per chosen expert and sorted by expert: [T*k, H], or the
    first `pairs` of them where the caller knows that at most `pairs` choices are real.

    An expert id of -1 (a choice held by another rank, under expert parallelism) sorts last, past
    every group, so the grouped GEMM returns zeros for it. With `align` > 1 every expert's rows
    start at a multiple of `align` (Transformer Engine's grouped GEMM needs 128), zero rows
    between: the rows are gathered straight into that layout, where padding them after the sort
    wrote them twice (and the backward scattered them twice)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)  # [T*k]
    key = jnp.where(flat >= 0, flat, num_experts)
    order = jnp.argsort(key, stable=True)[:pairs].astype(jnp.int32)
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    if align > 1:
        dest, tiles = mxfp8.tile_plan(group_sizes, order.shape[0], align)  # past the groups: dropped
        order = jnp.full((tiles * align,), flat.shape[0], jnp.int32).at[dest].set(order, mode="drop")
        group_sizes = (group_sizes + align - 1) // align * align
    return jnp.asarray(x).at[order // k].get(mode="fill", fill_value=0), Dispatch(order, group_sizes)


def combine(y: jax.Array, d: Dispatch, weights: jax.Array) -> jax.Array:
    """Expert outputs [T*k, H] (sorted as `d.order`) back to tokens, weighted sum in float32: [T, H]."""
    t, k = weights.shape
    pairs = jnp.zeros_like(y).at[d.order].set(y).reshape(t, k, -1)  # [T, k, H]
    return jnp.einsum("tkh,tk->th", pairs.astype(jnp.float32), weights.astype(jnp.float32))


def expert_ffn(
    xs: jax.Array,
    p: dict,
    group_sizes: jax.Array,
    dtype,
    backend: str | None,
    row_weights=None,
    rows_aligned: bool = False,
) -> jax.Array:
    """SwiGLU over expert-sorted rows [M, H]: down(silu(x gate_e) * x up_e) -> [M, H] (times
    `row_weights` [M] where given; `rows_aligned`: as `grouped_ffn`)."""
    w = [p[k].astype(dtype) for k in ("gate", "up", "down")]
    return grouped_ffn(xs, *w, group_sizes, backend, row_weights=row_weights, rows_aligned=rows_aligned)


def routed_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    p: dict,
    num_experts: int,
    dtype,
    backend: str | None,
    pairs: int | None = None,
    align: int | None = None,
) -> jax.Array:
    """Dropless dispatch, expert FFN, combine: tokens x [T, H] with their chosen experts and
    weights [T, k] (ids into p's `num_experts` experts; -1: none) -> float32 [T, H]. `pairs`: at
    most that many ids are not -1 (the grouped GEMM's input is then [pairs, H], not [T*k, H]; an
    expert-parallel receiver, whose rows carry few local choices each: the FFN applies the weights
    and each row's outputs are summed in the compute dtype, the dtype the row goes back in; the
    rows are dispatched in the layout `backend`'s grouped GEMM takes, each expert's rows from a
    multiple of `align`, default `row_alignment(backend)`)."""
    if pairs is not None and align is None:
        align = row_alignment(backend)
    with jax.named_scope("dispatch"):
        xs, d = dispatch(x, experts, num_experts, pairs, 1 if pairs is None else align)
    if pairs is None:
        with jax.named_scope("expert_ffn"):
            ys = expert_ffn(xs, p, d.group_sizes, dtype, backend)
        with jax.named_scope("combine"):
            return combine(ys, d, weights)
    k = experts.shape[1]
    with jax.named_scope("expert_ffn"):
        row_weights = weights.reshape(-1).at[d.order].get(mode="fill", fill_value=0)
        aligned = align % row_alignment(backend) == 0  # else the FFN pads them itself
        ys = expert_ffn(xs, p, d.group_sizes, dtype, backend, row_weights, rows_aligned=aligned)
    with jax.named_scope("combine"):  # padding rows (pair T*k) fall outside and are dropped
        return jnp.zeros((x.shape[0], ys.shape[1]), ys.dtype).at[d.order // k].add(ys, mode="drop")


def moe_layer(p: dict, bias: jax.Array, x: jax.Array, cfg: ModelConfig, dtype, backend: str):
    """The routed experts (dropless) on one device. x: [T, H]. Returns ([T, H], Routing)."""
    with jax.named_scope("router"):
        r = route(x, p["router"], bias, cfg)
    y = routed_experts(x, r.experts, r.weights, p["experts"], cfg.n_routed_experts, dtype, backend)
    return y.astype(dtype), r
