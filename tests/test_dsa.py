"""DeepSeek-V3.2's sparse attention (moe_jax.dsa): the blockwise selection, sparse MLA and indexer
loss against direct dense computations; the model against transformers' DeepseekV32ForCausalLM;
the indexer loss and every gradient against a PyTorch reference built from transformers' modules
and the report's formulas; a tiny V3.2 checkpoint in DeepSeek's format through convert, validate,
both training stages, resume, export and transformers; hostile V3.2 inputs."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import moe_jax
from converters.tiny import build_torch_model, make_tiny, tiny_config
from converters.torch_interop import from_torch
from moe_jax import dsa
from moe_jax.config import DEEPSEEK_V32, ModelConfig
from moe_jax.kernels.attention import allowed, document_ids
from moe_jax.params import ATTN_INDEXER
from moe_jax.train.config import load_config
from moe_jax.train.loop import train
from moe_jax.train.objective import flops_per_token
from tests.helpers import all_tensors, assert_bit_identical, error_lines, run_main
from validation.parity import compare
from validation.reference import load_reference


# ---- the blockwise kernels against dense computations ----------------------------------------------
def dense_reference(lat: dsa.Latents, index: dsa.Index, documents, topk: int, scale: float, sparse: bool):
    """Everything at once, [B, S, S] and [B, N, S, S]: the chosen keys as a mask, MLA with its keys
    and values expanded per head, and the indexer's KL (over the chosen keys, or every visible
    key), written from the definitions."""
    b, s = documents.shape
    pos = jnp.arange(s)
    ok = allowed(pos, pos, documents, documents)  # [B, S, S]
    idx_scores = jnp.einsum(
        "bsh,bsht->bst",
        index.w,
        jax.nn.relu(jnp.einsum("bshd,btd->bsht", index.q, index.k) / np.sqrt(index.q.shape[-1])),
    )
    if sparse:
        masked = jnp.where(ok, idx_scores, -jnp.inf)
        kth = -jnp.sort(-masked, axis=-1)[..., min(topk, s) - 1 : min(topk, s)]
        keep = ok & (masked >= kth)
    else:
        keep = ok
    k_nope = jnp.einsum("btc,cnd->btnd", lat.c_kv, lat.w_k)
    v = jnp.einsum("btc,cnv->btnv", lat.c_kv, lat.w_v)
    logits = (
        jnp.einsum("bsnd,btnd->bnst", lat.q_nope, k_nope) + jnp.einsum("bsnr,btr->bnst", lat.q_rope, lat.k_rope)
    ) * scale
    probs = jax.nn.softmax(jnp.where(keep[:, None], logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bnst,btnv->bsnv", probs, v)
    target = jax.lax.stop_gradient(probs.sum(1))
    target = target / target.sum(-1, keepdims=True)
    log_q = jax.nn.log_softmax(jnp.where(keep, idx_scores, -jnp.inf), axis=-1)
    kl = jnp.where(keep & (target > 0), target * (jnp.log(jnp.where(keep, target, 1.0)) - log_q), 0.0).sum()
    return out, kl, keep


def random_inputs(seed, b=2, s=19, n=3, dn=8, r=4, c=12, dv=6, h=16, d=8):  # 16 heads: no score ties at 0
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    lat = dsa.Latents(f(b, s, n, dn), f(b, s, n, r), f(b, s, c), f(b, s, r), f(c, n, dn) * 0.3, f(c, n, dv) * 0.3)
    index = dsa.Index(f(b, s, h, d), f(b, s, d), f(b, s, h))
    segments = np.ones((b, s), np.int32)
    segments[1, 7:] = 2  # row 1: two documents
    return lat, index, document_ids(jnp.asarray(segments))


@pytest.mark.parametrize("block, stripes", [(4, 4), (64, 4), (1, 8)])
def test_blocks_equal_the_dense_computation(block, stripes):
    """Selection, sparse attention and both stages' indexer losses, by blocks of queries (a block
    that does not divide S, one larger than S; selection in runs of blocks that see fewer keys
    than index_topk), equal their dense definitions, and so do the gradients: the attention's in
    the latents, the loss's in the indexer's projections."""
    lat, index, docs = random_inputs(0)
    topk, scale = 5, 0.4
    keys, valid = dsa.select(index, docs, topk, block=block, stripes=stripes)
    out, kl = dsa.sparse_attention(lat, keys, valid, scale, index, block=block)
    want_out, want_kl, keep = dense_reference(lat, index, docs, topk, scale, sparse=True)
    chosen = np.zeros(keep.shape, bool)
    np.put_along_axis(chosen, np.where(np.asarray(valid), np.asarray(keys), 0), True, -1)
    chosen &= np.asarray(allowed(jnp.arange(19), jnp.arange(19), docs, docs))
    np.testing.assert_array_equal(chosen, np.asarray(keep))  # no ties in these scores
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-5)
    np.testing.assert_allclose(float(kl), float(want_kl), rtol=1e-5)
    dense_kl = dsa.dense_index_loss(lat, index, docs, scale, block=block)
    np.testing.assert_allclose(
        float(dense_kl), float(dense_reference(lat, index, docs, topk, scale, False)[1]), rtol=1e-5
    )

    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.float32)

    def ours(lat, index):
        out, kl = dsa.sparse_attention(
            lat, *dsa.select(index, docs, topk, block=block, stripes=stripes), scale, index, block=block
        )
        return (out * cotangent).sum() + kl + dsa.dense_index_loss(lat, index, docs, scale, block=block)

    def dense(lat, index):
        out, kl, _ = dense_reference(lat, index, docs, topk, scale, sparse=True)
        return (out * cotangent).sum() + kl + dense_reference(lat, index, docs, topk, scale, False)[1]

    got, want = jax.grad(ours, argnums=(0, 1))(lat, index), jax.grad(dense, argnums=(0, 1))(lat, index)
    for a, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=2e-5, rtol=1e-4)


# ---- the model against transformers ------------------------------------------------------------------
V32 = dict(num_nextn_predict_layers=0, index_topk=5)  # MTP is absent from transformers' model


@pytest.fixture(scope="module")
def torch_v32():
    model = build_torch_model(tiny_config("v32", **V32), seed=0)
    model.config._attn_implementation = "eager"
    return model


def test_logits_equal_transformers_past_index_topk(torch_v32):
    """Float32, 23 tokens a row against 5 kept keys a query, one row of two packed documents
    (positions restart, keys never cross a document: transformers' packed-sequence mask)."""
    ours = from_torch(torch_v32)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 23)).astype(np.int32)
    segments = np.ones_like(tokens)
    segments[1, 11:] = 2
    positions = np.stack([np.arange(23), np.r_[np.arange(11), np.arange(12)]]).astype(np.int32)
    with torch.no_grad():
        want = torch_v32(torch.tensor(tokens).long(), position_ids=torch.tensor(positions).long(), use_cache=False)
    got = ours.apply(tokens, segment_ids=segments, positions=positions).logits
    np.testing.assert_allclose(np.asarray(got), want.logits.numpy(), atol=1e-4)


def torch_objective(model, tokens: np.ndarray, weight: float, dense: bool) -> torch.Tensor:
    """CE + weight x the indexers' loss, in PyTorch: transformers' model and modules, and the loss
    of DeepSeek-V3.2's report (section 2.1) written out: for each layer and query, KL(the main
    attention's probabilities summed over heads and normalized || softmax of the index scores),
    over the keys the query attends to (its chosen keys; every visible key when `dense`), the
    indexer's inputs detached; summed over layers, a mean over positions."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    inputs, targets = torch.tensor(tokens[:, :-1]).long(), torch.tensor(tokens[:, 1:]).long()
    b, s = inputs.shape
    layers = model.model.layers
    seen, hooks = {}, []
    for i, layer in enumerate(layers):
        layer.self_attn.indexer.index_topk = s if dense else model.config.index_topk  # dense: every key kept
        hooks.append(
            layer.self_attn.register_forward_pre_hook(
                lambda _m, _a, kw, i=i: seen.update({("x", i): kw["hidden_states"]}), with_kwargs=True
            )
        )
        hooks.append(
            layer.self_attn.indexer.register_forward_hook(
                lambda _m, _i, out, i=i: seen.update({("keys", i): out.long()})
            )
        )
    out = model(inputs, output_attentions=True, use_cache=False)
    for h in hooks:
        h.remove()
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(b * s, -1), targets.reshape(-1))
    positions = torch.arange(s)[None].expand(b, s)
    cos, sin = model.model.rotary_emb(seen[("x", 0)], positions)  # (the tables take the dtype of their first argument)
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    index_loss = 0.0
    for i, layer in enumerate(layers):
        attn, ix, cfg = layer.self_attn, layer.self_attn.indexer, model.config
        x = seen[("x", i)].detach()
        q = ix.wq_b(attn.q_a_layernorm(attn.q_a_proj(x)).detach()).view(b, s, ix.n_heads, ix.head_dim)
        k = ix.k_norm(ix.wk(x))[:, :, None]
        r = cfg.qk_rope_head_dim
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)[:, :, 0]
        dots = torch.relu(torch.einsum("bshd,btd->bsht", q, k) * ix.head_dim**-0.5)
        scores = torch.einsum("bsh,bsht->bst", ix.weights_proj(x) * ix.n_heads**-0.5, dots)
        keep = causal.expand(b, s, s).clone()
        if not dense:
            chosen = torch.zeros(b, s, s, dtype=torch.bool).scatter(-1, seen[("keys", i)], True)
            keep &= chosen
        target = out.attentions[i].detach().sum(1)
        target = target / target.sum(-1, keepdim=True)
        log_q = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), -1)
        terms = target * (torch.log(target.clamp_min(1e-30)) - log_q)
        index_loss = index_loss + terms.masked_fill(~keep | (target == 0), 0.0).sum()
    return ce + weight * index_loss / (b * s), ce


@pytest.mark.parametrize("stage", ["sparse", "warmup"])
def test_index_loss_and_gradients_equal_a_torch_reference(torch_v32, stage):
    """Float32, 1e-4: the loss, and the gradient of every weight: the model's from the LM loss, the
    indexers' from their KL alone (transformers' indexer takes no gradient; the reference's
    indexer scores are written from the report's formula on the same modules' weights)."""
    tokens = np.random.default_rng(3).integers(0, 256, (2, 18)).astype(np.int32)
    weight = 0.7
    model = torch_v32
    model.zero_grad()
    total, ce = torch_objective(model, tokens, weight, dense=stage == "warmup")
    total.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    grads.update({n: torch.zeros_like(b) for n, b in model.named_buffers() if "e_score_correction_bias" in n})
    want = from_torch(grads, config=tiny_config("v32", **V32)).params

    ours = from_torch(model)
    objective = jax.jit(moe_jax.objective, static_argnames=("config", "compute_dtype", "dsa_stage"))
    (loss, parts), got = jax.value_and_grad(objective, has_aux=True)(
        ours.params, ours.buffers, moe_jax.make_batch(tokens), ours.config, mtp_lambda=0.0, balance_alpha=0.0,
        compute_dtype="float32", dsa_stage=stage, index_loss_weight=weight,
    )  # fmt: skip
    np.testing.assert_allclose(float(loss), total.item(), rtol=1e-5)
    np.testing.assert_allclose(float(parts["ce_loss"]), ce.item(), rtol=1e-5)
    assert float(parts["index_loss"]) > 0
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = flat_want[path]
        scale = max(float(np.abs(w).max()), 1e-6)
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), atol=1e-4 * scale, rtol=1e-4, err_msg=jax.tree_util.keystr(path)
        )
    indexer = [
        np.abs(np.asarray(g)).max()
        for p, g in jax.tree_util.tree_leaves_with_path(got)
        if "indexer" in jax.tree_util.keystr(p)
    ]
    assert min(indexer) > 0  # every indexer weight learns from the loss


# ---- a tiny V3.2 checkpoint in DeepSeek's format, end to end ---------------------------------------
def tree_of(path) -> dict:
    """{'/'-joined parameter path: array} of a model's parameters."""
    model = moe_jax.from_pretrained(path)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(model.params)}


def train_run(run_dir, init, stage, *extra):
    cfg = load_config(
        "configs/tiny.yaml",
        [f"run_dir={run_dir}", f"model.init={init}", f"dsa.stage={stage}", "steps=20", "tensorboard=false"]
        + ["peak_tflops=1", "checkpoint.every=10", "data.seq_len=64", "data.batch_size=4", *extra],
    )
    return train(cfg, progress=False, log=lambda *a: None)


def losses(run_dir, key="loss") -> list[float]:
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_v32_checkpoint_converts_validates_trains_in_both_stages_and_exports(tmp_path):
    """DeepSeek's own format (FP8, MTP with its indexer, two shards): convert, validate with the
    defaults, 20 steps of each training stage on 64-token rows (past the 32 keys a query keeps),
    resume exactly, export, and transformers' DeepseekV32ForCausalLM on the export gives our logits."""
    src = make_tiny(tmp_path / "hf", "v32", fp8_weights=True, shards=2)
    assert any(".layers.3.self_attn.indexer." in n for n in all_tensors(src))  # the MTP layer's indexer
    code, _, err = run_main("convert", "--from", "hf", src, "--to", tmp_path / "jax")
    assert code == 0, err
    code, out, err = run_main("validate", "--hf", src, "--jax", tmp_path / "jax", "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and report["pass"], out[-2000:] + err[-2000:]
    assert all("index_mismatch" in row for row in report["layers"])
    code, _, err = run_main("export", "--from", tmp_path / "jax", "--to", tmp_path / "same")
    assert code == 0, err
    assert_bit_identical(all_tensors(src), all_tensors(tmp_path / "same"))  # FP8 bytes and scales as they came
    assert json.loads((tmp_path / "same" / "config.json").read_text()) == json.loads((src / "config.json").read_text())

    # warm-up: dense attention, only the indexers learn (their loss falls), every other weight stays
    warm = train_run(tmp_path / "warm", tmp_path / "jax", "warmup")
    index_loss = losses(tmp_path / "warm", "index_loss")
    assert np.mean(index_loss[-5:]) < 0.8 * np.mean(index_loss[:5]), index_loss
    before, after = tree_of(tmp_path / "jax"), tree_of(warm["model"])
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert moved and all("indexer" in k for k in moved), sorted(moved)
    # sparse: every weight learns, the loss falls; stopped at step 10 and resumed, bit for bit
    sparse = train_run(tmp_path / "sparse", warm["model"], "sparse")
    whole = losses(tmp_path / "sparse")
    assert np.mean(whole[-5:]) < np.mean(whole[:5]) - 0.3, whole
    assert all(
        k in json.loads((tmp_path / "sparse" / "metrics.jsonl").read_text().splitlines()[0])
        for k in ("index_loss", "ce_loss")
    )
    shutil.copytree(tmp_path / "sparse", tmp_path / "resumed", ignore=shutil.ignore_patterns("20", "model"))
    metrics = tmp_path / "resumed" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:10]))  # as at step 10
    cfg = load_config(
        "configs/tiny.yaml",
        [f"run_dir={tmp_path / 'resumed'}", f"model.init={warm['model']}", "dsa.stage=sparse", "steps=20"]
        + ["tensorboard=false", "peak_tflops=1", "checkpoint.every=10", "data.seq_len=64", "data.batch_size=4"],
    )
    train(cfg, resume=True, progress=False, log=lambda *a: None)
    assert losses(tmp_path / "resumed") == whole

    # the trained model back in DeepSeek's format, and in transformers
    code, _, err = run_main("export", "--from", sparse["model"], "--to", tmp_path / "out", "--dtype", "bfloat16")
    assert code == 0, err
    tokens = np.random.default_rng(5).integers(0, 256, (2, 40)).astype(np.int32)  # past index_topk
    report = compare(
        moe_jax.from_pretrained(tmp_path / "out", dtype="float32"), load_reference(tmp_path / "out"), tokens
    )
    assert report["pass"] and report["max_abs"] < 1e-4, report


# ---- the model FLOPs that MFU is reported against ----------------------------------------------------
@pytest.mark.parametrize("seq_len", [1024, 2048, 32768, 131072])
def test_model_flops_count_the_keys_each_query_attends_and_the_indexers(seq_len):
    """flops_per_token for DeepSeek-V3.2 against V3's count of the same widths, corrected position
    by position: each query's attention scores over min(t, index_topk) keys in the sparse stage
    (t in the warm-up, as V3), and the indexers' matrices (their tensors' sizes) and their scores
    against every earlier key, trained in both stages; in the warm-up the rest runs forward only."""
    v32 = ModelConfig.from_hf_dict(DEEPSEEK_V32)
    v3 = dataclasses.replace(v32, index_topk=None, index_n_heads=None, index_head_dim=None)
    t = np.arange(1, seq_len + 1, dtype=np.float64)
    layers = v32.num_hidden_layers + v32.num_nextn_predict_layers
    per_key = 2 * v32.num_attention_heads * (v32.qk_nope_head_dim + v32.qk_rope_head_dim + v32.v_head_dim)
    matrices = sum(np.prod(r.shape(v32)) for r in ATTN_INDEXER if len(r.shape(v32)) == 2)
    indexers = 3 * layers * (2 * matrices + 2 * v32.index_n_heads * v32.index_head_dim * t.mean())
    dense = flops_per_token(v3, seq_len, True)
    sparse = dense + 3 * layers * per_key * (np.minimum(t, v32.index_topk).mean() - t.mean()) + indexers
    np.testing.assert_allclose(flops_per_token(v32, seq_len, True), sparse, rtol=1e-4)
    np.testing.assert_allclose(flops_per_token(v32, seq_len, True, "warmup"), dense / 3 + indexers, rtol=1e-4)
    if seq_len <= v32.index_topk:  # dense attention: the sparse stage costs V3 plus the indexers
        np.testing.assert_allclose(flops_per_token(v32, seq_len, True), dense + indexers, rtol=1e-3)


# ---- hostile V3.2 inputs: one line each, exit status 2, nothing written ------------------------------
def edit_config(**changes):
    def damage(src):
        path = src / "config.json"
        config = {**json.loads(path.read_text()), **changes}
        path.write_text(json.dumps({k: v for k, v in config.items() if v is not DROP}))

    return damage


DROP = object()


def drop_tensor(name):
    def damage(src):
        from safetensors.numpy import load_file, save_file

        index = json.loads((src / "model.safetensors.index.json").read_text())
        shard = src / index["weight_map"].pop(name)
        tensors = load_file(shard)
        del tensors[name]
        save_file(tensors, shard)
        (src / "model.safetensors.index.json").write_text(json.dumps(index))

    return damage


HOSTILE = [
    ("indexer tensor missing", drop_tensor("model.layers.1.self_attn.indexer.wk.weight"),
     "model.layers.1.self_attn.indexer.wk.weight is missing"),
    ("index_topk 0", edit_config(index_topk=0), "index_topk=0 must be at least 1"),
    ("index_topk negative", edit_config(index_topk=-2048), "index_topk=-2048 must be at least 1"),
    ("index_topk a string", edit_config(index_topk="2048"), "index_topk='2048' must be an integer"),
    ("index_topk a float", edit_config(index_topk=20.5), "index_topk=20.5 must be an integer"),
    ("index_topk true", edit_config(index_topk=True), "index_topk=True must be an integer"),
    ("index_topk absurd", edit_config(index_topk=2**40), "index_topk=1099511627776 is too large"),
    ("index_head_dim under the rope dims", edit_config(index_head_dim=4), "index_head_dim=4 is smaller than qk_rope_head_dim=8"),
    ("no q latent", edit_config(q_lora_rank=None), "deepseek_v32 needs q_lora_rank"),
    ("a V3 checkpoint labelled V3.2", None, "config.json says DeepSeek-V3.2 (sparse attention) but the checkpoint has no indexer"),
]  # fmt: skip


@pytest.fixture(scope="module")
def v32_and_v3(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return make_tiny(root / "v32", "v32", fp8_weights=True, shards=2), make_tiny(root / "v3", "base", fp8_weights=True)


@pytest.mark.parametrize("damage, words", [pytest.param(d, w, id=n) for n, d, w in HOSTILE])
def test_hostile_v32_input_is_one_line_exit_2(v32_and_v3, tmp_path, damage, words):
    v32, v3 = v32_and_v3
    src = tmp_path / "src"
    if damage is None:  # DeepSeek-V3's tensors under V3.2's config
        shutil.copytree(v3, src)
        edit_config(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], index_topk=8)(src)
    else:
        shutil.copytree(v32, src)
        damage(src)
    for command in (["verify", src], ["convert", "--from", "hf", src, "--to", tmp_path / "out"]):
        code, out, err = run_main(*command)
        lines = error_lines(err)
        assert code == 2 and len(lines) == 1 and words in lines[0] and str(src) in lines[0], (command[0], err)
    assert not (tmp_path / "out").exists()
