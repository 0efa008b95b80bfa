"""Stopping as clusters stop jobs: SIGTERM saves a checkpoint; a vanished process stops the rest.

- `StopSignal`: SIGTERM (SLURM's `--signal` and preemption, Kubernetes eviction, `scancel`) sets
  a flag. The training loop votes on it with every step (`make_vote`: one all-reduce over the
  processes, dispatched beside the step and read with its metrics), so every process reads the
  same verdict after the same step, saves a checkpoint after the same next step, and exits 0.
  This is jax's multi-host preemption sync point done with the step's own rhythm: no process can
  be a step ahead of another when the verdict is read, because all read it from one collective.
- `PeerWatch`: in a multi-process run, every process posts a heartbeat to the coordination
  service's key-value store from a thread. A process whose heartbeat stops for `timeout_s`
  (killed, frozen, cut off from the network) would leave the others blocked in a collective:
  they stop instead, with one line naming it; one that fails posts its error and the others stop at
  once. It runs from the moment the process has joined (`moe-jax train` starts it right after
  `moe_jax.distributed.initialize`), so loading and compiling are watched too. (jax's own heartbeat
  would abort them later with a stack trace; `moe_jax.distributed.initialize` sets it longer than
  ours, and `moe_jax.distributed.supervise` turns the abort jax's client does at once when process
  0 is killed into the same kind of line.)
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import distributed as jax_distributed  # its client: the coordination service's key-value store
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moe_jax.errors import one_line

EXIT_PEER_LOST = 1  # the exit status of a process stopped because another vanished


class StopSignal:
    """SIGTERM or SIGINT (Ctrl-C) sets `requested` (main thread only; elsewhere nothing is
    installed): the run saves after the step and stops. A second Ctrl-C stops at once (what is
    being written is discarded, as on any interruption). A context manager: the previous handlers
    come back on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self._first_interrupt = -math.inf  # when the first Ctrl-C came
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            # one Ctrl-C may arrive twice: from the terminal and through moe_jax.train.supervisor
            now = time.monotonic()
            if self.requested and now - self._first_interrupt > 0.5:
                raise KeyboardInterrupt
            if not self.requested:
                self._first_interrupt = now
                print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again: at once)", file=sys.stderr)
        self.requested = True

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            # a Ctrl-C this process was started to ignore (a shell's background job) stays ignored
            wanted = [s for s in self.SIGNALS if s != signal.SIGINT or signal.getsignal(s) is not signal.SIG_IGN]
            self._previous = {s: signal.signal(s, self._handle) for s in wanted}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def make_vote():
    """`vote(flag)`: True on every process if any process passed True; a device array, read later.
    One process: the flag itself."""
    if jax.process_count() == 1:
        return lambda flag: np.bool_(flag)
    mesh = Mesh(np.array(jax.devices()), ("processes",))
    flags = NamedSharding(mesh, PartitionSpec("processes"))
    any_of = jax.jit(jnp.any, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def vote(flag: bool):
        local = np.full(jax.local_device_count(), flag)
        return any_of(jax.make_array_from_process_local_data(flags, local))

    return vote


class PeerWatch:
    """Heartbeats through the coordination service; `timeout_s` without one from a process that
    has not finished stops this process (`EXIT_PEER_LOST`) with one line naming it; a process that
    leaves with an error posts it, and the others stop at once, naming it.

    Two threads: `_beat` makes the RPCs (which block, neither answering nor failing, while process
    0 is frozen), `_judge` decides from the time of the last answered round trip, so a frozen
    coordinator is named after `timeout_s` too (jax's client aborts only after its own, longer,
    heartbeat timeout)."""

    PREFIX = "moe-jax/alive/"
    current: PeerWatch | None = None  # the one running (started by the CLI right after joining)

    def __init__(self, timeout_s: float, client=None):
        self.client = client or jax_distributed.global_state.client
        self.timeout_s = float(timeout_s)
        self.me, self.count = jax.process_index(), jax.process_count()
        self.host = socket.gethostname()
        self._period = min(2.0, self.timeout_s / 10)  # between heartbeats
        self._stop = threading.Event()
        self._answered = time.monotonic()  # the last round trip to the coordination service
        self._posted: dict[str, str] = {}
        self._beat_thread = threading.Thread(target=self._beat, name="moe-jax peer heartbeat", daemon=True)
        self._thread = threading.Thread(target=self._judge, name="moe-jax peer watch", daemon=True)

    def __enter__(self) -> PeerWatch:
        PeerWatch.current = self
        self._beat_thread.start()
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Finished: the others stop watching this process. Failed in a collective (a peer that
        died resets the connection at once): wait for the watch to name the peer that vanished,
        rather than report the transport's error; any other failure is this process's own, and
        the others are told at once."""
        if exc_type is not None and issubclass(exc_type, jax.errors.JaxRuntimeError):
            self._thread.join(self.timeout_s + 3 * self._period)  # ends the process if a peer is lost
        self._stop.set()
        self._thread.join()
        self._beat_thread.join(self._period + 1)  # no heartbeat may overwrite the last word
        if exc_type is None or not issubclass(exc_type, Exception):  # done, or Ctrl-C / SystemExit
            word = f"done {self.host}"
        else:
            word = f"failed {self.host}: {one_line(exc)[:300]}"
        last = threading.Thread(target=self._post, args=(word,), daemon=True)
        last.start()
        last.join(2 * self._period + 1)  # the coordinator is gone or frozen: nobody is left to tell
        PeerWatch.current = None

    def _post(self, value: str) -> None:
        try:
            self.client.key_value_set(f"{self.PREFIX}{self.me}", value, allow_overwrite=True)
        except Exception:
            pass

    def _beat(self) -> None:
        beat = 0
        while not self._stop.is_set():
            try:
                self.client.key_value_set(f"{self.PREFIX}{self.me}", f"{beat} {self.host}", allow_overwrite=True)
                self._posted = dict(self.client.key_value_dir_get(self.PREFIX))
                self._answered = time.monotonic()
                beat += 1
            except Exception:  # the coordination service does not answer: `_judge` counts the time
                pass
            self._stop.wait(self._period)

    def _judge(self) -> None:
        started = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}  # process -> (its last heartbeat, when it changed)
        while not self._stop.wait(self._period / 2):
            now = time.monotonic()
            if now - self._answered > self.timeout_s:
                self._lost(0, "", f"the coordination service it runs has not answered for {self.timeout_s:g} s")
            posted = self._posted
            for q in range(self.count):
                value = posted.get(f"{self.PREFIX}{q}", "")
                if q == self.me or value.startswith("done"):
                    continue
                if value.startswith("failed "):
                    host, _, why = value[len("failed ") :].partition(": ")
                    self._lost(q, host, f"it failed: {why}", verb="stopped with an error")
                last, since = seen.get(q, ("", started))
                if value != last:
                    seen[q] = (value, now)
                elif now - since > self.timeout_s:
                    host = value.split(" ", 1)[1] if " " in value else ""
                    self._lost(q, host, f"no heartbeat for {self.timeout_s:g} s: killed, frozen or cut off")

    def _lost(self, q: int, host: str, why: str, verb: str = "stopped responding") -> None:
        if self._stop.is_set():
            return
        where = f" on {host}" if host else ""
        print(
            f"moe-jax train: process {q} of {self.count}{where} {verb} ({why}); stopping process {self.me} "
            f"rather than waiting for it (peer_timeout_s={self.timeout_s:g})",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_PEER_LOST)
