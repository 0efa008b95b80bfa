"""Training metrics: metrics.jsonl round trip, TensorBoard events, resume truncation, plot and summary."""

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from moe_jax.train.metrics import MetricsWriter, plot, read_metrics, summary, truncate_after


def _steps(n=6, layers=3, start=1):
    """Metrics as the training loop logs them, with numpy scalars, a NaN, an Inf and a step without mtp_loss."""
    out = []
    for s in range(start, start + n):
        m = {
            "loss": 10.0 - s,
            "ce_loss": np.float32(9.5 - s),
            "mtp_loss": 0.5,
            "balance_loss": 0.01 * s,
            "grad_norm": np.float64(1.0 / s),
            "lr": 1e-4 * s,
            "tokens_per_s": 1000.0 + s,
            "step_time_s": 0.25,
            "tflops_per_device": 1.5,
            "mfu": 0.4,
            "skipped_steps": np.int32(0),
            "load_imbalance": np.linspace(1.0, 2.0, layers, dtype=np.float32) + s,
            "extra_metric": 7.0,
        }
        out.append((s, m))
    out[2][1]["loss"] = float("nan")
    out[3][1]["grad_norm"] = np.float32("inf")
    del out[4][1]["mtp_loss"]
    return out


def _expected(m: dict) -> dict:
    """The record read_metrics should return for metrics m (float32 values compare as float32)."""
    out = {}
    for k, v in m.items():
        if isinstance(v, np.ndarray):
            out[k] = [pytest.approx(float(x), rel=1e-6) for x in v]
        elif isinstance(v, np.integer):
            out[k] = int(v)
        elif math.isnan(v):
            out[k] = "nan"
        else:
            out[k] = pytest.approx(float(v), rel=1e-6)
    return out


def _nan_to_str(rec: dict) -> dict:
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in rec.items()}


def _read_events(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of the scalar summaries in the event files under logdir.

    Uses TensorBoard's EventAccumulator when the tensorboard package is installed, else reads the TFRecord
    framing (length, masked CRC, payload, masked CRC) with tensorboardX's Event proto, checking both CRCs.
    """
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event files in {logdir}"
    out: dict[str, dict[int, float]] = {}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.record_writer import masked_crc32c

        for f in files:
            data, pos = f.read_bytes(), 0
            while pos < len(data):
                header = data[pos : pos + 8]
                (n,) = struct.unpack("<Q", header)
                assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
                payload = data[pos + 12 : pos + 12 + n]
                assert struct.unpack("<I", data[pos + 12 + n : pos + 16 + n])[0] == masked_crc32c(payload)
                pos += 16 + n
                ev = Event.FromString(payload)
                if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START:
                    for values in out.values():  # a restart: TensorBoard hides events at or after ev.step
                        for step in [s for s in values if s >= ev.step]:
                            del values[step]
                for v in ev.summary.value:
                    out.setdefault(v.tag, {})[ev.step] = v.simple_value
        return out
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            out.setdefault(tag, {})[e.step] = e.value
    return out


def test_roundtrip_jsonl_and_tensorboard(tmp_path):
    run = tmp_path / "run"
    steps = _steps()
    with MetricsWriter(run) as w:
        for s, m in steps:
            w.write(s, m)
    w.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        w.write(99, {"loss": 1.0})

    # every line is strict JSON: non-finite values are the strings "NaN" / "Infinity"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(steps)
    raw = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}")) for line in lines]
    assert raw[2]["loss"] == "NaN" and raw[3]["grad_norm"] == "Infinity"
    assert list(raw[0])[:3] == ["step", "time", "loss"]

    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [s for s, _ in steps]
    assert all(abs(r["time"] - recs[0]["time"]) < 60 for r in recs)
    for r, (_, m) in zip(recs, steps):
        body = {k: v for k, v in r.items() if k not in ("step", "time")}
        assert _nan_to_str(body) == _expected(m)
    assert recs[3]["grad_norm"] == math.inf and "mtp_loss" not in recs[4]
    assert isinstance(recs[0]["skipped_steps"], int)
    assert read_metrics(run / "metrics.jsonl") == recs  # the file itself works too

    ev = _read_events(run / "tensorboard")
    assert ev["loss"][1] == pytest.approx(9.0) and math.isnan(ev["loss"][3])
    assert ev["grad_norm"][4] == math.inf
    assert sorted(ev["loss"]) == [1, 2, 3, 4, 5, 6]
    assert 5 not in ev["mtp_loss"] and ev["mtp_loss"][6] == pytest.approx(0.5)
    assert ev["extra_metric"][2] == pytest.approx(7.0)
    assert ev["load_imbalance/layer_2"][1] == pytest.approx(3.0) and "load_imbalance" not in ev
    assert {f"load_imbalance/layer_{i}" for i in range(3)} <= set(ev)


def test_jax_scalars_and_no_tensorboard(tmp_path):
    import jax.numpy as jnp

    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(jnp.int32(3), {"loss": jnp.float32(2.5), "ce_loss": jnp.bfloat16(1.5), "load_imbalance": jnp.ones(2)})
        with pytest.raises(ValueError, match="reserved"):
            w.write(4, {"step": 1})
    assert not (tmp_path / "tensorboard").exists()
    (rec,) = read_metrics(tmp_path)
    assert rec["step"] == 3 and rec["loss"] == 2.5 and rec["ce_loss"] == 1.5 and rec["load_imbalance"] == [1.0, 1.0]


def test_truncated_last_line_and_corrupt_middle_line(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for s, m in _steps():
            w.write(s, m)
    path = tmp_path / "metrics.jsonl"
    good = path.read_bytes()
    path.write_bytes(good + b'{"step": 7, "time": 1.0, "lo')  # what a SIGKILL mid-write leaves
    with pytest.warns(UserWarning, match="truncated last line"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]

    # appending after a crash first cuts the partial line off, so the file stays readable
    with pytest.warns(UserWarning, match="half-written"), MetricsWriter(tmp_path, tensorboard=False) as w:
        w.write(7, {"loss": 1.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6, 7]

    lines = good.splitlines(keepends=True)
    path.write_bytes(lines[0] + b"{not json\n" + b"".join(lines[1:]))
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: corrupt metrics line"):
        read_metrics(tmp_path)
    path.write_bytes(lines[0] + b'{"time": 1.0}\n' + b"".join(lines[1:]))
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: .*'step'"):
        read_metrics(tmp_path)

    with pytest.raises(ValueError, match="no such file"):
        read_metrics(tmp_path / "nothing-here")


def test_truncate_after_for_resume(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for s in range(1, 38):
            w.write(s, {"loss": float(s)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 38, "ti')  # killed mid-line after step 37
    assert truncate_after(tmp_path, 30) == 30
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 31))

    # resumed from the step-30 checkpoint: steps 31.. logged again, each exactly once
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for s in range(31, 41):
            w.write(s, {"loss": -float(s)})
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == list(range(1, 41))
    assert recs[35]["loss"] == -36.0

    # the same through MetricsWriter(resume_step=...), with TensorBoard, twice within a second
    other = tmp_path / "other"
    with MetricsWriter(other) as w:
        for s in range(1, 11):
            w.write(s, {"loss": float(s)})
    with MetricsWriter(other, resume_step=5) as w:
        w.write(6, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(other)] == [1, 2, 3, 4, 5, 6]
    assert len(list((other / "tensorboard").glob("events.*"))) == 2
    assert _read_events(other / "tensorboard")["loss"] == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0, 6: 0.5}
    assert truncate_after(tmp_path / "fresh-run", 10) == 0


def test_plot_and_summary(tmp_path):
    run = tmp_path / "run"
    with MetricsWriter(run, tensorboard=False) as w:
        for s, m in _steps(12, layers=20):
            w.write(s, m)
    out = plot(run)
    assert out == run / "metrics.png" and out.stat().st_size > 20_000
    img = pytest.importorskip("matplotlib.image").imread(out)
    h, w_, c = img.shape
    assert 600 < w_ < 2000 and 500 < h < 1500 and c in (3, 4) and w_ > h
    assert img[..., :3].std() > 0.05  # not a blank canvas
    assert [p.name for p in run.iterdir() if p.suffix == ".tmp"] == []

    line = summary(run)
    assert "\n" not in line and "12 steps" in line and "loss 9 -> -2" in line and "1,007 tokens/s" in line


def test_plot_missing_metrics_and_errors(tmp_path):
    sparse = tmp_path / "sparse"
    with MetricsWriter(sparse, tensorboard=False) as w:
        w.write(1, {"loss": 3.0})  # one step, nothing but the loss
    out = plot(sparse, out=tmp_path / "figs" / "sparse.png")
    assert out.stat().st_size > 10_000
    assert summary(sparse) == "sparse: 1 steps logged (1..1), loss 3 -> 3"

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no such file") as e:
        plot(empty)
    assert str(empty) in str(e.value) and "\n" not in str(e.value)
    assert not (empty / "metrics.png").exists()
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics records"):
        plot(empty)
    assert summary(empty) == "empty: no steps logged"
