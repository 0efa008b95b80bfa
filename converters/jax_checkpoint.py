"""The moe-jax checkpoint directory: its format, its writers' shared steps and its one reader.

    DST/config.json        the HF config, verbatim
    DST/manifest.json      format, dtype, MTP, every leaf's shape and dtype, every HF tensor
                           (source file and dtype, parameter and index), and the size and crc32
                           of every other file of the directory
    DST/state/             one zarr v2 array per leaf (Orbax's PyTree layout, no OCDBT) of
                           {"params": ..., "buffers": ..., ["fp8_scales": ...]}
    DST/hf/                tokenizer and generation files of the source, copied as they are

`convert` writes the arrays itself through TensorStore, one HF tensor (one chunk) at a time, so
a 671B model never sits in host memory; `train` writes its final model with Orbax. Both finish
with `finish`: integrity records, manifest, side files, atomic rename. Everything that reads
one (`from_pretrained`, `export`, `validate`, `train`) goes through `Checkpoint`, which checks
every file against its record before it uses a byte of it, and reads only the chunks asked for:
each host of a multi-host run restores (and checks) just the chunks its devices hold.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.experimental import multihost_utils

from converters import fp8, int4
from converters.extras import FILE as EXTRAS_FILE
from converters.extras import read_extras, write_extras
from converters.load import expected_count
from converters.safetensors_io import NP_TO_ST, CheckpointReader
from moe_jax.config import ConfigError, ModelConfig
from moe_jax.errors import IntegrityError
from moe_jax.files import (
    CheckpointError,
    commit,
    discard,
    file_records,
    prepare_destination,
    read_json_object,
    verify_files,
    walk_files,
    write_json,
)
from moe_jax.params import Entry, entries, leaf_dtype, param_shapes, set_path

STATE = "state"
SCALES = "fp8_scales"  # the subtree beside params/buffers that keeps an FP8 source's block scales
INT4_SCALES = "int4_scales"  # ... and an INT4 source's group scales
MANIFEST = "manifest.json"
FORMAT = "moe-jax/2"  # moe-jax/1: no integrity records
SIDE_FILES = "hf"
# Files of an HF repo that are not weights but travel with them (export writes them back).
# Tokenizers (tokenizer.json, tiktoken.model, ...), generation and processor settings, chat
# templates, and the model's own code that config.json's auto_map names (copied, never run), so
# that an export loads as its source did; also its license and card.
HF_EXTRA = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|generation_config\.json|.*\.tiktoken|.*\.model|.*\.py|.*\.jinja"
    r"|(pre)?processor_config\.json|chat_template\.json|LICENSE.*|README\.md)$"
)
LEAF_DTYPES = {"float32", "bfloat16", "float16"}


def leaf_name(path: tuple[str, ...]) -> str:
    return ".".join(path)


def scale_path(entry: Entry, int4: bool = False) -> tuple[str, ...]:
    """The leaf that keeps the FP8 block scales (or INT4 group scales) of a parameter converted
    from a quantized source."""
    return (INT4_SCALES if int4 else SCALES, *entry.path[1:])


def is_jax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def side_files(directory: Path) -> list[Path]:
    """The tokenizer and generation files of an HF directory (or of a checkpoint's `hf/`)."""
    if is_jax_checkpoint(directory):
        directory = directory / SIDE_FILES
    if not directory.is_dir():
        return []
    return [f for f in sorted(directory.iterdir()) if f.is_file() and HF_EXTRA.match(f.name)]


# ---- writing -----------------------------------------------------------------------------------
def zarr_dtype(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def array_spec(state_dir: Path, name: str) -> dict:
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(state_dir / name)}}


def create_arrays(state_dir: Path, leaves: dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype, tuple[int, ...]]]):
    """Create one uncompressed zarr array per leaf: path -> (shape, dtype, chunk shape). Returns
    TensorStores. A chunk file then holds exactly the chunk's bytes in C order."""
    stores = {}
    for path, (shape, dtype, chunks) in leaves.items():
        spec = array_spec(state_dir, leaf_name(path))
        spec["metadata"] = {
            "shape": list(shape),
            "chunks": list(chunks),
            "dtype": zarr_dtype(dtype),
            "compressor": None,
            "fill_value": None,
            "order": "C",
            "dimension_separator": ".",
        }
        stores[path] = ts.open(spec, create=True, delete_existing=True).result()
    return stores


def chunk_file(path: tuple[str, ...], chunk: Iterable[int]) -> str:
    """Relative path of a chunk's file: state/<leaf>/<i.j.k>."""
    return f"{STATE}/{leaf_name(path)}/{'.'.join(map(str, chunk)) or '0'}"


def write_tree_metadata(state_dir: Path, leaves: dict[tuple[str, ...], tuple[int, ...]]) -> None:
    """The `_METADATA` Orbax reads for a PyTree checkpoint of zarr v2 arrays without OCDBT (so
    that Orbax can restore our checkpoints too)."""
    tree = {
        str(path): {
            "key_metadata": [{"key": k, "key_type": 2} for k in path],
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(shape)},
        }
        for path, shape in leaves.items()
    }
    meta = {
        "tree_metadata": tree,
        "use_ocdbt": False,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    write_json(state_dir / "_METADATA", meta, indent=None)


def leaf_record(shape: Iterable[int], dtype) -> dict:
    """The manifest's record of one leaf (array) of the state."""
    return {"shape": list(shape), "dtype": np.dtype(dtype).name}


def tensor_record(entry: Entry, file: str | None, source_dtype: str, shape_dtype: str | None = None) -> dict:
    """The manifest's record of one HF tensor: the file and dtype it came in as (and for packed
    INT4, the dtype of its stored shape), and the parameter slot it fills (or the top-level
    parameter it is a tied copy of)."""
    record = {"file": file, "source_dtype": source_dtype}
    if shape_dtype is not None:
        record["shape_dtype"] = shape_dtype
    if entry.rule.tied_to:
        record["tied_to"] = entry.rule.tied_to
    else:
        record.update(param=leaf_name(entry.path), index=list(entry.index))
    return record


def model_manifest(source: str, dtype: str, mtp: bool, leaves: dict[str, dict], tensors: dict[str, dict]) -> dict:
    """What every writer records about the model (`finish` adds the format and the integrity records)."""
    return {"source": source, "dtype": dtype, "mtp": mtp, "leaves": leaves, "tensors": tensors}


def finish(
    work: Path,
    dst: Path,
    config_text: str,
    manifest: dict,
    files: Iterable[Path] = (),
    known: dict[str, tuple[int, int]] | None = None,
) -> None:
    """The last steps of every writer: config, side files, integrity records (`known`: crc32s
    computed while writing), manifest, then the atomic rename of `work` to `dst`."""
    (work / "config.json").write_text(config_text)
    files = list(files)
    if files:
        (work / SIDE_FILES).mkdir()
        for f in files:
            shutil.copyfile(f, work / SIDE_FILES / f.name)
    manifest = {"format": FORMAT, **manifest, "files": file_records(work, skip=[MANIFEST], known=known or {})}
    write_json(work / MANIFEST, manifest)
    commit(work, dst)


def is_previous_checkpoint(path: Path) -> bool:
    """What `--force` may replace: a directory that holds a moe-jax checkpoint."""
    return is_jax_checkpoint(path)


def save_model(
    dst: str | Path,
    config: dict,
    tree: dict,
    source: str,
    source_dtypes: dict[str, str] | None = None,
    hf_files: Iterable[Path] = (),
    extras: CheckpointReader | None = None,
    scales_from: "Checkpoint | None" = None,
    inputs: Iterable[Path] = (),
) -> Path:
    """Write a model held as (possibly sharded, multi-process) jax arrays {params, buffers} in
    the format above, atomically: what `train` writes at the end, for `export` and
    `from_pretrained`. `source_dtypes`: HF name -> the dtype the weights came in as (for
    `export --dtype source`; default: the parameter's own dtype); `hf_files`: tokenizer and
    generation files to hand on to the export; `extras`: tensors besides the model, carried
    through (converters.extras); `scales_from`: the converted checkpoint training started from,
    whose FP8/INT4 scales are kept, so that export writes back the source's bytes for every
    block or group whose values training left on their grid."""
    dst = Path(dst)
    cfg = ModelConfig.from_hf_dict(config)
    mtp = "mtp" in tree["params"]
    lead = jax.process_index() == 0
    work = prepare_destination(dst, True, inputs, is_previous_checkpoint, "moe-jax checkpoint") if lead else None
    work = Path(broadcast_text(str(work)))  # every process writes its shards into the lead's work dir
    try:
        checkpointer = ocp.Checkpointer(
            ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False, type_handler_registry=array_handlers())
        )
        _quiet_ocdbt_merge_notice()
        checkpointer.save(work.absolute() / STATE, {"params": tree["params"], "buffers": tree["buffers"]})
        if lead:
            leaves = {
                leaf_name(tuple(k.key for k in kp)): leaf_record(x.shape, x.dtype)
                for kp, x in jax.tree_util.tree_leaves_with_path(tree)
            }
            records = {}
            for e in entries(cfg, mtp):
                own = NP_TO_ST[leaves[leaf_name(e.path)]["dtype"]]
                shape_dtype = scales_from.tensors.get(e.hf_name, {}).get("shape_dtype") if scales_from else None
                records[e.hf_name] = tensor_record(e, None, (source_dtypes or {}).get(e.hf_name, own), shape_dtype)
            if scales_from is not None:
                leaves |= copy_scales(scales_from, work, leaves)
            dtype = np.dtype(leaves["params.embed"]["dtype"]).name
            manifest = model_manifest(source, dtype, mtp, leaves, records)
            if extras is not None:
                write_extras(extras, work)
            finish(work, dst, json.dumps(config, indent=2), manifest, sorted(hf_files))
    except BaseException:
        if lead:
            discard(work)
        raise
    sync_processes("save_model: committed")
    return dst


def copy_scales(src: "Checkpoint", work: Path, leaves: dict[str, dict]) -> dict[str, dict]:
    """The FP8/INT4 scale arrays of `src` whose parameter is among `leaves`, copied (each file
    checked against its integrity record first) into `work`; returns their leaf records."""
    copied = {}
    for name, leaf in src.leaves.items():
        subtree, _, rest = name.partition(".")
        if subtree in (SCALES, INT4_SCALES) and f"params.{rest}" in leaves:
            src.check_files(rel for rel in src.files or () if rel.startswith(f"{STATE}/{name}/"))
            shutil.copytree(src.path / STATE / name, work / STATE / name)
            copied[name] = leaf
    return copied


# Orbax's default on CPU splits the write of each replicated array among its replicas, compiling a
# slice program per array shape on the first save: 20 s of CPU for the tiny model's training state
# on 8 devices, for nothing on arrays this small. Arrays whose slice per replica is under this are
# written whole by one replica (as on GPUs, where Orbax does not split at all).
REPLICA_PARALLEL_MIN_BYTES = 1 << 20


def array_handlers() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's handler registry for what we save (jax arrays only), with the threshold above."""
    th = ocp.type_handlers
    handler = th.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES)
    return th.create_type_handler_registry((jax.Array, handler))


class _NoOcdbtMergeNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Skipping merge of OCDBT checkpoints" not in record.getMessage()


def _quiet_ocdbt_merge_notice() -> None:
    """Orbax's finalize always tries to merge per-process OCDBT files, and warns when there are
    none: on every save that does not use OCDBT, as ours (one zarr array per leaf) does."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _NoOcdbtMergeNotice) for f in logger.filters):
        logger.addFilter(_NoOcdbtMergeNotice())


def rerecord(dst: str | Path) -> None:
    """Record the integrity of a checkpoint again after editing its arrays in place on purpose."""
    dst = Path(dst)
    manifest = read_json_object(dst / MANIFEST, "a moe-jax checkpoint's manifest")
    manifest["files"] = file_records(dst, skip=[MANIFEST])
    write_json(dst / MANIFEST, manifest)


def broadcast_text(text: str, size: int = 4096) -> str:
    """The lead process's `text` (up to `size` bytes of UTF-8), in every process."""
    if jax.process_count() == 1:
        return text
    raw = np.zeros(size, np.uint8)
    data = text.encode()[:size]
    raw[: len(data)] = np.frombuffer(data, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(raw))).rstrip(b"\0").decode()


def sync_processes(name: str) -> None:
    """A barrier across the processes of a multi-process run (a no-op in one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


# ---- reading -----------------------------------------------------------------------------------
def _check_manifest(path: Path, m: dict) -> None:
    """The manifest's shape, checked before anything trusts it."""

    def bad(key: str, why: str):
        raise CheckpointError(f"{path}: {key} {why}; the manifest is damaged (reconvert or restore it)")

    if m.get("format") not in ("moe-jax/1", FORMAT):
        bad("'format'", f"is {m.get('format')!r}, not a moe-jax format this version reads (moe-jax/1, {FORMAT})")
    for key, kind in (("leaves", dict), ("tensors", dict), ("mtp", bool), ("dtype", str)):
        if not isinstance(m.get(key), kind):
            bad(f"'{key}'", f"is missing or not a {kind.__name__}")
    if m["dtype"] not in LEAF_DTYPES:
        bad("'dtype'", f"is {m['dtype']!r}, not one of {', '.join(sorted(LEAF_DTYPES))}")
    for name, leaf in m["leaves"].items():
        shape = leaf.get("shape") if isinstance(leaf, dict) else None
        ok = isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        if not ok or leaf.get("dtype") not in LEAF_DTYPES:
            bad(f"leaf {name!r}", "has no valid shape and dtype")
    for name, rec in m["tensors"].items():
        if not isinstance(rec, dict) or not isinstance(rec.get("source_dtype"), str):
            bad(f"tensor {name!r}", "has no valid record")
        if "tied_to" not in rec and (rec.get("param") not in m["leaves"] or not isinstance(rec.get("index"), list)):
            bad(f"tensor {name!r}", "names no parameter of this checkpoint")
    files = m.get("files")
    if files is not None and not (
        isinstance(files, dict) and all(isinstance(v, list) and len(v) == 2 for v in files.values())
    ):
        bad("'files'", "is not a table of [size, crc32]")
    if files is None and m["format"] != "moe-jax/1":
        bad("'files'", "(the integrity records) is missing")


def _region(index, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """[(start, stop)] per dimension of `index` (ints and slices over the leading dims)."""
    index = index if isinstance(index, tuple) else (index,)
    out = []
    for d, size in enumerate(shape):
        i = index[d] if d < len(index) else slice(None)
        if isinstance(i, slice):
            start, stop, _ = i.indices(size)
            out.append((start, max(start, stop)))
        else:
            i = int(i)
            out.append((i, i + 1))
    return out


class Checkpoint:
    """A moe-jax checkpoint directory: manifest and config read once, every file checked against
    its integrity record before use."""

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        self.manifest = read_json_object(manifest_path, "a moe-jax checkpoint's manifest")
        _check_manifest(manifest_path, self.manifest)
        self.files: dict[str, list[int]] | None = self.manifest.get("files")
        self.verify_reads = verify and self.files is not None
        if self.files is None and verify:
            print(
                f"warning: {self.path}: written by an older moe-jax without integrity records; "
                f"its files are not checked (reconvert to get them)",
                file=sys.stderr,
            )
        self._verified: set[str] = set()
        self.check_files(["config.json"])
        self.config = read_json_object(self.path / "config.json", "the model's config.json")
        try:
            self.cfg = ModelConfig.from_hf_dict(self.config)
        except ConfigError as e:
            raise ConfigError(f"{self.path / 'config.json'}: {e}") from None
        if expected_count(self.cfg, self.mtp) != len(self.tensors):  # before anything expands the config
            raise CheckpointError(
                f"{manifest_path}: lists {len(self.tensors)} tensors, its config.json implies "
                f"{expected_count(self.cfg, self.mtp)}"
            )
        self._check_leaves()
        self._stores: dict[str, Any] = {}
        self._chunks: dict[str, tuple[int, ...]] = {}

    def _check_leaves(self) -> None:
        """The arrays are those config.json implies: every parameter with its shape and dtype, and
        FP8/INT4 scales of the shape their weights imply (a config edited after conversion, or an
        array's shape changed in its metadata and the manifest, is caught before anything is read)."""
        want = {
            leaf_name(path): (shape, leaf_dtype(rule, self.dtype).name)
            for path, (shape, rule) in param_shapes(self.cfg, self.mtp).items()
        }
        for e in entries(self.cfg, self.mtp):
            if not e.rule.tied_to and len(e.hf_shape) == 2:
                want[leaf_name(scale_path(e))] = (e.stack + fp8.scale_shape(e.hf_shape), "float32")
                if self.cfg.int4_group_size:  # its scales keep the source's dtype
                    shape = e.stack + int4.scale_shape(e.hf_shape, self.cfg.int4_group_size)
                    want[leaf_name(scale_path(e, int4=True))] = (shape, None)
        for name, leaf in self.leaves.items():
            if name not in want:
                raise CheckpointError(
                    f"{self.path / MANIFEST}: array {name} is not a parameter of the model {self.path / 'config.json'} "
                    "describes"
                )
            shape, dtype = want[name]
            if tuple(leaf["shape"]) != tuple(shape) or leaf["dtype"] != (dtype or leaf["dtype"]):
                raise CheckpointError(
                    f"{self.path / MANIFEST}: parameter {name} is {leaf['dtype']} {leaf['shape']}, but "
                    f"{self.path / 'config.json'} implies {dtype} {list(shape)}; the config or the arrays were "
                    "altered (reconvert or restore the checkpoint)"
                )
        missing = [name for name in want if name.startswith(("params.", "buffers.")) and name not in self.leaves]
        if missing:
            raise CheckpointError(
                f"{self.path / MANIFEST}: no array for parameter {missing[0]}, which {self.path / 'config.json'} implies"
            )

    # ---- manifest facts
    @property
    def leaves(self) -> dict[str, dict]:
        return self.manifest["leaves"]

    @property
    def tensors(self) -> dict[str, dict]:
        return self.manifest["tensors"]

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def mtp(self) -> bool:
        return self.manifest["mtp"]

    @property
    def source(self) -> str:
        return str(self.manifest.get("source", ""))

    def source_dtypes(self) -> dict[str, str]:
        return {name: rec["source_dtype"] for name, rec in self.tensors.items()}

    def side_files(self) -> list[Path]:
        return side_files(self.path)

    def extra_tensors(self) -> CheckpointReader | None:
        """The tensors besides the model (converters.extras), their file checked first; None if none."""
        extras = read_extras(self.path)
        if extras is not None:
            self.check_files([EXTRAS_FILE])
        return extras

    # ---- integrity
    def describe(self, rel: str) -> str:
        """What a file of the checkpoint holds, for error messages."""
        parts = rel.split("/")
        if len(parts) != 3 or parts[0] != STATE:
            return {"config.json": "the model config"}.get(rel, "side file" if parts[0] == SIDE_FILES else "")
        leaf, key = parts[1], parts[2]
        if key.startswith("."):
            return f"metadata of parameter {leaf}"
        try:
            chunk = [int(k) for k in key.split(".")]
        except ValueError:
            return f"parameter {leaf}"
        param, what = leaf, ""
        for subtree, kind in ((SCALES, "FP8"), (INT4_SCALES, "INT4")):
            if leaf.startswith(subtree + "."):
                param, what = "params." + leaf[len(subtree) + 1 :], f"{kind} scales of "
        for hf, rec in self.tensors.items():
            if rec.get("param") == param and chunk[: len(rec["index"])] == rec["index"]:
                return f"{what}tensor {hf}, parameter {leaf}{rec['index'] or ''}"
        return f"parameter {leaf} chunk {key}"

    def check_files(self, rels: Iterable[str]) -> int:
        """Check these files (relative paths) once each; returns the bytes checked."""
        if not self.verify_reads:
            return 0
        todo = [r for r in rels if r not in self._verified]  # one not in the records is an error
        if not todo:
            return 0
        n = verify_files(self.path, self.files, todo, self.describe)
        self._verified.update(todo)
        return n

    def verify(self) -> tuple[int, int]:
        """Check every file of the checkpoint: (files, bytes). Also no file missing from the records."""
        if self.files is None:
            raise CheckpointError(f"{self.path / MANIFEST}: no integrity records (written by moe-jax/1); reconvert")
        extra = sorted(set(walk_files(self.path, skip=[MANIFEST])) - set(self.files))
        if extra:
            raise CheckpointError(
                f"{self.path / extra[0]}: not in the manifest's integrity records "
                f"(added after the checkpoint was written)"
            )
        n = verify_files(self.path, self.files, None, self.describe)
        for name in self.leaves:  # the arrays are what the manifest says
            self._store(name)
        return len(self.files), n

    # ---- arrays
    def _store(self, name: str):
        if name not in self._stores:
            if name not in self.leaves:
                raise CheckpointError(f"{self.path}: no parameter {name} in this checkpoint")
            self.check_files([f"{STATE}/{name}/.zarray"])
            try:
                store = ts.open(array_spec(self.path / STATE, name), open=True, read=True).result()
            except ValueError as e:
                raise CheckpointError(
                    f"{self.path / STATE / name}: unreadable array for parameter {name} ({str(e).splitlines()[0]})"
                ) from None
            leaf, dtype = self.leaves[name], np.dtype(store.dtype.numpy_dtype).name
            if tuple(store.shape) != tuple(leaf["shape"]) or dtype != leaf["dtype"]:
                raise CheckpointError(
                    f"{self.path / MANIFEST}: parameter {name} is recorded as {leaf['dtype']} {leaf['shape']}, but "
                    f"its array ({self.path / STATE / name}) is {dtype} {list(store.shape)}; the manifest or the "
                    "array was altered (reconvert or restore the checkpoint)"
                )
            self._chunks[name] = tuple(store.chunk_layout.read_chunk.shape)
            self._check_chunks(name, tuple(store.shape))
            self._stores[name] = store
        return self._stores[name]

    def _check_chunks(self, name: str, shape: tuple[int, ...]) -> None:
        """Every chunk file the array's metadata implies exists: a missing one would read as zeros."""
        have = set(os.listdir(self.path / STATE / name))
        grid = [range(-(-n // c)) for n, c in zip(shape, self._chunks[name])]
        for chunk in itertools.product(*grid):
            rel = chunk_file(tuple(name.split(".")), chunk)
            if rel.rpartition("/")[2] not in have:
                raise IntegrityError(
                    f"{self.path / rel}: missing ({self.describe(rel)}); the checkpoint is incomplete or damaged"
                )

    def read(self, name: str | tuple[str, ...], index=()) -> np.ndarray:
        """The region `index` (ints and slices over leading dims) of a leaf, as numpy, after
        checking every chunk file it touches."""
        name = name if isinstance(name, str) else leaf_name(name)
        store = self._store(name)
        region = _region(index, tuple(store.shape))
        chunks = self._chunks[name]
        if all(stop > start for start, stop in region):
            ranges = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(region, chunks)]
            self.check_files(chunk_file(tuple(name.split(".")), k) for k in itertools.product(*ranges))
        try:
            return np.asarray(store[index].read().result())
        except ValueError as e:
            raise CheckpointError(
                f"{self.path / STATE / name}: cannot read parameter {name} ({str(e).splitlines()[0]})"
            ) from None

    def restore(self, shardings: Callable | None = None, subtrees: Iterable[str] = ("params", "buffers")) -> dict:
        """{params, buffers} as jax arrays, each placed by `shardings(path)` (default: the first
        local device); each process reads (and checks) only the chunks its devices hold."""
        device = jax.local_devices()[0]
        tree: dict = {}
        subtrees = tuple(subtrees)
        for name, leaf in self.leaves.items():
            path = tuple(name.split("."))
            if path[0] not in subtrees:
                continue
            sharding = shardings(path) if shardings else jax.sharding.SingleDeviceSharding(device)
            self._store(name)  # opened (and its shape and dtype checked against the manifest) before reading
            cache: dict = {}  # replicated leaves: one read for all local devices

            def region(index, name=name, cache=cache):
                key = tuple((s.start, s.stop) if isinstance(s, slice) else s for s in index)
                if key not in cache:
                    cache[key] = self.read(name, index)
                return cache[key]

            set_path(tree, path, jax.make_array_from_callback(tuple(leaf["shape"]), sharding, region))
        return tree


__all__ = ["Checkpoint", "CheckpointError", "create_arrays", "finish", "save_model", "is_jax_checkpoint", "scale_path"]
