"""JAX logits and hidden states against transformers' DeepseekV3ForCausalLM, float32."""

import json

import numpy as np
import pytest

import moe_jax
from converters.tiny import build_torch_model, tiny_config
from converters.torch_interop import from_torch
from tests.conftest import random_tokens
from validation.parity import compare
from validation.reference import load_reference


def assert_parity(report):
    assert report["max_abs"] <= 1e-4, report
    assert report["top1"] == 1.0, report
    assert report["kl_max"] < 1e-7, report
    for layer in report["layers"]:
        assert layer["max_abs"] <= 1e-4 * max(1.0, layer["ref_rms"]), layer


def test_fixture_parity(checkpoint):
    model = moe_jax.from_pretrained(checkpoint)
    ref = load_reference(checkpoint)
    report = compare(model, ref, random_tokens(model.config.vocab_size, batch=2, length=32))
    assert_parity(report)
    # the checkpoint really is what its name says
    config = json.loads((checkpoint / "config.json").read_text())
    assert (checkpoint / "model.safetensors.index.json").exists() == ("sharded" in checkpoint.name)
    assert bool(config.get("quantization_config")) == ("fp8" in checkpoint.name)


@pytest.mark.parametrize("backend", ["ragged_dot", "tiled"])
def test_parity_with_each_grouped_gemm_backend(checkpoints, backend):
    """The default on CPU is tiled (the fixture test above); ragged_dot is the GPU default."""
    path = checkpoints["base_sharded"]
    model = moe_jax.from_pretrained(path, backend=backend)
    assert_parity(compare(model, load_reference(path), random_tokens(model.config.vocab_size, 2, 32)))


def random_valid_config(seed: int) -> dict:
    """A random DeepSeek-V3 config over every knob the architecture has."""
    r = np.random.default_rng(seed)
    n_group = int(r.choice([1, 2, 4]))
    per_group = int(r.choice([2, 3, 4]))
    topk_group = int(r.integers(1, n_group + 1))
    heads = int(r.choice([1, 2, 3]))
    rope = dict(rope_type="default", rope_theta=float(r.choice([1e4, 5e5])))
    if r.random() < 0.6:
        rope = dict(
            rope_type="yarn",
            rope_theta=1e4,
            factor=float(r.choice([2.0, 8.0, 40.0])),
            original_max_position_embeddings=int(r.choice([8, 32])),
            beta_fast=float(r.choice([32, 16])),
            beta_slow=float(r.choice([1, 2])),
            mscale=float(r.choice([1.0, 0.707])),
            mscale_all_dim=float(r.choice([0.0, 1.0, 0.707])),
        )
    layers = int(r.integers(1, 4))
    return tiny_config(
        "base",
        hidden_size=int(r.choice([32, 48])),
        intermediate_size=int(r.choice([40, 64])),
        moe_intermediate_size=int(r.choice([16, 24])),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=None if r.random() < 0.4 else int(r.choice([16, 40])),
        kv_lora_rank=int(r.choice([16, 24])),
        qk_nope_head_dim=int(r.choice([8, 16])),
        qk_rope_head_dim=int(r.choice([4, 8])),
        v_head_dim=int(r.choice([8, 12])),
        n_routed_experts=n_group * per_group,
        num_experts_per_tok=int(r.integers(1, topk_group * per_group + 1)),
        n_shared_experts=int(r.integers(0, 3)),
        n_group=n_group,
        topk_group=topk_group,
        first_k_dense_replace=int(r.integers(0, layers + 1)),
        routed_scaling_factor=float(r.choice([1.0, 2.5])),
        norm_topk_prob=bool(r.random() < 0.5),
        rope_parameters=rope,
        rope_interleave=bool(r.random() < 0.7),
        max_position_embeddings=64,
        num_nextn_predict_layers=0,
        initializer_range=0.15,
        rms_norm_eps=float(r.choice([1e-6, 1e-5])),
    )


@pytest.mark.parametrize("seed", range(16))
def test_random_config_parity(seed):
    config = random_valid_config(seed)
    ref = build_torch_model(config, seed=seed)
    model = from_torch(ref)  # also exercises torch -> JAX interop on a live model
    report = compare(model, ref, random_tokens(config["vocab_size"], batch=2, length=20, seed=seed))
    assert_parity(report)


def test_compute_dtype_is_separate_from_param_dtype(checkpoints):
    path = checkpoints["base_sharded"]
    mixed = moe_jax.from_pretrained(path, dtype="float32", compute_dtype="bfloat16")
    assert mixed.params["embed"].dtype == np.float32 and mixed.params["moe"]["router"].dtype == np.float32
    bf16 = moe_jax.from_pretrained(path, dtype="bfloat16")
    assert bf16.params["embed"].dtype.name == "bfloat16"
    assert bf16.params["moe"]["router"].dtype == np.float32  # as transformers keeps it
    tokens = random_tokens(mixed.config.vocab_size)
    full = np.asarray(moe_jax.from_pretrained(path)(tokens))
    out = mixed.apply(tokens)
    assert out.hidden_states.dtype.name == "bfloat16"
    # bf16 compute is close to, but measurably different from, float32
    diff = np.abs(np.asarray(out.logits) - full)
    assert 1e-4 < diff.mean() < 0.1


def test_bf16_both_sides_measured(checkpoints):
    """BF16 model vs BF16 transformers: the documented bf16 threshold (mean KL, top-1)."""
    path = checkpoints["wide_fp8_sharded"]
    model = moe_jax.from_pretrained(path, dtype="bfloat16")
    report = compare(model, load_reference(path, "bfloat16"), random_tokens(model.config.vocab_size, 4, 64), "bfloat16")
    assert report["pass"], report
    assert report["max_abs"] > 0  # bf16 really ran


def test_model_without_mtp_ignores_mtp_tensors(checkpoints):
    path = checkpoints["base_sharded"]
    with_mtp = moe_jax.from_pretrained(path)
    without = moe_jax.from_pretrained(path, mtp=False)
    assert "mtp" in with_mtp.params and "mtp" not in without.params
    tokens = random_tokens(with_mtp.config.vocab_size)
    np.testing.assert_array_equal(np.asarray(with_mtp(tokens)), np.asarray(without(tokens)))
