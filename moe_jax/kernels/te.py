"""Transformer Engine's grouped GEMM (the `te` and `te+mxfp8` grouped-GEMM backends).

TE (`transformer-engine[jax]` >= 2.20, optional, imported only here and only when used) runs the
expert GEMMs as cuBLASLt grouped GEMMs with its own custom VJP: BF16 on Hopper and Blackwell, and
MXFP8 on Blackwell (compute capability 10.x), where it quantizes each expert's rows in 1x32 blocks
(e4m3 forward, e5m2 gradients, e8m0 scales) in one grouped-quantize kernel per operand. Group
sizes stay on the device.

Compile-only machines. Where there is no NVIDIA driver, `load` first loads the driver stand-in
that scripts/setup_te.sh builds (every entry point answers "no device"), since TE's libraries do
not load without a libcuda.so.1, and TE's compute-capability query then answers from the
deviceless target being compiled for (`moe_jax.gpu.compiling_for`): TE compiles for H100 or B200
on a CPU machine and can run nothing there. One target per process: TE caches the answer.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from moe_jax import gpu

STUB = Path(sys.prefix) / "lib" / "cuda-stub" / "libcuda.so.1"  # built by scripts/cuda_stub/build.py
GROUP_ALIGN = 128  # rows per group that TE's MXFP8 grouped GEMM needs (BF16 takes it too)


def has_driver() -> bool:
    return os.path.exists("/dev/nvidiactl")


def load():
    """TE's JAX `grouped_dense` and quantizer factory, loaded for this machine (see the module)."""
    compile_only = not has_driver()
    if compile_only and "transformer_engine_jax" not in sys.modules:
        if not STUB.exists():
            raise RuntimeError(
                f"backend 'te' without an NVIDIA driver needs Transformer Engine and the compile-only driver "
                f"stand-in {STUB}: run scripts/setup_te.sh"
            )
        ctypes.CDLL(str(STUB), mode=ctypes.RTLD_GLOBAL)
    try:
        with warnings.catch_warnings():  # TE warns that its PyTorch extension is absent: we do not use it
            warnings.filterwarnings("ignore", message=".*Transformer Engine PyTorch extension.*")
            from transformer_engine.jax.dense import grouped_dense  # loads the extension, transformer_engine_jax
        import transformer_engine_jax
        from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode
    except (ImportError, OSError) as e:
        raise RuntimeError(f"backend 'te' needs transformer-engine[jax] >= 2.20 (scripts/setup_te.sh): {e}") from e
    if compile_only:
        gemm = sys.modules["transformer_engine.jax.cpp_extensions.gemm"]
        for module in (transformer_engine_jax, gemm):
            module.get_device_compute_capability = target_capability
    return grouped_dense, QuantizerFactory, ScalingMode


def target_capability(gpu_id: int = 0) -> int:
    """TE's compute-capability query (e.g. 100 for 10.0), answered from the deviceless target."""
    cc = gpu.capability()
    if cc is None:
        raise RuntimeError(
            "Transformer Engine without an NVIDIA GPU only compiles: inside moe_jax.gpu.compiling_for(<target devices>)"
        )
    return cc[0] * 10 + cc[1]


def require_mxfp8(cc: tuple[int, int] | None, what: str = "TE's MXFP8 grouped GEMM") -> None:
    """ValueError unless compute capability `cc` is Blackwell's (10.x), where TE has MXFP8."""
    if cc is None or cc < (10, 0):
        raise ValueError(f"{what} needs a Blackwell GPU (compute capability 10.x), not {cc}")


def grouped_dense(x: jax.Array, w: jax.Array, group_sizes: jax.Array, mxfp8: bool = False) -> jax.Array:
    """x [M, K] sorted by group, w [G, K, N] -> [M, N] by TE's grouped GEMM, BF16/FP16 or (with
    `mxfp8`, Blackwell only) MXFP8. Expects rows whose groups start at multiples of GROUP_ALIGN
    (`moe_jax.kernels.grouped_gemm.aligned` pads them)."""
    dense, factory, scaling = load()
    quantizers = {}
    if mxfp8:
        require_mxfp8(gpu.capability())
        quantizers["quantizer_set"] = factory.create_set(
            scaling_mode=scaling.MXFP8_1D_SCALING,
            fwd_dtype=jnp.float8_e4m3fn,
            bwd_dtype=jnp.float8_e5m2,
            is_2x2x=True,
            n_groups=w.shape[0],
        )
    return dense(x, w, group_sizes.astype(jnp.int32), contracting_dims=((1,), (1,)), **quantizers)
