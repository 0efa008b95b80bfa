"""Config reading and validation."""

import copy
import json
import math

import pytest

from converters.tiny import tiny_config
from moe_jax.config import ConfigError, ModelConfig
from moe_jax.model import rope_frequencies


def test_rope_scaling_and_rope_parameters_read_alike():
    v5 = tiny_config("base")
    v4 = dict(v5)
    params = dict(v4.pop("rope_parameters"))
    v4["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    v4["rope_scaling"] = params
    a, b = ModelConfig.from_hf_dict(v5), ModelConfig.from_hf_dict(v4)
    assert a == b and a.rope.rope_type == "yarn" and a.rope.factor == 4.0
    # softmax scale gains mscale(factor, mscale_all_dim)^2
    assert a.softmax_scale == pytest.approx(24**-0.5 * (0.1 * math.log(4.0) + 1) ** 2, rel=1e-12)
    plain = ModelConfig.from_hf_dict({**v4, "rope_scaling": None, "rope_theta": 5000.0})
    assert plain.rope.rope_type == "default" and plain.rope.theta == 5000.0


YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0}


@pytest.mark.parametrize(
    "change",
    [
        {},
        # both forms: transformers takes rope_scaling
        {"rope_scaling": {**YARN, "factor": 2.0}},
        {"rope_scaling": YARN, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        # a top-level pretraining length overrides the rope's own; without either: max_position_embeddings
        {"rope_parameters": {**YARN, "rope_theta": 10000.0}, "original_max_position_embeddings": 32},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
    ],
)
def test_rope_frequencies_match_transformers(change):
    import torch
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**tiny_config("wide"), **change}
    hf = DeepseekV3Config(**{k: v for k, v in copy.deepcopy(raw).items() if k != "model_type"})  # (it edits them)
    want, want_scale = ROPE_INIT_FUNCTIONS.get(hf.rope_parameters["rope_type"], _default_rope)(hf)
    got, got_scale = rope_frequencies(ModelConfig.from_hf_dict(raw))
    torch.testing.assert_close(torch.from_numpy(got).float(), want.float(), rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(want_scale)


def _default_rope(hf):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    return DeepseekV3RotaryEmbedding.compute_default_rope_parameters(hf)


def test_missing_keys_take_transformers_defaults():
    raw = tiny_config("base")
    for key in ("n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace"):
        raw.pop(key)
    raw.update(n_routed_experts=16, num_experts_per_tok=2, num_hidden_layers=4)
    cfg = ModelConfig.from_hf_dict(raw)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.first_k_dense_replace) == (8, 4, 2.5, 3)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope type"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_values_are_clear_errors(change, words, tmp_path):
    raw = {**tiny_config("base"), **change}
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_hf_dict(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=str(tmp_path)):
        ModelConfig.from_json(tmp_path)


def test_deepseek_v32_mlp_layer_types_decide_the_dense_layers():
    """transformers' DeepseekV32Config writes `mlp_layer_types` and builds its layers from it, over
    first_k_dense_replace: read it so; a layout the layer stacks cannot hold is a ConfigError."""
    raw = tiny_config("v32")
    layers = raw["num_hidden_layers"]
    types = ["dense"] + ["sparse"] * (layers - 1)
    cfg = ModelConfig.from_hf_dict({**raw, "first_k_dense_replace": layers, "mlp_layer_types": types})
    assert cfg.num_dense_layers == 1
    v3 = {**tiny_config("base"), "first_k_dense_replace": 2, "mlp_layer_types": types}  # V3's config has none
    assert ModelConfig.from_hf_dict(v3).num_dense_layers == 2
    for bad in (types[::-1], types[:-1], ["dense", "moe"] + types[2:], "dense"):
        with pytest.raises(ConfigError, match="mlp_layer_types"):
            ModelConfig.from_hf_dict({**raw, "mlp_layer_types": bad})
