"""Training metrics: metrics.jsonl round trip, TensorBoard events, resume truncation, plot and summary; expert
loads: per-layer statistics, RUN/expert_loads.bin, TensorBoard histograms, heat maps, and a real training run."""

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c

from moe_jax.train.config import load_config
from moe_jax.train.loop import train
from moe_jax.train.metrics.plots import MAP_COLUMNS, figure, plot, summary
from moe_jax.train.metrics.store import LOADS_FILE, read_expert_loads, read_metrics, truncate_after
from moe_jax.train.metrics.writer import MetricsWriter

try:  # TensorBoard's own reader, when the tensorboard package is installed (it is not a dependency)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
except ImportError:
    EventAccumulator = None


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


def _events(logdir: Path) -> dict[str, dict[int, Event]]:
    """tag -> {step: the Summary.Value logged} in the event files under logdir, read with tensorboardX's Event proto
    from the TFRecord framing (length, masked CRC, payload, masked CRC; both CRCs checked). A SessionLog START (a
    restart with purge_step) hides the events at or after its step, as TensorBoard does."""
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event files in {logdir}"
    out: dict[str, dict[int, Event]] = {}
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
                for values in out.values():
                    for step in [s for s in values if s >= ev.step]:
                        del values[step]
            for v in ev.summary.value:
                out.setdefault(v.tag, {})[ev.step] = v
    return out


def _read_events(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of the scalar summaries in the event files under logdir (TensorBoard's
    EventAccumulator when the tensorboard package is installed, else `_events`)."""
    if EventAccumulator is None:
        return {
            tag: {s: v.simple_value for s, v in values.items()}
            for tag, values in _events(logdir).items()
            if all(v.WhichOneof("value") == "simple_value" for v in values.values())
        }
    out: dict[str, dict[int, float]] = {}
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            out.setdefault(tag, {})[e.step] = e.value
    return out


def _histograms(logdir: Path) -> dict[str, dict[int, object]]:
    """tag -> {step: HistogramProto} of the histogram summaries under logdir."""
    return {
        tag: {s: v.histo for s, v in values.items()}
        for tag, values in _events(logdir).items()
        if all(v.WhichOneof("value") == "histo" for v in values.values())
    }


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
    # expert-parallel overflow (further exchange rounds per layer) is called out
    with MetricsWriter(sparse, tensorboard=False, resume_step=1) as w:
        w.write(2, {"loss": 2.0, "ep_overflow": [0, 0]})
        w.write(3, {"loss": 1.0, "ep_overflow": [2, 1]})
    line = summary(sparse)
    assert "overflowed in 1 logged steps (3 further exchange rounds" in line and "ep_capacity" in line

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


# ----------------------------------------------------------------------------- expert loads

NAMES = ["layer 3", "layer 4", "layer 5", "MTP 0"]


def _loads_of(rng, layers: int, experts: int, k: int, tokens: int) -> np.ndarray:
    """[layers, experts] float32: tokens routed to each expert when every token picks k distinct experts at random."""
    picks = np.argsort(rng.random((layers, tokens, experts)), axis=-1)[..., :k]
    return np.stack([np.bincount(p.ravel(), minlength=experts) for p in picks]).astype(np.float32)


def _collapsing_run(
    run, steps=12, *, start=1, layers=4, experts=16, k=4, tokens=256, collapse=2, collapse_from=6, seed=0, **kw
):
    """Write steps start.. through MetricsWriter as the training loop does; returns [(step, load, bias)].

    Row `collapse` collapses from step `collapse_from` on: every token picks expert 5 (and the same k - 1 others),
    so with 16 experts and k = 4, 12 experts receive nothing. The biases follow the aux-loss-free update
    (gamma 1e-3). kw: MetricsWriter arguments (tensorboard, resume_step) and loads_every."""
    rng = np.random.default_rng(seed)
    every = kw.pop("loads_every", 1)
    bias = np.zeros((layers, experts), np.float32)
    names = NAMES if layers == len(NAMES) else None
    written = []
    with MetricsWriter(run, **kw) as w:
        for s in range(start, start + steps):
            load = _loads_of(rng, layers, experts, k, tokens)
            if s >= collapse_from:
                load[collapse] = 0
                load[collapse, (5 + np.arange(k)) % experts] = tokens
            bias = bias + np.float32(1e-3) * np.sign(load.mean(-1, keepdims=True) - load)
            imbalance = load.max(-1) / load.mean(-1)
            w.write(
                s,
                {"loss": 3.0, "load_imbalance": imbalance},
                expert_load=load,
                router_bias=bias,
                experts_per_token=k,
                layer_names=names,
                loads_every=every,
            )
            written.append((s, load, bias))
    return written


def test_expert_loads_statistics_and_histograms(tmp_path):
    run = tmp_path / "run"
    written = _collapsing_run(run)

    # the full loads and biases read back exactly as written
    loads = read_expert_loads(run)
    assert loads.steps.tolist() == list(range(1, 13)) and loads.steps.dtype == np.int64
    np.testing.assert_array_equal(loads.load, np.stack([load for _, load, _ in written]))
    np.testing.assert_array_equal(loads.bias, np.stack([bias for _, _, bias in written]))
    assert loads.experts_per_token == 4 and loads.layer_names == NAMES
    np.testing.assert_allclose(loads.share.sum(-1), 4.0)  # every token has 4 slots

    # the layout is the documented one: a JSON line padded to 64 bytes, then packed records numpy reads alone
    path = run / LOADS_FILE
    header = path.read_bytes().split(b"\n", 1)[0] + b"\n"
    head = json.loads(header)
    assert len(header) % 64 == 0 and head["layers"] == 4 and head["experts"] == 16
    dtype = np.dtype([(f[0], f[1], tuple(f[2])) if len(f) == 3 else tuple(f) for f in head["record"]])
    assert dtype.itemsize == 8 + 8 * 4 * 16 and path.stat().st_size == len(header) + 12 * dtype.itemsize
    np.testing.assert_array_equal(np.fromfile(path, dtype=dtype, offset=len(header))["load"], loads.load)

    # metrics.jsonl: the per-layer statistics of every step, and they single out the collapsed layer
    recs = read_metrics(run)
    for r, (_, load, bias) in zip(recs, written):
        assert r["expert_max_share"] == pytest.approx(load.max(-1) / 256, abs=5e-5)
        assert r["experts_idle"] == (load == 0).sum(-1).tolist()
        assert r["router_bias_min"] == pytest.approx(bias.min(-1), rel=1e-4)
        assert r["router_bias_max"] == pytest.approx(bias.max(-1), rel=1e-4)
    assert all(max(r["expert_max_share"]) < 0.6 for r in recs[:5])  # 0.25 when perfectly balanced
    for r in recs[5:]:
        assert int(np.argmax(r["expert_max_share"])) == 2 and r["expert_max_share"][2] == 1.0
        assert r["experts_idle"][2] == 12 and r["experts_idle"][:2] == [0, 0]
    # the aux-loss-free update pushes the collapsed layer's biases apart by 2 gamma a step
    spread = [r["router_bias_max"][2] - r["router_bias_min"][2] for r in recs]
    assert spread[-1] == pytest.approx(spread[5] + 2e-3 * 6, rel=1e-3)
    line = summary(run)
    assert "most imbalanced: layer 5 (row 2), busiest expert 100% of tokens, 12 of 16 experts idle" in line

    # TensorBoard: a histogram per layer of the loads and of the biases, at the steps stored
    hist = _histograms(run / "tensorboard")
    assert set(hist) == {f"{key}/layer_{i}" for key in ("expert_load", "router_bias") for i in range(4)}
    for s, load, bias in written:
        h = hist["expert_load/layer_2"][s]
        assert (h.num, h.sum, h.min, h.max) == (16, load[2].sum(), load[2].min(), load[2].max())
        assert sum(h.bucket) == 16 and len(h.bucket) <= 33
        h = hist["router_bias/layer_1"][s]
        assert h.num == 16 and h.min == pytest.approx(bias[1].min()) and h.max == pytest.approx(bias[1].max())
    ev = _read_events(run / "tensorboard")
    assert ev["expert_max_share/layer_2"][12] == 1.0 and ev["experts_idle/layer_2"][12] == 12.0
    assert sorted(ev["loss"]) == list(range(1, 13))


def test_loads_cadence_and_what_is_optional(tmp_path):
    # logged every 3 steps, loads every 5: the first logged step, then the first logged step in each new window of
    # 5 steps, and the last step (the training loop passes loads_every=1 there)
    rng = np.random.default_rng(1)
    with MetricsWriter(tmp_path / "run") as w:
        for s in [*range(3, 31, 3), 31]:
            load = _loads_of(rng, 3, 8, 2, 64)
            w.write(
                s,
                {"loss": 1.0},
                expert_load=load,
                router_bias=-load,
                experts_per_token=2,
                loads_every=5 - 4 * (s == 31),
            )
    stored = [3, 6, 12, 15, 21, 27, 30, 31]
    assert read_expert_loads(tmp_path / "run").steps.tolist() == stored
    assert all(len(r["expert_max_share"]) == 3 for r in read_metrics(tmp_path / "run"))  # every logged step
    hist, ev = _histograms(tmp_path / "run" / "tensorboard"), _read_events(tmp_path / "run" / "tensorboard")
    assert sorted(hist["expert_load/layer_0"]) == stored and sorted(hist["router_bias/layer_2"]) == stored
    assert sorted(ev["expert_max_share/layer_1"]) == stored and len(ev["loss"]) == 11

    # no router bias: the records hold NaN biases and metrics.jsonl no bias statistics
    with MetricsWriter(tmp_path / "nobias", tensorboard=False) as w:
        rec = w.write(1, {"loss": 1.0}, expert_load=[[3, 1, 0, 0]], experts_per_token=1)
        assert rec["expert_max_share"] == [0.75] and rec["experts_idle"] == [2] and "router_bias_min" not in rec
        with pytest.raises(ValueError, match="different model"):
            w.write(2, {}, expert_load=np.ones((2, 4)), loads_every=1)
        with pytest.raises(ValueError, match="router_bias: shape"):
            w.write(3, {}, expert_load=np.ones((1, 4)), router_bias=np.ones((1, 5)))
        with pytest.raises(ValueError, match="reserved"):
            w.write(4, {"experts_idle": 1}, expert_load=np.ones((1, 4)))
    loads = read_expert_loads(tmp_path / "nobias")
    assert loads.steps.tolist() == [1] and np.isnan(loads.bias).all() and loads.layer_names == ["layer 0"]
    assert "busiest expert 75% of tokens, 2 of 4 experts idle" in summary(tmp_path / "nobias")

    # a model without MoE layers: nothing more is logged and no file is created
    with MetricsWriter(tmp_path / "dense", tensorboard=False) as w:
        assert set(w.write(1, {"loss": 1.0}, expert_load=np.zeros((0, 1)))) == {"step", "time", "loss"}
    assert not (tmp_path / "dense" / LOADS_FILE).exists() and "most imbalanced" not in summary(tmp_path / "dense")


def test_loads_torn_tail_and_resume_truncation(tmp_path):
    run = tmp_path / "run"
    first = _collapsing_run(run, steps=10)
    path = run / LOADS_FILE
    record = 8 + 8 * 4 * 16
    whole = path.read_bytes()
    path.write_bytes(whole + whole[-record:][: record // 3])  # what a SIGKILL mid-write leaves
    with pytest.warns(UserWarning, match="partial last record"):
        assert read_expert_loads(run).steps.tolist() == list(range(1, 11))

    # resumed from the checkpoint of step 6: the loads after it (and the torn record) go, steps 7.. are stored again
    again = _collapsing_run(run, steps=6, start=7, seed=1, resume_step=6)
    loads = read_expert_loads(run)
    assert loads.steps.tolist() == list(range(1, 13))
    np.testing.assert_array_equal(loads.load, np.stack([load for _, load, _ in first[:6] + again]))
    assert path.stat().st_size == len(whole) - 10 * record + 12 * record
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 13))
    hist = _histograms(run / "tensorboard")["expert_load/layer_0"]  # TensorBoard hides the first run's steps 7..10
    assert sorted(hist) == list(range(1, 13))
    assert [hist[s].max for s in range(1, 13)] == [load[0].max() for _, load, _ in first[:6] + again]

    # a writer opened without resume_step cuts a partial record off before appending
    path.write_bytes(path.read_bytes() + b"\x01" * 100)
    with pytest.warns(UserWarning, match="dropped a partial last record"):
        _collapsing_run(run, steps=1, start=13, tensorboard=False)
    assert read_expert_loads(run).steps.tolist() == list(range(1, 14))

    # truncate_after: exactly the records up to the step, atomically; none left: the file goes
    assert truncate_after(run, 3) == 3
    assert read_expert_loads(run).steps.tolist() == [1, 2, 3] and path.stat().st_size == len(whole) - 7 * record
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == []
    truncate_after(run, 0)
    assert not path.exists() and read_metrics(run) == []

    # a damaged header is an error naming the file
    path.write_bytes(b'{"format": "something else"}\n' + b"\0" * 100)
    with pytest.raises(ValueError, match=rf"{LOADS_FILE}: corrupt expert-loads header"):
        read_expert_loads(run)
    with pytest.raises(ValueError, match="no such file"):
        read_expert_loads(tmp_path / "elsewhere")


def _heat_titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.get_axes() if ax.get_ylabel() == "expert"]


def test_plot_heat_maps(tmp_path):
    run = tmp_path / "run"
    busiest = np.stack([load.max(-1) / 256 for _, load, _ in _collapsing_run(run, tensorboard=False)])  # [step, row]
    fig = figure(run)
    assert _heat_titles(fig) == [
        f"{name} (row {i}): busiest {busiest[-1, i]:.0%} (peak {busiest[:, i].max():.0%})"
        for i, name in enumerate(NAMES)
    ]
    assert _heat_titles(fig)[2] == "layer 5 (row 2): busiest 100% (peak 100%)"
    left = [ax.get_title(loc="left") for ax in fig.get_axes()]
    assert "busiest expert's share of the layer's tokens (1 = every token)" in left
    assert "router bias spread (max - min) per layer" in left
    # the collapsed layer's heat map: experts 5..8 hold every token from step 6 on (each 100%), the rest none
    (ax,) = [ax for ax in fig.get_axes() if ax.get_title().startswith("layer 5")]
    cells = np.asarray(ax.collections[0].get_array()).reshape(16, 12)  # experts x steps
    assert (cells[5:9, 5:] == 1.0).all() and (np.delete(cells, range(5, 9), 0)[:, 5:] == 0).all()
    assert 0 < cells[:, :5].max() < 0.6

    plain = tmp_path / "plain"  # the same run without loads: the first section alone
    with MetricsWriter(plain, tensorboard=False) as w:
        for s in range(1, 13):
            w.write(s, {"loss": 3.0})
    h0, w0 = imread(plot(plain)).shape[:2]
    out = plot(run)
    img = imread(out)
    assert img.shape[1] == w0 and img.shape[0] > h0 + 500  # the loads section below
    assert img[h0:, :, :3].std() > 0.05 and [p.name for p in run.iterdir() if p.suffix == ".tmp"] == []

    # many layers of 256 experts: 8 heat maps, the collapsed layer first
    big = tmp_path / "big"
    _collapsing_run(
        big, steps=6, layers=20, experts=256, k=8, tokens=512, collapse=13, collapse_from=3, tensorboard=False
    )
    titles = _heat_titles(figure(big))
    assert len(titles) == 8 and titles[0].startswith("layer 13: busiest 100%")
    assert plot(big).stat().st_size > 50_000

    # two experts, top-1: layer 1 collapses onto expert 1
    two = tmp_path / "two"
    _collapsing_run(two, steps=5, layers=2, experts=2, k=1, tokens=64, collapse=1, collapse_from=2, tensorboard=False)
    fig = figure(two)
    assert [t.split(":")[0] for t in _heat_titles(fig)] == ["layer 0", "layer 1"]
    (ax,) = [ax for ax in fig.get_axes() if ax.get_title().startswith("layer 1")]
    assert np.asarray(ax.collections[0].get_array()).reshape(2, 5)[:, 1:].tolist() == [[0.0] * 4, [1.0] * 4]
    assert "most imbalanced: layer 1, busiest expert 100% of tokens, 1 of 2 experts idle" in summary(two)
    plot(two)


def test_long_runs_are_drawn_in_bounded_columns(tmp_path):
    """More logged steps than MAP_COLUMNS: the maps group them, keeping a collapse of a single step visible."""
    n = MAP_COLUMNS + 301
    load = np.array([[2, 2, 2, 2], [2, 2, 2, 2]], np.float32)
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for s in range(1, n + 1):
            spike = load.copy()
            if s == 777:
                spike[1] = [8, 0, 0, 0]  # layer 1, one step: every token on expert 0
            w.write(s, {"loss": 1.0}, expert_load=spike, router_bias=np.zeros((2, 4)), loads_every=1)
    fig = figure(tmp_path)
    (over,) = [ax for ax in fig.get_axes() if ax.get_title(loc="left").startswith("busiest expert's share")]
    cells = np.asarray(over.collections[0].get_array()).reshape(2, -1)  # layers x columns
    assert cells.shape[1] == MAP_COLUMNS and cells[1].max() == 1.0 and cells[0].max() == 0.25
    assert (cells[1] == 1.0).sum() == 1
    heat = [ax for ax in fig.get_axes() if ax.get_ylabel() == "expert"]
    assert heat[1].get_title() == "layer 1: busiest 25% (peak 100%)"
    cells = np.asarray(heat[1].collections[0].get_array()).reshape(4, -1)  # experts x columns: means of groups
    assert cells.shape[1] == MAP_COLUMNS and 0.25 < cells[0].max() < 1.0


def test_training_run_records_expert_loads(tmp_path):
    """The tiny model (2 MoE layers + MTP, 16 experts, top-4, 8 x 128 tokens a step) trained 4 steps with
    loads_every=3: statistics every step, full loads at steps 1, 3 and 4 (the last), histograms at the same steps."""
    run = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", [f"run_dir={run}", "steps=4", "loads_every=3", "checkpoint.every=1000"])
    train(cfg, progress=False, log=lambda *a: None)
    recs = {r["step"]: r for r in read_metrics(run)}
    assert list(recs) == [1, 2, 3, 4]
    for r in recs.values():
        assert all(
            len(r[key]) == 3 for key in ("expert_max_share", "experts_idle", "router_bias_min", "router_bias_max")
        )
    loads = read_expert_loads(run)
    assert loads.steps.tolist() == [1, 3, 4] and loads.load.shape == loads.bias.shape == (3, 3, 16)
    assert loads.layer_names == ["layer 1", "layer 2", "MTP 0"] and loads.experts_per_token == 4
    np.testing.assert_array_equal(loads.load.sum(-1), 8 * 128 * 4)  # every token's 4 slots, in every layer
    for s, load, bias in zip(loads.steps, loads.load, loads.bias):
        r = recs[s]
        assert r["load_imbalance"] == pytest.approx(load.max(-1) / load.mean(-1), rel=1e-5)
        assert r["expert_max_share"] == pytest.approx(load.max(-1) / (8 * 128), abs=5e-5)
        assert r["experts_idle"] == (load == 0).sum(-1).tolist()
        assert r["router_bias_min"] == pytest.approx(bias.min(-1), rel=1e-4, abs=1e-9)
        assert r["router_bias_max"] == pytest.approx(bias.max(-1), rel=1e-4, abs=1e-9)
    # the stored bias is the one after the step's update, which moved it by gamma against that step's loads
    step4 = np.float32(1e-3) * np.sign(loads.load[2].mean(-1, keepdims=True) - loads.load[2])
    np.testing.assert_allclose(loads.bias[2] - loads.bias[1], step4, atol=1e-6)
    hist = _histograms(run / "tensorboard")
    assert sorted(hist["expert_load/layer_2"]) == [1, 3, 4] and hist["expert_load/layer_2"][4].sum == 8 * 128 * 4
    assert sorted(hist["router_bias/layer_0"]) == [1, 3, 4]
    titles = _heat_titles(figure(run))
    assert [t.split(":")[0] for t in titles] == ["layer 1 (row 0)", "layer 2 (row 1)", "MTP 0 (row 2)"]
