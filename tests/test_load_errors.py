"""Bad checkpoints: one clear error naming the file and tensor; the CLI exits 2 (in this process for
each damage, and in a fresh one, as a user runs it, for one)."""

import json
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moe_jax
from converters.safetensors_io import CheckpointError
from moe_jax.files import temp_dirs
from tests.helpers import run_main


@pytest.fixture
def ckpt(checkpoints, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints["wide_fp8_sharded"], dst)
    return dst


def edit_shard(path, fn):
    """Rewrite the shard holding kv_b_proj of layer 1 after fn(tensors)."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"]["model.layers.1.self_attn.kv_b_proj.weight"]
    tensors = load_file(shard)
    fn(tensors)
    save_file(tensors, shard)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or v != shard.name}
    for k in tensors:
        index["weight_map"][k] = shard.name
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return shard


def corrupt_header(path):
    """Point one tensor's data past the end of its shard."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"][NAME]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    start, end = header[NAME]["data_offsets"]
    header[NAME]["data_offsets"] = [start + 10**6, end + 10**6]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def drop(name):
    return lambda t: t.pop(name)


NAME = "model.layers.1.self_attn.kv_b_proj.weight"
NORM = "model.layers.1.input_layernorm.weight"  # stored in the same shard as NAME


@pytest.mark.parametrize(
    "make_bad, words",
    [
        (lambda p: edit_shard(p, drop(NAME)), NAME),
        (lambda p: edit_shard(p, drop(NAME + "_scale_inv")), NAME + "_scale_inv is missing"),
        (
            lambda p: edit_shard(p, lambda t: t.update({"model.extra": np.zeros(3, np.float32)})),
            "tensor model.extra is not part",
        ),
        (lambda p: edit_shard(p, lambda t: t.update({NAME: t[NAME][:-1]})), "has shape"),
        (
            lambda p: edit_shard(
                p, lambda t: t.update({NAME + "_scale_inv": np.full_like(t[NAME + "_scale_inv"], np.inf)})
            ),
            "NaN or Inf",
        ),
        (lambda p: edit_shard(p, lambda t: t.update({NORM: np.full_like(t[NORM], np.nan)})), NORM + " contains NaN"),
        (
            lambda p: (p / json.loads((p / "model.safetensors.index.json").read_text())["weight_map"][NAME]).unlink(),
            "is missing",
        ),
        (
            lambda p: (p / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {NAME: "../outside.safetensors"}})
            ),
            "outside",
        ),
        (lambda p: [f.write_bytes(f.read_bytes()[:1000]) for f in p.glob("model-00001*")], "model-00001"),
        (
            lambda p: [f.unlink() for f in p.glob("*.safetensors*")] + [(p / "pytorch_model.bin").write_bytes(b"x")],
            "pickle",
        ),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps({**json.loads((p / "config.json").read_text()), "hidden_size": 208})
            ),
            "has shape",
        ),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps({**json.loads((p / "config.json").read_text()), "model_type": "llama"})
            ),
            "model_type",
        ),
        (corrupt_header, "model-0000"),
    ],
)
def test_bad_checkpoint_is_one_clear_error(ckpt, make_bad, words, tmp_path):
    make_bad(ckpt)
    with pytest.raises((CheckpointError, moe_jax.ConfigError), match=words):
        moe_jax.from_pretrained(ckpt)
    # the converter: exit 2, one line naming the file (and tensor), and no output left behind
    dst = tmp_path / "out"
    code, _, err = run_main("convert", "--from", "hf", ckpt, "--to", dst)
    assert_convert_error(code, err, words, ckpt, dst)


def assert_convert_error(code, stderr, words, ckpt, dst):
    lines = [line for line in stderr.splitlines() if "error" in line]
    assert code == 2, stderr[-2000:]
    assert len(lines) == 1 and stderr.strip().endswith(lines[0]), stderr[-2000:]
    assert re.search(words, lines[0]) and str(ckpt) in lines[0], lines
    assert not dst.exists() and not temp_dirs(dst)


def test_cli_bad_input_exits_2_with_one_line(ckpt, tmp_path):
    """In a fresh process, as a user runs them: validate and convert exit 2 with one line (no
    warnings, no shutdown noise)."""
    edit_shard(ckpt, drop(NAME))
    proc = subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", "validate", "--hf", str(ckpt)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and NAME in lines[0] and "error" in lines[0], proc.stderr
    dst = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", "convert", "--from", "hf", str(ckpt), "--to", str(dst)],
        capture_output=True,
        text=True,
    )
    assert_convert_error(proc.returncode, proc.stderr, NAME, ckpt, dst)


def test_model_inputs_and_options_are_checked(checkpoints, converted, tmp_path):
    """Bad inputs to the Python API: a ValueError naming the argument, never a wrong result."""
    model = moe_jax.from_pretrained(checkpoints["flat_single"])
    vocab, ok = model.config.vocab_size, np.ones((1, 4), np.int32)
    cases = [
        (lambda: model(np.array([[1, 2, vocab]])), f"tokens: ids must be in [0, {vocab})"),
        (lambda: model(np.array([[1, -1]])), "tokens: ids must be in"),
        (lambda: model(np.array([[1.5, 2.0]])), "tokens: expected integers, got float64"),
        (lambda: model(np.zeros((0, 4), np.int32)), "tokens: expected token ids shaped [batch, sequence]"),
        (lambda: model(np.array([1, 2, 3])), "got shape (3,)"),
        (lambda: model.apply(ok, segment_ids=np.ones((1, 3), np.int32)), "segment_ids: shape (1, 3)"),
        (lambda: model.apply(ok, positions=np.ones(4, np.int32)), "positions: shape (4,)"),
        (lambda: moe_jax.from_pretrained(checkpoints["flat_single"], mesh=4), "mesh: expected a jax Mesh"),
        (lambda: moe_jax.from_pretrained(checkpoints["flat_single"], mesh="data=-1,expert=-1"), "-1 (the rest"),
        (lambda: moe_jax.from_pretrained(checkpoints["flat_single"], mtp=True), "has no MTP layers"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert words in str(e.value), (words, str(e.value))
    # a converted checkpoint of a format this version does not know
    copy = tmp_path / "future"
    shutil.copytree(converted("base_sharded"), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format": "moe-jax/9"}))
    with pytest.raises(CheckpointError, match="'moe-jax/9', not a moe-jax format this version reads"):
        moe_jax.from_pretrained(copy)
