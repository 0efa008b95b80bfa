#!/usr/bin/env bash
# One run on a borrowed GPU (the device tool: one H200, jax 0.11+, no Transformer Engine unless
# installed), at most 10 minutes: first what the deviceless compile checks cannot show (the Mosaic
# GPU grouped GEMMs' and cuDNN attention's numerics, cuDNN's acceptance of MLA's head dims), then
# GPU-relevant tests, bf16 dense peak, the MoE benchmark at GPU size (Mosaic GPU against
# ragged_dot), the TE grouped GEMM where TE exists, full-width training TFLOP/s. Everything lands as JSON in ${OUT:-runs/gpu}. Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
# the package, installed editable (no build isolation: the device machine has no network); the
# PYTHONPATH entry is the fallback where pip cannot install it (scripts import it, never a path)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
# DeepSeek-V3's widths, from the one copy of its config.json (moe_jax.config.DEEPSEEK_V3)
read -r HIDDEN WIDTH < <(python3 -c 'from moe_jax.config import DEEPSEEK_V3 as c; print(c["hidden_size"], c["moe_intermediate_size"])')
python3 - <<'PY' > "$OUT/gpu_env.json"
import json, jax
print(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}))
PY
# numerics first: the kernels no CPU can run (scripts/gpu_numerics.py)
python3 scripts/gpu_numerics.py --out "$OUT/numerics.json" 2>&1 | tail -30
# bf16 dense peak: the ceiling every grouped-GEMM figure is read against
python3 - <<'PY' > "$OUT/dense_peak.json"
import json, time, jax, jax.numpy as jnp
n = 8192
a = jnp.ones((n, n), jnp.bfloat16); b = jnp.ones((n, n), jnp.bfloat16)
f = jax.jit(lambda a, b: a @ b); f(a, b).block_until_ready()
t = time.perf_counter(); [f(a, b).block_until_ready() for _ in range(20)]; dt = (time.perf_counter() - t) / 20
print(json.dumps({"n": n, "tflops": 2 * n**3 / dt / 1e12}))
PY
# backend correctness on the GPU (naive-loop tests, MXFP8 bit-exactness, dispatch/combine)
python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_grouped_gemm.py tests/test_attention.py 2>&1 | tail -5 > "$OUT/tests.txt"
# DeepSeek-V3.2's sparse attention on the GPU: selection by runs of query blocks, sparse MLA and the
# indexer's losses and gradients against their dense definitions (a separate line: its module imports torch)
python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_dsa.py -k "blocks_equal" 2>&1 | tail -5 > "$OUT/tests_dsa.txt"
# the MoE benchmark at GPU scale (DeepSeek-V3's hidden and expert widths, 32 experts), bf16,
# every backend that runs there
python3 scripts/bench_moe.py --tokens 65536 --hidden "$HIDDEN" --width "$WIDTH" --experts 32 --dtype bfloat16 \
  --backends mgpu,ragged_dot,tiled,capacity --repeats 10 --no-references --out "$OUT/bench_moe.json"
# attention at MLA's full widths (128 heads, q/k 192, v 128, bf16): cuDNN against the blockwise form
python3 scripts/bench_attention.py --impls cudnn,blockwise --dtype bfloat16 --heads 128 --dqk 192 --dv 128 \
  --seq 4096,16384 --max-gib 100 --repeats 3 --out "$OUT/bench_attention.json" 2>&1 | tail -6
python3 - <<'PY' > "$OUT/te.json"
import json
try:
    import transformer_engine.jax  # noqa: F401
    import jax, jax.numpy as jnp, numpy as np
    from moe_jax.kernels.grouped_gemm import grouped_ffn, grouped_matmul
    x = jnp.ones((4096, 1024), jnp.bfloat16); w = jnp.ones((8, 1024, 512), jnp.bfloat16)
    s = jnp.array([512] * 8, jnp.int32)
    d = np.abs(np.asarray(grouped_matmul(x, w, s, "te"), np.float32) - np.asarray(grouped_matmul(x, w, s, "ragged_dot"), np.float32)).max()
    # the FFN as the TE backend runs it (rows padded once for all three GEMMs), uneven groups
    k = jax.random.split(jax.random.key(0), 4)
    xf = jax.random.normal(k[0], (4096, 1024), jnp.bfloat16)
    gate, up = (0.03 * jax.random.normal(k[i], (8, 1024, 512), jnp.bfloat16) for i in (1, 2))
    down = 0.03 * jax.random.normal(k[3], (8, 512, 1024), jnp.bfloat16)
    sf = jnp.array([700, 0, 13, 1000, 383, 2000, 0, 0], jnp.int32)
    ffn = lambda b: np.asarray(grouped_ffn(xf, gate, up, down, sf, b), np.float32)
    d_ffn = np.abs(ffn("te") - ffn("ragged_dot")).max()
    print(json.dumps({"te": True, "max_abs_vs_ragged_dot": float(d), "ffn_max_abs_vs_ragged_dot": float(d_ffn)}))
except ImportError as e:
    print(json.dumps({"te": False, "why": str(e)}))
PY
# the ragged_all_to_all transport (GPU default, does not compile on XLA:CPU): on one GPU only
# EP=1 runs, which still compiles and runs the collective and the packing around it
python3 - <<'PY' > "$OUT/ep_ragged.json"
import json, numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
from moe_jax.config import ModelConfig
from moe_jax.moe import moe_layer
from moe_jax.parallel.ep import ExpertParallel, ep_moe
cfg = ModelConfig.from_hf_dict(dict(model_type="deepseek_v3", vocab_size=16, hidden_size=64, intermediate_size=64,
    moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=1, kv_lora_rank=4, qk_nope_head_dim=4,
    qk_rope_head_dim=2, v_head_dim=4, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
    first_k_dense_replace=0, n_shared_experts=0))
r = np.random.default_rng(0)
p = {"router": jnp.asarray(r.standard_normal((64, 16)), jnp.float32), "experts": {k: jnp.asarray(r.standard_normal(s) * 0.1,
     jnp.float32) for k, s in (("gate", (16, 64, 32)), ("up", (16, 64, 32)), ("down", (16, 32, 64)))}}
x, bias = jnp.asarray(r.standard_normal((256, 64)), jnp.float32), jnp.zeros(16)
mesh = Mesh(np.array(jax.devices()[:1]), ("expert",))
out = {}
for t in ("ragged", "all_to_all", "ragged_emulated"):
    try:
        got = jax.jit(lambda p, x: ep_moe(p, bias, x, cfg, mesh, options=ExpertParallel(transport=t))[0])(p, x)
        want = moe_layer(p, bias, x, cfg, jnp.float32, None)[0]
        out[t] = float(jnp.abs(got - want).max())
    except Exception as e:
        out[t] = f"{type(e).__name__}: {e}"[:300]
# FP8 dispatch and FP8 gradients (the HGX 671B configs' exchange): the real collective's gradients
# against the emulated one's, both rounding the same way
c = jnp.asarray(r.standard_normal((256, 64)), jnp.float32)
def fp8_grads(t):
    ep = ExpertParallel(transport=t, dispatch="float8", gradient_dispatch="float8")
    return jax.jit(lambda p, x: jax.vjp(lambda p, x: ep_moe(p, bias, x, cfg, mesh, options=ep)[0], p, x)[1](c))(p, x)
try:
    g, want = fp8_grads("ragged"), fp8_grads("ragged_emulated")
    out["ragged_fp8_grads_vs_emulated"] = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want)))
except Exception as e:
    out["ragged_fp8_grads_vs_emulated"] = f"{type(e).__name__}: {e}"[:300]
print(json.dumps(out))
PY
# gradient accumulation on the GPU: 4 micro-batches against the one big batch (tiny model, float32,
# packed rows), without and with remat "full" (whose layer loops add each layer's weight gradients
# into the sums as they compute them) and "save_dispatch" (the same loops, each layer's pullback taken
# in the forward and rebuilt in the backward), and the accumulated steps' speed at bf16 against the plain step
python3 - <<'PY' > "$OUT/accumulated.json"
import json, tempfile, time, numpy as np, jax, jax.numpy as jnp, optax, moe_jax
from converters.tiny import make_tiny
from moe_jax.train.step import init_train_state, make_batch, make_train_step
model = moe_jax.from_pretrained(make_tiny(tempfile.mkdtemp() + "/tiny", variant="base"))
r = np.random.default_rng(0)
batch = make_batch(r.integers(0, 256, (16, 257)), np.sort(r.integers(1, 4, (16, 257)), axis=1))
out = {}
for dtype in ("float32", "bfloat16"):
    for n, remat in ((1, "none"), (4, "none"), (4, "full"), (4, "save_dispatch")):
        state = init_train_state(jax.tree.map(jnp.copy, {"params": model.params, "buffers": model.buffers}), optax.sgd(1.0))
        step = make_train_step(model.config, optax.sgd(1.0), compute_dtype=dtype, grad_accum=n, remat=remat)
        new, m = step(state, batch)
        params = [np.asarray(a, np.float32) for a in jax.tree.leaves(new["params"])]  # before the next step donates it
        t = time.perf_counter(); jax.block_until_ready(step(new, batch)); dt = time.perf_counter() - t
        out[f"{dtype}_{n}_{remat}"] = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), "step_s": dt, "params": params}
a, b, c = out["float32_1_none"], out["float32_4_none"], out["float32_4_full"]
summary = {"loss": [a["loss"], b["loss"], c["loss"]], "grad_norm": [a["grad_norm"], b["grad_norm"], c["grad_norm"]],
           "max_param_diff": max(float(np.abs(x - y).max()) for x, y in zip(a["params"], b["params"])),
           "max_param_diff_fused": max(float(np.abs(x - y).max()) for x, y in zip(a["params"], c["params"])),
           "max_param_diff_save_dispatch_vs_full": max(
               float(np.abs(x - y).max()) for x, y in zip(c["params"], out["float32_4_save_dispatch"]["params"])),
           "step_s": {k: v["step_s"] for k, v in out.items()}}
print(json.dumps(summary))
PY
# training throughput: a reduced-depth, full-width DeepSeek-V3 (1 dense + 1 MoE layer, all 256
# experts, full vocabulary: bench_train's defaults, from DEEPSEEK_V3), bf16 forward+backward:
# model TFLOP/s per GPU and MFU
python3 scripts/bench_train.py --models full-width --moe-layers 1 --full-seq 4096 --full-batch 2 --steps 5 \
  --json "$OUT/bench_train.json" 2>&1 | tail -4
# moe-jax plan against the memory the same compiled training step uses on this GPU (bf16 compute,
# 16 x 1024 tokens, configs/plan_check.json: it fits one H200)
python3 scripts/bench_plan.py --config configs/tiny.yaml model.init=configs/plan_check.json \
  model.compute_dtype=bfloat16 data.batch_size=16 data.seq_len=1024 --out "$OUT/plan_vs_measured.json" 2>&1 | tail -5
ls -la "$OUT"
