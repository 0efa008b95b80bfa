"""Where parameters live on a device mesh.

Logical axes per parameter come from its path; RULES maps logical axes to mesh axes. Axes the
mesh lacks, or that do not divide the dimension, stay replicated.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# logical axis -> mesh axes it may be sharded over (in order)
RULES: dict[str, tuple[str, ...]] = {
    "expert": ("expert",),
}


def mesh_from_spec(spec: str, devices=None) -> Mesh:
    """"data=2,expert=4" -> a Mesh over the first 8 devices (the product must divide them)."""
    import numpy as np

    devices = list(devices if devices is not None else jax.devices())
    try:
        axes = [(name.strip(), int(size)) for name, size in (part.split("=") for part in spec.split(","))]
    except ValueError:
        raise ValueError(f"bad mesh spec {spec!r} (expected e.g. 'data=2,expert=4')") from None
    n = int(np.prod([size for _, size in axes]))
    if n > len(devices) or len(devices) % n:
        raise ValueError(f"mesh {spec!r} needs {n} devices; {len(devices)} available")
    return Mesh(np.array(devices[:n]).reshape([size for _, size in axes]), [name for name, _ in axes])


def logical_axes(path: tuple[str, ...], ndim: int) -> tuple[str | None, ...]:
    """Logical name of each dimension of the leaf at `path` (None: not sharded)."""
    axes: list[str | None] = [None] * ndim
    if "experts" in path:
        axes[-3] = "expert"  # [L, E, in, out]
    return tuple(axes)


def leaf_sharding(mesh: Mesh, path: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
    spec = []
    for dim, name in zip(shape, logical_axes(path, len(shape))):
        mesh_axes = tuple(a for a in RULES.get(name, ()) if a in mesh.shape) if name else ()
        size = 1
        for a in mesh_axes:
            size *= mesh.shape[a]
        spec.append(mesh_axes if mesh_axes and dim % size == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*spec))


def shard_tree(tree, mesh: Mesh):
    """device_put every leaf of a {params, buffers} tree onto its sharding."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: jax.device_put(x, leaf_sharding(mesh, tuple(k.key for k in kp), x.shape)), tree
    )
