"""Config reading and validation."""

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


def test_yarn_frequencies_match_transformers():
    import torch
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = tiny_config("wide")
    hf = DeepseekV3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    got, got_scale = rope_frequencies(ModelConfig.from_hf_dict(raw))
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(want_scale)


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
