"""Expert-parallel MoE on 8 CPU devices against the single-device layer (subprocess: the device
count must be set before jax starts)."""

import os
import subprocess
import sys

# 8 forced CPU devices, and the suite's compiler flags (conftest.py). These compare sharded against
# unsharded results computed in the same process with the same flags.
ENV = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {os.environ['XLA_FLAGS']}"}

SCRIPT = r"""
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
from moe_jax.config import ModelConfig
from moe_jax.moe import moe_layer, route
from moe_jax.parallel.ep import dispatch_plan, ep_moe

cfg = ModelConfig.from_hf_dict(dict(
    model_type="deepseek_v3", vocab_size=16, hidden_size=16, intermediate_size=8, moe_intermediate_size=8,
    num_hidden_layers=1, num_attention_heads=1, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2,
    v_head_dim=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
    first_k_dense_replace=0, n_shared_experts=0))
rng = np.random.default_rng(0)
p = {"router": jnp.asarray(rng.standard_normal((16, 16)), jnp.float32),
     "experts": {k: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
                 for k, s in (("gate", (16, 16, 8)), ("up", (16, 16, 8)), ("down", (16, 8, 16)))}}
x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
# router correction biases: random, and skewed (every token's top-4 slots on experts 0-3). An argument
# of the jitted functions, not a constant in them: one compilation per mesh serves both.
biases = [jnp.asarray(rng.standard_normal(16) * 0.1, jnp.float32), jnp.zeros(16).at[:4].set(10.0)]

@jax.jit
def single(p, bias, x):  # the single-device layer, its routing and its gradients
    f = lambda p, x: moe_layer(p, bias, x, cfg, jnp.float32, "tiled")  # noqa: E731
    out, routing = f(p, x)
    return out, routing.experts, jax.grad(lambda p, x: (f(p, x)[0] ** 2).sum(), argnums=(0, 1))(p, x)

wants = [single(p, bias, x) for bias in biases]
cases = [((1,), "all_to_all"), ((2,), "all_to_all"), ((4,), "all_to_all"), ((8,), "all_to_all"),
         ((2,), "ragged_emulated"), ((8,), "ragged_emulated"), ((2, 4), "all_to_all"), ((2, 2, 2), "all_to_all")]
for shape, transport in cases:  # expert alone, data x expert, data x fsdp x expert
    names = {1: ("expert",), 2: ("data", "expert"), 3: ("data", "fsdp", "expert")}[len(shape)]
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)

    @jax.jit
    def parallel(p, bias, x, mesh=mesh, t=transport):  # the forward, and separately its gradients
        f = lambda p, x: ep_moe(p, bias, x, cfg, mesh, transport=t)  # noqa: E731
        out, routing = f(p, x)
        return out, routing.experts, jax.grad(lambda p, x: (f(p, x)[0] ** 2).sum(), argnums=(0, 1))(p, x)

    for bias, (want, want_experts, gw) in zip(biases, wants):
        out, experts, g = parallel(p, bias, x)
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(experts), np.asarray(want_experts))
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gw)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
for bias in biases:
    # deduplication: rows sent == distinct (token, destination rank) pairs, never more than naive
    r = route(x, p["router"], bias, cfg)
    send, ids, _ = dispatch_plan(r.experts, r.weights, 4, 4)
    distinct = sum(len(set((np.asarray(r.experts[t]) // 4).tolist())) for t in range(64))
    assert int(send.sum()) == distinct <= 64 * 4
    assert int((ids >= 0).sum()) == 64 * 4  # every choice arrives: nothing dropped
print("ok")
"""


def test_expert_parallel_equals_single_device():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]


MODEL_SCRIPT = r"""
import sys, numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
import moe_jax
from moe_jax.model import forward
from validation.parity import compare
from validation.reference import load_reference
path, converted = sys.argv[1:3]
single = moe_jax.from_pretrained(path)
tokens = np.random.default_rng(0).integers(0, 256, (8, 16)).astype(np.int32)
def logits_and_grads(model):  # one program per mesh: the forward and its gradients
    def loss(params):
        logits = forward(params, model.buffers, jnp.asarray(tokens), model.config, mesh=model.mesh).logits
        return logits.mean(), logits
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(model.params)
    return np.asarray(logits), grads
want, g_want = logits_and_grads(single)
# the spine's parity check, with expert parallelism on
report = compare(moe_jax.from_pretrained(path, mesh="data=2,expert=4"), load_reference(path), tokens)
assert report["max_abs"] <= 1e-4 and report["top1"] == 1.0 and report["kl_max"] < 1e-7, report
for spec in ("expert=8", "data=2,expert=4", "fsdp=2,expert=4", "data=2,fsdp=2,expert=2", "tensor=2,expert=4"):
    model = moe_jax.from_pretrained(path, mesh=spec)
    logits, g = logits_and_grads(model)
    np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
# a converted checkpoint placed on a Mesh object: the routed experts split over its expert axis
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))
model = moe_jax.from_pretrained(converted, mesh=mesh)
w = model.params["moe"]["experts"]["gate"]
assert w.sharding.spec[1] == "expert", w.sharding
assert {s.data.shape for s in w.addressable_shards} == {(w.shape[0], w.shape[1] // 4, *w.shape[2:])}
single = moe_jax.from_pretrained(converted)
np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(single(tokens)), atol=1e-5, rtol=0)
# the training state on that mesh: AdamW's moments laid out as their parameters, not replicated
import optax
state = moe_jax.init_train_state(model, optax.adamw(1e-3), mesh)
mu = state["opt_state"][0].mu
for (path, p), m in zip(jax.tree_util.tree_leaves_with_path(model.params), jax.tree.leaves(mu)):
    assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (jax.tree_util.keystr(path), m.sharding, p.sharding)
assert mu["moe"]["experts"]["gate"].sharding.spec[1] == "expert"
print("ok")
"""


def test_model_on_meshes_equals_single_device(checkpoints, converted):
    """expert alone and with data, fsdp and tensor axes; parity against transformers; and a converted
    checkpoint placed on a mesh (one 8-device process for all: each start imports jax and torch)."""
    args = [checkpoints["base_sharded"], converted("base_sharded")]
    proc = subprocess.run(
        [sys.executable, "-c", MODEL_SCRIPT, *map(str, args)], capture_output=True, text=True, env=ENV
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]
