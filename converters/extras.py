"""Tensors a checkpoint holds besides the DeepSeek-V3 language model: a multimodal wrapper's vision
tower and projector, rotary buffers, anything else outside the model's namespace
(`safetensors_io.is_model_name`). They are carried through `convert`, `train` and `export` byte for
byte, so that an export is as complete as its source.

A moe-jax checkpoint keeps them in `extra/model.safetensors` (absent when there are none), under
the names they were stored under.
"""

from __future__ import annotations

from pathlib import Path

from converters.safetensors_io import SINGLE_NAME, CheckpointReader, ShardWriter

DIR = "extra"


def write_extras(source: CheckpointReader, work: Path) -> None:
    """The source's extra tensors into `work/extra/` (nothing when it has none)."""
    if not source.extras:
        return
    (work / DIR).mkdir()
    specs = [(name, dtype, shape) for name, (_, dtype, shape) in source.extras.items()]
    writer = ShardWriter(work / DIR / SINGLE_NAME, specs, {"format": "pt"})
    for name in source.extras:
        writer.write(name, source.extra_bytes(name))
    writer.close()


FILE = f"{DIR}/{SINGLE_NAME}"  # relative to the checkpoint, as its integrity records name it


def read_extras(checkpoint_dir: Path) -> CheckpointReader | None:
    """The extra tensors of a moe-jax checkpoint (None when it has none), unchecked: use
    `Checkpoint.extra_tensors`, which checks the file against its record first."""
    path = Path(checkpoint_dir) / DIR
    return CheckpointReader(path) if path.is_dir() else None
