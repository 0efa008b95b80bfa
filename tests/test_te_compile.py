"""The `te` grouped-GEMM backend (Transformer Engine), compiled for H100 and B200 by XLA's GPU
compiler on this CPU machine (deviceless; moe_jax.kernels.te loads TE through the compile-only
driver stand-in that scripts/setup_te.sh builds). Nothing runs: the compiled programs show that
every expert GEMM is TE's grouped GEMM (forward, input and weight gradient), in BF16 and, on
Blackwell, in MXFP8 with TE's grouped quantize kernels and FP8 operands. One target per process
(TE keeps the compute capability it first sees)."""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from moe_jax.kernels import te


def te_installed() -> bool:
    try:
        importlib.metadata.version("transformer_engine_jax")
    except importlib.metadata.PackageNotFoundError:
        return False
    return te.has_driver() or te.STUB.exists()


pytestmark = pytest.mark.skipif(
    not te_installed(),
    reason="Transformer Engine for deviceless compilation is not installed (scripts/setup_te.sh)",
)

SCRIPT = r"""
import json, re, sys
import jax, jax.numpy as jnp
from moe_jax import gpu
from moe_jax.config import ModelConfig
from moe_jax.kernels.grouped_gemm import grouped_ffn
from moe_jax.moe import moe_layer

target, backends = sys.argv[1], sys.argv[2].split(",")
topo = gpu.topology(target)
bf16 = jnp.bfloat16

def compiled(f, *args):
    with gpu.compiling_for(topo.devices):
        c = jax.jit(f).lower(*args).compile()
    out = gpu.describe(c)
    out["fp8_dtypes"] = sorted(set(re.findall(r"\b(f8e\w+)\[", c.as_text())))
    return out

M, K, N, G = 4096, 1024, 512, 8
a = lambda shape, dtype=bf16: gpu.abstract(topo, shape, dtype)
ffn_args = (a((M, K)), a((G, K, N)), a((G, K, N)), a((G, N, K)), a((G,), jnp.int32))
cfg = ModelConfig.from_hf_dict(dict(
    model_type="deepseek_v3", vocab_size=512, hidden_size=K, intermediate_size=2048, moe_intermediate_size=N,
    num_hidden_layers=1, first_k_dense_replace=0, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=64,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=G, num_experts_per_tok=2,
    n_group=1, topk_group=1, n_shared_experts=0, num_nextn_predict_layers=0))
layer = {"router": a((K, G), jnp.float32), "experts": {"gate": a((G, K, N)), "up": a((G, K, N)), "down": a((G, N, K))}}
out = {}
for backend in backends:
    ffn = gpu.forward_backward(lambda x, g, u, d, s, b=backend: grouped_ffn(x, g, u, d, s, b), (0, 1, 2, 3))
    moe = gpu.forward_backward(lambda p, bias, x, b=backend: moe_layer(p, bias, x, cfg, bf16, b)[0], (0, 2))
    out[backend] = {"ffn": compiled(ffn, *ffn_args), "moe": compiled(moe, layer, a((G,), jnp.float32), a((M // 2, K)))}
try:
    compiled(lambda x, w, s: grouped_ffn(x, w, w, jnp.swapaxes(w, 1, 2), s, "te+mxfp8"), a((M, K)), a((G, K, K)),
             a((G,), jnp.int32))
    out["mxfp8_error"] = None
except ValueError as e:
    out["mxfp8_error"] = str(e)
print("REPORT " + json.dumps(out))
"""

M, K, N, G = 4096, 1024, 512, 8
FFN_FLOPS = 3 * 3 * 2 * M * K * N  # three GEMMs, each forward, input and weight gradient
TARGETS = {"h100": ["te"], "b200": ["te", "te+mxfp8"]}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def report(request):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [request.param, ",".join(TARGETS[request.param])]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    return request.param, json.loads(line[len("REPORT ") :])


def te_calls(stats, kind: str) -> int:
    return stats["custom_calls"].get(f"te_grouped_{kind}_v2_ffi", 0)


def test_every_expert_gemm_is_te_grouped_gemm(report):
    target, out = report
    for backend in TARGETS[target]:
        for what in ("ffn", "moe"):
            stats = out[backend][what]
            # gate, up and down: each forward, input gradient and weight gradient
            assert te_calls(stats, "gemm") == 9, (backend, what, stats["custom_calls"])
        # XLA computes no expert GEMM: its dots are under 1% of the experts' FLOPs
        assert out[backend]["ffn"]["flops"] < 0.01 * FFN_FLOPS, out[backend]["ffn"]
        # the MoE layer: only the router's [T, H] x [H, E] dot and its gradients are XLA's
        assert out[backend]["moe"]["flops"] < 0.05 * FFN_FLOPS / 4, out[backend]["moe"]
    assert out["te"]["ffn"]["fp8_dtypes"] == [] and te_calls(out["te"]["ffn"], "quantize") == 0


def test_mxfp8_is_te_quantized_on_blackwell_only(report):
    target, out = report
    if target == "h100":
        assert "Blackwell" in out["mxfp8_error"], out["mxfp8_error"]
        return
    assert out["mxfp8_error"] is None
    for what in ("ffn", "moe"):
        stats = out["te+mxfp8"][what]
        assert te_calls(stats, "quantize") >= 3, stats["custom_calls"]
        # e4m3 forward operands, e5m2 gradients, e8m0 block scales
        assert {"f8e4m3fn", "f8e5m2", "f8e8m0fnu"} <= set(stats["fp8_dtypes"]), stats["fp8_dtypes"]


def test_without_a_gpu_te_only_compiles():
    """Outside compilation for a deviceless target, the `te` backend says it only compiles here."""
    code = (
        "import jax.numpy as jnp\n"
        "from moe_jax.kernels.grouped_gemm import grouped_matmul\n"
        "try:\n"
        "    grouped_matmul(jnp.ones((256, 128), jnp.bfloat16), jnp.ones((2, 128, 128), jnp.bfloat16),"
        " jnp.array([100, 156]), 'te')\n"
        "except RuntimeError as e:\n"
        "    print('REFUSED', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if te.has_driver():
        pytest.skip("this machine has an NVIDIA driver: TE runs here")
    assert "REFUSED" in proc.stdout and "only compiles" in proc.stdout, proc.stdout + proc.stderr[-3000:]
