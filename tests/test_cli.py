"""The command line, as a user runs it."""

import json
import subprocess
import sys


def moe_jax(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moe_jax.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_quickstart_runs_and_passes(tmp_path):
    proc = moe_jax("quickstart", "--workdir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("PASS") == 2, proc.stdout
    assert (tmp_path / "tiny-hf" / "model.safetensors.index.json").exists()


def test_make_tiny_then_validate_writes_report(tmp_path):
    ckpt = tmp_path / "flat"
    assert moe_jax("make-tiny", str(ckpt), "--variant", "flat", "--dtype", "bfloat16").returncode == 0
    report = tmp_path / "report.json"
    proc = moe_jax("validate", "--hf", str(ckpt), "--tokens", "16", "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(report.read_text())
    assert data["pass"] is True and data["logits"]["max_abs"] < 1e-4 and len(data["layers"]) == 3
