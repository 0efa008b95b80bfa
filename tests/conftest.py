"""Tiny checkpoints built once per session, in the real on-disk formats."""

import os
import tempfile

# One XLA compilation cache for the whole run, subprocesses included (they inherit the
# environment): the tiny model's train step and forward are compiled once, not in every test.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="moe-jax-xla-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from converters.tiny import make_tiny  # noqa: E402

# name -> make_tiny arguments. Together: grouped routing on/off, q_lora_rank set/null, YaRN on/off,
# interleaved and plain rope, MTP present/absent, FP32/BF16/FP8 storage, widths that are not
# multiples of 128, single-file and sharded layouts.
FIXTURES = {
    "base_sharded": dict(variant="base", shards=3),
    "flat_single": dict(variant="flat"),
    "wide_fp8_sharded": dict(variant="wide", fp8_weights=True, shards=2),
    "base_fp8_single": dict(variant="base", fp8_weights=True),
    "base_bf16_single": dict(variant="base", dtype="bfloat16"),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_tiny(root / name, **kw) for name, kw in FIXTURES.items()}


@pytest.fixture(params=sorted(FIXTURES))
def checkpoint(request, checkpoints):
    return checkpoints[request.param]


def random_tokens(vocab, batch=2, length=24, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)
