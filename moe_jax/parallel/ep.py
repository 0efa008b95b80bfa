"""Expert parallelism with deduplicated dispatch, in `jax.shard_map`.

Routed experts are split over the mesh axis `axis` (EP ranks, E/EP experts each) and tokens are
split over the same axis (T tokens per rank). Each rank routes its own tokens, then sends every
token ONCE to each rank that holds any of its top-k experts, with that rank's local expert ids
and routing weights; the receiver fans the row out to its local experts, reduces the weighted
outputs per row (the single-device dispatch, grouped GEMM and combine: `moe_jax.moe.routed_experts`
over its E/EP experts), and sends one row back; the source sums what comes back.

Transports (`transport=`; default: "ragged" on GPU/TPU, "all_to_all" elsewhere):
- "all_to_all": a fixed [EP, T, H] `all_to_all`. With deduplication a rank receives at most T
  rows from each source, so the fixed buffer is dropless by construction. It moves EP*T rows per
  rank whatever the routing; it is what XLA:CPU supports (ragged_all_to_all does not compile
  there: "HLO opcode ragged-all-to-all is not supported by XLA:CPU", jax 0.10.2).
- "ragged": `jax.lax.ragged_all_to_all` moves only the rows that carry a token (the
  deduplicated count, see scripts/bench_ep.py); same receive layout, so equally dropless.
- "ragged_emulated": the "ragged" algorithm with the collective emulated by all_gather, so its
  offsets and packing are tested on CPU (tests/test_ep.py); for tests only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moe_jax import gpu
from moe_jax.config import ModelConfig
from moe_jax.moe import Routing, route, routed_experts


def dispatch_plan(experts: jax.Array, weights: jax.Array, ep: int, experts_per_rank: int):
    """Per destination rank: which tokens go there (once each), with local ids and weights.

    experts, weights: [T, k]. Returns (send [EP, T] bool, local_ids [EP, T, k] (-1: not on that
    rank), local_weights [EP, T, k] (0 where not on that rank))."""
    rank_of = experts // experts_per_rank  # [T, k]
    on_rank = rank_of[None] == jnp.arange(ep)[:, None, None]  # [EP, T, k]
    local_ids = jnp.where(on_rank, (experts % experts_per_rank)[None], -1)
    local_weights = jnp.where(on_rank, weights[None], 0.0)
    return on_rank.any(-1), local_ids, local_weights


def _ragged_emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name):
    """`jax.lax.ragged_all_to_all`'s semantics (one slice per peer) from all_gather and a scatter."""
    del recv_sizes  # implied by what the peers send
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [EP (source), R, ...]
    starts, sizes, dests = (
        jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes, output_offsets)
    )
    j = jnp.arange(operand.shape[0])
    rows = jnp.take_along_axis(
        operands,
        jnp.clip(starts[:, None] + j, 0, operand.shape[0] - 1).reshape(operands.shape[:2] + (1,) * (operand.ndim - 1)),
        axis=1,
    )
    target = jnp.where(j < sizes[:, None], dests[:, None] + j, output.shape[0])  # out of range: dropped
    return output.at[target.reshape(-1)].set(rows.reshape((-1,) + operand.shape[1:]), mode="drop")


def _ragged_exchange(x, ids, weights, send, ep: int, axis: str, expert_fn, ragged_all_to_all):
    """Dispatch only the (token, rank) rows in `send`, run `expert_fn` on what arrives, and sum
    what comes back per token. Rows from source s land at s*T on the receiver."""
    t, h = x.shape
    cap = t * min(ep, ids.shape[-1])  # a token goes to at most min(EP, k) ranks
    order = jnp.argsort(~send.reshape(-1), stable=True)[:cap]  # sent rows first, destination-major
    token = order % t
    send_sizes = send.sum(1).astype(jnp.int32)  # [EP] rows for each destination
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    me = jax.lax.axis_index(axis)
    slots = jnp.full((ep,), me * t, jnp.int32)  # where my rows land on every receiver
    recv_sizes = jax.lax.all_to_all(send_sizes, axis, 0, 0, tiled=True)

    def there(a, fill):
        out = jnp.full((ep * t,) + a.shape[1:], fill, a.dtype)
        return ragged_all_to_all(a, out, input_offsets, send_sizes, slots, recv_sizes, axis_name=axis)

    y = expert_fn(
        there(x[token], 0), there(ids.reshape(ep * t, -1)[order], -1), there(weights.reshape(ep * t, -1)[order], 0)
    )
    # back: the rows from source s (at s*T) return to s's packed position for me
    their_offsets = jax.lax.all_to_all(input_offsets, axis, 0, 0, tiled=True)
    back = ragged_all_to_all(
        y,
        jnp.zeros((cap, h), y.dtype),
        jnp.arange(ep, dtype=jnp.int32) * t,
        recv_sizes,
        their_offsets,
        send_sizes,
        axis_name=axis,
    )
    return jnp.zeros((t, h), jnp.float32).at[token].add(back.astype(jnp.float32))  # unsent rows are zero


def default_transport() -> str:
    """ "ragged" on GPUs (a real one, or the deviceless target being compiled for: moe_jax.gpu) and
    TPUs, "all_to_all" elsewhere."""
    return "ragged" if gpu.capability() is not None or jax.default_backend() in ("gpu", "tpu") else "all_to_all"


def ep_moe(
    p: dict,
    bias: jax.Array,
    x: jax.Array,
    cfg: ModelConfig,
    mesh: Mesh,
    axis: str = "expert",
    backend: str | None = None,
    transport: str | None = None,
) -> tuple[jax.Array, Routing]:
    """(Routed-expert output [N, H], Routing) for tokens x [N, H]. Tokens are split over every axis of the mesh
    (so data axes shard them too), experts over `axis`; the exchange runs over `axis` only."""
    transport = transport or default_transport()
    if transport not in ("all_to_all", "ragged", "ragged_emulated"):
        raise ValueError(f"unknown expert-parallel transport {transport!r}")
    ep = mesh.shape[axis]
    if cfg.n_routed_experts % ep:
        raise ValueError(f"{cfg.n_routed_experts} experts do not split over {ep} ranks of axis {axis!r}")
    per_rank = cfg.n_routed_experts // ep
    dtype = x.dtype

    def local(router, bias, gate, up, down, x):  # x [T, H]; gate/up/down [E/EP, ...]
        with jax.named_scope("router"):
            r = route(x, router, bias, cfg)
        with jax.named_scope("dispatch"):
            send, ids, weights = dispatch_plan(r.experts, r.weights, ep, per_rank)
        w = {"gate": gate, "up": up, "down": down}

        def experts(rows, rows_ids, rows_weights):  # received rows [R, H], up to k local experts each
            return routed_experts(rows, rows_ids, rows_weights, w, per_rank, dtype, backend)  # float32 [R, H]

        if transport != "all_to_all":
            collective = jax.lax.ragged_all_to_all if transport == "ragged" else _ragged_emulated
            fn = lambda *received: experts(*received).astype(dtype)  # noqa: E731
            return _ragged_exchange(x, ids, weights, send, ep, axis, fn, collective).astype(dtype), r
        send_x = jnp.where(send[..., None], x[None], 0).astype(dtype)  # [EP, T, H], each row once per rank
        recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True)  # [EP (source), T, H]
        recv_ids = jax.lax.all_to_all(ids, axis, 0, 0, tiled=True)
        recv_w = jax.lax.all_to_all(weights, axis, 0, 0, tiled=True)
        t, h = x.shape
        y = experts(recv_x.reshape(ep * t, h), recv_ids.reshape(ep * t, -1), recv_w.reshape(ep * t, -1))
        back = jax.lax.all_to_all(y.reshape(ep, t, h), axis, 0, 0, tiled=True)  # [EP (expert rank), T, H]
        return back.sum(0).astype(dtype), r

    e, tokens = P(axis), P(tuple(mesh.axis_names))
    out_specs = (tokens, Routing(tokens, tokens, tokens))  # the routing stays split like the tokens
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), e, e, e, tokens), out_specs=out_specs, check_vma=False)
    ex = p["experts"]
    return fn(p["router"], bias, ex["gate"], ex["up"], ex["down"], x)
