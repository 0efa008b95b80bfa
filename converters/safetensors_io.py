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

from converters import int4  # noqa: E402
from moe_jax.errors import CheckpointError, one_line  # noqa: E402
from moe_jax.files import (  # noqa: E402
    UMASK,
    atomic_write,
    commit,
    discard,
    fsync_file,
    json_kind,
    load_json_unique,
    prepare_destination,
    write_json,
)

INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype names <-> numpy, for the dtypes a DeepSeek checkpoint uses
ST_TO_NP = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
NP_TO_ST = {v.name: k for k, v in ST_TO_NP.items()}
ST_INTS = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8")}  # INT4 packing and shapes (converters.int4)


def is_model_name(name: str) -> bool:
    """A tensor of the DeepSeek-V3 language model's namespace (after any wrapper's prefix), whose
    every name must be one the model reads; others (a vision tower, rotary buffers that are
    recomputed anyway) are carried through untouched."""
    return (name.startswith("model.") or name.startswith("lm_head.")) and not name.endswith("rotary_emb.inv_freq")


def raw_bytes(arr: np.ndarray) -> memoryview:
    """The array's bytes in C order (no copy when already contiguous), any dtype."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


# bytes per element of every whole-byte safetensors dtype
ST_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2}
ST_SIZES |= {"BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def st_nbytes(st_dtype: str, shape) -> int:
    if st_dtype not in ST_SIZES:
        raise CheckpointError(f"safetensors dtype {st_dtype} is not supported here")
    return int(np.prod(shape, dtype=np.int64)) * ST_SIZES[st_dtype]


class ShardWriter:
    """Writes one safetensors file tensor by tensor, in a planned order, to a temp name; the file
    is opened at its first tensor and closed and renamed into place at its last (so that a writer
    per shard of an export holds one open file at a time, not one per shard)."""

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
        self.header = struct.pack("<Q", len(raw)) + raw
        self.order = [name for name, _, _ in specs]
        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp")
        self.file = None
        self.next = 0

    def write(self, name: str, value: np.ndarray | bytes) -> None:
        data = value if isinstance(value, bytes) else raw_bytes(value)
        if self.next == len(self.order) or self.order[self.next] != name or len(data) != self.sizes[name]:
            raise RuntimeError(f"{self.path}: {name} out of plan")
        if self.file is None:
            self.file = open(self.tmp, "wb")
            self.file.write(self.header)
        self.file.write(data)
        self.next += 1
        if self.next == len(self.order):
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.tmp, self.path)

    def close(self) -> None:
        """Check that every planned tensor was written (the file is then in place)."""
        if self.next != len(self.order):
            if self.file is not None:
                self.file.close()
            raise RuntimeError(f"{self.path}: {len(self.order) - self.next} tensors not written")


SINGLE_NAME = "model.safetensors"


def is_plain_file_name(name) -> bool:
    """A file name directly inside a directory: no separators, not '.', '..' or empty.
    Judged on the name as written, not on where a symlink of that name leads (the hub cache
    stores shards as symlinks into its blobs directory)."""
    if not isinstance(name, str) or name in ("", ".", ".."):
        return False
    return not any(c in name for c in "/\\\0")


def check_regular_file(path: Path, what: str) -> None:
    """`path` (symlinks followed) exists and is a regular file, not a directory or a pipe."""
    if not path.exists():
        raise CheckpointError(f"{path}: {what} is missing")
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} is not a regular file")


class CheckpointReader:
    """Name -> tensor access over one `model.safetensors` or an indexed set of shards.

    The language model's tensors go by their DeepSeek-V3 names (a wrapper's `prefix` taken off);
    every other tensor is an extra (`extras`: stored name -> its file, dtype, shape), to be
    carried through byte for byte. A compressed-tensors INT4 weight (`W_packed`, `W_scale`,
    `W_shape`) is also listed as `W`, of dtype `int4.DTYPE` and its unpacked shape."""

    def __init__(self, path: str | os.PathLike, prefix: str = ""):
        self.root = Path(path)
        self.prefix = prefix
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: not a directory")
        self.name_to_file: dict[str, Path] = {}
        index, single = self.root / INDEX_NAME, self.root / SINGLE_NAME
        if index.exists() or index.is_symlink():
            self._read_index(index)
        elif single.exists() or single.is_symlink():
            check_regular_file(single, "the checkpoint file")
            self._read_headers([single])
        else:
            pickles = sorted(p.name for p in self.root.glob("*.bin")) + sorted(p.name for p in self.root.glob("*.pt"))
            if pickles:
                raise CheckpointError(
                    f"{self.root / pickles[0]}: pickle checkpoints are not loaded (unsafe); convert to safetensors"
                )
            raise CheckpointError(f"{self.root}: no {SINGLE_NAME} or {INDEX_NAME}")
        self._set_extras_aside()
        self._list_int4()

    def _set_extras_aside(self) -> None:
        self.extras: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        self.extra_offsets: dict[str, int] = {}
        self.extra_sizes: dict[str, int] = {}
        for stored in list(self.name_to_file):
            if not (stored.startswith(self.prefix) and is_model_name(stored[len(self.prefix) :])):
                if self.dtypes[stored] not in ST_SIZES:
                    raise CheckpointError(
                        f"{self.name_to_file[stored]}: tensor {stored} has dtype {self.dtypes[stored]}, "
                        f"which cannot be carried through (whole-byte dtypes only)"
                    )
                self.extras[stored] = (self.name_to_file.pop(stored), self.dtypes.pop(stored), self.shapes.pop(stored))
                self.extra_offsets[stored] = self.offsets.pop(stored)
                self.extra_sizes[stored] = self.sizes.pop(stored)
        if self.prefix:  # what is left is the model's, every name under the prefix
            for stored in list(self.name_to_file):
                for table in (self.name_to_file, self.dtypes, self.shapes, self.offsets, self.sizes):
                    table[stored[len(self.prefix) :]] = table.pop(stored)

    def _list_int4(self) -> None:
        """Each `W_packed` (with its `W_scale` and `W_shape`) as `W`: dtype int4.DTYPE, shape [out, in]."""
        self.packed_parts: set[str] = set()
        for packed in [n for n in self.name_to_file if int4.packed_base(n)]:
            name = int4.packed_base(packed)
            for part in int4.components(name)[1:]:
                if part not in self.name_to_file:
                    raise CheckpointError(f"{self.where(packed)} is packed INT4 but {self.prefix}{part} is missing")
            if name in self.name_to_file:
                raise CheckpointError(f"{self.where(name)} is stored both packed ({packed}) and unpacked")
            shape_name = name + int4.SHAPE
            if self.dtypes[shape_name] not in int4.SHAPE_DTYPES or self.shapes[shape_name] != (2,):
                got = f"{self.dtypes[shape_name]} {list(self.shapes[shape_name])}"
                raise CheckpointError(f"{self.where(shape_name)} is {got}, expected I32 [2] (the unpacked [out, in])")
            shape = tuple(int(d) for d in self.get(shape_name))
            self.name_to_file[name], self.dtypes[name], self.shapes[name] = self.name_to_file[packed], int4.DTYPE, shape
            self.packed_parts.update(int4.components(name))

    def where(self, name: str) -> str:
        """`file: tensor NAME` (the name as stored) for error messages."""
        return f"{self.file_of(name)}: tensor {self.prefix}{name}"

    def _read_index(self, index: Path) -> None:
        check_regular_file(index, "the safetensors index")
        try:
            text = index.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{index}: cannot read the index ({e.strerror or e})") from None
        obj = load_json_unique(text, index, "the safetensors index")
        if not isinstance(obj, dict):
            kind = json_kind(obj)
            raise CheckpointError(f"{index}: not a safetensors index ({kind}, not an object)")
        weight_map = obj.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            got = f"{json_kind(weight_map)} {weight_map!r:.60}" if "weight_map" in obj else "none"
            raise CheckpointError(f"{index}: weight_map must be a non-empty object, got {got}")
        files: dict[str, Path] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str):
                kind = json_kind(fname)
                raise CheckpointError(f"{index}: tensor {name} maps to {kind}, not a file name")
            if not is_plain_file_name(fname):
                raise CheckpointError(
                    f"{index}: tensor {name} points outside the checkpoint directory "
                    f"({fname!r} is not a plain file name)"
                )
            files[name] = self.root / fname  # kept as named: a symlink (hub cache blob) is fine
        first_name = {path: name for name, path in reversed(files.items())}
        for path, name in sorted(first_name.items()):
            check_regular_file(path, f"shard named in the index for tensor {name}")
        self._read_headers(sorted(first_name), expected=files)

    def _read_headers(self, paths: Iterable[Path], expected: Mapping[str, Path] | None = None) -> None:
        self.dtypes: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.offsets: dict[str, int] = {}  # absolute file offset of each tensor's data
        self.sizes: dict[str, int] = {}  # bytes of each tensor's data
        for path in paths:
            try:
                with safe_open(path, framework="numpy") as f:  # validates the header against the file
                    names = list(f.keys())
                with open(path, "rb") as f:
                    n = struct.unpack("<Q", f.read(8))[0]
                    raw_header = f.read(n)
            except Exception as e:  # safetensors raises its own error types for bad headers
                error = one_line(e)
                raise CheckpointError(f"{path}: unreadable safetensors file: {error}") from None
            header = load_json_unique(raw_header, path, "the safetensors header")
            for name in names:
                if name in self.name_to_file:
                    other = self.name_to_file[name]
                    raise CheckpointError(f"{path}: tensor {name} is also in {other}")
                info = header[name]
                self.name_to_file[name] = path
                self.dtypes[name] = info["dtype"]
                self.shapes[name] = tuple(info["shape"])
                self.offsets[name] = 8 + n + info["data_offsets"][0]
                self.sizes[name] = info["data_offsets"][1] - info["data_offsets"][0]
        if expected is not None:
            for name, path in expected.items():
                if self.name_to_file.get(name) != path:
                    raise CheckpointError(f"{path}: tensor {name} named in the index is not in this shard")

    # ---- access ----------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The model's tensors (a packed INT4 weight once, under its weight's name)."""
        return [n for n in self.name_to_file if n not in self.packed_parts]

    def __contains__(self, name: str) -> bool:
        return name in self.name_to_file

    def file_of(self, name: str) -> Path:
        try:
            return self.name_to_file[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: tensor {self.prefix}{name} not found in the checkpoint") from None

    def _read(self, name: str, first_row: int, rows: int) -> np.ndarray:
        path = self.file_of(name)
        shape = self.shapes[name]
        dtype = ST_TO_NP.get(self.dtypes[name], ST_INTS.get(self.dtypes[name]))
        if dtype is None:
            raise CheckpointError(f"{self.where(name)} has dtype {self.dtypes[name]}, not a float weight")
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        out = np.empty((rows, *shape[1:]) if shape else (), dtype)
        self._read_into(
            path, name, memoryview(out.reshape(-1).view(np.uint8)), self.offsets[name] + first_row * row_bytes
        )
        return out

    def extra_bytes(self, stored: str) -> bytes:
        """An extra tensor's data, byte for byte."""
        path = self.extras[stored][0]
        buf = bytearray(self.extra_sizes[stored])
        self._read_into(path, stored, memoryview(buf), self.extra_offsets[stored])
        return bytes(buf)

    def _read_into(self, path: Path, name: str, buf: memoryview, start: int) -> None:
        pos = 0
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                while pos < len(buf):
                    got = os.preadv(fd, [buf[pos:]], start + pos)
                    if got <= 0:
                        raise CheckpointError(f"{path}: tensor {name} is cut short (truncated?)")
                    pos += got
            finally:
                os.close(fd)
        except OSError as e:  # removed or replaced since the headers were read, I/O error
            error = e.strerror or e
            raise CheckpointError(f"{path}: cannot read tensor {name} ({error})") from None

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
        os.chmod(tmp, 0o666 & ~UMASK)  # safetensors creates its files 0600
        fsync_file(tmp)
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
        atomic_write(out / INDEX_NAME, json.dumps(index, indent=2))


def is_hf_checkpoint(path: str | os.PathLike) -> bool:
    """A directory holding an HF safetensors checkpoint (what `--force` may replace)."""
    path = Path(path)
    return (path / "config.json").is_file() and ((path / SINGLE_NAME).is_file() or (path / INDEX_NAME).is_file())


def write_hf_directory(
    out: str | os.PathLike,
    tensors: Iterable[tuple[str, np.ndarray]],
    config: dict,
    shard_bytes: int,
    force: bool,
    files: Mapping[str, bytes] = {},
) -> Path:
    """An HF checkpoint directory (shards, index, config.json, `files` by name) from `tensors`,
    written atomically; a non-empty `out` needs `force` and must hold an HF checkpoint."""
    work = prepare_destination(out, force, replaceable=is_hf_checkpoint, kind="HF checkpoint")
    try:
        write_checkpoint(work, tensors, shard_bytes=shard_bytes)
        write_json(work / "config.json", config, indent=2)
        for name, data in files.items():
            atomic_write(work / name, data)
    except BaseException:
        discard(work)
        raise
    commit(work, Path(out))
    return Path(out)
