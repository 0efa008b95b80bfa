"""Synthetic DeepSeek FP8 checkpoints at full width, for benchmarks and tests.

DeepSeek-V3's real widths (`moe_jax.config.DEEPSEEK_V3`: hidden 7168, vocab 129280, MLA with 128
heads, experts of width 2048) at a depth and an expert count that fit a small disk, in DeepSeek's
on-disk format: every tensor of the parameter table (`moe_jax.params.entries`) under its real
name, FP8 projections as e4m3 with a float32 `_scale_inv` per 128x128 block, the rest BF16, the
correction bias float32. Values are random: e4m3 codes drawn uniformly (never the NaN code),
block scales uniform in `scale`, BF16 tensors normal(0, 0.02). No MTP layer is written.

Written tensor by tensor through `converters.safetensors_io.write_checkpoint` (one shard in
memory at a time), atomically, like every other checkpoint this package writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from converters import fp8
from converters.safetensors_io import write_hf_directory
from moe_jax.config import DEEPSEEK_V3, ModelConfig
from moe_jax.params import entries

SHARD_BYTES = 4 * 10**9  # about the size of a DeepSeek-V3 shard (163 shards, 641 GiB)


def full_width_config(moe_layers: int, experts: int = 32, vocab_size: int | None = None) -> dict:
    """DeepSeek-V3's config.json with one dense layer, `moe_layers` MoE layers of `experts`
    routed experts and no MTP layer, optionally a smaller vocabulary. Expert groups as
    DeepSeek-V3's (8 groups, 4 kept) from 16 experts on; fewer experts get fewer groups, each
    of at least the 2 experts a group score sums."""
    n_group = min(DEEPSEEK_V3["n_group"], max(1, experts // 2))
    return {
        **DEEPSEEK_V3,
        "num_hidden_layers": 1 + moe_layers,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 0,
        "n_routed_experts": experts,
        "n_group": n_group,
        "topk_group": min(DEEPSEEK_V3["topk_group"], n_group),
        "vocab_size": vocab_size or DEEPSEEK_V3["vocab_size"],
    }


def synthetic_tensors(
    cfg: ModelConfig, seed: int = 0, scale: tuple[float, float] = (1e-4, 1e-3)
) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of a DeepSeek FP8 checkpoint with this config (no MTP layer), in the table's
    order, each FP8 weight followed by its `_scale_inv`; generated one at a time."""
    rng = np.random.default_rng(seed)
    for e in entries(cfg, mtp=False):
        n = int(np.prod(e.hf_shape))
        if e.rule.fp8:
            codes = rng.integers(0, 0x7F, n, dtype=np.uint8) | (rng.integers(0, 2, n, dtype=np.uint8) << 7)
            yield e.hf_name, codes.view(fp8.FP8_DTYPE).reshape(e.hf_shape)
            yield e.hf_name + fp8.SCALE_SUFFIX, rng.uniform(*scale, fp8.scale_shape(e.hf_shape)).astype(np.float32)
        else:
            value = 0.02 * rng.standard_normal(e.hf_shape, np.float32)
            yield e.hf_name, value if e.rule.buffer else value.astype(ml_dtypes.bfloat16)


def write_synthetic(
    out: str | os.PathLike,
    config: dict,
    shard_bytes: int = SHARD_BYTES,
    seed: int = 0,
    scale: tuple[float, float] = (1e-4, 1e-3),
    force: bool = True,
) -> int:
    """Write the synthetic FP8 checkpoint of `config` (an HF config.json dict) to `out`, which
    it replaces if it holds an HF checkpoint (`force`); returns the bytes of tensor data."""
    out = Path(out)
    cfg = ModelConfig.from_hf_dict(config)
    total = 0

    def counted() -> Iterator[tuple[str, np.ndarray]]:
        nonlocal total
        for name, value in synthetic_tensors(cfg, seed, scale):
            total += value.nbytes
            yield name, value

    write_hf_directory(out, counted(), {**config, "quantization_config": dict(fp8.QUANT_CONFIG)}, shard_bytes, force)
    return total


def synthetic_checkpoint(
    out: str | os.PathLike,
    moe_layers: int,
    experts: int = 32,
    shard_bytes: int = SHARD_BYTES,
    seed: int = 0,
    scale: tuple[float, float] = (1e-4, 1e-3),
) -> int:
    """A full-width DeepSeek-V3 FP8 checkpoint with one dense and `moe_layers` MoE layers of
    `experts` experts (`full_width_config`) in `out`; returns the bytes of tensor data."""
    return write_synthetic(out, full_width_config(moe_layers, experts), shard_bytes, seed, scale)


def largest_tensor_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of the largest tensor of the model (no MTP layer) at `dtype_bytes` per value."""
    return max(int(np.prod(e.hf_shape)) * dtype_bytes for e in entries(cfg, mtp=False))
