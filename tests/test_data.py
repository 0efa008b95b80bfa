"""The training data pipeline: tokenizers, sources, packing, and the Grain batch pipeline."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from moe_jax.data import (
    ByteTokenizer,
    HFTokenizer,
    PackedDataset,
    batches,
    load_stream,
    load_tokenizer,
    positions_from_segments,
    read_documents,
    tokenize_to_npy,
)

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs, then pack it again.",
    "How vexingly quick daft zebras jump over the dog and the fox!",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A checkpoint directory with a real BPE tokenizer.json trained on TEXT, EOS '</s>'."""
    d = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT * 5, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>", "lstrip": False}}))
    return d


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("vocab", [256, 300])
def test_byte_tokenizer_round_trip(vocab):
    tok = ByteTokenizer(vocab)
    text = "héllo wörld – 東京 🚀\n"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size <= vocab and tok.eos_id < vocab
    assert tok.eos_id not in ids
    assert tok.eos_id == (0 if vocab == 256 else 256)
    assert load_tokenizer(None, vocab).eos_id == tok.eos_id
    with pytest.raises(ValueError):
        ByteTokenizer(200)


def test_byte_tokenizer_vocab_256_drops_nul():
    tok = ByteTokenizer(256)
    assert tok.encode("a\0b") == [97, 98]


def test_tokenizer_json(hf_dir, tmp_path):
    tok = load_tokenizer(hf_dir, vocab_size=1000)
    assert isinstance(tok, HFTokenizer)
    ref = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in TEXT + ["the lazy zebras"]:
        assert tok.encode(text) == ref.encode(text).ids
    assert tok.encode_batch(TEXT) == [ref.encode(t).ids for t in TEXT]
    assert tok.eos_id == ref.token_to_id("</s>")
    assert tok.vocab_size == ref.get_vocab_size()

    # A converted JAX checkpoint keeps the tokenizer in DIR/hf; EOS may come from config.json.
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert load_tokenizer(tmp_path, 1000).eos_id == 1
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    assert load_tokenizer(tmp_path, 1000).eos_id == ref.token_to_id("<unk>")


def test_tokenizer_errors(hf_dir, tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json.*vocab_size is 50"):
        load_tokenizer(hf_dir, vocab_size=50)
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no EOS"):
        load_tokenizer(tmp_path, 1000)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    with pytest.raises(ValueError, match="tokenizer_config.json.*not in"):
        load_tokenizer(tmp_path, 1000)


# ----------------------------------------------------------------------------- sources


def test_text_sources(tmp_path):
    (tmp_path / "b.txt").write_text(TEXT[1])
    (tmp_path / "a.txt").write_text(TEXT[0])
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"text": TEXT[2]}) + "\n\n" + json.dumps({"text": "ünï", "id": 3}) + "\n"
    )
    pq.write_table(pa.table({"text": ["p0", "p1"], "n": [0, 1]}), tmp_path / "d.parquet")
    (tmp_path / "notes.md").write_text("skipped in directories")
    want = [TEXT[0], TEXT[1], TEXT[2], "ünï", "p0", "p1"]
    assert list(read_documents(tmp_path)) == want
    assert list(read_documents(str(tmp_path / "*.txt"))) == TEXT[:2]
    assert list(read_documents([tmp_path / "d.parquet", tmp_path / "a.txt"])) == ["p0", "p1", TEXT[0]]

    tok = ByteTokenizer(257)
    stream = load_stream(tmp_path, tok)
    assert stream.dtype == np.int32
    assert stream.tolist() == [i for d in want for i in [*d.encode(), 256]]


def test_source_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2:"):
        list(read_documents(bad))
    bad.write_text(json.dumps({"text": "ok"}) + "\n\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3:"):
        list(read_documents(bad))
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nt.parquet")
    with pytest.raises(ValueError, match=r"nt\.parquet: no 'text' column"):
        list(read_documents(tmp_path / "nt.parquet"))
    with pytest.raises(FileNotFoundError):
        list(read_documents(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError):
        list(read_documents(str(tmp_path / "*.none")))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported"):
        list(read_documents(tmp_path / "x.csv"))
    # bytes that are not UTF-8: the file (and the JSON line) named, one line
    (tmp_path / "latin.txt").write_bytes(b"ok\n\xff\xfe\x00bad \x80")
    with pytest.raises(ValueError, match=r"latin\.txt: not UTF-8 text \(byte 3: invalid start byte\)$"):
        list(read_documents(tmp_path / "latin.txt"))
    bad.write_bytes(json.dumps({"text": "ok"}).encode() + b"\n\xff\xfe" + json.dumps({"text": "x"}).encode() + b"\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not UTF-8 text \(byte 0 of the line: invalid start byte\)$"):
        list(read_documents(bad))
    # a spec that is not a path, a pattern, a built-in name or a list of them
    for spec in (5, None, [tmp_path / "latin.txt", 5]):
        with pytest.raises(ValueError, match=r"^data source (5|None): expected a file, directory"):
            list(read_documents(spec))


def test_sources_read_as_named(tmp_path):
    """Files in symlinked subdirectories and with suffixes in capitals are read like the rest; a
    file whose name holds glob characters is that file; .txt line ends stay as written; an
    unreadable Parquet file is named."""
    shard = tmp_path / "elsewhere"
    shard.mkdir()
    (shard / "b.txt").write_text("B")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("A")
    (src / "C.TXT").write_text("C")
    (src / "shard").symlink_to(shard, target_is_directory=True)
    (src / "shard" / "loop").symlink_to(src, target_is_directory=True)  # read once, no endless walk
    assert sorted(read_documents(src)) == ["A", "B", "C"]
    assert sorted(read_documents(str(src / "**" / "*.txt"))) == ["A", "B"]  # glob's own rules
    literal = tmp_path / "data[1].txt"
    literal.write_text("literal")
    assert list(read_documents(literal)) == ["literal"]
    (tmp_path / "crlf.txt").write_bytes(b"a\r\nb\rc")
    assert load_stream(tmp_path / "crlf.txt", ByteTokenizer(257)).tolist() == [97, 13, 10, 98, 13, 99, 256]
    (tmp_path / "corrupt.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"corrupt\.parquet: not a Parquet file pyarrow can read"):
        list(read_documents(tmp_path / "corrupt.parquet"))


def test_a_named_tokenizer_must_be_there(hf_dir, tmp_path):
    """A tokenizer the user names is required: a missing path or a directory without one is an
    error, not the byte tokenizer; the tokenizer.json file itself names its directory."""
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_tokenizer(tmp_path / "missing", 1000, required=True)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tiktoken.model in it"):
        load_tokenizer(tmp_path, 1000, required=True)
    assert isinstance(load_tokenizer(tmp_path, 1000), ByteTokenizer)  # a checkpoint without one: bytes
    assert isinstance(load_tokenizer(hf_dir / "tokenizer.json", 1000, required=True), HFTokenizer)
    empty = Tokenizer(models.WordLevel({}, unk_token="[UNK]"))  # no vocabulary at all: its EOS bounds it
    assert HFTokenizer(empty, eos_id=0).vocab_size == 1


def test_python_docs():
    from pydoc_data.topics import topics

    docs = list(read_documents("python-docs"))
    assert len(docs) == len(topics) > 50
    assert sum(map(len, docs)) > 300_000
    assert docs == [topics[k] for k in sorted(topics)]
    stream = load_stream("python-docs", ByteTokenizer(256))
    assert (stream == 0).sum() == len(docs) and stream.max() < 256


def test_npy_stream_and_tokenize_to_npy(hf_dir, tmp_path):
    tok = load_tokenizer(hf_dir, 1000)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT))
    out = tokenize_to_npy(tmp_path / "a.jsonl", tok, tmp_path / "tokens.npy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "tokens.npy"]  # no temporary file left
    want = [i for t in TEXT for i in [*Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(t).ids, tok.eos_id]]
    stream = load_stream(out, tok)
    assert isinstance(stream, np.memmap) and stream.tolist() == want

    # Several .npy files: concatenated, with an EOS between files where a file does not end in one.
    np.save(tmp_path / "b.npy", np.array([5, 6, 7], np.uint16))
    assert load_stream([out, tmp_path / "b.npy", out], tok).tolist() == want + [5, 6, 7, tok.eos_id] + want
    np.save(tmp_path / "big.npy", np.array([5, 5000]))
    with pytest.raises(ValueError, match=r"big\.npy: token ids"):
        load_stream(tmp_path / "big.npy", tok)
    np.save(tmp_path / "f.npy", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match=r"f\.npy: expected a 1-D integer"):
        load_stream(tmp_path / "f.npy", tok)
    # not a .npy file (text, empty, a pickle), or an object array: named, never unpickled
    for content in (b"not npy\n", b"", b"\x80\x04K\x05."):
        (tmp_path / "obj.npy").write_bytes(content)
        with pytest.raises(ValueError, match=r"obj\.npy: not a NumPy \.npy file \(no \.npy header\)$"):
            load_stream(tmp_path / "obj.npy", tok)
    np.save(tmp_path / "obj.npy", np.array([1, "a"], object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"obj\.npy: not a readable \.npy token array \(.*Python objects"):
        load_stream(tmp_path / "obj.npy", tok)


# ----------------------------------------------------------------------------- packing


def naive_rows(stream, seq_len, eos):
    """Per-token loop: rows of seq_len + 1 with stride seq_len, segment ids and positions."""
    out = []
    for i in range((len(stream) - 1) // seq_len):
        toks = [int(t) for t in stream[i * seq_len : i * seq_len + seq_len + 1]]
        seg, pos, s, p = [], [], 1, 0
        for k, t in enumerate(toks):
            if k > 0 and toks[k - 1] == eos:
                s, p = s + 1, 0
            seg.append(s)
            pos.append(p)
            p += 1
        out.append((toks, seg, pos))
    return out


@pytest.mark.parametrize("seq_len", [1, 7, 16])
def test_packing(seq_len):
    rng = np.random.default_rng(seq_len)
    eos = 0
    stream = rng.integers(1, 9, 200).astype(np.int32)
    stream[rng.choice(200, 25, replace=False)] = eos
    ds = PackedDataset(stream, seq_len, eos)
    assert len(ds) == (len(stream) - 1) // seq_len
    rows = [ds[i] for i in range(len(ds))]
    # Rows tile the stream: each row's last token is the next row's first.
    assert np.concatenate([r["tokens"][:-1] for r in rows]).tolist() == stream[: len(ds) * seq_len].tolist()
    assert rows[-1]["tokens"][-1] == stream[len(ds) * seq_len]
    for r, (toks, seg, pos) in zip(rows, naive_rows(stream, seq_len, eos)):
        assert r["tokens"].dtype == r["segment_ids"].dtype == np.int32
        assert r["tokens"].tolist() == toks and r["segment_ids"].tolist() == seg
        assert positions_from_segments(r["segment_ids"]).tolist() == pos
        changes = np.flatnonzero(np.diff(r["segment_ids"])) + 1
        assert (r["tokens"][changes - 1] == eos).all() and (r["tokens"][:-1] == eos).sum() == len(changes)
    batched = np.stack([r["segment_ids"] for r in rows])
    assert positions_from_segments(batched).tolist() == [p for _, _, p in naive_rows(stream, seq_len, eos)]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="shorter than one row"):
        PackedDataset(stream[:seq_len], seq_len, eos)
    with pytest.raises(ValueError, match=rf"^data\.source: a stream of {seq_len} tokens .* data\.seq_len \+ 1 = "):
        PackedDataset(stream[:seq_len], seq_len, eos)
    with pytest.raises(ValueError, match=r"^docs/\*\.txt: a stream of"):
        PackedDataset(stream[:seq_len], seq_len, eos, source="docs/*.txt")


# ----------------------------------------------------------------------------- pipeline


def row_ids(batch, seq_len):
    """Which dataset row each batch row is (the stream is arange, so the first token tells)."""
    return (batch["tokens"][:, 0] // seq_len).tolist()


@pytest.fixture
def ds():
    return PackedDataset(np.arange(8 * 37 + 1, dtype=np.int32), 8, eos_id=-1)  # 37 distinct rows


def take(it, n):
    return [next(it) for _ in range(n)]


def test_pipeline_deterministic_and_resumable(ds):
    run = take(batches(ds, 6, seed=3), 20)
    again = take(batches(ds, 6, seed=3), 20)
    other = take(batches(ds, 6, seed=4), 20)
    for a, b in zip(run, again):
        assert a.keys() == {"tokens", "segment_ids"} and a["tokens"].shape == (6, 9)
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["segment_ids"], b["segment_ids"])
    assert any((a["tokens"] != b["tokens"]).any() for a, b in zip(run, other))

    it = batches(ds, 6, seed=3)
    take(it, 7)
    state = json.loads(json.dumps(it.state))
    assert state["step"] == 7 and state["epoch"] == 7 // (37 // 6)
    resumed = take(batches(ds, 6, seed=state["seed"], start_step=state["step"]), 13)
    for a, b in zip(run[7:], resumed):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["segment_ids"], b["segment_ids"])


@pytest.mark.parametrize("num_rows,batch_size", [(36, 6), (37, 4)])
def test_pipeline_epochs(num_rows, batch_size):
    ds = PackedDataset(np.arange(8 * num_rows + 1, dtype=np.int32), 8, eos_id=-1)
    spe = num_rows // batch_size  # full batches per epoch; the remainder rows are skipped
    it = batches(ds, batch_size, seed=0)
    epochs = [[r for b in take(it, spe) for r in row_ids(b, 8)] for _ in range(4)]
    assert it.state["epoch"] == 4
    for e in epochs:
        assert len(set(e)) == len(e) == spe * batch_size  # no row twice in an epoch
        if num_rows % batch_size == 0:
            assert sorted(e) == list(range(num_rows))  # every row exactly once
    assert len({tuple(e) for e in epochs}) == 4  # reshuffled every epoch
    with pytest.raises(ValueError, match="larger than the dataset"):
        batches(ds, num_rows + 1, seed=0)


def test_pipeline_process_sharding(ds):
    full = take(batches(ds, 6, seed=1, start_step=5), 10)
    parts = [take(batches(ds, 6, seed=1, process_index=p, process_count=2, start_step=5), 10) for p in range(2)]
    for g, p0, p1 in zip(full, parts[0], parts[1]):
        assert p0["tokens"].shape == p1["tokens"].shape == (3, 9)
        a, b = row_ids(p0, 8), row_ids(p1, 8)
        assert not set(a) & set(b)
        assert sorted(a + b) == sorted(row_ids(g, 8))
        np.testing.assert_array_equal(np.concatenate([p0["tokens"], p1["tokens"]]), g["tokens"])
    with pytest.raises(ValueError, match="multiple of the process count"):
        batches(ds, 5, seed=1, process_count=2)
    with pytest.raises(ValueError, match="process_index"):
        batches(ds, 6, seed=1, process_index=2, process_count=2)
