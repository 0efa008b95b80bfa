"""The command line, as a user runs it."""

import json
import subprocess
import sys

import pytest

from converters.tiny import make_tiny
from tests.helpers import error_lines, run_main


def moe_jax(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "moe_jax.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_quickstart_runs_the_whole_pipeline(tmp_path):
    """README's first command: parity, convert, validation gate, training, FP8 export, reload."""
    proc = moe_jax("quickstart", "--workdir", str(tmp_path), "--steps", "20")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("PASS (float32)") == 2 and proc.stdout.count("PASS (bfloat16)") == 1, proc.stdout
    assert "validation passed" in proc.stdout
    assert (tmp_path / "tiny-hf" / "model.safetensors.index.json").exists()
    assert (tmp_path / "tiny-jax" / "manifest.json").exists()
    losses = [json.loads(line)["ce_loss"] for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0
    assert (tmp_path / "train" / "metrics.png").exists()
    config = json.loads((tmp_path / "trained-hf" / "config.json").read_text())
    assert config["quantization_config"]["fmt"] == "e4m3"


def test_make_tiny_then_validate_writes_report(tmp_path):
    """In this process (the quickstart above runs the commands in a fresh one)."""
    ckpt = tmp_path / "flat"
    assert run_main("make-tiny", ckpt, "--variant", "flat", "--dtype", "bfloat16")[0] == 0
    report = tmp_path / "report.json"
    code, _, err = run_main("validate", "--hf", ckpt, "--tokens", "16", "--dtype", "float32", "--report", report)
    assert code == 0, err[-2000:]
    data = json.loads(report.read_text())
    assert data["pass"] is True and data["logits"]["max_abs"] < 1e-4 and len(data["layers"]) == 3


def test_bad_numbers_name_their_flag(tmp_path):
    """Refused by the argument parsing, before any work (exit 2)."""
    ckpt = make_tiny(tmp_path / "tiny")  # max_position_embeddings 256
    cases = [
        (("validate", "--hf", ckpt, "--tokens", "0"), "argument --tokens: must be >= 1, got 0"),
        (("validate", "--hf", ckpt, "--tokens", "-3"), "argument --tokens: must be >= 1, got -3"),
        (("validate", "--hf", ckpt, "--batch", "0"), "argument --batch: must be >= 1, got 0"),
        (
            ("validate", "--hf", ckpt, "--tokens", "100000"),
            "--tokens 100000: more than the model's max_position_embeddings (256",
        ),
        (
            ("export", "--from", ckpt, "--to", tmp_path / "x", "--shard-size", "0"),
            "argument --shard-size: expected a positive size",
        ),
        (
            ("export", "--from", ckpt, "--to", tmp_path / "x", "--shard-size", "-5"),
            "argument --shard-size: expected a positive size",
        ),
        (
            ("export", "--from", ckpt, "--to", tmp_path / "x", "--shard-size", "abc"),
            "argument --shard-size: expected a positive size",
        ),
        *(
            (
                ("export", "--from", ckpt, "--to", tmp_path / "x", "--shard-size", size),
                "argument --shard-size: expected",
            )
            for size in ("inf", "1e400", "nan", "5XB")
        ),
        (
            ("export", "--from", ckpt, "--to", tmp_path / "x", "--workers", "0"),
            "argument --workers: must be >= 1, got 0",
        ),
        (
            ("convert", "--from", "hf", ckpt, "--to", tmp_path / "x", "--workers", "0"),
            "argument --workers: must be >= 1",
        ),
        (("quickstart", "--workdir", tmp_path / "q", "--steps", "0"), "argument --steps: must be >= 1, got 0"),
    ]
    for args, message in cases:
        code, out, err = run_main(*args)
        assert code == 2 and len(err.splitlines()) == 1 and message in err, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_output_paths_are_checked_before_the_work(tmp_path):
    """A file that cannot be written is refused by the argument parsing (the validation and the
    plan's compile never start), naming the user's path and its flag."""
    ckpt = make_tiny(tmp_path / "tiny")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "a_dir").mkdir()
    under_a_file, nowhere = tmp_path / "a_file" / "out.json", tmp_path / "no" / "dir" / "out.json"
    cases = [
        (("validate", "--hf", ckpt, "--report", nowhere), "--report", f"{nowhere}: no directory {nowhere.parent}"),
        (
            ("validate", "--hf", ckpt, "--plot", under_a_file),
            "--plot",
            f"{under_a_file}: no directory {tmp_path / 'a_file'}",
        ),
        (
            ("validate", "--hf", ckpt, "--report", tmp_path / "a_dir"),
            "--report",
            f"{tmp_path / 'a_dir'}: is a directory",
        ),
        (
            ("plan", "--config", "configs/tiny.yaml", "--json", tmp_path / "a_dir"),
            "--json",
            f"{tmp_path / 'a_dir'}: is a directory",
        ),
        (("plan", "--config", "configs/tiny.yaml", "--json", nowhere), "--json", str(nowhere)),
        (("plot", tmp_path, "--out", tmp_path / "a_dir"), "--out", f"{tmp_path / 'a_dir'}: is a directory"),
    ]
    for args, flag, message in cases:
        code, out, err = run_main(*args)
        lines = err.splitlines()
        assert code == 2 and len(lines) == 1 and not out, (args, err)
        assert lines[0].startswith(f"moe-jax {args[0]}: error: argument {flag}: {message}"), lines
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["a_dir", "a_file", "tiny", *(p.name for p in ckpt.iterdir())]
    )


SOURCE = "data.source: expected a file, directory, glob pattern or built-in name, or a list of them, got"


@pytest.mark.parametrize(
    "name, content, override, message",
    [
        ("bad.txt", b"\xff\xfe\x00bad \x80", "data.source={}", "{}: not UTF-8 text (byte 0: invalid start byte)"),
        ("bad.jsonl", b'{"text": "ok"}\n\xff\xfe{"text":"x"}\n', "data.source={}", "{}:2: not UTF-8 text (byte 0"),
        ("obj.npy", b"not npy\n", "data.source={}", "{}: not a NumPy .npy file (no .npy header)"),
        (
            "short.txt",
            b"hi",
            "data.source={}",
            "data.source={}: a stream of 3 tokens is shorter than one row of data.seq_len",
        ),
        (None, None, "data.source=5", f"{SOURCE} 5"),
        (None, None, "data.source=null", f"{SOURCE} None"),
        ("run.yaml", b"steps: 2\nrun_dir: x\xff\n", None, "{}: not UTF-8 text (byte 19: invalid start byte)"),
        (None, None, "optim.lr=[", "override 'optim.lr=[': the value of optim.lr is not valid YAML: line 1, column 2"),
    ],
    ids=[
        "txt-not-utf8",
        "jsonl-not-utf8",
        "npy-not-npy",
        "shorter-than-a-row",
        "source-5",
        "source-null",
        "config-not-utf8",
        "override-not-yaml",
    ],
)
def test_bad_training_input_is_one_line_naming_the_file_or_key(tmp_path, name, content, override, message):
    """`moe-jax train` on data or a config it cannot read: exit 2, one line naming the file or the
    config key, no traceback, no run directory."""
    path = tmp_path / name if name else None
    if path:
        path.write_bytes(content)
    config = path if name == "run.yaml" else "configs/tiny.yaml"
    args = [override.format(path)] if override else []
    code, out, err = run_main("train", "--config", config, "--quiet", f"run_dir={tmp_path / 'run'}", *args)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"moe-jax train: error: {message.format(path)}"), lines
    assert not (tmp_path / "run").exists()


def test_no_command_writes_over_what_it_reads(tmp_path):
    """Outputs that would replace an input (or each other) are refused before any work."""
    ckpt = make_tiny(tmp_path / "tiny")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\n")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0}\n')
    config = tmp_path / "run.yaml"
    config.write_text("steps: 2\n")
    (tmp_path / "qs" / "train").mkdir(parents=True)
    (tmp_path / "qs" / "train" / "notes.txt").write_text("keep")
    cases = [
        (("validate", "--hf", ckpt, "--prompts", prompts, "--plot", prompts), "--plot would write into the input"),
        (("validate", "--hf", ckpt, "--report", tmp_path / "r", "--plot", tmp_path / "r"), "name one file"),
        (("plot", metrics, "--out", metrics), "--out would write into the input"),
        (("plan", "--config", config, "--target", "cpu", "--json", config), "--json would write into the input"),
        (("quickstart", "--workdir", tmp_path / "qs"), "is not a previous quickstart's run"),
        (("validate", "--hf", ckpt, "--seed", "-1"), "argument --seed: must be in [0, 2**63), got -1"),
    ]
    for args, words in cases:
        code, _, err = run_main(*args)
        assert code == 2 and len(error_lines(err)) == 1 and words in err, (args, err)
    assert prompts.read_text() == "the quick brown fox\n" and config.read_text() == "steps: 2\n"
    assert metrics.read_text().startswith('{"step": 1') and (tmp_path / "qs" / "train" / "notes.txt").exists()
    prompts.write_bytes(b"\xff\xfeabc\n")
    kimi = make_tiny(tmp_path / "kimi", "kimi-k2")  # (a checkpoint with a tokenizer)
    code, _, err = run_main("validate", "--hf", kimi, "--prompts", prompts)
    assert code == 2 and f"{prompts}: not UTF-8 text" in err, err
