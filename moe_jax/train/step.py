"""The training step as a library: the objective, the jitted step, its state and its batches.

`moe-jax train` is built on these; a custom loop uses them the same way:

    state = init_train_state(model, optimizer)
    step = make_train_step(model.config, optimizer)
    state, metrics = step(state, make_batch(tokens))  # tokens [B, S + 1]

The state is a pytree {params, buffers, opt_state, step}: Orbax saves it and optax updates it
as it is. A batch holds rows of S + 1 tokens: the model reads the first S, the targets are the
next token (and, for the MTP depths, the ones after it) within the same document.

The step's numbers (loss weights, the bias update speed, the learning-rate schedule) are inputs
of the compiled step, not constants in it: runs that differ only in them share one compilation
(and one entry of a persistent compilation cache).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from moe_jax.config import ModelConfig
from moe_jax.data import positions_from_segments
from moe_jax.model import ACCUMULATING, DeepseekV3, Sparse, forward, remat_policy, rms_norm
from moe_jax.parallel.ep import ExpertParallel
from moe_jax.sharding import batch_sharding, constrain_batch, for_compute, place
from moe_jax.train import objective as obj


def objective(
    params: dict,
    buffers: dict,
    batch: dict,
    config: ModelConfig,
    *,
    mtp_lambda: float = 0.3,
    balance_alpha: float = 1e-4,
    compute_dtype="bfloat16",
    backend: str | None = None,
    remat: str = "none",
    mesh=None,
    ep: ExpertParallel | None = None,
    denominators: dict | None = None,
    dsa_stage: str = "sparse",
    index_loss_weight: float = 1.0,
    sums: dict | None = None,
) -> tuple[jax.Array, dict]:
    """(loss, metrics) of one batch: loss = CE + mtp_lambda * MTP + balance_alpha * balance
    (DeepSeek-V3, sections 2.1.2 and 2.2). The MTP term is there when `params` hold MTP layers.
    For DeepSeek-V3.2, + index_loss_weight * the indexers' KL loss (`moe_jax.dsa`: summed over
    layers, a mean over positions), in `dsa_stage` "sparse" (top-k attention) or "warmup" (dense
    attention); its gradient reaches the indexers alone, and theirs comes from it alone.
    metrics: ce_loss, mtp_loss, balance_loss, index_loss (V3.2), expert_load [MoE layers (then MTP
    layers), E], the tokens each expert received, and ep_overflow [MoE layers]: further rounds of
    the expert-parallel exchange (moe_jax.parallel.ep). Differentiable in `params`. Jit it with
    `config` and the keyword options static: `jax.jit(objective, static_argnames=("config",
    "compute_dtype"))`.

    `denominators` (objective.loss_denominators of a larger batch this one is a micro-batch of):
    each term is then this batch's share of that batch's loss, so the micro-batches' losses and
    gradients sum to the whole batch's. `sums`: float32 sums of the layer stacks' gradients, which
    the backward adds this batch's into (`moe_jax.model.forward`; remat "full")."""
    tokens, seg = batch["tokens"], batch["segment_ids"]
    inputs = tokens[:, :-1]
    mtp = "mtp" in params and config.num_nextn_predict_layers > 0
    out = forward(
        params,
        buffers,
        inputs,
        config,
        segment_ids=seg[:, :-1],
        positions=batch["positions"],
        dtype=jnp.dtype(compute_dtype),
        mtp=mtp,
        backend=backend,
        remat=remat_policy(remat),
        mesh=mesh,
        ep=ep,
        logits=False,
        sparse=Sparse(dense=dsa_stage == "warmup", loss=config.dsa),
        sums=sums,
    )
    with jax.named_scope("loss"):
        hidden = [out.hidden_states[-1], *(out.mtp_hidden_states if mtp else ())]  # main head, then MTP depths
        norms = [params["final_norm"], *(params["mtp"]["head_norm"] if mtp else ())]
        x = jnp.stack([rms_norm(h, w, config.rms_norm_eps) for h, w in zip(hidden, norms)])
        pairs = [obj.targets_at(tokens, seg, 1 + j) for j in range(len(hidden))]
        targets, masks = (jnp.stack(a) for a in zip(*pairs))
        if denominators is None:
            denominators = obj.loss_denominators(batch, len(hidden) - 1)
        weights = masks / jnp.maximum(denominators["targets"], 1.0)[:, None, None]
        losses = obj.head_cross_entropy(x, params["lm_head"], targets, weights, mesh)  # [1 + depths]
        ce = losses[0]
        mtp_loss = losses[1:].mean() if mtp else jnp.zeros((), jnp.float32)
        balance = jnp.zeros(())
        if out.routing:
            balance = obj.balance_loss(out.routing, inputs.shape[0], config) * (inputs.shape[0] / denominators["rows"])
        total = ce + mtp_lambda * mtp_loss + balance_alpha * balance
        index_loss = jnp.zeros((), jnp.float32)
        if out.index_loss is not None:
            index_loss = out.index_loss / denominators["positions"]
            total = total + index_loss_weight * index_loss
    loads = obj.expert_loads(out.routing, config.n_routed_experts) if out.routing else jnp.zeros((0, 1))
    overflow = jnp.concatenate([r.overflow for r in out.routing]) if out.routing else jnp.zeros((0,), jnp.int32)
    metrics = dict(ce_loss=ce, mtp_loss=mtp_loss, balance_loss=balance, expert_load=loads, ep_overflow=overflow)
    return total, {**metrics, "index_loss": index_loss}


def accumulated(value_and_grad, params, batch: dict, n: int, depths: int, mesh=None, grad_shardings=None, fused=()):
    """((loss, metrics), gradients) of `batch` from `value_and_grad(params, micro_batch,
    denominators, sums)` run on n micro-batches in a loop, summed: equal to one pass over the whole
    batch (the losses are normalized by the whole batch's `loss_denominators`; expert loads and
    overflow rounds add up). Micro-batch i holds rows i, n + i, 2n + i, ..., so each device keeps
    the rows it holds. The gradients add up in float32 (as DeepSeek-V3 accumulates them), laid
    out as `grad_shardings` (those of the weights computed with) where given. The layer stacks
    named in `fused` ("dense", "moe") are summed by the backward itself: `value_and_grad` gets
    their sums so far as `sums` and returns them with this micro-batch's gradients added
    (`moe_jax.model.accumulating_scan`); the rest are added here."""
    denominators = obj.loss_denominators(batch, depths)
    micro = jax.tree.map(lambda x: jnp.moveaxis(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 1, 0), batch)

    def add(total, one):
        sums = {k: total[1][k] for k in fused} or None
        value, grads = value_and_grad(params, jax.tree.map(lambda x: constrain_batch(x, mesh), one), denominators, sums)
        unfused = lambda g: {k: v for k, v in g.items() if k not in fused}  # noqa: E731
        summed = jax.tree.map(
            lambda t, x: t + x.astype(t.dtype), (total[0], unfused(total[1])), (value, unfused(grads))
        )
        total = (summed[0], {**summed[1], **{k: grads[k] for k in fused}})  # the fused ones are sums already
        if grad_shardings is not None:
            total = (total[0], jax.lax.with_sharding_constraint(total[1], grad_shardings))
        return total, None

    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(value_and_grad, params, first, denominators)
    wider = lambda d: jnp.promote_types(d, jnp.float32) if jnp.issubdtype(d, jnp.floating) else d  # noqa: E731
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, wider(s.dtype)), shapes)
    if grad_shardings is not None:
        zeros = (zeros[0], jax.lax.with_sharding_constraint(zeros[1], grad_shardings))
    total, _ = jax.lax.scan(add, zeros, micro)
    return total


class WarmupCosine(NamedTuple):
    """The learning rate at each step: linear warmup from 0 to `peak` over `warmup` steps, then a
    cosine decay to `end` at step `total` (optax.warmup_cosine_decay_schedule(0, peak, warmup,
    total, end)). A pytree of numbers, so the step takes them as inputs."""

    peak: float
    warmup: float
    total: float
    end: float

    def __call__(self, count: jax.Array) -> jax.Array:
        count = jnp.asarray(count, jnp.float32)
        warmup = jnp.maximum(self.warmup, 1.0)
        rising = self.peak * jnp.clip(count, 0.0, self.warmup) / warmup
        decay = jnp.maximum(self.total - self.warmup, 1.0)
        t = jnp.clip(count - self.warmup, 0.0, decay) / decay
        falling = (self.peak - self.end) * 0.5 * (1 + jnp.cos(jnp.pi * t)) + self.end
        return jnp.where(count < self.warmup, rising, falling)


def as_inputs(tree) -> dict:
    """Python numbers -> float32 scalars: what the compiled step takes at every call."""
    return jax.tree.map(lambda x: np.float32(x), tree)


def make_train_step(
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    *,
    mtp_lambda: float = 0.3,
    balance_alpha: float = 1e-4,
    bias_gamma: float = 1e-3,
    compute_dtype="bfloat16",
    backend: str | None = None,
    remat: str = "none",
    mesh=None,
    ep: ExpertParallel | None = None,
    lr_schedule: WarmupCosine | None = None,
    state_shardings=None,
    grad_accum: int = 1,
    dsa_stage: str = "sparse",
    index_loss_weight: float = 1.0,
    fuse_accumulation: bool = True,
) -> TrainStep:
    """`step(state, batch) -> (state, metrics)`, jitted, the state donated. One step: gradients of
    `objective`, the optimizer's update, then the auxiliary-loss-free router bias update
    (bias_i += bias_gamma * sign(mean load - load_i), outside the gradient). A step whose loss or
    gradient norm is not finite changes nothing (metrics["finite"] says so).

    With `lr_schedule` the step multiplies the optimizer's updates by the learning rate of the
    step: give an optimizer of learning rate 1 (e.g. optax.adamw(1.0)), as `moe-jax train` does.

    With `grad_accum` = n the batch is n micro-batches, run one after another inside the step
    (`accumulated`): activations of one micro-batch at a time, one optimizer update and one bias
    update (on the summed expert loads) a step, equal to the step on the whole batch. With remat
    "full" and `fuse_accumulation` the layer loops' backward adds each layer's weight gradients
    into the float32 sums as it computes them, so no micro-batch's gradients of a layer stack
    exist whole (`moe_jax.model.accumulating_scan`).

    DeepSeek-V3.2 (`dsa_stage`, `index_loss_weight`: `objective`): in the "warmup" stage only the
    indexers train: every other weight's gradient is stopped (no backward pass through the model)
    and its update is zero, whatever the optimizer (its state for them is kept, unchanged: the
    same memory as the sparse stage).

    metrics: loss, ce_loss, balance_loss, mtp_loss (with MTP), index_loss (V3.2), grad_norm, lr (with `lr_schedule`),
    finite, expert_load [layers, E], router_bias [layers, E] (after the update), load_imbalance
    [layers] (max / mean load), ep_overflow [layers] (further expert-parallel exchange rounds). With `state_shardings` the state comes back laid out as it went
    in, so later steps reuse the first step's compilation."""
    remat_policy(remat)  # a bad name fails here, not at the first trace
    numbers = dict(
        mtp_lambda=mtp_lambda,
        balance_alpha=balance_alpha,
        bias_gamma=bias_gamma,
        lr=lr_schedule,
        index_loss_weight=index_loss_weight,
    )
    if dsa_stage not in ("warmup", "sparse"):
        raise ValueError(f"dsa_stage must be 'warmup' or 'sparse', got {dsa_stage!r}")
    if dsa_stage == "warmup" and not config.dsa:
        raise ValueError("dsa_stage='warmup' trains the indexers of DeepSeek-V3.2; this model has none")
    frozen = dsa_stage == "warmup"  # only the indexers train

    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    fuse_accumulation = fuse_accumulation and remat_policy(remat) in ACCUMULATING and not frozen

    def step(state, batch, numbers):
        params, buffers = state["params"], state["buffers"]

        def value_and_grad(params, batch, denominators=None, sums=None):
            loss_fn = lambda p, sums: objective(  # noqa: E731
                only_indexers(p) if frozen else p, buffers, batch, config, mtp_lambda=numbers["mtp_lambda"],
                balance_alpha=numbers["balance_alpha"], compute_dtype=compute_dtype, backend=backend, remat=remat,
                mesh=mesh, ep=ep, denominators=denominators, dsa_stage=dsa_stage,
                index_loss_weight=numbers["index_loss_weight"], sums=sums,
            )  # fmt: skip
            if sums is None:
                return jax.value_and_grad(lambda p: loss_fn(p, None), has_aux=True)(params)
            # the layer stacks' gradients come as the new sums; the stacks themselves take none
            stacks, rest = {k: params[k] for k in sums}, {k: v for k, v in params.items() if k not in sums}
            value, (grads, sums) = jax.value_and_grad(
                lambda rest, sums: loss_fn({**rest, **stacks}, sums), argnums=(0, 1), has_aux=True
            )(rest, sums)
            return value, {**grads, **sums}

        compute, layouts, reduce = for_compute(params, mesh, jnp.dtype(compute_dtype))
        if grad_accum == 1:
            (loss, aux), grads = value_and_grad(compute, batch)
        else:
            rows = batch["tokens"].shape[0]
            if rows % grad_accum:
                raise ValueError(f"a batch of {rows} rows does not split into {grad_accum} micro-batches")
            depths = config.num_nextn_predict_layers if "mtp" in params else 0
            if state_shardings is not None and layouts is not None:  # the gradients as the computed weights lie
                layouts = jax.tree.map(
                    lambda used, kept: kept if used is None else used,
                    layouts,
                    state_shardings["params"],
                    is_leaf=lambda x: x is None,
                )
            else:
                layouts = None
            fused = tuple(k for k in ("dense", "moe") if k in params) if fuse_accumulation else ()
            (loss, aux), grads = accumulated(value_and_grad, compute, batch, grad_accum, depths, mesh, layouts, fused)
        grads = reduce(grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        if frozen:
            updates = jax.tree_util.tree_map_with_path(
                lambda kp, u: u if is_indexer(kp) else jnp.zeros_like(u), updates
            )
        if numbers["lr"] is not None:
            lr = numbers["lr"](state["step"])
            updates = jax.tree.map(lambda u: (lr * u).astype(u.dtype), updates)
        new = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "buffers": obj.update_router_bias(buffers, aux["expert_load"], numbers["bias_gamma"]),
        }
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        old = {k: state[k] for k in new}
        new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # a bad step changes nothing
        new["step"] = state["step"] + 1
        metrics = dict(
            loss=loss,
            ce_loss=aux["ce_loss"],
            balance_loss=aux["balance_loss"],
            grad_norm=grad_norm,
            finite=finite,
            expert_load=aux["expert_load"],
            router_bias=router_biases(new["buffers"]),
            load_imbalance=obj.imbalance(aux["expert_load"]),
            ep_overflow=aux["ep_overflow"],
        )
        if numbers["lr"] is not None:
            metrics["lr"] = lr
        if "mtp" in params and config.num_nextn_predict_layers > 0:
            metrics["mtp_loss"] = aux["mtp_loss"]
        if config.dsa:
            metrics["index_loss"] = aux["index_loss"]
        return new, metrics

    jitted = jax.jit(step, donate_argnums=0, out_shardings=(state_shardings, None))
    return TrainStep(jitted, as_inputs(numbers), replicated(mesh))


def is_indexer(key_path) -> bool:
    """Whether a parameter (by its key path in the tree) belongs to a DeepSeek-V3.2 indexer."""
    return any(getattr(k, "key", None) == "indexer" for k in key_path)


def only_indexers(params: dict) -> dict:
    """The parameters with every gradient but the indexers' stopped (DeepSeek-V3.2's warm-up stage)."""
    return jax.tree_util.tree_map_with_path(lambda kp, x: x if is_indexer(kp) else jax.lax.stop_gradient(x), params)


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """The jitted step and the numbers it takes at every call (float32 scalars, replicated)."""

    jitted: jax.stages.Wrapped
    numbers: dict
    numbers_sharding: jax.sharding.Sharding

    @functools.cached_property
    def _numbers_on_device(self) -> dict:
        return jax.device_put(self.numbers, self.numbers_sharding)

    def __call__(self, state: dict, batch: dict) -> tuple[dict, dict]:
        return self.jitted(state, batch, self._numbers_on_device)

    def lower(self, state, batch) -> jax.stages.Lowered:
        """Lowered for `state` and `batch`, arrays or jax.ShapeDtypeStructs (a deviceless mesh too)."""
        numbers = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((), x.dtype, sharding=self.numbers_sharding), self.numbers
        )
        return self.jitted.lower(state, batch, numbers)


def replicated(mesh=None):
    """The sharding of a value every device holds whole: the mesh's, or the first device's."""
    return SingleDeviceSharding(jax.devices()[0]) if mesh is None else NamedSharding(mesh, PartitionSpec())


def router_biases(buffers: dict) -> jax.Array:
    """The router correction biases [layers, E], in expert_load's row order (MoE stack, then MTP)."""
    rows = []
    if "moe" in buffers:
        rows.append(buffers["moe"]["router_bias"])
    if "router_bias" in buffers.get("mtp", {}).get("layer", {}):
        rows.append(buffers["mtp"]["layer"]["router_bias"])
    return jnp.concatenate(rows) if rows else jnp.zeros((0, 1), jnp.float32)


def optimizer_shardings(optimizer: optax.GradientTransformation, params, mesh=None):
    """The optimizer state's layout: each per-parameter leaf (Adam's moments) sharded as its
    parameter, the rest (step counts) replicated. (Left to XLA, `jit(optimizer.init)` replicates
    the moments: they are zeros, computed from no input.) `params`: arrays or ShapeDtypeStructs."""
    return optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        jax.eval_shape(optimizer.init, params),
        jax.tree.map(lambda p: p.sharding, params),
        transform_non_params=lambda _: replicated(mesh),
    )


def init_train_state(model: DeepseekV3 | dict, optimizer: optax.GradientTransformation, mesh=None) -> dict:
    """{params, buffers, opt_state, step} from a model (or a {params, buffers} tree), every leaf
    committed to its device(s): the parameters' own shardings, the optimizer's moments those of
    their parameters, the rest replicated."""
    tree = {"params": model.params, "buffers": model.buffers} if isinstance(model, DeepseekV3) else model
    state = {"params": tree["params"], "buffers": tree.get("buffers", {})}
    state = jax.tree.map(lambda x: x if getattr(x, "committed", False) else jax.device_put(x, replicated(mesh)), state)
    init = jax.jit(optimizer.init, out_shardings=optimizer_shardings(optimizer, state["params"], mesh))
    state["opt_state"] = init(state["params"])
    state["step"] = jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh))
    return state


def make_batch(tokens, segment_ids=None, mesh=None) -> dict:
    """A training batch from rows of S + 1 tokens [B, S + 1] (numpy or lists) and, for packed rows,
    their document ids (> 0; 0 marks padding; default: one document a row). With `mesh` the rows
    are split over its batch axes (every process passing the same global batch)."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [batch, seq_len + 1] with seq_len >= 1, got shape {tokens.shape}")
    seg = np.ones_like(tokens) if segment_ids is None else np.asarray(segment_ids, np.int32)
    if seg.shape != tokens.shape:
        raise ValueError(f"segment_ids shape {seg.shape} differs from tokens shape {tokens.shape}")
    batch = {"tokens": tokens, "segment_ids": seg, "positions": positions_from_segments(seg[:, :-1])}
    if mesh is None:
        return {k: jnp.asarray(v) for k, v in batch.items()}
    return {k: place(v, batch_sharding(mesh, v.shape)) for k, v in batch.items()}
