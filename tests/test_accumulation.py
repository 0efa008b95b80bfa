"""Gradient accumulation with the layer loops' weight gradients added into the float32 sums as the
backward computes them (moe_jax.model.accumulating_scan), against the step on one big batch and
the accumulation that stacks each micro-batch's gradients first. (On meshes, with expert
parallelism and a data axis: test_ep's training steps.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import moe_jax
from converters.tiny import make_tiny
from moe_jax.train.step import init_train_state, make_batch, make_train_step


def test_fused_accumulation_equals_one_big_batch_and_holds_no_stacked_gradient(tmp_path):
    """Every feature of the tiny model (a dense layer, MoE layers, MTP, packed rows with padding),
    8 MoE layers of wider experts so that the layer stacks dominate the step's memory: 4
    micro-batches with remat "full", fused and not, against the whole batch in one pass (loss
    terms, expert loads, the weights after an SGD step, which are the gradients); the fused step's
    temporaries smaller by at least 3/4 of the stacks' bytes (one micro-batch's stacked gradient)."""
    path = make_tiny(tmp_path / "tiny", "base", num_hidden_layers=9, moe_intermediate_size=128)
    model = moe_jax.from_pretrained(path)
    rng = np.random.default_rng(3)
    segments = np.repeat(np.arange(1, 5)[None], 8, 0)[:, np.sort(rng.integers(0, 4, 17))]
    segments[:2, 12:] = 0  # padding
    batch = make_batch(rng.integers(0, 256, (8, 17)), segments)
    sgd = optax.sgd(1.0)  # the new weights are the gradients, linearly

    def step(n, remat, fuse=True):
        state = init_train_state(jax.tree.map(jnp.copy, {"params": model.params, "buffers": model.buffers}), sgd)
        train_step = make_train_step(
            model.config, sgd, compute_dtype="float32", grad_accum=n, remat=remat, fuse_accumulation=fuse
        )
        compiled = train_step.lower(state, batch).compile()  # run as compiled: one compilation
        temporaries = compiled.memory_analysis().temp_size_in_bytes
        return (*compiled(state, batch, jax.device_put(train_step.numbers)), temporaries)

    want, m_want, _ = step(1, "none")
    results = {fuse: step(4, "full", fuse) for fuse in (True, False)}
    for fuse, (got, m_got, _) in results.items():
        for key in ("loss", "ce_loss", "mtp_loss", "balance_loss", "grad_norm"):
            np.testing.assert_allclose(float(m_got[key]), float(m_want[key]), rtol=1e-5, err_msg=f"{key}, fused={fuse}")
        np.testing.assert_array_equal(np.asarray(m_got["expert_load"]), np.asarray(m_want["expert_load"]))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5, err_msg=f"fused={fuse}")
    stacks = sum(x.nbytes for kind in ("dense", "moe") for x in jax.tree.leaves(model.params[kind]))
    saved = results[False][2] - results[True][2]
    assert saved >= 0.75 * stacks, (saved, stacks)


def test_fused_accumulation_of_deepseek_v32_equals_one_big_batch(tmp_path):
    """DeepSeek-V3.2 in its sparse stage (each query's top-k keys, the indexers' loss among the
    layer loop's outputs), rows longer than index_topk: 2 fused micro-batches against one pass."""
    model = moe_jax.from_pretrained(make_tiny(tmp_path / "tiny", "v32"))
    batch = make_batch(np.random.default_rng(4).integers(0, 256, (4, 81)))
    sgd = optax.sgd(1.0)
    results = []
    for n, remat in ((1, "none"), (2, "full")):
        state = init_train_state(jax.tree.map(jnp.copy, {"params": model.params, "buffers": model.buffers}), sgd)
        step = make_train_step(model.config, sgd, compute_dtype="float32", grad_accum=n, remat=remat)
        traced = str(jax.make_jaxpr(step.jitted)(state, batch, step.numbers))  # before the step donates the state
        results.append(step(state, batch))
    # the dense and the MoE layer loops ran their written-out backward (accumulating_scan's run_bwd)
    assert traced.count("run_bwd") == 2, "the fused accumulation was not used"
    (want, m_want), (got, m_got) = results
    for key in ("loss", "ce_loss", "index_loss", "balance_loss", "grad_norm"):
        np.testing.assert_allclose(float(m_got[key]), float(m_want[key]), rtol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


def test_accumulating_scan_keeps_what_its_remat_policy_saves():
    """accumulating_scan with remat "save_dispatch"'s policy: each layer's value named DISPATCHED
    (here a sine, standing for what the exchange received) comes from the forward pass, so the
    backward computes no sine (with remat "full" it recomputes it); the weight gradients added into
    the sums equal jax's own gradient of the plain scan, as "full"'s do. What it saves is only the
    named value: one [layers, rows, width] stack beside the layer inputs."""
    from jax.ad_checkpoint import checkpoint_name

    from moe_jax.model import REMAT_POLICIES, accumulating_scan
    from moe_jax.parallel.ep import DISPATCHED

    rng = np.random.default_rng(0)
    layers, rows, width = 3, 4, 5
    params = {"w": jnp.asarray(rng.standard_normal((layers, width, width)) * 0.5, jnp.float32)}
    buffers = {"b": jnp.asarray(rng.standard_normal((layers, width)), jnp.float32)}
    h0, ctx = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((rows, width), (width,)))

    def body(h, layer, ctx):
        p, buf = layer
        received = checkpoint_name(jnp.sin(h @ p["w"]), DISPATCHED)
        h = jnp.tanh(received @ p["w"].T + buf["b"]) * ctx
        return h, (h,)

    def loss(h_last, hs):
        return (h_last**2).sum() + hs[0].sum()  # linear in hs: no residual of its own

    def plain(params):
        return loss(*jax.lax.scan(lambda h, layer: body(h, layer, ctx), h0, (params, buffers)))

    want = jax.grad(plain)(params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    for name, sines in (("full", 2), ("save_dispatch", 1)):

        def fused(sums, policy=REMAT_POLICIES[name]):
            return loss(*accumulating_scan(body, params, buffers, h0, ctx, sums, policy))

        got = jax.grad(fused)(zeros)
        np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-5, atol=1e-6, err_msg=name)
        program = str(jax.make_jaxpr(jax.grad(fused))(zeros))
        assert program.count(" sin ") == sines, (name, program.count(" sin "))
        residuals = jax.eval_shape(lambda s: jax.vjp(fused, s)[1], zeros)
        kept = [x.shape for x in jax.tree.leaves(residuals) if x.shape == (layers, rows, width)]
        assert len(kept) == (2 if name == "save_dispatch" else 1), (name, kept)  # the layer outputs, and the sines
