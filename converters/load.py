"""HF tensors -> our parameter tree, driven by the mapping table.

A source is anything with `names()` and `get(name) -> np.ndarray`: a safetensors checkpoint
(`CheckpointReader`) or a torch state dict (`converters.torch_interop.StateDictSource`).
Tensors are read one at a time and written into preallocated stacked arrays.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

import numpy as np
from tqdm.auto import tqdm

from converters import fp8, int4
from converters.safetensors_io import CheckpointError
from moe_jax.config import ModelConfig
from moe_jax.params import (
    GLOBAL,
    MTP_EXTRA,
    Entry,
    decoder_rules,
    entries,
    get_path,
    leaf_dtype,
    param_shapes,
    set_path,
)

Tree = dict[str, Any]


class TensorSource(Protocol):
    def names(self) -> list[str]: ...

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str) -> np.ndarray: ...


def where(source: TensorSource, name: str) -> str:
    """`file: tensor name` for error messages."""
    located = getattr(source, "where", None)
    return located(name) if located else f"tensor {name}"


def is_int4(source: TensorSource, name: str) -> bool:
    """A compressed-tensors packed INT4 weight (a CheckpointReader lists it under its weight's name)."""
    return getattr(source, "dtypes", {}).get(name) == int4.DTYPE


def read_float(source: TensorSource, name: str) -> np.ndarray:
    """A tensor as stored, dequantized to float32 if it is DeepSeek FP8."""
    arr = source.get(name)
    if arr.dtype == fp8.FP8_DTYPE:
        return fp8.dequantize(arr, read_scale(source, name, arr.shape))[0]
    check_no_scale(source, name, arr.dtype)
    return arr


def check_no_scale(source: TensorSource, name: str, dtype) -> None:
    """Only float8 weights have block scales: a scale beside any other weight is an error."""
    scale = name + fp8.SCALE_SUFFIX
    if scale in source:
        raise CheckpointError(f"{where(source, name)} is {dtype}, not float8, yet has {scale}")


LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def expected_count(cfg: ModelConfig, mtp: bool) -> int:
    """len(entries(cfg, mtp)), computed without expanding the layers and experts."""

    def per_layer(moe: bool) -> int:
        return sum(cfg.n_routed_experts if r.per_expert else 1 for r in decoder_rules(cfg, moe))

    n_mtp = cfg.num_nextn_predict_layers if mtp else 0
    layers = cfg.num_hidden_layers + n_mtp
    dense = min(cfg.first_k_dense_replace, layers)
    decoders = dense * per_layer(False) + (layers - dense) * per_layer(True)
    return len(GLOBAL) + decoders + n_mtp * len(MTP_EXTRA)


def check_plan_size(source: TensorSource, cfg: ModelConfig, mtp: bool) -> None:
    """Refuse a config.json that asks for far more tensors than the checkpoint holds (10**9
    layers, 10**7 experts) before `entries(cfg, mtp)` expands them: call it first. Time and
    memory are linear in the names present; a few missing tensors are left to `check_names`,
    which names them (the plan it builds stays within twice the names present)."""
    weights = [n for n in source.names() if not n.endswith(fp8.SCALE_SUFFIX)]
    need = expected_count(cfg, mtp)
    if need <= len(weights):
        return
    root = getattr(source, "root", None)
    config = f"{root / 'config.json'}" if root is not None else "config.json"
    n_mtp = cfg.num_nextn_predict_layers if mtp else 0
    layers = {int(m.group(1)) for n in weights if (m := LAYER_RE.match(n))}
    if cfg.num_hidden_layers + n_mtp > len(layers):
        says = f"num_hidden_layers={cfg.num_hidden_layers}" + (f" (+{n_mtp} MTP)" if n_mtp else "")
        held = f"the checkpoint holds tensors for {len(layers)} layers"
        raise CheckpointError(f"{config}: says {says} but {held}")
    experts: dict[int, set[int]] = {}
    for n in weights:
        if m := EXPERT_RE.match(n):
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    most = max((len(e) for e in experts.values()), default=0)
    if cfg.num_moe_layers + n_mtp > 0 and cfg.n_routed_experts > most:
        held = f"the checkpoint holds tensors for at most {most} experts per layer"
        raise CheckpointError(f"{config}: says n_routed_experts={cfg.n_routed_experts} but {held}")
    if need > 2 * len(weights):
        held = f"the checkpoint holds {len(weights)}"
        raise CheckpointError(f"{config}: implies {need} tensors (besides scales) but {held}")


def check_names(source: TensorSource, cfg: ModelConfig, plan: list[Entry], mtp: bool) -> None:
    """Every expected tensor present, nothing unknown (MTP layers may be skipped on purpose),
    and every `_scale_inv` beside its weight."""
    expected = {e.hf_name for e in plan}
    names = set(source.names())
    missing = [e.hf_name for e in plan if e.hf_name not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        prefix = getattr(source, "prefix", "")
        why = ""
        if cfg.dsa and not any(".indexer." in n for n in names):
            why = (
                ": config.json says DeepSeek-V3.2 (sparse attention) but the checkpoint has no indexer (DeepSeek-V3's?)"
            )
        raise CheckpointError(f"{getattr(source, 'root', 'source')}: tensor {prefix}{missing[0]} is missing{more}{why}")
    first_mtp, end_mtp = cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    for name in sorted(names - expected):
        if name.endswith(fp8.SCALE_SUFFIX):
            base = name[: -len(fp8.SCALE_SUFFIX)]
            if base not in names:
                raise CheckpointError(f"{where(source, name)}: its weight {base} does not exist")
            if base in expected:
                continue  # scale beside a non-float8 weight: check_headers / read_checked
        m = LAYER_RE.match(name)
        if not mtp and m and first_mtp <= int(m.group(1)) < end_mtp:
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
    check_plan_size(source, cfg, mtp)
    plan = entries(cfg, mtp)
    check_names(source, cfg, plan, mtp)
    if hasattr(source, "dtypes"):
        check_headers(source, plan, cfg.int4_group_size)
    tree: Tree = {}
    for path, (shape, rule) in param_shapes(cfg, mtp).items():
        set_path(tree, path, np.empty(shape, leaf_dtype(rule, dtype)))
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
    """The entry's tensor in parameter layout and `dtype`, FP8 or INT4 dequantized, shape and
    values checked; with `with_scale`, (tensor, its FP8 block scales, INT4 group scales or None)."""
    name = entry.hf_name
    arr = None if is_int4(source, name) else source.get(name)
    shape = source.shapes[name] if arr is None else tuple(arr.shape)
    if shape != entry.hf_shape:
        raise CheckpointError(f"{where(source, name)} has shape {shape}, config.json implies {entry.hf_shape}")
    scale = None
    if is_int4(source, name):
        packed, scale = source.get(name + int4.PACKED), read_int4_scale(source, name)
        value, finite = int4.dequantize(packed, scale, entry.hf_shape, dtype)
        value = transposed(value) if entry.rule.transpose else value
    elif arr.dtype == fp8.FP8_DTYPE:
        scale = read_scale(source, name, arr.shape)
        value, finite = fp8.dequantize(arr, scale, entry.rule.transpose, dtype)
    else:
        check_no_scale(source, name, arr.dtype)
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
    """The block scales of float8 weight `name`, checked: shape, finite, not negative (zero is
    an all-zero block)."""
    scale_name = name + fp8.SCALE_SUFFIX
    if len(shape) != 2:
        raise CheckpointError(f"{where(source, name)} is float8 but not 2-D: {tuple(shape)}")
    if scale_name not in source:
        raise CheckpointError(f"{where(source, name)} is float8 but {scale_name} is missing")
    scale = source.get(scale_name)
    if scale.shape != fp8.scale_shape(shape):
        raise CheckpointError(
            f"{where(source, scale_name)} has shape {scale.shape}, expected {fp8.scale_shape(shape)} for weight {shape}"
        )
    if not all_finite(scale):
        raise CheckpointError(f"{where(source, scale_name)} contains NaN or Inf")
    if (scale < 0).any():
        raise CheckpointError(f"{where(source, scale_name)} is negative (min {scale.min()})")
    return scale


def read_int4_scale(source: TensorSource, name: str) -> np.ndarray:
    """The group scales of INT4 weight `name`, checked: finite, not negative (the symmetric
    scheme's scale is a magnitude; zero is an all-zero group)."""
    scale = source.get(name + int4.SCALE)
    if not all_finite(scale):
        raise CheckpointError(f"{where(source, name + int4.SCALE)} contains NaN or Inf")
    if (scale < 0).any():
        raise CheckpointError(f"{where(source, name + int4.SCALE)} is negative (min {scale.min()})")
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


def check_int4(reader, name: str, shape: tuple[int, ...], group: int | None) -> None:
    """A packed INT4 weight's stored tensors against its shape and config.json's group size."""
    if group is None:
        raise CheckpointError(
            f"{where(reader, name + int4.PACKED)} is packed INT4 but config.json has no compressed-tensors quantization_config"
        )
    if len(shape) != 2 or shape[1] % group:
        raise CheckpointError(
            f"{where(reader, name)} is packed INT4 of shape {list(shape)}: its inputs are not whole groups of {group}"
        )
    for part, dtypes, want in (
        (int4.PACKED, ("I32",), int4.packed_shape(shape)),
        (int4.SCALE, int4.SCALE_DTYPES, int4.scale_shape(shape, group)),
    ):
        got = (reader.dtypes[name + part], reader.shapes[name + part])
        if got[0] not in dtypes or got[1] != want:
            raise CheckpointError(
                f"{where(reader, name + part)} is {got[0]} {list(got[1])}, expected {dtypes[0]} {list(want)} "
                f"for INT4 weight {list(shape)} in groups of {group}"
            )
    check_no_scale(reader, name, "packed INT4")


def check_headers(reader, plan: list[Entry], int4_group: int | None = None) -> None:
    """Shapes and dtypes of every tensor from the file headers alone (and INT4 weights' shapes),
    before any weight is read."""
    for entry in plan:
        name = entry.hf_name
        dtype, shape = reader.dtypes[name], reader.shapes[name]
        if shape != entry.hf_shape:
            raise CheckpointError(f"{where(reader, name)} has shape {shape}, config.json implies {entry.hf_shape}")
        if dtype == int4.DTYPE:
            check_int4(reader, name, shape, int4_group)
        elif dtype == "F8_E4M3":
            scale = name + fp8.SCALE_SUFFIX
            if len(shape) != 2:
                raise CheckpointError(f"{where(reader, name)} is float8 but not 2-D: {shape}")
            if scale not in reader:
                raise CheckpointError(f"{where(reader, name)} is float8 but {scale} is missing")
            if reader.shapes[scale] != fp8.scale_shape(shape) or reader.dtypes[scale] != "F32":
                raise CheckpointError(
                    f"{where(reader, scale)} is {reader.dtypes[scale]} {reader.shapes[scale]}, "
                    f"expected F32 {fp8.scale_shape(shape)} for weight {shape}"
                )
        elif dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where(reader, name)} has dtype {dtype}, expected one of F32, BF16, F16, F8_E4M3")
        else:
            check_no_scale(reader, name, dtype)
