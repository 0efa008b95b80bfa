"""Per-step training metrics: RUN/metrics.jsonl (the record), RUN/tensorboard/ (for TensorBoard), RUN/metrics.png.

    with MetricsWriter(run_dir, resume_step=ckpt_step) as w:     # resume_step=None for a fresh run
        w.write(step, {"loss": ..., "lr": ..., "load_imbalance": [...per MoE layer...]})
    read_metrics(run_dir) -> [{"step": 1, "time": 1.7e9, "loss": 11.0, ...}, ...]
    plot(run_dir) -> RUN/metrics.png        summary(run_dir) -> one line for the CLI

metrics.jsonl holds one JSON object per logged step: `step`, `time` (unix seconds), then the metrics in the
order given. Scalars are written as JSON numbers (ints stay ints), lists (`load_imbalance`: max/mean expert
load per MoE layer, MTP layer last) as lists of numbers, strings and None as they are.

Non-finite floats are written as the JSON strings "NaN", "Infinity" and "-Infinity" (the spellings of
JavaScript and of Python's json module), so every line is strict JSON and NaN stays distinguishable from Inf.
`read_metrics` turns those strings back into floats.

Each line is flushed as it is written: a killed run keeps every step logged so far, except possibly a
partial last line, which `read_metrics` skips with a warning and `MetricsWriter` cuts off before appending.
TensorBoard events are flushed every `tb_flush_secs` and on close.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Self

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from tensorboardX import SummaryWriter

from converters.files import atomic_write

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "metrics.png"
_RESERVED = ("step", "time")
_TO_FLOAT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


# ----------------------------------------------------------------------------- encoding


def _encode_float(x, short: bool = False) -> float | str:
    """A float, or its non-finite spelling. short: x came from a <= 32-bit float; write its shortest float32
    repr (7.3333335, not 7.333333492279053), which reads back as the same float32."""
    x = float(x)
    if math.isfinite(x):
        return float(str(np.float32(x))) if short else x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def _encode(key: str, v):
    """A metric value as JSON-ready data: int, float, "NaN"/"Infinity"/"-Infinity", str, None, or a list."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, (bool, np.bool_, int, np.integer)):
        return int(v)
    if isinstance(v, (list, tuple)):
        return [_encode(key, x) if isinstance(x, (int, np.integer)) else _encode_float(x, _short(x)) for x in v]
    try:
        ndim = np.ndim(v)
    except Exception:  # noqa: BLE001 - anything numpy cannot look at is not a metric
        raise TypeError(f"metric {key!r}: unsupported value of type {type(v).__name__}") from None
    if ndim == 1:
        short = _short(v)
        return [_encode_float(x, short) for x in np.asarray(v, dtype=np.float64)]
    if ndim != 0:
        raise ValueError(f"metric {key!r}: expected a scalar or a 1-D list, got shape {np.shape(v)}")
    dtype = getattr(v, "dtype", None)
    if dtype is not None and (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_)):
        return int(v)
    return _encode_float(v, _short(v))


def _short(v) -> bool:
    """Whether v is a numpy/jax float of 32 bits or fewer (float32, bfloat16, float16)."""
    dtype = getattr(v, "dtype", None)
    return dtype is not None and dtype.kind == "f" and dtype.itemsize <= 4 or str(dtype) == "bfloat16"


def _decode(v):
    if isinstance(v, str):
        return _TO_FLOAT.get(v, v)
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


# ----------------------------------------------------------------------------- reading


def _metrics_path(run_dir) -> Path:
    p = Path(run_dir)
    return p if p.is_file() or p.suffix == ".jsonl" else p / METRICS_FILE


def _records(path: Path, warn: bool = True) -> Iterator[tuple[int, bytes, dict]]:
    """(line number, raw line without newline, decoded record) for each record in `path`.

    A corrupt line raises ValueError naming path:line, except the last non-blank line, which a killed writer can
    leave half-written: that one is skipped with a warning.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (no metrics logged in {path.parent}?)") from None
    lines = data.split(b"\n")
    last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8", errors="replace"))
            if not isinstance(rec, dict):
                raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
            step = rec.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                raise ValueError(f"'step' is {step!r}, not an integer")
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            if i == last:
                if warn:
                    warnings.warn(f"{path}:{i + 1}: skipping truncated last line ({e})", stacklevel=3)
                return
            snippet = raw[:80].decode("utf-8", errors="replace")
            raise ValueError(f"{path}:{i + 1}: corrupt metrics line ({e}): {snippet!r}") from None
        yield i + 1, raw, {k: _decode(v) for k, v in rec.items()}


def read_metrics(run_dir) -> list[dict]:
    """All records of RUN/metrics.jsonl (or of the .jsonl file `run_dir` names), in file order.

    Non-finite values come back as floats. ValueError when the file is missing or a line other than the last is
    corrupt (the message names file:line); a corrupt last line is skipped with a warning.
    """
    return [rec for _, _, rec in _records(_metrics_path(run_dir))]


# ----------------------------------------------------------------------------- writing


def truncate_after(run_dir, step: int) -> int:
    """Atomically rewrite RUN/metrics.jsonl keeping only the records with step <= `step`; returns how many.

    Call it when resuming from the checkpoint of `step`, before opening a MetricsWriter on the run (or pass
    `resume_step` to MetricsWriter, which does both). A half-written last line is dropped too. No-op (returns 0)
    when the run has no metrics.jsonl yet.
    """
    step = operator.index(step)
    path = _metrics_path(run_dir)
    if not path.exists():
        return 0
    kept = [raw for _, raw, rec in _records(path, warn=False) if rec["step"] <= step]
    atomic_write(path, lambda f: f.write(b"".join(raw + b"\n" for raw in kept)))
    return len(kept)


def _drop_partial_tail(path: Path) -> None:
    """Cut a half-written last line (no trailing newline) off `path`, so appended lines start on a line of their own."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos, keep = end, 0
        while pos > 0:  # scan back in chunks for the last newline
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        f.truncate(keep)
    warnings.warn(f"{path}: dropped a half-written last line ({end - keep} bytes) before appending", stacklevel=3)


class _DropNanWarning(logging.Filter):
    """tensorboardX logs a warning for every non-finite scalar; metrics.jsonl already records those."""

    def filter(self, record):
        return "NaN or Inf" not in record.getMessage()


_NAN_FILTER = _DropNanWarning()


class MetricsWriter:
    """Appends one record per logged step to RUN/metrics.jsonl and the same scalars to RUN/tensorboard/.

    run_dir: the run directory (created if missing). tensorboard: also write TensorBoard event files (needs
    tensorboardX). resume_step: when resuming from the checkpoint of that step, first drop the records after it
    (`truncate_after`) and have TensorBoard hide its events after it. tb_flush_secs: how often TensorBoard events
    are flushed to disk (metrics.jsonl is flushed every line).

    Use as a context manager, or call close() (idempotent). Per-layer lists are written to TensorBoard as
    `KEY/layer_{i}`; strings and None only go to metrics.jsonl.
    """

    def __init__(
        self, run_dir, tensorboard: bool = True, *, resume_step: int | None = None, tb_flush_secs: float = 10.0
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            truncate_after(self.run_dir, resume_step)
        _drop_partial_tail(self.path)
        self._tb = None
        if tensorboard:
            logging.getLogger("tensorboardX.x2num").addFilter(_NAN_FILTER)  # added once
            purge = None if resume_step is None else operator.index(resume_step) + 1
            # tensorboardX names event files by the second they were opened and opens them with "wb": the suffix
            # keeps a writer opened in the same second as an earlier one from overwriting its file, and sorts after it
            self._tb = SummaryWriter(
                logdir=str(self.run_dir / TENSORBOARD_DIR),
                purge_step=purge,
                flush_secs=tb_flush_secs,
                filename_suffix=f".{time.time_ns()}",
            )
        self._file = open(self.path, "a", encoding="utf-8")
        self._closed = False

    def write(self, step: int, metrics: Mapping) -> dict:
        """Log `metrics` for `step`; returns the record as written to metrics.jsonl (non-finite as strings)."""
        if self._closed:
            raise ValueError(f"{self.path}: MetricsWriter is closed")
        step = operator.index(step)
        now = time.time()
        record = {"step": step, "time": now}
        for k, v in metrics.items():
            k = str(k)
            if k in _RESERVED:
                raise ValueError(f"metric name {k!r} is reserved (metrics.jsonl sets 'step' and 'time' itself)")
            record[k] = _encode(k, v)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k in _RESERVED or v is None or isinstance(v, str) and v not in _TO_FLOAT:
                    continue
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        self._tb.add_scalar(f"{k}/layer_{i}", float(_decode(x)), step, walltime=now)
                else:
                    self._tb.add_scalar(k, float(_decode(v)), step, walltime=now)
        return record

    def flush(self) -> None:
        if not self._closed:
            self._file.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._file.close()
        finally:
            if self._tb is not None:
                self._tb.close()
                self._tb = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- plot and summary


def _by_step(records: list[dict]) -> list[dict]:
    """One record per step (the last one written wins), in step order."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def _layers(records: list[dict], key: str = "load_imbalance") -> np.ndarray | None:
    """(records, layers) float64, NaN-padded when the layer count varies; None if no record has a list there."""
    rows = [r.get(key) if isinstance(r.get(key), list) else [] for r in records]
    width = max(map(len, rows), default=0)
    if width == 0:
        return None
    out = np.full((len(records), width), np.nan)
    for i, row in enumerate(rows):
        for j, x in enumerate(row):
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                out[i, j] = x
    return out


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.45", fontsize=10)


def _panel(
    ax, records, steps, keys: list[tuple[str, str]], title: str, *, ylabel: str = "", logy: bool = False
) -> bool:
    """Lines for the (key, label) pairs that were logged; a note when none was. True if anything was drawn."""
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel("step")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    drawn, flagged, finite_all = False, False, []
    for key, label in keys:
        raw = _nonfinite_aware(records, key)
        if raw is None:
            continue
        values, bad = raw
        (ln,) = ax.plot(
            steps, values, marker="." if len(steps) < 50 else None, markersize=3, linewidth=1.2, label=label
        )
        if bad.any():
            flagged = True
            ax.plot(
                steps[bad],
                np.full(int(bad.sum()), 0.97),
                "x",
                color=ln.get_color(),
                markersize=5,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
            )
        finite_all.append(values[np.isfinite(values)])
        drawn = True
    if not drawn:
        _note(ax, f"no {' / '.join(k for k, _ in keys)} logged")
        return False
    if flagged:
        ax.set_title(f"{title}  (x: NaN/Inf)", fontsize=10, loc="left")
    vals = np.concatenate(finite_all)
    if logy and vals.size and (vals > 0).all():
        ax.set_yscale("log")
    if len(keys) > 1:
        ax.legend(fontsize=8)
    return True


def _nonfinite_aware(records, key) -> tuple[np.ndarray, np.ndarray] | None:
    """(values with NaN where missing or non-finite, mask of steps logged as NaN/Inf); None if never logged."""
    if not any(key in r for r in records):
        return None
    values = np.full(len(records), np.nan)
    bad = np.zeros(len(records), bool)
    for i, r in enumerate(records):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if math.isfinite(v):
                values[i] = v
            else:
                bad[i] = True
    return values, bad


def plot(run_dir, out=None) -> Path:
    """Draw loss, balance loss, grad norm/lr, tokens/s, per-layer load imbalance and MFU vs step to a PNG.

    Default output RUN/metrics.png, written atomically. Panels whose metrics were never logged carry a note.
    ValueError (naming the file) when there is no metrics.jsonl or it holds no records.
    """
    path = _metrics_path(run_dir)
    records = _by_step(read_metrics(path))
    if not records:
        raise ValueError(f"{path}: no metrics records to plot")
    out = Path(out) if out is not None else path.parent / PLOT_FILE
    steps = np.array([r["step"] for r in records], dtype=np.int64)

    fig = Figure(figsize=(14, 11), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2)
    fig.suptitle(summary(path), fontsize=11)

    _panel(axes[0, 0], records, steps, [("loss", "total"), ("ce_loss", "CE"), ("mtp_loss", "MTP")], "loss")
    _panel(axes[0, 1], records, steps, [("balance_loss", "balance loss")], "balance loss")

    ax = axes[1, 0]
    has_grad = _panel(
        ax, records, steps, [("grad_norm", "grad norm")], "grad norm and learning rate", ylabel="grad norm", logy=True
    )
    lr = _nonfinite_aware(records, "lr")
    if lr is not None:
        if not has_grad:
            ax.texts[-1].remove()  # the "no grad_norm logged" note: the lr line fills the panel
            ax.set_ylabel("")
        ax2 = ax.twinx()
        ax2.plot(
            steps,
            lr[0],
            color="tab:orange",
            linewidth=1.2,
            marker="." if len(steps) < 50 else None,
            markersize=3,
            label="lr",
        )
        ax2.set_ylabel("learning rate", color="tab:orange")
        ax2.tick_params(axis="y", colors="tab:orange")
        ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))

    _panel(axes[1, 1], records, steps, [("tokens_per_s", "tokens/s")], "throughput", ylabel="tokens/s")

    ax = axes[2, 0]
    ax.set_title("load imbalance per MoE layer (max / mean expert load)", fontsize=10, loc="left")
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    imb = _layers(records)
    if imb is None:
        _note(ax, "no load_imbalance logged")
    else:
        n = imb.shape[1]
        cmap, norm = colormaps["viridis"], Normalize(0, max(n - 1, 1))
        for j in range(n):
            ax.plot(
                steps,
                np.where(np.isfinite(imb[:, j]), imb[:, j], np.nan),
                color=cmap(norm(j)),
                linewidth=1,
                marker="." if len(steps) < 50 else None,
                markersize=3,
                label=f"layer {j}",
            )
        ax.axhline(1.0, color="0.5", linestyle="--", linewidth=0.8)
        if n <= 12:
            ax.legend(fontsize=7, ncols=2 if n > 6 else 1)
        else:
            cb = fig.colorbar(
                ScalarMappable(norm=norm, cmap=cmap),
                ax=ax,
                pad=0.01,
                fraction=0.04,
                label="layer (MTP last when present)",
            )
            cb.locator = MaxNLocator(integer=True)
            cb.update_ticks()

    if any("mfu" in r for r in records) or not any("tflops_per_device" in r for r in records):
        _panel(axes[2, 1], records, steps, [("mfu", "MFU")], "model FLOPs utilization", ylabel="MFU")
    else:
        _panel(axes[2, 1], records, steps, [("tflops_per_device", "TFLOP/s per device")], "TFLOP/s per device")
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=90))
    return out


def summary(run_dir) -> str:
    """One line: steps logged, first -> last loss, mean tokens/s (without the first record, which includes
    compilation, when there are more), skipped steps when any. ValueError when there is no metrics.jsonl."""
    path = _metrics_path(run_dir)
    records = _by_step(read_metrics(path))
    name = path.parent.name or str(path.parent)
    if not records:
        return f"{name}: no steps logged"
    first, last = records[0]["step"], records[-1]["step"]
    parts = [f"{name}: {len(records)} steps logged ({first}..{last})"]
    loss = [v for r in records if isinstance(v := r.get("loss"), (int, float)) and not isinstance(v, bool)]
    if loss:
        parts.append(f"loss {loss[0]:.4g} -> {loss[-1]:.4g}")
    tps = _nonfinite_aware(records, "tokens_per_s")
    if tps is not None:
        vals = tps[0][1:] if len(records) > 1 else tps[0]
        vals = vals[np.isfinite(vals)]
        if vals.size:
            parts.append(f"mean {vals.mean():,.0f} tokens/s")
    skipped = records[-1].get("skipped_steps")
    if isinstance(skipped, (int, float)) and skipped:
        parts.append(f"{skipped:g} skipped steps")
    return ", ".join(parts)
