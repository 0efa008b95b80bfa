"""What a new user meets first: fast and honest commands, configs checked whole before any work,
outputs others can read, no noise, make-tiny doing what it says."""

import os
import stat
import subprocess
import sys

import pytest

from converters.convert import convert_hf
from converters.tiny import make_tiny
from moe_jax import data
from moe_jax.train.config import ConfigError, load_config
from moe_jax.train.loop import train
from tests.helpers import run_main


@pytest.mark.parametrize("argv", [["--help"], ["convert"], ["train", "--nope"], ["validate", "--dtype", "fp16"]])
def test_help_and_argument_errors_import_nothing_heavy(argv):
    """They answer before jax, torch or numpy load (each takes seconds on a busy machine)."""
    code = (
        "import sys\nfrom moe_jax.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    assert e.code in (0, 2), e.code\nheavy = [m for m in ('jax', 'torch', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_yaml_errors_name_line_and_column(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("steps: 5\nmodel:\n  init: tiny\n   seed: [1\n")
    with pytest.raises(ConfigError, match=r"run\.yaml: not valid YAML: line 4, column 8: "):
        load_config(bad)
    # a key given twice (plain YAML keeps the last; a repeated section would replace the first whole)
    for text, where in (
        ("steps: 2\nsteps: 3\n", "line 2, column 1"),
        ("data:\n  seed: 1\ndata:\n  seq_len: 8\n", "line 3"),
    ):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=rf"run\.yaml: not valid YAML: {where}.*given twice"):
            load_config(bad)


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.param_dtype=fp16", "model.param_dtype: 'fp16' is not one of float32, bfloat16, float16"),
        ("model.compute_dtype=half", "model.compute_dtype: 'half'"),
        ("model.backend=cutlass", "model.backend: unknown grouped-GEMM backend 'cutlass'"),
        ("model.remat=some", "model.remat: 'some'"),
        ("export_dtype=int8", "export_dtype: 'int8'"),
        ("validate.dtype=float16", "validate.dtype: 'float16'"),
        ("xla_preset=fast", "xla_preset: 'fast'"),
        ("checkpoint.every=0", "checkpoint.every must be >= 1"),
    ],
)
def test_choices_are_checked_when_the_config_loads(override, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, [override])


def test_a_bad_data_source_fails_before_the_validation_gate(tmp_path):
    """The whole run config is checked before the (long) validation gate: with a data source that
    does not exist and a validation source that does not either, the data source is reported."""
    hf = make_tiny(tmp_path / "hf")
    convert_hf(hf, tmp_path / "jax", progress=False)
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.init={tmp_path / 'jax'}",
            "validate.required=true",
            f"validate.hf={tmp_path / 'no-such-hf'}",
            f"data.source={tmp_path / 'no-such-data.txt'}",
        ],
    )
    with pytest.raises((ValueError, OSError), match="no-such-data"):
        train(cfg, progress=False, log=lambda *a: None)


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_make_tiny_writes_the_shards_asked_for(tmp_path, shards):
    out = make_tiny(tmp_path / "tiny", shards=shards)
    assert len(list(out.glob("*.safetensors"))) == shards


def test_a_training_run_is_quiet_and_readable_by_others(tmp_path):
    """A normal run prints no library warnings (Orbax's OCDBT notice) and writes every file with
    the permissions the umask gives, like any other file the user creates."""
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    run = tmp_path / "run"
    # configs/tiny.yaml: the training tests' compiled step (from the cache), not a compilation of its own
    args = ["--config", "configs/tiny.yaml", f"run_dir={run}", "steps=2", "checkpoint.every=1"]
    old = os.umask(0o022)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "moe_jax.cli", "train", "--quiet", *args], capture_output=True, text=True, env=env
        )
        plot_code, _, plot_err = run_main("plot", run)
    finally:
        os.umask(old)
    assert proc.returncode == 0 and plot_code == 0, proc.stderr[-3000:] + plot_err[-2000:]
    assert "WARNING" not in proc.stderr and "Skipping merge" not in proc.stderr, proc.stderr[-3000:]
    for rel in ("config.yaml", "metrics.jsonl", "metrics.png", "model/config.json", "model/manifest.json"):
        assert stat.S_IMODE((run / rel).stat().st_mode) == 0o644, rel
    step_files = [p for p in (run / "checkpoints").rglob("*") if p.is_file()]
    assert step_files and all(stat.S_IMODE(p.stat().st_mode) & 0o044 == 0o044 for p in step_files)


def test_an_unreadable_tokenizer_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match=f"{tmp_path / 'tokenizer.json'}: not a tokenizer"):
        data.load_tokenizer(tmp_path, 256)
