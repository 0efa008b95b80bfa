"""Files and directories that every moe-jax command writes and reads: one way to do each.

- `atomic_write`: a file appears whole or not at all (temp file, fsync, rename), with the
  permissions any file the user creates gets (0666 less the umask).
- `prepare_destination` / `commit`: an output directory is built in a work directory of its own
  beside it (`.<name>.<hex>.partial`) and renamed into place when complete; `--force` replaces
  only a previous output of the same kind, and never a directory that the command reads
  (`refuse_overlap`); two runs to one destination never leave a mix of both.
- `file_records` / `verify_files`: the size and crc32 of every file of a directory, recorded when
  it is written and checked before anything is read from it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import sys
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
    """Refuse a destination that is one of the inputs, contains one, or lies inside one (symlinks
    resolved): replacing it could destroy what the command reads, or writing into an input
    directory would add files to it."""
    out = Path(os.path.realpath(dst))
    for p in inputs:
        real = Path(os.path.realpath(p))
        if _inside(real, out):
            what = "is" if real == out else "contains"
            raise CheckpointError(f"{dst}: the destination ({flag}) {what} the input {p}; choose another destination")
        if _inside(out, real):
            raise CheckpointError(
                f"{dst}: the destination ({flag}) is inside the input {p}; choose another destination"
            )


def refuse_write_into(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], flag: str) -> None:
    """Refuse an output file that is an input file or lies inside an input directory (it would
    replace what the command reads, or add an unrecorded file to a checkpoint)."""
    target = Path(os.path.realpath(out))
    for p in inputs:
        if _inside(target, Path(os.path.realpath(p))):
            raise CheckpointError(f"{out}: {flag} would write into the input {p}; choose another path")


# Each write to DST builds its output in its own work directory `.DST.<8 hex>.partial` beside it,
# and sets a replaced DST aside as `.DST.<same hex>.old` until the new one is in place. The run
# holds a lock (flock) on both while it lives: one that nobody holds is debris of a killed run.
# (`.DST.partial` and `.DST.old`: the names an older moe-jax used.)
@dataclasses.dataclass
class _Run:
    lock: int  # the open, flock-ed work directory
    force: bool
    replaceable: Callable[[Path], bool]
    kind: str


_RUNS: dict[Path, _Run] = {}


def temp_dirs(dst: str | os.PathLike) -> list[Path]:
    """The work directories and backups beside DST, of runs now writing it or killed."""
    dst = Path(dst)
    pattern = re.compile(rf"\.{re.escape(dst.name)}(\.[0-9a-f]{{8}})?\.(partial|old)")
    if not dst.parent.is_dir():
        return []
    return sorted(p for p in dst.parent.iterdir() if pattern.fullmatch(p.name))


NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # a file system without flock (Lustre's default)


def _lock(path: Path, wait: bool) -> int | None:
    """An open descriptor of the directory `path`, locked; None if another process holds its
    lock (and `wait` is false) or it is gone. Where the file system has no locks: the descriptor
    if `wait` (our own directory, or DST), else None (a directory we cannot tell is debris)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            return fd  # still the directory of that name, not one removed while we waited
    except (BlockingIOError, FileNotFoundError):
        pass
    except OSError as e:
        if e.errno not in NO_LOCKS:
            os.close(fd)
            raise
        if wait:
            return fd
    os.close(fd)
    return None


def remove_stale(dst: Path, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Remove the work directories and backups of killed runs to DST (never one a live run holds,
    nor an input); a link of such a name is removed, never followed. On a file system without
    locks none can be told from a live run's: they are named on stderr, for the user to remove."""
    inputs = list(inputs)
    for path in temp_dirs(dst):
        refuse_overlap(path, inputs)
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        elif (fd := _lock(path, wait=False)) is not None:
            try:
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)
        elif not _has_locks(path):
            print(
                f"{path}: left by another run, live or killed (this file system has no locks to tell); "
                "remove it if no run is writing it",
                file=sys.stderr,
            )


def _has_locks(path: Path) -> bool:
    """Whether the file system of the directory `path` supports flock."""
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as e:
        return e.errno not in NO_LOCKS
    finally:
        os.close(fd)
    return True


def prepare_destination(
    dst: str | os.PathLike,
    force: bool,
    inputs: Iterable[str | os.PathLike] = (),
    replaceable: Callable[[Path], bool] = lambda p: True,
    kind: str = "output",
) -> Path:
    """Check DST and return a new work directory beside it, this run's own, for `commit` (or
    `discard`) to end.

    A non-empty DST needs `force`, and even then is replaced only if `replaceable(DST)` (it holds
    a previous output of this kind). DST may not be, contain, nor lie inside any of the `inputs`."""
    dst = Path(dst)
    inputs = list(inputs)
    refuse_overlap(dst, inputs)
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise CheckpointError(f"{dst}: exists and is not a directory; refusing to replace it")
    if dst.exists() and any(dst.iterdir()):
        _check_replace(dst, force, replaceable, kind)
    if not dst.parent.is_dir():
        dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dst, inputs)
    while True:
        work = dst.parent / f".{dst.name}.{secrets.token_hex(4)}.partial"
        try:
            work.mkdir()
        except FileExistsError:
            continue
        if (fd := _lock(work, wait=True)) is not None:  # None: another run's remove_stale took it
            _RUNS[work] = _Run(fd, force, replaceable, kind)
            return work


def _check_replace(dst: Path, force: bool, replaceable: Callable[[Path], bool], kind: str, meanwhile: str = "") -> None:
    if not force:
        raise CheckpointError(f"{dst}: {meanwhile or 'exists and is not empty'} (use --force to replace it)")
    if not replaceable(dst):
        raise CheckpointError(f"{dst}: is not a previous {kind}; refusing to replace it even with --force")


def commit(work: Path, dst: Path) -> None:
    """Move the finished work directory to DST. A DST that another run wrote meanwhile is replaced
    only as `force` and `replaceable` allow; on any failure the work directory is removed."""
    run = _RUNS[work]
    old, old_lock = work.with_name(work.name.removesuffix(".partial") + ".old"), None
    try:
        while old_lock is None:
            try:
                os.rename(work, dst)  # fails if DST is not empty: only then is there one to replace
                break
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            _check_replace(dst, run.force, run.replaceable, run.kind, "was written by another run while this one ran")
            # waits for a run still replacing DST; None: DST was replaced or removed meanwhile, and
            # what is there now is checked again
            if (old_lock := _lock(dst, wait=True)) is not None:
                os.rename(dst, old)
                os.rename(work, dst)
    except BaseException:
        if old_lock is not None and old.exists() and not dst.exists():
            os.rename(old, dst)  # DST as it was (the rename above failed or was interrupted)
        discard(work)
        raise
    finally:
        if old_lock is not None:
            if not old.exists() or dst.exists():
                shutil.rmtree(old, ignore_errors=True)
            os.close(old_lock)
    os.close(_RUNS.pop(work).lock)
    fsync_file(dst.parent)


def discard(work: Path) -> None:
    """Remove a work directory that will not be committed, and release its lock."""
    remove(work)
    run = _RUNS.pop(work, None)
    if run is not None:
        os.close(run.lock)


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
