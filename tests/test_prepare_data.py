"""Tokenized corpora: scripts/prepare_data.py writes a token directory (shards + meta.json +
tokenizer.json), data.source=DIR trains on it, and the run's tokenizer serves generate/eval.

Expectations come from outside the code under test: the documents written here, the
`tokenizers` library read directly, hashlib, file sizes, the run's own metrics.jsonl."""

import hashlib
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
import tokenizers
from flax import nnx

from dsattn import cli, config, data
from dsattn.config import DataConfig
from dsattn.datasource import SourceKind
from dsattn.errors import DsattnError

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.n_layers=1", "model.d_model=32", "model.ffn_hidden=64", "attention.n_heads=2",
        "attention.n_kv_heads=2", "attention.head_dim=16", "train.batch_size=2",
        "train.seq_len=16", "train.steps=3", "train.ckpt_every=3", "train.eval_batches=1",
        "train.eval_every=3", "data.max_bytes=0"]

# A few KB of varied text: code, prose, whitespace runs, non-ASCII, a literal "<|endoftext|>"
# (must stay text, not become the separator).
DOCS = [f"def f{i}(x):\n    return x * {i} + {i * i}  # ünïcode {i}\n\n\tindent\n" * (3 + i % 4)
        for i in range(10)] + [
    "The quick brown fox jumps over the lazy dog. " * 12,
    "日本語のテキスト、そして emoji 🦊 and accents: café, naïve, Ångström.\n" * 5,
    "a literal <|endoftext|> inside a document stays text\n" * 4,
]


def _load_script(name):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


prepare_data = _load_script("prepare_data")


def run_main(main, argv, capsys):
    """(exit status, stdout, stderr lines) of a script's main under the scripts' error policy."""
    with pytest.raises(SystemExit) as e:
        cli.run(main, [str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err.strip().splitlines()


def write_corpus(root: Path, docs=DOCS) -> Path:
    src = root / "corpus"
    src.mkdir()
    for i, d in enumerate(docs):
        (src / f"doc{i:02d}.txt").write_text(d, encoding="utf-8")
    return src


def prepare(capsys, *argv):
    status, out, err = run_main(prepare_data.main, argv, capsys)
    assert status == 0, err
    return out


def shard_tokens(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"])
                           for s in meta["splits"][split]])


def split_documents(tokens, eos_id) -> list[list[int]]:
    """Documents of a shard: each ends with eos_id."""
    assert len(tokens) and tokens[-1] == eos_id
    cuts = np.flatnonzero(tokens == eos_id)
    return [tokens[a + 1 if i else 0: b].tolist()
            for i, (a, b) in enumerate(zip(np.r_[-1, cuts[:-1]], cuts))]


def is_subsequence(sub, seq) -> bool:
    it = iter(seq)
    return all(any(x == y for y in it) for x in sub)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A corpus prepared with a trained 320-token BPE (shared: training a tokenizer once)."""
    root = tmp_path_factory.mktemp("prep")
    src = write_corpus(root)
    out = root / "tokens"
    status = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"),
                             str(src / "*.txt"), "-o", str(out), "--vocab-size", "320",
                             "--val-fraction", "0.3"], capture_output=True, cwd=ROOT, timeout=120)
    assert status.returncode == 0, status.stderr.decode()
    return src, out


# ----------------------------------------------------------------- 1. prepare_data.py
def test_prepared_directory_round_trips_every_document(prepared):
    src, out = prepared
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json",
                                                      "train_000.bin", "val_000.bin"]
    assert not [p for p in out.parent.iterdir() if p.name not in ("corpus", "tokens")]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["version"] == 1 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == "tokenizer.json"
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    assert meta["vocab_size"] == tok.get_vocab_size() and 256 < meta["vocab_size"] <= 320
    assert meta["eos_id"] == tok.token_to_id("<|endoftext|>")
    decoded = {}
    for split in ("train", "val"):
        for s in meta["splits"][split]:  # the loader's checks hold
            raw = (out / s["file"]).read_bytes()
            assert len(raw) == s["bytes"] == 2 * s["tokens"]
            assert hashlib.sha256(raw).hexdigest() == s["sha256"]
        docs = split_documents(shard_tokens(out, split), meta["eos_id"])
        assert len(docs) == sum(s["documents"] for s in meta["splits"][split])
        decoded[split] = [tok.decode(d, skip_special_tokens=False) for d in docs]
    # split at document boundaries: each side holds whole documents in corpus order
    assert decoded["train"] and decoded["val"]
    assert sorted(decoded["train"] + decoded["val"]) == sorted(DOCS)
    assert is_subsequence(decoded["train"], DOCS) and is_subsequence(decoded["val"], DOCS)


def test_token_dtype_fits_the_largest_id():
    from dsattn import tokendir
    assert tokendir.token_dtype(320) == np.uint16
    assert tokendir.token_dtype(65536) == np.uint16  # ids 0..65535
    assert tokendir.token_dtype(65537) == np.uint32
    assert tokendir.token_dtype(129280) == np.uint32


def test_loading_the_saved_tokenizer_gives_identical_ids(prepared, tmp_path, capsys):
    src, out = prepared
    again = tmp_path / "again"
    prepare(capsys, str(src / "*.txt"), "-o", again, "--tokenizer", out / "tokenizer.json",
            "--val-fraction", "0.3")
    for split in ("train", "val"):
        np.testing.assert_array_equal(shard_tokens(again, split), shard_tokens(out, split))
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_paragraph_documents_of_one_file(tmp_path, capsys):
    f = tmp_path / "book.txt"
    paras = [f"Paragraph {i}: " + "words " * (5 + i) for i in range(8)]
    f.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    out = tmp_path / "tok"
    prepare(capsys, f, "-o", out, "--vocab-size", "300", "--docs", "paragraph",
            "--val-fraction", "0.3")
    meta = json.loads((out / "meta.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    got = [tok.decode(d, skip_special_tokens=False) for split in ("train", "val")
           for d in split_documents(shard_tokens(out, split), meta["eos_id"])]
    assert sorted(got) == sorted(p if i < 7 else p + "\n" for i, p in enumerate(paras))


def test_hf_dataset_rows_are_documents(tmp_path, capsys, monkeypatch):
    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    calls = []

    def load_dataset(name, cfg_name=None, split=None):
        calls.append((name, cfg_name, split))
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    out = tmp_path / "ds"
    prepare(capsys, "--dataset", "someone/corpus", "--dataset-config", "small",
            "-o", out, "--vocab-size", "300")
    assert calls and all(c == ("someone/corpus", "small", "train") for c in calls)
    meta = json.loads((out / "meta.json").read_text())
    assert sum(s["documents"] for sp in meta["splits"].values() for s in sp) == len(DOCS)


def test_dataset_without_the_datasets_package_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    status, _, err = run_main(prepare_data.main, ["--dataset", "x/y", "-o", tmp_path / "o"],
                              capsys)
    assert status == 1 and len(err) == 1 and "pip install datasets" in err[0], err
    assert not (tmp_path / "o").exists()


def _assert_nothing_written(root: Path, keep: set):
    assert {p.name for p in root.iterdir()} == keep


def test_prepare_errors_are_one_line_and_write_nothing(prepared, tmp_path, capsys):
    src, out = prepared
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("")
    bad = tmp_path / "bad.json"
    bad.write_text("{not a tokenizer")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    cases = [([empty / "*.txt", "-o", tmp_path / "o1"], "empty corpus"),
             ([src / "*.txt", "-o", tmp_path / "o2", "--tokenizer", bad], "bad.json"),
             ([src / "*.txt", "-o", full], "--force"),
             ([tmp_path / "nothing*.txt", "-o", tmp_path / "o3"], "nothing*.txt")]
    for argv, needle in cases:
        status, _, err = run_main(prepare_data.main, argv, capsys)
        assert status == 1 and len(err) == 1 and needle in err[0], (argv, err)
        _assert_nothing_written(tmp_path, {"empty", "bad.json", "full"})
        assert [p.name for p in full.iterdir()] == ["keep.txt"]
    empty_dir = tmp_path / "empty_dir"  # --force fills an empty directory
    empty_dir.mkdir()
    prepare(capsys, src / "*.txt", "-o", empty_dir, "--vocab-size", "300", "--force")
    assert (empty_dir / "meta.json").exists()
    _assert_nothing_written(tmp_path, {"empty", "bad.json", "full", "empty_dir"})


def _tree(root: Path) -> dict:
    """{relative path: bytes} of every file under root."""
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_force_replaces_only_a_token_directory(prepared, tmp_path, capsys):
    """--force once removed whatever -o named: here the very inputs. It replaces only a token
    directory (or an empty one); anything else is refused in one line, nothing touched."""
    src, out = prepared
    v = tmp_path / "V"  # the repro: the inputs inside the output directory
    (v / "sub").mkdir(parents=True)
    for i, d in enumerate(DOCS[:4]):
        (v / f"n{i}.md").write_text(d, encoding="utf-8")
    (v / "a.txt").write_text("not an input, still mine")
    (v / "sub" / "NOTES.md").write_text("keep")
    before = _tree(v)
    mine = tmp_path / "mine"  # not a token directory, no input in it
    mine.mkdir()
    (mine / "meta.json").write_text('{"title": "a meta.json of something else"}')
    for argv, needle in [([v / "*.md", "-o", v], "inside the output directory"),
                         ([src / "*.txt", "-o", v], "not a token directory"),
                         ([src / "*.txt", "-o", mine], "not a token directory")]:
        status, _, err = run_main(prepare_data.main, [*argv, "--force", "--vocab-size", "300"],
                                  capsys)
        assert status == 1 and len(err) == 1 and needle in err[0] and "--force" in err[0], err
        assert _tree(v) == before
        assert {p.name for p in tmp_path.iterdir()} == {"V", "mine"}  # no temporary left
    # a token directory holding an input: replacing it would remove that input
    tok = tmp_path / "tok"
    tok.mkdir()
    for p in out.iterdir():
        (tok / p.name).write_bytes(p.read_bytes())
    (tok / "extra.txt").write_text(DOCS[0], encoding="utf-8")
    kept = _tree(tok)
    status, _, err = run_main(prepare_data.main, [src / "*.txt", tok / "extra.txt", "-o", tok,
                                                  "--force", "--vocab-size", "300"], capsys)
    assert status == 1 and len(err) == 1 and "extra.txt lies inside" in err[0], err
    assert _tree(tok) == kept
    status, _, err = run_main(prepare_data.main, [src / "*.txt", "-o", tok, "--force",
                                                  "--vocab-size", "300"], capsys)
    assert status == 1 and len(err) == 1 and "holds extra.txt" in err[0], err  # not ours
    assert _tree(tok) == kept
    # a token directory of prepare_data.py is replaced
    (tok / "extra.txt").unlink()
    prepare(capsys, src / "*.txt", "-o", tok, "--vocab-size", "300", "--force",
            "--val-fraction", "0.5")
    assert json.loads((tok / "meta.json").read_text())["val_fraction"] == 0.5  # out's: 0.3


def test_every_file_that_is_not_utf8_is_named_at_once_and_errors_decides(tmp_path, capsys):
    """A corpus with two Latin-1 files: strict (the default) names both in one line, with the
    count, and writes nothing; --errors skip leaves them out and says how many; --errors
    replace reads them with U+FFFD. Each phase says what it did, with counts."""
    src = write_corpus(tmp_path)
    for name in ("latin_a.txt", "latin_b.txt"):
        (src / name).write_bytes("café crème, naïveté\n".encode("latin-1") * 20)
    argv = [src / "*.txt", "--vocab-size", "300", "--val-fraction", "0.3"]
    status, _, err = run_main(prepare_data.main, [*argv, "-o", tmp_path / "strict"], capsys)
    assert status == 1 and len(err) == 1, err
    assert "2 of 15 files are not UTF-8" in err[0] and "latin_a.txt (byte 3)" in err[0] \
        and "latin_b.txt (byte 3)" in err[0] and "--errors" in err[0], err
    assert not (tmp_path / "strict").exists()
    out = prepare(capsys, *argv, "-o", tmp_path / "skip", "--errors", "skip")
    lines = out.splitlines()
    assert lines[0].startswith("read 15 files (") and "2 not UTF-8, left out" in lines[0], out
    assert lines[1].startswith("tokenizer: trained a BPE of ") and "on 13 documents" in lines[1]
    assert lines[2].startswith("tokenized and wrote 13 documents"), out
    meta = json.loads((tmp_path / "skip" / "meta.json").read_text())
    assert sum(s["documents"] for sp in meta["splits"].values() for s in sp) == len(DOCS)
    out = prepare(capsys, *argv, "-o", tmp_path / "replace", "--errors", "replace")
    assert "2 not UTF-8, read with U+FFFD" in out.splitlines()[0], out
    meta = json.loads((tmp_path / "replace" / "meta.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "replace" / "tokenizer.json"))
    got = [tok.decode(d, skip_special_tokens=False) for split in ("train", "val")
           for d in split_documents(shard_tokens(tmp_path / "replace", split), meta["eos_id"])]
    assert len(got) == len(DOCS) + 2 and sum("caf\ufffd cr\ufffdme" in d for d in got) == 2


# ----------------------------------------------------------------- 2. data.source=DIR
def test_token_directory_corpus_is_the_shards(prepared):
    _, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    c = data.load_corpus(DataConfig(source=str(out), max_bytes=0), meta["vocab_size"])
    np.testing.assert_array_equal(c.train, shard_tokens(out, "train"))
    np.testing.assert_array_equal(c.val, shard_tokens(out, "val"))
    assert isinstance(c.train, np.memmap) and c.train.dtype == np.uint16
    # data.max_bytes caps each split in proportion: 180 bytes of train, 20 of val (uint16)
    capped = data.load_corpus(DataConfig(source=str(out), max_bytes=200, val_fraction=0.1),
                              meta["vocab_size"])
    np.testing.assert_array_equal(capped.train, shard_tokens(out, "train")[:90])
    np.testing.assert_array_equal(capped.val, shard_tokens(out, "val")[:10])
    cfg = config.load(ROOT / "configs/tiny/mha.yaml", [f"data.source={out}"])
    assert data.with_source_vocab(cfg).model.vocab_size == meta["vocab_size"]
    big = config.load(ROOT / "configs/tiny/mha.yaml", [f"data.source={out}",
                                                        "model.vocab_size=1024"])
    with pytest.warns(UserWarning, match="never trained"):  # an explicit one: room to spare
        assert data.with_source_vocab(big, explicit=True).model.vocab_size == 1024
    src = config.DataConfig(source=str(out)).source
    assert src.kind is SourceKind.TOKEN_DIR and not src.byte_level
    assert src.tokenizer.read_bytes() == (out / meta["tokenizer"]).read_bytes()


def test_token_directory_checks(prepared, tmp_path):
    _, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    bare = tmp_path / "bare"  # shards without their metadata
    bare.mkdir()
    (bare / "train_000.bin").write_bytes((out / "train_000.bin").read_bytes())
    with pytest.raises(DsattnError, match="meta.json"):
        data.load_corpus(DataConfig(source=str(bare)), 512)
    cut = tmp_path / "cut"  # a shard shorter than its metadata says
    cut.mkdir()
    for p in out.iterdir():
        (cut / p.name).write_bytes(p.read_bytes())
    (cut / "val_000.bin").write_bytes((out / "val_000.bin").read_bytes()[:-2])
    with pytest.raises(DsattnError, match=r"val_000\.bin.*bytes"):
        data.load_corpus(DataConfig(source=str(cut)), 512)
    small = meta["vocab_size"] - 1
    with pytest.raises(DsattnError, match=f"vocab_size {small}"):
        data.load_corpus(DataConfig(source=str(out)), small)


def test_train_errors_are_one_line_and_write_nothing(prepared, tmp_path, capsys):
    _, out = prepared
    train_script = _load_script("train")
    meta = json.loads((out / "meta.json").read_text())
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "train_000.bin").write_bytes(b"\0\0" * 64)
    for source, overrides, needle in [
            (bare, [], "meta.json"),
            (out, [f"model.vocab_size={meta['vocab_size'] - 1}"], "model.vocab_size")]:
        run = tmp_path / "run"
        status, _, err = run_main(
            train_script.main, ["configs/tiny/mha.yaml", "--run-dir", run, "--quiet",
                                f"data.source={source}", *TINY, *overrides], capsys)
        assert status == 1 and len(err) == 1 and needle in err[0], err
        assert not run.exists()


# ----------------------------------------------------------------- 3. a run on a token directory
def script(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"),
                           *map(str, args)], capture_output=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def run_dir(prepared, tmp_path_factory):
    _, out = prepared
    run = tmp_path_factory.mktemp("bpe_run") / "run"
    p = script("train", "configs/tiny/mha.yaml", "--run-dir", run, "--quiet",
               f"data.source={out}", *TINY)
    assert p.returncode == 0, p.stderr.decode()
    (run.parent / "stdout.txt").write_bytes(p.stdout)
    return run


def val_bytes_per_token(src: Path, out: Path) -> float:
    """The validation documents' UTF-8 bytes over the validation shard's tokens."""
    text = sum(len(p.read_text(encoding="utf-8").encode()) for p in sorted(src.iterdir())
               if data.is_val_file(p.name, 0.3))
    return text / len(shard_tokens(out, "val"))


def test_a_run_prints_its_size_at_start_and_its_loss_beside_the_baselines(prepared, run_dir):
    src, out = prepared
    first, *_, last = (run_dir.parent / "stdout.txt").read_text().splitlines()
    model, cfg, _ = cli.load_run(run_dir)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert f"{n_params:,} parameters" in first
    assert f"vocabulary {json.loads((out / 'meta.json').read_text())['vocab_size']:,}" in first
    assert "32 tokens per step" in first and "3 steps" in first  # 2 x 16, TINY's
    val_loss = float(re.search(r"validation loss ([\d.]+) nats/token", last).group(1))
    unigram = data.unigram_entropy(shard_tokens(out, "val"), cfg.model.vocab_size)
    assert f"unigram baseline {unigram:.4f}" in last
    bpb = float(re.search(r"\(([\d.]+) bits/byte\)", last).group(1))
    assert bpb == pytest.approx(val_loss / math.log(2) / val_bytes_per_token(src, out),
                                abs=2e-4)


def test_the_vocab_follows_the_tokenizer_unless_set(prepared, tmp_path):
    _, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    preset = tmp_path / "preset.yaml"  # a preset's own vocab (as configs/small's 32768)
    preset.write_text("model: {vocab_size: 4096}\n")
    cfg = config.load(preset, [f"data.source={out}"])
    assert data.with_source_vocab(cfg).model.vocab_size == meta["vocab_size"]
    with pytest.warns(UserWarning, match="never trained"):  # set by the user: kept, said
        assert data.with_source_vocab(cfg, explicit=True).model.vocab_size == 4096


def test_training_on_a_token_directory_keeps_its_tokenizer(prepared, run_dir):
    _, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    assert config.load(run_dir / "config.yaml").model.vocab_size == meta["vocab_size"]
    assert (run_dir / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_generate_encodes_and_decodes_through_the_runs_tokenizer(run_dir):
    from dsattn import generate
    prompt = "def f3(x):"
    p = script("generate", run_dir, "--prompt", prompt, "--max-new", "12", "--temperature", "0")
    assert p.returncode == 0, p.stderr.decode()
    tok = tokenizers.Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    model, _, _ = cli.load_run(run_dir)
    new = generate.generate(model, [tok.encode(prompt).ids], 12, temperature=0.0)[0]
    assert len(new) == 12 and max(new) < model.cfg.model.vocab_size
    want = prompt + tok.decode(new, skip_special_tokens=False) + "\n"
    assert p.stdout.decode("utf-8") == want
    assert "[12 tokens" in p.stderr.decode()


def test_eval_on_a_token_directory_run(prepared, run_dir, tmp_path):
    rows_file = tmp_path / "rows.json"
    p = script("eval", run_dir, "--seq-len", "16", "--json", rows_file, "--quiet",
               "--batches", "1")  # the run's validation batches: its logged val_loss
    assert p.returncode == 0, p.stderr.decode()
    (row,) = json.loads(rows_file.read_text())["rows"]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["val_loss"] for r in logged if "val_loss" in r][-1]
    assert row["nats_per_token"] == pytest.approx(val_loss, rel=1e-5)
    src, out = prepared  # bits per byte from the text bytes meta.json records
    assert row["bits_per_byte"] == pytest.approx(
        row["nats_per_token"] / math.log(2) / val_bytes_per_token(src, out), rel=1e-9)


def test_eval_refuses_data_of_another_tokenizer(prepared, run_dir, capsys):
    src, _ = prepared
    eval_script = _load_script("eval")
    status, _, err = run_main(eval_script.main, [run_dir, "--data", src / "*.txt", "--quiet"],
                              capsys)
    assert status == 1 and len(err) == 1 and "tokenizer" in err[0], err


def test_a_vocab_beyond_uint16_gets_uint32_shards_and_the_separator_added(tmp_path, capsys):
    vocab = {f"w{i}": i for i in range(70_000)}  # ids above 65535 must survive
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    word_level.save(str(tmp_path / "words.json"))
    docs = [" ".join(f"w{(i * 7919 + j * 104729) % 70_000}" for j in range(40)) for i in range(6)]
    src = tmp_path / "c"
    src.mkdir()
    for i, d in enumerate(docs):
        (src / f"d{i}.txt").write_text(d)
    out = tmp_path / "tok"
    prepare(capsys, src / "*.txt", "-o", out, "--tokenizer", tmp_path / "words.json",
            "--val-fraction", "0.3")
    meta = json.loads((out / "meta.json").read_text())
    # the tokenizer had no <|endoftext|>: the copy gets it as the next id
    assert meta["eos_id"] == 70_000 and meta["vocab_size"] == 70_001
    assert meta["dtype"] == "uint32"
    got = [d for split in ("train", "val")
           for d in split_documents(shard_tokens(out, split), meta["eos_id"])]
    want = [[int(w[1:]) for w in d.split()] for d in docs]
    assert sorted(got) == sorted(want) and max(max(d) for d in got) > 65_535
    c = data.load_corpus(DataConfig(source=str(out), max_bytes=0), 70_001)
    assert c.train.dtype == np.uint32


def test_a_split_in_several_shards_reads_as_their_concatenation(prepared, tmp_path):
    _, out = prepared
    two = tmp_path / "two"
    two.mkdir()
    for p in out.iterdir():
        (two / p.name).write_bytes(p.read_bytes())
    meta = json.loads((out / "meta.json").read_text())
    train = shard_tokens(out, "train")
    cut = int(np.flatnonzero(train == meta["eos_id"])[0]) + 1  # after the first document
    train[:cut].tofile(two / "train_000.bin")
    train[cut:].tofile(two / "train_001.bin")
    meta["splits"]["train"] = [
        {"file": f"train_00{i}.bin", "tokens": len(a), "bytes": 2 * len(a), "documents": 0,
         "sha256": hashlib.sha256(a.astype("<u2").tobytes()).hexdigest()}
        for i, a in enumerate((train[:cut], train[cut:]))]
    (two / "meta.json").write_text(json.dumps(meta))
    c = data.load_corpus(DataConfig(source=str(two), max_bytes=0), meta["vocab_size"])
    np.testing.assert_array_equal(c.train, train)


def test_identical_documents_on_both_sides_of_the_split_are_counted(tmp_path, capsys):
    names = [f"doc{i:02d}.txt" for i in range(40)]
    val = [n for n in names if data.is_val_file(n, 0.3)]
    train = [n for n in names if n not in val]
    src = tmp_path / "corpus"
    src.mkdir()
    texts = {n: f"document {n}: " + "words " * (5 + i) for i, n in enumerate(names)}
    # two validation documents copied under training names (one of them twice)
    texts[train[0]] = texts[train[1]] = texts[val[0]]
    texts[train[2]] = texts[val[1]]
    for n, t in texts.items():
        (src / n).write_text(t, encoding="utf-8")
    status, _, err = run_main(prepare_data.main, [src / "*.txt", "-o", tmp_path / "tok",
                                                  "--vocab-size", "300", "--val-fraction",
                                                  "0.3"], capsys)
    assert status == 0
    (line,) = [e for e in err if "identical" in e]
    assert f"2 of {len(val)} validation documents" in line
    # distinct documents: no warning
    for n in (train[0], train[1], train[2]):
        (src / n).write_text(f"fresh {n}", encoding="utf-8")
    status, _, err = run_main(prepare_data.main, [src / "*.txt", "-o", tmp_path / "tok2",
                                                  "--vocab-size", "300", "--val-fraction",
                                                  "0.3"], capsys)
    assert status == 0 and not [e for e in err if "identical" in e]


def test_a_later_run_removes_the_temporaries_of_killed_runs_only(prepared, tmp_path):
    """A prepare_data.py killed by SIGKILL leaves its .tok.tmp-<pid> of partial shards; the
    next run into the same directory removes it, but never one whose process still runs."""
    src, out = prepared
    killed = subprocess.Popen(  # killed for real, at its first document's write
        [sys.executable, "-c", "import os, runpy, signal, sys; from dsattn import tokendir; "
         "tokendir.Writer.add = lambda *a: os.kill(os.getpid(), signal.SIGKILL); "
         "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
         str(ROOT / "scripts" / "prepare_data.py"), str(src / "*.txt"), "-o",
         str(tmp_path / "tok"), "--tokenizer", str(out / "tokenizer.json")],
        stderr=subprocess.PIPE, cwd=ROOT)
    assert killed.wait(timeout=120) == -9, killed.stderr.read().decode()
    (stale,) = tmp_path.iterdir()
    assert stale.name == f".tok.tmp-{killed.pid}" and (stale / "train_000.bin").exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        running = tmp_path / f".tok.tmp-{alive.pid}"  # a run still writing
        running.mkdir()
        (running / "train_000.bin").write_bytes(b"\0\0")
        other = tmp_path / f".other.tmp-{killed.pid}"  # another output's: not ours to judge
        other.mkdir()
        p = script("prepare_data", src / "*.txt", "-o", tmp_path / "tok", "--tokenizer",
                   out / "tokenizer.json")
        assert p.returncode == 0, p.stderr.decode()
        assert {q.name for q in tmp_path.iterdir()} == {"tok", running.name, other.name}
        assert (running / "train_000.bin").read_bytes() == b"\0\0"
    finally:
        alive.kill()
        alive.wait()


def test_a_resume_on_ids_of_another_tokenizer_is_refused(prepared, run_dir, tmp_path, capsys):
    """The run's token directory rebuilt (--force) with another tokenizer of the same vocab
    size, then the run resumed: its ids now mean other strings. Refused in one line naming
    both tokenizers, the run's copy kept; the same tokenizer resumes."""
    src, out = prepared
    tok, run = tmp_path / "tok", tmp_path / "run"
    shutil.copytree(out, tok)
    shutil.copytree(run_dir, run)
    cfg_file = run / "config.yaml"  # the run as if trained on `tok` (the same bytes)
    cfg_file.write_text(cfg_file.read_text().replace(str(out), str(tok)))
    other = json.loads((out / "tokenizer.json").read_text())  # two tokens' ids swapped
    vocab = other["model"]["vocab"]
    a, b = [t for t, i in vocab.items() if i >= 257][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "other.json").write_text(json.dumps(other))
    prepare(capsys, src / "*.txt", "-o", tok, "--tokenizer", tmp_path / "other.json",
            "--val-fraction", "0.3", "--force")
    assert json.loads((tok / "meta.json").read_text())["vocab_size"] == len(vocab)
    kept = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    train_script = _load_script("train")
    resume = ["configs/tiny/mha.yaml", "--run-dir", run, "--quiet", f"data.source={tok}",
              *TINY, "train.steps=6", "train.ckpt_every=6"]
    status, _, err = run_main(train_script.main, resume, capsys)
    assert status == 1 and len(err) == 1, err
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()[:12]  # noqa: E731
    for name in (run / "tokenizer.json", tok / "tokenizer.json"):
        assert f"{name} (sha256 {sha(name)}" in err[0], err
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == kept
    # rebuilt with the run's own tokenizer: the resume goes on
    prepare(capsys, src / "*.txt", "-o", tok, "--tokenizer", run / "tokenizer.json",
            "--val-fraction", "0.3", "--force")
    status, _, err = run_main(train_script.main, resume, capsys)
    assert status == 0, err
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in r] == [3, 6]
    assert (run / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
