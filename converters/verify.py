"""`moe-jax verify PATH`: is this checkpoint whole? One line of verdict, or a CheckpointError.

- a moe-jax checkpoint (manifest.json): every file against its recorded size and crc32, no file
  unrecorded, every array's shape and dtype as the manifest says, the config readable;
- a training run's step checkpoint (moe-jax-files.json): every file against its record;
- an HF directory or hub repo id: the index, every shard's header, every tensor the config
  implies present with its dtype and shape, nothing unknown, and every FP8 or INT4 scale tensor of
  the right shape, finite and non-negative.
"""

from __future__ import annotations

import time
from pathlib import Path

from converters.convert import open_hf
from converters.jax_checkpoint import Checkpoint, is_jax_checkpoint
from converters.load import read_int4_scale, read_scale
from moe_jax.files import FILES_RECORD, verify_directory


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def verify(path: str | Path) -> str:
    t0 = time.perf_counter()
    if is_jax_checkpoint(path):
        ckpt = Checkpoint(path)
        files, nbytes = ckpt.verify()
        return (
            f"OK: {path}: moe-jax checkpoint ({ckpt.dtype}, MTP {'yes' if ckpt.mtp else 'no'}), "
            f"{files} files, {_size(nbytes)}, every checksum matches ({time.perf_counter() - t0:.2f} s)"
        )
    if (Path(path) / FILES_RECORD).is_file():
        nbytes = verify_directory(path)
        return f"OK: {path}: {_size(nbytes)}, every checksum matches ({time.perf_counter() - t0:.2f} s)"
    source = open_hf(path)  # index, headers, names, dtypes, shapes
    reader = source.reader
    fp8_entries = [e for e in source.plan if source.is_fp8(e)]
    for e in fp8_entries:
        read_scale(reader, e.hf_name, reader.shapes[e.hf_name])  # shape, finite, non-negative
    int4_entries = [e for e in source.plan if source.is_int4(e)]
    for e in int4_entries:
        read_int4_scale(reader, e.hf_name)  # finite, non-negative
    shards = len(set(reader.name_to_file.values()) | {f for f, _, _ in reader.extras.values()})
    kinds = [f"FP8 ({len(fp8_entries)} block-scaled weights)"] * bool(fp8_entries)
    kinds += [f"INT4 ({len(int4_entries)} packed weights, groups of {source.cfg.int4_group_size})"] * bool(int4_entries)
    kinds += [f"{len(reader.extras)} tensors besides the model (carried through)"] * bool(reader.extras)
    mtp = " with MTP" if source.mtp else ""
    return (
        f"OK: {path}: HF checkpoint, {shards} shard(s), {len(source.plan)} tensors{mtp}, "
        f"{', '.join(kinds) or 'not quantized'}: index, headers, names, dtypes, shapes and scales consistent "
        f"({time.perf_counter() - t0:.1f} s)"
    )
