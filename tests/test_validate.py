"""`moe-jax validate`: passes on faithful checkpoints, names the layer that differs, exit codes.

The command runs in this process (`run_main`: no interpreter, jax and torch start-up per call);
test_load_errors runs it in a fresh process."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import moe_jax
from tests.helpers import run_main


@pytest.mark.parametrize("name", ["base_sharded", "flat_single", "wide_fp8_sharded"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_faithful_checkpoints_pass_in_float32(checkpoints, tmp_path, name, layerwise):
    report = tmp_path / "report.json"
    args = ["validate", "--hf", checkpoints[name], "--tokens", "32", "--dtype", "float32", "--report", report]
    code, out, err = run_main(*args, *(["--layerwise"] if layerwise else []))
    assert code == 0, out[-3000:] + err[-3000:]
    r = json.loads(report.read_text())
    assert r["pass"] and r["first_failing_layer"] is None
    assert r["logits"]["kl_max"] < 1e-7 and r["logits"]["top1"] == 1.0 and r["logits"]["max_abs"] <= 1e-4
    assert len(r["layers"]) == json.loads((checkpoints[name] / "config.json").read_text())["num_hidden_layers"]
    assert all(layer["routing_mismatch"] in (None, 0.0) for layer in r["layers"])


def test_default_dtype_is_the_checkpoints(checkpoints, converted, tmp_path):
    """A fresh conversion of an FP8 checkpoint (bfloat16) passes with default flags: validate
    compares in the dtype the JAX checkpoint holds, with that dtype's tolerances, and says so."""
    src, dst = checkpoints["wide_fp8_sharded"], converted("wide_fp8_sharded")
    report = tmp_path / "r.json"
    code, out, err = run_main("validate", "--hf", src, "--jax", dst, "--tokens", "16", "--report", report)
    assert code == 0, out[-3000:] + err[-3000:]
    first = out.splitlines()[0]
    assert "bfloat16" in first and f"the dtype {dst} holds" in first, first
    r = json.loads(report.read_text())
    assert r["dtype"] == "bfloat16" and r["thresholds"]["layer_rel_rms"] == 5e-2
    code, out, _ = run_main("validate", "--hf", src, "--tokens", "16", "--report", report)  # HF alone: as convert would
    assert code == 0 and "bfloat16" in out.splitlines()[0]
    code, out, _ = run_main("validate", "--hf", checkpoints["flat_single"], "--tokens", "8", "--report", report)
    assert code == 0 and json.loads(report.read_text())["dtype"] == "float32"
    assert "stores F32 weights" in out.splitlines()[0]


def most_used_expert(path, layer):
    """The expert of HF layer `layer` that validate's default random tokens use most."""
    model = moe_jax.from_pretrained(path)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 64)).astype(np.int32)
    routing = model.apply(tokens).routing[0]  # the main MoE stack
    experts = np.asarray(routing.experts[layer - model.config.first_k_dense_replace])
    return int(np.bincount(experts.ravel()).argmax())


def edit_tensors(path, fn):
    for shard in path.glob("*.safetensors"):
        tensors = load_file(shard)
        if fn(tensors):
            save_file(tensors, shard, metadata={"format": "pt"})


@pytest.mark.parametrize("layerwise", [False, True])
def test_perturbed_expert_fails_and_names_its_layer(checkpoints, converted, tmp_path, layerwise):
    src = checkpoints["base_sharded"]
    dst = converted("base_sharded")
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    expert = most_used_expert(src, 2)
    name = f"model.layers.2.mlp.experts.{expert}.up_proj.weight"

    def perturb(t):
        if name in t:
            t[name] = t[name] * np.float32(1.5)
            return True

    edit_tensors(hf, perturb)
    report, png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["validate", "--hf", hf, "--jax", dst, "--report", report, "--plot", png]
    code, out, err = run_main(*args, *(["--layerwise"] if layerwise else []))
    assert code == 1, out[-3000:] + err[-3000:]
    r = json.loads(report.read_text())
    assert r["pass"] is False and r["first_failing_layer"] == 2
    assert all(layer["pass"] for layer in r["layers"][:2])
    assert "first layer over tolerance: 2" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_different_rope_fails_at_the_first_layer(checkpoints, converted, tmp_path):
    src = checkpoints["base_sharded"]
    dst = converted("base_sharded")
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    config = json.loads((hf / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 20000.0
    (hf / "config.json").write_text(json.dumps(config))
    report = tmp_path / "r.json"
    code, out, err = run_main("validate", "--hf", hf, "--jax", dst, "--layerwise", "--report", report)
    assert code == 1, out[-3000:] + err[-3000:]
    assert json.loads(report.read_text())["first_failing_layer"] == 0


def test_prompts_through_the_checkpoints_tokenizer(checkpoints, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = tmp_path / "hf"
    shutil.copytree(checkpoints["flat_single"], hf)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "</s>"]))
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))  # as training needs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the lazy dog jumps over the quick fox\npack my box with five dozen jugs\n")
    report = tmp_path / "r.json"
    code, _, err = run_main("validate", "--hf", hf, "--prompts", prompts, "--report", report)
    assert code == 0, err[-3000:]
    r = json.loads(report.read_text())
    assert r["tokens"][0] == 2 and r["tokens"][1] > 3 and r["logits"]["kl_max"] < 1e-7


def test_prompts_through_a_tiktoken_tokenizer(tmp_path):
    """Kimi-K2 ships tiktoken.model and tokenizer_config.json: --prompts reads them as training does
    (the prompts' token ids in the report are the tokenizer's, cut to the shorter prompt)."""
    from converters.tiny import make_tiny
    from moe_jax.config import ModelConfig
    from moe_jax.data import load_tokenizer

    src = make_tiny(tmp_path / "kimi", "kimi-k2", int4_experts=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\n\njumps over the lazy dog\n")
    report = tmp_path / "r.json"
    code, _, err = run_main("validate", "--hf", src, "--prompts", prompts, "--report", report)
    assert code == 0, err[-3000:]
    want = load_tokenizer(src, ModelConfig.from_json(src).vocab_size).encode_batch(
        ["the quick brown fox", "jumps over the lazy dog"]
    )
    assert json.loads(report.read_text())["tokens"] == [2, min(map(len, want))] and min(map(len, want)) > 3


def test_bad_input_exits_2(checkpoints, converted, tmp_path):
    code, _, err = run_main("validate", "--hf", tmp_path / "nothing")
    assert code == 2 and "nothing" in err
    other = converted("flat_single")  # another architecture
    code, _, err = run_main("validate", "--hf", checkpoints["base_sharded"], "--jax", other)
    assert code == 2 and "differ" in err
    code, _, err = run_main("validate", "--hf", checkpoints["flat_single"], "--prompts", tmp_path / "p.txt")
    assert code == 2 and "tokenizer.json" in err
