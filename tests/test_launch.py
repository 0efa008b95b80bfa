"""Launching as clusters do (scripts/launch/): the SLURM batch script's and the Kubernetes Job's
own commands, started as two local processes with the environment each scheduler gives its
tasks, form one 2-process run; SIGTERM to one process saves and stops both, and --resume
continues bit for bit; a process that stops responding stops the other with one line."""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from moe_jax.train.metrics.store import read_metrics
from tests.test_multiprocess import trained_weights

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 10
# the run every test starts: the tiny model on short rows, 2 processes of one CPU device, no periodic
# checkpoints (a process's start, not its steps, is most of a test's time)
RUN = [f"steps={STEPS}", "mesh=data=2", "model.mtp=false", "data.batch_size=2", "data.seq_len=32"]
RUN += ["checkpoint.every=1000", "tensorboard=false", "peak_tflops=1"]
CPU = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def free_port(low: int = 1024, high: int = 65535) -> int:
    for port in np.random.default_rng().integers(low, high, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", int(port)))
            except OSError:
                continue
            return int(port)
    raise RuntimeError("no free port")


def slurm_command(run_dir: Path) -> list[str]:
    """The srun line of scripts/launch/slurm.sbatch: its command, with the script's variables."""
    script = (ROOT / "scripts/launch/slurm.sbatch").read_text()
    (line,) = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    words = shlex.split(line)[1:]
    words = words[next(i for i, w in enumerate(words) if not w.startswith("--")) :]  # srun's own options
    values = {"$MOE_JAX": str(BIN / "moe-jax"), "$CONFIG": str(ROOT / "configs/tiny.yaml"), "$RUN_DIR": str(run_dir)}
    words = [re.sub(r"\$[A-Z_]+", lambda m: values[m.group()], w) for w in words if w != "$@"]
    return words + RUN


def slurm_tasks() -> list[dict]:
    """What srun gives the two tasks of a step on one node; jax derives the coordinator's port
    from the job id (job id % 4096 + 61440): pick a job id whose port is free."""
    job_id = free_port(61440) - 61440 + 4096 * 1234
    step = {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_NODES": "1"}
    return [{**step, "SLURM_NTASKS": "2", "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)} for i in (0, 1)]


def kubernetes_pods(run_dir: Path) -> list[tuple[list[str], dict]]:
    """The command and environment of each pod of scripts/launch/kubernetes.yaml's indexed Job (2
    completions), as Kubernetes would resolve them; the coordinator's DNS name becomes 127.0.0.1."""
    service, job = yaml.safe_load_all((ROOT / "scripts/launch/kubernetes.yaml").read_text())
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and service["spec"]["clusterIP"] == "None"
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    index_ref = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    pods = []
    port = free_port()
    for index in range(2):
        env = {}
        for var in container["env"]:
            if "value" in var:
                env[var["name"]] = var["value"]
            else:
                assert var["valueFrom"]["fieldRef"]["fieldPath"] == index_ref, var
                env[var["name"]] = str(index)
        # what the manifest promises: pod 0 of the Job, named through the headless Service
        host, _ = env["JAX_COORDINATOR_ADDRESS"].split(":")
        assert (
            host == f"{job['metadata']['name']}-0.{pod['subdomain']}"
            and pod["subdomain"] == service["metadata"]["name"]
        )
        assert env["JAX_NUM_PROCESSES"] == str(spec["completions"]) == str(spec["parallelism"])
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
        env.update(CONFIG=str(ROOT / "configs/tiny.yaml"), RUN_DIR=str(run_dir))
        command = container["command"]
        assert command[:2] == ["sh", "-c"]
        # the run's test settings go after the manifest's own arguments, before its `&& test -e ...`
        pods.append((["sh", "-c", command[2].replace(" && ", " " + shlex.join(RUN) + " && ", 1)], env))
    return pods


def start(command: list[str], env: dict) -> subprocess.Popen:
    path = f"{BIN}{os.pathsep}{os.environ['PATH']}"
    return subprocess.Popen(
        command, env={**os.environ, **CPU, **env, "PATH": path}, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    outs = [p.communicate(timeout=600) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outs)]


def metrics_of(run_dir: Path) -> dict[str, np.ndarray]:
    records = read_metrics(run_dir)
    return {k: np.array([r[k] for r in records]) for k in ("step", "loss", "ce_loss", "grad_norm", "lr")}


def wait_for_step(run_dir: Path, step: int, procs, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) >= step:
            return
        assert all(p.poll() is None for p in procs), "a process ended before the run reached step {step}"
        time.sleep(0.05)
    raise TimeoutError(f"the run did not reach step {step}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The Kubernetes Job's two pods, run to the end: the reference of the resumed run."""
    run_dir = tmp_path_factory.mktemp("k8s") / "run"
    results = finish([start(cmd, env) for cmd, env in kubernetes_pods(run_dir)])
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    assert "2 device(s) in 2 process(es)" in results[0][1] + results[0][2]
    return run_dir


def test_kubernetes_job_is_one_two_process_run(uninterrupted):
    metrics = metrics_of(uninterrupted)
    assert list(metrics["step"]) == list(range(1, STEPS + 1))
    assert (uninterrupted / "model" / "manifest.json").is_file()  # the pods' `test -e` passed: exit 0


def test_sigterm_saves_every_process_at_one_step_and_resumes_exactly(uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    procs = [start(slurm_command(run_dir), env) for env in slurm_tasks()]
    wait_for_step(run_dir, 2, procs)
    procs[1].send_signal(signal.SIGTERM)  # as SLURM's --signal or a preemption would
    results = finish(procs)
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir())
    assert len(saved) == 1 and 2 <= saved[0] < STEPS, saved
    assert f"every process stopped after step {saved[0]}" in results[0][1] + results[0][2]
    assert (run_dir / "checkpoints" / str(saved[0]) / "moe-jax-files.json").is_file()  # recorded, verifiable
    assert not (run_dir / "model").exists()
    assert list(metrics_of(run_dir)["step"]) == list(range(1, saved[0] + 1))

    # the job queued again: the same command (it has --resume) continues from the checkpoint
    procs = [start(slurm_command(run_dir), env) for env in slurm_tasks()]
    for rc, out, err in finish(procs):
        assert rc == 0, err[-3000:]
    got, want = metrics_of(run_dir), metrics_of(uninterrupted)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert [sorted(r) for r in read_metrics(run_dir)] == [sorted(r) for r in read_metrics(uninterrupted)]
    got, want = trained_weights(run_dir / "model"), trained_weights(uninterrupted / "model")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("how", ["frozen", "killed", "coordinator frozen", "coordinator killed", "fails at start"])
def test_a_lost_process_stops_the_other_with_one_line(tmp_path, how):
    """Whichever process is lost (process 0 runs the coordination service), and whenever (here
    in its start-up, or at step 2), the other stops with one line naming it."""
    run_dir = tmp_path / "run"
    command = slurm_command(run_dir) + ["peer_timeout_s=5", "steps=100000"]
    lost = 0 if how.startswith("coordinator") else 1
    bad = ["data.source=/nonexistent/data.txt"] if how == "fails at start" else []
    procs = [start(command + bad * (i == lost), env) for i, env in enumerate(slurm_tasks())]
    survivor = procs[1 - lost]
    try:
        if how != "fails at start":
            wait_for_step(run_dir, 2, procs)
        t0 = time.monotonic()
        if how.endswith("frozen"):
            procs[lost].send_signal(signal.SIGSTOP)  # no steps, no heartbeats, its connections open
            survivor.send_signal(signal.SIGTERM)  # ... and the other cannot save with it
        elif how.endswith("killed"):
            procs[lost].kill()  # its connections reset: the collective in flight fails at once
        out, err = survivor.communicate(timeout=120)
        waited = time.monotonic() - t0
    finally:
        procs[lost].kill()
        procs[lost].communicate()
    # jax's own client aborts a process whose coordination service is killed, before Python can run:
    # its relay (moe_jax.train.stderr_relay) says the line instead
    assert survivor.returncode == (-signal.SIGABRT if how == "coordinator killed" else 1), err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("moe-jax") or "Error" in ln or "error" in ln]
    words = (
        "stopped with an error (it failed: /nonexistent/data.txt" if how == "fails at start" else "stopped responding"
    )
    assert len(lines) == 1 and f"process {lost} of 2" in lines[0] and words in lines[0], err[-3000:]
    assert waited < 60, waited


def test_a_run_that_does_not_form_stops_with_one_line(tmp_path):
    """One process started, the other never: it stops after join_timeout_s, saying so."""
    command = slurm_command(tmp_path / "run") + ["join_timeout_s=5"]
    proc = start(command, slurm_tasks()[0])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("moe-jax") or "Error" in ln or "error" in ln]
    assert len(lines) == 1 and "the 2-process run did not form within 5 s" in lines[0], err[-3000:]
