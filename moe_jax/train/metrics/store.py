"""A run's metrics files, and reading them: RUN/metrics.jsonl (the record) and RUN/expert_loads.bin (full
per-expert loads); `truncate_after` cuts both back to a step when a run resumes. MetricsWriter
(moe_jax.train.metrics.writer) writes them.

    read_metrics(run_dir) -> [{"step": 1, "time": 1.7e9, "loss": 11.0, ...}, ...]
    read_expert_loads(run_dir) -> ExpertLoads(steps [N], load [N, layers, E], bias [N, layers, E], ...)

metrics.jsonl holds one JSON object per logged step: `step`, `time` (unix seconds), then the metrics in the
order given. Scalars are written as JSON numbers (ints stay ints), lists (`load_imbalance`: max/mean expert
load per MoE layer, MTP layer last; `ep_overflow`: further rounds each layer's expert-parallel exchange took,
moe_jax.parallel.ep) as lists of numbers, strings and None as they are.

Non-finite floats are written as the JSON strings "NaN", "Infinity" and "-Infinity" (the spellings of
JavaScript and of Python's json module), so every line is strict JSON and NaN stays distinguishable from Inf.
`read_metrics` turns those strings back into floats.

Each line is flushed as it is written: a killed run keeps every step logged so far, except possibly a
partial last line, which `read_metrics` skips with a warning and `MetricsWriter` cuts off before appending.

RUN/expert_loads.bin, the full loads and biases of some steps (which: MetricsWriter). Layout: one JSON header
line (UTF-8, padded with spaces to a multiple of 64 bytes including its newline):
    {"format": "moe-jax expert loads", "version": 1, "layers": L, "experts": E, "experts_per_token": k,
     "layer_names": [...], "record": [["step", "<i8"], ["load", "<f4", [L, E]], ["bias", "<f4", [L, E]]]}
then fixed-size records, a packed little-endian numpy structured array of that `record` dtype:
    int64 step, float32 load[L][E] (tokens per expert), float32 bias[L][E] (NaN when no bias was given)
= 8 + 8 L E bytes each (DeepSeek-V3, 58 MoE layers + 1 MTP x 256 experts: 120,840 bytes). Numpy reads it with
`np.fromfile(path, dtype, offset=header_bytes)`; `read_expert_loads` does. The header is written atomically when
the file is created; records are appended and flushed one by one, so a killed run can leave only a partial last
record, which `read_expert_loads` drops with a warning and `MetricsWriter` cuts off before appending.
`truncate_after` (resume) keeps the records with step <= the resume step, as for metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import operator
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from moe_jax.files import atomic_write

METRICS_FILE = "metrics.jsonl"
LOADS_FILE = "expert_loads.bin"
LOADS_FORMAT = "moe-jax expert loads"
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}  # their spellings in metrics.jsonl


# ----------------------------------------------------------------------------- encoding


def _encode_float(x, short: bool = False) -> float | str:
    """A float, or its non-finite spelling. short: x came from a <= 32-bit float; write its shortest float32
    repr (7.3333335, not 7.333333492279053), which reads back as the same float32."""
    x = float(x)
    if math.isfinite(x):
        return float(str(np.float32(x))) if short else x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def encode(key: str, v):
    """A metric value as JSON-ready data: int, float, "NaN"/"Infinity"/"-Infinity", str, None, or a list."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, (bool, np.bool_, int, np.integer)):
        return int(v)
    if isinstance(v, (list, tuple)):
        return [encode(key, x) if isinstance(x, (int, np.integer)) else _encode_float(x, _short(x)) for x in v]
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


def decode(v):
    if isinstance(v, str):
        return NON_FINITE.get(v, v)
    if isinstance(v, list):
        return [decode(x) for x in v]
    return v


# ----------------------------------------------------------------------------- reading


def metrics_path(run_dir) -> Path:
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
        yield i + 1, raw, {k: decode(v) for k, v in rec.items()}


def read_metrics(run_dir) -> list[dict]:
    """All records of RUN/metrics.jsonl (or of the .jsonl file `run_dir` names), in file order.

    Non-finite values come back as floats. ValueError when the file is missing or a line other than the last is
    corrupt (the message names file:line); a corrupt last line is skipped with a warning.
    """
    return [rec for _, _, rec in _records(metrics_path(run_dir))]


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


def loads_path(run_dir) -> Path:
    return metrics_path(run_dir).parent / LOADS_FILE


def _record_dtype(layers: int, experts: int) -> np.dtype:
    return np.dtype([("step", "<i8"), ("load", "<f4", (layers, experts)), ("bias", "<f4", (layers, experts))])


def loads_header(layers: int, experts: int, experts_per_token: int, layer_names: list[str]) -> bytes:
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


def read_loads_header(path: Path) -> tuple[dict, int, np.dtype]:
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


def full_records(path: Path, warn: bool = True) -> tuple[dict, int, np.dtype, int]:
    """(header, header bytes, record dtype, number of whole records); warns when a partial record trails them."""
    head, offset, dtype = read_loads_header(path)
    body = path.stat().st_size - offset
    n, extra = divmod(body, dtype.itemsize)
    if extra and warn:
        warnings.warn(f"{path}: skipping a partial last record ({extra} of {dtype.itemsize} bytes)", stacklevel=3)
    return head, offset, dtype, n


def read_expert_loads(run_dir) -> ExpertLoads:
    """The full per-expert loads and router biases stored in RUN/expert_loads.bin (beside the metrics.jsonl that
    `run_dir` names), in file order. A partial last record (a killed run) is skipped with a warning. ValueError
    when the file is missing or its header is not one."""
    path = loads_path(run_dir)
    if not path.exists():
        raise ValueError(f"{path}: no such file (no expert loads stored in {path.parent}?)")
    head, offset, dtype, n = full_records(path)
    recs = np.fromfile(path, dtype=dtype, count=n, offset=offset)
    return ExpertLoads(
        recs["step"].astype(np.int64),
        recs["load"],
        recs["bias"],
        head["experts_per_token"],
        head["layer_names"],
    )


# ----------------------------------------------------------------------------- truncation (resume)


def truncate_after(run_dir, step: int) -> int:
    """Atomically rewrite RUN/metrics.jsonl keeping only the records with step <= `step`; returns how many.

    RUN/expert_loads.bin (beside it) is cut the same way: its records with step <= `step` are kept (the file is
    removed when none is). Call it when resuming from the checkpoint of `step`, before opening a MetricsWriter on
    the run (or pass `resume_step` to MetricsWriter, which does both). A half-written last line (record) is dropped
    too. No-op (returns 0) when the run has no metrics.jsonl yet.
    """
    step = operator.index(step)
    _truncate_loads(loads_path(run_dir), step)
    path = metrics_path(run_dir)
    if not path.exists():
        return 0
    kept = [raw for _, raw, rec in _records(path, warn=False) if rec["step"] <= step]
    atomic_write(path, lambda f: f.write(b"".join(raw + b"\n" for raw in kept)))
    return len(kept)


def _truncate_loads(path: Path, step: int) -> None:
    if not path.exists():
        return
    head, offset, dtype, n = full_records(path, warn=False)
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
