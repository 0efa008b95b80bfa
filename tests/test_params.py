"""The parameter table: every leaf of the tree has one rule, and what the rest of the code derives
from it (sharding axes, decay, dtype) agrees with the leaf's shape and with transformers."""

import jax
import numpy as np
import pytest

from converters.tiny import build_torch_model, tiny_config
from moe_jax.config import DEEPSEEK_V3, ModelConfig
from moe_jax.params import entries, init_tree, logical_axes, param_shapes, rule_of
from moe_jax.sharding import RULES


def leaves(tree):
    return [(tuple(k.key for k in kp), x) for kp, x in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.mark.parametrize("variant", ["base", "flat", "wide"])
def test_every_leaf_has_a_rule_that_fits_its_shape(variant):
    cfg = ModelConfig.from_hf_dict(tiny_config(variant))
    tree = init_tree(cfg, dtype="bfloat16")
    for path, x in leaves(tree):
        rule = rule_of(path)
        axes = logical_axes(path, x.ndim)
        assert len(axes) == x.ndim
        assert set(axes) - {None} <= set(RULES)
        assert ("expert" in axes) == ("experts" in path)  # routed experts, and only they, split over experts
        own = x.ndim - (path[1] != "embed" and path[1] not in ("final_norm", "lm_head")) - rule.per_expert
        assert rule.decay == (own == 2)  # matrices decay, norms do not
        assert x.dtype == (np.float32 if path[-1] in ("router", "router_bias") else np.dtype("bfloat16"))


def test_unknown_leaf_is_named():
    with pytest.raises(KeyError, match="params/moe/nothing"):
        rule_of(("params", "moe", "nothing"))


def test_table_names_match_transformers_state_dict():
    """Every non-MTP tensor of the table is a parameter (or buffer) of transformers' model, with the
    shape the table says, and nothing of transformers' model is left out (fused experts split)."""
    config = tiny_config("base")
    model = build_torch_model(config)
    state = model.state_dict()
    table = {e.hf_name: e.hf_shape for e in entries(ModelConfig.from_hf_dict(config), mtp=False)}
    ours = set()
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                for part, half in (("gate_proj", t[e, : t.shape[1] // 2]), ("up_proj", t[e, t.shape[1] // 2 :])):
                    assert table[f"{prefix}{e}.{part}.weight"] == tuple(half.shape)
                    ours.add(f"{prefix}{e}.{part}.weight")
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                assert table[f"{prefix}{e}.down_proj.weight"] == tuple(t[e].shape)
                ours.add(f"{prefix}{e}.down_proj.weight")
        else:
            assert table[name] == tuple(t.shape), name
            ours.add(name)
    assert ours == set(table)


def test_full_size_shapes():
    """DeepSeek-V3: the published counts, 671B for the main model and 685B with the MTP module
    (which stores its own copies of the 0.93B embedding and head; here they are tied)."""
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    main, with_mtp = (sum(int(np.prod(s)) for s, _ in param_shapes(cfg, mtp).values()) for mtp in (False, True))
    tied = 2 * cfg.vocab_size * cfg.hidden_size
    assert round(main / 1e9) == 671
    assert 684e9 < with_mtp + tied < 686e9  # (the hub counts the FP8 scales too)
