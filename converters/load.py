"""HF tensors -> our parameter tree, driven by the mapping table.

A source is anything with `names()` and `get(name) -> np.ndarray`: a safetensors checkpoint
(`CheckpointReader`) or a torch state dict (`converters.torch_interop.StateDictSource`).
Tensors are read one at a time and written into preallocated stacked arrays.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from converters import fp8
from converters.mapping import Entry, entries, param_shapes
from converters.safetensors_io import CheckpointError
from moe_jax.config import ModelConfig

Tree = dict[str, Any]


class TensorSource(Protocol):
    def names(self) -> list[str]: ...

    def get(self, name: str) -> np.ndarray: ...


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def where(source: TensorSource, name: str) -> str:
    """`file: tensor name` for error messages."""
    file_of = getattr(source, "file_of", None)
    return f"{file_of(name)}: tensor {name}" if file_of else f"tensor {name}"


def read_float(source: TensorSource, name: str) -> np.ndarray:
    """A tensor as stored, dequantized to float32 if it is DeepSeek FP8."""
    arr = source.get(name)
    if arr.dtype == fp8.FP8_DTYPE:
        scale_name = name + fp8.SCALE_SUFFIX
        if scale_name not in source.names():
            raise CheckpointError(f"{where(source, name)} is float8 but {scale_name} is missing")
        scale = source.get(scale_name)
        if arr.ndim != 2 or scale.shape != fp8.scale_shape(arr.shape):
            raise CheckpointError(
                f"{where(source, scale_name)} has shape {scale.shape}, "
                f"expected {fp8.scale_shape(arr.shape)} for weight {arr.shape}"
            )
        return fp8.dequantize(arr, scale)
    return arr


def set_path(tree: Tree, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_path(tree: Tree, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def source_has_mtp(source: TensorSource, cfg: ModelConfig) -> bool:
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    return cfg.num_nextn_predict_layers > 0 and any(n.startswith(prefix) for n in source.names())


def check_names(source: TensorSource, cfg: ModelConfig, plan: list[Entry], mtp: bool) -> None:
    """Every expected tensor present, nothing unknown (MTP layers may be skipped on purpose)."""
    expected = {e.hf_name for e in plan}
    names = set(source.names())
    missing = [e.hf_name for e in plan if e.hf_name not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{getattr(source, 'root', 'source')}: tensor {missing[0]} is missing{more}")
    layer_re = re.compile(r"model\.layers\.(\d+)\.")
    for name in sorted(names - expected):
        if name.endswith(fp8.SCALE_SUFFIX) and name[: -len(fp8.SCALE_SUFFIX)] in expected:
            continue
        m = layer_re.match(name)
        if not mtp and m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # MTP tensors, not loaded
        raise CheckpointError(f"{where(source, name)} is not part of a DeepSeek-V3 model with this config.json")


def load_tree(
    source: TensorSource,
    cfg: ModelConfig,
    dtype: str = "float32",
    mtp: bool = True,
    progress: bool = False,
) -> Tree:
    """{"params": ..., "buffers": ...} as numpy arrays, from the tensors of `source`."""
    plan = entries(cfg, mtp)
    check_names(source, cfg, plan, mtp)
    tree: Tree = {}
    for path, (shape, rule) in param_shapes(cfg, mtp).items():
        set_path(tree, path, np.empty(shape, np.float32 if rule.float32 else np_dtype(dtype)))
    # Tied copies (the MTP layer's embedding and head) are checked once their originals are in.
    plan = sorted(plan, key=lambda e: e.rule.tied_to is not None)
    for entry in tqdm(plan, desc="loading", unit="tensor", disable=not progress):
        value = read_checked(source, entry)
        dest = get_path(tree, entry.path)
        if entry.rule.tied_to:
            if not np.array_equal(dest, value.astype(dest.dtype)):
                raise CheckpointError(
                    f"{where(source, entry.hf_name)} differs from {'/'.join(entry.path[1:])}, which it must copy"
                )
            continue
        dest[entry.index] = value
    return tree


def read_checked(source: TensorSource, entry: Entry) -> np.ndarray:
    """The entry's tensor as float, in parameter layout, with its shape and values checked."""
    arr = read_float(source, entry.hf_name)
    if tuple(arr.shape) != entry.hf_shape:
        raise CheckpointError(
            f"{where(source, entry.hf_name)} has shape {tuple(arr.shape)}, config.json implies {entry.hf_shape}"
        )
    if not np.isfinite(arr).all():
        raise CheckpointError(f"{where(source, entry.hf_name)} contains NaN or Inf")
    return arr.T if entry.rule.transpose else arr
