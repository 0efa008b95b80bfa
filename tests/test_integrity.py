"""Checkpoints users can trust: hub-cache layouts, destinations that never destroy an input, and
corruption caught by every reader of a converted checkpoint and of a training run.

Each hostile case runs the CLI in this process (`run_main`) and asserts: exit 2, exactly one
stderr line that names the file (and the parameter or tensor), no traceback, every input
byte-for-byte untouched, and no output that could pass for complete."""

import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models

import moe_jax
from converters.convert import convert_hf
from converters.jax_checkpoint import Checkpoint, rerecord
from moe_jax.files import FILES_RECORD, commit, discard, prepare_destination, temp_dirs
from tests.helpers import error_lines, run_main

EXPERT = "state/params.moe.experts.down/0.3.0.0"  # HF tensor model.layers.1.mlp.experts.3.down_proj.weight
EXPERT_HF = "model.layers.1.mlp.experts.3.down_proj.weight"


def digest(path: Path) -> dict[str, str]:
    """Every file (and link) below `path` -> a hash of its bytes: to prove an input untouched."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(path))] = "link:" + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_one_error(code, err, cmd, *words):
    lines = error_lines(err)
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"moe-jax {cmd}: error: "), lines
    assert "Traceback" not in err
    for w in words:
        assert str(w) in lines[0], (w, lines[0])


def assert_no_complete_output(dst: Path):
    assert not dst.exists() or not any(dst.iterdir()) or not (dst / "config.json").exists(), list(dst.iterdir())
    assert not temp_dirs(dst)


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    """A converted FP8 checkpoint with tokenizer side files, made once; tests damage copies."""
    root = tmp_path_factory.mktemp("integrity")
    src = root / "hf"
    shutil.copytree(checkpoints["wide_fp8_sharded"], src)
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    convert_hf(src, root / "jax", progress=False)
    return root / "jax"


@pytest.fixture
def damaged(converted, tmp_path):
    dst = tmp_path / "jax"
    shutil.copytree(converted, dst)
    return dst


def set_leaf(m: dict, name: str, **record) -> dict:
    return {**m, "leaves": {**m["leaves"], name: {**m["leaves"][name], **record}}}


def flip_byte(path: Path, at: int = 100):
    raw = bytearray(path.read_bytes())
    raw[at % len(raw)] ^= 0x10
    path.write_bytes(bytes(raw))


def edit_manifest(dst: Path, fn):
    m = json.loads((dst / "manifest.json").read_text())
    m = fn(m)
    (dst / "manifest.json").write_text(json.dumps(m))


def edit_json_and_rerecord(dst: Path, rel: str, fn):
    """Change a JSON file of the checkpoint on purpose and record the checksums again: only a
    check of the arrays against config.json can tell."""
    path = dst / rel
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))
    rerecord(dst)


def swap_down_shape(dst: Path):
    """params.moe.experts.down [L, E, a, b] -> [L, E, b, a], in its array's metadata and the manifest."""
    name = "params.moe.experts.down"
    swap = lambda s: s[:2] + s[2:][::-1]  # noqa: E731
    edit_json_and_rerecord(
        dst, f"state/{name}/.zarray", lambda z: {**z, "shape": swap(z["shape"]), "chunks": swap(z["chunks"])}
    )
    edit_json_and_rerecord(dst, "manifest.json", lambda m: set_leaf(m, name, shape=swap(m["leaves"][name]["shape"])))


# damage -> (what the message names)
DAMAGE = {
    "chunk deleted": (lambda d: (d / EXPERT).unlink(), [EXPERT, EXPERT_HF, "missing"]),
    "chunk truncated": (
        lambda d: (d / EXPERT).write_bytes((d / EXPERT).read_bytes()[:-7]),
        [EXPERT, EXPERT_HF, "bytes"],
    ),
    "chunk byte flipped": (lambda d: flip_byte(d / EXPERT), [EXPERT, EXPERT_HF, "checksum"]),
    "chunk emptied": (lambda d: (d / EXPERT).write_bytes(b""), [EXPERT, "0 bytes"]),
    "scale chunk flipped": (
        lambda d: flip_byte(d / "state/fp8_scales.moe.experts.down/0.3.0.0", 2),
        ["fp8_scales.moe.experts.down", "FP8 scales of tensor " + EXPERT_HF],
    ),
    "array metadata deleted": (
        lambda d: (d / "state/params.moe.experts.down/.zarray").unlink(),
        ["params.moe.experts.down/.zarray", "missing"],
    ),
    "array metadata altered": (
        lambda d: (d / "state/params.moe.experts.down/.zarray").write_text(
            (d / "state/params.moe.experts.down/.zarray").read_text().replace("bfloat16", "<f4")
        ),
        ["params.moe.experts.down/.zarray"],
    ),
    "embedding chunk flipped": (lambda d: flip_byte(d / "state/params.embed/0.0", 5), ["params.embed", "checksum"]),
    "config altered": (
        lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("1e-06", "2e-06")),
        ["config.json", "checksum"],
    ),
    "config deleted": (lambda d: (d / "config.json").unlink(), ["config.json", "missing"]),
    "manifest not JSON": (lambda d: (d / "manifest.json").write_text("{not json"), ["manifest.json", "JSON"]),
    "manifest a list": (lambda d: (d / "manifest.json").write_text("[]"), ["manifest.json", "object"]),
    "manifest leaves null": (lambda d: edit_manifest(d, lambda m: {**m, "leaves": None}), ["manifest.json", "leaves"]),
    "manifest leaf shape bad": (
        lambda d: edit_manifest(
            d, lambda m: {**m, "leaves": {**m["leaves"], "params.embed": {"shape": ["x"], "dtype": "bfloat16"}}}
        ),
        ["manifest.json", "params.embed"],
    ),
    "manifest leaf shape edited": (
        lambda d: edit_manifest(
            d, lambda m: set_leaf(m, "params.embed", shape=[n + 1 for n in m["leaves"]["params.embed"]["shape"]])
        ),
        ["manifest.json", "params.embed", "[301, 201]", "config.json implies bfloat16 [300, 200]"],
    ),
    "manifest leaf dtype edited": (
        lambda d: edit_manifest(d, lambda m: set_leaf(m, "params.moe.experts.down", dtype="float32")),
        ["manifest.json", "params.moe.experts.down", "config.json implies bfloat16"],
    ),
    "manifest files missing": (
        lambda d: edit_manifest(d, lambda m: {k: v for k, v in m.items() if k != "files"}),
        ["manifest.json", "integrity records"],
    ),
    "chunk not in the records": (
        lambda d: edit_manifest(d, lambda m: {**m, "files": {k: v for k, v in m["files"].items() if k != EXPERT}}),
        [EXPERT, EXPERT_HF, "not in the checkpoint's integrity records"],
    ),
    "config hidden_size edited, checksums rerecorded": (
        lambda d: edit_json_and_rerecord(d, "config.json", lambda c: {**c, "hidden_size": 100}),
        ["manifest.json", "params.embed", "[300, 200]", "config.json implies bfloat16 [300, 100]"],
    ),
    "array shape swapped in metadata and manifest, rerecorded": (
        swap_down_shape,
        [
            "manifest.json",
            "params.moe.experts.down",
            "[1, 8, 200, 136]",
            "config.json implies bfloat16 [1, 8, 136, 200]",
        ],
    ),
    "manifest tensor unmapped": (
        lambda d: edit_manifest(
            d,
            lambda m: {
                **m,
                "tensors": {
                    **m["tensors"],
                    EXPERT_HF: {"source_dtype": "F8_E4M3", "param": "params.nowhere", "index": [0]},
                },
            },
        ),
        ["manifest.json", EXPERT_HF],
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_export_refuses_a_damaged_checkpoint(damaged, tmp_path, case):
    make, words = DAMAGE[case]
    make(damaged)
    before = digest(damaged)
    out = tmp_path / "out"
    code, _, err = run_main("export", "--from", damaged, "--to", out)
    assert_one_error(code, err, "export", *words)
    assert digest(damaged) == before
    assert_no_complete_output(out)


READERS = ["verify", "from_pretrained", "validate", "train-init"]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", ["chunk deleted", "chunk byte flipped", "scale chunk flipped"])
def test_every_reader_refuses_a_damaged_checkpoint(damaged, checkpoints, tmp_path, reader, case):
    make, words = DAMAGE[case]
    make(damaged)
    before = digest(damaged)
    words = [w for w in words if w != "FP8 scales of tensor " + EXPERT_HF] if reader != "verify" else words
    if reader == "from_pretrained":
        if case == "scale chunk flipped":
            moe_jax.from_pretrained(damaged)  # the model does not read the FP8 scales: nothing to check
            return
        with pytest.raises(moe_jax.IntegrityError) as e:
            moe_jax.from_pretrained(damaged)
        assert all(str(w) in str(e.value) for w in words) and "\n" not in str(e.value)
    elif reader == "verify":
        assert_one_error(*run_main("verify", damaged)[::2], "verify", *words)
    elif reader == "validate":
        if case == "scale chunk flipped":
            return  # validate reads no FP8 scales either
        code, _, err = run_main(
            "validate",
            "--hf",
            checkpoints["wide_fp8_sharded"],
            "--jax",
            damaged,
            "--dtype",
            "bfloat16",
            "--tokens",
            "8",
        )
        assert_one_error(code, err, "validate", *words)
    else:
        if case == "scale chunk flipped":
            return
        run, tokenizer = tmp_path / "run", tmp_path / "tokenizer"  # a real one: the side file is a stand-in
        tokenizer.mkdir()
        Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>")).save(str(tokenizer / "tokenizer.json"))
        (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
        code, _, err = run_main(
            "train",
            "--config",
            "configs/tiny.yaml",
            f"run_dir={run}",
            f"model.init={damaged}",
            f"data.tokenizer={tokenizer}",
            "data.seq_len=8",  # each document is one token and an EOS to it
            "data.batch_size=1",
            "steps=1",
            "--quiet",
            "tensorboard=false",
        )
        assert_one_error(code, err, "train", *words)
        assert not (run / "model").exists()
    assert digest(damaged) == before


@pytest.mark.parametrize(
    "case",
    [
        "manifest leaf shape edited",
        "manifest leaf dtype edited",
        "config hidden_size edited, checksums rerecorded",
        "array shape swapped in metadata and manifest, rerecorded",
    ],
)
def test_from_pretrained_and_verify_check_the_arrays_against_the_config(damaged, case):
    make, words = DAMAGE[case]
    make(damaged)
    with pytest.raises(moe_jax.CheckpointError) as e:
        moe_jax.from_pretrained(damaged)
    assert all(str(w) in str(e.value) for w in words) and "\n" not in str(e.value), e.value
    assert_one_error(*run_main("verify", damaged)[::2], "verify", *words)


def test_a_missing_chunk_of_an_old_format_checkpoint_is_an_error(damaged, tmp_path):
    """moe-jax/1 has no checksums: a missing chunk file must not read back as zeros."""
    edit_manifest(damaged, lambda m: {k: v for k, v in m.items() if k != "files"} | {"format": "moe-jax/1"})
    (damaged / EXPERT).unlink()
    out = tmp_path / "out"
    code, _, err = run_main("export", "--from", damaged, "--to", out)
    assert code == 2, err
    assert "Traceback" not in err
    line = error_lines(err)[-1]
    assert line.startswith("moe-jax export: error: ") and "missing" in line, line
    assert str(damaged / EXPERT) in line and EXPERT_HF in line, line
    assert_no_complete_output(out)


def test_verify_says_ok_and_catches_added_files(converted, damaged, checkpoints):
    code, out, err = run_main("verify", converted)
    assert code == 0 and out.startswith(f"OK: {converted}: moe-jax checkpoint") and "every checksum matches" in out
    (damaged / "state" / "params.embed" / "0.1").write_bytes(b"x")
    assert_one_error(*run_main("verify", damaged)[::2], "verify", "params.embed/0.1", "not in the manifest")
    code, out, _ = run_main("verify", checkpoints["wide_fp8_sharded"])
    assert code == 0 and "HF checkpoint, 2 shard(s)" in out and "FP8" in out


def test_integrity_records_cover_every_file(converted):
    m = json.loads((converted / "manifest.json").read_text())
    on_disk = {p.relative_to(converted).as_posix() for p in converted.rglob("*") if p.is_file()}
    assert set(m["files"]) == on_disk - {"manifest.json"}
    assert "hf/tokenizer.json" in m["files"] and "config.json" in m["files"]
    assert Checkpoint(converted).verify()[0] == len(on_disk) - 1


# ---- destinations ------------------------------------------------------------------------------
@pytest.fixture
def src(checkpoints, tmp_path):
    path = tmp_path / "src"
    shutil.copytree(checkpoints["base_fp8_single"], path)
    return path


def _convert(src, dst, *flags):
    return run_main("convert", "--from", "hf", src, "--to", dst, *flags)


def _train(run_dir, init):
    return run_main("train", "--config", "configs/tiny.yaml", f"run_dir={run_dir}", f"model.init={init}", "--quiet")


def _link(target: Path, link: Path) -> Path:
    os.symlink(target, link)
    return link


def _file(path: Path) -> Path:
    path.write_text("keep")
    return path


# case -> (command, its run given (src, tmp_path), the path the message names, words it says)
DESTINATIONS = {
    "convert to its source": ("convert", lambda s, t: _convert(s, s, "--force"), "src", "is the input"),
    "convert to its source, no force": ("convert", lambda s, t: _convert(s, s), "src", "is the input"),
    "convert to the source's parent": ("convert", lambda s, t: _convert(s, t, "--force"), "", "contains the input"),
    "convert into its source": (
        "convert",
        lambda s, t: _convert(s, s / "sub"),
        "src/sub",
        "is inside the input",
    ),
    "convert to a link to the source": (
        "convert",
        lambda s, t: _convert(s, _link(s, t / "link"), "--force"),
        "link",
        "is the input",
    ),
    "convert whose work dir is the source": (
        "convert",
        lambda s, t: _convert(_dot_partial(s), t / "x"),
        ".x.partial",
        "is the input",
    ),
    "convert onto a file": ("convert", lambda s, t: _convert(s, _file(t / "f"), "--force"), "f", "not a directory"),
    "convert onto a foreign directory": (
        "convert",
        lambda s, t: _convert(s, _precious(t / "p"), "--force"),
        "p",
        "not a previous moe-jax checkpoint",
    ),
    "export to its source": (
        "export",
        lambda s, t: run_main("export", "--from", _conv(s, t), "--to", t / "jax", "--force"),
        "jax",
        "is the input",
    ),
    "export to the source's parent": (
        "export",
        lambda s, t: run_main("export", "--from", _conv(s, t), "--to", t, "--force"),
        "",
        "contains the input",
    ),
    "export into its source": (
        "export",
        lambda s, t: run_main("export", "--from", _conv(s, t), "--to", t / "jax" / "exp"),
        "jax/exp",
        "is inside the input",
    ),
    "export onto a foreign directory": (
        "export",
        lambda s, t: run_main("export", "--from", _conv(s, t), "--to", _precious(t / "p"), "--force"),
        "p",
        "not a previous HF checkpoint",
    ),
    "make-tiny onto a foreign directory": (
        "make-tiny",
        lambda s, t: run_main("make-tiny", _precious(t / "p"), "--force"),
        "p",
        "not a previous HF checkpoint",
    ),
    "make-tiny onto a checkpoint, no force": ("make-tiny", lambda s, t: run_main("make-tiny", s), "src", "--force"),
    "validate report into the checkpoint": (
        "validate",
        lambda s, t: run_main("validate", "--hf", s, "--report", s / "report.json"),
        "src/report.json",
        "would write into the input",
    ),
    "validate plot over the config": (
        "validate",
        lambda s, t: run_main("validate", "--hf", s, "--plot", s / "config.json"),
        "src/config.json",
        "would write into the input",
    ),
    "train into its init": ("train", lambda s, t: _train(s, s), "src", "is the input"),
    "train into a parent of its init": ("train", lambda s, t: _train(t, s), "", "contains the input"),
    "train inside its init": ("train", lambda s, t: _train(s / "run", s), "src/run", "is inside the input"),
}


def _precious(path: Path) -> Path:
    path.mkdir()
    (path / "notes.txt").write_text("keep me")
    return path


def _dot_partial(src: Path) -> Path:
    """The source, renamed to the work directory a convert to `x` beside it would use."""
    target = src.parent / ".x.partial"
    os.replace(src, target)
    return target


def _conv(src: Path, t: Path) -> Path:
    if not (t / "jax").exists():
        convert_hf(src, t / "jax", progress=False)
    return t / "jax"


@pytest.mark.parametrize("case", sorted(DESTINATIONS))
def test_no_command_destroys_its_input(src, tmp_path, case):
    cmd, run, named, words = DESTINATIONS[case]
    before = digest(tmp_path)
    code, _, err = run(src, tmp_path)
    assert_one_error(code, err, cmd, tmp_path / named if named else tmp_path, words)
    after = digest(tmp_path)
    for k, v in before.items():  # every file that existed before is unchanged
        moved = k.replace("src/", ".x.partial/", 1) if case == "convert whose work dir is the source" else k
        assert after.get(moved) == v, k
    for p in tmp_path.rglob("*"):  # and so is what the case itself set up
        if p.name in ("notes.txt", "f"):
            assert p.read_text().startswith("keep"), p
    assert not [p for p in tmp_path.rglob(".*.partial") if p.name != ".x.partial"]


@pytest.mark.parametrize("force", [False, True])
def test_two_converts_racing_to_one_destination_leave_one_intact_checkpoint(checkpoints, tmp_path, force):
    """Two processes convert to the same DST at once: each works in its own directory, and the
    second to finish either fails with one line (no --force) or replaces the first's output whole."""
    dst = tmp_path / "dst"
    cmd = [sys.executable, "-m", "moe_jax.cli", "convert", "--from", "hf", str(checkpoints["wide_fp8_sharded"])]
    cmd += ["--to", str(dst), "--workers", "1"] + (["--force"] if force else [])
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    results = [(p.wait(), p.stderr.read().decode()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == ([0, 0] if force else [0, 2]), results
    for code, err in results:  # the loser's one error line (after its progress bar, if it got that far)
        errors = [line for line in error_lines(err) if "error" in line]
        assert code == 0 or (len(errors) == 1 and f"{dst}: " in errors[0] and "--force" in errors[0]), err
    assert Checkpoint(dst).verify()
    assert not temp_dirs(dst)


def test_a_forced_commit_waiting_on_a_destination_replaced_meanwhile_replaces_the_new_one(tmp_path):
    """A --force run finishing while another run is replacing DST waits for it, then replaces what
    that run put there, rather than throwing its own finished output away."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "who").write_text("first")
    late, mine = (prepare_destination(dst, force=True) for _ in range(2))
    (late / "who").write_text("late")
    (mine / "who").write_text("mine")
    held = os.open(dst, os.O_RDONLY)  # the late run, in the middle of replacing DST
    fcntl.flock(held, fcntl.LOCK_EX)
    committing = threading.Thread(target=commit, args=(mine, dst))
    committing.start()
    time.sleep(0.5)  # let it find DST taken and wait on its lock
    os.rename(dst, tmp_path / "set-aside")
    os.rename(late, dst)  # the late run's output in place: DST is now another directory
    discard(late)  # (nothing left at that name) the late run ends: its lock is released
    os.close(held)
    committing.join(timeout=30)
    assert not committing.is_alive() and (dst / "who").read_text() == "mine"
    assert not temp_dirs(dst)


def test_a_live_runs_work_directory_is_kept_and_a_killed_runs_removed(src, tmp_path):
    dst = tmp_path / "dst"
    work = tmp_path / ".dst.0123abcd.partial"  # another run's, while it holds its lock
    _precious(work)
    fd = os.open(work, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert _convert(src, dst)[0] == 0
        assert (work / "notes.txt").read_text() == "keep me" and temp_dirs(dst) == [work]
    finally:
        os.close(fd)  # that run is gone: the next run to DST removes what it left
    assert _convert(src, dst, "--force")[0] == 0
    assert not temp_dirs(dst) and Checkpoint(dst).verify()


def test_a_stale_partial_that_is_a_link_is_removed_not_followed(src, tmp_path):
    precious = tmp_path / "precious"
    _precious(precious)
    dst = tmp_path / "dst"
    os.symlink(precious, tmp_path / ".dst.partial")
    code, _, err = _convert(src, dst)
    assert code == 0, err
    assert (precious / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / ".dst.partial").exists() and Checkpoint(dst).verify()


def test_outputs_honour_the_umask(src, tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    want = 0o666 & ~umask
    convert_hf(src, tmp_path / "jax", progress=False)
    run_main("make-tiny", tmp_path / "tiny")
    for path in (
        tmp_path / "jax/config.json",
        tmp_path / "jax/manifest.json",
        tmp_path / "tiny/config.json",
        tmp_path / "tiny/model.safetensors",
        tmp_path / "jax/state/params.embed/0.0",
    ):
        assert stat.S_IMODE(path.stat().st_mode) == want, path


def test_os_errors_are_one_line(src, tmp_path):
    (tmp_path / "file").write_text("x")
    code, _, err = _convert(src, tmp_path / "file" / "below")
    assert_one_error(code, err, "convert", tmp_path / "file")
    code, _, err = run_main("validate", "--hf", src, "--report", tmp_path / "no" / "such" / "dir" / "r.json")
    assert_one_error(code, err, "validate", tmp_path / "no" / "such" / "dir")


def test_damaged_checkpoint_in_a_fresh_process_prints_one_line(damaged, tmp_path):
    (damaged / EXPERT).unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", "export", "--from", str(damaged), "--to", str(tmp_path / "out")],
        capture_output=True,
    )
    err = proc.stderr.decode()  # bytes: text mode would turn the progress bar's carriage returns into newlines
    assert_one_error(proc.returncode, err, "export", EXPERT_HF)  # no shutdown noise either
    assert_no_complete_output(tmp_path / "out")


# ---- the huggingface_hub cache -----------------------------------------------------------------
def hub_cache(cache: Path, repo: str, files: Path, revision: str = "5f0c9d3e1b2a4c6d8e0f1a2b3c4d5e6f7a8b9c0d") -> Path:
    """Lay out `files` exactly as huggingface_hub caches a repo: content-addressed blobs (sha256
    for large files, git blob sha1 for small ones), a snapshot of relative symlinks, refs/main."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True)
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in sorted(files.iterdir()):
        raw = f.read_bytes()
        if f.suffix == ".safetensors":
            blob = hashlib.sha256(raw).hexdigest()
        else:
            blob = hashlib.sha1(b"blob %d\0" % len(raw) + raw).hexdigest()
        (repo_dir / "blobs" / blob).write_bytes(raw)
        os.symlink(f"../../blobs/{blob}", snapshot / f.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    return snapshot


def test_sharded_fp8_checkpoint_from_the_hub_cache(checkpoints, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    src = checkpoints["wide_fp8_sharded"]
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "tiny-org/tiny-dsv3-fp8", src)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    # the layout is huggingface_hub's own: its cache scanner and resolver read it
    info = huggingface_hub.scan_cache_dir(cache)
    assert [r.repo_id for r in info.repos] == ["tiny-org/tiny-dsv3-fp8"] and not info.warnings
    shard = huggingface_hub.try_to_load_from_cache(
        "tiny-org/tiny-dsv3-fp8", "model-00001-of-00002.safetensors", cache_dir=cache
    )
    assert Path(shard).is_symlink() and Path(shard).parent == snapshot

    code, out, err = run_main(
        "convert", "--from", "hf", "tiny-org/tiny-dsv3-fp8", "--to", tmp_path / "jax", "--dtype", "float32"
    )
    assert code == 0, err
    code, out, err = run_main("validate", "--hf", "tiny-org/tiny-dsv3-fp8", "--jax", tmp_path / "jax", "--tokens", "16")
    assert code == 0, out + err
    code, out, err = run_main("verify", "tiny-org/tiny-dsv3-fp8")
    assert code == 0 and "2 shard(s)" in out, err
    tokens = np.arange(32, dtype=np.int32).reshape(2, 16)
    from_hub = moe_jax.from_pretrained("tiny-org/tiny-dsv3-fp8")(tokens)
    np.testing.assert_array_equal(np.asarray(from_hub), np.asarray(moe_jax.from_pretrained(src)(tokens)))
    # a repo that is not cached, offline: one line that says so
    code, _, err = run_main("convert", "--from", "hf", "tiny-org/absent", "--to", tmp_path / "x")
    assert_one_error(code, err, "convert", "tiny-org/absent", "not in the local hub cache", "HF_HUB_OFFLINE")
    with pytest.raises(moe_jax.CheckpointError, match="tiny-org/absent: .*not in the local hub cache"):
        moe_jax.from_pretrained("tiny-org/absent")


# ---- training checkpoints ----------------------------------------------------------------------
def test_resume_checks_the_step_checkpoint_and_sets_aside_unrecorded_ones(tmp_path):
    run = tmp_path / "run"
    args = [
        "train",
        "--config",
        "configs/tiny.yaml",
        f"run_dir={run}",
        "steps=2",
        "checkpoint.every=1",
        "--quiet",
        "tensorboard=false",
    ]
    code, _, err = run_main(*args)
    assert code == 0, err
    step2 = run / "checkpoints" / "2"
    assert (step2 / FILES_RECORD).exists() and (run / "checkpoints" / "1" / FILES_RECORD).exists()
    assert run_main("verify", step2)[0] == 0
    # damage the latest step: resuming names the file and how to go back one checkpoint
    data_files = sorted(
        p for p in step2.rglob("*") if p.is_file() and p.stat().st_size > 1000 and p.name != FILES_RECORD
    )
    flip_byte(data_files[0])
    # resumed to 4 steps (no more checkpoints): the step compiled for every tiny.yaml run (the
    # schedule's length is an input of it)
    more = ["steps=4", "checkpoint.every=1000", "--resume"]
    code, _, err = run_main(*args, *more)
    assert_one_error(code, err, "train", data_files[0], "checksum", f"remove {step2}")
    # a step whose integrity was never recorded (killed in between) is set aside, not resumed from
    (step2 / FILES_RECORD).unlink()
    code, out, err = run_main(*args, *more)
    assert code == 0, err
    assert (run / "unverified-checkpoints" / "2").is_dir()
    assert "resumed from" in out and "(step 1)" in out


def test_from_pretrained_names_unsupported_dtypes(checkpoints):
    import jax.numpy as jnp

    src = checkpoints["base_bf16_single"]
    assert moe_jax.from_pretrained(src, dtype=jnp.bfloat16, compute_dtype="float32").param_dtype == jnp.bfloat16
    for bad in ("fp16", "int8", 3):
        with pytest.raises(moe_jax.CheckpointError, match="float32, bfloat16, float16"):
            moe_jax.from_pretrained(src, dtype=bad)
