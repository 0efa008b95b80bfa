"""Shared test helpers."""

import glob
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file

import converters.safetensors_io  # noqa: F401  (float8 for safetensors' numpy backend)


def run_cli(*args, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", *map(str, args)], capture_output=True, text=True, env=env, **kw
    )


# `python -m moe_jax.cli` with Ctrl-C raising KeyboardInterrupt, as in a terminal, even when this
# process was started with SIGINT ignored (a shell's background job), which a child inherits
INTERRUPTIBLE_CLI = [
    sys.executable,
    "-c",
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'moe-jax'; runpy.run_module('moe_jax.cli', run_name='__main__')",
]


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


def run_main(*args):
    """Run the `moe-jax` CLI in this process (no interpreter start-up, no jax re-import):
    (exit code, stdout, stderr). An exception escaping `main` fails the calling test."""
    import contextlib
    import io

    from moe_jax.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def error_lines(stderr: str) -> list[str]:
    """The non-empty lines a terminal shows: a progress bar's frames, each ended by a carriage
    return and overwritten by the next, leave only what was written last on their line."""
    shown = [line.rsplit("\r", 1)[-1] for line in stderr.split("\n")]
    return [line for line in shown if line.strip()]
