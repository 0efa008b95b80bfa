"""Gradients, packed sequences, scanned layers, torch interop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import moe_jax
from converters.tiny import build_torch_model, tiny_config
from converters.torch_interop import from_torch, to_torch, torch_to_numpy
from moe_jax.config import ModelConfig
from moe_jax.model import forward
from moe_jax.params import init_tree
from tests.conftest import random_tokens


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def test_gradients_reach_every_parameter_and_not_the_router_bias(checkpoints):
    model = moe_jax.from_pretrained(checkpoints["base_sharded"])
    cfg = model.config
    tokens = jnp.asarray(random_tokens(cfg.vocab_size, batch=4, length=32))

    def loss(params, buffers):
        out = forward(params, buffers, tokens, cfg, mtp=True)
        lm = cross_entropy(out.logits[:, :-1], tokens[:, 1:])
        return lm + 0.3 * cross_entropy(out.mtp_logits[0][:, :-2], tokens[:, 2:])

    grads, bias_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(model.params, model.buffers)  # one compilation
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        g = np.asarray(g)
        name = jax.tree_util.keystr(path)
        assert np.isfinite(g).all(), name
        # every layer of every stacked parameter gets a gradient
        stacked = any(f"'{kind}'" in name for kind in ("dense", "moe", "mtp"))
        per_layer = g.reshape(g.shape[0] if stacked else 1, -1)
        assert (np.abs(per_layer).max(axis=1) > 0).all(), name
    # the correction bias only steers the choice: no gradient, and it is not a trainable param
    assert all(float(jnp.abs(b).max()) == 0 for b in jax.tree.leaves(bias_grads))
    assert "router_bias" not in str(jax.tree_util.tree_structure(model.params))


def test_packed_segments_equal_separate_sequences(checkpoints):
    model = moe_jax.from_pretrained(checkpoints["base_sharded"])
    a, b = random_tokens(model.config.vocab_size, 1, 10, seed=1), random_tokens(model.config.vocab_size, 1, 14, seed=2)
    packed = np.concatenate([a, b], axis=1)
    segments = np.array([[0] * 10 + [1] * 14], np.int32)
    positions = np.array([list(range(10)) + list(range(14))], np.int32)
    out = np.asarray(model(packed, segment_ids=segments, positions=positions))
    np.testing.assert_allclose(out[:, :10], np.asarray(model(a)), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[:, 10:], np.asarray(model(b)), atol=1e-5, rtol=0)
    # without segment ids the second document attends to the first
    mixed = np.asarray(model(packed, positions=positions))
    assert np.abs(mixed[:, 10:] - out[:, 10:]).max() > 1e-3


def test_compile_size_does_not_grow_with_depth():
    def equations(layers):
        cfg = ModelConfig.from_hf_dict(tiny_config("base", num_hidden_layers=layers))
        tree = jax.eval_shape(lambda: jax.tree.map(jnp.asarray, init_tree(cfg)))
        tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda p, b, t: forward(p, b, t, cfg).logits)(tree["params"], tree["buffers"], tokens)
        return len(str(jaxpr).split())  # words: the printer wraps long lines where it likes

    assert equations(3) == equations(12)


@torch.no_grad()
def test_torch_interop_round_trip():
    config = tiny_config("base")
    source = build_torch_model(config, seed=3)
    model = from_torch(source.state_dict(), config)  # from a bare state dict
    target = build_torch_model(config, seed=4)  # different weights
    to_torch(model, target)
    want, got = source.state_dict(), target.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    tokens = torch.as_tensor(random_tokens(config["vocab_size"]), dtype=torch.long)
    torch.testing.assert_close(target(tokens).logits, source(tokens).logits, rtol=0, atol=0)


def test_torch_to_numpy_is_a_view():
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = torch.randn(4, 6).to(dtype)
        view = torch_to_numpy(t)
        assert view.shape == (4, 6) and view.dtype.itemsize == t.element_size()
        assert view.ctypes.data == t.data_ptr()
        np.testing.assert_array_equal(view.astype(np.float32), t.float().numpy())


def test_remat_policies_give_the_same_gradients(checkpoints):
    """Every remat policy (incl. offloading the query/value projections to host memory) only
    changes what is stored for the backward pass, never the result."""
    from moe_jax.model import REMAT_POLICIES

    model = moe_jax.from_pretrained(checkpoints["flat_single"])
    tokens = jnp.asarray(random_tokens(model.config.vocab_size, 2, 16))

    def grads(remat):
        loss = lambda p: forward(p, model.buffers, tokens, model.config, remat=remat).logits.std()  # noqa: E731
        return jax.jit(jax.grad(loss))(model.params)

    want = grads("none")
    for name in [n for n in REMAT_POLICIES if n != "none"]:  # each against "none"
        for a, b in zip(jax.tree.leaves(grads(name)), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7, err_msg=name)
    with pytest.raises(ValueError, match="unknown remat policy"):
        forward(model.params, model.buffers, tokens, model.config, remat="most")


def test_profile_regions_are_named():
    """A profile of a step reads like the code: every region carries its jax.named_scope."""
    cfg = ModelConfig.from_hf_dict(tiny_config("base"))
    tree = init_tree(cfg)
    tokens = np.zeros((1, 8), np.int32)

    def f(params, buffers):
        out = forward(params, buffers, tokens, cfg, mtp=True)
        return out.logits, out.mtp_logits

    text = jax.jit(f).lower(tree["params"], tree["buffers"]).as_text(debug_info=True)
    for scope in ("attention", "mlp", "router", "dispatch", "expert_ffn", "combine", "shared_experts", "mtp"):
        assert f'"{scope}/' in text or f"/{scope}/" in text, scope


def test_chunked_head_loss_equals_the_whole_logits():
    """The training loss's head, a vocabulary chunk at a time with a running log-sum-exp
    (moe_jax.train.objective), against the cross-entropy of the whole logits: each depth's value
    and the gradients of the hidden states and the head (float32), with weighted and masked
    positions and chunks that do not divide the vocabulary (the last one padded)."""
    from moe_jax.train import objective as obj

    rng = np.random.default_rng(0)
    depths, b, s, h, v = 2, 2, 6, 8, 37
    x = jnp.asarray(rng.standard_normal((depths, b, s, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((h, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (depths, b, s)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(depths, b, s)) * (rng.uniform(size=(depths, b, s)) > 0.3), jnp.float32)
    probe = jnp.asarray([1.0, 0.3])

    def whole(x, w):
        logp = jax.nn.log_softmax(jnp.einsum("dbsh,hv->dbsv", x, w), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return (nll * weights).sum((1, 2))

    want = whole(x, w)
    want_grads = jax.grad(lambda x, w: whole(x, w) @ probe, argnums=(0, 1))(x, w)
    for chunk in (5, 16, 37, 64):
        got = obj.head_cross_entropy(x, w, targets, weights, None, chunk)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
        grads = jax.grad(lambda x, w: obj.head_cross_entropy(x, w, targets, weights, None, chunk) @ probe, (0, 1))(x, w)
        for a, b_ in zip(grads, want_grads):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-4, atol=1e-6)
