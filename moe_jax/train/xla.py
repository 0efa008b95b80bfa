"""XLA flag presets for training on GPUs, applied from the config (`xla_preset`) through
XLA_FLAGS before the backend starts. Flags the user already set in XLA_FLAGS win.

Every flag here is accepted by the XLA that jax 0.10.2 ships (tests/test_train.py starts
jax with each preset); they only change what GPU compilation does.
"""

from __future__ import annotations

import os
import re

# flag -> value, with what it does
_OVERLAP = {
    # Schedule collectives asynchronously around independent compute (overlap comms with math).
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Run collectives on a high-priority stream so they are not starved by compute kernels.
    "xla_gpu_enable_highest_priority_async_stream": "true",
    # Let up to 2 independent collectives run at once on separate streams (multi-stream collectives).
    "xla_gpu_experimental_parallel_collective_overlap_limit": "2",
    # Move FSDP reduce-scatters / all-reduces of the previous scan iteration (layer) out of the
    # loop body so they overlap with this layer's compute. (Not all-gathers: with
    # xla_gpu_enable_pipelined_all_gather, jax 0.10.2's XLA fails to compile the training step,
    # "layout minor_to_major field contains 4 elements, but shape has 0 dimensions"; the
    # latency-hiding scheduler still overlaps each layer's gathers within the layer.)
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # Unroll the layer scan by two so the pipelined collectives have somewhere to go.
    "xla_gpu_enable_while_loop_double_buffering": "true",
    # Combine small collectives into larger ones (fewer NCCL launches).
    "xla_gpu_all_gather_combine_threshold_bytes": "134217728",
    "xla_gpu_reduce_scatter_combine_threshold_bytes": "67108864",
    "xla_gpu_all_reduce_combine_threshold_bytes": "134217728",
}

PRESETS: dict[str, dict[str, str]] = {
    "gpu": _OVERLAP,
    # the same plus: no CUDA graphs (they can hold large buffers alive and hide collective
    # hangs while debugging), cuBLAS rather than Triton for GEMMs (more predictable on Hopper).
    "gpu_debug": {**_OVERLAP, "xla_gpu_enable_command_buffer": "", "xla_gpu_enable_triton_gemm": "false"},
}


def preset_flags(name: str) -> dict[str, str]:
    if name not in PRESETS:
        raise ValueError(f"unknown xla_preset {name!r} (have: {', '.join(PRESETS)})")
    return PRESETS[name]


FLAG = re.compile(r"--(\w+)=(\S*)")


def parse_flags(text: str | None) -> dict[str, str]:
    """ "--name=value --name=value" -> {name: value}; ValueError naming what is not such a flag."""
    flags = {}
    for part in (text or "").split():
        if not (m := FLAG.fullmatch(part)):
            raise ValueError(f"{part!r} is not an XLA flag of the form --name=value")
        flags[m.group(1)] = m.group(2)
    return flags


def apply_preset(name: str | None, extra: str | None = None) -> str:
    """Add the preset's flags, then the config's own `extra` flags (which override the preset's),
    to XLA_FLAGS, keeping any the user set there; returns the new value. Must run before jax
    initializes its backend."""
    current = os.environ.get("XLA_FLAGS", "")
    flags = {**(preset_flags(name) if name else {}), **parse_flags(extra)}
    have = {part.split("=", 1)[0].lstrip("-") for part in current.split()}
    added = [f"--{k}={v}" for k, v in flags.items() if k not in have]
    os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return os.environ["XLA_FLAGS"]
