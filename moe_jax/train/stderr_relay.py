"""A multi-process run's standard error, relayed by a small process that can speak for it after it.

jax's coordination client aborts a process (`LOG(FATAL)`, SIGABRT, a native stack trace) the moment
process 0, which runs the coordination service, is killed: before any Python code of the process
can speak. So in a multi-process run `moe-jax train` hands its standard error to this relay
(`start`): the training process keeps its pid, its signals and its exit status, and the relay
passes every line through, except that jax's abort message, the coordination service's error
lines just before it and the native stack trace become one line naming the lost process, as
`moe_jax.train.preemption.PeerWatch` words every other loss. The relay ends when the training
process has closed its standard error (exited, however it ended).

    python -m moe_jax.train.stderr_relay PROCESS_ID NUM_PROCESSES   (its stdin: the pipe)
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

FATAL = "Terminating process because the JAX distributed service detected fatal errors"
COORDINATION_LOG = re.compile(r"^[EWF]\d{4} [\d:.]+\s+\d+ coordination_service(_agent)?\.cc:\d+\]")
NATIVE_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ ")
HOLD_S = 3.0  # coordination-service error lines are held this long, in case the abort follows


def start(process_id: int, num_processes: int) -> None:
    """From here on this process's standard error (fd 2: Python's and native code's alike) goes
    through the relay."""
    read, write = os.pipe()
    subprocess.Popen(
        [sys.executable, "-m", "moe_jax.train.stderr_relay", str(process_id), str(num_processes)],
        stdin=read,
        start_new_session=True,  # a Ctrl-C to the terminal's process group is the trainer's, not the relay's
    )
    os.close(read)
    sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)


def relay(source, out, me: int, n: int) -> None:
    """Lines of `source` (bytes, until EOF) to `out`, jax's abort turned into one line."""
    chunks: queue.Queue = queue.Queue()

    def read() -> None:
        while data := source.read1(65536):
            chunks.put(data)
        chunks.put(None)

    threading.Thread(target=read, daemon=True).start()
    partial, held, held_at, fatal = b"", [], 0.0, []

    def flush() -> None:
        out.write(b"".join(held))
        out.flush()
        held.clear()

    while True:
        try:
            data = chunks.get(timeout=0.5)
        except queue.Empty:
            if held and not fatal and time.monotonic() - held_at > HOLD_S:
                flush()
            continue
        if data is None:
            break
        *lines, partial = (partial + data).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            if fatal or FATAL in line:
                fatal.append(line)
            elif COORDINATION_LOG.match(line) or (
                held and not NATIVE_LOG.match(line) and not line.startswith("moe-jax")
            ):
                held_at = held_at if held else time.monotonic()
                held.append(raw + b"\n")
            else:
                flush()
                out.write(raw + b"\n")
        if partial and not fatal and not held and not NATIVE_LOG.match(partial.decode(errors="replace")):
            out.write(partial)  # a progress bar's \r updates: at once
            partial = b""
        out.flush()
    if fatal:
        frames = [line for line in fatal if not line.startswith("    @")]  # (the native stack trace)
        text = "\n".join([b.decode(errors="replace") for b in held] + frames)
        out.write((lost_line(text, me, n) + "\n").encode())
    else:
        flush()
        out.write(partial)
    out.flush()


def lost_line(status: str, me: int, n: int) -> str:
    """The one line for jax's abort message `status`."""
    if "RegisterTask" in status:
        what = "the run did not form: not every process joined in time"
    elif "stopped sending heartbeats" in status:
        ids = status.split("stopped sending heartbeats", 1)[1].split("The tasks have crashed", 1)[0]
        lost = sorted({int(q) for q in re.findall(r"(?:task:)?\b(\d+)\b", ids)} - {me})
        what = " and ".join(f"process {q} of {n}" for q in lost) or "another process"
        what += " stopped responding (no heartbeat to the coordination service: killed, frozen or cut off)"
    else:  # the connection to the service failed: process 0, which runs it, is gone
        what = (
            f"process 0 of {n} stopped responding (its coordination service dropped the connection or "
            "stopped answering: killed, frozen or cut off)"
        )
    return f"moe-jax train: {what}; stopping process {me} rather than waiting for it (jax aborted it)"


if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # it ends when the trainer's stderr does
        signal.signal(sig, signal.SIG_IGN)
    relay(sys.stdin.buffer, sys.stderr.buffer, int(sys.argv[1]), int(sys.argv[2]))
