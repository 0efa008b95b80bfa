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
import os
import shutil
import struct
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm.auto import tqdm

from converters import fp8
from converters.files import atomic_write, commit, prepare_destination, remove
from converters.jax_checkpoint import MANIFEST, SIDE_FILES, Checkpoint, leaf_name, scale_path
from converters.safetensors_io import (
    INDEX_NAME,
    NP_TO_ST,
    SINGLE_NAME,
    ST_TO_NP,
    CheckpointError,
    is_hf_checkpoint,
    raw_bytes,
    st_nbytes,
)
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
    if unit not in units or not num:
        raise ValueError(f"bad size {text!r} (e.g. 5GB, 500MB)")
    return int(float(num) * units[unit])


class ShardWriter:
    """Writes one safetensors file tensor by tensor, in a planned order, to a temp name."""

    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]):
        header: dict = {"__metadata__": metadata}
        offset = 0
        self.sizes = {}
        for name, st_dtype, shape in specs:
            size = st_nbytes(st_dtype, shape)
            header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            self.sizes[name] = size
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
        self.order = [name for name, _, _ in specs]
        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp")
        self.file = open(self.tmp, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, name: str, value: np.ndarray) -> None:
        if self.order[self.next] != name or value.nbytes != self.sizes[name]:
            raise RuntimeError(f"{self.path}: {name} out of plan")
        self.file.write(raw_bytes(value))
        self.next += 1

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.next != len(self.order):
            raise RuntimeError(f"{self.path}: {len(self.order) - self.next} tensors not written")
        os.replace(self.tmp, self.path)


def _out_dtype(entry: Entry, source_dtype: str, dtype: str) -> str:
    """safetensors dtype of the exported tensor (the correction bias always stays F32)."""
    if entry.rule.buffer:
        return "F32"
    if dtype == "source":
        return source_dtype
    if dtype == "fp8":
        return "F8_E4M3" if entry.rule.fp8 else "BF16"
    return NP_TO_ST[dtype]


# ---- plan --------------------------------------------------------------------------------------
Spec = tuple[str, str, tuple[int, ...]]  # (HF name, safetensors dtype, shape) of one output tensor


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """Every tensor to write, its dtype and shape, and the shard it goes to."""

    plan: list[Entry]
    specs: dict[str, list[Spec]]  # HF name -> the tensor, and its FP8 scales where it is FP8
    shards: list[list[Spec]]  # tensors of each shard, in writing order
    names: list[str]  # file name of each shard

    @property
    def total(self) -> int:
        return sum(st_nbytes(s[1], s[2]) for shard in self.shards for s in shard)

    @property
    def fp8(self) -> bool:
        return any(s[1] == "F8_E4M3" for shard in self.shards for s in shard)


def plan_export(ckpt: Checkpoint, dtype: str, shard_size: int) -> ExportPlan:
    """Check the manifest covers every tensor, pick each tensor's dtype and lay out the shards:
    tensors in mapping order, a new shard when the next would overflow."""
    plan = entries(ckpt.cfg, ckpt.mtp)
    records = ckpt.tensors
    missing = [e.hf_name for e in plan if e.hf_name not in records]
    if missing:
        raise CheckpointError(f"{ckpt.path / MANIFEST}: tensor {missing[0]} has no record; the manifest is damaged")
    specs: dict[str, list[Spec]] = {}
    for e in plan:
        st = _out_dtype(e, records[e.hf_name]["source_dtype"], dtype)
        specs[e.hf_name] = [(e.hf_name, st, e.hf_shape)]
        if st == "F8_E4M3":
            specs[e.hf_name].append((e.hf_name + fp8.SCALE_SUFFIX, "F32", fp8.scale_shape(e.hf_shape)))
    shards: list[list[Spec]] = [[]]
    size = 0
    for e in plan:
        for spec in specs[e.hf_name]:
            nbytes = st_nbytes(spec[1], spec[2])
            if shards[-1] and size + nbytes > shard_size:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += nbytes
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return ExportPlan(plan, specs, shards, names)


# ---- execute -----------------------------------------------------------------------------------
def hf_tensors(ckpt: Checkpoint, e: Entry, specs: list[Spec]) -> list[tuple[str, np.ndarray]]:
    """One entry's HF tensor(s) read from its chunk: transposed back, cast, or re-quantized to
    FP8 (with the source's scales where its values still lie on their grid)."""
    if e.rule.tied_to:  # the MTP layer's copies of the embedding and head
        value = ckpt.read(("params", e.rule.tied_to))
    else:
        value = ckpt.read(e.path, e.index)
    if e.rule.transpose:
        value = value.T
    st = specs[0][1]
    if st != "F8_E4M3":
        return [(e.hf_name, value.astype(ST_TO_NP[st]))]
    hint = None
    if leaf_name(scale_path(e)) in ckpt.leaves and not e.rule.tied_to:
        hint = ckpt.read(scale_path(e), e.index)
    q, scale = fp8.requantize(value, hint)
    return [(e.hf_name, q), (e.hf_name + fp8.SCALE_SUFFIX, scale)]


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
    when FP8 tensors were written) and the tokenizer and generation files, each checked first."""
    if len(layout.shards) > 1:
        weight_map = {spec[0]: layout.names[i] for i, shard in enumerate(layout.shards) for spec in shard}
        index = {"metadata": {"total_size": layout.total}, "weight_map": weight_map}
        atomic_write(work / INDEX_NAME, json.dumps(index, indent=2))
    config = ckpt.cfg.to_hf_dict()
    if dtype == "fp8" or (dtype == "source" and layout.fp8):
        config["quantization_config"] = dict(fp8.QUANT_CONFIG)
    else:
        config.pop("quantization_config", None)
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
        remove(work)
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
