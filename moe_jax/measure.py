"""Measuring a command: wall time and peak memory, sampled from /proc (Linux), standard library only.

`run_sampled` runs a command as a child process and samples its `/proc/PID/status` every 20 ms
(`peak_during` does the same for this process while a function runs):
RssAnon (private memory, what runs a machine out of RAM) and RssFile (mapped file pages,
reclaimable). The benchmarks (`scripts/bench_convert.py`, `scripts/bench_validate.py`) report
these peaks beside their targets.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time
from pathlib import Path

GiB = 2**30
_FIELDS = {"RssAnon": "anon", "RssFile": "file"}


def read_rss(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of process `pid` in bytes ({} once it has exited)."""
    got = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = _FIELDS.get(line.split(":", 1)[0])
                if key:
                    got[key] = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return got


def sample_while(pid: int, running, peak: dict[str, int], interval: float) -> None:
    """Raise `peak`'s anon/file to process `pid`'s RssAnon/RssFile every `interval` s while `running()`."""
    while running():
        for key, value in read_rss(pid).items():
            peak[key] = max(peak.get(key, 0), value)
        time.sleep(interval)


def peak_during(fn, interval: float = 0.0005) -> tuple[object, dict[str, int]]:
    """(fn(), the peak RssAnon/RssFile of this process while it ran, in bytes)."""
    pid, done, peak = os.getpid(), threading.Event(), dict(read_rss(os.getpid()))
    sampler = threading.Thread(target=sample_while, args=(pid, lambda: not done.is_set(), peak, interval))
    sampler.start()
    try:
        return fn(), peak
    finally:
        done.set()
        sampler.join()


def run_sampled(cmd: list[str], check: bool = True, interval: float = 0.02) -> dict:
    """Run `cmd`, sampling its RssAnon/RssFile every `interval` seconds.

    Returns seconds (wall time), peak_anon and peak_file (bytes), returncode and stdout. A
    nonzero exit raises RuntimeError with the end of stderr, except exit 1 when `check` is
    false (a command that reports a failed check, like `moe-jax validate`, still measured)."""
    peak = {"anon": 0, "file": 0}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sampler = threading.Thread(target=sample_while, args=(proc.pid, lambda: proc.poll() is None, peak, interval))
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode and (check or proc.returncode != 1):
        raise RuntimeError(f"{' '.join(cmd)} failed: {err.decode()[-2000:]}")
    return {
        "seconds": time.perf_counter() - t0,
        "peak_anon": peak["anon"],
        "peak_file": peak["file"],
        "returncode": proc.returncode,
        "stdout": out.decode(),
    }


def benchmark_parser(doc: str, name: str, workdir: bool = False) -> argparse.ArgumentParser:
    """The flags every benchmark shares: --out (its JSON, default runs/NAME.json) and, for those
    that write checkpoints, --workdir (default /tmp/NAME)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"runs/{name}.json", help="where the JSON results go")
    if workdir:
        parser.add_argument("--workdir", type=Path, default=Path(f"/tmp/{name}"), help="scratch space for checkpoints")
    return parser
