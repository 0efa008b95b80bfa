"""`from_pretrained`: a Hugging Face DeepSeek-V3 checkpoint directory -> `DeepseekV3`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from converters.load import load_tree, source_has_mtp
from converters.safetensors_io import CheckpointReader
from moe_jax.config import ModelConfig
from moe_jax.model import DeepseekV3


def model_from_tree(cfg: ModelConfig, tree: dict, compute_dtype=None, backend: str = "ragged_dot") -> DeepseekV3:
    params = jax.tree.map(jnp.asarray, tree["params"])
    buffers = jax.tree.map(jnp.asarray, tree.get("buffers", {}))
    dtype = compute_dtype or params["embed"].dtype
    return DeepseekV3(cfg, params, buffers, dtype=jnp.dtype(dtype), backend=backend)


def from_pretrained(
    path: str | os.PathLike,
    dtype: str = "float32",
    compute_dtype: str | None = None,
    mtp: bool | None = None,
    backend: str = "ragged_dot",
    progress: bool = False,
) -> DeepseekV3:
    """Load an HF DeepSeek-V3 checkpoint (single file or sharded; BF16, FP32 or FP8 blocks).

    `dtype` is the parameter dtype (the router stays float32, as in transformers), and
    `compute_dtype` the activation dtype (default: `dtype`). MTP layers load when the
    checkpoint has them (`mtp=None`), or as forced. Tensors are read one at a time.
    """
    cfg = ModelConfig.from_json(path)
    reader = CheckpointReader(path)
    try:
        with_mtp = source_has_mtp(reader, cfg) if mtp is None else mtp
        tree = load_tree(reader, cfg, dtype, mtp=with_mtp, progress=progress)
    finally:
        reader.close()
    return model_from_tree(cfg, tree, compute_dtype, backend)


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
