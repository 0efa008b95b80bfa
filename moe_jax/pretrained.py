"""`from_pretrained`: a Hugging Face DeepSeek-V3 checkpoint directory -> `DeepseekV3`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from converters.load import load_tree, source_has_mtp
from converters.safetensors_io import CheckpointReader
from moe_jax.errors import CheckpointError
from moe_jax.config import ModelConfig
from moe_jax.model import DeepseekV3
from moe_jax.sharding import as_mesh


def model_from_tree(cfg: ModelConfig, tree: dict, compute_dtype=None, backend: str | None = None, mesh=None) -> DeepseekV3:
    """A model from host (numpy) or device arrays; placed onto `mesh` when given."""
    tree = {"params": tree["params"], "buffers": tree.get("buffers", {})}
    if mesh is not None:
        from moe_jax.sharding import shard_tree

        tree = shard_tree(tree, mesh)
    else:
        tree = jax.tree.map(jnp.asarray, tree)
    dtype = compute_dtype or tree["params"]["embed"].dtype
    return DeepseekV3(cfg, tree["params"], tree["buffers"], dtype=jnp.dtype(dtype), backend=backend, mesh=mesh)


PARAM_DTYPES = ("float32", "bfloat16", "float16")


def from_pretrained(
    path: str | os.PathLike,
    dtype: str | None = None,
    compute_dtype: str | None = None,
    mtp: bool | None = None,
    backend: str | None = None,
    mesh=None,
    progress: bool = False,
) -> DeepseekV3:
    """Load a DeepSeek-V3 checkpoint: an HF directory or hub repo id (single file or sharded;
    BF16, FP32 or FP8 blocks; read one tensor at a time) or a `moe-jax convert` output (each
    host reading, and checking against its integrity records, only the chunks its devices hold
    when `mesh` is given).

    `dtype` is the parameter dtype (default: float32 for HF, as stored for converted; the
    router stays float32, as in transformers), `compute_dtype` the activation dtype (default:
    `dtype`). MTP layers load when present (`mtp=None`), or as forced.

    Raises `moe_jax.CheckpointError` (a ValueError; `ConfigError` and `IntegrityError` are
    subclasses) for any bad input, with a one-line message naming the file and the tensor,
    parameter or config key.
    """
    from converters.hub import resolve_source
    from converters.jax_checkpoint import Checkpoint, is_jax_checkpoint

    for name, value in (("dtype", dtype), ("compute_dtype", compute_dtype)):
        try:
            known = value is None or jnp.dtype(value).name in PARAM_DTYPES  # names and dtype objects
        except TypeError:
            known = False
        if not known:
            raise CheckpointError(f"{name}={value!r} is not supported (have: {', '.join(PARAM_DTYPES)})")
    mesh = as_mesh(mesh)
    path = resolve_source(path)
    try:
        if is_jax_checkpoint(path):
            ckpt = Checkpoint(path)
            if mtp and not ckpt.mtp:
                raise CheckpointError(f"{path}: converted without MTP layers (mtp=True asks for them)")
            shardings = None
            if mesh is not None:
                from moe_jax.sharding import leaf_sharding

                shapes = {tuple(k.split(".")): tuple(v["shape"]) for k, v in ckpt.leaves.items()}
                shardings = lambda p: leaf_sharding(mesh, p, shapes[p])  # noqa: E731
            tree = ckpt.restore(shardings)
            if mtp is False:
                tree = {k: {n: v for n, v in sub.items() if n != "mtp"} for k, sub in tree.items()}
            if dtype is not None:
                tree["params"] = _cast_params(tree["params"], dtype)
            return model_from_tree(ckpt.cfg, tree, compute_dtype, backend, mesh)  # already placed: no copy
        cfg = ModelConfig.from_json(path)
        reader = CheckpointReader(path)
        with_mtp = source_has_mtp(reader, cfg) if mtp is None else mtp
        tree = load_tree(reader, cfg, dtype or "float32", mtp=with_mtp, progress=progress)
        return model_from_tree(cfg, tree, compute_dtype, backend, mesh)
    except OSError as e:
        raise CheckpointError(f"{e.filename or path}: cannot read ({e.strerror or e})") from None


def _cast_params(params: dict, dtype: str) -> dict:
    """Cast to `dtype`, except the leaves the mapping keeps in float32 (the router)."""
    from converters.load import np_dtype

    target = np_dtype(dtype)
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: x if kp[-1].key == "router" else x.astype(target), params
    )


def init_tree(cfg: ModelConfig, seed: int = 0, dtype: str = "float32", mtp: bool = True) -> dict:
    """Random weights for every parameter of the mapping table (normal(0, initializer_range),
    norms one, router biases zero), as numpy arrays: for training from scratch and tests."""
    import numpy as np

    from converters.load import np_dtype, set_path
    from converters.mapping import param_shapes

    rng = np.random.default_rng(seed)
    tree: dict = {}
    for path, (shape, rule) in param_shapes(cfg, mtp).items():
        if rule.init == "ones":
            value = np.ones(shape, np.float32)
        elif rule.init == "zeros":
            value = np.zeros(shape, np.float32)
        else:
            value = cfg.initializer_range * rng.standard_normal(shape, np.float32)
        set_path(tree, path, value.astype(np.float32 if rule.float32 else np_dtype(dtype)))
    return tree
