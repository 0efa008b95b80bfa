"""Training data for `moe-jax train`: tokenizers, document sources, packing and the batch pipeline.

    text files ──read_documents──► documents ──tokenizer──► one flat token stream (EOS after each doc)
    .npy token arrays ─────────────────────────────────────►  ″
    stream ──PackedDataset──► rows of seq_len + 1 tokens with segment ids (random access)
    rows ──batches──► shuffled, repeated, per-process batches; batch n depends only on (seed, n)

Text sources are tokenized once at startup, which suits corpora of up to a few hundred MB. Tokenize
larger ones ahead of time with `tokenize_to_npy`; a .npy stream is memory-mapped, not loaded.
"""

from __future__ import annotations

import base64
import functools
import glob
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from pydoc_data.topics import topics

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tiktoken
from tokenizers import Tokenizer

from moe_jax.errors import one_line
from moe_jax.files import atomic_write

BUILTIN = ("python-docs",)  # built-in sources: English text that ships with Python
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
SUFFIXES = TEXT_SUFFIXES + (".npy",)
_ENCODE_CHUNK = 256  # documents per encode_batch call


# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as token ids, for models without a tokenizer.json (the built-in tiny model).

    With vocab_size > 256 the ids are the 256 byte values and EOS is 256. With vocab_size == 256
    there is no spare id, so EOS is byte 0 (NUL), which text practically never contains; NUL
    characters in the text are dropped so that EOS stays unambiguous.
    """

    def __init__(self, vocab_size: int = 257):
        if vocab_size < 256:
            raise ValueError(f"byte tokenizer needs a vocabulary of at least 256 ids, the model has {vocab_size}")
        self.eos_id = 256 if vocab_size > 256 else 0
        self.vocab_size = max(self.eos_id + 1, 256)

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8")
        if self.eos_id == 0:
            data = data.replace(b"\0", b"")
        return list(data)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256 and i != self.eos_id).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json through the `tokenizers` library (no remote code, no pickles)."""

    def __init__(self, tokenizer, eos_id: int):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.eos_id = int(eos_id)
        self.vocab_size = max([*tokenizer.get_vocab(with_added_tokens=True).values(), self.eos_id]) + 1

    def encode(self, text: str) -> list[int]:
        """Ids exactly as `Tokenizer.encode(text)` gives them (special tokens such as BOS included)."""
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))


# Kimi's pre-tokenizer pattern, as its tokenization_kimi.py (which we never run) builds it: runs of
# Han characters apart; words with their capitals and English contractions; numbers of up to three
# digits; punctuation; whitespace. `&&` is a class intersection, which tiktoken's regex engine reads.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# tokenizer_config.json's tokenizer_class -> the pattern its (remote) code uses; tiktoken.model
# itself holds only the ranks
TIKTOKEN_PATTERNS = {"TikTokenTokenizer": KIMI_PATTERN}


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token) rank` per line, ranks 0, 1, 2, ... each once."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            token, rank = base64.b64decode(token, validate=True), int(rank)
        except ValueError:
            raise ValueError(f"{path}:{number}: not a 'base64-token rank' line") from None
        if token in ranks or rank != len(ranks):
            raise ValueError(f"{path}:{number}: rank {rank} (expected {len(ranks)}, each token once)")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    return ranks


class TiktokenTokenizer:
    """A checkpoint's tiktoken BPE (`tiktoken.model` and `tokenizer_config.json`, as Kimi ships
    them), built from those files alone. Special tokens take the ids after the last rank, up to the
    model's vocabulary: named as tokenizer_config.json's added_tokens_decoder names them, the rest
    `<|reserved_token_{id}|>` (as Kimi's code names them). Special tokens written in the text are
    read as such, and text is cut where Kimi's code cuts it (every 400,000 characters and in
    runs of over 25,000 spaces or non-spaces)."""

    MAX_CHARS, MAX_RUN = 400_000, 25_000

    def __init__(self, model_file: Path, vocab_size: int):
        config_file = model_file.parent / "tokenizer_config.json"
        if not config_file.is_file():
            raise ValueError(
                f"{model_file}: no tokenizer_config.json beside it (it names the tokenizer and its special tokens)"
            )
        try:
            config = _read_json(config_file)
        except ValueError as e:
            raise ValueError(f"{config_file}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_file}: not a JSON object")
        added = config.get("added_tokens_decoder")
        if not isinstance(added, (dict, type(None))):
            raise ValueError(f"{config_file}: added_tokens_decoder must be an object, got {added!r:.60}")
        kind = config.get("tokenizer_class")
        if kind not in TIKTOKEN_PATTERNS:
            raise ValueError(
                f"{config_file}: tokenizer_class {kind!r}: no known pre-tokenizer pattern for {model_file.name} "
                f"(known: {', '.join(TIKTOKEN_PATTERNS)})"
            )
        self.ranks = read_tiktoken_ranks(model_file)
        base = len(self.ranks)
        named = {}
        for key, entry in (added or {}).items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not key.isdigit() or not isinstance(content, str) or not base <= int(key) < vocab_size:
                raise ValueError(
                    f"{config_file}: added token {key}: {entry!r:.60} is not a special token id in [{base}, {vocab_size})"
                )
            named[int(key)] = content
        self.specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(base, vocab_size)}
        self.encoding = tiktoken.Encoding(
            model_file.name, pat_str=TIKTOKEN_PATTERNS[kind], mergeable_ranks=self.ranks, special_tokens=self.specials
        )
        self.vocab_size = max(vocab_size, base)

    def token_to_id(self, token: str) -> int | None:
        return self.specials.get(token, self.ranks.get(token.encode()))

    def encode(self, text: str) -> list[int]:
        return [i for piece in self._pieces(text) for i in self.encoding.encode(piece, allowed_special="all")]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(list(ids))

    def _pieces(self, text: str) -> Iterator[str]:
        """The text in pieces of at most MAX_CHARS, each cut again inside any run of more than
        MAX_RUN spaces or non-spaces."""
        for start in range(0, max(len(text), 1), self.MAX_CHARS):
            chunk = text[start : start + self.MAX_CHARS]
            if not _LONG_RUN.search(chunk):
                yield chunk
                continue
            cut, run, space = 0, 0, chunk[:1].isspace()
            for i, c in enumerate(chunk):
                if c.isspace() != space:
                    run, space = 1, c.isspace()
                elif run == self.MAX_RUN:
                    yield chunk[cut:i]
                    cut, run = i, 1
                else:
                    run += 1
            yield chunk[cut:]


_LONG_RUN = re.compile(rf"\s{{{TiktokenTokenizer.MAX_RUN + 1}}}|\S{{{TiktokenTokenizer.MAX_RUN + 1}}}")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _eos_id(tok_file: Path, tokenizer, search: Sequence[Path]) -> int:
    """EOS from tokenizer_config.json's eos_token, else from config.json's eos_token_id."""
    for d in search:
        token = _read_json(d / "tokenizer_config.json").get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            eos = tokenizer.token_to_id(token)
            if eos is None:
                raise ValueError(f"{d / 'tokenizer_config.json'}: eos_token {token!r} is not in {tok_file}")
            return eos
    for d in search:
        eos = _read_json(d / "config.json").get("eos_token_id")
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if isinstance(eos, int):
            return eos
    raise ValueError(
        f"{tok_file}: no EOS token (no eos_token in tokenizer_config.json, no eos_token_id in config.json)"
    )


TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")


def load_tokenizer(checkpoint_dir: str | os.PathLike | None, vocab_size: int, required: bool = False):
    """The checkpoint's tokenizer.json (in DIR or DIR/hf; DIR may also be the file itself), else its
    tiktoken.model, else the byte tokenizer, unless `required` (a tokenizer the user named:
    FileNotFoundError naming DIR); ids must fit vocab_size."""
    search, tiktoken_files = [], []
    if checkpoint_dir is not None:
        d = Path(checkpoint_dir)
        if d.is_file() and d.name in TOKENIZER_FILES:
            d = checkpoint_dir = d.parent
        search = [p for p in (d, d / "hf") if (p / "tokenizer.json").is_file()]
        tiktoken_files = [p / "tiktoken.model" for p in (d, d / "hf") if (p / "tiktoken.model").is_file()]
        if required and not search and not tiktoken_files:
            what = "no such directory" if not d.exists() else f"no {' or '.join(TOKENIZER_FILES)} in it or its hf/"
            raise FileNotFoundError(f"{checkpoint_dir}: {what}")
    if not search and tiktoken_files:
        tok = TiktokenTokenizer(tiktoken_files[0], vocab_size)
        tok.eos_id = _eos_id(tiktoken_files[0], tok, [tiktoken_files[0].parent, Path(checkpoint_dir)])
        if tok.vocab_size > vocab_size:
            raise ValueError(
                f"{tiktoken_files[0]}: token ids go up to {tok.vocab_size - 1}, the model's vocab_size is {vocab_size}"
            )
        return tok
    if not search:
        return ByteTokenizer(vocab_size)
    tok_file = search[0] / "tokenizer.json"
    try:
        raw = Tokenizer.from_file(str(tok_file))
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ValueError(f"{tok_file}: not a tokenizer the tokenizers library can read ({e})") from None
    tok = HFTokenizer(raw, _eos_id(tok_file, raw, [search[0], Path(checkpoint_dir)]))
    if tok.vocab_size > vocab_size or tok.eos_id >= vocab_size:
        raise ValueError(f"{tok_file}: token ids go up to {tok.vocab_size - 1}, the model's vocab_size is {vocab_size}")
    return tok


# ----------------------------------------------------------------------------- sources


def source_files(spec) -> list:
    """Built-in names and files of `spec` (a path, directory, glob pattern or built-in name, or a
    list of them); FileNotFoundError naming the first that does not exist, ValueError naming one
    that is not a path or a name."""
    items = [spec] if isinstance(spec, (str, os.PathLike)) or not isinstance(spec, Iterable) else list(spec)
    out = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise ValueError(
                f"data source {item!r}: expected a file, directory, glob pattern or built-in name {BUILTIN}"
            )
        s = os.fspath(item)
        p = Path(s)
        if s in BUILTIN:
            out.append(s)
        elif p.is_dir():
            files = _once(sorted(f for f in _walk(p) if suffix(f) in SUFFIXES))
            if not files:
                raise FileNotFoundError(f"{p}: no {', '.join(SUFFIXES)} files in this directory")
            out += files
        elif p.is_file():  # a name with [, * or ? in it is still this file
            out.append(p)
        elif glob.has_magic(s):
            files = _once(sorted(Path(f) for f in glob.glob(s, recursive=True) if Path(f).is_file()))
            if not files:
                raise FileNotFoundError(f"{s}: no file matches this pattern")
            out += files
        else:
            raise FileNotFoundError(f"{s}: no such file, directory or pattern, and not a built-in source {BUILTIN}")
    for f in out:
        if isinstance(f, Path) and suffix(f) not in SUFFIXES:
            raise ValueError(f"{f}: unsupported file type (expected {', '.join(SUFFIXES)})")
    return out


def suffix(path: Path) -> str:
    """A source file's kind: its suffix, in any case (.TXT is .txt)."""
    return path.suffix.lower()


def _once(files: list[Path]) -> list[Path]:
    """`files` with each real file once (the first of the names that reach it through symlinks)."""
    seen, out = set(), []
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


def _walk(directory: Path) -> Iterator[Path]:
    """Every file under `directory`, through symlinked directories too (each real one once)."""
    seen = set()
    for root, dirs, files in os.walk(directory, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a symlink back up the tree, or a second link to one directory
            dirs[:] = []
            continue
        seen.add(real)
        yield from (Path(root) / f for f in files if (Path(root) / f).is_file())


def source_roots(spec) -> list[tuple[Path, int | None]]:
    """Where a data source spec reads files: (directory, how many levels below it; None: all) for
    a directory (all) and a glob pattern (its leading directory, as deep as the pattern reaches,
    all with `**`). A run writing where files are read would feed its own files back as data."""
    items = [spec] if isinstance(spec, (str, os.PathLike)) or not isinstance(spec, Iterable) else list(spec)
    roots = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)) or os.fspath(item) in BUILTIN:
            continue
        s = os.fspath(item)
        if Path(s).is_dir():
            roots.append((Path(s), None))
        elif glob.has_magic(s) and not Path(s).is_file():
            parts = Path(s).parts
            fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
            reach = None if "**" in parts[fixed:] else len(parts) - fixed
            roots.append((Path(*parts[:fixed]) if fixed else Path("."), reach))
    return roots


def _python_docs() -> Iterator[str]:
    for name in sorted(topics):
        yield topics[name]


def _jsonl(path: Path) -> Iterator[str]:
    with open(path, "rb") as f:  # JSON Lines: lines end in \n; each is decoded alone to name it
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {e.start} of the line: {e.reason})") from None
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a 'text' field ({e})") from None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: 'text' is {type(text).__name__}, not a string")
            yield text


def _parquet(path: Path) -> Iterator[str]:
    try:
        f = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a Parquet file pyarrow can read ({one_line(e)})") from None
    if "text" not in f.schema_arrow.names:
        raise ValueError(f"{path}: no 'text' column (columns: {', '.join(f.schema_arrow.names)})")
    row = 0
    for batch in f.iter_batches(columns=["text"]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise ValueError(f"{path}: row {row}: 'text' is {type(text).__name__}, not a string")
            row += 1
            yield text


def _documents(source) -> Iterator[str]:
    if source == "python-docs":
        yield from _python_docs()
    elif suffix(source) == ".txt":
        try:
            with open(source, encoding="utf-8", newline="") as f:  # line ends as written (\r\n stays)
                text = f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        yield text
    elif suffix(source) == ".jsonl":
        yield from _jsonl(source)
    elif suffix(source) == ".parquet":
        yield from _parquet(source)
    else:
        raise ValueError(f"{source}: pre-tokenized, not text; read it with load_stream")


def read_documents(spec) -> Iterator[str]:
    """Non-empty text documents of `spec`: python-docs, .txt (a file), .jsonl / .parquet (a 'text' each)."""
    for source in source_files(spec):
        for doc in _documents(source):
            if doc:
                yield doc


# ----------------------------------------------------------------------------- token stream


def _load_npy(path: Path, vocab_size: int) -> np.ndarray:
    with open(path, "rb") as f:  # else np.load takes it for a pickle and says so
        if f.read(len(np.lib.format.MAGIC_PREFIX)) != np.lib.format.MAGIC_PREFIX:
            raise ValueError(f"{path}: not a NumPy .npy file (no .npy header)")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # an object array, a truncated file
        raise ValueError(f"{path}: not a readable .npy token array ({e})") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{path}: expected a 1-D integer token array, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        raise ValueError(
            f"{path}: token ids {int(arr.min())}..{int(arr.max())} outside the vocabulary 0..{vocab_size - 1}"
        )
    return arr


def _encode(docs: Iterable[str], tokenizer) -> Iterator[np.ndarray]:
    """Each document's ids followed by EOS (unless the tokenizer already ended it with EOS)."""
    docs = iter(docs)
    while True:
        chunk = [d for _, d in zip(range(_ENCODE_CHUNK), docs)]
        if not chunk:
            return
        for ids in tokenizer.encode_batch(chunk):
            if not ids or ids[-1] != tokenizer.eos_id:
                ids = [*ids, tokenizer.eos_id]
            yield np.asarray(ids, np.int32)


def load_stream(spec, tokenizer) -> np.ndarray:
    """One flat 1-D token stream of `spec`, EOS after each document; a single .npy is memory-mapped."""
    parts = []
    for source in source_files(spec):
        if isinstance(source, Path) and suffix(source) == ".npy":
            parts.append(_load_npy(source, tokenizer.vocab_size))
        else:
            parts += _encode((d for d in _documents(source) if d), tokenizer)
    parts = [p for p in parts if p.size]
    if not parts:
        raise ValueError(f"{spec}: no tokens")
    if len(parts) == 1:
        return parts[0]
    eos = np.array([tokenizer.eos_id], np.int32)  # keep documents of different .npy files apart
    parts = [q for p in parts for q in ((p,) if p[-1] == tokenizer.eos_id else (p, eos))]
    return np.concatenate(parts).astype(np.int32, copy=False)


def tokenize_to_npy(spec, tokenizer, out_path: str | os.PathLike) -> Path:
    """Tokenize `spec` once into an int32 .npy stream (written atomically), for large corpora."""
    out = Path(out_path)
    if out.suffix != ".npy":
        raise ValueError(f"{out}: the output must be a .npy file")
    stream = np.asarray(load_stream(spec, tokenizer), np.int32)
    return atomic_write(out, lambda f: np.save(f, stream, allow_pickle=False))


# ----------------------------------------------------------------------------- packing


class PackedDataset:
    """Rows of seq_len + 1 consecutive stream tokens, with segment ids; random access.

    Row i is stream[i*S : i*S + S + 1]: consecutive rows share one token, so that with
    inputs = tokens[:-1] and targets = tokens[1:] every stream token after the first is a target
    exactly once (no padding, nothing lost but the last partial row). segment_ids number the
    documents within a row 1, 2, 3, ...; a new segment starts right after each EOS. `source` names
    the stream's data in the error for a stream shorter than one row.
    """

    def __init__(self, stream: np.ndarray, seq_len: int, eos_id: int, source="data.source"):
        if stream.ndim != 1:
            raise ValueError(f"the token stream must be 1-D, got shape {stream.shape}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.stream, self.seq_len, self.eos_id = stream, seq_len, eos_id
        self.num_rows = (len(stream) - 1) // seq_len
        if self.num_rows < 1:
            raise ValueError(
                f"{source}: a stream of {len(stream)} tokens is shorter than one row of data.seq_len + 1 = {seq_len + 1}"
            )

    def __len__(self) -> int:
        return self.num_rows

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of what the rows hold: seq_len, the stream's length and 64 blocks of its tokens
        spread over it (so a resume over other data, or the same data cut or tokenized another way,
        is told apart without reading a corpus of billions of tokens whole)."""
        h = hashlib.sha256(f"{self.seq_len} {len(self.stream)}".encode())
        block = 4096
        for start in np.linspace(0, max(len(self.stream) - block, 0), 64).astype(np.int64):
            h.update(np.asarray(self.stream[start : start + block], np.int64).tobytes())
        return h.hexdigest()[:32]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        i = int(i)
        if not 0 <= i < self.num_rows:
            raise IndexError(f"row {i} out of range 0..{self.num_rows - 1}")
        start = i * self.seq_len
        tokens = np.asarray(self.stream[start : start + self.seq_len + 1], np.int32)
        segment_ids = np.ones(len(tokens), np.int32)
        segment_ids[1:] += np.cumsum(tokens[:-1] == self.eos_id, dtype=np.int32)
        return dict(tokens=tokens, segment_ids=segment_ids)


def positions_from_segments(segment_ids: np.ndarray) -> np.ndarray:
    """Positions that restart at 0 where each segment starts, along the last axis (row or batch)."""
    seg = np.asarray(segment_ids)
    idx = np.arange(seg.shape[-1])
    starts = np.ones(seg.shape, bool)
    starts[..., 1:] = seg[..., 1:] != seg[..., :-1]
    first = np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)
    return (idx - first).astype(np.int32)


# ----------------------------------------------------------------------------- pipeline


class Batches:
    """Endless per-process batches of a dataset's rows, reshuffled every epoch (see `batches`)."""

    def __init__(
        self, dataset, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1, start_step: int = 0
    ):
        if batch_size < 1 or batch_size % process_count:
            raise ValueError(
                f"batch_size {batch_size} must be a positive multiple of the process count {process_count}"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in 0..{process_count - 1}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.num_rows, self.batch_size, self.seed = len(dataset), batch_size, seed
        self.fingerprint = getattr(dataset, "fingerprint", None)  # what the rows hold (PackedDataset)
        self.steps_per_epoch = self.num_rows // batch_size
        if self.steps_per_epoch < 1:
            raise ValueError(f"batch_size {batch_size} is larger than the dataset ({self.num_rows} rows)")
        self.local_batch = batch_size // process_count
        self.offset = process_index * self.local_batch
        self.step = start_step
        # Row k of epoch e is self.rows[e * num_rows + k]: each epoch is a fresh permutation.
        self.rows = grain.MapDataset.source(dataset).shuffle(seed=seed).repeat()

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's share of global batch `step` (a pure function of seed and step)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        first = epoch * self.num_rows + k * self.batch_size + self.offset
        rows = [self.rows[first + j] for j in range(self.local_batch)]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        out = self.batch(self.step)
        self.step += 1
        return out

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self.step // self.steps_per_epoch

    @property
    def state(self) -> dict:
        """JSON-serializable; resume with batches(..., seed=state["seed"], start_step=state["step"])."""
        state = dict(
            step=self.step, seed=self.seed, batch_size=self.batch_size, num_rows=self.num_rows, epoch=self.epoch
        )
        return state if self.fingerprint is None else {**state, "fingerprint": self.fingerprint}


def batches(
    dataset, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1, start_step: int = 0
) -> Batches:
    """Iterator of dicts of numpy arrays [batch_size // process_count, S + 1], from `start_step` on.

    Deterministic: batch n depends only on (seed, n), so a run resumed at start_step=n yields what
    an uninterrupted one would have from step n. Each epoch is a new Grain shuffle of the whole
    dataset cut into len(dataset) // batch_size global batches of distinct rows (the remainder, a
    different few rows each epoch, is skipped); process p takes the p-th contiguous slice of
    batch_size // process_count rows of each global batch.
    """
    return Batches(dataset, batch_size, seed, process_index, process_count, start_step)
