"""The DeepSeek-V3 family as it ships, each as a tiny checkpoint in that exact on-disk format:
Kimi-K2 (model_type kimi_k2, FP8), Kimi-K2-Thinking (routed experts in compressed-tensors INT4,
built by the compressed-tensors library) and Kimi-K2.5 (the same text model in a multimodal
wrapper with a vision tower), with Kimi's tiktoken tokenizer. Each goes convert -> validate ->
train -> export -> reload, against transformers (a DeepseekV3Config of the same fields) and the
compressed-tensors library's own decompression."""

import json
import os

import numpy as np
import pytest
import tiktoken
import tiktoken.load
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.numpy import load_file, save_file

import moe_jax
from converters import int4
from converters.safetensors_io import CheckpointReader
from converters.tiny import KIMI_INT4, KIMI_SPECIALS, VISION_TENSORS, make_tiny
from moe_jax import data
from moe_jax.train.config import load_config
from moe_jax.train.loop import train
from tests.helpers import all_tensors, assert_bit_identical, error_lines, run_main
from validation.layerwise import random_tokens
from validation.parity import compare
from validation.reference import load_reference

FORMATS = {
    "kimi-k2": dict(fp8_weights=True, shards=2),  # Kimi-K2-Instruct: FP8 with 128x128 scales
    "kimi-k2-thinking": dict(int4_experts=True, shards=2),  # routed experts INT4
    "kimi-k2.5": dict(int4_experts=True, wrapper="kimi_k25", shards=3),  # the same inside the wrapper
}
SCHEME = QuantizationConfig.model_validate(KIMI_INT4).config_groups["group_0"]
PACKED = BaseCompressor.get_value_from_registry("pack-quantized")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    made = {name: make_tiny(root / name, "kimi-k2", **kw) for name, kw in FORMATS.items()}
    for path in made.values():  # the remote code config.json's auto_map names: carried, never run
        (path / "configuration_deepseek.py").write_text("raise SystemExit('remote code ran')\n")
    return made


def test_int4_codes_match_the_compressed_tensors_library():
    """Packing, unpacking with the scales, and fresh quantization (float32 weights: the library's
    min-max scale amax / 7.5, round half to even, clamp to [-8, 7]) bit for bit."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 96)) * rng.uniform(0.01, 3, (24, 1))).astype(np.float32)
    w[3, :32] = 0  # an all-zero group
    groups = torch.from_numpy(w).unflatten(-1, (3, 32))
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), SCHEME.weights)
    theirs = PACKED.compress({"weight": torch.from_numpy(w), "weight_scale": scale, "weight_zero_point": zero}, SCHEME)
    packed, ours_scale = int4.quantize(w, 32, np.float32)
    np.testing.assert_array_equal(ours_scale, theirs["weight_scale"].numpy())
    np.testing.assert_array_equal(packed, theirs["weight_packed"].numpy())
    codes = torch.from_numpy(rng.integers(-8, 8, (5, 40)).astype(np.int8))  # 40: a part-filled last word
    np.testing.assert_array_equal(int4.pack(codes.numpy()), pack_to_int32(codes, 4).numpy())
    np.testing.assert_array_equal(int4.unpack(int4.pack(codes.numpy()), 40), codes.numpy())
    decompressed = PACKED.decompress(dict(theirs), SCHEME)["weight"].numpy()
    ours, finite = int4.dequantize(packed, ours_scale, w.shape)
    assert finite and np.array_equal(ours, decompressed)


@pytest.mark.parametrize("name", list(FORMATS))
def test_convert_validate_train_export_reload(family, name, tmp_path):
    src = family[name]
    config = json.loads((src / "config.json").read_text())
    tokens = random_tokens(320, 2, 24, 0)
    # the HF checkpoint read by JAX = transformers on the same files (INT4: the library's decompression)
    report = compare(moe_jax.from_pretrained(src), load_reference(src), tokens)
    assert report["pass"] and report["max_abs"] < 1e-4, report
    code, out, err = run_main("convert", "--from", "hf", src, "--to", tmp_path / "jax")
    assert code == 0, err
    code, out, err = run_main(
        "validate", "--hf", src, "--jax", tmp_path / "jax", "--tokens", "16", "--report", tmp_path / "r.json"
    )
    assert code == 0 and json.loads((tmp_path / "r.json").read_text())["pass"], out[-2000:] + err[-2000:]
    # untouched: the export is the source, byte for byte (INT4 codes, scales and shapes, the
    # vision tower, the tokenizer files) and config.json is the same
    code, _, err = run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / "same")
    assert code == 0, err
    assert_bit_identical(all_tensors(src), all_tensors(tmp_path / "same"))
    assert json.loads((tmp_path / "same" / "config.json").read_text()) == config
    for f in ("tiktoken.model", "tokenizer_config.json", "configuration_deepseek.py"):
        assert (tmp_path / "same" / f).read_bytes() == (src / f).read_bytes()
    # BF16: no quantization_config left (a wrapper keeps it in its text_config), the rest as it was
    code, _, err = run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / "bf16", "--dtype", "bfloat16")
    assert code == 0, err
    plain = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in plain and "quantization_config" not in plain.get("text_config", {})
    assert plain == {k: v for k, v in config.items() if k != "quantization_config"} or "text_config" in plain
    tensors = all_tensors(tmp_path / "bf16")
    model_names = {n for n in tensors if n.startswith(("model.", "lm_head.", "language_model."))}
    assert {tensors[n].dtype.name for n in model_names} == {"bfloat16", "float32"}  # (float32: router biases)
    assert len(tensors) - len(model_names) == (len(VISION_TENSORS) if name == "kimi-k2.5" else 0)
    # train on text through Kimi's tokenizer, export as it came in, reload
    cfg = load_config(
        "configs/tiny.yaml",
        [f"run_dir={tmp_path / 'run'}", f"model.init={tmp_path / 'jax'}", "steps=3", "tensorboard=false"]
        + ["peak_tflops=1", "checkpoint.every=1000", "model.mtp=false", "data.seq_len=64", "data.batch_size=4"],
    )
    result = train(cfg, progress=False, log=lambda *a: None)
    exported = tmp_path / "trained-hf"
    code, _, err = run_main("export", "--from", result["model"], "--to", exported, "--dtype", "source")
    assert code == 0, err
    assert json.loads((exported / "config.json").read_text()) == config
    before, after = all_tensors(src), all_tensors(exported)
    assert sorted(before) == sorted(after)
    for n in before:
        assert before[n].dtype == after[n].dtype and before[n].shape == after[n].shape, n
        if not n.startswith("language_model.") and not n.startswith(("model.", "lm_head.")):
            assert np.array_equal(before[n].view(np.uint8), after[n].view(np.uint8)), n  # carried through
    trained = moe_jax.from_pretrained(result["model"])
    requantized = compare(trained, load_reference(exported), tokens)  # trained weights vs their quantized export
    print(
        f"{name}: trained weights vs their export: KL mean {requantized['kl_mean']:.3g}, top-1 {requantized['top1']:.3f}"
    )
    # (the tiny model's weights are large, std 0.1: measured KL mean 0.006 for INT4 experts, 0.037 for FP8)
    assert requantized["top1"] > 0.5 and requantized["kl_mean"] < 0.1, requantized
    again = compare(moe_jax.from_pretrained(exported), load_reference(exported), tokens)
    assert again["pass"], again


def kimi_encoding(directory) -> tiktoken.Encoding:
    """tiktoken's Encoding built as Kimi's tokenization_kimi.py builds it from the same files."""
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken caches files by path otherwise
    ranks = tiktoken.load.load_tiktoken_bpe(str(directory / "tiktoken.model"))
    added = json.loads((directory / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    names = {int(k): v["content"] for k, v in added.items()}
    specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + 16)}
    return tiktoken.Encoding("kimi", pat_str=data.KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_tiktoken_tokenizer_gives_tiktokens_ids(family, tmp_path):
    directory = family["kimi-k2"]
    ours, theirs = data.load_tokenizer(directory, 320), kimi_encoding(directory)
    assert (
        ours.eos_id == 305
        and ours.token_to_id("<|im_end|>") == 306
        and ours.token_to_id("<|reserved_token_309|>") == 309
    )
    texts = [
        "The experts route the tokens; THE ROUTER's scores don't tie.",
        "模型的专家处理分配给它们的词元。 mixed 中文 and English 12345",
        "[BOS]a chat<|im_user|>hi<|im_end|> [EOS]",
        "tabs\t\tand\n\nnewlines  ",
    ]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text, allowed_special="all"), text
        assert ours.decode(ours.encode(text)) == text
    long_run = "a" + " " * 30_000 + "b"  # cut inside runs of over 25,000 spaces, as Kimi's code does
    assert ours.encode(long_run) == [
        i for piece in ("a" + " " * 24_999, " " * 5_001 + "b") for i in theirs.encode(piece)
    ]
    stream = data.load_stream(str(write_docs(tmp_path)), ours)
    assert stream[-1] == 305 and (stream == 305).sum() == 2  # EOS after each document


def write_docs(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ("first 文档", "second document")) + "\n")
    return path


def test_bad_tiktoken_files_are_one_line(family, tmp_path):
    directory = tmp_path / "tok"
    directory.mkdir()
    for f in ("tiktoken.model", "tokenizer_config.json"):
        (directory / f).write_bytes((family["kimi-k2"] / f).read_bytes())
    lines = (directory / "tiktoken.model").read_text().splitlines()
    (directory / "tiktoken.model").write_text("\n".join(lines[:3] + ["not base64!! 3"] + lines[4:]) + "\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:4: not a 'base64-token rank' line"):
        data.load_tokenizer(directory, 320)
    (directory / "tiktoken.model").write_text("\n".join(lines[:3] + lines[4:]) + "\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:4: rank 4 \(expected 3"):
        data.load_tokenizer(directory, 320)
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(ValueError, match="tokenizer_class 'GPT2Tokenizer': no known pre-tokenizer pattern"):
        data.load_tokenizer(directory, 320)


def edit_config(path, fn):
    config = json.loads((path / "config.json").read_text())
    fn(config)
    (path / "config.json").write_text(json.dumps(config))


def edit_tensors(path, fn):
    """fn(tensors) on every shard, the index kept in step."""
    weight_map = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors = load_file(shard)
        fn(tensors)
        save_file(tensors, shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
    index = path / "model.safetensors.index.json"
    if index.exists():
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


EXPERT = "model.layers.1.mlp.experts.3.gate_proj.weight"


def weights_of(group):
    return group["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(
    "name, edit, words",
    [
        ("kimi-k2", lambda p: edit_config(p, lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"])),
         "unsupported model_type 'llama' with architectures ['LlamaForCausalLM']"),
        ("kimi-k2.5", lambda p: edit_config(p, lambda c: c["text_config"].update(model_type="qwen3", architectures=None)),
         "text_config: unsupported model_type 'qwen3'"),
        ("kimi-k2-thinking", lambda p: edit_config(p, lambda c: weights_of(c["quantization_config"]).update(num_bits=8)),
         "weights.num_bits=8 (supported: 4)"),
        ("kimi-k2-thinking", lambda p: edit_config(p, lambda c: weights_of(c["quantization_config"]).update(symmetric=False)),
         "weights.symmetric=False (supported: True)"),
        ("kimi-k2-thinking", lambda p: edit_config(p, lambda c: c["quantization_config"].update(format="float-quantized")),
         "quantization_config.format='float-quantized' (supported: 'pack-quantized')"),
        ("kimi-k2-thinking", lambda p: edit_config(p, lambda c: c.pop("quantization_config")),
         "_packed is packed INT4 but config.json has no compressed-tensors quantization_config"),
        ("kimi-k2-thinking", lambda p: edit_tensors(p, lambda t: t.pop(EXPERT + "_shape", None)),
         f"{EXPERT}_packed is packed INT4 but {EXPERT}_shape is missing"),
        ("kimi-k2-thinking", lambda p: edit_tensors(p, lambda t: t.update({EXPERT + "_scale": t[EXPERT + "_scale"][:, :1]}) if EXPERT + "_scale" in t else None),
         f"{EXPERT}_scale is BF16 [32, 1], expected BF16 [32, 2] for INT4 weight [32, 64] in groups of 32"),
        ("kimi-k2-thinking", lambda p: edit_tensors(p, lambda t: t.update({EXPERT + "_scale": -t[EXPERT + "_scale"]}) if EXPERT + "_scale" in t else None),
         f"{EXPERT}_scale is negative"),
        ("kimi-k2.5", lambda p: edit_tensors(p, lambda t: t.update({"language_model.model.bogus": t["mm_projector.pre_norm.weight"]}) if "mm_projector.pre_norm.weight" in t else None),
         "tensor language_model.model.bogus is not part of a DeepSeek-V3 model"),
    ],
)  # fmt: skip
def test_unsupported_family_members_are_one_line(family, tmp_path, name, edit, words):
    src = tmp_path / "src"
    src.mkdir()
    for f in family[name].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    edit(src)
    code, out, err = run_main("convert", "--from", "hf", src, "--to", tmp_path / "out")
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert words in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
    if "negative" in words:  # verify judges the scales as convert does
        code, _, err = run_main("verify", src)
        assert code == 2 and words in err, err


def test_reader_lists_a_packed_weight_once(family):
    reader = CheckpointReader(family["kimi-k2.5"], "language_model.")
    assert reader.dtypes[EXPERT] == int4.DTYPE and reader.shapes[EXPERT] == (32, 64)
    assert EXPERT in reader.names() and EXPERT + "_packed" not in reader.names()
    assert set(reader.extras) == {n for n in all_tensors(family["kimi-k2.5"]) if not n.startswith("language_model.")}
    assert KIMI_SPECIALS[305] == "[EOS]"


def test_what_training_leaves_alone_exports_bit_identical(family, tmp_path):
    """lr 0: the weights stay on their INT4 grid, so `export --dtype source` of the trained model
    writes back the source's codes, scales and shapes (the converted start's scales travel with
    the trained model); only the router biases, which the bias update moves, differ."""
    src = family["kimi-k2-thinking"]
    assert run_main("convert", "--from", "hf", src, "--to", tmp_path / "jax")[0] == 0
    overrides = [f"run_dir={tmp_path / 'run'}", f"model.init={tmp_path / 'jax'}", "steps=2", "optim.lr=0"]
    overrides += ["tensorboard=false", "peak_tflops=1", "checkpoint.every=1000", "data.seq_len=64", "data.batch_size=4"]
    result = train(load_config("configs/tiny.yaml", overrides), progress=False, log=lambda *a: None)
    assert run_main("export", "--from", result["model"], "--to", tmp_path / "hf", "--dtype", "source")[0] == 0
    before, after = all_tensors(src), all_tensors(tmp_path / "hf")
    moved = {n for n in before if not np.array_equal(before[n].view(np.uint8), after[n].view(np.uint8))}
    assert moved and all(n.endswith("e_score_correction_bias") for n in moved), sorted(moved)[:5]
    assert sum(n.endswith("_packed") for n in before) == 2 * 16 * 3  # every expert's three projections, unmoved


@pytest.mark.parametrize("shape_dtype", ["I8", 3])
def test_a_damaged_int4_record_names_the_manifest_and_tensor(family, tmp_path, shape_dtype):
    """An INT4 tensor's record whose shape dtype is not one safetensors INT4 shapes come in."""
    assert run_main("convert", "--from", "hf", family["kimi-k2-thinking"], "--to", tmp_path / "jax")[0] == 0
    manifest = tmp_path / "jax" / "manifest.json"
    m = json.loads(manifest.read_text())
    name = next(n for n, r in m["tensors"].items() if "experts" in n and "shape_dtype" in r)
    m["tensors"][name]["shape_dtype"] = shape_dtype
    manifest.write_text(json.dumps(m))
    code, _, err = run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / "hf")
    assert code == 2 and f"manifest.json: tensor {name}: shape_dtype {shape_dtype!r} is not one of I32, I64" in err, err
    assert not (tmp_path / "hf").exists()


def test_any_checkpoint_carries_its_extra_tensors(checkpoints, tmp_path):
    """Tensors outside the model's namespace (any dtype, here int64 and float16) and rotary
    buffers go through convert and export byte for byte; the model's own tensors as before."""
    src = tmp_path / "src"
    src.mkdir()
    for f in checkpoints["base_bf16_single"].iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    extra = {
        "value_head.weight": np.arange(12, dtype=np.float16).reshape(3, 4),
        "value_head.steps": np.array([7, -1], np.int64),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.linspace(1, 0, 4, dtype=np.float32),
    }
    edit_tensors(src, lambda t: t.update(extra))
    assert run_main("convert", "--from", "hf", src, "--to", tmp_path / "jax")[0] == 0
    assert sorted(p.name for p in (tmp_path / "jax" / "extra").iterdir()) == ["model.safetensors"]
    assert run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / "out")[0] == 0
    assert_bit_identical(all_tensors(src), all_tensors(tmp_path / "out"))
    assert run_main("verify", tmp_path / "jax")[0] == 0
    stored = tmp_path / "jax" / "extra" / "model.safetensors"  # damaged: export refuses it, writes nothing
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF
    stored.write_bytes(bytes(data))
    code, _, err = run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / "again")
    assert code == 2 and len(error_lines(err)) == 1 and "extra/model.safetensors" in err, err
    assert not (tmp_path / "again").exists()
