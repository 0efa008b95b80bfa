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

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> np.ndarray: ...


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def where(source: TensorSource, name: str) -> str:
    """`file: tensor name` for error messages."""
    file_of = getattr(source, "file_of", None)
    return f"{file_of(name)}: tensor {name}" if file_of else f"tensor {name}"


def read_float(source: TensorSource, name: str) -> np.ndarray:
    """A tensor as stored, dequantized to float32 (numpy) if it is DeepSeek FP8."""
    arr = source.get(name)
    if arr.dtype == fp8.FP8_DTYPE:
        return fp8.dequantize(arr, read_scale(source, name, arr.shape))
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
    if hasattr(source, "dtypes"):
        check_headers(source, plan)
    tree: Tree = {}
    for path, (shape, rule) in param_shapes(cfg, mtp).items():
        set_path(tree, path, np.empty(shape, np.float32 if rule.float32 else np_dtype(dtype)))
    # Tied copies (the MTP layer's embedding and head) are checked once their originals are in.
    plan = sorted(plan, key=lambda e: e.rule.tied_to is not None)
    for entry in tqdm(plan, desc="loading", unit="tensor", disable=not progress):
        dest = get_path(tree, entry.path)
        value = read_checked(source, entry, dest.dtype)
        if entry.rule.tied_to:
            if not np.array_equal(dest, value.astype(dest.dtype)):
                raise CheckpointError(
                    f"{where(source, entry.hf_name)} differs from {'/'.join(entry.path[1:])}, which it must copy"
                )
            continue
        dest[entry.index] = value
    return tree


def read_checked(source: TensorSource, entry: Entry, dtype=np.float32, with_scale: bool = False):
    """The entry's tensor in parameter layout and `dtype`, FP8 dequantized, shape and values
    checked; with `with_scale`, (tensor, its FP8 block scales or None)."""
    name = entry.hf_name
    arr = source.get(name)
    if tuple(arr.shape) != entry.hf_shape:
        raise CheckpointError(f"{where(source, name)} has shape {tuple(arr.shape)}, config.json implies {entry.hf_shape}")
    scale = None
    if arr.dtype == fp8.FP8_DTYPE:
        scale = read_scale(source, name, arr.shape)
        value, finite = fp8.dequantize_table(arr, scale, entry.rule.transpose, dtype)
    else:
        finite = all_finite(arr)
        arr = arr.astype(dtype, copy=False)
        value = transposed(arr) if entry.rule.transpose else np.ascontiguousarray(arr)
    if not finite:
        raise CheckpointError(f"{where(source, name)} contains NaN or Inf")
    return (value, scale) if with_scale else value


def transposed(a: np.ndarray, rows: int = 256) -> np.ndarray:
    """np.ascontiguousarray(a.T) of a 2-D array, in row tiles and on the unsigned-integer view
    (ml_dtypes' bfloat16 has no fast copy loop): the same bytes, about twice as fast."""
    uint = fp8.UINT_OF_SIZE.get(a.dtype.itemsize)
    if a.ndim != 2 or uint is None:
        return np.ascontiguousarray(a.T)
    src = a.view(uint)
    out = np.empty(a.shape[::-1], uint)
    for i in range(0, a.shape[0], rows):
        out[:, i : i + rows] = src[i : i + rows].T
    return out.view(a.dtype)



def read_scale(source: TensorSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    scale_name = name + fp8.SCALE_SUFFIX
    if scale_name not in source:
        raise CheckpointError(f"{where(source, name)} is float8 but {scale_name} is missing")
    scale = source.get(scale_name)
    if scale.shape != fp8.scale_shape(shape):
        raise CheckpointError(
            f"{where(source, scale_name)} has shape {scale.shape}, expected {fp8.scale_shape(shape)} for weight {shape}"
        )
    if not all_finite(scale):
        raise CheckpointError(f"{where(source, scale_name)} contains NaN or Inf")
    return scale


# Exponent bits of each float type: all set means Inf or NaN. Testing them on the integer view is
# several times faster than np.isfinite on bf16 (an ml_dtypes ufunc) and needs no float temporaries.
_EXPONENT_MASK = {2: (np.uint16, {"bfloat16": 0x7F80, "float16": 0x7C00}), 4: (np.uint32, {"float32": 0x7F800000})}


def all_finite(arr: np.ndarray, rows: int = 4096) -> bool:
    """np.isfinite(arr).all(), in row blocks, without a full-size temporary."""
    if arr.size == 0:
        return True
    flat = arr.reshape(arr.shape[0], -1) if arr.ndim > 1 else arr.reshape(1, -1)
    int_type, masks = _EXPONENT_MASK.get(arr.dtype.itemsize, (None, {}))
    mask = masks.get(arr.dtype.name)
    if mask is None:
        return all(np.isfinite(flat[i : i + rows]).all() for i in range(0, flat.shape[0], rows))
    bits = flat.view(int_type)
    return all(((bits[i : i + rows] & mask) != mask).all() for i in range(0, flat.shape[0], rows))


FLOAT_DTYPES = {"F32", "BF16", "F16"}


def check_headers(reader, plan: list[Entry]) -> None:
    """Shapes and dtypes of every tensor from the file headers alone, before any data is read."""
    for entry in plan:
        name = entry.hf_name
        dtype, shape = reader.dtypes[name], reader.shapes[name]
        if shape != entry.hf_shape:
            raise CheckpointError(f"{where(reader, name)} has shape {shape}, config.json implies {entry.hf_shape}")
        if dtype == "F8_E4M3":
            scale = name + fp8.SCALE_SUFFIX
            if scale not in reader:
                raise CheckpointError(f"{where(reader, name)} is float8 but {scale} is missing")
            if reader.shapes[scale] != fp8.scale_shape(shape) or reader.dtypes[scale] != "F32":
                raise CheckpointError(
                    f"{where(reader, scale)} is {reader.dtypes[scale]} {reader.shapes[scale]}, "
                    f"expected F32 {fp8.scale_shape(shape)} for weight {shape}"
                )
        elif dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where(reader, name)} has dtype {dtype}, expected one of F32, BF16, F16, F8_E4M3")
