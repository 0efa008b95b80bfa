#!/usr/bin/env bash
# One run on a borrowed GPU (the device tool: one H200, jax 0.11+, no Transformer Engine unless
# installed): GPU-relevant tests, bf16 dense peak, the MoE benchmark at GPU size, the TE grouped
# GEMM where TE exists. Everything lands as JSON in ${OUT:-runs/gpu}. Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps -e . >/dev/null 2>&1 || true
python3 - <<'PY' > "$OUT/gpu_env.json"
import json, jax
print(json.dumps({"jax": jax.__version__, "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}))
PY
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
python3 -m pytest -q tests/test_grouped_gemm.py 2>&1 | tail -3 > "$OUT/tests.txt"
# the MoE benchmark at GPU scale, bf16, every backend that runs there
python3 scripts/bench_moe.py --tokens 65536 --hidden 7168 --width 2048 --experts 32 --dtype bfloat16 \
  --backends ragged_dot,tiled128,tiled256,capacity --repeats 10 --out "$OUT/bench_moe.json"
python3 - <<'PY' > "$OUT/te.json"
import json
try:
    import transformer_engine.jax  # noqa: F401
    import jax, jax.numpy as jnp, numpy as np
    from moe_jax.kernels.grouped_gemm import grouped_matmul
    x = jnp.ones((4096, 1024), jnp.bfloat16); w = jnp.ones((8, 1024, 512), jnp.bfloat16)
    s = jnp.array([512] * 8, jnp.int32)
    d = np.abs(np.asarray(grouped_matmul(x, w, s, "te"), np.float32) - np.asarray(grouped_matmul(x, w, s, "ragged_dot"), np.float32)).max()
    print(json.dumps({"te": True, "max_abs_vs_ragged_dot": float(d)}))
except ImportError as e:
    print(json.dumps({"te": False, "why": str(e)}))
PY
ls -la "$OUT"
