"""MetricsWriter writes a run's metrics as it trains: RUN/metrics.jsonl and RUN/expert_loads.bin (their formats:
moe_jax.train.metrics.store) and RUN/tensorboard/ (for TensorBoard).

    with MetricsWriter(run_dir, resume_step=ckpt_step) as w:     # resume_step=None for a fresh run
        w.write(step, {"loss": ..., "lr": ..., "load_imbalance": [...per MoE layer...]},
                expert_load=loads, router_bias=bias, experts_per_token=8, loads_every=100)

metrics.jsonl and expert_loads.bin are flushed every record; TensorBoard events every `tb_flush_secs` and on close.

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
  of every further `loads_every` steps (`loads_every=1`: every written step).
- TensorBoard, at the same cadence as expert_loads.bin: histograms `expert_load/layer_{i}` (tokens per expert) and
  `router_bias/layer_{i}` per row i (HISTOGRAM_BINS equal-width bins, ~0.6 KB each), and the four lists above as
  scalars `KEY/layer_{i}` (at that cadence only, unlike other lists: 4 x 59 tags a step would dominate the events).
"""

from __future__ import annotations

import json
import logging
import operator
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

import numpy as np

from moe_jax.files import atomic_write
from moe_jax.train.metrics.store import (
    LOADS_FILE,
    METRICS_FILE,
    NON_FINITE,
    decode,
    encode,
    full_records,
    loads_header,
    truncate_after,
)

TENSORBOARD_DIR = "tensorboard"
LAYER_STATS = ("expert_max_share", "experts_idle", "router_bias_min", "router_bias_max")
HISTOGRAM_BINS = 32  # equal-width bins of the TensorBoard histograms (tensorboardX's default 1549 take ~6 KB each)
_RESERVED = ("step", "time")


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
            from tensorboardX import SummaryWriter  # imports torch when present: only when asked

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
        head, offset, dtype, n = full_records(self.loads_path, warn=False)
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
            record[k] = encode(k, v)
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
                if k in _RESERVED or v is None or isinstance(v, str) and v not in NON_FINITE:
                    continue
                if k in LAYER_STATS and not store:
                    continue  # (bounded: DeepSeek-V3 has 59 rows of each, at the cadence of expert_loads.bin)
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        self._tb.add_scalar(f"{k}/layer_{i}", float(decode(x)), step, walltime=now)
                else:
                    self._tb.add_scalar(k, float(decode(v)), step, walltime=now)
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
            atomic_write(self.loads_path, loads_header(layers, experts, operator.index(k), names))
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
