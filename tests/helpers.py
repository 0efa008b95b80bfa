"""Shared test helpers."""

import glob
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file

import converters.safetensors_io  # noqa: F401  (float8 for safetensors' numpy backend)


def run_cli(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "moe_jax.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, **kw)  # fmt: skip


def all_tensors(path) -> dict[str, np.ndarray]:
    tensors = {}
    for f in sorted(glob.glob(f"{path}/*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def assert_bit_identical(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8)), name
