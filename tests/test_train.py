"""`moe-jax train` on the tiny model: learning, exact resume after SIGKILL, the bias update, the NaN
guard, the validation gate, and the config. (8 devices = 1 device: test_multiprocess, whose 8-device
process trains on one device as well.)"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from converters.tiny import make_tiny
from moe_jax import data
from moe_jax.train.config import ConfigError, load_config
from moe_jax.train.loop import TrainingError, train
from moe_jax.train.metrics.store import read_metrics
from tests.helpers import INTERRUPTIBLE_CLI, error_lines, run_main


def tiny_run(tmp_path, *overrides):
    # MFU against a stated peak: no 2048x2048 matmul timed at every start (the CLI runs below time it)
    overrides = [f"run_dir={tmp_path / 'run'}", "tensorboard=false", "peak_tflops=1", *overrides]
    return load_config("configs/tiny.yaml", overrides)


def bigram_entropy() -> float:
    """H(next byte | this byte) of the training text: the best CE a model that ignores context can reach."""
    stream = np.asarray(data.load_stream("python-docs", data.load_tokenizer(None, 256)), np.int64)
    counts = np.bincount(stream[:-1] * 256 + stream[1:], minlength=256 * 256).reshape(256, 256).astype(float)
    joint = counts / counts.sum()
    cond = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    nz = counts > 0
    return float(-(joint[nz] * np.log(cond[nz])).sum())


def test_loss_falls_below_what_a_context_free_model_can_reach(tmp_path):
    # 200 steps of 1024 tokens see under half the text once: the model cannot have memorized it
    cfg = tiny_run(tmp_path, "steps=200", "optim.lr=1e-2", "optim.warmup_steps=10", "checkpoint.every=1000")
    train(cfg, progress=False, log=lambda *a: None)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 201))
    first, last = records[0]["ce_loss"], np.mean([r["ce_loss"] for r in records[-10:]])
    bound = bigram_entropy()  # 2.45 nats on this text; unigram is 3.26, uniform 5.55
    assert first > 5.0 and last < bound - 0.15, (first, last, bound)
    assert all(np.isfinite(r["mtp_loss"]) and r["mtp_loss"] < records[0]["mtp_loss"] for r in records[-10:])
    for key in ("balance_loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu"):
        assert records[-1][key] > 0, key
    assert len(records[-1]["load_imbalance"]) == 3  # two MoE layers and the MTP layer
    # the trained model is a moe-jax checkpoint: it loads and exports
    import moe_jax

    model = moe_jax.from_pretrained(tmp_path / "run" / "model")
    assert model.config.num_hidden_layers == 3 and "mtp" in model.params
    code, _, err = run_main("plot", tmp_path / "run")
    assert code == 0 and (tmp_path / "run" / "metrics.png").stat().st_size > 10_000, err


KILL_SCRIPT_STEPS = 24  # a checkpoint every 6; killed after 14 steps were logged


def _train_args(run_dir, *extra):
    return [
        "train",
        "--config",
        "configs/tiny.yaml",
        f"run_dir={run_dir}",
        f"steps={KILL_SCRIPT_STEPS}",
        "checkpoint.every=6",
        "tensorboard=false",
        "--quiet",
        *extra,
    ]


def test_sigkill_and_resume_gives_the_same_losses(tmp_path):
    """A CLI process killed mid-run, resumed: the losses of the uninterrupted run, bit for bit. The
    uninterrupted and the resumed runs are the same command in this process (the same XLA flags,
    the same compiled step)."""
    code, _, err = run_main(*_train_args(tmp_path / "whole"))
    assert code == 0, err[-3000:]
    want = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "whole")}

    cmd = [sys.executable, "-m", "moe_jax.cli", *_train_args(tmp_path / "killed")]
    killed = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and killed.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 14:
            killed.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert killed.wait(timeout=60) == -signal.SIGKILL, killed.stderr.read()[-3000:]
    logged = read_metrics(tmp_path / "killed")[-1]["step"]
    assert 14 <= logged < KILL_SCRIPT_STEPS
    # resuming with what the checkpoint (step 12) was not written with: one line, nothing changed
    for change, words in (
        ("data.batch_size=4", "checkpoints/12: written with data.batch_size=8, this run has 4"),
        ("model.mtp=false", "checkpoints/12: holds another model or optimizer: params.mtp."),
        ("steps=10", "checkpoints/12: the run is past steps=10; resume with steps >= 12"),
    ):
        code, _, err = run_main(*_train_args(tmp_path / "killed", "--resume", change))
        assert code == 2 and len(error_lines(err)) == 1 and words in err, (change, err[-3000:])
    code, out, err = run_main(*_train_args(tmp_path / "killed", "--resume"))
    assert code == 0, err[-3000:]
    assert "resumed from" in out + err
    got = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "killed")}
    assert got == want  # every step, bit for bit; steps past the checkpoint were logged once

    # Ctrl-C: a checkpoint after the step, exit 0; resumed, the same run
    cmd = [*INTERRUPTIBLE_CLI, *_train_args(tmp_path / "interrupted")]
    interrupted = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    while time.time() < deadline and interrupted.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 3:
            interrupted.send_signal(signal.SIGINT)
            break
        time.sleep(0.01)
    out, err = interrupted.communicate(timeout=120)
    assert interrupted.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "Ctrl-C: stopping after this step" in err and "every process stopped after step" in out + err
    (saved,) = [int(p.name) for p in (tmp_path / "interrupted" / "checkpoints").iterdir()]
    assert 3 <= saved < KILL_SCRIPT_STEPS
    assert run_main(*_train_args(tmp_path / "interrupted", "--resume"))[0] == 0
    assert {r["step"]: r["loss"] for r in read_metrics(tmp_path / "interrupted")} == want


def test_a_refused_resume_loads_no_model(tmp_path):
    """The resume checks that need no model (the data's order, the steps) refuse before the model
    is loaded: with a weight file of the starting checkpoint cut short after the run, those
    refusals still name the step checkpoint, and only a resume that passes them reaches the file."""
    converted = tmp_path / "converted"
    assert run_main("convert", "--from", "hf", make_tiny(tmp_path / "hf", "base"), "--to", converted)[0] == 0
    args = _train_args(tmp_path / "run", f"model.init={converted}", "steps=2", "checkpoint.every=2")
    code, _, err = run_main(*args)
    assert code == 0, err[-3000:]
    damaged = next((converted / "state" / "params.dense.mlp.down").glob("0.*"))
    with open(damaged, "r+b") as f:
        f.truncate(100)
    for change, words in (
        ("data.batch_size=4", "checkpoints/2: written with data.batch_size=8, this run has 4"),
        ("steps=1", "checkpoints/2: the run is past steps=1; resume with steps >= 2"),
        ("data.seq_len=64", "checkpoints/2: written over other data (data.source, data.seq_len or the tokenizer"),
    ):
        code, _, err = run_main(*args, "--resume", change)
        assert code == 2 and len(error_lines(err)) == 1 and words in err, (change, err[-3000:])
    code, _, err = run_main(*args, "--resume", "steps=3")
    assert code == 2 and len(error_lines(err)) == 1 and str(damaged) in err and "100 bytes, recorded" in err, err


def test_data_refusals_come_before_the_model(tmp_path):
    """A named tokenizer that is not there, a batch larger than the data, a run_dir inside the data
    it reads (its own files would become data): one line naming the key, before any model loads."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "a.txt").write_text("x" * 2000)
    base = [
        "train",
        "--config",
        "configs/tiny.yaml",
        "--quiet",
        "tensorboard=false",
        "steps=1",
        f"data.source={data_dir}",
    ]
    for change, words in (
        (f"data.tokenizer={tmp_path / 'missing'}", f"data.tokenizer: {tmp_path / 'missing'}: no such directory"),
        (f"data.tokenizer={data_dir}", "no tokenizer.json or tiktoken.model in it"),
        (
            "data.batch_size=16",
            "data.batch_size=16 is more than data.source's 15 rows of data.seq_len + 1 = 129 tokens",
        ),
        (f"run_dir={data_dir / 'run'}", f"run_dir is inside data.source's {data_dir}"),
        (f"data.source={data_dir}/*/*.txt", f"run_dir is inside data.source's {data_dir}"),  # run/x.txt
        (f"data.source={data_dir}/**/*.txt", f"run_dir is inside data.source's {data_dir}"),
    ):
        run = (
            f"run_dir={data_dir / 'run'}" if "source" in change or "run_dir" in change else f"run_dir={tmp_path / 'r'}"
        )
        code, _, err = run_main(*base, run, change)
        assert code == 2 and len(error_lines(err)) == 1 and words in err, (change, err[-3000:])
    assert not (data_dir / "run").exists() and not (tmp_path / "r" / "checkpoints").exists()
    # a pattern that reaches no deeper than the data directory's own files reads none of the run's
    code, _, err = run_main(*base, f"run_dir={data_dir / 'run'}", f"data.source={data_dir}/*.txt", "checkpoint.every=1")
    assert code == 0 and (data_dir / "run" / "checkpoints").is_dir(), err[-3000:]


def skewed_checkpoint(path, offset=1.0):
    """A tiny HF checkpoint whose routers all prefer experts 0-3 by `offset`."""
    make_tiny(path, "base")
    tensors = load_file(path / "model.safetensors")
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = np.zeros_like(tensors[name])
            tensors[name][:4] = offset
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_bias_update_balances_a_skewed_router(tmp_path):
    ckpt = skewed_checkpoint(tmp_path / "skewed")
    cfg = tiny_run(
        tmp_path,
        f"model.init={ckpt}",
        "steps=60",
        "optim.lr=0",
        "loss.balance_alpha=0",
        "loss.bias_gamma=0.03",
        "checkpoint.every=1000",
    )
    train(cfg, progress=False, log=lambda *a: None)
    records = read_metrics(tmp_path / "run")
    first = records[0]["load_imbalance"]
    last = np.mean([r["load_imbalance"] for r in records[-10:]], axis=0)
    assert min(first) > 3.5  # 4 of 16 experts take (almost) every top-4 slot: max/mean near 4
    assert max(last) < 2.0, (first, last)
    # with gamma = 0 nothing moves the router (lr 0): the skew stays
    cfg = tiny_run(tmp_path / "off", f"model.init={ckpt}", "steps=5", "optim.lr=0", "loss.bias_gamma=0")
    train(cfg, progress=False, log=lambda *a: None)
    assert min(read_metrics(tmp_path / "off" / "run")[-1]["load_imbalance"]) > 3.5


def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path):
    ckpt = make_tiny(tmp_path / "nan", "base")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight"][:] = 3e38  # finite (loads), overflows in the first matmul
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    cfg = tiny_run(tmp_path, f"model.init={ckpt}", "optim.max_nonfinite=3")
    with pytest.raises(TrainingError, match="not finite for 3 steps in a row"):
        train(cfg, progress=False, log=lambda *a: None)
    records = read_metrics(tmp_path / "run")
    assert [r["skipped_steps"] for r in records] == [1, 2, 3]
    assert not (tmp_path / "run" / "model").exists()  # nothing that could pass for a trained model


def test_next_step_is_dispatched_before_a_step_is_read(tmp_path, monkeypatch):
    """The loop issues step n + 1 before it reads step n's metrics, so the device never waits for the
    host; a checkpoint step is read (flushed) before the next is dispatched; every step is logged once."""
    from moe_jax.train import loop

    events = []
    make_step = loop.make_step

    def recording_make_step(*args, **kwargs):
        step_fn = make_step(*args, **kwargs)

        def step(state, batch):
            out = step_fn(state, batch)
            events.append(("dispatch", sum(e[0] == "dispatch" for e in events) + 1))
            return out

        return step

    class RecordingWriter(loop.MetricsWriter):
        def write(self, step, metrics, **kwargs):
            events.append(("read", step))
            return super().write(step, metrics, **kwargs)

    monkeypatch.setattr(loop, "make_step", recording_make_step)
    monkeypatch.setattr(loop, "MetricsWriter", RecordingWriter)
    # checkpoints every 10 steps
    cfg = tiny_run(tmp_path, f"steps={KILL_SCRIPT_STEPS}", "checkpoint.every=10")
    losses = train(cfg, progress=False, log=lambda *a: None)["losses"]
    steps = list(range(1, KILL_SCRIPT_STEPS + 1))
    assert [n for kind, n in events if kind == "dispatch"] == steps
    assert [n for kind, n in events if kind == "read"] == steps  # each step read once, in order
    at = {event: i for i, event in enumerate(events)}
    for n in steps[:-1]:
        if n % 10:
            assert at["dispatch", n + 1] < at["read", n], (n, events)
        else:  # a checkpoint holds only steps the guard has seen
            assert at["read", n] < at["dispatch", n + 1], (n, events)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == steps and list(losses) == steps
    assert all(r["step_time_s"] > 0 for r in records)


def test_validation_gate(tmp_path, converted):
    """validate.required: a checkpoint that validates against its source trains; one that was
    changed after conversion does not."""
    jax_ckpt = converted("base_sharded")  # the tiny base model, converted; validated against its source
    cfg = tiny_run(tmp_path, f"model.init={jax_ckpt}", "validate.required=true", "steps=2", "validate.tokens=16")
    assert train(cfg, progress=False, log=lambda *a: None)["losses"]
    other = skewed_checkpoint(tmp_path / "other", offset=0.5)  # same shapes, different router biases
    cfg = tiny_run(
        tmp_path / "b",
        f"model.init={jax_ckpt}",
        "validate.required=true",
        f"validate.hf={other}",
        "steps=2",
        "validate.tokens=16",
    )
    with pytest.raises(TrainingError, match="validation of .* failed"):
        train(cfg, progress=False, log=lambda *a: None)


def test_config_errors_and_overrides(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["optim.lr=1e-4", "mesh=data=2,expert=4", "model.remat=offload_qv"])
    assert cfg.optim.lr == 1e-4 and cfg.mesh == "data=2,expert=4" and cfg.model.remat == "offload_qv"
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        load_config(None, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match="steps: expected int"):
        load_config(None, ["steps=many"])
    assert load_config(None, ["model.backend=te+mxfp8"]).model.backend == "te+mxfp8"  # TE's MXFP8 recipe
    with pytest.raises(ConfigError, match="optim.grad_accum must be >= 1 and divide data.batch_size \\(8\\), got 3"):
        load_config("configs/tiny.yaml", ["optim.grad_accum=3"])
    with pytest.raises(ConfigError, match="peer_timeout_s must be > 0, got 0"):
        load_config(None, ["peer_timeout_s=0"])
    with pytest.raises(ConfigError, match="xla_flags: 'xla_foo' is not an XLA flag of the form --name=value"):
        load_config(None, ["xla_flags=--xla_bar=1 xla_foo"])
    with pytest.raises(ConfigError, match="optim.moment_dtype: 'float8' is not one of None, float32"):
        load_config(None, ["optim.moment_dtype=float8"])
    with pytest.raises(ConfigError, match="model.backend: unknown grouped-GEMM backend 'te\\+fp4'"):
        load_config(None, ["model.backend=te+fp4"])
    # on a machine without an NVIDIA GPU, a TE backend is refused before anything is loaded
    with pytest.raises(ConfigError, match="model.backend: 'te' runs Transformer Engine, which needs an NVIDIA GPU"):
        train(tiny_run(tmp_path, "model.backend=te"), progress=False, log=lambda *a: None)
    assert not (tmp_path / "run").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  initt: tiny\n")
    code, _, err = run_main("train", "--config", bad)
    assert code == 2 and "bad.yaml" in err and "model.initt" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=-1", "optim.lr must be >= 0, got -1.0"),
        ("optim.lr=nan", "optim.lr must be a finite number, got nan"),
        ("optim.lr=inf", "optim.lr must be a finite number, got inf"),
        ("optim.eps=0", "optim.eps must be > 0, got 0.0"),
        ("optim.b1=2", "optim.b1 must be in [0, 1), got 2.0"),
        ("optim.b2=1", "optim.b2 must be in [0, 1), got 1.0"),
        ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio must be in [0, 1], got 1.5"),
        ("optim.warmup_steps=-5", "optim.warmup_steps must be >= 0, got -5"),
        ("optim.clip_norm=-1", "optim.clip_norm must be > 0, got -1.0"),
        ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0, got -0.1"),
        ("optim.max_nonfinite=0", "optim.max_nonfinite must be >= 1, got 0"),
        ("loss.mtp_lambda=-1", "loss.mtp_lambda must be >= 0, got -1.0"),
        ("loss.balance_alpha=nan", "loss.balance_alpha must be a finite number, got nan"),
        ("data.seq_len=1", "data.seq_len must be >= 2, got 1"),
        ("data.seed=-1", "data.seed must be in [0, 2**32), got -1"),
        ("data.seed=4294967296", "data.seed must be in [0, 2**32), got 4294967296"),
        ("validate.tokens=0", "validate.tokens must be >= 1, got 0"),
        ("peak_tflops=0", "peak_tflops must be > 0 (or null), got 0.0"),
        ("mesh=data=0", "mesh 'data=0': an axis size must be >= 1 (or -1: the rest of the devices)"),
        ("mesh=data=-3,expert=2", "mesh 'data=-3,expert=2': an axis size must be >= 1"),
        ("mesh=data=-1,expert=-1", "mesh 'data=-1,expert=-1': at most one axis may be -1"),
    ],
)
def test_numbers_out_of_range_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", [override])
    assert str(e.value) == message or str(e.value).startswith(message), str(e.value)


def test_shipped_configs_are_in_range():
    for path in sorted(Path("configs").glob("*.yaml")):
        load_config(path)
    assert load_config(None, ["mesh=data=-1,expert=2", "optim.warmup_steps=0", "loss.bias_gamma=0"]).mesh


@pytest.mark.parametrize(
    "config", [None, "gpu", "gpu_debug", *sorted(str(p) for p in Path("configs").glob("deepseek-v3*-671b-*.yaml"))]
)
def test_xla_presets_and_config_flags_are_flags_xla_accepts(config, monkeypatch):
    """XLA aborts on a flag it does not know: start jax with each preset, and with each shipped run
    config's preset and own flags as `moe-jax` applies them (GPU flags parse on CPU too). The
    config's flags override its preset's; a flag already in XLA_FLAGS wins over both."""
    from moe_jax.train.xla import apply_preset

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    if config is None:  # the order: XLA_FLAGS, then the config's flags, then the preset's
        flags = apply_preset(
            "gpu", "--xla_gpu_enable_command_buffer=FUSION --xla_gpu_all_gather_combine_threshold_bytes=7"
        )
        assert "--xla_gpu_enable_command_buffer= " in flags and "FUSION" not in flags
        assert "--xla_gpu_all_gather_combine_threshold_bytes=7" in flags
        assert "--xla_gpu_all_gather_combine_threshold_bytes=134217728" not in flags
        return
    cfg = load_config(config) if config.endswith(".yaml") else None
    flags = apply_preset(cfg.xla_preset, cfg.xla_flags) if cfg else apply_preset(config)
    proc = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.numpy.ones(3).sum())"],
        capture_output=True,
        text=True,
        env={**os.environ, "XLA_FLAGS": flags},
    )
    assert proc.returncode == 0 and "3.0" in proc.stdout, proc.stderr[-2000:]


def test_checkpoint_tokenizer_is_used_and_handed_on(tmp_path):
    """An HF directory with its own tokenizer.json: training text goes through it, and the
    trained model's export carries the tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from converters.export import export_hf

    ckpt = make_tiny(tmp_path / "hf", "base")
    text = "\n".join(data.read_documents("python-docs"))[:200_000]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>", "</s>"]))
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "docs.txt").write_text(text)
    cfg = tiny_run(tmp_path, f"model.init={ckpt}", f"data.source={tmp_path / 'docs.txt'}", "steps=2")
    train(cfg, progress=False, log=lambda *a: None)
    loaded = data.load_tokenizer(tmp_path / "run" / "model", 256)
    assert isinstance(loaded, data.HFTokenizer) and loaded.encode("def f(x):") == tok.encode("def f(x):").ids
    out = export_hf(tmp_path / "run" / "model", tmp_path / "export", progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (ckpt / name).read_bytes()


@pytest.mark.parametrize(
    "peak,warmup,total,end", [(3e-3, 5, 40, 3e-4), (1e-2, 10, 200, 1e-3), (1e-3, 0, 7, 0.0), (0.0, 3, 9, 0.0)]
)
def test_learning_rate_schedule_is_optax_warmup_cosine(peak, warmup, total, end):
    import optax

    from moe_jax.train.step import WarmupCosine

    counts = np.arange(total + 4)
    want = optax.warmup_cosine_decay_schedule(0.0, peak, warmup, total, end)(counts)
    np.testing.assert_allclose(WarmupCosine(peak, warmup, total, end)(counts), want, rtol=2e-6, atol=1e-12)


def test_adamw_with_bfloat16_moments_is_numpy_adamw_rounding_them_each_step(tmp_path):
    """optim.moment_dtype=bfloat16 (as DeepSeek-V3 trained): the moments are kept in bfloat16 and
    updated in float32; against AdamW in numpy whose update uses the step's float32 moments and
    which keeps them rounded to bfloat16 for the next step, over steps whose gradients are clipped and whose matrices decay and norms do not."""
    import jax
    import ml_dtypes

    from moe_jax.train.loop import make_optimizer

    cfg = tiny_run(tmp_path, "optim.moment_dtype=bfloat16", "optim.clip_norm=4.0", "optim.weight_decay=0.1")
    tx, _ = make_optimizer(cfg)
    rng = np.random.default_rng(0)
    params = {"moe": {"attn": {"o_proj": rng.normal(size=(2, 6, 5)).astype(np.float32)}},
              "final_norm": 1 + rng.normal(size=(5,)).astype(np.float32)}  # fmt: skip
    state = tx.init(params)
    assert {x.dtype for x in jax.tree.leaves(state) if x.ndim} == {np.dtype("bfloat16")}
    bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    o = cfg.optim
    m = jax.tree.map(np.zeros_like, params)
    v = jax.tree.map(np.zeros_like, params)
    for t in range(1, 7):
        grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32) * 3, params)
        norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in jax.tree.leaves(grads)))
        clipped = jax.tree.map(lambda g: g * min(1.0, o.clip_norm / norm), grads)
        m = jax.tree.map(lambda m, g: o.b1 * m + (1 - o.b1) * g, m, clipped)
        v = jax.tree.map(lambda v, g: o.b2 * v + (1 - o.b2) * g * g, v, clipped)
        want = jax.tree.map(lambda m, v: -(m / (1 - o.b1**t)) / (np.sqrt(v / (1 - o.b2**t)) + o.eps), m, v)
        want["moe"]["attn"]["o_proj"] -= o.weight_decay * params["moe"]["attn"]["o_proj"]
        m, v = jax.tree.map(bf16, m), jax.tree.map(bf16, v)  # what the next step starts from
        updates, state = tx.update(grads, state, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=1e-6), updates, want)
        stored = (state[1][0].mu, state[1][0].nu)
        for have, ref in zip(stored, (m, v)):
            jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), b), have, ref)


def test_runs_that_differ_in_numbers_share_one_compilation(tmp_path):
    """Learning rate, warmup, steps and loss weights are inputs of the compiled step: two runs that
    differ in all of them lower to the same program (one compilation, one persistent-cache entry)."""
    import jax

    from converters.tiny import tiny_config
    from moe_jax.config import ModelConfig
    from moe_jax.params import init_tree
    from moe_jax.train.loop import make_optimizer, make_step
    from moe_jax.train.step import init_train_state, make_batch

    a = tiny_run(tmp_path)
    b = tiny_run(tmp_path, "steps=7", "optim.lr=0.5", "optim.warmup_steps=2", "optim.min_lr_ratio=0.5",
                 "loss.mtp_lambda=0.1", "loss.balance_alpha=0", "loss.bias_gamma=0")  # fmt: skip
    config = ModelConfig.from_hf_dict(tiny_config("base"))
    batch = make_batch(np.zeros((2, 9), np.int32))
    texts, numbers = [], []
    for cfg in (a, b):
        tx, schedule = make_optimizer(cfg)
        state = init_train_state(init_tree(config), tx)
        step = make_step(cfg, config, tx, schedule, None, None)
        texts.append(step.lower(state, batch).as_text())
        numbers.append(jax.tree.leaves(step.numbers))
    assert texts[0] == texts[1]
    assert numbers[0] != numbers[1]


def test_fp8_dispatch_refused_where_the_exchange_is_the_fixed_all_to_all(tmp_path):
    """`moe-jax train` expert-parallel on 2 CPU devices (XLA:CPU's exchange: the fixed all_to_all,
    compute dtype only) with FP8 gradients asked for: one line naming the options, exit 2, no run
    directory."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {os.environ.get('XLA_FLAGS', '')}"}
    args = ["--config", "configs/tiny.yaml", "mesh=expert=2", "steps=1", "model.ep_gradient_dispatch=float8"]
    proc = subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", "train", *args, f"run_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.ep_dispatch / model.ep_gradient_dispatch: float8) needs the ragged exchange" in proc.stderr
    assert [line for line in proc.stderr.splitlines() if "error" in line] == [proc.stderr.strip().splitlines()[-1]]
    assert not (tmp_path / "run").exists()
