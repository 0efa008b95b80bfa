"""Expert parallelism with deduplicated dispatch, in `jax.shard_map`.

Routed experts are split over the mesh axis `axis` (EP ranks, E/EP experts each) and tokens are
split over the same axis (T tokens per rank). Each rank routes its own tokens, then sends every
token ONCE to each rank that holds any of its top-k experts, with that rank's local expert ids
and routing weights; the receiver fans the row out to its local experts (one grouped GEMM),
reduces the weighted outputs per row, and sends one row back; the source sums what comes back.

Transport: a fixed [EP, T, H] `all_to_all`. With deduplication a rank receives at most T rows
from each source, so the fixed buffer is dropless by construction; it is what XLA:CPU supports
(ragged_all_to_all does not compile there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from moe_jax.config import ModelConfig
from moe_jax.kernels.grouped_gemm import grouped_ffn
from moe_jax.moe import Routing, route


def dispatch_plan(experts: jax.Array, weights: jax.Array, ep: int, experts_per_rank: int):
    """Per destination rank: which tokens go there (once each), with local ids and weights.

    experts, weights: [T, k]. Returns (send [EP, T] bool, local_ids [EP, T, k] (-1: not on that
    rank), local_weights [EP, T, k] (0 where not on that rank))."""
    rank_of = experts // experts_per_rank  # [T, k]
    on_rank = rank_of[None] == jnp.arange(ep)[:, None, None]  # [EP, T, k]
    local_ids = jnp.where(on_rank, (experts % experts_per_rank)[None], -1)
    local_weights = jnp.where(on_rank, weights[None], 0.0)
    return on_rank.any(-1), local_ids, local_weights


def _expert_rows(rows: jax.Array, ids: jax.Array, weights: jax.Array, w: dict, experts_per_rank: int, backend):
    """Received rows [R, H] with up to k local experts each -> weighted sum of their outputs [R, H]."""
    r, k = ids.shape
    flat = ids.reshape(-1)
    key = jnp.where(flat >= 0, flat, experts_per_rank)  # pairs for other ranks sort last, past the groups
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=experts_per_rank + 1)[:experts_per_rank].astype(jnp.int32)
    ys = grouped_ffn(rows[order // k], w["gate"], w["up"], w["down"], sizes, backend)  # [R*k, H]
    pairs = jnp.zeros_like(ys).at[order].set(ys).reshape(r, k, -1)
    return jnp.einsum("rkh,rk->rh", pairs.astype(jnp.float32), weights.astype(jnp.float32))


def ep_moe(p: dict, bias: jax.Array, x: jax.Array, cfg: ModelConfig, mesh: Mesh, axis: str = "expert",
           backend: str | None = None) -> tuple[jax.Array, Routing]:  # fmt: skip
    """(Routed-expert output [N, H], Routing) for tokens x [N, H]. Tokens are split over every axis of the mesh
    (so data axes shard them too), experts over `axis`; the all_to_all runs over `axis` only."""
    ep = mesh.shape[axis]
    if cfg.n_routed_experts % ep:
        raise ValueError(f"{cfg.n_routed_experts} experts do not split over {ep} ranks of axis {axis!r}")
    per_rank = cfg.n_routed_experts // ep
    dtype = x.dtype

    def local(router, bias, gate, up, down, x):  # x [T, H]; gate/up/down [E/EP, ...]
        r = route(x, router, bias, cfg)
        send, ids, weights = dispatch_plan(r.experts, r.weights, ep, per_rank)
        send_x = jnp.where(send[..., None], x[None], 0).astype(dtype)  # [EP, T, H], each row once per rank
        recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True)  # [EP (source), T, H]
        recv_ids = jax.lax.all_to_all(ids, axis, 0, 0, tiled=True)
        recv_w = jax.lax.all_to_all(weights, axis, 0, 0, tiled=True)
        t, h = x.shape
        w = {"gate": gate.astype(dtype), "up": up.astype(dtype), "down": down.astype(dtype)}
        y = _expert_rows(recv_x.reshape(ep * t, h), recv_ids.reshape(ep * t, -1), recv_w.reshape(ep * t, -1),
                         w, per_rank, backend)  # fmt: skip
        back = jax.lax.all_to_all(y.reshape(ep, t, h), axis, 0, 0, tiled=True)  # [EP (expert rank), T, H]
        return back.sum(0).astype(dtype), r

    e, tokens = P(axis), P(tuple(mesh.axis_names))
    out_specs = (tokens, Routing(tokens, tokens, tokens))  # the routing stays split like the tokens
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), e, e, e, tokens), out_specs=out_specs, check_vma=False)
    ex = p["experts"]
    return fn(p["router"], bias, ex["gate"], ex["up"], ex["down"], x)
