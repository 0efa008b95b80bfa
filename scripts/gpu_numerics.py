"""On a real NVIDIA GPU (scripts/gpu_check.sh): what the deviceless compile checks cannot show.

- The Mosaic GPU grouped GEMMs (backend "mgpu": forward, input and weight gradients) against a
  float32 per-group loop, at DeepSeek-V3's expert widths with skewed and empty groups.
- cuDNN's fused attention at MLA's head dims (q/k 192, v 128) with packed documents: whether
  cuDNN accepts the config, and forward and gradients against the blockwise attention.
Writes JSON (--out); exits nonzero if a comparison fails.

    python3 scripts/gpu_numerics.py --out runs/gpu/numerics.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax.config import DEEPSEEK_V3
from moe_jax.kernels import mgpu
from moe_jax.kernels.attention import attention
from moe_jax.kernels.grouped_gemm import grouped_matmul
from moe_jax.measure import benchmark_parser


def relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def grouped_gemm_check(rng) -> dict:
    k, n, g = DEEPSEEK_V3["hidden_size"], DEEPSEEK_V3["moe_intermediate_size"], 32
    sizes = rng.multinomial(4000, rng.dirichlet(np.full(g, 0.3)))  # skewed; some groups may be empty
    sizes[3] = 0
    m = 4096  # rows past the groups: zeros
    x = jnp.asarray(rng.standard_normal((m, k)) / 8, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)) / 8, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    y, pullback = jax.vjp(lambda x, w: grouped_matmul(x, w, gs, "mgpu"), x, w)
    dx, dw = pullback(dy)
    xf, wf, dyf = (np.asarray(a, np.float32) for a in (x, w, dy))
    want_y, want_dx, want_dw = np.zeros((m, n), np.float32), np.zeros((m, k), np.float32), np.zeros_like(wf)
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        want_y[rows] = xf[rows] @ wf[e]
        want_dx[rows] = dyf[rows] @ wf[e].T
        want_dw[e] = xf[rows].T @ dyf[rows]
        start += size
    errors = {"y": relative(y, want_y), "dx": relative(dx, want_dx), "dw": relative(dw, want_dw)}
    return {"architecture": mgpu.architecture(), "kernels_used": mgpu.supports(x, w), "relative_error": errors}


def attention_check(rng) -> dict:
    b, s, heads = 2, 4096, 16
    dqk = DEEPSEEK_V3["qk_nope_head_dim"] + DEEPSEEK_V3["qk_rope_head_dim"]
    dv = DEEPSEEK_V3["v_head_dim"]
    ids = np.zeros((b, s), np.int32)
    ids[0] = np.repeat(np.arange(5), [1000, 24, 2000, 1000, 72])  # packed documents, one row
    q, k = (jnp.asarray(rng.standard_normal((b, s, heads, dqk)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, s, heads, dv)), jnp.bfloat16)
    d_out = jnp.asarray(rng.standard_normal((b, s, heads, dv)), jnp.bfloat16)
    results = {}
    for impl in ("cudnn", "blockwise"):
        out, pullback = jax.vjp(
            lambda q, k, v, impl=impl: attention(q, k, v, jnp.asarray(ids), dqk**-0.5, impl), q, k, v
        )
        results[impl] = (out, *pullback(d_out))
    hlo = jax.jit(lambda q, k, v: attention(q, k, v, jnp.asarray(ids), dqk**-0.5, "cudnn")).lower(q, k, v).as_text()
    names = ("out", "dq", "dk", "dv")
    errors = {n: relative(a, b) for n, a, b in zip(names, results["cudnn"], results["blockwise"])}
    return {"cudnn_in_program": "cudnn" in hlo, "relative_error_vs_blockwise": errors}


def main() -> None:
    args = benchmark_parser(__doc__, "gpu/numerics").parse_args()
    rng = np.random.default_rng(0)
    report, failed = {"devices": [str(d) for d in jax.devices()]}, []
    for name, check, limit in (("grouped_gemm", grouped_gemm_check, 2e-2), ("attention", attention_check, 3e-2)):
        try:
            report[name] = check(rng)
            errors = next(v for k, v in report[name].items() if k.startswith("relative_error"))
            if max(errors.values()) > limit:
                failed.append(f"{name}: {errors}")
        except Exception as e:  # a kernel cuDNN or Mosaic refuses on this GPU: record it, go on
            report[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            failed.append(name)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    if failed:
        sys.exit(f"failed: {failed}")


if __name__ == "__main__":
    main()
