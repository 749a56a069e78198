"""A token directory: a corpus tokenized once (scripts/prepare_data.py), read by data.source=DIR.

    DIR/meta.json        format, version, tokenizer, vocab_size, dtype, eos_id, splits
    DIR/tokenizer.json   the tokenizer the ids belong to (dsattn.tokenizer)
    DIR/train_000.bin    raw little-endian token ids: uint16 when the vocab fits, else uint32
    DIR/val_000.bin

Every document's tokens are followed by `eos_id`, so a shard reads doc, eos, doc, eos, ... and
holds whole documents; train and validation are split by document. meta.json lists each
split's shards in order with their tokens, bytes, sha256 and documents. `read_meta` checks
the fields and every shard's size against them; `read` also hashes every shard against its
sha256 and bounds its ids (`verify`: one pass, 0.15 s for 100 MB on a 2-core CPU) and
memory-maps them. `Writer` fills a temporary sibling directory and renames it into place at
the end: a failed or interrupted run leaves nothing half-done (a killed one's temporary
directory is removed by the next Writer of the same directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from dsattn.errors import InputError
from dsattn.tokenizer import TOKENIZER_FILE, HFTokenizer

META_FILE = "meta.json"
FORMAT = "dsattn-tokens"
VERSION = 1
SPLITS = ("train", "val")
DTYPES = {"uint16": "<u2", "uint32": "<u4"}  # meta.json's name -> the bytes on disk
HASH_CHUNK = 1 << 24  # bytes of a shard hashed (and its ids bounded) at a time


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype that holds ids 0..vocab_size-1: uint16 up to 65536 tokens."""
    return np.dtype(DTYPES["uint16"] if vocab_size <= 1 << 16 else DTYPES["uint32"])


def is_token_dir(path) -> bool:
    return (Path(path) / META_FILE).is_file()


# ----------------------------------------------------------------------------- writing
class Writer:
    """Writes a token directory at `out`: `add(split, ids)` per document, then `commit`.
    Used as a context manager, an exception removes everything written."""

    def __init__(self, out, vocab_size: int, eos_id: int, *, force: bool = False):
        self.out = Path(out)
        check_output(self.out, force)
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.dtype = token_dtype(vocab_size)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        _remove_stale(self.out)
        self.tmp.mkdir()
        self.shards = {s: {"file": f"{s}_000.bin", "tokens": 0, "bytes": 0, "documents": 0}
                       for s in SPLITS}
        self._files = {s: open(self.tmp / self.shards[s]["file"], "wb") for s in SPLITS}
        self._sha = {s: hashlib.sha256() for s in SPLITS}

    def add(self, split: str, ids) -> None:
        """One document's ids; the separator is appended here."""
        arr = np.append(np.asarray(ids, np.int64), self.eos_id)
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            raise InputError(f"token id {int(arr.max())} is outside the tokenizer's "
                             f"vocab of {self.vocab_size}")
        raw = arr.astype(self.dtype).tobytes()
        self._files[split].write(raw)
        self._sha[split].update(raw)
        shard = self.shards[split]
        shard["tokens"] += len(arr)
        shard["bytes"] += len(raw)
        shard["documents"] += 1

    def commit(self, tokenizer, **info) -> dict:
        """Write the tokenizer and meta.json, then move the directory into place. `tokenizer`
        is a tokenizer.json path (copied as is) or an object with `save(path)`."""
        self._close()
        if isinstance(tokenizer, (str, Path)):
            shutil.copyfile(tokenizer, self.tmp / TOKENIZER_FILE)
        else:
            tokenizer.save(self.tmp / TOKENIZER_FILE)
        meta = {"format": FORMAT, "version": VERSION, "tokenizer": TOKENIZER_FILE,
                "vocab_size": self.vocab_size, "dtype": self.dtype.name,
                "eos_id": self.eos_id, **info,
                "splits": {s: [{**self.shards[s], "sha256": self._sha[s].hexdigest()}]
                           for s in SPLITS}}
        (self.tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
        old = None
        if self.out.exists():  # empty, or --force: set aside first so `out` is never partial
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old)
        return meta

    def abort(self) -> None:
        self._close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _close(self):
        for f in self._files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is not None:
            self.abort()


def _remove_stale(out: Path) -> None:
    """Remove the temporary directories beside `out` of Writers whose process is gone (a
    SIGKILL runs no cleanup, so nothing else ever would), this pid's leftover included. One
    whose pid is alive is a run still writing: it stays."""
    for tmp in out.parent.iterdir():
        m = re.fullmatch(rf"\.{re.escape(out.name)}\.tmp-(\d+)", tmp.name)
        if m and (int(m[1]) == os.getpid() or not _alive(int(m[1]))):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def check_output(out: Path, force: bool, inputs=()) -> None:
    """Refuse to replace a file, or a non-empty directory unless forced. `force` replaces
    only a token directory holding nothing else and none of the `inputs` (resolved paths):
    the old directory is removed whole, and once that took the very inputs with it."""
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    root = out.resolve()
    inside = [p for p in inputs if Path(p).is_relative_to(root)]
    if inside:
        raise InputError(f"input {inside[0]} lies inside the output directory {out}, which "
                         f"--force would remove; write the token directory elsewhere (-o)")
    other = _not_token_dir_entry(out)
    if other is not None:
        raise InputError(f"{out} is not a token directory ({other}); --force replaces only a "
                         f"token directory of prepare_data.py or an empty directory: choose "
                         f"another -o, or empty it yourself")
    if not force:
        raise InputError(f"{out} is a token directory; --force replaces it")


def _not_token_dir_entry(path: Path) -> str | None:
    """Why `path` is not a token directory (its meta.json, or an entry that none of
    prepare_data.py's files are), or None: its entries are all a token directory's."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        ours = {META_FILE, meta["tokenizer"]}
        ours |= {s["file"] for shards in meta["splits"].values() for s in shards}
        if meta["format"] != FORMAT:
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # any other meta.json
        return f"no {META_FILE} of prepare_data.py"
    other = sorted(p.name for p in path.iterdir() if p.name not in ours or not p.is_file())
    return f"it holds {other[0]}" if other else None


# ----------------------------------------------------------------------------- reading
def read_meta(path) -> dict:
    """meta.json of a token directory, with its fields and every shard's size checked."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise InputError(f"{path} is a directory without {META_FILE}: not a token directory of "
                         f"scripts/prepare_data.py (for text files give a glob such as "
                         f"{os.path.join(str(path), '*.txt')!r})")
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{meta_path}: not JSON ({e})") from None

    def bad(what):
        return InputError(f"{meta_path}: {what}; rerun scripts/prepare_data.py")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad(f"not a {FORMAT} metadata file")
    if meta.get("version") != VERSION:
        raise bad(f"format version {meta.get('version')!r}, this dsattn reads {VERSION}")
    for key, typ in (("tokenizer", str), ("vocab_size", int), ("dtype", str),
                     ("splits", dict)):
        if not isinstance(meta.get(key), typ):
            raise bad(f"field {key!r} missing or not a {typ.__name__}")
    if not (meta.get("eos_id") is None or isinstance(meta["eos_id"], int)):
        raise bad("field 'eos_id' is not an integer")
    if meta["dtype"] not in DTYPES or np.dtype(DTYPES[meta["dtype"]]).itemsize < \
            token_dtype(meta["vocab_size"]).itemsize:
        raise bad(f"dtype {meta['dtype']!r} cannot hold a vocab of {meta['vocab_size']}")
    if not (path / meta["tokenizer"]).is_file():
        raise bad(f"its tokenizer {meta['tokenizer']!r} is missing")
    # a run copies the tokenizer: one that does not load would only fail at generation
    tok_vocab = HFTokenizer.from_file(path / meta["tokenizer"]).vocab_size
    if tok_vocab != meta["vocab_size"]:
        raise bad(f"vocab_size {meta['vocab_size']}, its tokenizer has {tok_vocab} tokens")
    itemsize = np.dtype(DTYPES[meta["dtype"]]).itemsize
    for split in SPLITS:
        shards = meta["splits"].get(split)
        if not isinstance(shards, list) or not shards:
            raise bad(f"no {split!r} shards")
        for s in shards:
            if not (isinstance(s, dict) and isinstance(s.get("file"), str)
                    and isinstance(s.get("tokens"), int) and isinstance(s.get("bytes"), int)
                    and isinstance(s.get("sha256"), str)):
                raise bad(f"a {split!r} shard lacks file, tokens, bytes or sha256")
            f = path / s["file"]
            size = f.stat().st_size if f.is_file() else None
            if size is None or size != s["bytes"] or size != s["tokens"] * itemsize:
                raise bad(f"shard {s['file']} has {size} bytes, meta.json says {s['bytes']} "
                          f"({s['tokens']} tokens of {meta['dtype']})")
    return meta


def verify(path, meta: dict) -> None:
    """Every shard's bytes against meta.json's sha256 and its ids against the vocab, in one
    pass: a damaged shard is named (InputError), not trained on. Out-of-vocab ids once read
    as a NaN loss several steps in; damage that keeps every id in the vocab is caught only by
    the hash."""
    dtype, vocab = np.dtype(DTYPES[meta["dtype"]]), meta["vocab_size"]
    for split in SPLITS:
        for s in meta["splits"][split]:
            f, sha, bad, n = Path(path) / s["file"], hashlib.sha256(), None, 0
            with open(f, "rb") as fh:  # read_meta checked the size: whole ids, chunk by chunk
                while chunk := fh.read(HASH_CHUNK):
                    sha.update(chunk)
                    ids = np.frombuffer(chunk, dtype)
                    if bad is None and ids.size and ids.max() >= vocab:
                        i = int(np.argmax(ids >= vocab))
                        bad = n + i, int(ids[i])
                    n += ids.size
            hashed = sha.hexdigest() == s["sha256"]
            if bad is not None:
                also = "" if hashed else ", and its sha256 is not meta.json's"
                raise InputError(
                    f"{f}: token {bad[0]:,} (byte offset {bad[0] * dtype.itemsize:,}) is id "
                    f"{bad[1]}, outside the vocab of {vocab}{also}: the shard is damaged; "
                    f"rerun scripts/prepare_data.py")
            if not hashed:
                raise InputError(
                    f"{f}: its sha256 {sha.hexdigest()[:16]}... is not meta.json's "
                    f"{s['sha256'][:16]}...: the shard is damaged or changed since "
                    f"scripts/prepare_data.py wrote it; rerun scripts/prepare_data.py")


def read(path) -> tuple[dict, np.ndarray, np.ndarray]:
    """(meta, train, val) of a token directory, every shard verified (`verify`): read-only
    memory maps of its shards (several shards of a split are concatenated in memory)."""
    meta = read_meta(path)
    verify(path, meta)
    dtype = DTYPES[meta["dtype"]]

    def split(name):
        maps = [np.memmap(Path(path) / s["file"], dtype=dtype, mode="r") if s["tokens"]
                else np.zeros(0, dtype) for s in meta["splits"][name]]
        return maps[0] if len(maps) == 1 else np.concatenate(maps)

    return meta, split("train"), split("val")


__all__ = ["Writer", "read", "read_meta", "verify", "token_dtype", "is_token_dir", "META_FILE",
           "VERSION"]
