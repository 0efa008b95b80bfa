"""`moe-jax convert --from hf`: HF safetensors (FP8/BF16/FP32) -> our JAX checkpoint, streaming.

Every HF tensor is read on its own (positioned reads), dequantized if FP8, cast, transposed, and
written into its chunk of the stacked parameter before the next one is needed; a few worker
threads overlap reading and writing, and at most `workers` tensors are in flight, so peak
memory is set by the largest tensor, not by the checkpoint. FP8 sources keep their block
scales (`fp8_scales/...`) so that export can write the same e4m3 bytes back.

The output is built in `.<DST>.partial` beside DST and renamed into place when complete: an
interrupted run leaves no DST, and a rerun starts over and writes the same bytes.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import zlib
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from converters import fp8
from converters.files import prepare_destination, remove
from converters.hub import resolve_source
from converters.jax_checkpoint import (STATE, chunk_file, create_arrays, finish, is_previous_checkpoint, leaf_name,
                                       side_files, write_tree_metadata)  # fmt: skip
from converters.load import all_finite, check_headers, check_names, check_plan_size, read_checked, transposed, where
from moe_jax.params import TIED_NAMES, Entry, entries, has_mtp_tensors, np_dtype
from converters.safetensors_io import CheckpointError, CheckpointReader, raw_bytes, st_nbytes
from moe_jax.config import ModelConfig

# Tensors without a layer axis (the embedding and the head, 1.85 GB each in bf16 at 671B) are
# read, converted and written in blocks of this many HF rows, one chunk each, so that memory
# holds a block rather than the tensor.
ROW_BLOCK = 8192


def blocked(entry: Entry) -> bool:
    return not entry.stack and len(entry.hf_shape) == 2 and entry.hf_shape[0] > ROW_BLOCK


def chunk_shape(entry: Entry) -> tuple[int, ...]:
    """One chunk per HF tensor (1 along the stacked axes), or per ROW_BLOCK rows of a big one."""
    shape = list(entry.param_shape)
    if blocked(entry):
        shape[1 if entry.rule.transpose else 0] = ROW_BLOCK
    return (1,) * len(entry.stack) + tuple(shape[len(entry.stack) :])


def scale_path(entry: Entry) -> tuple[str, ...]:
    return ("fp8_scales", *entry.path[1:])


def _check_tied(reader: CheckpointReader, entry: Entry, rows: int = 8192) -> None:
    """The MTP copy of the embedding/head must equal the main tensor (compared in row blocks)."""
    main = TIED_NAMES[entry.rule.tied_to]
    n = entry.hf_shape[0]
    for i in range(0, n, rows):
        a = reader.get_slice(entry.hf_name, slice(i, min(i + rows, n)))
        b = reader.get_slice(main, slice(i, min(i + rows, n)))
        if not np.array_equal(a.astype(np.float32), b.astype(np.float32)):
            raise CheckpointError(f"{where(reader, entry.hf_name)} differs from {main}, which it must copy")


def release_freed_memory() -> None:
    """Return freed heap memory to the OS. glibc keeps freed blocks below its (adaptive) mmap
    threshold in per-thread arenas, so with several workers peak private memory would creep up
    with the number of tensors converted (+13% from 1 to 4 MoE layers, measured) instead of
    staying set by the largest ones. No-op where glibc is absent."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()


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
    src_dir = resolve_source(src)
    dst = Path(dst)
    cfg = ModelConfig.from_json(src_dir)
    reader = CheckpointReader(src_dir)
    with_mtp = mtp and has_mtp_tensors(reader.names(), cfg)
    check_plan_size(reader, cfg, with_mtp)  # before `entries` expands an absurd config
    plan = entries(cfg, with_mtp)
    check_names(reader, cfg, plan, with_mtp)
    check_headers(reader, plan)  # everything knowable from headers is checked before writing

    if dtype == "auto":
        weights = [reader.dtypes[e.hf_name] for e in plan if not e.rule.float32]
        dtype = "float32" if "F32" in weights else "bfloat16"
    inputs = [src_dir, src_dir / "config.json", *set(reader.name_to_file.values())]
    work = prepare_destination(dst, force, inputs, is_previous_checkpoint, "moe-jax checkpoint")
    target = np_dtype(dtype)
    leaves: dict[tuple[str, ...], tuple] = {}
    for e in plan:
        if e.rule.tied_to:
            continue
        leaf_dtype = np.dtype(np.float32) if e.rule.float32 else target
        leaves[e.path] = (e.param_shape, leaf_dtype, chunk_shape(e))
        if reader.dtypes[e.hf_name] == "F8_E4M3":
            shape = fp8.scale_shape(e.hf_shape)
            leaves[scale_path(e)] = (e.stack + shape, np.dtype(np.float32), (1,) * len(e.stack) + shape)
    stores = create_arrays(work / STATE, leaves)
    known: dict[str, tuple[int, int]] = {}  # chunk file -> (size, crc32), computed as it is written

    def write(path: tuple[str, ...], chunk: tuple[int, ...], region, value: np.ndarray) -> None:
        # The array is ours and never modified again: TensorStore may keep it instead of copying.
        stores[path][region].write(value, can_reference_source_data_indefinitely=True).result()
        data = raw_bytes(value)
        known[chunk_file(path, chunk)] = (len(data), zlib.crc32(data))

    def convert_block(e: Entry, start: int) -> None:
        """HF rows [start, start + ROW_BLOCK) of a big tensor -> one chunk."""
        stop = min(start + ROW_BLOCK, e.hf_shape[0])
        block = reader.get_slice(e.hf_name, slice(start, stop))
        if not all_finite(block):
            raise CheckpointError(f"{where(reader, e.hf_name)} contains NaN or Inf")
        block = block.astype(leaves[e.path][1], copy=False)
        if e.rule.transpose:
            write(e.path, (0, start // ROW_BLOCK), np.s_[:, start:stop], transposed(block))
        else:
            write(e.path, (start // ROW_BLOCK, 0), np.s_[start:stop], np.ascontiguousarray(block))

    def convert_one(e: Entry) -> None:
        """A whole tensor (and its FP8 scales) -> its chunk."""
        if e.rule.tied_to:
            _check_tied(reader, e)
            return
        value, scale = read_checked(reader, e, leaves[e.path][1], with_scale=True)
        chunk = e.index + (0,) * (len(e.param_shape) - len(e.index))
        write(e.path, chunk, e.index, value)
        if scale is not None:
            write(scale_path(e), e.index + (0, 0), e.index, np.ascontiguousarray(scale, np.float32))

    def nbytes(e: Entry) -> int:
        names = [e.hf_name] + ([e.hf_name + fp8.SCALE_SUFFIX] if reader.dtypes[e.hf_name] == "F8_E4M3" else [])
        return sum(st_nbytes(reader.dtypes[n], reader.shapes[n]) for n in names)

    # Tasks: one per tensor, or one per row block of a big one, so blocks convert in parallel.
    tasks = []
    for e in plan:
        if blocked(e):
            rows = e.hf_shape[0]
            tasks += [(e, i, nbytes(e) * (min(i + ROW_BLOCK, rows) - i) // rows) for i in range(0, rows, ROW_BLOCK)]
        else:
            tasks.append((e, None, nbytes(e)))
    bar = tqdm(total=sum(t[2] for t in tasks), unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
               disable=not progress)  # fmt: skip
    try:
        with cf.ThreadPoolExecutor(max_workers=workers) as pool:
            pending: dict[cf.Future, tuple] = {}
            todo = iter(tasks)
            while True:  # at most `workers` tasks in flight: memory stays bounded
                while len(pending) < workers and (task := next(todo, None)) is not None:
                    e, start, _ = task
                    fut = pool.submit(convert_one, e) if start is None else pool.submit(convert_block, e, start)
                    pending[fut] = task
                if not pending:
                    break
                done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    size = pending.pop(fut)[2]
                    fut.result()  # re-raises the worker's error
                    bar.update(size)
                release_freed_memory()
        bar.close()
        records: dict[str, dict] = {}
        for e in plan:
            record = {"file": reader.file_of(e.hf_name).name, "source_dtype": reader.dtypes[e.hf_name]}
            if e.rule.tied_to:
                record["tied_to"] = e.rule.tied_to
            else:
                record.update(param=leaf_name(e.path), index=list(e.index))
            records[e.hf_name] = record
        write_tree_metadata(work / STATE, {p: leaf[0] for p, leaf in leaves.items()})
        manifest = {
            "source": str(src),
            "dtype": dtype,
            "mtp": with_mtp,
            "leaves": {leaf_name(p): {"shape": list(s), "dtype": np.dtype(d).name} for p, (s, d, _) in leaves.items()},
            "tensors": records,
        }
        finish(work, dst, (src_dir / "config.json").read_text(), manifest, side_files(src_dir), known)
    except BaseException:
        bar.leave = False  # the error line alone stays on the terminal
        bar.close()
        remove(work)
        raise
    return manifest
