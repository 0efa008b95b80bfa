"""Expert-parallel MoE on 8 CPU devices against the single-device layer (subprocess: the device
count must be set before jax starts)."""

import os
import subprocess
import sys

import numpy as np

from moe_jax.config import DEEPSEEK_V3, ModelConfig
from moe_jax.parallel.ep import max_ranks_per_token, ranks_per_token

# 8 forced CPU devices, and the suite's compiler flags (conftest.py). These compare sharded against
# unsharded results computed in the same process with the same flags.
ENV = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {os.environ['XLA_FLAGS']}"}

SCRIPT = r"""
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
from moe_jax.config import ModelConfig
from moe_jax.moe import moe_layer, route, routed_experts
from moe_jax.parallel.ep import ExpertParallel, dispatch_plan, ep_moe
from moe_jax.quant import mxfp8

E = 32
def layer(hidden):  # (config, weights) of a one-layer model of this width
    cfg = ModelConfig.from_hf_dict(dict(
        model_type="deepseek_v3", vocab_size=16, hidden_size=hidden, intermediate_size=8, moe_intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=1, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2,
        v_head_dim=4, n_routed_experts=E, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=0, n_shared_experts=0))
    p = {"router": jnp.asarray(rng.standard_normal((hidden, E)), jnp.float32),
         "experts": {k: jnp.asarray(rng.standard_normal(s) * 1.2 / np.sqrt(hidden), jnp.float32)
                     for k, s in (("gate", (E, hidden, 8)), ("up", (E, hidden, 8)), ("down", (E, 8, hidden)))}}
    return cfg, p
rng = np.random.default_rng(0)
cfg, p = layer(16)
x = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
# Router correction biases, arguments of the jitted functions (one compilation per mesh serves all):
# balanced (small random), skewed (popularity falling with the id), every token to expert 5 (and 3
# others), every token's 4 experts on one rank (experts 0-3: one rank at EP 8).
biases = {
    "balanced": jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32),
    "skewed": jnp.linspace(1.0, -1.0, E),
    "one_expert": jnp.zeros(E).at[5].set(10.0),
    "one_rank": jnp.zeros(E).at[:4].set(10.0),
}

def with_grads(f):  # the forward, its routing, its overflow and its gradients, jitted
    def run(p, bias, x):
        out, routing = f(p, bias, x)
        grads = jax.grad(lambda p, x: (f(p, bias, x)[0] ** 2).sum(), argnums=(0, 1))(p, x)
        return out, routing.experts, routing.overflow, grads
    return jax.jit(run)

single = with_grads(lambda p, bias, x: moe_layer(p, bias, x, cfg, jnp.float32, "tiled"))
wants = {name: single(p, bias, x) for name, bias in biases.items()}

def block_atol(b):  # the wide layer (hidden 256, blocks 2^14 apart): 1e-5 of the largest value in b's 128-wide block
    h = b.shape.index(256)
    largest = np.moveaxis(np.abs(b), h, -1).reshape(-1, 2, 128).max(axis=(0, 2))
    return 1e-5 * np.repeat(largest, 128).reshape([256 if i == h else 1 for i in range(b.ndim)])

def close(a, b, what, rtol=1e-4, blocks=False):
    a, b = np.asarray(a), np.asarray(b)
    if not blocks:
        return np.testing.assert_allclose(a, b, atol=1e-5, rtol=rtol, err_msg=what)
    off = np.abs(a - b) - block_atol(b) - rtol * np.abs(b)
    worst = np.unravel_index(off.argmax(), off.shape)
    assert off.max() <= 0, f"{what}: {(off > 0).sum()} of {off.size} differ, at {worst}: {a[worst]} vs {b[worst]}"

def check(got, want, what, blocks=False):
    out, experts, _, g = got
    close(out, want[0], what, 1e-5, blocks)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(want[1]), err_msg=what)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want[3])):
        close(a, b, what, 1e-4, blocks)

def mesh_of(shape, names):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)

# (mesh shape, axes, transport, capacity). The bounded transport at capacities that make the
# skewed routings take further rounds (checked below); all_to_all is the fixed worst-case buffer.
# (data x expert with all_to_all, and data x fsdp x expert, run in the whole model's mesh test below)
cases = [((1,), ("expert",), "all_to_all", 1.5), ((1,), ("expert",), "ragged_emulated", 1.25),
         ((8,), ("expert",), "all_to_all", 1.5),
         ((8,), ("expert",), "ragged_emulated", 0.5), ((2, 4), ("data", "expert"), "ragged_emulated", 0.3),
         ((8,), ("expert",), "ragged_emulated", 1e-4),  # a budget of one row: a round per row, still exact
         ((2, 4), ("expert_node", "expert"), "ragged_emulated", 0.5),
         ((2, 2, 2), ("data", "expert_node", "expert"), "ragged_emulated", 0.3)]
results = {}
for shape, names, transport, capacity in cases:
    mesh, options = mesh_of(shape, names), ExpertParallel(capacity=capacity, transport=transport)
    parallel = with_grads(lambda p, bias, x, mesh=mesh, o=options: ep_moe(p, bias, x, cfg, mesh, options=o))
    for name, bias in biases.items():
        got = parallel(p, bias, x)
        check(got, wants[name], f"{shape} {names} {transport} {name}")
        results[shape, names, transport, name] = got
        if transport == "ragged_emulated" and capacity < 1 and name != "balanced":
            assert int(got[2]) > 0, (shape, names, name, "took no further round")
        if transport == "all_to_all":
            assert int(got[2]) == 0
# the hierarchical exchange equals the flat one
for name in biases:
    flat, hier = results[(8,), ("expert",), "ragged_emulated", name], results[(2, 4), ("expert_node", "expert"), "ragged_emulated", name]
    np.testing.assert_allclose(np.asarray(hier[0]), np.asarray(flat[0]), atol=1e-6, rtol=1e-6)
# a capacity that covers the worst case (every source's 8 tokens x 4 pairs to one rank: 8 x the
# balanced load) never takes a further round
worst = with_grads(lambda p, bias, x: ep_moe(p, bias, x, cfg, mesh_of((8,), ("expert",)),
                                            options=ExpertParallel(capacity=8.0, transport="ragged_emulated")))
for name, bias in biases.items():
    got = worst(p, bias, x)
    check(got, wants[name], f"worst-case capacity {name}")
    assert int(got[2]) == 0, name

# a device's 8 tokens through the layer 4 at a time (model.ep_chunk), at a capacity that makes the
# routings take further rounds in each chunk: the single device's results, overflow summed
chunked = with_grads(lambda p, bias, x: ep_moe(p, bias, x, cfg, mesh_of((2, 4), ("expert_node", "expert")),
                                              options=ExpertParallel(capacity=0.5, transport="ragged_emulated", chunk=4)))
for name, bias in biases.items():
    got = chunked(p, bias, x)
    check(got, wants[name], f"chunked {name}")
    assert int(got[2]) > 0, name  # half the balanced load a round: every routing overflows

# one token a device (decode-sized batches; model.ep_chunk=1): a round has room for one row's units,
# more rows than the device's ranks x tokens, on the flat and the hierarchical exchange
for shape, names, tokens, chunk in (((2,), ("expert",), 2, None), ((2, 4), ("expert_node", "expert"), 8, None),
                                    ((4, 2), ("data", "expert"), 64, 1)):
    few = with_grads(lambda p, bias, x, mesh=mesh_of(shape, names), chunk=chunk: ep_moe(
        p, bias, x, cfg, mesh, options=ExpertParallel(transport="ragged_emulated", chunk=chunk)))
    for name in ("balanced", "one_rank"):
        check(few(p, biases[name], x[:tokens]), single(p, biases[name], x[:tokens]), f"{tokens} tokens on {shape} {names}")

# FP8 dispatch: the experts see each row quantized once (e4m3, a power-of-two scale per 128, numpy
# below) and the gradient passes the rounding straight through; routing uses the unrounded row. On
# the hierarchical mesh: both stages move the quantized rows (the inner one re-sends them as they came).
# Rows two blocks wide (hidden 256), the first block 2^-14 of the second: with power-of-two scales the
# block size shows only where a block's values fall below e4m3's normal range (2^-6 of its 448), as the
# first block's do under a scale for the whole row; the weights reading the first block are 2^14
# larger, so that its rounding counts as much as the second's.
def qdq_numpy(a):
    a = np.asarray(a, np.float32)
    blocks = a.reshape(*a.shape[:-1], -1, 128)
    scale = 2.0 ** np.ceil(np.log2(np.abs(blocks).max(-1, keepdims=True) / 448.0))
    return (np.asarray((blocks / scale).astype(jnp.float8_e4m3fn), np.float32) * scale).reshape(a.shape)
tilt = np.repeat([2.0 ** -14, 1.0], 128)
def two_blocks(shape):
    return jnp.asarray(rng.standard_normal(shape) * tilt, jnp.float32)
narrow = cfg, p, x
cfg, p = layer(256)
p = {"router": p["router"] / tilt[:, None] / 16,  # logits of unit scale: the router's gradient not saturated
     "experts": {k: w / (tilt[:, None] if k != "down" else 1) for k, w in p["experts"].items()}}
x = two_blocks((64, 256))
assert np.array_equal(np.asarray(mxfp8.dequantize(*mxfp8.quantize(x, block=128), block=128)), qdq_numpy(x))
row_scale = 2.0 ** np.ceil(np.log2(np.abs(np.asarray(x)).max(-1, keepdims=True) / 448.0))
assert not np.array_equal(qdq_numpy(x), np.asarray((x / row_scale).astype(jnp.float8_e4m3fn), np.float32) * row_scale)
x_rounded = jnp.asarray(qdq_numpy(x))
def reference_fp8(p, bias, x):  # called with x only
    r = route(x, p["router"], bias, cfg)
    xq = x + jax.lax.stop_gradient(x_rounded - x)
    return routed_experts(xq, r.experts, r.weights, p["experts"], E, jnp.float32, "tiled"), r
options = ExpertParallel(capacity=0.5, transport="ragged_emulated", dispatch="float8")
got = with_grads(lambda p, bias, x: ep_moe(p, bias, x, cfg, mesh_of((2, 4), ("expert_node", "expert")), options=options))
want = with_grads(reference_fp8)
wide_biases = {"balanced": biases["balanced"], "one_rank": biases["one_rank"]}
for name, bias in wide_biases.items():
    check(got(p, bias, x), want(p, bias, x), f"fp8 {name}", blocks=True)

# FP8 gradient dispatch: the combined rows' gradients reach the experts quantized once (e4m3, a
# power-of-two scale per 128, numpy above), through both stages and the further rounds ("one_rank"
# takes some at this capacity); the forward is untouched. A fixed cotangent c, so that its rounding
# is known: the single-device layer's gradients with the rounded c.
c = two_blocks((64, 256))
p = {**p, "experts": {**p["experts"], "down": p["experts"]["down"] / tilt}}  # dh reads c's first block at 2^14
def routed(p, bias, x):
    r = route(x, p["router"], bias, cfg)
    return routed_experts(x, r.experts, r.weights, p["experts"], E, jnp.float32, "tiled")
def pulled_back(f):  # (output, gradients of <output, cotangent> with respect to p and x)
    return jax.jit(lambda p, bias, x, ct: (lambda out, pb: (out, pb(ct)))(*jax.vjp(lambda p, x: f(p, bias, x), p, x)))
mesh = mesh_of((2, 4), ("expert_node", "expert"))
options = ExpertParallel(capacity=0.5, transport="ragged_emulated", gradient_dispatch="float8")
got = pulled_back(lambda p, bias, x: ep_moe(p, bias, x, cfg, mesh, options=options)[0])
want = pulled_back(routed)
for name, bias in wide_biases.items():
    (out, g), (out_want, g_want) = got(p, bias, x, c), want(p, bias, x, jnp.asarray(qdq_numpy(c)))
    close(out, out_want, name, 1e-5, blocks=True)
    for a, b, unrounded in zip(jax.tree.leaves(g), jax.tree.leaves(g_want), jax.tree.leaves(want(p, bias, x, c)[1])):
        close(a, b, f"fp8 gradient {name}", blocks=True)
        a, unrounded = np.asarray(a), np.asarray(unrounded)
        assert not np.allclose(a, unrounded, atol=block_atol(unrounded), rtol=1e-4), "the gradient was not rounded"

# remat "save_dispatch": the backward recomputes the layer but for what the outer stage's dispatch
# received, which the forward kept: the same gradients as remat "full", bit for bit, and one send of
# hidden rows fewer in the compiled program (the emulated transport gathers each send's rows: [.., 256])
import re
from moe_jax.model import REMAT_POLICIES
for dispatch in ("bfloat16", "float8"):
    options = ExpertParallel(capacity=0.5, transport="ragged_emulated", dispatch=dispatch)
    compiled = {}
    for policy in ("full", "save_dispatch"):
        layer_fn = jax.checkpoint(lambda p, x: ep_moe(p, biases["one_rank"], x, cfg, mesh, options=options)[0],
                                  policy=REMAT_POLICIES[policy])
        grad = jax.jit(jax.grad(lambda p, x: (layer_fn(p, x) ** 2).sum(), argnums=(0, 1)))
        hlo = grad.lower(p, x).compile().as_text()
        compiled[policy] = grad(p, x), len(re.findall(r",256\]\S* all-gather(-start)?\(", hlo))
    for a, b in zip(jax.tree.leaves(compiled["full"][0]), jax.tree.leaves(compiled["save_dispatch"][0])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=dispatch)
    assert compiled["save_dispatch"][1] == compiled["full"][1] - 1, (dispatch, compiled["full"][1], compiled["save_dispatch"][1])
cfg, p, x = narrow

for bias in biases.values():
    # deduplication: rows sent == distinct (token, destination rank) pairs, never more than naive
    r = route(x, p["router"], bias, cfg)
    send, ids, _ = dispatch_plan(r.experts, r.weights, 4, 8)
    distinct = sum(len(set((np.asarray(r.experts[t]) // 8).tolist())) for t in range(64))
    assert int(send.sum()) == distinct <= 64 * 4
    assert int((ids >= 0).sum()) == 64 * 4  # every choice arrives: nothing dropped
print("ok")
"""


def test_balanced_rows_per_token_match_a_simulation():
    """ranks_per_token's closed form against sampling its routing model: `topk_group` groups chosen
    uniformly, k experts uniform among theirs with every chosen group used (or k uniform over all
    experts); and max_ranks_per_token bounds every sample."""
    rng = np.random.default_rng(0)
    configs = [
        DEEPSEEK_V3,
        {**DEEPSEEK_V3, "n_group": 1, "topk_group": 1},
        {**DEEPSEEK_V3, "n_routed_experts": 64, "num_experts_per_tok": 6},
    ]
    for fields in configs:
        cfg = ModelConfig.from_hf_dict(fields)
        e, k, groups, kept = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        per_group = e // groups
        samples = []
        while len(samples) < 4000:
            chosen = rng.choice(groups, kept, replace=False)
            pool = (chosen[:, None] * per_group + np.arange(per_group)).ravel()
            experts = rng.choice(pool, k, replace=False)
            if len(set(experts // per_group)) == kept or kept == groups:  # every chosen group used
                samples.append(experts)
        samples = np.array(samples)
        for ranks in (4, 8, 16, 32, 64):
            reached = np.array([len(set(s)) for s in samples // (e // ranks)])
            assert abs(reached.mean() / ranks_per_token(cfg, ranks) - 1) < 0.02, (fields, ranks)
            assert reached.max() <= max_ranks_per_token(cfg, ranks), (fields, ranks)


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
# (data x expert and data x fsdp x expert: their gradients are checked by the training steps below)
for spec in ("expert=8", "fsdp=2,expert=4", "tensor=2,expert=4"):
    model = moe_jax.from_pretrained(path, mesh=spec)
    logits, g = logits_and_grads(model)
    np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
# the embedding lookup that leaves the table split (moe_jax.model.embed_tokens) against a per-token
# loop, its gradient against the single device's: hidden over FSDP axes, vocabulary over tensor, and
# a batch of one row that no axis splits
from moe_jax.model import embed_tokens
from moe_jax.sharding import leaf_sharding, mesh_from_spec
rng = np.random.default_rng(2)
table = rng.standard_normal((64, 32)).astype(np.float32)
for spec, rows in (("data=2,fsdp=2,tensor=2", 4), ("fsdp=2,expert_node=2,expert=2", 8), ("fsdp=4,tensor=2", 1)):
    mesh, ids = mesh_from_spec(spec), rng.integers(0, 64, (rows, 5)).astype(np.int32)
    cotangent = rng.standard_normal((rows, 5, 32)).astype(np.float32)
    lookup = lambda t, m: jnp.sum(embed_tokens(t, jnp.asarray(ids), jnp.float32, m) * cotangent)
    placed = jax.device_put(table, leaf_sharding(mesh, ("params", "embed"), table.shape))
    out = jax.jit(lambda t: embed_tokens(t, jnp.asarray(ids), jnp.float32, mesh))(placed)
    np.testing.assert_array_equal(np.asarray(out), np.stack([[table[i] for i in row] for row in ids]))
    g = jax.jit(jax.grad(lambda t: lookup(t, mesh)))(placed)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(lambda t: lookup(t, None))(table)), atol=1e-6)
# a converted checkpoint placed on a Mesh object: the routed experts split over its expert axis, and
# their hidden dimension over the data axis (the master weights split over the expert's replicas)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))
model = moe_jax.from_pretrained(converted, mesh=mesh)
w = model.params["moe"]["experts"]["gate"]
assert w.sharding.spec[1:3] == ("expert", "data"), w.sharding
assert {s.data.shape for s in w.addressable_shards} == {(w.shape[0], w.shape[1] // 4, w.shape[2] // 2, w.shape[3])}
single = moe_jax.from_pretrained(converted)
np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(single(tokens)), atol=1e-5, rtol=0)
try:  # 5 tokens cannot split over 8 devices: one line saying so, not shard_map's error
    model(tokens[:1, :5])
    raise AssertionError("5 tokens ran on 8 devices")
except ValueError as e:
    assert str(e).startswith("tokens: 1 x 5 = 5 do not split over the mesh's 8 devices"), e
# the training state on that mesh: AdamW's moments laid out as their parameters, not replicated
import optax
state = moe_jax.init_train_state(model, optax.adamw(1e-3), mesh)
mu = state["opt_state"][0].mu
for (path, p), m in zip(jax.tree_util.tree_leaves_with_path(model.params), jax.tree.leaves(mu)):
    assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (jax.tree_util.keystr(path), m.sharding, p.sharding)
assert mu["moe"]["experts"]["gate"].sharding.spec[1] == "expert"
# training steps with MTP, a router biased so that every token picks the same experts, and packed
# rows of uneven documents and padding, against the single device's step on the whole batch (metrics,
# expert loads, the updated weights and router biases): the fixed worst-case buffer on the
# hierarchical mesh (its bounded exchange's gradients: the script above); the bounded exchange at a
# small capacity (further rounds, in the metrics) with gradient accumulation (optim.grad_accum: 4
# micro-batches) on a data axis, over which the experts' master weights are split and gathered once a
# step, each data replica computing with its own copy (moe_jax.sharding.for_compute), and remat
# save_dispatch (each layer recomputed in the backward from what its dispatch received, kept by the
# forward); and data, fsdp and expert axes together with 2 micro-batches and remat full. With remat,
# the layer loops add each layer's gradients into the sums as they compute them
# (moe_jax.model.accumulating_scan)
import re
from moe_jax.hlo import parse
from moe_jax.parallel.ep import ExpertParallel
from moe_jax.train.step import init_train_state, make_batch, make_train_step
rows = np.random.default_rng(3)
segments = np.repeat(np.arange(1, 5)[None], 16, 0)[:, np.sort(rows.integers(0, 4, 17))]
segments[:3, 12:] = 0  # padding
tokens = rows.integers(0, 256, (16, 17))

def train_step(mesh, ep=None, grad_accum=1, remat="none"):
    model = moe_jax.from_pretrained(sys.argv[1], mesh=mesh)
    skewed = jax.tree.map(lambda b: b.at[..., :model.config.num_experts_per_tok].add(10.0), model.buffers)
    sgd = optax.sgd(1.0)  # the new weights are the gradients, linearly (Adam would magnify round-off in ~0 ones)
    state = init_train_state(jax.tree.map(jnp.copy, {"params": model.params, "buffers": skewed}), sgd, mesh)
    step = make_train_step(model.config, sgd, mesh=mesh, ep=ep, compute_dtype="float32", grad_accum=grad_accum, remat=remat)
    batch = make_batch(tokens, segments, mesh=mesh)
    module = mesh and parse(step.lower(state, batch).compile().as_text())
    return (*step(state, batch), module, model)

want, m_want, _, model = train_step(None)
assert "mtp" in model.params
hierarchical = Mesh(np.array(jax.devices()).reshape(2, 4), ("expert_node", "expert"))
with_data = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))
with_fsdp = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "expert"))
bounded, fixed = ExpertParallel(capacity=0.3, transport="ragged_emulated"), ExpertParallel(transport="all_to_all")
for mesh, ep, n, remat in ((hierarchical, fixed, 1, "none"), (with_data, bounded, 4, "save_dispatch"), (with_fsdp, fixed, 2, "full")):
    got, m_got, module, model = train_step(mesh, ep, n, remat)
    assert (np.asarray(m_got["ep_overflow"]).sum() > 0) == (ep is bounded), mesh
    for key in ("loss", "ce_loss", "mtp_loss", "balance_loss", "grad_norm"):
        np.testing.assert_allclose(float(m_got[key]), float(m_want[key]), rtol=1e-5, err_msg=key)
    np.testing.assert_array_equal(np.asarray(m_got["expert_load"]), np.asarray(m_want["expert_load"]))
    for a, b in zip(jax.tree.leaves((got["params"], got["buffers"])), jax.tree.leaves((want["params"], want["buffers"]))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    if "fsdp" in mesh.shape:  # ZeRO-3: fsdp gathers an expert's weights where each layer uses them
        continue
    # the experts stay put: no all-gather of a layer's experts inside a loop of the compiled step;
    # with the data axis, their gather over it happens once, outside
    bodies = {b for lines in module.computations.values() for line in lines for b in re.findall(r"body=%?([\w.\-]+)", line)}
    w = model.params["moe"]["experts"]["gate"]  # [layers, experts, hidden, width]
    local = w.shape[1] // mesh.shape["expert"]
    def of_experts(line):
        return re.search(rf"\[(\d+,)?{local},({w.shape[2]},{w.shape[3]}|{w.shape[3]},{w.shape[2]})\]", line)
    inside = [line for lines in module.computations.values() for line in lines if " all-gather" in line and of_experts(line)]
    assert not [line for line in inside if any(line in module.computations[b] for b in bodies)], inside
    assert bool(inside) == ("data" in mesh.shape), inside
    # nor is their gradient reduced inside a loop: with a data axis each replica sums its own over
    # the micro-batches, and the replicas' sums are reduced once, after
    reductions = re.compile(r" (all-reduce|reduce-scatter|all-to-all)(-start)?\(")
    reduced = [line for b in bodies for line in module.computations[b] if reductions.search(line) and of_experts(line)]
    assert not reduced, reduced
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


def test_fp8_dispatch_refused_by_the_fixed_all_to_all():
    """The all_to_all transport (XLA:CPU's) moves rows in the compute dtype: asking it for FP8 rows
    or gradients is an error naming the options, not a silent bf16 exchange."""
    import jax
    import jax.numpy as jnp
    import pytest
    from jax.sharding import Mesh

    from moe_jax.parallel.ep import ExpertParallel, ep_moe

    cfg = ModelConfig.from_hf_dict(
        {**DEEPSEEK_V3, "hidden_size": 16, "n_routed_experts": 8, "n_group": 1, "topk_group": 1}
    )
    p = {"router": jnp.zeros((16, 8)), "experts": {k: jnp.zeros((8, 16, 16)) for k in ("gate", "up", "down")}}
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    for option in ({"dispatch": "float8"}, {"gradient_dispatch": "float8"}):
        with pytest.raises(ValueError, match="model.ep_dispatch / model.ep_gradient_dispatch: float8"):
            ep_moe(
                p, jnp.zeros(8), jnp.zeros((4, 16)), cfg, mesh, options=ExpertParallel(transport="all_to_all", **option)
            )


def test_a_capacity_past_the_worst_case_is_the_worst_case():
    """model.ep_capacity is a multiple of the balanced load: one past every pair of every rank
    landing on one receiver buys nothing, so the budget stops there (not an integer overflowing
    int32 in the exchange's arithmetic); infinity is refused."""
    import jax
    import pytest
    from jax.sharding import Mesh

    from moe_jax.parallel.ep import ExpertParallel, stages

    cfg = ModelConfig.from_hf_dict({**DEEPSEEK_V3, "n_routed_experts": 8, "n_group": 1, "topk_group": 1})
    mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
    (stage,) = stages(cfg, mesh, 4096, 1e9)
    assert stage.budget == 4096 * cfg.num_experts_per_tok < 2**31
    assert stages(cfg, mesh, 4096, 0.5)[0].budget == 4096 * cfg.num_experts_per_tok // 2
    with pytest.raises(ValueError, match="capacity must be a finite number > 0, got inf"):
        ExpertParallel(capacity=float("inf"))
