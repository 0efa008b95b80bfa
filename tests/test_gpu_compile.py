"""The GPU compute path, compiled for H100 and B200 by XLA's GPU compiler on this CPU machine
(deviceless; moe_jax.gpu). Nothing runs: the compiled programs show which kernels run, the
FLOPs XLA would spend, and the temporaries. Each target compiles in its own process (Mosaic GPU
keeps the first architecture it compiles for in a process). What only a GPU can show (numerics,
cuDNN's acceptance of a config, speed) is in scripts/gpu_check.sh."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

from moe_jax import gpu
from moe_jax.kernels import mgpu

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from moe_jax import gpu
from moe_jax.config import ModelConfig
from moe_jax.kernels.attention import attention
from moe_jax.kernels.grouped_gemm import grouped_ffn
from moe_jax.model import forward
from moe_jax.params import init_tree

topo = gpu.topology(sys.argv[1])
replicated = NamedSharding(gpu.deviceless_mesh(topo, {"x": 1}), P())
bf16 = jnp.bfloat16

def spec(shape, dtype=bf16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)

def compiled(f, *args):
    with gpu.compiling_for(topo.devices):
        return gpu.describe(jax.jit(f).lower(*args).compile())

out = {}
M, K, N, G = 1024, 256, 256, 8
ffn_args = (spec((M, K)), spec((G, K, N)), spec((G, K, N)), spec((G, N, K)), spec((G,), jnp.int32))
out["ffn"] = {
    b: compiled(gpu.forward_backward(lambda x, g, u, d, s, b=b: grouped_ffn(x, g, u, d, s, b), (0, 1, 2, 3)), *ffn_args)
    for b in ("ragged_dot", "mgpu")
}

H, DQK, DV = 4, 192, 128  # MLA's head dims
def attention_grads(impl):
    return gpu.forward_backward(lambda q, k, v, ids: attention(q, k, v, ids, 0.07, impl=impl), (0, 1, 2))
out["attention"] = {
    impl: {S: compiled(attention_grads(impl), spec((1, S, H, DQK)), spec((1, S, H, DQK)), spec((1, S, H, DV)),
                       spec((1, S), jnp.int32))
           for S in (1024, 4096)}
    for impl in ("naive", "blockwise", "cudnn")
}

cfg = ModelConfig.from_hf_dict(dict(
    model_type="deepseek_v3", vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
    num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=64,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2,
    n_group=1, topk_group=1, n_shared_experts=1, num_nextn_predict_layers=0))
tree = jax.eval_shape(lambda: jax.tree.map(jnp.asarray, init_tree(cfg, dtype="bfloat16", mtp=False)))
tree = jax.tree.map(lambda a: spec(a.shape, a.dtype), tree)
def model_loss(params, buffers, tokens):  # default grouped GEMM and attention for the target
    return forward(params, buffers, tokens, cfg, dtype=bf16).logits.astype(jnp.float32).mean()
out["model"] = compiled(jax.grad(model_loss), tree["params"], tree["buffers"], spec((2, 512), jnp.int32))
print("REPORT " + json.dumps(out))
"""

M, K, N, G = 1024, 256, 256, 8
IDEAL_FFN_FLOPS = 3 * 3 * 2 * M * K * N  # three GEMMs, each forward, input and weight gradient


@pytest.fixture(scope="module", params=["h100", "b200"])
def report(request):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, request.param], capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    return request.param, json.loads(line[len("REPORT ") :])


def mosaic_calls(stats) -> int:
    return sum(n for target, n in stats["custom_calls"].items() if target.startswith("mosaic_gpu"))


def test_grouped_gemm_wastes_nothing(report):
    target, out = report
    dense, mgpu = out["ffn"]["ragged_dot"], out["ffn"]["mgpu"]
    # XLA's ragged_dot: a masked dense dot over every group, and an [M, G, K]-sized temporary
    assert dense["flops"] > 0.8 * G * IDEAL_FFN_FLOPS and dense["largest_elements"] >= M * G * K
    assert mosaic_calls(dense) == 0
    # the Mosaic GPU kernels: every GEMM a kernel (Hopper: forward, input and weight gradient of
    # gate, up and down; Blackwell: forward and input gradient, the weight gradient by windows)
    assert mosaic_calls(mgpu) >= (9 if target == "h100" else 6), mgpu["custom_calls"]
    assert mgpu["largest_elements"] <= G * K * N, mgpu["largest_array"]  # nothing larger than the weights
    # XLA's own dots: none on Hopper; Blackwell's weight-gradient windows (each window size's loop
    # body counted once), far from ragged_dot's G times the ideal
    assert mgpu["flops"] < (0.01 if target == "h100" else 1.0) * IDEAL_FFN_FLOPS
    activations = 2 * (M * K + 3 * M * N)  # bf16 x and the three [M, N] intermediates
    weights = 2 * 3 * G * K * N
    # Hopper: activations alone; Blackwell adds w^T copies (input gradient) and float32 weight-gradient sums
    bound = 4 * activations + (0 if target == "h100" else 4 * weights)
    assert mgpu["temp_bytes"] < bound, (mgpu["temp_bytes"], bound)


def test_attention_memory_is_linear_in_sequence_length(report):
    _, out = report
    growth = {
        impl: by_s["4096"]["temp_bytes"] / max(by_s["1024"]["temp_bytes"], 1) for impl, by_s in out["attention"].items()
    }
    assert growth["naive"] > 12, growth  # S x S scores: 16x for 4x the length
    assert growth["blockwise"] < 5 and growth["cudnn"] < 5, growth
    s = 4096
    assert out["attention"]["blockwise"][str(s)]["largest_elements"] < s * s, out["attention"]["blockwise"][str(s)]
    cudnn = out["attention"]["cudnn"][str(s)]["custom_calls"]
    assert any(t.startswith("__cudnn$fmha") and "Backward" in t for t in cudnn), cudnn
    assert any(t.startswith("__cudnn$fmha") and "Backward" not in t for t in cudnn), cudnn


def test_model_compiles_to_the_gpu_kernels_by_default(report):
    """The model's forward and backward for a GPU target: the grouped GEMMs are Mosaic GPU
    kernels and attention is cuDNN's, with no flag set."""
    _, out = report
    calls = out["model"]["custom_calls"]
    assert mosaic_calls(out["model"]) > 0, calls
    assert any(t.startswith("__cudnn$fmha") for t in calls), calls


def test_targets_and_topologies():
    """Every target builds a deviceless cluster of the asked size, of its kind; bad requests are
    one clear error."""
    for name, target in gpu.TARGETS.items():
        topo = gpu.topology(name, hosts=2, gpus_per_host=4)
        assert len(topo.devices) == 8 and {d.device_kind for d in topo.devices} == {target.description}
        assert gpu.capability(topo.devices) == target.capability
    mesh = gpu.deviceless_mesh(gpu.topology("h100", 2, 8), {"data": 2, "expert": 8})
    assert dict(mesh.shape) == {"data": 2, "expert": 8}
    with pytest.raises(ValueError, match="unknown GPU target 'a100'; known: h100, h200, b200, gb200, b300, gb300"):
        gpu.topology("a100")
    with pytest.raises(ValueError, match="at least one host"):
        gpu.topology("h100", hosts=0)


def test_mosaic_kernels_only_where_they_run():
    """bf16/fp16 with K and N in whole 256-blocks on Hopper and Blackwell targets; float32, mixed
    dtypes, other widths and the CPU run as ragged_dot."""
    bf16, f32 = jnp.zeros((64, 512), jnp.bfloat16), jnp.zeros((64, 512), jnp.float32)
    w16, w32 = jnp.zeros((4, 512, 256), jnp.bfloat16), jnp.zeros((4, 512, 256), jnp.float32)
    assert not mgpu.supports(bf16, w16)  # this CPU
    for target, family in (("h100", "hopper"), ("b200", "blackwell"), ("gb300", "blackwell")):
        with gpu.compiling_for(gpu.topology(target).devices):
            assert mgpu.architecture() == family and mgpu.supports(bf16, w16)
            assert not mgpu.supports(f32, w32) and not mgpu.supports(bf16, w32)
            assert not mgpu.supports(bf16[:, :200], w16[:, :200])


def test_one_gpu_architecture_per_process_for_mosaic_kernels(monkeypatch):
    """jax's Mosaic GPU builds a process's kernels for the first architecture it built one for (a
    later one failed in ptxas: "SM version specified by .target is higher than default SM version
    assumed"); a second architecture is refused with a line that says what to do. B200 and GB200
    share one (sm_100)."""
    monkeypatch.setattr(mgpu, "_compiled_for", [])
    for target in ("b200", "gb200"):
        with gpu.compiling_for(gpu.topology(target).devices):
            mgpu.claim_architecture()
    with gpu.compiling_for(gpu.topology("h100").devices):
        with pytest.raises(ValueError, match="built Mosaic GPU kernels for sm_100; .* cannot build them for sm_90"):
            mgpu.claim_architecture()
