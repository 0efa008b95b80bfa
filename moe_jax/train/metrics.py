"""Per-step training metrics: RUN/metrics.jsonl (the record), RUN/expert_loads.bin (full per-expert loads),
RUN/tensorboard/ (for TensorBoard), RUN/metrics.png.

    with MetricsWriter(run_dir, resume_step=ckpt_step) as w:     # resume_step=None for a fresh run
        w.write(step, {"loss": ..., "lr": ..., "load_imbalance": [...per MoE layer...]},
                expert_load=loads, router_bias=bias, experts_per_token=8, loads_every=100)
    read_metrics(run_dir) -> [{"step": 1, "time": 1.7e9, "loss": 11.0, ...}, ...]
    read_expert_loads(run_dir) -> ExpertLoads(steps [N], load [N, layers, E], bias [N, layers, E], ...)
    plot(run_dir) -> RUN/metrics.png        summary(run_dir) -> one line for the CLI

metrics.jsonl holds one JSON object per logged step: `step`, `time` (unix seconds), then the metrics in the
order given. Scalars are written as JSON numbers (ints stay ints), lists (`load_imbalance`: max/mean expert
load per MoE layer, MTP layer last; `ep_overflow`: further rounds each layer's expert-parallel exchange took,
moe_jax.parallel.ep) as lists of numbers, strings and None as they are.

Non-finite floats are written as the JSON strings "NaN", "Infinity" and "-Infinity" (the spellings of
JavaScript and of Python's json module), so every line is strict JSON and NaN stays distinguishable from Inf.
`read_metrics` turns those strings back into floats.

Each line is flushed as it is written: a killed run keeps every step logged so far, except possibly a
partial last line, which `read_metrics` skips with a warning and `MetricsWriter` cuts off before appending.
TensorBoard events are flushed every `tb_flush_secs` and on close.

Expert loads. `write(..., expert_load=[layers, E], router_bias=[layers, E])`: the tokens routed to each expert in
the step and the router correction bias after the step's update; rows are the MoE layers in order, then the MTP
layers (the row order of `load_imbalance`; `layer_names` names them for the plot, e.g. "layer 3", "MTP 0").

- metrics.jsonl, every logged step, four more per-layer lists (one number per row), from which a collapse reads
  at once:
    expert_max_share   the busiest expert's share of the step's tokens: its load / tokens, where tokens = sum of
                       the layer's loads / experts_per_token. experts_per_token / E when perfectly balanced; 1.0
                       when every token went to that expert. Rounded to 4 decimals.
    experts_idle       how many experts received no token.
    router_bias_min,   the smallest and largest correction bias (5 significant digits); max - min is the spread
    router_bias_max    that the bias update needed (it grows by 2 * gamma a step while a layer stays unbalanced).
- RUN/expert_loads.bin, the full loads and biases, at the first written step and then at the first written step
  of every further `loads_every` steps (`loads_every=1`: every written step). Layout: one JSON header line (UTF-8,
  padded with spaces to a multiple of 64 bytes including its newline):
    {"format": "moe-jax expert loads", "version": 1, "layers": L, "experts": E, "experts_per_token": k,
     "layer_names": [...], "record": [["step", "<i8"], ["load", "<f4", [L, E]], ["bias", "<f4", [L, E]]]}
  then fixed-size records, a packed little-endian numpy structured array of that `record` dtype:
    int64 step, float32 load[L][E] (tokens per expert), float32 bias[L][E] (NaN when no bias was given)
  = 8 + 8 L E bytes each (DeepSeek-V3, 58 MoE layers + 1 MTP x 256 experts: 120,840 bytes). Numpy reads it with
  `np.fromfile(path, dtype, offset=header_bytes)`; `read_expert_loads` does. The header is written atomically when
  the file is created; records are appended and flushed one by one, so a killed run can leave only a partial last
  record, which `read_expert_loads` drops with a warning and `MetricsWriter` cuts off before appending.
  `truncate_after` (resume) keeps the records with step <= the resume step, as for metrics.jsonl.
- TensorBoard, at the same cadence as expert_loads.bin: histograms `expert_load/layer_{i}` (tokens per expert) and
  `router_bias/layer_{i}` per row i (HISTOGRAM_BINS equal-width bins, ~0.6 KB each), and the four lists above as
  scalars `KEY/layer_{i}` (at that cadence only, unlike other lists: 4 x 59 tags a step would dominate the events).
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, Self

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize, PowerNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator
from tensorboardX import SummaryWriter

from moe_jax.files import atomic_write

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "metrics.png"
LOADS_FILE = "expert_loads.bin"
LOADS_FORMAT = "moe-jax expert loads"
LAYER_STATS = ("expert_max_share", "experts_idle", "router_bias_min", "router_bias_max")
HISTOGRAM_BINS = 32  # equal-width bins of the TensorBoard histograms (tensorboardX's default 1549 take ~6 KB each)
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


class ExpertLoads(NamedTuple):
    """The contents of RUN/expert_loads.bin, records in file order."""

    steps: np.ndarray  # [N] int64
    load: np.ndarray  # [N, layers, E] float32: tokens routed to each expert in that step
    bias: np.ndarray  # [N, layers, E] float32: router correction bias after the step's update (NaN: not given)
    experts_per_token: int
    layer_names: list[str]  # one per row: the MoE layers in order, then the MTP layers

    @property
    def share(self) -> np.ndarray:
        """[N, layers, E] float64: each expert's share of the step's tokens (1.0: every token went to it)."""
        return self.share_of(slice(None))

    def share_of(self, layer) -> np.ndarray:
        """`share` of one row: [N, E] (or of the rows a slice selects)."""
        load = self.load[:, layer]
        tokens = load.sum(-1, keepdims=True, dtype=np.float64) / self.experts_per_token
        return np.divide(load, tokens, out=np.zeros(load.shape), where=tokens > 0)

    @property
    def busiest(self) -> np.ndarray:
        """[N, layers] float64: the busiest expert's share of the step's tokens (metrics.jsonl's expert_max_share)."""
        tokens = self.load.sum(-1, dtype=np.float64) / self.experts_per_token
        return np.divide(self.load.max(-1), tokens, out=np.zeros(tokens.shape), where=tokens > 0)


def _loads_path(run_dir) -> Path:
    return _metrics_path(run_dir).parent / LOADS_FILE


def _record_dtype(layers: int, experts: int) -> np.dtype:
    return np.dtype([("step", "<i8"), ("load", "<f4", (layers, experts)), ("bias", "<f4", (layers, experts))])


def _loads_header(layers: int, experts: int, experts_per_token: int, layer_names: list[str]) -> bytes:
    """The header line of a new expert_loads.bin, padded with spaces to a multiple of 64 bytes."""
    head = {
        "format": LOADS_FORMAT,
        "version": 1,
        "layers": layers,
        "experts": experts,
        "experts_per_token": experts_per_token,
        "layer_names": layer_names,
        "record": [["step", "<i8"], ["load", "<f4", [layers, experts]], ["bias", "<f4", [layers, experts]]],
    }
    line = json.dumps(head).encode()
    return line + b" " * (-(len(line) + 1) % 64) + b"\n"


def _read_loads_header(path: Path) -> tuple[dict, int, np.dtype]:
    """(header, its length in bytes, the record dtype) of an expert_loads.bin; ValueError naming the file."""
    with open(path, "rb") as f:
        line = f.readline(1 << 22)
    try:
        if not line.endswith(b"\n"):
            raise ValueError("no header line")
        head = json.loads(line)
        if not isinstance(head, dict) or head.get("format") != LOADS_FORMAT or head.get("version") != 1:
            raise ValueError(f"not a version-1 {LOADS_FORMAT!r} file")
        layers, experts, k = (operator.index(head[key]) for key in ("layers", "experts", "experts_per_token"))
        names = [str(n) for n in head.get("layer_names") or []]
        head["layer_names"] = names if len(names) == layers else [f"layer {i}" for i in range(layers)]
        if layers < 0 or experts < 1 or k < 1:
            raise ValueError(f"bad sizes: {layers} layers, {experts} experts, {k} experts per token")
    except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: corrupt expert-loads header ({e})") from None
    return head, len(line), _record_dtype(layers, experts)


def _full_records(path: Path, warn: bool = True) -> tuple[dict, int, np.dtype, int]:
    """(header, header bytes, record dtype, number of whole records); warns when a partial record trails them."""
    head, offset, dtype = _read_loads_header(path)
    body = path.stat().st_size - offset
    n, extra = divmod(body, dtype.itemsize)
    if extra and warn:
        warnings.warn(f"{path}: skipping a partial last record ({extra} of {dtype.itemsize} bytes)", stacklevel=3)
    return head, offset, dtype, n


def read_expert_loads(run_dir) -> ExpertLoads:
    """The full per-expert loads and router biases stored in RUN/expert_loads.bin (beside the metrics.jsonl that
    `run_dir` names), in file order. A partial last record (a killed run) is skipped with a warning. ValueError
    when the file is missing or its header is not one."""
    path = _loads_path(run_dir)
    if not path.exists():
        raise ValueError(f"{path}: no such file (no expert loads stored in {path.parent}?)")
    head, offset, dtype, n = _full_records(path)
    recs = np.fromfile(path, dtype=dtype, count=n, offset=offset)
    return ExpertLoads(
        recs["step"].astype(np.int64),
        recs["load"],
        recs["bias"],
        head["experts_per_token"],
        head["layer_names"],
    )


def _maybe_loads(path: Path) -> ExpertLoads | None:
    """read_expert_loads, or None when there is no file (or no record); duplicates of a step: the last wins."""
    if not _loads_path(path).exists():
        return None
    loads = read_expert_loads(path)
    if not loads.steps.size:
        return None
    _, last = np.unique(loads.steps[::-1], return_index=True)  # sorted steps; index of each one's last record
    keep = len(loads.steps) - 1 - last
    return loads._replace(steps=loads.steps[keep], load=loads.load[keep], bias=loads.bias[keep])


# ----------------------------------------------------------------------------- writing


def truncate_after(run_dir, step: int) -> int:
    """Atomically rewrite RUN/metrics.jsonl keeping only the records with step <= `step`; returns how many.

    RUN/expert_loads.bin (beside it) is cut the same way: its records with step <= `step` are kept (the file is
    removed when none is). Call it when resuming from the checkpoint of `step`, before opening a MetricsWriter on
    the run (or pass `resume_step` to MetricsWriter, which does both). A half-written last line (record) is dropped
    too. No-op (returns 0) when the run has no metrics.jsonl yet.
    """
    step = operator.index(step)
    _truncate_loads(_loads_path(run_dir), step)
    path = _metrics_path(run_dir)
    if not path.exists():
        return 0
    kept = [raw for _, raw, rec in _records(path, warn=False) if rec["step"] <= step]
    atomic_write(path, lambda f: f.write(b"".join(raw + b"\n" for raw in kept)))
    return len(kept)


def _truncate_loads(path: Path, step: int) -> None:
    if not path.exists():
        return
    head, offset, dtype, n = _full_records(path, warn=False)
    recs = np.fromfile(path, dtype=dtype, count=n, offset=offset)
    keep = recs["step"] <= step
    if not keep.any():
        path.unlink()
        return
    if keep.all() and path.stat().st_size == offset + n * dtype.itemsize:
        return
    with open(path, "rb") as f:
        header = f.read(offset)
    atomic_write(path, lambda f: (f.write(header), f.write(recs[keep].tobytes())))


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


def _sig(x, digits: int = 5) -> float:
    return float(f"{float(x):.{digits}g}")


def layer_stats(expert_load, router_bias=None, experts_per_token: int = 1) -> dict[str, list]:
    """The per-layer lists `write` adds to metrics.jsonl (see the module docstring) for loads [layers, E] and
    biases [layers, E] (None: no router_bias_* lists)."""
    load = np.asarray(expert_load, np.float64)
    tokens = load.sum(-1) / experts_per_token
    busiest = np.divide(load.max(-1), tokens, out=np.zeros(len(load)), where=tokens > 0)
    out = {
        "expert_max_share": [round(float(x), 4) for x in busiest],
        "experts_idle": [int(x) for x in (load == 0).sum(-1)],
    }
    if router_bias is not None:
        bias = np.asarray(router_bias, np.float64)
        out["router_bias_min"] = [_sig(x) for x in bias.min(-1)]
        out["router_bias_max"] = [_sig(x) for x in bias.max(-1)]
    return out


class MetricsWriter:
    """Appends one record per logged step to RUN/metrics.jsonl and the same scalars to RUN/tensorboard/; with
    expert loads, also per-layer load and bias statistics, RUN/expert_loads.bin and TensorBoard histograms.

    run_dir: the run directory (created if missing). tensorboard: also write TensorBoard event files (needs
    tensorboardX). resume_step: when resuming from the checkpoint of that step, first drop the records after it
    in metrics.jsonl and expert_loads.bin (`truncate_after`) and have TensorBoard hide its events after it.
    tb_flush_secs: how often TensorBoard events are flushed to disk (the other files are flushed every record).

    Use as a context manager, or call close() (idempotent). Per-layer lists are written to TensorBoard as
    `KEY/layer_{i}`; strings and None only go to metrics.jsonl.
    """

    def __init__(
        self, run_dir, tensorboard: bool = True, *, resume_step: int | None = None, tb_flush_secs: float = 10.0
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.loads_path = self.run_dir / LOADS_FILE
        if resume_step is not None:
            truncate_after(self.run_dir, resume_step)
        _drop_partial_tail(self.path)
        self._loads_file = None
        self._loads_shape: tuple[int, int] | None = None
        self._loads_dtype: np.dtype | None = None
        self._loads_last: int | None = None  # the last step stored in expert_loads.bin
        if self.loads_path.exists():
            self._open_loads()
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

    def _open_loads(self) -> None:
        """Open the existing expert_loads.bin for appending, cutting off a partial last record first."""
        head, offset, dtype, n = _full_records(self.loads_path, warn=False)
        end = offset + n * dtype.itemsize
        size = self.loads_path.stat().st_size
        if size != end:
            os.truncate(self.loads_path, end)
            warnings.warn(
                f"{self.loads_path}: dropped a partial last record ({size - end} bytes) before appending", stacklevel=3
            )
        if n:
            self._loads_last = int(
                np.fromfile(self.loads_path, dtype=dtype, count=1, offset=end - dtype.itemsize)[0][0]
            )
        self._loads_shape, self._loads_dtype = (head["layers"], head["experts"]), dtype
        self._loads_file = open(self.loads_path, "ab")

    def write(
        self,
        step: int,
        metrics: Mapping,
        *,
        expert_load=None,
        router_bias=None,
        experts_per_token: int = 1,
        layer_names: Sequence[str] | None = None,
        loads_every: int = 1,
    ) -> dict:
        """Log `metrics` for `step`; returns the record as written to metrics.jsonl (non-finite as strings).

        expert_load [layers, E] (tokens routed to each expert in this step) and router_bias [layers, E] (the
        correction bias after the step's update; optional): add the per-layer statistics `layer_stats` to the
        record, and store both in expert_loads.bin, with TensorBoard histograms, when this is the first step
        written (with loads) or the first in a new window of `loads_every` steps (step // loads_every grew; 1:
        every step). experts_per_token: the model's top-k (expert_max_share is a share of tokens, not of the k
        slots per token). layer_names: one per row, recorded when expert_loads.bin is created (for the plot).
        """
        if self._closed:
            raise ValueError(f"{self.path}: MetricsWriter is closed")
        step, every = operator.index(step), operator.index(loads_every)
        if every < 1:
            raise ValueError(f"loads_every must be >= 1, got {every}")
        now = time.time()
        record = {"step": step, "time": now}
        for k, v in metrics.items():
            k = str(k)
            if k in _RESERVED:
                raise ValueError(f"metric name {k!r} is reserved (metrics.jsonl sets 'step' and 'time' itself)")
            record[k] = _encode(k, v)
        load, bias = self._loads(expert_load, router_bias)
        if load is not None:  # every check before anything is written
            if self._loads_shape is not None and load.shape != self._loads_shape:
                raise ValueError(
                    f"{self.loads_path}: holds loads of {self._loads_shape[0]} layers x {self._loads_shape[1]} "
                    f"experts; got {load.shape[0]} x {load.shape[1]} (a different model: use another run_dir)"
                )
            if layer_names is not None and len(layer_names) != len(load):
                raise ValueError(f"layer_names: {len(layer_names)} names for {len(load)} layers")
            if operator.index(experts_per_token) < 1:
                raise ValueError(f"experts_per_token must be >= 1, got {experts_per_token}")
            for k, v in layer_stats(load, bias, experts_per_token).items():
                if k in record:
                    raise ValueError(f"metric name {k!r} is reserved (computed from expert_load)")
                record[k] = v
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        store = load is not None and (self._loads_last is None or step // every > self._loads_last // every)
        if store:
            self._store_loads(step, load, bias, experts_per_token, layer_names)
        if self._tb is not None:
            for k, v in record.items():
                if k in _RESERVED or v is None or isinstance(v, str) and v not in _TO_FLOAT:
                    continue
                if k in LAYER_STATS and not store:
                    continue  # (bounded: DeepSeek-V3 has 59 rows of each, at the cadence of expert_loads.bin)
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        self._tb.add_scalar(f"{k}/layer_{i}", float(_decode(x)), step, walltime=now)
                else:
                    self._tb.add_scalar(k, float(_decode(v)), step, walltime=now)
            if store:
                for key, table in (("expert_load", load), ("router_bias", bias)):
                    for i, row in enumerate(table if table is not None else []):
                        row = row[np.isfinite(row)]
                        if row.size:
                            self._tb.add_histogram(f"{key}/layer_{i}", row, step, bins=HISTOGRAM_BINS, walltime=now)
        return record

    @staticmethod
    def _loads(expert_load, router_bias) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(loads, biases) as float32 [layers, E], or None for what was not given (or has no layer)."""
        if expert_load is None:
            return None, None
        load = np.asarray(expert_load, np.float32)
        if load.ndim != 2:
            raise ValueError(f"expert_load: expected [layers, experts], got shape {load.shape}")
        if load.shape[0] == 0:
            return None, None  # a model without MoE layers
        if router_bias is None or np.size(router_bias) == 0:
            return load, None
        bias = np.asarray(router_bias, np.float32)
        if bias.shape != load.shape:
            raise ValueError(f"router_bias: shape {bias.shape} differs from expert_load's {load.shape}")
        return load, bias

    def _store_loads(self, step: int, load: np.ndarray, bias: np.ndarray | None, k: int, names) -> None:
        if self._loads_file is None:
            layers, experts = load.shape
            names = [str(n) for n in names] if names is not None else [f"layer {i}" for i in range(layers)]
            atomic_write(self.loads_path, _loads_header(layers, experts, operator.index(k), names))
            self._open_loads()
        rec = np.zeros((), self._loads_dtype)
        rec["step"], rec["load"], rec["bias"] = step, load, np.nan if bias is None else bias
        self._loads_file.write(rec.tobytes())
        self._loads_file.flush()
        self._loads_last = step

    def flush(self) -> None:
        if not self._closed:
            self._file.flush()
            if self._loads_file is not None:
                self._loads_file.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._file.close()
            if self._loads_file is not None:
                self._loads_file.close()
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


HEATMAP_LAYERS = 8  # heat maps drawn at most: every layer when there are no more, else the most imbalanced
MAP_COLUMNS = 1200  # steps drawn at most across a map; more are grouped (max for the per-layer maps, mean per expert)
_SHARE_NORM = PowerNorm(0.5, 0.0, 1.0)  # square-root colour scale: 1/E-sized shares stay visible next to 1.0
_SHARE_CMAP = "magma"


def figure(run_dir) -> Figure:
    """The figure `plot` saves. Its first 3 x 2 panels: loss, balance loss, grad norm/lr, tokens/s, per-layer load
    imbalance and MFU vs step. When RUN/expert_loads.bin holds records, a second section follows: two layers x steps
    maps (the busiest expert's share of tokens and the router bias spread, every logged step) and heat maps of each
    expert's share of the layer's tokens over the stored steps (experts on y), for every layer when there are at most
    HEATMAP_LAYERS, else for the HEATMAP_LAYERS with the highest mean busiest-expert share, worst first.

    ValueError (naming the file) when there is no metrics.jsonl or it holds no records.
    """
    path = _metrics_path(run_dir)
    records = _by_step(read_metrics(path))
    if not records:
        raise ValueError(f"{path}: no metrics records to plot")
    steps = np.array([r["step"] for r in records], dtype=np.int64)
    loads = _maybe_loads(path)
    if loads is None:
        fig = Figure(figsize=(14, 11), layout="constrained")
        top = fig
    else:
        chosen = _heat_layers(loads)
        heat_rows = math.ceil(len(chosen) / 4)
        fig = Figure(figsize=(14, 11 + 3.6 + 3.2 * heat_rows), layout="constrained")
        top, over, heats = fig.subfigures(3, 1, height_ratios=[11, 3.6, 3.2 * heat_rows])
    FigureCanvasAgg(fig)
    fig.suptitle(summary(path), fontsize=11)
    _scalar_panels(top, records, steps, loads.layer_names if loads is not None else [])
    if loads is not None:
        _overview(over, records, steps, loads)
        _heatmaps(heats, loads, chosen)
    return fig


def plot(run_dir, out=None) -> Path:
    """Draw `figure(run_dir)` to a PNG: by default RUN/metrics.png, written atomically. Panels whose metrics were
    never logged carry a note. ValueError (naming the file) when there is no metrics.jsonl or it holds no records.
    """
    fig = figure(run_dir)
    out = Path(out) if out is not None else _metrics_path(run_dir).parent / PLOT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=90))
    return out


def _scalar_panels(fig, records: list[dict], steps: np.ndarray, names: Sequence[str]) -> None:
    axes = fig.subplots(3, 2)

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
                label=_label(names, j),
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
                label="row: MoE layers in order, MTP last",
            )
            cb.locator = MaxNLocator(integer=True)
            cb.update_ticks()

    if any("mfu" in r for r in records) or not any("tflops_per_device" in r for r in records):
        _panel(axes[2, 1], records, steps, [("mfu", "MFU")], "model FLOPs utilization", ylabel="MFU")
    else:
        _panel(axes[2, 1], records, steps, [("tflops_per_device", "TFLOP/s per device")], "TFLOP/s per device")
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _label(names: Sequence[str], i: int) -> str:
    """A row's name for titles: its layer name, with the row index (the index of metrics.jsonl's lists and of the
    TensorBoard tags) when the two differ."""
    name = names[i] if i < len(names) else f"layer {i}"
    return name if name == f"layer {i}" else f"{name} (row {i})"


def _heat_layers(loads: ExpertLoads) -> list[int]:
    """The rows to draw as heat maps: all when few, else the HEATMAP_LAYERS with the highest mean busiest-expert
    share over the stored steps, worst first."""
    layers = loads.load.shape[1]
    if layers <= HEATMAP_LAYERS:
        return list(range(layers))
    score = np.nan_to_num(loads.busiest.mean(0), nan=-1.0)
    return sorted(range(layers), key=lambda i: (-score[i], i))[:HEATMAP_LAYERS]


def _columns(x: np.ndarray, z: np.ndarray, how: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, z [steps, rows]) with at most MAP_COLUMNS steps: consecutive steps grouped evenly, each group drawn
    at its last step as the max (how="max", NaN ignored: a one-step collapse stays visible) or mean of its values."""
    if len(x) <= MAP_COLUMNS:
        return x, z
    starts = np.linspace(0, len(x), MAP_COLUMNS + 1).astype(np.int64)
    if how == "max":
        z = np.fmax.reduceat(z, starts[:-1], axis=0)
    else:
        z = np.add.reduceat(z, starts[:-1], axis=0) / np.diff(starts)[:, None]
    return x[starts[1:] - 1], z


def _edges(x: np.ndarray) -> np.ndarray:
    """Cell edges around the sorted steps x: halfway between neighbours, half a spacing beyond the ends (but not
    before step 0.5: the first stored step, 1, is followed by a whole loads_every gap)."""
    x = np.asarray(x, np.float64)
    if len(x) == 1:
        return np.array([x[0] - 0.5, x[0] + 0.5])
    mid = (x[1:] + x[:-1]) / 2
    first = max(x[0] - (mid[0] - x[0]), min(x[0], 1.0) - 0.5)
    return np.concatenate([[first], mid, [x[-1] + (x[-1] - mid[-1])]])


def _map(ax, x: np.ndarray, z: np.ndarray, norm, cmap, how: str, xbins: int | str = "auto"):
    """z [len(x), rows] as cells: steps on x, rows on y (row 0 at the bottom)."""
    x, z = _columns(x, z, how)
    mesh = ax.pcolormesh(_edges(x), np.arange(z.shape[1] + 1) - 0.5, z.T, norm=norm, cmap=cmap, rasterized=True)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=xbins, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(z.shape[1], 9)))
    return mesh


def _overview(fig, records: list[dict], steps: np.ndarray, loads: ExpertLoads) -> None:
    """Layers x steps: the busiest expert's share of tokens, and the router bias spread (max - min)."""
    names = loads.layer_names
    ax_share, ax_bias = fig.subplots(1, 2)
    share, x_share = _layers(records, "expert_max_share"), steps
    if share is None:  # metrics.jsonl without the statistics: the stored steps only
        share, x_share = loads.busiest, loads.steps
    lo, hi = _layers(records, "router_bias_min"), _layers(records, "router_bias_max")
    if lo is not None and hi is not None:
        spread, x_bias = hi - lo, steps
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: no bias given
            spread, x_bias = np.nanmax(loads.bias, -1) - np.nanmin(loads.bias, -1), loads.steps
    by_name = FuncFormatter(lambda y, _: names[int(y)] if float(y).is_integer() and 0 <= y < len(names) else "")
    for ax, title in (
        (ax_share, "busiest expert's share of the layer's tokens (1 = every token)"),
        (ax_bias, "router bias spread (max - min) per layer"),
    ):
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel("MoE layer (MTP last)")
    m = _map(ax_share, x_share, share, _SHARE_NORM, _SHARE_CMAP, "max")
    ax_share.yaxis.set_major_formatter(by_name)
    fig.colorbar(m, ax=ax_share, pad=0.01, fraction=0.05)
    if np.isfinite(spread).any():
        top = float(np.nanmax(spread))
        m = _map(ax_bias, x_bias, spread, Normalize(0.0, top if top > 0 else 1.0), "viridis", "max")
        ax_bias.yaxis.set_major_formatter(by_name)
        fig.colorbar(m, ax=ax_bias, pad=0.01, fraction=0.05)
    else:
        _note(ax_bias, "no router bias logged")


def _heatmaps(fig, loads: ExpertLoads, chosen: list[int]) -> None:
    """One heat map per chosen row: each expert's share of the layer's tokens at every stored step."""
    cols = min(4, len(chosen))
    axes = fig.subplots(math.ceil(len(chosen) / cols), cols, squeeze=False).ravel()
    layers, experts = loads.load.shape[1:]
    k = loads.experts_per_token
    which = "every layer" if len(chosen) == layers else f"the {len(chosen)} most imbalanced of {layers} layers"
    fig.suptitle(
        f"load per expert over time: each expert's share of the layer's tokens, {which} "
        f"(top-{k} of {experts} experts: {k / experts:.3g} when balanced)",
        fontsize=10,
    )
    busiest = loads.busiest
    for ax, i in zip(axes, chosen):
        m = _map(ax, loads.steps, loads.share_of(i), _SHARE_NORM, _SHARE_CMAP, "mean", xbins=8 // cols + 2)
        title = f"{_label(loads.layer_names, i)}: busiest {busiest[-1, i]:.0%} (peak {busiest[:, i].max():.0%})"
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("expert")
    for ax in axes[len(chosen) :]:
        ax.set_visible(False)
    fig.colorbar(m, ax=list(axes[: len(chosen)]), pad=0.01, fraction=0.03, label="share of tokens")


def summary(run_dir) -> str:
    """One line: steps logged, first -> last loss, mean tokens/s (without the first record, which includes
    compilation, when there are more), skipped steps when any, and, when expert loads were logged, the most
    imbalanced layer at the last logged step. ValueError when there is no metrics.jsonl."""
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
    overflowed = [sum(r["ep_overflow"]) for r in records if isinstance(r.get("ep_overflow"), list)]
    if any(overflowed):
        parts.append(
            f"expert-parallel buffers overflowed in {sum(map(bool, overflowed))} logged steps "
            f"({sum(overflowed)} further exchange rounds; raise model.ep_capacity to avoid them)"
        )
    worst = _worst_layer(path, records)
    if worst:
        parts.append(worst)
    return ", ".join(parts)


def _worst_layer(path: Path, records: list[dict]) -> str | None:
    """ "most imbalanced: layer 5 (row 2), busiest expert 97% of tokens, 14 of 16 experts idle" for the last record
    with expert_max_share; None when there is none."""
    logged = [r for r in records if isinstance(r.get("expert_max_share"), list)]
    if not logged:
        return None
    share = _layers(logged[-1:], "expert_max_share")[0]
    if not np.isfinite(share).any():
        return None
    i = int(np.nanargmax(share))
    names, experts = [], None
    if _loads_path(path).exists():
        try:
            head = _read_loads_header(_loads_path(path))[0]
            names, experts = head["layer_names"], head["experts"]
        except ValueError:
            pass  # plot and read_expert_loads report a damaged file; the summary line still names the row
    text = f"most imbalanced: {_label(names, i)}, busiest expert {share[i]:.0%} of tokens"
    idle = logged[-1].get("experts_idle")
    if isinstance(idle, list) and i < len(idle) and isinstance(idle[i], int) and idle[i]:
        text += f", {idle[i]} of {experts} experts idle" if experts else f", {idle[i]} experts idle"
    return text
