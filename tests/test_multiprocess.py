"""Two processes of four CPU devices each (jax.distributed, gloo over 127.0.0.1) on one 8-device
mesh against a single process with 8 devices: the tiny model's forward and backward (equal to
4e-9 here: gloo sums gradients across processes in another order than the in-process
reduction), then `train` with each process feeding its half of every global batch."""

import os
import socket
import subprocess
import sys

import numpy as np

SCRIPT = r"""
import sys
import numpy as np, jax, jax.numpy as jnp
from moe_jax import distributed
multi = distributed.initialize()  # from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
import moe_jax
from moe_jax.model import forward
from moe_jax.train.config import load_config
from moe_jax.train.loop import train
path, out, run_dir = sys.argv[1:4]
spec = "data=2,expert=4"
model = moe_jax.from_pretrained(path, mesh=spec)
assert jax.device_count() == 8 and jax.process_count() == (2 if multi else 1)
tokens = np.random.default_rng(0).integers(0, 256, (8, 16)).astype(np.int32)
batch = model.place_batch(tokens)
def loss(params, buffers, batch):
    out = forward(params, buffers, batch, model.config, mesh=model.mesh, mtp=True)
    return out.logits.mean() + out.mtp_logits.mean()
grads = jax.jit(jax.grad(loss))(model.params, model.buffers, batch)
result = {"logits": distributed.gather(model(tokens))}
for kp, g in jax.tree_util.tree_leaves_with_path(grads):
    result["grad." + jax.tree_util.keystr(kp)] = distributed.gather(g)
if jax.process_index() == 0:
    np.savez(out, **result)
cfg = load_config("configs/tiny.yaml", [f"run_dir={run_dir}", "steps=3", f"mesh={spec}", "checkpoint.every=2",
                                        "tensorboard=false"])
train(cfg, progress=False)
print("done", jax.process_index(), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, env, n):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, *args],
            env={**os.environ, **env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for extra in n
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "done" in out, err[-4000:]


def test_two_processes_equal_one(checkpoints, tmp_path):
    from moe_jax.train.metrics import read_metrics

    path = str(checkpoints["base_sharded"])
    run(
        [path, str(tmp_path / "single.npz"), str(tmp_path / "single")],
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        [{}],
    )
    coordinator = {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "JAX_NUM_PROCESSES": "2",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    }
    run(
        [path, str(tmp_path / "multi.npz"), str(tmp_path / "multi")],
        coordinator,
        [{"JAX_PROCESS_ID": "0"}, {"JAX_PROCESS_ID": "1"}],
    )
    single, multi = np.load(tmp_path / "single.npz"), np.load(tmp_path / "multi.npz")
    assert sorted(single.files) == sorted(multi.files) and len(single.files) > 40
    for name in single.files:
        np.testing.assert_allclose(multi[name], single[name], rtol=0, atol=1e-7, err_msg=name)
        assert np.abs(single[name]).max() > 0, name
    # training: same per-step losses, checkpoints and final model written once
    want = [r["loss"] for r in read_metrics(tmp_path / "single")]
    got = [r["loss"] for r in read_metrics(tmp_path / "multi")]
    assert len(want) == 3
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert sorted(p.name for p in (tmp_path / "multi" / "checkpoints").iterdir()) == ["2", "3"]
    assert (tmp_path / "multi" / "model" / "manifest.json").exists()


def test_distributed_settings_precedence(monkeypatch):
    """Flags win over the environment; nothing set means a single-process run."""
    from moe_jax import distributed

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.settings() == dict(coordinator_address=None, num_processes=None, process_id=None)
    assert distributed.initialize() is False  # no coordinator, no cluster: stays single-process
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert distributed.settings() == dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=3)
    assert distributed.settings("h:1", 2, 0) == dict(coordinator_address="h:1", num_processes=2, process_id=0)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "four")
    import pytest

    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='four' is not an integer"):
        distributed.settings()
