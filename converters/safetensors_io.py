"""Lazy reading and atomic writing of (sharded) safetensors checkpoints.

`safetensors.safe_open` validates every shard's header (offsets inside the file, no overlaps);
the data is then read with plain positioned reads (`os.preadv`) straight into numpy buffers, a
tensor or a block of its rows at a time. That costs memory only for what is read and, unlike
reading through the memory map, no page fault per 4 KiB page (it halves the converter's system
time at 671B scale). Bad checkpoints raise `CheckpointError` with a one-line message that names
the file and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

# safetensors' numpy backend looks the float8 types up on numpy itself; give it ml_dtypes'.
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if not hasattr(np, _name):
        setattr(np, _name, getattr(ml_dtypes, _name))

from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype names <-> numpy, for the dtypes a DeepSeek checkpoint uses
ST_TO_NP = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
            "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}  # fmt: skip
NP_TO_ST = {v.name: k for k, v in ST_TO_NP.items()}


def raw_bytes(arr: np.ndarray) -> memoryview:
    """The array's bytes in C order (no copy when already contiguous), any dtype."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def st_nbytes(st_dtype: str, shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) * ST_TO_NP[st_dtype].itemsize


SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file and tensor."""


class CheckpointReader:
    """Name -> tensor access over one `model.safetensors` or an indexed set of shards."""

    def __init__(self, path: str | os.PathLike):
        self.root = Path(path)
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: not a directory")
        self.name_to_file: dict[str, Path] = {}
        index = self.root / INDEX_NAME
        if index.exists():
            self._read_index(index)
        elif (self.root / SINGLE_NAME).exists():
            self._read_headers([self.root / SINGLE_NAME])
        else:
            pickles = sorted(p.name for p in self.root.glob("*.bin")) + sorted(p.name for p in self.root.glob("*.pt"))
            if pickles:
                raise CheckpointError(
                    f"{self.root / pickles[0]}: pickle checkpoints are not loaded (unsafe); convert to safetensors"
                )
            raise CheckpointError(f"{self.root}: no {SINGLE_NAME} or {INDEX_NAME}")

    def _read_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        root = self.root.resolve()
        files: dict[str, Path] = {}
        for name, fname in weight_map.items():
            path = (self.root / fname).resolve()
            if root not in path.parents:
                raise CheckpointError(f"{index}: tensor {name} points outside the checkpoint ({fname})")
            if not path.exists():
                raise CheckpointError(f"{path}: shard named in the index for tensor {name} is missing")
            files[name] = path
        self._read_headers(sorted(set(files.values())), expected=files)

    def _read_headers(self, paths: Iterable[Path], expected: Mapping[str, Path] | None = None) -> None:
        self.dtypes: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.offsets: dict[str, int] = {}  # absolute file offset of each tensor's data
        for path in paths:
            size = path.stat().st_size
            try:
                with safe_open(path, framework="numpy") as f:  # validates the header against the file
                    names = list(f.keys())
                with open(path, "rb") as f:
                    n = struct.unpack("<Q", f.read(8))[0]
                    header = json.loads(f.read(n))
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{path}: unreadable safetensors file ({size} bytes): {e}") from None
            for name in names:
                info = header[name]
                self.name_to_file[name] = path
                self.dtypes[name] = info["dtype"]
                self.shapes[name] = tuple(info["shape"])
                self.offsets[name] = 8 + n + info["data_offsets"][0]
        if expected is not None:
            for name, path in expected.items():
                if self.name_to_file.get(name) != path:
                    raise CheckpointError(f"{path}: tensor {name} named in the index is not in this shard")

    # ---- access ----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.name_to_file)

    def __contains__(self, name: str) -> bool:
        return name in self.name_to_file

    def file_of(self, name: str) -> Path:
        try:
            return self.name_to_file[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: tensor {name} not found in the checkpoint") from None

    def _read(self, name: str, first_row: int, rows: int) -> np.ndarray:
        path = self.file_of(name)
        shape = self.shapes[name]
        if self.dtypes[name] not in ST_TO_NP:
            raise CheckpointError(f"{path}: tensor {name} has dtype {self.dtypes[name]}, not a float weight")
        dtype = ST_TO_NP[self.dtypes[name]]
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        out = np.empty((rows, *shape[1:]) if shape else (), dtype)
        fd = os.open(path, os.O_RDONLY)
        try:
            buf, pos, start = memoryview(out.reshape(-1).view(np.uint8)), 0, self.offsets[name] + first_row * row_bytes
            while pos < len(buf):
                got = os.preadv(fd, [buf[pos:]], start + pos)
                if got <= 0:
                    raise CheckpointError(f"{path}: tensor {name} is cut short (file truncated?)")
                pos += got
        finally:
            os.close(fd)
        return out

    def get(self, name: str) -> np.ndarray:
        """The whole tensor, as a numpy array (bf16/float8 as ml_dtypes types)."""
        self.file_of(name)  # a clear error for unknown names
        shape = self.shapes[name]
        return self._read(name, 0, shape[0] if shape else 1).reshape(shape)

    def get_slice(self, name: str, rows: slice) -> np.ndarray:
        """Rows [start, stop) of a tensor; reads only those bytes."""
        self.file_of(name)
        start, stop, step = rows.indices(self.shapes[name][0])
        if step != 1:
            raise ValueError("get_slice reads contiguous row ranges only")
        return self._read(name, start, max(0, stop - start))

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in set(self.name_to_file.values()))

    def close(self) -> None:
        pass


def write_checkpoint(
    out_dir: str | os.PathLike,
    tensors: Iterable[tuple[str, np.ndarray]],
    shard_bytes: int = 5 * 2**30,
    metadata: dict[str, str] | None = None,
) -> None:
    """Write `tensors` as safetensors shards plus an index, each file atomically.

    One shard is `model.safetensors` with no index (as transformers writes small models).
    Shards are filled in the order given, up to `shard_bytes` each; only one shard's tensors
    are held at a time.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", **(metadata or {})}
    shards: list[list[str]] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, np.ndarray] = {}
    pending_bytes = 0
    tmp_names: list[Path] = []
    total = 0

    def flush():
        nonlocal pending, pending_bytes
        if not pending:
            return
        tmp = out / f".tmp-shard-{len(shards):05d}.safetensors"
        save_file({k: np.ascontiguousarray(v) for k, v in pending.items()}, str(tmp), metadata=meta)
        tmp_names.append(tmp)
        shards.append(list(pending))
        pending, pending_bytes = {}, 0

    for name, arr in tensors:
        if name in weight_map or name in pending:
            raise CheckpointError(f"{out}: tensor {name} written twice")
        if pending and pending_bytes + arr.nbytes > shard_bytes:
            flush()
        pending[name] = arr
        pending_bytes += arr.nbytes
        total += arr.nbytes
    flush()

    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, final in zip(tmp_names, names):
        os.replace(tmp, out / final)
    if n > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {name: names[i] for i, shard in enumerate(shards) for name in shard},
        }
        write_text_atomic(out / INDEX_NAME, json.dumps(index, indent=2))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
