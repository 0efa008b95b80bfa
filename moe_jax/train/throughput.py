"""What a training step achieves: model FLOPs per device against the device's peak (MFU)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import gpu


def peak_tflops(configured: float | None) -> tuple[float, str]:
    """Per-device peak for MFU: configured, a dense BF16 datasheet figure for known GPUs, or (CPU)
    a float32 matmul measured here."""
    if configured:
        return configured, "configured"
    device = jax.devices()[0]
    target = gpu.target_of(device.device_kind) if device.platform == "gpu" else None
    if target is not None:
        return target.peak_bf16_flops / 1e12, f"{target.description} BF16 dense datasheet"
    return measured_matmul_tflops(device), f"measured {MATMUL_N}x{MATMUL_N} float32 matmul on {device.platform}"


MATMUL_N = 2048  # ~50 ms a matmul on 2 cores: long enough to time steadily


@functools.cache
def measured_matmul_tflops(device) -> float:
    """A float32 matmul's rate on `device`, timed once per process (median of 5)."""
    a = jax.device_put(jnp.ones((MATMUL_N, MATMUL_N), jnp.float32), device)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * MATMUL_N**3 / float(np.median(times)) / 1e12
