"""`convert --from hf` and `export`: bit-identical round trips, FP8 kept exactly, atomic output."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import torch
from safetensors.numpy import load_file, save_file

import moe_jax
from converters import convert as convert_mod
from converters import fp8
from converters.convert import convert_hf
from converters.export import export_hf
from converters.jax_checkpoint import Checkpoint, array_spec, rerecord
from converters.tiny import make_tiny
from moe_jax.files import temp_dirs
from tests.conftest import random_tokens
from tests.helpers import INTERRUPTIBLE_CLI, all_tensors, assert_bit_identical, run_cli, run_main
from validation.reference import load_reference


@pytest.mark.parametrize("name", ["base_sharded", "base_bf16_single", "wide_fp8_sharded", "base_fp8_single"])
def test_round_trip_is_bit_identical(checkpoints, tmp_path, name):
    src = checkpoints[name]
    dst, out = tmp_path / "jax", tmp_path / "hf"
    code, _, err = run_main("convert", "--from", "hf", src, "--to", dst)
    assert code == 0, err
    code, _, err = run_main("export", "--from", dst, "--to", out, "--shard-size", "300KB")
    assert code == 0, err
    assert_bit_identical(all_tensors(src), all_tensors(out))
    assert (out / "model.safetensors.index.json").exists()  # several 300 KB shards
    config = json.loads((out / "config.json").read_text())
    assert ("quantization_config" in config) == ("fp8" in name)
    # the converted checkpoint computes what the source does
    tokens = random_tokens(config["vocab_size"], 2, 32)  # test_parity's shape: its compilation
    manifest = Checkpoint(dst).manifest
    want = moe_jax.from_pretrained(src, dtype=manifest["dtype"])(tokens)
    np.testing.assert_array_equal(np.asarray(moe_jax.from_pretrained(dst)(tokens)), np.asarray(want))


def test_fp8_export_from_fp8_source_is_bit_identical(checkpoints, converted, tmp_path):
    src = checkpoints["wide_fp8_sharded"]
    export_hf(converted("wide_fp8_sharded"), tmp_path / "hf", dtype="fp8", progress=False)
    assert_bit_identical(all_tensors(src), all_tensors(tmp_path / "hf"))


@torch.no_grad()
def test_exports_load_in_transformers_with_the_source_logits(checkpoints, converted, tmp_path):
    from transformers import DeepseekV3ForCausalLM

    src = checkpoints["base_sharded"]  # float32
    export_hf(converted("base_sharded"), tmp_path / "hf", progress=False)
    tokens = torch.as_tensor(random_tokens(256), dtype=torch.long)
    want = DeepseekV3ForCausalLM.from_pretrained(src, dtype=torch.float32)(tokens).logits
    got = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)(tokens).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    # an FP8 source exported as bf16 loads as a plain model: its weights are the dequantized ones
    fp8_src = checkpoints["wide_fp8_sharded"]
    export_hf(converted("wide_fp8_sharded"), tmp_path / "hf16", dtype="bfloat16", progress=False)
    assert "quantization_config" not in json.loads((tmp_path / "hf16" / "config.json").read_text())
    model = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf16", dtype=torch.bfloat16)
    ref = load_reference(fp8_src, "bfloat16")
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], p, rtol=0, atol=0, msg=name)


def test_trained_weights_get_new_scales_only_where_they_moved(checkpoints, tmp_path):
    src = checkpoints["wide_fp8_sharded"]
    dst = tmp_path / "jax"
    convert_hf(src, dst, progress=False)
    # "training" moves one 128x128 block of one expert's up_proj in layer 1 (stored transposed)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    arr = ts.open(array_spec(dst / "state", "params.moe.experts.up"), open=True).result()
    slot = np.asarray(arr[0, 3].read().result())  # [H=200, I=136] = HF [136, 200].T
    moved = slot[128:200, 0:128].astype(np.float32) * np.random.default_rng(0).uniform(0.5, 2.0, (72, 128))
    slot[128:200, 0:128] = moved.astype(slot.dtype)  # HF block (0, 1)
    arr[0, 3].write(slot).result()
    rerecord(dst)  # edited on purpose: record its integrity again
    export_hf(dst, tmp_path / "hf", dtype="fp8", progress=False)
    before, after = all_tensors(src), all_tensors(tmp_path / "hf")
    changed = [k for k in before if not np.array_equal(before[k].view(np.uint8), after[k].view(np.uint8))]
    assert sorted(changed) == [name, name + "_scale_inv"]
    s0, s1 = before[name + "_scale_inv"], after[name + "_scale_inv"]
    assert (s0 != s1).sum() == 1 and s0[0, 0] == s1[0, 0]
    new_block = slot.T[0:128, 128:200].astype(np.float32)
    assert s1[0, 1] == np.float32(np.abs(new_block).max() / np.float32(448))
    np.testing.assert_array_equal(after[name][:, :128].view(np.uint8), before[name][:, :128].view(np.uint8))
    q = fp8.quantize_with_scale(new_block, s1[:1, 1:2])
    np.testing.assert_array_equal(after[name][0:128, 128:200].view(np.uint8), q.view(np.uint8))


def test_ue8m0_scales_stay_powers_of_two_and_the_config_keeps_its_scale_format(checkpoints, tmp_path):
    """DeepSeek-V3.1 / V3.2 store power-of-two scales (`scale_fmt: ue8m0`): an export keeps what did
    not move bit for bit, gives a block that moved the power of two at or above amax / 448, and
    writes the scale format back."""
    src = tmp_path / "src"
    shutil.copytree(checkpoints["wide_fp8_sharded"], src)
    for shard in src.glob("*.safetensors"):  # requantized with power-of-two scales
        tensors = load_file(shard)
        for name in [n for n in tensors if n.endswith(fp8.SCALE_SUFFIX)]:
            weight = name.removesuffix(fp8.SCALE_SUFFIX)
            tensors[weight], tensors[name] = fp8.quantize(fp8.dequantize(tensors[weight], tensors[name])[0], "ue8m0")
        save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    (src / "config.json").write_text(json.dumps(config))
    dst = tmp_path / "jax"
    convert_hf(src, dst, progress=False)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    arr = ts.open(array_spec(dst / "state", "params.moe.experts.up"), open=True).result()
    slot = np.asarray(arr[0, 3].read().result())  # HF [136, 200].T
    slot[128:200, 0:128] = (slot[128:200, 0:128].astype(np.float32) * 2.5).astype(
        slot.dtype
    )  # HF block (0, 1): its scale must grow
    arr[0, 3].write(slot).result()
    rerecord(dst)
    export_hf(dst, tmp_path / "hf", progress=False)
    assert (
        json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
        == config["quantization_config"]
    )
    before, after = all_tensors(src), all_tensors(tmp_path / "hf")
    changed = [k for k in before if not np.array_equal(before[k].view(np.uint8), after[k].view(np.uint8))]
    assert sorted(changed) == [name, name + fp8.SCALE_SUFFIX]
    scales = after[name + fp8.SCALE_SUFFIX]
    amax = np.abs(slot.T[0:128, 128:200].astype(np.float32)).max() / np.float32(448)
    assert amax <= scales[0, 1] < 2 * amax and np.log2(scales[0, 1]).is_integer()
    for k, s in after.items():
        if k.endswith(fp8.SCALE_SUFFIX):
            assert (np.log2(s[s > 0]) == np.round(np.log2(s[s > 0]))).all(), k


def test_big_tensors_stream_in_row_blocks(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(convert_mod, "ROW_BLOCK", 64)  # the 256-row embedding and head go in 4 blocks
    src = checkpoints["base_bf16_single"]
    convert_hf(src, tmp_path / "jax", progress=False)
    zarray = json.loads((tmp_path / "jax" / "state" / "params.lm_head" / ".zarray").read_text())
    assert zarray["chunks"] == [64, 64]  # [H, V] param, V in blocks of 64
    export_hf(tmp_path / "jax", tmp_path / "hf", progress=False)
    assert_bit_identical(all_tensors(src), all_tensors(tmp_path / "hf"))


def test_an_fp8_head_bigger_than_a_row_block_converts_with_its_scales(checkpoints, tmp_path, monkeypatch):
    """FP8 is allowed for any 2-D weight: a head stored in FP8 with its block scales and more rows
    than a row block is read whole and dequantized, and exported back bit for bit, the MTP
    layer's copies too (with the main tensor's scales, here coarser than fresh ones would be). A
    copy whose scales differ holds other values: refused, naming it."""
    monkeypatch.setattr(convert_mod, "ROW_BLOCK", 64)  # the 256-row head: more than a row block
    src = tmp_path / "src"
    shutil.copytree(checkpoints["base_fp8_single"], src)
    tensors = load_file(src / "model.safetensors")
    head = np.random.default_rng(0).standard_normal(tensors["lm_head.weight"].shape).astype(np.float32) * 0.05
    for main in ("lm_head.weight", "model.embed_tokens.weight"):
        value = head if main == "lm_head.weight" else tensors[main].astype(np.float32)
        scale = fp8.quantize(value)[1] * 4  # not the scales a fresh quantization picks
        q = fp8.quantize_with_scale(value, scale)
        for name in [n for n in tensors if n == main or n.endswith(TIED_COPY[main])]:  # the MTP copies equal it
            tensors[name], tensors[name + fp8.SCALE_SUFFIX] = q, scale
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    convert_hf(src, tmp_path / "jax", dtype="float32", progress=False)
    loaded = np.asarray(moe_jax.from_pretrained(tmp_path / "jax").params["lm_head"]).T
    np.testing.assert_array_equal(
        loaded, fp8.dequantize(tensors["lm_head.weight"], tensors["lm_head.weight_scale_inv"])[0]
    )
    export_hf(tmp_path / "jax", tmp_path / "hf", progress=False)  # in the source's dtypes: an FP8 head
    assert_bit_identical(all_tensors(src), all_tensors(tmp_path / "hf"))
    copy = next(n for n in tensors if n.endswith(".shared_head.head.weight"))
    tensors[copy + fp8.SCALE_SUFFIX] = tensors[copy + fp8.SCALE_SUFFIX] * 2  # the same codes, twice the values
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_main("convert", "--from", "hf", src, "--to", tmp_path / "jax2")
    assert code == 2 and f"{copy}{fp8.SCALE_SUFFIX}" in err and "differs from lm_head.weight_scale_inv" in err, err


TIED_COPY = {"lm_head.weight": ".shared_head.head.weight", "model.embed_tokens.weight": ".embed_tokens.weight"}


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_every_tensor_in_a_16_bit_source_comes_back_as_stored(checkpoints, tmp_path, stored):
    """A source stored wholly in bfloat16 (the router's correction bias too) or in float16 exports
    back bit for bit with --dtype source: float16 converts to float32 (bfloat16 would round it)."""
    src = tmp_path / "src"
    shutil.copytree(checkpoints["flat_single"], src)  # float32
    tensors = {
        k: v.astype(ml_dtypes.bfloat16 if stored == "bfloat16" else np.float16) for k, v in all_tensors(src).items()
    }
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert run_main("convert", "--from", "hf", src, "--to", tmp_path / "jax")[0] == 0
    assert json.loads((tmp_path / "jax" / "manifest.json").read_text())["dtype"] == (
        "bfloat16" if stored == "bfloat16" else "float32"
    )
    assert run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / "hf", "--dtype", "source")[0] == 0
    assert_bit_identical(tensors, all_tensors(tmp_path / "hf"))


def test_an_export_of_more_shards_than_open_files_allowed(checkpoints, converted, tmp_path):
    """Shards are filled one after another: an export holds one open at a time, whatever their number."""
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "moe_jax.cli", "export", "--from", str(converted("base_fp8_single")), "--to", str(out)]
    limited = ["bash", "-c", 'ulimit -n 200 && exec "$@"', "bash"]  # at most 200 open files
    proc = subprocess.run([*limited, *cmd, "--shard-size", "1KB"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list(out.glob("model-*.safetensors"))) > 300
    assert_bit_identical(all_tensors(checkpoints["base_fp8_single"]), all_tensors(out))


def test_an_export_that_would_overflow_its_dtype_is_refused(checkpoints, tmp_path):
    """A float32 value past bfloat16's range would be written as Inf: refused, naming the tensor."""
    src = tmp_path / "src"
    shutil.copytree(checkpoints["flat_single"], src)  # float32
    name = "model.layers.0.input_layernorm.weight"
    tensors = load_file(src / "model.safetensors")
    tensors[name][0] = 3.4e38  # finite in float32; bfloat16's largest is 3.39e38
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert run_main("convert", "--from", "hf", src, "--to", tmp_path / "jax")[0] == 0
    for dtype in ("bfloat16", "fp8"):
        code, _, err = run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / dtype, "--dtype", dtype)
        assert code == 2 and f"tensor {name} has values beyond BF16's range" in err, err
        assert not (tmp_path / dtype).exists() and not temp_dirs(tmp_path / dtype)
    assert run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / "f32", "--dtype", "float32")[0] == 0


def test_no_mtp_and_tokenizer_files(checkpoints, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(checkpoints["base_sharded"], src)
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "generation_config.json").write_text('{"bos_token_id": 0}')
    code, _, err = run_main("convert", "--from", "hf", src, "--to", tmp_path / "jax", "--no-mtp")
    assert code == 0, err
    manifest = Checkpoint(tmp_path / "jax").manifest
    assert manifest["mtp"] is False and not any(k.startswith("params.mtp") for k in manifest["leaves"])
    assert (tmp_path / "jax" / "hf" / "tokenizer.json").exists()
    code, _, err = run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / "hf")
    assert code == 0, err
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    exported = all_tensors(tmp_path / "hf")
    assert not any(k.startswith("model.layers.3.") for k in exported)  # the MTP layer stayed out
    assert exported.keys() == {k for k in all_tensors(src) if not k.startswith("model.layers.3.")}


def test_hub_repo_id_resolves_from_the_local_cache(checkpoints, tmp_path):
    cache = tmp_path / "hub"
    snap = cache / "models--tiny-org--tiny-dsv3" / "snapshots" / "0123abcd"
    shutil.copytree(checkpoints["flat_single"], snap)
    (cache / "models--tiny-org--tiny-dsv3" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-dsv3" / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = run_cli("convert", "--from", "hf", "tiny-org/tiny-dsv3", "--to", tmp_path / "jax", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Checkpoint(tmp_path / "jax").manifest["source"] == "tiny-org/tiny-dsv3"
    missing = run_cli("convert", "--from", "hf", "tiny-org/absent", "--to", tmp_path / "x", env=env)
    assert missing.returncode == 2 and "tiny-org/absent" in missing.stderr


def test_non_empty_destination_needs_force(checkpoints, tmp_path):
    dst = tmp_path / "jax"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    code, _, err = run_main("convert", "--from", "hf", checkpoints["flat_single"], "--to", dst)
    assert code == 2 and "--force" in err
    assert (dst / "precious.txt").read_text() == "keep me"
    # --force replaces only a previous output of the same kind, never other files
    code, _, err = run_main("convert", "--from", "hf", checkpoints["flat_single"], "--to", dst, "--force")
    assert code == 2 and "not a previous moe-jax checkpoint" in err
    assert (dst / "precious.txt").read_text() == "keep me"
    (dst / "precious.txt").unlink()
    assert run_main("convert", "--from", "hf", checkpoints["flat_single"], "--to", dst)[0] == 0
    assert run_main("convert", "--from", "hf", checkpoints["base_sharded"], "--to", dst, "--force")[0] == 0
    assert Checkpoint(dst).cfg.num_hidden_layers == 3
    code, _, err = run_main("export", "--from", dst, "--to", dst, "--force")
    assert code == 2 and "is the input" in err and Checkpoint(dst).verify()


def tree_bytes(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_sigkill_at_any_point_then_rerun_gives_identical_output(tmp_path):
    src = make_tiny(tmp_path / "src", "wide", fp8_weights=True, shards=3, n_routed_experts=32, num_hidden_layers=4)
    reference = tmp_path / "reference"
    convert_hf(src, reference, progress=False)
    want = tree_bytes(reference)
    n_files = len(want)
    cmd = [sys.executable, "-m", "moe_jax.cli", "convert", "--from", "hf", str(src), "--workers", "1"]
    for fraction in (0.0, 0.3, 0.7, 0.95):
        dst = tmp_path / f"dst-{fraction}"
        proc = subprocess.Popen(cmd + ["--to", str(dst)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while proc.poll() is None and time.time() < deadline:
            # os.walk skips directories the converter renames away mid-walk (rglob raised on them)
            works = temp_dirs(dst)
            written = sum(len(files) for work in works for _, _, files in os.walk(work)) if works else -1
            if written >= fraction * n_files:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not dst.exists() or tree_bytes(dst) == want  # nothing that could pass for complete
        code, _, err = run_main("convert", "--from", "hf", src, "--to", dst)  # the rerun: in this process
        assert code == 0, err[-2000:]
        assert tree_bytes(dst) == want
        assert not temp_dirs(dst)
    # Ctrl-C part way: one line, exit 130, and nothing left behind
    dst = tmp_path / "dst-interrupted"
    cmd = [*INTERRUPTIBLE_CLI, *cmd[3:], "--to", str(dst)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        written = sum(len(files) for work in temp_dirs(dst) for _, _, files in os.walk(work))
        if written >= 0.3 * n_files:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate()[1]
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.splitlines()[-1] == "moe-jax convert: interrupted"
    assert not dst.exists() and not temp_dirs(dst)
