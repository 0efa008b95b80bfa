"""Expert parallelism: dropless, deduplicated dispatch and combine in `jax.shard_map`, in bounded
buffers.

Routed experts are split over the mesh's expert axes (`expert`, and `expert_node` outside it for
the hierarchical exchange) and tokens over every axis. Each rank routes its own tokens, then sends
every token ONCE to each rank that holds any of its top-k experts, with that rank's local expert
ids and routing weights; the receiver runs its experts (the single-device dispatch, grouped GEMM
and combine, `moe_jax.moe.routed_experts`, over its E/EP experts), reduces the weighted outputs
per row and sends one row back; the source sums what comes back.

**Bounded, still dropless** (transports "ragged" and "ragged_emulated"). Per round of the
exchange a rank receives at most `budget` units: (row, local expert) pairs where the experts run
(the grouped GEMM's input), rows where the next stage is another exchange; budget = capacity x
the load a rank gets when routing is balanced (`ExpertParallel.capacity`, `stages`). What does
not fit is never dropped: it goes in further rounds of the same exchange. Every round, each
receiver's budget is handed to the sources in rank order and each sender's to the destinations
in rank order (`allocate`), from counts all ranks exchanged, so every rank knows the rounds
without a host sync. The first round is unrolled and differentiated as usual; the further rounds
(none in the common case) run in a while loop whose trip count the counts decide, under a custom
VJP that replays them in the backward (recomputing their experts). `Routing.overflow` counts them.

**Hierarchical** (a mesh with `expert_node` and `expert`): a token crosses `expert_node` (between
nodes: the network) once for each node that holds any of its experts, to the rank with its own
position there, which fans it out over `expert` (inside the node: NVLink) to the ranks holding
them; the combine comes back the same way. Both stages are the same bounded exchange: the outer
stage's "experts" are the inner exchange. DeepSeek-V3's group-limited routing (n_group 8,
topk_group 4) bounds a token to 4 nodes when its 8 expert groups lie on 8 nodes.

**FP8 dispatch** (`ExpertParallel.dispatch="float8"`): dispatched rows travel as e4m3 with one
power-of-two (E8M0) scale per block of 128 (of 32 under Transformer Engine MXFP8: MXFP8's own
layout, so the grouped GEMM's quantization gives back the same values). Power-of-two scales make
quantizing a dequantized row exact, so the inner stage re-sends the same bytes: rows are rounded
once. The combine travels in the compute dtype, and so does every gradient unless
`ExpertParallel.gradient_dispatch="float8"`: then the combined rows' gradients, which the backward
sends to the experts (the gradient before the down projection), travel as e4m3 with the same
blocks, as DeepSeek-V3 trained; the gradient of the dispatched rows comes back in the compute dtype.

**Kept for the backward**: what the outer stage's first round receives (rows or their e4m3 values
and scales, ids, weights) is named `DISPATCHED`, so that remat "save_dispatch" (moe_jax.model)
keeps it from the forward and the backward's recomputation does not send it over the network again.

Transports (`ExpertParallel.transport`; default: "ragged" on GPU/TPU, "all_to_all" elsewhere):
- "ragged": `jax.lax.ragged_all_to_all`, bounded rounds as above.
- "ragged_emulated": the same algorithm with the collective emulated by all_gather, so rounds,
  offsets and packing are tested on CPU (tests/test_ep.py); for tests only.
- "all_to_all": a fixed [EP, T, H] `all_to_all` over all expert axes (flat). With deduplication a
  rank receives at most T rows from each source, so the fixed buffer is dropless by construction;
  it moves EP*T rows per rank whatever the routing, and its expert input can reach EP*T*min(k, E/EP)
  rows. It is what XLA:CPU supports ("HLO opcode ragged-all-to-all is not supported by XLA:CPU",
  jax 0.10.2). It moves rows in the compute dtype: FP8 dispatch options are refused with it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from moe_jax import gpu
from moe_jax.config import ModelConfig
from moe_jax.moe import Routing, route, routed_experts
from moe_jax.quant import mxfp8

EXPERT_AXES = ("expert_node", "expert")  # outer (between nodes), inner (inside a node)
TRANSPORTS = ("ragged", "ragged_emulated", "all_to_all")
DISPATCH_DTYPES = ("bfloat16", "float8")  # bfloat16: the compute dtype


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How the MoE layer runs when its experts are split over the mesh (`model.ep_*` in a run config)."""

    capacity: float = 1.25  # receive buffers per round, over the balanced load (scripts/bench_ep.py)
    dispatch: str = "bfloat16"  # payload of dispatched rows: the compute dtype, or "float8"
    gradient_dispatch: str = "bfloat16"  # payload of the combined rows' gradients sent to the experts
    transport: str | None = None  # TRANSPORTS (None: default_transport())
    chunk: int | None = (
        None  # tokens a device runs through the layer at a time (None: all): bounds its buffers at long context
    )

    def __post_init__(self):
        if not 0 < self.capacity < math.inf:
            raise ValueError(f"expert-parallel capacity must be a finite number > 0, got {self.capacity}")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"expert-parallel chunk must be >= 1 tokens, got {self.chunk}")
        for name, payload in (("dispatch", self.dispatch), ("gradient dispatch", self.gradient_dispatch)):
            if payload not in DISPATCH_DTYPES:
                raise ValueError(f"expert-parallel {name} {payload!r}: one of {', '.join(DISPATCH_DTYPES)}")
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise ValueError(f"unknown expert-parallel transport {self.transport!r}: one of {', '.join(TRANSPORTS)}")


def check_transport(options: ExpertParallel) -> str:
    """The transport `options` runs with here; ValueError if it cannot move what they ask for."""
    transport = options.transport or default_transport()
    if transport == "all_to_all" and "float8" in (options.dispatch, options.gradient_dispatch):
        raise ValueError(
            "FP8 dispatch (model.ep_dispatch / model.ep_gradient_dispatch: float8) needs the ragged exchange, the "
            "default on GPUs and TPUs; the exchange here is the fixed all_to_all, which moves rows in the compute dtype"
        )
    return transport


def default_transport() -> str:
    """ "ragged" on GPUs (a real one, or the deviceless target being compiled for: moe_jax.gpu) and
    TPUs, "all_to_all" elsewhere."""
    return "ragged" if gpu.capability() is not None or jax.default_backend() in ("gpu", "tpu") else "all_to_all"


def expert_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's expert axes larger than one, outer first."""
    return tuple(a for a in EXPERT_AXES if mesh.shape.get(a, 1) > 1)


def exchange_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes the MoE layer exchanges over: the expert axes larger than one, else an expert
    axis of size one (one rank: the exchange still runs, with itself)."""
    axes = expert_axes(mesh) or tuple(a for a in EXPERT_AXES if a in mesh.shape)[-1:]
    if not axes:
        raise ValueError(f"mesh {dict(mesh.shape)} has no expert axis ({' or '.join(EXPERT_AXES)})")
    return axes


# ---- what balanced routing sends ----------------------------------------------------------------
def ranks_per_token(cfg: ModelConfig, ranks: int) -> float:
    """Expected distinct ranks a token reaches when E experts lie in order on `ranks` ranks and
    routing is balanced: its top-k uniform over all experts or, with group-limited routing, over
    the experts of `topk_group` groups chosen uniformly, each chosen group used (DeepSeek's rule
    picks groups by their best experts' scores, so a chosen group holds at least one of the
    token's experts). The analytic row count of a deduplicated dispatch (one row per token and rank)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    per_rank = e // ranks
    groups, kept = cfg.n_group, cfg.topk_group
    per_group = e // max(groups, 1)
    aligned = per_rank % per_group == 0 or per_group % per_rank == 0
    if not (1 < groups and kept < groups and aligned):
        return ranks * (1 - math.comb(e - per_rank, k) / math.comb(e, k))
    if per_rank >= per_group:  # whole groups on a rank: reached when any of them is chosen
        held = per_rank // per_group
        return ranks * (1 - math.comb(groups - held, kept) / math.comb(groups, kept))

    def every_group_used(sizes: list[int]) -> int:  # ways to pick k of these experts, none of the groups empty
        return sum(
            (-1) ** len(empty) * math.comb(sum(sizes) - sum(sizes[i] for i in empty), k)
            for n in range(len(sizes) + 1)
            for empty in itertools.combinations(range(len(sizes)), n)
        )

    missed = every_group_used([per_group - per_rank] + [per_group] * (kept - 1)) / every_group_used([per_group] * kept)
    return ranks * kept / groups * (1 - missed)  # its group chosen, then one of its experts


def max_ranks_per_token(cfg: ModelConfig, ranks: int) -> int:
    """The most ranks (of `ranks` holding the experts in order) one token can reach: k, or fewer
    under group-limited routing, where a token's experts lie in `topk_group` groups."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    per_rank, per_group = e // ranks, e // max(cfg.n_group, 1)
    bound = min(k, ranks)
    if 1 < cfg.n_group and cfg.topk_group < cfg.n_group:
        if per_rank % per_group == 0:
            bound = min(bound, cfg.topk_group)
        elif per_group % per_rank == 0:
            bound = min(bound, cfg.topk_group * (per_group // per_rank))
    return bound


def rows_per_stage(cfg: ModelConfig, mesh: Mesh, domain: int) -> list[dict[str, float]]:
    """Expected rows one token's dispatch sends to other devices in each stage of the exchange
    (outer first) when routing is balanced, over the network (between NVLink domains of `domain`
    consecutive devices) and over NVLink; its combine sends as many back. The flat exchange sends
    one row to each peer of its expert axis that holds any of the token's experts; the
    hierarchical one, one to each `expert_node` peer reached, then from there one to each `expert`
    peer reached. From device 0's view of the mesh."""
    axes = expert_axes(mesh)
    out = []
    origin = {name: 0 for name in mesh.axis_names}
    for i, axis in enumerate(axes):
        size = mesh.shape[axis]
        ids = [mesh.devices[tuple({**origin, axis: j}[a] for a in mesh.axis_names)].id for j in range(size)]
        remote = sum(j // domain != ids[0] // domain for j in ids)
        # this stage's rows: one per rank reached of the experts' split by the axes so far, except
        # the one that is the sender itself
        per_peer = ranks_per_token(cfg, math.prod(mesh.shape[a] for a in axes[: i + 1])) / size
        out.append({"network": per_peer * remote, "nvlink": per_peer * (size - 1 - remote)})
    return out


def rows_per_token(cfg: ModelConfig, mesh: Mesh, domain: int) -> dict[str, float]:
    """`rows_per_stage` summed over the stages."""
    stages_ = rows_per_stage(cfg, mesh, domain)
    return {way: sum(s[way] for s in stages_) for way in ("network", "nvlink")}


def exchange_bytes_per_row(
    cfg: ModelConfig, options: ExpertParallel, backend: str | None, dtype_bytes: int, dispatches: int = 1
) -> float:
    """Bytes one dispatched row moves per training step, both ways, counted from what the code
    sends: forward the row (compute dtype, or e4m3 plus one E8M0 scale per block) with its k local
    ids and weights (4 + 4 bytes each), `dispatches` times (twice where the backward recomputes
    the layer, remat, and does not keep what arrived), and the combined row back once (a
    recomputation does not need it); backward the row's gradient back (compute dtype), the
    combined row's gradient forward (compute dtype, or e4m3 and scales) and the weights' gradient."""
    h, k = cfg.hidden_size, cfg.num_experts_per_tok

    def payload(kind: str) -> int:
        block = fp8_block(kind, backend)
        return h * dtype_bytes if block is None else h + math.ceil(h / block)

    dispatch = payload(options.dispatch) + k * 8
    backward = h * dtype_bytes + payload(options.gradient_dispatch) + k * 4
    return dispatch * dispatches + h * dtype_bytes + backward


class Stage(NamedTuple):
    """One exchange over one mesh axis."""

    axis: str
    ranks: int
    per_rank: int  # experts each rank holds, of the experts this stage addresses
    pairs: bool  # budgets count (row, local expert) pairs (the experts run here), else rows
    budget: int  # units a rank receives per round
    fanout: int  # the most ranks of this stage one row can reach


def stages(cfg: ModelConfig, mesh: Mesh, tokens: int, capacity: float) -> tuple[Stage, ...]:
    """The exchange's stages for `tokens` tokens a rank: one over the expert axis (flat), or over
    `expert_node` then `expert` (hierarchical). Budgets: capacity x the balanced load a rank
    receives, tokens x k pairs where the experts run, tokens x ranks_per_token rows otherwise."""
    axes = exchange_axes(mesh)
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    out, experts, split = [], e, 1
    for i, axis in enumerate(axes):
        ranks, last = mesh.shape[axis], i == len(axes) - 1
        split *= ranks  # the experts' split by the axes so far
        load = tokens * (k if last else ranks_per_token(cfg, split))
        fanout = min(ranks, max_ranks_per_token(cfg, split))
        row_cost = min(k, experts // ranks) if last else 1  # a round always has room for one row
        everything = math.prod(mesh.shape[a] for a in axes) * tokens * k  # every pair of every rank to one
        budget = max(min(math.ceil(capacity * load), everything), row_cost)  # room for more is no use
        out.append(Stage(axis, ranks, experts // ranks, last, budget, fanout))
        experts //= ranks
    return tuple(out)


# ---- one round's schedule (integers only) -------------------------------------------------------
def allocate(remaining: jax.Array, recv_budget: int, send_budget: int) -> jax.Array:
    """remaining [S, D]: units source s still has for destination d -> units allowed this round:
    each receiver's budget handed to the sources in order, then each sender's to the destinations
    in order. Every rank computes the same table from the same counts."""
    before = jnp.cumsum(remaining, 0) - remaining
    allowed = jnp.clip(recv_budget - before, 0, remaining)
    before = jnp.cumsum(allowed, 1) - allowed
    return jnp.clip(send_budget - before, 0, allowed)


class Plan(NamedTuple):
    """A stage's integer plan for my rows (fixed for all rounds)."""

    ids: jax.Array  # [N, k] ids into the stage's experts (-1: none)
    local_ids: jax.Array  # [D, N, k] ids on each destination (-1: not there)
    cost: jax.Array  # [D, N] units the row costs at each destination (0: not sent there)
    ends: jax.Array  # [D, N] cumulative cost through each row
    total: jax.Array  # [D] units for each destination


class Round(NamedTuple):
    """Who sends what where in one round (the operands of ragged_all_to_all, both ways)."""

    order: jax.Array  # [send rows] indices into [D * N] (destination-major), the sent ones first
    valid: jax.Array  # [send rows] bool
    send_sizes: jax.Array  # [D] rows I send to each destination
    input_offsets: jax.Array  # [D] where they start in my packed rows
    output_offsets: jax.Array  # [D] where they land on each destination
    recv_sizes: jax.Array  # [D] rows I receive from each source
    recv_offsets: jax.Array  # [D] where they land in my receive buffer
    return_offsets: jax.Array  # [D] where each source's rows return to (its packed positions)


def on_ranks(ids: jax.Array, weights: jax.Array, stage: Stage):
    """ids, weights [N, k] -> per destination rank: local ids [D, N, k] (-1: not there), local
    weights [D, N, k] (0: not there)."""
    dest = jnp.where(ids >= 0, ids // stage.per_rank, -1)
    on = dest[None] == jnp.arange(stage.ranks)[:, None, None]
    return jnp.where(on, ids % stage.per_rank, -1), jnp.where(on, weights[None], 0.0)


def make_plan(ids: jax.Array, stage: Stage) -> Plan:
    local_ids, _ = on_ranks(ids, jnp.zeros(ids.shape), stage)
    on = local_ids >= 0
    cost = (on.sum(-1) if stage.pairs else on.any(-1)).astype(jnp.int32)  # [D, N]
    ends = jnp.cumsum(cost, 1)
    return Plan(ids, local_ids, cost, ends, ends[:, -1])


def schedule(plan: Plan, remaining: jax.Array, stage: Stage, send_rows: int) -> tuple[Round, jax.Array]:
    """The next round for my rows, and what remains after it ([D] units)."""
    table = jax.lax.all_gather(remaining, stage.axis)  # [S, D]
    allowed = allocate(table, stage.budget, send_rows)[jax.lax.axis_index(stage.axis)]  # [D]
    done = plan.total - remaining
    chosen = (plan.cost > 0) & (plan.ends > done[:, None]) & (plan.ends <= (done + allowed)[:, None])  # [D, N]
    sent = jnp.max(jnp.where(chosen, plan.ends, done[:, None]), axis=1) - done
    send_sizes = chosen.sum(1).astype(jnp.int32)
    order = jnp.argsort(~chosen.reshape(-1), stable=True)[:send_rows].astype(jnp.int32)
    order = jnp.pad(order, (0, send_rows - order.shape[0]))  # room for more rows than there are: invalid
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    recv_sizes = jax.lax.all_to_all(send_sizes, stage.axis, 0, 0, tiled=True)
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    rnd = Round(
        order,
        jnp.arange(send_rows) < send_sizes.sum(),
        send_sizes,
        input_offsets,
        jax.lax.all_to_all(recv_offsets, stage.axis, 0, 0, tiled=True),
        recv_sizes,
        recv_offsets,
        jax.lax.all_to_all(input_offsets, stage.axis, 0, 0, tiled=True),
    )
    return rnd, remaining - sent


# ---- moving rows ---------------------------------------------------------------------------------
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


@dataclasses.dataclass(frozen=True)
class Mover:
    """Packed rows to the receivers' buffers (`send`) and back (`back`), over one stage's axis."""

    axis: str
    recv_rows: int
    collective: Callable
    fp8_block: int | None = None  # FP8 payload for `send_x`: e4m3 with one E8M0 scale per block
    grad_fp8_block: int | None = None  # the same for the gradient `back_y` receives

    def send(self, a, rnd: Round, fill=0):
        out = jnp.full((self.recv_rows,) + a.shape[1:], fill, a.dtype)
        args = (rnd.input_offsets, rnd.send_sizes, rnd.output_offsets, rnd.recv_sizes)
        return self.collective(a, out, *args, axis_name=self.axis)

    def back(self, a, rnd: Round, rows: int):
        out = jnp.zeros((rows,) + a.shape[1:], a.dtype)
        args = (rnd.recv_offsets, rnd.recv_sizes, rnd.return_offsets, rnd.send_sizes)
        return self.collective(a, out, *args, axis_name=self.axis)

    def send_fp8(self, a, rnd: Round, block: int):
        """`send` with the rows quantized before the wire (e4m3, one E8M0 scale per block) and
        dequantized after it, in a's dtype."""
        q, scales = mxfp8.quantize(a, block=block)
        return mxfp8.dequantize(self.send(q, rnd), self.send(scales, rnd), dtype=a.dtype, block=block)

    def send_x(self, x, rnd: Round, name: str | None = None):
        """Hidden rows; with an FP8 payload quantized before and dequantized after the wire, their
        gradient coming back in x's dtype. With `name`, what arrives (the rows, or their e4m3
        values and scales) is named for a remat policy (`jax.ad_checkpoint.checkpoint_name`)."""
        if self.fp8_block is None:
            return named(self.send(x, rnd), name)
        q, scales = mxfp8.quantize(jax.lax.stop_gradient(x), block=self.fp8_block)
        q, scales = named(self.send(q, rnd), name), named(self.send(scales, rnd), name)
        received = mxfp8.dequantize(q, scales, dtype=x.dtype, block=self.fp8_block)

        @jax.custom_vjp
        def move(x, received, rnd):  # `received`, with x's gradient the receivers' sent back
            return received

        def fwd(x, received, rnd):
            return received, (rnd, x.shape[0])

        def bwd(res, g):
            rnd, rows = res
            return self.back(g, rnd, rows), None, None

        move.defvjp(fwd, bwd)
        return move(x, received, rnd)

    def back_y(self, y, rnd: Round, rows: int):
        """Combined rows back to their sources (`back`); with an FP8 gradient payload their
        gradient travels to the experts quantized (its transpose, `send`, moves e4m3 and scales)
        and arrives dequantized in y's dtype."""
        if self.grad_fp8_block is None:
            return self.back(y, rnd, rows)

        @jax.custom_vjp
        def move(y, rnd):
            return self.back(y, rnd, rows)

        def fwd(y, rnd):
            return move(y, rnd), rnd

        def bwd(rnd, g):
            return self.send_fp8(g, rnd, self.grad_fp8_block), None

        move.defvjp(fwd, bwd)
        return move(y, rnd)


# ---- the exchange --------------------------------------------------------------------------------
DISPATCHED = "dispatched_rows"  # what the outer stage's dispatch received (remat "save_dispatch" keeps it)


def named(a: jax.Array, name: str | None) -> jax.Array:
    return a if name is None else checkpoint_name(a, name)


# (params, rows [R, H], local ids [R, k], weights [R, k], at most `pairs` ids not -1) -> (float32 [R, H], extra rounds)
Experts = Callable


def exchange(
    params, x, ids, weights, stages_: tuple[Stage, ...], experts: Experts, ctx: "Context", acc=jnp.float32, outer=True
):
    """Rows x [N, H] with expert ids [N, k] (into the experts `stages_` address; -1: none) and
    their weights -> ([N, H] in `acc`: the weighted sum of their experts' outputs, extra rounds
    taken here and in inner stages). An inner stage sums in the compute dtype, the dtype its
    sums go back in; the outer one in float32. What the outer stage's first round receives is
    named `DISPATCHED`."""
    stage, inner = stages_[0], stages_[1:]
    if inner:
        experts_here = lambda p, xr, ir, wr, pairs: exchange(p, xr, ir, wr, inner, experts, ctx, xr.dtype, False)  # noqa: E731
    else:
        experts_here = experts
    n, k = ids.shape
    send_rows = max(min(stage.budget, n * stage.fanout), min(k, stage.per_rank))  # room for one row's units
    recv_rows = min(stage.budget, stage.ranks * send_rows)
    mover = Mover(stage.axis, recv_rows, ctx.collective, ctx.fp8_block, ctx.grad_fp8_block)
    dtype = x.dtype

    def one_round(params, x, weights, plan: Plan, rnd: Round, name=None):
        _, local_weights = on_ranks(plan.ids, weights, stage)
        token = rnd.order % n
        rows_ids = jnp.where(rnd.valid[:, None], plan.local_ids.reshape(stage.ranks * n, k)[rnd.order], -1)
        xr = mover.send_x(x[token], rnd, name)
        ir = named(mover.send(rows_ids, rnd, fill=-1), name)
        wr = named(mover.send(local_weights.reshape(stage.ranks * n, k)[rnd.order], rnd), name)
        yr, extra = experts_here(params, xr, ir, wr, stage.budget)
        back = mover.back_y(yr.astype(dtype), rnd, send_rows)
        y = jnp.zeros((n, x.shape[1]), acc).at[token].add(jnp.where(rnd.valid[:, None], back, 0).astype(acc))
        return y, extra

    plan = make_plan(ids, stage)
    rnd, remaining = schedule(plan, plan.total, stage, send_rows)
    y, extra = one_round(params, x, weights, plan, rnd, DISPATCHED if outer else None)
    more = _further_rounds(one_round, lambda plan, rem: schedule(plan, rem, stage, send_rows), ctx.sync_axes, acc)
    y_more, extra_more = more(params, x, weights, plan, remaining)
    return y + y_more, extra + extra_more


def _further_rounds(one_round, next_round, sync_axes, acc):
    """Rounds 2, 3, ... while any rank has rows left (none in the common case): a while loop whose
    trip count comes from the exchanged counts, the same on every rank of `sync_axes`, under a
    custom VJP that replays the rounds in the backward."""

    def more(remaining):
        return jax.lax.pmax(jnp.any(remaining > 0).astype(jnp.int32), sync_axes) > 0

    @jax.custom_vjp
    def run(params, x, weights, plan, remaining):
        def body(carry):
            remaining, y, extra = carry
            rnd, remaining = next_round(plan, remaining)
            y_round, extra_round = one_round(params, x, weights, plan, rnd)
            return remaining, y + y_round, extra + 1 + extra_round

        init = (remaining, jnp.zeros(x.shape, acc), jnp.zeros((), jnp.int32))
        with jax.named_scope("ep_further_rounds"):
            _, y, extra = jax.lax.while_loop(lambda c: more(c[0]), body, init)
        return y, extra

    def fwd(params, x, weights, plan, remaining):
        return run(params, x, weights, plan, remaining), (params, x, weights, plan, remaining)

    def bwd(res, cotangents):
        params, x, weights, plan, remaining = res
        g = cotangents[0]

        def body(carry):
            remaining, grads = carry
            rnd, remaining = next_round(plan, remaining)
            _, vjp = jax.vjp(lambda p, x, w: one_round(p, x, w, plan, rnd)[0], params, x, weights)
            return remaining, jax.tree.map(jnp.add, grads, vjp(g))

        zeros = jax.tree.map(jnp.zeros_like, (params, x, weights))
        with jax.named_scope("ep_further_rounds"):
            _, grads = jax.lax.while_loop(lambda c: more(c[0]), body, (remaining, zeros))
        return (*grads, None, None)

    run.defvjp(fwd, bwd)
    return run


class Context(NamedTuple):
    collective: Callable  # ragged_all_to_all or its emulation
    fp8_block: int | None  # dispatched rows' FP8 block (None: the compute dtype)
    grad_fp8_block: int | None  # the combined rows' gradients' (None: the compute dtype)
    sync_axes: tuple[str, ...]  # every expert axis: all ranks agree on every loop's trip count


def fp8_block(payload: str, backend: str | None) -> int | None:
    """An FP8 payload's block (None: `payload` is not FP8): MXFP8's 32 under TE MXFP8, else
    DeepSeek's 128."""
    if payload != "float8":
        return None
    return mxfp8.BLOCK if backend is not None and "mxfp8" in backend else 128


# ---- the MoE layer -------------------------------------------------------------------------------
def dispatch_plan(experts: jax.Array, weights: jax.Array, ep: int, experts_per_rank: int):
    """Per destination rank: which tokens go there (once each), with local ids and weights.

    experts, weights: [T, k]. Returns (send [EP, T] bool, local_ids [EP, T, k] (-1: not on that
    rank), local_weights [EP, T, k] (0 where not on that rank))."""
    local_ids, local_weights = on_ranks(experts, weights, Stage("", ep, experts_per_rank, True, 0, ep))
    return (local_ids >= 0).any(-1), local_ids, local_weights


def ep_moe(
    p: dict,
    bias: jax.Array,
    x: jax.Array,
    cfg: ModelConfig,
    mesh: Mesh,
    backend: str | None = None,
    options: ExpertParallel | None = None,
) -> tuple[jax.Array, Routing]:
    """(Routed-expert output [N, H], Routing) for tokens x [N, H]. Tokens are split over every
    axis of the mesh (so data axes shard them too), experts over its expert axes; the exchange
    runs over the expert axes only. Routing.overflow: the further rounds this layer took."""
    options = options or ExpertParallel()
    transport = check_transport(options)
    axes = exchange_axes(mesh)
    ep = math.prod(mesh.shape[a] for a in axes)
    if cfg.n_routed_experts % ep:
        raise ValueError(f"{cfg.n_routed_experts} experts do not split over {ep} ranks of axes {axes}")
    per_rank = cfg.n_routed_experts // ep
    dtype = x.dtype
    everything = tuple(mesh.axis_names)

    def run_experts(w, rows, rows_ids, rows_weights, pairs=None):  # received rows [R, H], up to k local experts each
        y = routed_experts(rows, rows_ids, rows_weights, w, per_rank, dtype, backend, pairs)
        return y, jnp.zeros((), jnp.int32)

    def local(router, bias, gate, up, down, x):  # x [T, H]; gate/up/down [E/EP, ...]
        t, h = x.shape
        if options.chunk is None or t <= options.chunk:
            y, r, extra = one_chunk(router, bias, gate, up, down, x)
        else:  # chunk by chunk (each recomputed in the backward): buffers for a chunk's tokens
            if t % options.chunk:
                raise ValueError(f"model.ep_chunk={options.chunk} does not divide a device's {t} tokens")
            chunks = x.reshape(t // options.chunk, options.chunk, h)
            run = jax.checkpoint(lambda xc: one_chunk(router, bias, gate, up, down, xc))
            ys, rs, extras = jax.lax.map(run, chunks)
            y, extra = ys.reshape(t, h), extras.sum()
            r = Routing(*(f.reshape(t, *f.shape[2:]) for f in rs[:3]), rs.overflow)
        overflow = jax.lax.pmax(extra, everything)  # the same figure on every device
        return y.astype(dtype), r._replace(overflow=overflow)

    def one_chunk(router, bias, gate, up, down, x):  # x [T, H] -> (y, routing, further rounds)
        with jax.named_scope("router"):
            r = route(x, router, bias, cfg)
        w = {"gate": gate, "up": up, "down": down}
        t, h = x.shape
        with jax.named_scope("expert_exchange"):
            if transport == "all_to_all":
                send, ids, weights = dispatch_plan(r.experts, r.weights, ep, per_rank)
                send_x = jnp.where(send[..., None], x[None], 0).astype(dtype)  # [EP, T, H], each row once per rank
                recv_x, recv_ids, recv_w = (
                    jax.lax.all_to_all(a, axes, 0, 0, tiled=True) for a in (send_x, ids, weights)
                )
                y, _ = run_experts(
                    w, recv_x.reshape(ep * t, h), recv_ids.reshape(ep * t, -1), recv_w.reshape(ep * t, -1)
                )
                y = jax.lax.all_to_all(y.astype(dtype).reshape(ep, t, h), axes, 0, 0, tiled=True).sum(0)  # [T, H]
                extra = jnp.zeros((), jnp.int32)
            else:
                collective = jax.lax.ragged_all_to_all if transport == "ragged" else _ragged_emulated
                blocks = (fp8_block(options.dispatch, backend), fp8_block(options.gradient_dispatch, backend))
                ctx = Context(collective, *blocks, axes)
                y, extra = exchange(
                    w, x, r.experts, r.weights, stages(cfg, mesh, t, options.capacity), run_experts, ctx
                )
        return y, r, extra

    # the experts as the step computes with them: with a data axis, one copy per data replica side
    # by side (moe_jax.sharding.for_compute), so that dimension splits over data too
    replicated = p["experts"]["gate"].shape[0] // cfg.n_routed_experts > 1
    e, tokens = P(("data", *axes) if replicated else axes), P(everything)
    out_specs = (tokens, Routing(tokens, tokens, tokens, P()))  # the routing stays split like the tokens
    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), e, e, e, tokens), out_specs=out_specs, check_vma=False)
    # in the compute dtype before the exchange: what XLA gathers (fsdp) and every round reads
    ex = {k: w.astype(dtype) for k, w in p["experts"].items()}
    return fn(p["router"], bias, ex["gate"], ex["up"], ex["down"], x)
