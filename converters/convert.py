"""`moe-jax convert --from hf`: HF safetensors (FP8/BF16/FP32) -> our JAX checkpoint, streaming.

Every HF tensor is read on its own (positioned reads), dequantized if FP8, cast, transposed, and
written into its chunk of the stacked parameter before the next one is needed; a few worker
threads overlap reading and writing, and at most `workers` tensors are in flight, so peak
memory is set by the largest tensor, not by the checkpoint. FP8 sources keep their block
scales (`fp8_scales/...`) so that export can write the same e4m3 bytes back.

The output is built in a work directory of its own beside DST (`moe_jax.files`) and renamed
into place when complete: an interrupted run leaves no DST, and a rerun starts over and writes
the same bytes.

`convert_hf` runs in three steps: plan (`open_hf` reads and checks the source, `plan_leaves`
decides every output array), execute (`stream_tensors` fills them), record (`record_manifest`,
then `jax_checkpoint.finish`). `open_hf` also serves `moe-jax verify`.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import ctypes.util
import dataclasses
import os
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from converters import fp8, int4
from converters.extras import write_extras
from converters.hub import resolve_source
from converters.jax_checkpoint import (
    STATE,
    chunk_file,
    create_arrays,
    finish,
    is_previous_checkpoint,
    leaf_name,
    leaf_record,
    model_manifest,
    scale_path,
    side_files,
    tensor_record,
    write_tree_metadata,
)
from converters.load import all_finite, check_headers, check_names, check_plan_size, read_checked, transposed, where
from converters.safetensors_io import ST_TO_NP, CheckpointError, CheckpointReader, raw_bytes
from moe_jax.config import ModelConfig, read_config
from moe_jax.files import discard, prepare_destination
from moe_jax.params import TIED_NAMES, Entry, entries, has_mtp_tensors, leaf_dtype

# Tensors without a layer axis (the embedding and the head, 1.85 GB each in bf16 at 671B) are
# read, converted and written in blocks of this many HF rows, one chunk each, so that memory
# holds a block rather than the tensor.
ROW_BLOCK = 8192

# path -> (shape, dtype, chunk shape) of every array of the output
Leaves = dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype, tuple[int, ...]]]
# one unit of work: (entry, first HF row of its block or None for the whole tensor, bytes read)
Task = tuple[Entry, int | None, int]


# ---- plan --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HFSource:
    """An HF checkpoint, checked as far as its config and headers allow, before a byte is read."""

    root: Path  # the directory (a hub id resolved to its snapshot)
    cfg: ModelConfig
    config_text: str  # config.json as read (and checked): the output carries exactly this
    reader: CheckpointReader
    mtp: bool  # the MTP layers are read
    plan: list[Entry]  # every tensor to read, in file order

    def inputs(self) -> list[Path]:
        """What a destination may not be, nor contain."""
        files = {*self.reader.name_to_file.values(), *(f for f, _, _ in self.reader.extras.values())}
        return [self.root, self.root / "config.json", *files]

    def is_fp8(self, entry: Entry) -> bool:
        return self.reader.dtypes[entry.hf_name] == "F8_E4M3"

    def is_int4(self, entry: Entry) -> bool:
        return self.reader.dtypes[entry.hf_name] == int4.DTYPE

    def stored(self, entry: Entry) -> list[str]:
        """The tensors the entry is read from: itself, with its FP8 scales, or its INT4 parts."""
        if self.is_int4(entry):
            return int4.components(entry.hf_name)
        return [entry.hf_name] + ([entry.hf_name + fp8.SCALE_SUFFIX] if self.is_fp8(entry) else [])

    def scale_leaf(self, entry: Entry) -> tuple[tuple[str, ...], tuple[int, ...], np.dtype] | None:
        """(path, shape, dtype) of the leaf that keeps an FP8 or INT4 weight's scales for export."""
        if self.is_fp8(entry):
            return scale_path(entry), entry.stack + fp8.scale_shape(entry.hf_shape), np.dtype(np.float32)
        if self.is_int4(entry):
            dtype = ST_TO_NP[self.reader.dtypes[entry.hf_name + int4.SCALE]]
            return (
                scale_path(entry, int4=True),
                entry.stack + int4.scale_shape(entry.hf_shape, self.cfg.int4_group_size),
                dtype,
            )
        return None


def open_hf(src: str | os.PathLike, mtp: bool = True) -> HFSource:
    """Resolve `src` (a directory or a hub repo id), read its config and shard headers, and check
    everything they tell: names, dtypes, shapes, scales (raises CheckpointError/ConfigError)."""
    root = resolve_source(src)
    cfg, config_text = read_config(root)
    reader = CheckpointReader(root, cfg.tensor_prefix)
    with_mtp = mtp and has_mtp_tensors(reader.names(), cfg)
    check_plan_size(reader, cfg, with_mtp)  # before `entries` expands an absurd config
    plan = entries(cfg, with_mtp)
    check_names(reader, cfg, plan, with_mtp)
    check_headers(reader, plan, cfg.int4_group_size)  # everything knowable from headers is checked before writing
    return HFSource(root, cfg, config_text, reader, with_mtp, plan)


def param_dtype(source: HFSource, dtype: str) -> str:
    """`auto`: float32 if the source stores weights in float32 or float16 (which bfloat16 would
    round), else bfloat16."""
    if dtype != "auto":
        return dtype
    weights = [source.reader.dtypes[e.hf_name] for e in source.plan if not e.rule.float32]
    return "float32" if {"F32", "F16"} & set(weights) else "bfloat16"


def blocked(source: HFSource, entry: Entry) -> bool:
    """Read and written by row blocks: a big tensor without a layer axis, stored unpacked and
    unscaled (an FP8 or INT4 one, which no released checkpoint has, is read whole with its scales)."""
    big = not entry.stack and len(entry.hf_shape) == 2 and entry.hf_shape[0] > ROW_BLOCK
    return big and not source.is_int4(entry) and not source.is_fp8(entry)


def chunk_shape(source: HFSource, entry: Entry) -> tuple[int, ...]:
    """One chunk per HF tensor (1 along the stacked axes), or per ROW_BLOCK rows of a big one."""
    shape = list(entry.param_shape)
    if blocked(source, entry):
        shape[1 if entry.rule.transpose else 0] = ROW_BLOCK
    return (1,) * len(entry.stack) + tuple(shape[len(entry.stack) :])


def plan_leaves(source: HFSource, dtype: str) -> Leaves:
    """Every array of the output: the parameters (tied copies have none) and the FP8 block scales."""
    leaves: Leaves = {}
    for e in source.plan:
        if e.rule.tied_to:
            continue
        leaves[e.path] = (e.param_shape, leaf_dtype(e.rule, dtype), chunk_shape(source, e))
        if (scales := source.scale_leaf(e)) is not None:
            path, shape, scale_dtype = scales
            leaves[path] = (shape, scale_dtype, (1,) * len(e.stack) + shape[len(e.stack) :])
    return leaves


def plan_tasks(source: HFSource) -> list[Task]:
    """One task per tensor, or one per row block of a big one (so that blocks convert in
    parallel), each with the bytes it reads (for the progress bar)."""
    reader = source.reader

    def nbytes(e: Entry) -> int:
        return sum(reader.sizes[n] for n in source.stored(e))

    tasks: list[Task] = []
    for e in source.plan:
        if blocked(source, e):
            rows = e.hf_shape[0]
            tasks += [(e, i, nbytes(e) * (min(i + ROW_BLOCK, rows) - i) // rows) for i in range(0, rows, ROW_BLOCK)]
        else:
            tasks.append((e, None, nbytes(e)))
    return tasks


# ---- execute -----------------------------------------------------------------------------------
class ChunkWriter:
    """The output arrays, written one chunk at a time, with the size and crc32 of every chunk
    file computed as it is written (so that `finish` need not read them back)."""

    def __init__(self, stores: dict, leaves: Leaves):
        self.stores = stores
        self.dtypes = {path: leaf[1] for path, leaf in leaves.items()}
        self.known: dict[str, tuple[int, int]] = {}  # chunk file -> (size, crc32)

    def write(self, path: tuple[str, ...], chunk: tuple[int, ...], region, value: np.ndarray) -> None:
        # The array is ours and never modified again: TensorStore may keep it instead of copying.
        self.stores[path][region].write(value, can_reference_source_data_indefinitely=True).result()
        data = raw_bytes(value)
        self.known[chunk_file(path, chunk)] = (len(data), zlib.crc32(data))


def _check_tied(source: HFSource, entry: Entry, rows: int = 8192) -> None:
    """The MTP copy of the embedding/head must equal the main tensor, stored as it is (its FP8
    scales or INT4 parts too; compared in row blocks)."""
    reader, main = source.reader, TIED_NAMES[entry.rule.tied_to]
    for name in source.stored(entry):
        other = main + name[len(entry.hf_name) :]  # the weight, or its scales or parts
        if other not in reader.dtypes or reader.shapes[other] != reader.shapes[name]:
            raise CheckpointError(f"{where(reader, name)} has no counterpart {other} to copy")
        n = reader.shapes[name][0]
        for i in range(0, n, rows):
            a = reader.get_slice(name, slice(i, min(i + rows, n)))
            b = reader.get_slice(other, slice(i, min(i + rows, n)))
            if not np.array_equal(a.astype(np.float32), b.astype(np.float32)):
                raise CheckpointError(f"{where(reader, name)} differs from {other}, which it must copy")


def convert_tensor(source: HFSource, e: Entry, out: ChunkWriter) -> None:
    """A whole tensor (and its FP8 or INT4 scales) -> its chunk."""
    if e.rule.tied_to:
        _check_tied(source, e)
        return
    value, scale = read_checked(source.reader, e, out.dtypes[e.path], with_scale=True)
    chunk = e.index + (0,) * (len(e.param_shape) - len(e.index))
    out.write(e.path, chunk, e.index, value)
    if scale is not None:
        path = source.scale_leaf(e)[0]
        out.write(path, e.index + (0, 0), e.index, np.ascontiguousarray(scale, out.dtypes[path]))


def convert_block(reader: CheckpointReader, e: Entry, start: int, out: ChunkWriter) -> None:
    """HF rows [start, start + ROW_BLOCK) of a big tensor -> one chunk."""
    stop = min(start + ROW_BLOCK, e.hf_shape[0])
    block = reader.get_slice(e.hf_name, slice(start, stop))
    if not all_finite(block):
        raise CheckpointError(f"{where(reader, e.hf_name)} contains NaN or Inf")
    block = block.astype(out.dtypes[e.path], copy=False)
    if e.rule.transpose:
        out.write(e.path, (0, start // ROW_BLOCK), np.s_[:, start:stop], transposed(block))
    else:
        out.write(e.path, (start // ROW_BLOCK, 0), np.s_[start:stop], np.ascontiguousarray(block))


def run_bounded(tasks: list[Task], run: Callable[[Task], None], workers: int, done: Callable[[int], None]) -> None:
    """Run every task on `workers` threads with at most `workers` in flight (memory stays
    bounded); `done(bytes)` after each; the first error is re-raised."""
    with cf.ThreadPoolExecutor(max_workers=workers) as pool:
        pending: dict[cf.Future, Task] = {}
        todo = iter(tasks)
        untrimmed = 0  # bytes converted since freed memory was last returned to the OS
        while True:
            while len(pending) < workers and (task := next(todo, None)) is not None:
                pending[pool.submit(run, task)] = task
            if not pending:
                break
            finished, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                size = pending.pop(fut)[2]
                fut.result()  # re-raises the worker's error
                done(size)
                untrimmed += size
            if untrimmed >= TRIM_EVERY_BYTES:
                release_freed_memory()
                untrimmed = 0


def stream_tensors(source: HFSource, out: ChunkWriter, workers: int, progress: bool) -> None:
    """Read, check and convert every tensor of the source into its chunks, with a progress bar
    (bytes/s, ETA) that an error erases, so that the error line alone stays on the terminal."""
    tasks = plan_tasks(source)

    def run(task: Task) -> None:
        e, start, _ = task
        if start is None:
            convert_tensor(source, e, out)
        else:
            convert_block(source.reader, e, start, out)

    bar = tqdm(
        total=sum(t[2] for t in tasks),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="convert",
        disable=not progress,
    )
    try:
        run_bounded(tasks, run, workers, bar.update)
    except BaseException:
        bar.leave = False
        bar.close()
        raise
    bar.close()


# A trim walks the whole heap (2 ms in a process that has imported torch and transformers), so it
# runs after every 64 MiB converted rather than after every tensor (a 671B checkpoint has 90,000).
TRIM_EVERY_BYTES = 64 * 2**20


def release_freed_memory() -> None:
    """Return freed heap memory to the OS. glibc keeps freed blocks below its (adaptive) mmap
    threshold in per-thread arenas, so with several workers peak private memory would creep up
    with the number of tensors converted (+13% from 1 to 4 MoE layers, measured) instead of
    staying set by the largest ones. No-op where glibc is absent."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()


# ---- record ------------------------------------------------------------------------------------
def record_manifest(src: str | os.PathLike, source: HFSource, dtype: str, leaves: Leaves) -> dict:
    """The manifest's model part: every leaf, and where every HF tensor came from and went."""
    reader = source.reader
    records = {}
    for e in source.plan:
        shape_dtype = reader.dtypes[e.hf_name + int4.SHAPE] if source.is_int4(e) else None
        records[e.hf_name] = tensor_record(e, reader.file_of(e.hf_name).name, reader.dtypes[e.hf_name], shape_dtype)
    leaf_records = {leaf_name(p): leaf_record(shape, d) for p, (shape, d, _) in leaves.items()}
    return model_manifest(str(src), dtype, source.mtp, leaf_records, records)


# ---- the command -------------------------------------------------------------------------------
def convert_hf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype: str = "auto",
    mtp: bool = True,
    force: bool = False,
    workers: int = 4,
    progress: bool = True,
) -> dict:
    """Convert; returns the manifest. Raises CheckpointError/ConfigError on bad input.

    `dtype` of the parameters: bfloat16, float32, or auto (float32 if the source stores its
    weights in float32, else bfloat16; FP8 weights dequantize to bfloat16 as DeepSeek's do)."""
    dst = Path(dst)
    source = open_hf(src, mtp)  # plan
    dtype = param_dtype(source, dtype)
    leaves = plan_leaves(source, dtype)
    work = prepare_destination(dst, force, source.inputs(), is_previous_checkpoint, "moe-jax checkpoint")
    try:
        out = ChunkWriter(create_arrays(work / STATE, leaves), leaves)
        stream_tensors(source, out, workers, progress)  # execute
        write_extras(source.reader, work)
        write_tree_metadata(work / STATE, {p: leaf[0] for p, leaf in leaves.items()})  # record
        manifest = record_manifest(src, source, dtype, leaves)
        finish(work, dst, source.config_text, manifest, side_files(source.root), out.known)
    except BaseException:
        discard(work)
        raise
    return manifest
