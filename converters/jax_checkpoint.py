"""Our JAX checkpoint directory, written slot by slot, read by Orbax.

    DST/config.json        the HF config, verbatim
    DST/manifest.json      every HF tensor: source file, param path and index, dtype, shape, checksum
    DST/state/             an Orbax PyTree checkpoint (zarr v2 arrays, no OCDBT) of
                           {"params": ..., "buffers": ..., ["fp8_scales": ...]}
    DST/hf/                tokenizer and generation files of the source, copied as they are

Orbax saves whole arrays, so a 671B model would have to sit in host memory first. We write the
same on-disk format ourselves through TensorStore, one HF tensor (one chunk) at a time, and
restore with Orbax, which places every array straight onto a mesh, each host reading only the
chunks its devices hold. Chunks are one layer (and one expert) of a stacked parameter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import jax
import numpy as np
import tensorstore as ts

from converters.load import np_dtype, set_path
from converters.safetensors_io import write_text_atomic

STATE = "state"
MANIFEST = "manifest.json"


def leaf_name(path: tuple[str, ...]) -> str:
    return ".".join(path)


def zarr_dtype(dtype: np.dtype) -> str:
    dtype = np.dtype(dtype)
    return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def array_spec(state_dir: Path, path: tuple[str, ...]) -> dict:
    return {"driver": "zarr", "kvstore": {"driver": "file", "path": str(state_dir / leaf_name(path))}}


def create_arrays(state_dir: Path, leaves: dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype, tuple[int, ...]]]):
    """Create one zarr array per leaf: path -> (shape, dtype, chunk shape). Returns TensorStores."""
    stores = {}
    for path, (shape, dtype, chunks) in leaves.items():
        spec = array_spec(state_dir, path)
        spec["metadata"] = {
            "shape": list(shape), "chunks": list(chunks), "dtype": zarr_dtype(dtype), "compressor": None,
            "fill_value": None, "order": "C", "dimension_separator": ".",
        }  # fmt: skip
        stores[path] = ts.open(spec, create=True, delete_existing=True).result()
    return stores


def write_tree_metadata(state_dir: Path, leaves: dict[tuple[str, ...], tuple[int, ...]]) -> None:
    """The `_METADATA` Orbax reads for a PyTree checkpoint of zarr v2 arrays without OCDBT."""
    tree = {
        str(path): {
            "key_metadata": [{"key": k, "key_type": 2} for k in path],
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False, "write_shape": list(shape)},
        }
        for path, shape in leaves.items()
    }
    meta = {
        "tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True, "custom_metadata": None,
    }  # fmt: skip
    write_text_atomic(state_dir / "_METADATA", json.dumps(meta, sort_keys=True))


def open_array(dst: Path, path: tuple[str, ...]):
    return ts.open(array_spec(Path(dst) / STATE, path), open=True).result()


def read_manifest(dst: str | Path) -> dict:
    path = Path(dst) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not a moe-jax checkpoint (no manifest.json)") from None


def is_jax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).exists()


def restore(dst: str | Path, shardings: Any = None, subtrees: Iterable[str] = ("params", "buffers")) -> dict:
    """Restore the state with Orbax onto `shardings` (a function of the leaf path tuple returning
    a jax Sharding, or None for the first local device)."""
    import orbax.checkpoint as ocp  # slow to import; only restoring needs it

    manifest = read_manifest(dst)
    device = jax.local_devices()[0]
    item, restore_args = {}, {}
    for name, leaf in manifest["leaves"].items():
        path = tuple(name.split("."))
        if path[0] not in subtrees:
            continue
        sharding = shardings(path) if shardings else jax.sharding.SingleDeviceSharding(device)
        set_path(item, path, jax.ShapeDtypeStruct(tuple(leaf["shape"]), np_dtype(leaf["dtype"]), sharding=sharding))
        set_path(restore_args, path, ocp.ArrayRestoreArgs(sharding=sharding))
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False))
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    return checkpointer.restore(Path(dst).absolute() / STATE, args=args)


def save_model(dst: str | Path, config: dict, tree: dict, source: str, source_dtypes: dict[str, str] | None = None,
               hf_files: Iterable[Path] = ()) -> Path:  # fmt: skip
    """Write a model held as (possibly sharded, multi-process) jax arrays {params, buffers} in
    the format above, atomically: what `train` writes at the end, for `export` and
    `from_pretrained`. `source_dtypes`: HF name -> the dtype the weights came in as (for
    `export --dtype source`; default: the parameter's own dtype); `hf_files`: tokenizer and
    generation files to hand on to the export."""
    import orbax.checkpoint as ocp

    from converters.convert import commit, prepare_destination
    from converters.mapping import entries
    from converters.safetensors_io import NP_TO_ST
    from moe_jax.config import ModelConfig

    dst = Path(dst)
    cfg = ModelConfig.from_hf_dict(config)
    mtp = "mtp" in tree["params"]
    lead = jax.process_index() == 0
    work = dst.parent / f".{dst.name}.partial"
    if lead:
        work = prepare_destination(dst, force=True)
    _sync("save_model: work dir")
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False))
    checkpointer.save(work.absolute() / STATE, {"params": tree["params"], "buffers": tree["buffers"]})
    if lead:
        leaves = {
            leaf_name(tuple(k.key for k in kp)): {"shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
            for kp, x in jax.tree_util.tree_leaves_with_path(tree)
        }
        records = {}
        for e in entries(cfg, mtp):
            if e.rule.tied_to:
                records[e.hf_name] = {"file": None, "source_dtype": (source_dtypes or {}).get(e.hf_name, "F32"),
                                      "tied_to": e.rule.tied_to}  # fmt: skip
                continue
            own = NP_TO_ST[leaves[leaf_name(e.path)]["dtype"]]
            records[e.hf_name] = {"file": None, "source_dtype": (source_dtypes or {}).get(e.hf_name, own),
                                  "param": leaf_name(e.path), "index": list(e.index)}  # fmt: skip
        dtype = np.dtype(leaves["params.embed"]["dtype"]).name
        manifest = {"format": "moe-jax/1", "source": source, "dtype": dtype, "mtp": mtp, "leaves": leaves, "tensors": records}
        write_text_atomic(work / MANIFEST, json.dumps(manifest, indent=1))
        write_text_atomic(work / "config.json", json.dumps(config, indent=2))
        hf_files = sorted(hf_files)
        if hf_files:
            import shutil

            (work / "hf").mkdir()
            for f in hf_files:
                shutil.copyfile(f, work / "hf" / f.name)
        commit(work, dst)
    _sync("save_model: committed")
    return dst


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
