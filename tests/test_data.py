"""Tests for dsattn.data: corpora, by-file splits, caps, stateless batches, entropy, codec."""

import hashlib
import json
import math
import re
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import yaml

from dsattn import config, data, recall, tokendir
from dsattn.config import DataConfig
from dsattn.datasource import SourceKind
from dsattn.errors import ConfigError, InputError

SMALL = 200_000  # stdlib cap used by the tests: keeps them fast


def _crc_val(rel: str, frac: float) -> bool:
    return zlib.crc32(rel.encode()) % 10_000 < frac * 10_000


# ----------------------------------------------------------------------------- stdlib
def test_stdlib_files_sorted_py_without_site_packages():
    files = data._stdlib_files()
    assert len(files) > 100
    assert list(files) == sorted(files)
    assert all(f.endswith(".py") and "site-packages" not in f.split("/") for f in files)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert (root / "os.py").is_file() and "os.py" in files


def test_stdlib_split_is_by_file_disjoint_and_matches_crc():
    files = data._stdlib_files()
    train, val = data.split_files(files, 0.05)
    assert set(train).isdisjoint(val)
    assert sorted(train + val) == sorted(files)
    assert val == [f for f in files if _crc_val(f, 0.05)]
    assert 0.02 < len(val) / len(files) < 0.10


def test_stdlib_corpus_contents_and_cap():
    cfg = DataConfig(source="stdlib", val_fraction=0.05, max_bytes=SMALL)
    c = data.load_corpus(cfg, 256)
    assert c.train.dtype == np.int32 and c.train.ndim == 1 and c.vocab_size == 256
    n_val = round(SMALL * 0.05)
    assert len(c.val) == n_val and len(c.train) == SMALL - n_val  # cap binds, split in proportion
    assert "stdlib" in c.description
    # Independent expectation: each split is its files, in sorted order, joined by b"\n".
    root = Path(sysconfig.get_paths()["stdlib"])
    files = data._stdlib_files()
    for arr, want_val in ((c.train, False), (c.val, True)):
        chosen = [f for f in files if _crc_val(f, 0.05) == want_val]
        expected, total = [], 0
        for f in chosen:
            expected.append((root / f).read_bytes())
            total += len(expected[-1]) + 1
            if total > len(arr):
                break
        assert bytes(arr.astype(np.uint8)) == b"\n".join(expected)[: len(arr)]


def test_stdlib_corpus_deterministic_and_cached():
    cfg = DataConfig(max_bytes=SMALL)
    a = data.load_corpus(cfg, 256)
    b = data.load_corpus(cfg, 256)
    assert a.train is b.train  # in-process cache
    fresh = data._stdlib_corpus.__wrapped__(cfg.val_fraction, cfg.max_bytes)
    np.testing.assert_array_equal(fresh[0], a.train)
    np.testing.assert_array_equal(fresh[1], a.val)
    assert not a.train.flags.writeable  # the cached arrays cannot be corrupted by a caller


def test_stdlib_vocab_too_small_raises():
    with pytest.raises(ValueError, match="vocab_size 100"):
        data.load_corpus(DataConfig(max_bytes=SMALL), 100)


# ----------------------------------------------------------------------------- batching
def test_batch_at_windows_match_source_and_are_reproducible():
    tokens = np.arange(5000, dtype=np.uint16)  # distinct values: a window reveals its start
    b = data.batch_at(tokens, step=3, batch_size=6, seq_len=32, seed=7)
    assert b["inputs"].shape == b["targets"].shape == (6, 32)
    assert b["inputs"].dtype == b["targets"].dtype == np.int32
    for row_in, row_tg in zip(b["inputs"], b["targets"]):
        s = int(row_in[0])
        np.testing.assert_array_equal(row_in, tokens[s : s + 32])
        np.testing.assert_array_equal(row_tg, tokens[s + 1 : s + 33])
    again = data.batch_at(tokens, step=3, batch_size=6, seq_len=32, seed=7)
    np.testing.assert_array_equal(again["inputs"], b["inputs"])
    other_step = data.batch_at(tokens, step=4, batch_size=6, seq_len=32, seed=7)
    other_seed = data.batch_at(tokens, step=3, batch_size=6, seq_len=32, seed=8)
    assert not np.array_equal(other_step["inputs"], b["inputs"])
    assert not np.array_equal(other_seed["inputs"], b["inputs"])


def test_batch_at_edges():
    tokens = np.arange(33, dtype=np.int32)
    b = data.batch_at(tokens, 0, 4, 32, 0)  # exactly seq_len + 1 tokens: the one window
    np.testing.assert_array_equal(b["inputs"], np.tile(tokens[:32], (4, 1)))
    np.testing.assert_array_equal(b["targets"], np.tile(tokens[1:], (4, 1)))
    with pytest.raises(ValueError, match="shorter"):
        data.batch_at(tokens, 0, 4, 33, 0)
    # Windows stay in bounds and reach both ends over many steps.
    t = np.arange(50, dtype=np.int32)
    starts = np.concatenate([data.batch_at(t, i, 8, 10, 1)["inputs"][:, 0] for i in range(200)])
    assert starts.min() == 0 and starts.max() == 50 - 11


def test_eval_batches_fixed_and_distinct_from_training():
    tokens = np.arange(10_000, dtype=np.int32)
    e1 = data.eval_batches(tokens, 3, 4, 16)
    e2 = data.eval_batches(tokens, 3, 4, 16)
    assert len(e1) == 3
    for x, y in zip(e1, e2):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    train0 = data.batch_at(tokens, 0, 4, 16, 0)
    assert not np.array_equal(e1[0]["inputs"], train0["inputs"])
    assert not np.array_equal(e1[0]["inputs"], e1[1]["inputs"])


# ----------------------------------------------------------------------------- user sources
def test_single_text_file_tail_split_exact(tmp_path):
    payload = bytes(range(256)) * 4  # 1024 bytes
    f = tmp_path / "one.txt"
    f.write_bytes(payload)
    c = data.load_corpus(DataConfig(source=str(f), val_fraction=0.25, max_bytes=0), 256)
    assert len(c.val) == 256 and len(c.train) == 768
    assert bytes(c.train.astype(np.uint8)) == payload[:768]
    assert bytes(c.val.astype(np.uint8)) == payload[768:]
    capped = data.load_corpus(DataConfig(source=str(f), val_fraction=0.1, max_bytes=500), 256)
    assert len(capped.train) == 450 and len(capped.val) == 50
    assert bytes(capped.val.astype(np.uint8)) == payload[450:500]


def test_glob_text_files_split_by_file(tmp_path):
    names = [f"doc{i:02d}.txt" for i in range(30)]
    for i, n in enumerate(names):
        (tmp_path / n).write_text(f"<{n}>" + "x" * i)
    frac = 0.3
    want_val = [n for n in names if _crc_val(n, frac)]
    want_train = [n for n in names if not _crc_val(n, frac)]
    assert want_val and want_train  # precondition of this test
    c = data.load_corpus(DataConfig(source=str(tmp_path / "*.txt"), val_fraction=frac,
                                    max_bytes=0), 256)
    join = lambda ns: "\n".join((tmp_path / n).read_text() for n in ns)  # noqa: E731
    assert data.decode(c.train) == join(want_train)
    assert data.decode(c.val) == join(want_val)


def test_uint16_token_file_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=2000).astype("<u2")
    f = tmp_path / "toks.u16"
    tokens.tofile(f)
    c = data.load_corpus(DataConfig(source=str(f), val_fraction=0.1, max_bytes=0), 1000)
    assert c.train.dtype == np.uint16 and c.vocab_size == 1000
    assert len(c.val) == 200
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]), tokens)
    np.testing.assert_array_equal(c.val, tokens[-200:])
    b = data.batch_at(c.train, 0, 2, 8, 0)
    assert b["inputs"].dtype == np.int32
    capped = data.load_corpus(DataConfig(source=str(f), val_fraction=0.1, max_bytes=1000), 1000)
    np.testing.assert_array_equal(np.concatenate([capped.train, capped.val]), tokens[:500])


def test_token_file_out_of_vocab_raises(tmp_path):
    f = tmp_path / "bad.bin"
    np.array([1, 2, 300, 4], dtype="<u2").tofile(f)
    with pytest.raises(ValueError, match=r"bad\.bin.*300.*256"):
        data.load_corpus(DataConfig(source=str(f), max_bytes=0), 256)


def test_missing_source_and_empty_corpus(tmp_path):
    src = str(tmp_path / "nothing_here" / "*.txt")
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        data.load_corpus(DataConfig(source=src), 256)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        data.load_corpus(DataConfig(source=str(empty)), 256)


# ----------------------------------------------------------------------------- data.source
def _spellings(tmp_path):
    """{data.source text: (kind, files, recall parameters)} for every form the text takes,
    over files written here (HOME set to tmp_path, so ~ names it)."""
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta\n")
    for name in ("t.u16", "T.BIN"):
        np.arange(8, dtype="<u2").tofile(tmp_path / name)
    vocab = {f"w{i}": i for i in range(299)} | {"<|endoftext|>": 299}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0")).save(
        str(tmp_path / "tokenizer.json"))
    with tokendir.Writer(tmp_path / "tok", vocab_size=300, eos_id=299) as w:
        w.add("train", [1, 2, 3])
        w.add("val", [4, 5])
        w.commit(tmp_path / "tokenizer.json")
    K, t = SourceKind, tmp_path
    return {
        "stdlib": (K.STDLIB, (), None),
        "recall": (K.RECALL, (), {}),
        "recall:": (K.RECALL, (), {}),
        "recall:min_dist=8,max_dist=64": (K.RECALL, (), {"min_dist": 8, "max_dist": 64}),
        "recall: min_dist = 8 , corpus=stdlib,": (K.RECALL, (), {"min_dist": 8,
                                                                  "corpus": "stdlib"}),
        f"{t}/a.txt": (K.TEXT, (t / "a.txt",), None),
        "~/a.txt": (K.TEXT, (t / "a.txt",), None),
        f"{t}/**/*.txt": (K.TEXT, (t / "a.txt", t / "sub" / "b.txt"), None),
        f"{t}/t.u16": (K.TOKENS, (t / "t.u16",), None),
        f"{t}/*.[uB]*": (K.TOKENS, (t / "T.BIN", t / "t.u16"), None),  # suffixes any case
        f"{t}/tok": (K.TOKEN_DIR, (t / "tok",), None),
        "~/tok": (K.TOKEN_DIR, (t / "tok",), None),
        f"{t}/later.txt": (K.TEXT, (), None),  # nothing there yet: looked up when read
        f"{t}/later.u16": (K.TOKENS, (), None),
    }


def test_every_data_source_spelling_parses_to_its_meaning(tmp_path, monkeypatch):
    """data.source is parsed once, when a config is built, whichever way it is given (a config
    file, a command-line override, DataConfig): each form names its kind, its files (sorted,
    ~ expanded) and a recall source's parameters; config.yaml keeps the text as written."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for text, (kind, files, params) in _spellings(tmp_path).items():
        given = [DataConfig(source=text).source,
                 config.loads(yaml.safe_dump({"data": {"source": text}})).data.source]
        # an override's value is YAML: "recall:" or "recall: k=v" there is a mapping (refused)
        overridable = not re.search(r":( |$)", text)
        if overridable:
            given.append(config.loads("", [f"data.source={text}"]).data.source)
        for src in given:
            assert (src.kind, src.paths, str(src)) == (kind, files, text), text
            assert src.byte_level == (kind not in (SourceKind.TOKENS, SourceKind.TOKEN_DIR))
            want = None if params is None else recall.RecallSpec(**params)
            assert src.recall == want, text
        cfg = config.loads(yaml.safe_dump({"data": {"source": text}}))
        assert yaml.safe_load(cfg.to_yaml())["data"]["source"] == text
        assert config.loads(cfg.to_yaml()) == cfg
    tok = DataConfig(source=f"{tmp_path}/tok").source
    assert (tok.tokenizer, tok.vocab_size) == (tmp_path / "tok" / "tokenizer.json", 300)
    assert DataConfig(source="stdlib").source.tokenizer is None
    assert set(data.LOADERS) == set(SourceKind)  # every kind has its loader


def test_bad_data_sources_are_refused_naming_it(tmp_path):
    (tmp_path / "a.txt").write_text("alpha\n")
    np.arange(8, dtype="<u2").tofile(tmp_path / "t.u16")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match=r"data.source: recall parameter 'min_dist' is not "
                                          r"key=value"):
        config.loads("", ["data.source=recall:min_dist"])
    with pytest.raises(ConfigError, match=r"data.source: expected a string, got 5"):
        config.loads("", ["data.source=5"])
    with pytest.raises(InputError, match=r"data.source .*\*' mixes token files"):
        DataConfig(source=str(tmp_path / "*"))
    with pytest.raises(InputError, match=r"plain is a directory without meta.json"):
        DataConfig(source=str(tmp_path / "plain"))
    ghost = DataConfig(source=str(tmp_path / "gone" / "*.txt"))  # loads; reading it fails
    with pytest.raises(FileNotFoundError, match=r"data.source .*gone.*matches no file"):
        data.load_corpus(ghost, 256)


# ----------------------------------------------------------------------------- entropy, codec
def test_unigram_entropy():
    assert data.unigram_entropy(np.array([0, 1, 2, 3] * 25), 256) == pytest.approx(math.log(4))
    assert data.unigram_entropy(np.full(100, 7), 256) == 0.0
    p = np.array([0.5, 0.25, 0.25])
    toks = np.array([0, 0, 1, 2])
    assert data.unigram_entropy(toks, 3) == pytest.approx(-(p * np.log(p)).sum())


def test_encode_decode_round_trip():
    text = "héllo, wörld — 日本語 🙂\n\ttabs"
    toks = data.encode(text)
    assert toks.dtype == np.int32
    np.testing.assert_array_equal(toks, np.frombuffer(text.encode("utf-8"), np.uint8))
    assert data.decode(toks) == text
    assert data.decode(toks[:2]) == "h\ufffd"  # cut mid-character: replaced, not an error


def test_block_windows_hold_part_of_a_block_or_whole_blocks():
    tokens = np.arange(10 * 8, dtype=np.int32)  # 10 blocks of 8
    for seq_len in (5, 16):
        b = data.batch_at(tokens, 3, 6, seq_len, 0, block=8)
        assert (b["inputs"][:, 0] % 8 == 0).all()  # every window starts a block
        np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
    with pytest.raises(InputError, match="at most the corpus's sequences of 8 tokens, or whole"):
        data.batch_at(tokens, 0, 2, 12, 0, block=8)


# ----------------------------------------------------------------------------- damaged shards
def _token_dir(tmp_path, n_train=5000):
    """A token directory of known ids (a word-level tokenizer of 300 tokens, eos 299)."""
    vocab = {f"w{i}": i for i in range(299)} | {"<|endoftext|>": 299}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0")).save(
        str(tmp_path / "tokenizer.json"))
    ids = np.random.default_rng(0).integers(0, 299, n_train)
    with tokendir.Writer(tmp_path / "tok", vocab_size=300, eos_id=299) as w:
        w.add("train", ids)
        w.add("val", ids[:100])
        w.commit(tmp_path / "tokenizer.json")
    return tmp_path / "tok", np.append(ids, 299)


def _overwrite(path, offset, raw: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(raw)


def test_a_damaged_shard_is_named_not_trained_on(tmp_path):
    """4096 bytes of 0xFF in a shard once trained on as id 65535 until the loss was NaN: the
    shard is named with the first out-of-vocab id's place, and a damage that keeps every id in
    the vocab is caught by meta.json's sha256."""
    out, ids = _token_dir(tmp_path)
    shard, source = out / "train_000.bin", DataConfig(source=str(out), max_bytes=0)
    np.testing.assert_array_equal(data.load_corpus(source, 300).train, ids)
    good = shard.read_bytes()
    _overwrite(shard, 4096, b"\xff" * 4096)
    with pytest.raises(InputError, match=r"train_000\.bin: token 2,048 \(byte offset 4,096\) is "
                                         r"id 65535, outside the vocab of 300.*sha256"):
        data.load_corpus(source, 300)
    shard.write_bytes(good)
    swapped = ids[:12].copy()
    swapped[10], swapped[11] = ids[11], ids[10]
    assert swapped[10] != swapped[11]
    _overwrite(shard, 0, swapped.astype("<u2").tobytes())  # ids in range, in another order
    with pytest.raises(InputError, match=r"train_000\.bin: its sha256 .* is not meta.json's"):
        data.load_corpus(source, 300)
    # out-of-vocab ids that meta.json's hash vouches for: still refused, named
    shard.write_bytes(good)
    _overwrite(shard, 2 * 4999, b"\x2c\x01")  # id 300 at the last token before the eos
    meta = json.loads((out / "meta.json").read_text())
    meta["splits"]["train"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(InputError, match=r"train_000\.bin: token 4,999 \(byte offset 9,998\) is "
                                         r"id 300, outside the vocab of 300"):
        data.load_corpus(source, 300)
