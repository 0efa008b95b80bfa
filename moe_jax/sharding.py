"""Where parameters and activations live on a device mesh.

The mesh has named axes out of MESH_AXES. Every parameter dimension has a logical name (the
parameter table's `logical_axes`, `moe_jax.params`), and RULES maps each logical name to the mesh axes it is split over. Axes the
mesh lacks, or whose size does not divide the dimension, leave that dimension replicated; XLA
inserts the collectives that the layout implies (all-gather of fsdp-split weights before use,
reduce-scatter of their gradients), and the MoE layer runs its own all_to_all over `expert`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_jax.params import logical_axes, rule_of

# expert_node: the expert axis between nodes, outside `expert` (inside a node): the MoE layer's
# exchange is then hierarchical (moe_jax.parallel.ep)
MESH_AXES = ("data", "fsdp", "expert_node", "expert", "tensor")

# logical axis -> mesh axes it is split over (in order)
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert_node", "expert"),  # tokens: every axis that does not split a weight's math
    "expert": ("expert_node", "expert"),  # routed experts
    # the hidden dimension of weights: fully sharded over every axis that does not split the weight's
    # math (the expert axes are data axes for every weight but the routed experts, split by expert)
    "embed": ("fsdp", "data", "expert_node", "expert"),
    "lora": ("fsdp", "data", "expert_node", "expert"),  # MLA's low-rank dimension (q_b_proj, kv_b_proj: no hidden one)
    "heads": ("tensor",),  # attention heads (q_b/kv_b outputs, o_proj input)
    "mlp": ("tensor",),  # dense, shared and expert FFN width
    "vocab": ("tensor",),
}


def mesh_from_spec(spec: str, devices=None) -> Mesh:
    """ "data=2,expert=4" -> a Mesh. One axis may be -1 (all remaining devices). The product must
    equal the number of devices when several processes share the run; a single process may use
    the first N of its devices."""
    devices = list(devices if devices is not None else jax.devices())
    try:
        axes = [(name.strip(), int(size)) for name, size in (part.split("=") for part in spec.split(","))]
    except ValueError:
        raise ValueError(f"bad mesh spec {spec!r} (expected e.g. 'data=2,expert=4')") from None
    names = [name for name, _ in axes]
    unknown = sorted(set(names) - set(MESH_AXES))
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"mesh {spec!r}: axes must be distinct names out of {', '.join(MESH_AXES)}")
    sizes = [size for _, size in axes]
    if any(size < 1 and size != -1 for size in sizes) or sizes.count(-1) > 1:
        raise ValueError(f"mesh {spec!r}: each axis size must be >= 1, or -1 (the rest of the devices) for one axis")
    known = math.prod(size for size in sizes if size != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"mesh {spec!r}: the {len(devices)} devices do not split into axes of {known}")
        sizes = [size if size != -1 else len(devices) // known for size in sizes]
    n = math.prod(sizes)
    if n > len(devices) or len(devices) % n:
        raise ValueError(
            f"mesh {spec!r} has {n} devices: it must cover the {len(devices)} available or a divisor of them"
        )
    if n != len(devices) and jax.process_count() > 1:
        raise ValueError(
            f"mesh {spec!r} covers {n} of {len(devices)} devices; with several processes it must cover all"
        )
    return Mesh(np.array(devices[:n]).reshape(sizes), names)


def as_mesh(mesh) -> Mesh | None:
    """A Mesh from a Mesh, a spec string, or None."""
    if mesh is not None and not isinstance(mesh, (str, Mesh)):
        raise ValueError(f"mesh: expected a jax Mesh or a spec such as 'data=2,expert=4', got {mesh!r}")
    return mesh_from_spec(mesh) if isinstance(mesh, str) else mesh


def spec_for(mesh: Mesh, names: tuple[str | None, ...], shape: tuple[int, ...]) -> PartitionSpec:
    """PartitionSpec for a value with these logical dimension names. A dimension takes its rule's
    mesh axes that no earlier dimension took, as many of them (in order) as its size divides by."""
    spec, used = [], set()
    for dim, name in zip(shape, names):
        mesh_axes = tuple(a for a in RULES.get(name, ()) if a in mesh.shape and a not in used) if name else ()
        while mesh_axes and dim % math.prod(mesh.shape[a] for a in mesh_axes):
            mesh_axes = mesh_axes[:-1]
        spec.append(mesh_axes or None)
        used.update(mesh_axes)
    return PartitionSpec(*spec)


def leaf_sharding(mesh: Mesh, path: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, spec_for(mesh, logical_axes(path, len(shape)), shape))


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Activations and token batches: the leading (batch) dimension split over the batch axes."""
    return NamedSharding(mesh, spec_for(mesh, ("batch",) + (None,) * (len(shape) - 1), shape))


def constrain_batch(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Pin an activation [B, ...] to the batch layout (inside jit); no-op without a mesh."""
    return x if mesh is None else jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.shape))


# The axes a weight is fully sharded over (FSDP) and gathered from where it is used; the routed
# experts keep their expert axes, and are gathered over `data` once a step (`for_compute`).
GATHERED = ("fsdp", "data", "expert_node", "expert")


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of a PartitionSpec entry."""
    return entry if isinstance(entry, tuple) else () if entry is None else (entry,)


def without_data(entry):
    """A PartitionSpec entry without the `data` axis."""
    return tuple(a for a in axes_of(entry) if a != "data") or None


def held_expert(mesh: Mesh, path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[bool, int | None]:
    """(held, copies_dim) for the weight at parameter `path` of `shape`: held when it is a routed
    expert's weight whose master copy a `data` axis splits, which the training step gathers over
    `data` once and holds (`for_compute`); copies_dim, when the experts are also split over
    expert axes (expert parallelism), is the expert dimension along which the step holds one copy
    per `data` replica (else None)."""
    if mesh.shape.get("data", 1) == 1:
        return False, None
    names = logical_axes(path, len(shape))
    if "expert" not in names or rule_of(path).float32:
        return False, None
    spec = spec_for(mesh, names, shape)
    if not any("data" in axes_of(entry) for entry in spec):
        return False, None
    e = names.index("expert")
    return True, (e if spec[e] is not None else None)


def gathered_for_use(tree: dict, mesh: Mesh | None, scope: tuple[str, ...], stacked: bool = True, dtype=None) -> dict:
    """Fully sharded data parallelism where weights are used: each weight of `tree` (one layer's,
    sliced out of a stack of layers when `stacked`; under the parameter path `scope`) constrained
    to its layout without the GATHERED axes (except on a routed expert's expert dimension). XLA
    then all-gathers the weight before its matmuls and reduce-scatters its gradient, and the
    activations keep their batch layout (left alone, XLA may instead re-lay a whole activation
    along the weight's split dimension). With `dtype` (the compute dtype) each weight is cast on
    its shard first (`cast_and_gather`), so the gather, the gathered copy and the gradient's
    reduction are in that dtype (the router, kept in float32, stays so); the model casts every
    other weight to it at use, so the values are the same. No-op without those axes."""
    if mesh is None or all(mesh.shape.get(a, 1) == 1 for a in GATHERED):
        return tree

    def constrain(kp, x):
        path = (*scope, *(k.key for k in kp))
        if held_expert(mesh, path, (1, *x.shape) if stacked else x.shape)[1] is not None:
            return x  # a routed expert's weights: for_compute's copies, or left to the MoE layer's shard_map
        used, kept = use_layout(mesh, path, x.shape, stacked)
        if dtype is None or rule_of(path).float32:
            return jax.lax.with_sharding_constraint(x, used)
        return cast_and_gather(x, dtype, used, kept)

    return jax.tree_util.tree_map_with_path(constrain, tree)


def use_layout(mesh: Mesh, path: tuple[str, ...], shape: tuple[int, ...], stacked: bool = False):
    """(used, kept): the layouts of the weight at parameter `path` (of `shape`; one layer of a stack
    when `stacked`) where it is used (without the GATHERED axes, but for a routed expert's expert
    dimension) and where it is kept."""
    full = (1, *shape) if stacked else shape
    names = logical_axes(path, len(full))
    spec = spec_for(mesh, names, full)

    def gathered(entry, name):
        if name == "expert":
            return entry
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a not in (None, *GATHERED))
        return axes or None

    used = [gathered(entry, name) for entry, name in zip(spec, names)]
    skip = 1 if stacked else 0
    return NamedSharding(mesh, PartitionSpec(*used[skip:])), NamedSharding(mesh, PartitionSpec(*spec[skip:]))


def cast_and_gather(x: jax.Array, dtype, used: NamedSharding, kept: NamedSharding) -> jax.Array:
    """x cast to `dtype` on its shard, then laid out as `used` (gathered). The backward mirrors it:
    the gradient, summed over every use, is reduced onto x's own layout `kept` in `dtype` (a
    reduce-scatter), then cast back. (Left to autodiff, XLA may all-reduce each use's gradient
    whole; the barrier keeps it from gathering before the cast.)"""

    @jax.custom_vjp
    def gather(x):
        return jax.lax.with_sharding_constraint(jax.lax.optimization_barrier(x.astype(dtype)), used)

    def backward(_, g):
        return (jax.lax.with_sharding_constraint(g.astype(dtype), kept).astype(x.dtype),)

    gather.defvjp(lambda x: (gather(x), None), backward)
    return gather(x)


def for_compute(params: dict, mesh: Mesh | None, dtype) -> tuple[dict, dict | None, callable]:
    """Experts stay put: (the parameters the step computes with, their layouts, and the map from
    their gradients to the parameters'). A routed expert's weights split over `data` (their
    float32 master copy and AdamW moments split over the expert's replicas: ZeRO-1) are cast to
    `dtype` and gathered over it once, before the step's micro-batches, and held: the layer loop
    never gathers them over `data`. Under expert parallelism each `data` replica computes with a
    copy of its own (the copies side by side along the expert dimension, which the MoE layer
    splits over `data` too), so each replica's gradient stays on its devices through the
    micro-batches, and the map sums the copies once, onto the master's split: one reduce-scatter
    a step, where a gradient shared by the replicas is reduced at every micro-batch. Over `fsdp` a
    weight stays fully sharded and is gathered where it is used (ZeRO-3), an expert's too; every
    other weight is left as it is."""
    if mesh is None or mesh.shape.get("data", 1) == 1:
        return params, None, lambda grads: grads
    layouts, hoisted = {}, {}
    replicas = mesh.shape["data"]

    def prepare(kp, x):
        path = ("params", *(k.key for k in kp))
        held, e = held_expert(mesh, path, x.shape)
        if not held:
            return x
        spec = spec_for(mesh, logical_axes(path, x.ndim), x.shape)
        local = PartitionSpec(*map(without_data, spec))
        w = jax.lax.optimization_barrier(x.astype(dtype))  # cast on the shard, gathered in `dtype`
        hoisted[path], layouts[path] = (NamedSharding(mesh, spec), x.dtype, e), NamedSharding(mesh, local)
        if e is None:
            return jax.lax.with_sharding_constraint(w, layouts[path])
        copies = jnp.broadcast_to(jnp.expand_dims(w, e), (*w.shape[:e], replicas, *w.shape[e:]))
        copies = copies.reshape(*w.shape[:e], replicas * w.shape[e], *w.shape[e + 1 :])
        layouts[path] = NamedSharding(mesh, PartitionSpec(*local[:e], ("data", *axes_of(local[e])), *local[e + 1 :]))
        return jax.lax.with_sharding_constraint(copies, layouts[path])

    compute = jax.tree_util.tree_map_with_path(prepare, params)
    layout_tree = jax.tree_util.tree_map_with_path(lambda kp, x: layouts.get(("params", *(k.key for k in kp))), compute)

    def reduce(grads):
        def one(kp, g):
            if (place := hoisted.get(("params", *(k.key for k in kp)))) is None:
                return g
            kept, dtype, e = place
            g = g.astype(dtype)
            if e is not None:  # the replicas' copies summed
                g = g.reshape(*g.shape[:e], replicas, g.shape[e] // replicas, *g.shape[e + 1 :]).sum(e)
            return jax.lax.with_sharding_constraint(g, kept)

        return jax.tree_util.tree_map_with_path(one, grads)

    return compute, layout_tree, reduce


def place(x, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value that every process holds in full; each device gets its
    slice (no process needs the others' devices to be addressable)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def shard_tree(tree, mesh: Mesh):
    """Place every leaf of a {params, buffers} tree (host or device arrays) onto its sharding."""

    def put(kp, x):
        sharding = leaf_sharding(mesh, tuple(k.key for k in kp), x.shape)
        return jax.device_put(x, sharding) if isinstance(x, jax.Array) else place(x, sharding)

    return jax.tree_util.tree_map_with_path(put, tree)
