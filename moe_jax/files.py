"""Files and directories that every moe-jax command writes and reads: one way to do each.

- `atomic_write`: a file appears whole or not at all (temp file, fsync, rename), with the
  permissions any file the user creates gets (0666 less the umask).
- `prepare_destination` / `commit`: an output directory is built in `.<name>.partial` beside
  it and renamed into place when complete; `--force` replaces only a previous output of the same
  kind, and never a directory that the command reads (`refuse_overlap`).
- `file_records` / `verify_files`: the size and crc32 of every file of a directory, recorded when
  it is written and checked before anything is read from it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Mapping

from moe_jax.errors import CheckpointError, IntegrityError, one_line


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable) -> Path:
    """Write `path` whole or not at all. `data`: bytes, text, or a function of a binary file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes 0600: honour the umask like open() does
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | os.PathLike, obj, indent: int | None = 1) -> Path:
    return atomic_write(path, json.dumps(obj, indent=indent))


def json_kind(value) -> str:
    """How JSON names a value's type, for error messages."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    return kinds.get(type(value), "an array" if isinstance(value, list) else "an object")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object_pairs_hook: a JSON object whose keys are unique (json keeps the last)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise CheckpointError(f"key {key!r} appears twice")
        out[key] = value
    return out


def load_json_unique(data: str | bytes, path: Path, what: str):
    """`data` parsed as JSON, duplicate keys refused; errors name `path` and `what`."""
    try:
        return json.loads(data, object_pairs_hook=_unique_keys)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {what}: {e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: {what} is not valid JSON ({one_line(e)})") from None


def read_json_object(path: str | os.PathLike, what: str) -> dict:
    """A JSON file that must hold an object; any other content is a one-line CheckpointError."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found ({what})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    obj = load_json_unique(data, path, what)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, not {json_kind(obj)}")
    return obj


# ---- destinations ------------------------------------------------------------------------------
def remove(path: Path) -> None:
    """Remove a file, a directory tree, or a symbolic link itself (never what it points to)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def refuse_overlap(dst: str | os.PathLike, inputs: Iterable[str | os.PathLike], flag: str = "--to") -> None:
    """Refuse a destination that is one of the inputs or contains one (symlinks resolved), so that
    replacing it could destroy what the command reads."""
    out = Path(os.path.realpath(dst))
    for p in inputs:
        real = Path(os.path.realpath(p))
        if _inside(real, out):
            what = "is" if real == out else "contains"
            raise CheckpointError(f"{dst}: the destination ({flag}) {what} the input {p}; choose another destination")


def refuse_write_into(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], flag: str) -> None:
    """Refuse an output file that is an input file or lies inside an input directory (it would
    replace what the command reads, or add an unrecorded file to a checkpoint)."""
    target = Path(os.path.realpath(out))
    for p in inputs:
        if _inside(target, Path(os.path.realpath(p))):
            raise CheckpointError(f"{out}: {flag} would write into the input {p}; choose another path")


def work_paths(dst: Path) -> tuple[Path, Path]:
    """The directories beside DST that a write uses: the work directory and the previous DST."""
    return dst.parent / f".{dst.name}.partial", dst.parent / f".{dst.name}.old"


def prepare_destination(
    dst: str | os.PathLike,
    force: bool,
    inputs: Iterable[str | os.PathLike] = (),
    replaceable: Callable[[Path], bool] = lambda p: True,
    kind: str = "output",
) -> Path:
    """Check DST and return a fresh work directory beside it.

    A non-empty DST needs `force`, and even then is replaced only if `replaceable(DST)` (it holds
    a previous output of this kind). DST, its work directory and its backup may not be, nor
    contain, any of the `inputs`."""
    dst = Path(dst)
    work, old = work_paths(dst)
    inputs = list(inputs)
    for path in (dst, work, old):
        refuse_overlap(path, inputs)
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise CheckpointError(f"{dst}: exists and is not a directory; refusing to replace it")
    if dst.exists() and any(dst.iterdir()):
        if not force:
            raise CheckpointError(f"{dst}: exists and is not empty (use --force to replace it)")
        if not replaceable(dst):
            raise CheckpointError(f"{dst}: is not a previous {kind}; refusing to replace it even with --force")
    if not dst.parent.is_dir():
        dst.parent.mkdir(parents=True, exist_ok=True)
    remove(work)  # a stale work directory (or a link of that name) from a killed run
    work.mkdir()
    os.chmod(work, 0o777 & ~UMASK)
    return work


def commit(work: Path, dst: Path) -> None:
    """Move the finished work directory to DST; an old DST is removed only after that."""
    _, old = work_paths(dst)
    remove(old)
    if dst.exists():
        os.replace(dst, old)
    os.replace(work, dst)
    remove(old)
    fsync_file(dst.parent)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file (or a directory's entries) to disk; a no-op where the OS refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- integrity ---------------------------------------------------------------------------------
CHUNK = 16 * 2**20


def file_crc32(path: Path) -> tuple[int, int]:
    """(size, crc32) of a file, read in 16 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc


def walk_files(root: Path, skip: Iterable[str] = ()) -> list[str]:
    """Every regular file below `root`, as sorted '/'-separated relative paths."""
    skip = set(skip)
    out = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = Path(dirpath, name).relative_to(root).as_posix()
            if rel not in skip:
                out.append(rel)
    return sorted(out)


def file_records(
    root: str | os.PathLike, skip: Iterable[str] = (), known: Mapping[str, tuple[int, int]] = {}, workers: int = 4
) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of every file below `root` except `skip`. `known`: records
    computed while writing (used when the size on disk agrees), so only the rest are read."""
    root = Path(root)

    def record(rel: str) -> list[int]:
        if rel in known and (root / rel).stat().st_size == known[rel][0]:
            return list(known[rel])
        return list(file_crc32(root / rel))

    rels = walk_files(root, skip)
    with ThreadPoolExecutor(workers) as pool:  # zlib releases the GIL: files hash in parallel
        return dict(zip(rels, pool.map(record, rels)))


def verify_files(
    root: str | os.PathLike,
    records: Mapping[str, list[int]],
    only: Iterable[str] | None = None,
    describe: Callable[[str], str] = lambda rel: "",
    workers: int = 4,
) -> int:
    """Check files below `root` against their records (all, or those in `only`); returns the bytes
    checked. Raises IntegrityError naming the first bad file and what it holds (`describe`)."""
    root = Path(root)
    names = sorted(records if only is None else only)

    def check(rel: str) -> int:
        what = describe(rel)
        where = f"{root / rel}{f' ({what})' if what else ''}"
        if rel not in records:
            raise IntegrityError(f"{where}: not in the checkpoint's integrity records")
        size, crc = records[rel]
        path = root / rel
        if not path.is_file():
            raise IntegrityError(f"{where}: missing (the checkpoint is incomplete or damaged)")
        try:
            got_size, got_crc = file_crc32(path)
        except OSError as e:
            raise IntegrityError(f"{where}: cannot read ({e.strerror or e})") from None
        if got_size != size:
            raise IntegrityError(f"{where}: {got_size} bytes, recorded {size} (truncated or overwritten)")
        if got_crc != crc:
            raise IntegrityError(f"{where}: checksum mismatch (altered since it was written)")
        return size

    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(check, names))


FILES_RECORD = "moe-jax-files.json"  # the integrity records of a directory without a manifest


def record_directory(root: str | os.PathLike) -> None:
    """Write the integrity records of every file below `root` into `root/moe-jax-files.json`."""
    root = Path(root)
    write_json(root / FILES_RECORD, {"format": "moe-jax-files/1", "files": file_records(root, skip=[FILES_RECORD])})


def verify_directory(root: str | os.PathLike) -> int:
    """Check a directory written with `record_directory`; returns the bytes checked."""
    root = Path(root)
    record = read_json_object(root / FILES_RECORD, "integrity records")
    files = record.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{root / FILES_RECORD}: 'files' is not an object")
    on_disk = set(walk_files(root, skip=[FILES_RECORD]))
    extra = sorted(on_disk - set(files))
    if extra:
        raise IntegrityError(
            f"{root / extra[0]}: not in the integrity records (added after the checkpoint was written)"
        )
    return verify_files(root, files)
