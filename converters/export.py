"""`moe-jax export`: our JAX checkpoint -> HF safetensors shards, streaming.

The mapping table runs backwards: every HF tensor is read from its chunk, transposed back,
cast (or re-quantized to DeepSeek FP8) and appended to its shard file, whose header was laid
out in advance from the known names, dtypes and shapes. Memory holds a few tensors, not a shard.

FP8: a weight whose values still lie on its original e4m3 grid (it was not trained, or training
left it there) is written with its original scale and recovers its original e4m3 bytes
exactly; a 128x128 block that moved gets a fresh scale, amax / 448, as DeepSeek computes it.

`export_hf` runs in three steps: plan (`plan_export`: dtypes and shard layout), execute
(`write_shards`), record (`write_hf_files`: index, config.json, tokenizer files).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm.auto import tqdm

from converters import fp8, int4
from converters.jax_checkpoint import MANIFEST, SIDE_FILES, Checkpoint, leaf_name, scale_path
from converters.load import all_finite
from converters.safetensors_io import (
    INDEX_NAME,
    NP_TO_ST,
    SINGLE_NAME,
    ST_INTS,
    ST_TO_NP,
    CheckpointError,
    CheckpointReader,
    ShardWriter,
    is_hf_checkpoint,
    st_nbytes,
)
from moe_jax.files import atomic_write, commit, discard, prepare_destination
from moe_jax.params import Entry, entries

EXPORT_DTYPES = ("source", "bfloat16", "float32", "fp8")


def parse_size(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
    }
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    unit = s[len(num) :]
    value = float(num) * units[unit] if unit in units and num else math.nan  # float() raises on junk
    if not math.isfinite(value):
        raise ValueError(f"bad size {text!r} (e.g. 5GB, 500MB)")
    return int(value)


def _out_dtype(entry: Entry, source_dtype: str, dtype: str) -> str:
    """safetensors dtype of the exported tensor, or int4.DTYPE for packed INT4 (the correction
    bias stays F32 but for `source`)."""
    if dtype == "source":
        return source_dtype
    if entry.rule.buffer:
        return "F32"
    if dtype == "fp8":
        return "F8_E4M3" if entry.rule.fp8 else "BF16"
    return NP_TO_ST[dtype]


# ---- plan --------------------------------------------------------------------------------------
Spec = tuple[str, str, tuple[int, ...]]  # (stored name, safetensors dtype, shape) of one output tensor


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """Every tensor to write, its dtype and shape, and the shard it goes to."""

    plan: list[Entry]
    specs: dict[str, list[Spec]]  # HF name -> the tensor(s) it is stored as (FP8 scales, INT4 parts)
    shards: list[list[Spec]]  # tensors of each shard, in writing order (extras last)
    names: list[str]  # file name of each shard
    extras: CheckpointReader | None  # tensors besides the model, written as they came

    @property
    def total(self) -> int:
        return sum(st_nbytes(s[1], s[2]) for shard in self.shards for s in shard)

    def writes(self, st_dtype: str) -> bool:
        """Whether any weight goes out as `st_dtype` (I32: packed INT4)."""
        return any(specs[0][1] == st_dtype for specs in self.specs.values())


def int4_specs(ckpt: Checkpoint, e: Entry, name: str) -> list[Spec]:
    """The three stored tensors of an INT4 weight: scales in the source's dtype (bf16 when the
    checkpoint no longer has them), its shape in the dtype the source stored it in."""
    group = ckpt.cfg.int4_group_size
    if group is None or e.hf_shape[1] % group:
        raise CheckpointError(
            f"{ckpt.path}: tensor {e.hf_name} came in as INT4 but config.json gives no group size for it"
        )
    scales = leaf_name(scale_path(e, int4=True))
    scale_dtype = NP_TO_ST[ckpt.leaves[scales]["dtype"]] if scales in ckpt.leaves else "BF16"
    shape_dtype = ckpt.tensors[e.hf_name].get("shape_dtype", "I32")
    if shape_dtype not in int4.SHAPE_DTYPES:
        raise CheckpointError(
            f"{ckpt.path / MANIFEST}: tensor {e.hf_name}: shape_dtype {shape_dtype!r} is not one of "
            f"{', '.join(int4.SHAPE_DTYPES)}; the manifest is damaged"
        )
    return [
        (name + int4.PACKED, "I32", int4.packed_shape(e.hf_shape)),
        (name + int4.SCALE, scale_dtype, int4.scale_shape(e.hf_shape, group)),
        (name + int4.SHAPE, shape_dtype, (2,)),
    ]


def plan_export(ckpt: Checkpoint, dtype: str, shard_size: int) -> ExportPlan:
    """Check the manifest covers every tensor, pick each tensor's dtype and lay out the shards:
    tensors in mapping order (then the extras), a new shard when the next would overflow."""
    plan = entries(ckpt.cfg, ckpt.mtp)
    records = ckpt.tensors
    missing = [e.hf_name for e in plan if e.hf_name not in records]
    if missing:
        raise CheckpointError(f"{ckpt.path / MANIFEST}: tensor {missing[0]} has no record; the manifest is damaged")
    prefix = ckpt.cfg.tensor_prefix
    specs: dict[str, list[Spec]] = {}
    for e in plan:
        st, name = _out_dtype(e, records[e.hf_name]["source_dtype"], dtype), prefix + e.hf_name
        if st == int4.DTYPE:
            specs[e.hf_name] = int4_specs(ckpt, e, name)
        elif st == "F8_E4M3":
            specs[e.hf_name] = [(name, st, e.hf_shape), (name + fp8.SCALE_SUFFIX, "F32", fp8.scale_shape(e.hf_shape))]
        elif st in ST_TO_NP:
            specs[e.hf_name] = [(name, st, e.hf_shape)]
        else:
            raise CheckpointError(
                f"{ckpt.path / MANIFEST}: tensor {e.hf_name} came in as {st}, which export cannot write"
            )
    extras = ckpt.extra_tensors()
    extra_specs = [(n, d, s) for n, (_, d, s) in extras.extras.items()] if extras else []
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in [spec for e in plan for spec in specs[e.hf_name]] + extra_specs:
        nbytes = st_nbytes(spec[1], spec[2])
        if shards[-1] and size + nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return ExportPlan(plan, specs, shards, names, extras)


# ---- execute -----------------------------------------------------------------------------------
def hf_tensors(ckpt: Checkpoint, e: Entry, specs: list[Spec]) -> list[tuple[str, np.ndarray]]:
    """One entry's HF tensor(s) read from its chunk: transposed back, cast, or re-quantized to
    FP8 or INT4 (with the source's scales where its values still lie on their grid)."""
    if e.rule.tied_to:  # the MTP layer's copies of the embedding and head
        value = ckpt.read(("params", e.rule.tied_to))
    else:
        value = ckpt.read(e.path, e.index)
    if e.rule.transpose:
        value = value.T
    (name, st, _), *parts = specs
    packed_int4 = name.endswith(int4.PACKED)
    if st != "F8_E4M3" and not packed_int4:
        out = value.astype(ST_TO_NP[st])
        if not all_finite(out):  # the checkpoint's values are finite: these overflowed the cast
            raise CheckpointError(
                f"{ckpt.path}: tensor {e.hf_name} has values beyond {st}'s range (largest |value| "
                f"{float(np.abs(value).max()):.4g}); export it in a wider dtype (--dtype float32)"
            )
        return [(name, out)]
    scales = scale_path(e, int4=packed_int4)
    hint = ckpt.read(scales, e.index) if leaf_name(scales) in ckpt.leaves else None  # a tied copy: the main's
    if not packed_int4:
        q, scale = fp8.requantize(value, hint, ckpt.cfg.fp8_scale_fmt)
        return [(name, q), (parts[0][0], scale)]
    (scale_name, scale_st, scale_shape), (shape_name, shape_st, _) = parts
    group, scale_dtype = e.hf_shape[1] // scale_shape[1], ST_TO_NP[scale_st]
    if hint is None:
        packed, scale = int4.quantize(value, group, scale_dtype)
    else:
        packed, scale = int4.requantize(value, hint.astype(scale_dtype), group)
    return [(name, packed), (scale_name, scale), (shape_name, np.array(e.hf_shape, ST_INTS[shape_st]))]


def write_shards(ckpt: Checkpoint, layout: ExportPlan, work: Path, workers: int, progress: bool) -> None:
    """Stream every tensor into its shard (a few computed ahead), with a progress bar that an
    error erases, so that the error line alone stays on the terminal."""
    bar = tqdm(total=layout.total, unit="B", unit_scale=True, unit_divisor=1024, desc="export", disable=not progress)
    try:
        shard_of = {spec[0]: i for i, sh in enumerate(layout.shards) for spec in sh}
        writers = [ShardWriter(work / name, sh, {"format": "pt"}) for name, sh in zip(layout.names, layout.shards)]

        def tensors(e: Entry) -> list[tuple[str, np.ndarray]]:
            return hf_tensors(ckpt, e, layout.specs[e.hf_name])

        with cf.ThreadPoolExecutor(max_workers=workers) as pool:
            for pairs in _ordered(pool, tensors, layout.plan, workers):
                for name, value in pairs:
                    writers[shard_of[name]].write(name, value)
                    bar.update(value.nbytes)
        for name in layout.extras.extras if layout.extras else ():
            data = layout.extras.extra_bytes(name)
            writers[shard_of[name]].write(name, data)
            bar.update(len(data))
        bar.close()
        for w in writers:
            w.close()
    except BaseException:
        bar.leave = False
        bar.close()
        raise


# ---- record ------------------------------------------------------------------------------------
def write_hf_files(ckpt: Checkpoint, layout: ExportPlan, work: Path, dtype: str) -> None:
    """The index (when sharded), config.json (with DeepSeek's FP8 quantization_config exactly
    when FP8 tensors were written, the source's own when INT4 ones were, else none) and the
    tokenizer and generation files, each checked first."""
    if len(layout.shards) > 1:
        weight_map = {spec[0]: layout.names[i] for i, shard in enumerate(layout.shards) for spec in shard}
        index = {"metadata": {"total_size": layout.total}, "weight_map": weight_map}
        atomic_write(work / INDEX_NAME, json.dumps(index, indent=2))
    cfg = ckpt.cfg
    if layout.writes("I32"):  # INT4, as the source had it (export writes INT4 only for --dtype source)
        config = cfg.to_hf_dict()
    elif layout.writes("F8_E4M3"):
        config = cfg.with_quantization(fp8.quant_config(cfg.fp8_scale_fmt))
    else:
        config = cfg.with_quantization(None)
    atomic_write(work / "config.json", json.dumps(config, indent=2))
    for f in ckpt.side_files():
        ckpt.check_files([f"{SIDE_FILES}/{f.name}"])
        shutil.copyfile(f, work / f.name)


# ---- the command -------------------------------------------------------------------------------
def export_hf(
    src: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str = "source",
    shard_size: int = 5 * 10**9,
    force: bool = False,
    workers: int = 4,
    progress: bool = True,
) -> Path:
    """Write an HF checkpoint from our JAX checkpoint `src`. `dtype`: source (each tensor as it
    came in, FP8 included), bfloat16, float32 or fp8 (DeepSeek's layout)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"unknown export dtype {dtype!r} (have: {', '.join(EXPORT_DTYPES)})")
    src, out = Path(src), Path(out)
    ckpt = Checkpoint(src)  # plan: manifest and config, read and checked once
    layout = plan_export(ckpt, dtype, shard_size)
    work = prepare_destination(out, force, [src], is_hf_checkpoint, "HF checkpoint")
    try:
        write_shards(ckpt, layout, work, workers, progress)  # execute
        write_hf_files(ckpt, layout, work, dtype)  # record
    except BaseException:
        discard(work)
        raise
    commit(work, out)
    return out


def _ordered(pool: cf.Executor, fn, items: list, ahead: int) -> Iterator:
    """pool.map with at most `ahead` results computed ahead of the consumer (bounded memory)."""
    futures: list[cf.Future] = []
    it = iter(items)
    for item in it:
        futures.append(pool.submit(fn, item))
        if len(futures) >= ahead:
            break
    while futures:
        result = futures.pop(0).result()
        nxt = next(it, None)
        if nxt is not None:
            futures.append(pool.submit(fn, nxt))
        yield result


__all__ = ["export_hf", "parse_size", "CheckpointError"]
