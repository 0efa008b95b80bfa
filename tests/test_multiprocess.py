"""Two processes of four CPU devices each (jax.distributed, gloo over 127.0.0.1) run the tiny
model's forward and backward on one 8-device mesh, and match a single process with 8 devices
(to 4e-9 here: gloo sums gradients across processes in another order than the in-process reduction)."""

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
path, out, spec = sys.argv[1:4]
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
print("done", jax.process_index(), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, env, n):
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, *args], env={**os.environ, **env, **extra},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in n]  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "done" in out, err[-4000:]


def test_two_processes_equal_one(checkpoints, tmp_path):
    path = str(checkpoints["base_sharded"])
    spec = "data=2,expert=4"
    run([path, str(tmp_path / "single.npz"), spec], {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, [{}])
    coordinator = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2",
                   "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}  # fmt: skip
    run([path, str(tmp_path / "multi.npz"), spec], coordinator, [{"JAX_PROCESS_ID": "0"}, {"JAX_PROCESS_ID": "1"}])
    single, multi = np.load(tmp_path / "single.npz"), np.load(tmp_path / "multi.npz")
    assert sorted(single.files) == sorted(multi.files) and len(single.files) > 40
    for name in single.files:
        np.testing.assert_allclose(multi[name], single[name], rtol=0, atol=1e-7, err_msg=name)
        assert np.abs(single[name]).max() > 0, name


def test_training_on_two_processes_equals_one(tmp_path):
    """`moe-jax train` with --coordinator/--num-processes/--process-id: each process feeds its half of
    every global batch; per-step losses equal a single 8-device process on the same mesh."""
    from moe_jax.train.metrics import read_metrics

    common = ["-m", "moe_jax.cli", "train", "--config", "configs/tiny.yaml", "steps=4", "mesh=data=2,expert=4",
              "checkpoint.every=2", "tensorboard=false", "--quiet"]  # fmt: skip
    single = subprocess.run([sys.executable, *common, f"run_dir={tmp_path / 'single'}"], capture_output=True, text=True,
                            env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, *common, f"run_dir={tmp_path / 'multi'}", "--coordinator", address,
                               "--num-processes", "2", "--process-id", str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
             for i in range(2)]  # fmt: skip
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    want = [r["loss"] for r in read_metrics(tmp_path / "single")]
    got = [r["loss"] for r in read_metrics(tmp_path / "multi")]
    assert len(want) == 4
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert sorted(p.name for p in (tmp_path / "multi" / "checkpoints").iterdir()) == ["2", "4"]
    assert (tmp_path / "multi" / "model" / "manifest.json").exists()
