"""`from_pretrained`: a Hugging Face DeepSeek-V3 checkpoint directory -> `DeepseekV3`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from converters.hub import resolve_source
from converters.jax_checkpoint import Checkpoint, is_jax_checkpoint
from converters.load import load_tree
from converters.safetensors_io import CheckpointReader
from moe_jax.config import ModelConfig
from moe_jax.errors import CheckpointError
from moe_jax.model import DeepseekV3, model_from_tree
from moe_jax.params import PARAM_DTYPES, has_mtp_tensors, leaf_dtype, rule_of
from moe_jax.sharding import as_mesh, leaf_sharding


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
            return load_converted(Checkpoint(path), dtype, compute_dtype, mtp, backend, mesh)
        cfg = ModelConfig.from_json(path)
        reader = CheckpointReader(path, cfg.tensor_prefix)
        return load_hf(reader, cfg, dtype, compute_dtype, mtp, backend, mesh, progress)
    except OSError as e:
        raise CheckpointError(f"{e.filename or path}: cannot read ({e.strerror or e})") from None


def load_converted(ckpt: Checkpoint, dtype=None, compute_dtype=None, mtp=None, backend=None, mesh=None) -> DeepseekV3:
    """The model in an opened `moe-jax convert` checkpoint (see `from_pretrained`)."""
    if mtp and not ckpt.mtp:
        raise CheckpointError(f"{ckpt.path}: converted without MTP layers (mtp=True asks for them)")
    shardings = None
    if mesh is not None:
        shapes = {tuple(k.split(".")): tuple(v["shape"]) for k, v in ckpt.leaves.items()}
        shardings = lambda p: leaf_sharding(mesh, p, shapes[p])  # noqa: E731
    tree = ckpt.restore(shardings)
    if mtp is False:
        tree = without_mtp(tree)
    if dtype is not None:
        tree["params"] = _cast_params(tree["params"], dtype)
    return model_from_tree(ckpt.cfg, tree, compute_dtype, backend, mesh)  # already placed: no copy


def load_hf(
    reader: CheckpointReader,
    cfg: ModelConfig,
    dtype=None,
    compute_dtype=None,
    mtp=None,
    backend=None,
    mesh=None,
    progress: bool = False,
) -> DeepseekV3:
    """The model in an opened HF checkpoint (see `from_pretrained`)."""
    present = has_mtp_tensors(reader.names(), cfg)
    if mtp and not present:
        raise CheckpointError(f"{reader.root}: has no MTP layers (mtp=True asks for them)")
    with_mtp = present if mtp is None else mtp
    tree = load_tree(reader, cfg, dtype or "float32", mtp=with_mtp, progress=progress)
    return model_from_tree(cfg, tree, compute_dtype, backend, mesh)


def without_mtp(tree: dict) -> dict:
    """A {params, buffers} tree without its MTP layers."""
    return {k: {n: v for n, v in sub.items() if n != "mtp"} for k, sub in tree.items()}


def _cast_params(params: dict, dtype: str) -> dict:
    """Cast to `dtype`, except the leaves the parameter table keeps in float32 (the router)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: x.astype(leaf_dtype(rule_of(("params", *(k.key for k in kp))), dtype)), params
    )
