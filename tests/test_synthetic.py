"""converters.synthetic: the checkpoint it writes loads through CheckpointReader and holds every
tensor of the parameter table with its real name, shape and dtype, each FP8 weight with a block
scale of the right shape; checked against shapes and block products computed here in numpy."""

import json
import math

import numpy as np
import pytest

from converters.safetensors_io import INDEX_NAME, CheckpointReader
from converters.synthetic import full_width_config, largest_tensor_bytes, write_synthetic
from converters.verify import verify
from moe_jax.config import DEEPSEEK_V3, ModelConfig
from moe_jax.errors import CheckpointError
from moe_jax.params import entries

# DeepSeek-V3 at toy widths, none a multiple of 128 (partial edge blocks), 1 dense + 2 MoE layers
H, FF, MI, VOCAB, HEADS, QR, KVR, NOPE, ROPE, V, E = 200, 300, 136, 300, 2, 160, 130, 16, 8, 16, 4
SMALL = {
    **DEEPSEEK_V3,
    "hidden_size": H,
    "intermediate_size": FF,
    "moe_intermediate_size": MI,
    "vocab_size": VOCAB,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "q_lora_rank": QR,
    "kv_lora_rank": KVR,
    "qk_nope_head_dim": NOPE,
    "qk_rope_head_dim": ROPE,
    "v_head_dim": V,
    "n_routed_experts": E,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "num_nextn_predict_layers": 0,
}
SCALE = (1e-3, 1e-2)


def expected_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the small config and its torch [out, in] shape, written out by hand."""
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    for layer in range(3):
        p = f"model.layers.{layer}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_a_proj.weight": (QR, H),
                p + "self_attn.q_a_layernorm.weight": (QR,),
                p + "self_attn.q_b_proj.weight": (HEADS * (NOPE + ROPE), QR),
                p + "self_attn.kv_a_proj_with_mqa.weight": (KVR + ROPE, H),
                p + "self_attn.kv_a_layernorm.weight": (KVR,),
                p + "self_attn.kv_b_proj.weight": (HEADS * (NOPE + V), KVR),
                p + "self_attn.o_proj.weight": (H, HEADS * V),
            }
        )
        ffns = [(f"mlp.experts.{e}", MI) for e in range(E)] + [("mlp.shared_experts", MI)] if layer else [("mlp", FF)]
        for ffn, width in ffns:
            shapes.update(
                {
                    p + f"{ffn}.gate_proj.weight": (width, H),
                    p + f"{ffn}.up_proj.weight": (width, H),
                    p + f"{ffn}.down_proj.weight": (H, width),
                }
            )
        if layer > 0:
            shapes.update({p + "mlp.gate.weight": (E, H), p + "mlp.gate.e_score_correction_bias": (E,)})
    return shapes


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "ckpt"
    nbytes = write_synthetic(path, SMALL, shard_bytes=400_000, seed=3, scale=SCALE)
    return path, nbytes


def test_every_tensor_with_its_shape_dtype_and_block_scale(written):
    path, nbytes = written
    reader = CheckpointReader(path)
    shapes = expected_shapes()
    fp8_names = {n for n in shapes if n.endswith("_proj.weight") or n.endswith("proj_with_mqa.weight")}
    scales = {n + "_scale_inv" for n in fp8_names}
    assert set(reader.names()) == set(shapes) | scales
    # the parameter table names the same tensors, with the same shapes
    assert {e.hf_name: e.hf_shape for e in entries(ModelConfig.from_hf_dict(SMALL), mtp=False)} == shapes
    assert (path / INDEX_NAME).is_file() and len({reader.file_of(n) for n in reader.names()}) > 1

    total = 0
    for name in reader.names():
        value = reader.get(name)
        total += value.nbytes
        if name in scales:
            rows, cols = shapes[name[: -len("_scale_inv")]]
            assert reader.dtypes[name] == "F32" and value.shape == (math.ceil(rows / 128), math.ceil(cols / 128))
            assert np.all((value >= SCALE[0]) & (value < SCALE[1])), name
        elif name in fp8_names:
            assert reader.dtypes[name] == "F8_E4M3" and value.shape == shapes[name]
            codes = value.view(np.uint8)
            assert not np.any((codes & 0x7F) == 0x7F), f"{name}: NaN code"  # e4m3fn's only NaN
            assert codes.min() < 0x80 <= codes.max(), f"{name}: both signs"
            # the real weight: every value times the scale of its 128 x 128 block, in plain numpy
            scale = reader.get(name + "_scale_inv")
            full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[: value.shape[0], : value.shape[1]]
            weight = value.astype(np.float32) * full
            assert np.isfinite(weight).all() and np.abs(weight).max() <= 448 * SCALE[1]
            r, c = value.shape[0] - 1, value.shape[1] - 1  # a value in the last (partial) block
            assert weight[r, c] == np.float32(value[r, c]) * scale[r // 128, c // 128]
        elif name.endswith("e_score_correction_bias"):
            assert reader.dtypes[name] == "F32" and value.shape == shapes[name]
        else:
            assert reader.dtypes[name] == "BF16" and value.shape == shapes[name], name
            assert np.isfinite(value.astype(np.float32)).all()
    assert nbytes == total
    assert json.loads((path / INDEX_NAME).read_text())["metadata"]["total_size"] == total
    config = json.loads((path / "config.json").read_text())
    assert config == {**SMALL, "quantization_config": DEEPSEEK_V3["quantization_config"]}
    embed = reader.get("model.embed_tokens.weight").astype(np.float32)
    assert abs(embed.std() - 0.02) < 0.002


def test_moe_jax_verify_accepts_it(written):
    n_fp8 = sum(1 for n in expected_shapes() if n.endswith("proj.weight") or n.endswith("proj_with_mqa.weight"))
    line = verify(written[0])
    assert line.startswith(f"OK: {written[0]}: HF checkpoint") and f"FP8 ({n_fp8} block-scaled" in line


def test_seeded_and_replaces_only_a_checkpoint(tmp_path, written):
    again = tmp_path / "again"
    write_synthetic(again, SMALL, shard_bytes=400_000, seed=3, scale=SCALE)
    a, b = CheckpointReader(written[0]), CheckpointReader(again)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert np.array_equal(a.get(name).view(np.uint8), b.get(name).view(np.uint8))
    write_synthetic(again, SMALL, seed=4, scale=SCALE)  # over the previous one, now a single file
    c = CheckpointReader(again)
    assert not (again / INDEX_NAME).exists()
    assert not np.array_equal(a.get(name).view(np.uint8), c.get(name).view(np.uint8))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a previous HF checkpoint"):
        write_synthetic(other, SMALL)
    assert (other / "notes.txt").read_text() == "mine"


def test_full_width_config_is_deepseek_v3_at_reduced_depth():
    raw = full_width_config(2, experts=64)
    cfg = ModelConfig.from_hf_dict(raw)
    widths = (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.moe_intermediate_size)
    assert widths == (7168, 129280, 128, 2048)
    depth = (cfg.num_hidden_layers, cfg.num_dense_layers, cfg.n_routed_experts, cfg.num_nextn_predict_layers)
    assert depth == (3, 1, 64, 0)
    assert (raw["n_group"], raw["topk_group"]) == (8, 4)
    assert full_width_config(1, experts=16)["n_group"] == 8 and full_width_config(1, experts=16)["topk_group"] == 4
    small = full_width_config(1, experts=8, vocab_size=1024)
    assert (small["n_group"], small["topk_group"], small["vocab_size"]) == (4, 4, 1024)
    ModelConfig.from_hf_dict(small)  # two experts per group: a valid config
    assert largest_tensor_bytes(cfg) == 129280 * 7168 * 2  # the embedding and the head, in bf16
