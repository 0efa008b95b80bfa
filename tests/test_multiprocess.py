"""Two processes of four CPU devices each (jax.distributed, gloo over 127.0.0.1) on one 8-device
mesh against a single process with 8 devices: the tiny model's forward and backward (equal to
4e-9 here: gloo sums gradients across processes in another order than the in-process
reduction), then `train` with each process feeding its half of every global batch. The single
process also trains on one device: 8 devices (data x expert) = 1 device. (One 8-device process
start, and one compilation of the 8-device training step, serve both comparisons.)"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from moe_jax import distributed
from moe_jax.train.metrics import read_metrics

SCRIPT = r"""
import sys, json
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
# 6 steps, a step checkpoint every 4 (and after the last, off that cadence)
def run(run_dir, mesh, every):
    cfg = load_config("configs/tiny.yaml", [f"run_dir={run_dir}", "steps=6", f"mesh={mesh}", f"checkpoint.every={every}",
                                            "tensorboard=false"])
    return train(cfg, progress=False, log=lambda *a: None)["losses"]
losses = {"eight": run(run_dir, spec, 4)}
if not multi:  # the same run on one device (no mesh)
    losses["one"] = run(run_dir + "-one", "null", 100)
print("losses", json.dumps(losses))
print("done", jax.process_index(), flush=True)
"""


# LLVM at -O0 in every process: the comparisons are between processes with the same flags; compiling
# is most of their time, and -O0 compiles in 60% of it.
O0 = "--xla_backend_optimization_level=0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, env, n) -> list[str]:
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
    return [out for out, _ in outs]


def test_two_processes_equal_one(checkpoints, tmp_path):
    path = str(checkpoints["base_sharded"])
    (out,) = run(
        [path, str(tmp_path / "single.npz"), str(tmp_path / "single")],
        {"XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {O0}"},
        [{}],
    )
    coordinator = {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "JAX_NUM_PROCESSES": "2",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {O0}",
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
    assert len(want) == 6
    np.testing.assert_allclose(got[:3], want[:3], rtol=1e-6)
    # then, as for 8 devices against 1 below, Adam amplifies the reduction order's 4e-9 (measured
    # 5.7e-6 at step 5, 1.2e-5 at step 6)
    np.testing.assert_allclose(got, want, rtol=5e-5)
    assert sorted(p.name for p in (tmp_path / "multi" / "checkpoints").iterdir()) == ["4", "6"]
    assert (tmp_path / "multi" / "model" / "manifest.json").exists()

    # 8 devices (data=2, expert=4) = 1 device, in the single process
    losses = json.loads(next(line for line in out.splitlines() if line.startswith("losses "))[len("losses ") :])
    one, eight = losses["one"], losses["eight"]
    assert list(one) == [str(s) for s in range(1, 7)] and list(eight) == list(one)
    # float32. The sharded run sums in another order: the first loss agrees to 3e-7; Adam's
    # normalised updates amplify such differences to about 1e-5 by step 6 (measured 1.2e-5).
    np.testing.assert_allclose(eight["1"], one["1"], rtol=1e-6)
    np.testing.assert_allclose([eight[k] for k in one], [one[k] for k in one], rtol=5e-5)


def test_distributed_settings_precedence(monkeypatch):
    """Flags win over the environment; nothing set means a single-process run."""
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
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='four' is not an integer"):
        distributed.settings()
