"""Joining a multi-process run (several hosts, or several processes on one machine).

Every process runs the same program; `initialize` connects it to the others through JAX's
distributed runtime before any device is used. After that `jax.devices()` lists the devices of
all processes, a mesh spans them, and jitted functions run as one SPMD program: NCCL between
GPUs, gloo between CPU processes.

Where the arguments come from, first found wins:
1. explicit arguments (the CLI's --coordinator / --num-processes / --process-id);
2. the environment: JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES,
   JAX_PROCESS_ID;
3. JAX's cluster auto-detection (SLURM, Open MPI, Kubernetes/JobSet, Cloud TPU), when none of
   the above is set but such a cluster is detected.
With none of them a run stays single-process and `initialize` does nothing.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import jax
import numpy as np
from jax._src.clusters import ClusterEnv  # jax's own cluster detection (SLURM, MPI, ...)
from jax.experimental import multihost_utils


def settings(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> dict:
    """The coordinator, process count and id from the arguments, else the environment."""
    env = os.environ
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _int_env("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _int_env("JAX_PROCESS_ID")
    return dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _cluster_detected() -> bool:
    return any(env.is_env_present() for env in ClusterEnv._cluster_types if env.__name__ != "SingleProcessEnv")


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    cpu_collectives: str = "gloo",
    heartbeat_timeout_s: float = 100,
    join_timeout_s: float = 300,
) -> bool:
    """Join the run described by the arguments / environment; True if it is multi-process.
    Must run before anything touches a device. `heartbeat_timeout_s`: when jax's runtime gives
    up on a silent process and aborts the others (set it above the training loop's own
    `peer_timeout_s`, which stops them first with a clear line). `join_timeout_s`: a run that has
    not formed by then (a process that never started, or died before joining) stops this process
    with one line, exit status 1 (jax's own `initialization_timeout`, set 30 s longer, would abort
    it with a stack trace)."""
    args = settings(coordinator, num_processes, process_id)
    if args["num_processes"] == 1:
        return False
    if args["coordinator_address"] is None and args["num_processes"] is None and not _cluster_detected():
        return False
    if args["coordinator_address"] and (args["num_processes"] is None or args["process_id"] is None):
        if not _cluster_detected():
            raise ValueError(
                "a coordinator address needs the process count and this process's id "
                "(--num-processes/--process-id or JAX_NUM_PROCESSES/JAX_PROCESS_ID)"
            )
    # CPU processes exchange collectives over gloo (TCP); GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    # jax's preemption service takes SIGTERM over; moe_jax.train.preemption handles it instead
    jax.config.update("jax_enable_preemption_service", False)
    with _JoinDeadline(join_timeout_s, args):
        jax.distributed.initialize(
            **args,
            heartbeat_timeout_seconds=math.ceil(heartbeat_timeout_s),
            initialization_timeout=math.ceil(join_timeout_s) + 30,
        )
    return jax.process_count() > 1


class _JoinDeadline:
    """Ends the process with one line (exit 1) if `jax.distributed.initialize` has not returned
    after `timeout_s` (it releases the GIL while it waits, so this thread runs)."""

    def __init__(self, timeout_s: float, args: dict):
        self.timeout_s, self.args = timeout_s, args
        self._joined = threading.Event()

    def __enter__(self):
        threading.Thread(target=self._run, name="moe-jax join deadline", daemon=True).start()

    def __exit__(self, *exc):
        self._joined.set()

    def _run(self) -> None:
        if self._joined.wait(self.timeout_s):
            return
        n, me, where = self.args["num_processes"], self.args["process_id"], self.args["coordinator_address"]
        if n is None or me is None:  # given by the cluster (SLURM, Kubernetes, ...): what jax read
            env = next((e for e in ClusterEnv._cluster_types if e.is_env_present() and not e.opt_in_only_method), None)
            try:
                n, me = n or env.get_process_count(), env.get_process_id() if me is None else me
            except Exception:  # noqa: BLE001  (only the message is at stake)
                pass
        count = f"{n}-process " if n else ""
        if me == 0:
            why = "not every other process joined it (never started, or failed before joining)"
        else:
            at = f" at {where}" if where else ""
            why = f"process 0's coordination service{at} did not answer, or not every process joined"
        print(
            f"moe-jax train: the {count}run did not form within {self.timeout_s:g} s: {why}; "
            f"stopping process {me if me is not None else '?'} (join_timeout_s={self.timeout_s:g})",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


def gather(x) -> np.ndarray:
    """A global (possibly multi-process) array, in full on every process, as numpy."""
    if jax.process_count() == 1 or x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
