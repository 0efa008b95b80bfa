"""The command line, as a user runs it."""

import json
import subprocess
import sys

from tests.helpers import run_main


def moe_jax(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moe_jax.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_quickstart_runs_the_whole_pipeline(tmp_path):
    """README's first command: parity, convert, validation gate, training, FP8 export, reload."""
    proc = moe_jax("quickstart", "--workdir", str(tmp_path), "--steps", "20")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("PASS (float32)") == 2 and proc.stdout.count("PASS (bfloat16)") == 1, proc.stdout
    assert "validation passed" in proc.stdout
    assert (tmp_path / "tiny-hf" / "model.safetensors.index.json").exists()
    assert (tmp_path / "tiny-jax" / "manifest.json").exists()
    losses = [json.loads(line)["ce_loss"] for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0
    assert (tmp_path / "train" / "metrics.png").exists()
    config = json.loads((tmp_path / "trained-hf" / "config.json").read_text())
    assert config["quantization_config"]["fmt"] == "e4m3"


def test_make_tiny_then_validate_writes_report(tmp_path):
    """In this process (the quickstart above runs the commands in a fresh one)."""
    ckpt = tmp_path / "flat"
    assert run_main("make-tiny", ckpt, "--variant", "flat", "--dtype", "bfloat16")[0] == 0
    report = tmp_path / "report.json"
    code, _, err = run_main("validate", "--hf", ckpt, "--tokens", "16", "--dtype", "float32", "--report", report)
    assert code == 0, err[-2000:]
    data = json.loads(report.read_text())
    assert data["pass"] is True and data["logits"]["max_abs"] < 1e-4 and len(data["layers"]) == 3
