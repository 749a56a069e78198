"""Data: token corpora and stateless batching for training and evaluation.

The default corpus is the ``.py`` source of the running interpreter's standard library,
read as bytes (vocab 256), so every experiment works offline and identically on every
machine with the same Python. User data is a text file or glob (bytes again), a raw
little-endian uint16 token file (``.u16``/``.bin``), or a token directory of
scripts/prepare_data.py (dsattn.tokendir: memory-mapped shards, their tokenizer and split).
`load_corpus` reads the corpus a config's ``data.source`` names (a `DataSource`, parsed
when the config loaded: dsattn.datasource), one loader per `SourceKind`. Validation is split
by file (a stable CRC32 of each file's relative path), or by a contiguous tail when there is
only one file, so no text ever appears on both sides; a token directory was split by
document when it was prepared. ``batch_at`` draws the batch of step ``i`` from
``default_rng([seed, i])``: batches are a pure function of (seed, step), so a resumed run
sees exactly the batches an uninterrupted one would, with no iterator state to save.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsattn import recall as recall_lib
from dsattn import tokendir
from dsattn import config as config_lib
from dsattn.config import DataConfig
from dsattn.datasource import DataSource, SourceKind
from dsattn.errors import ConfigError, InputError
FILE_SEPARATOR = b"\n"  # joins files of a split; byte-level vocab has no spare token
_HASH_BUCKETS = 10_000
_EVAL_SEED_BASE = 2**32  # eval batches use seed + this: never a training (seed, step) stream


@dataclass
class Corpus:
    train: np.ndarray  # 1-D int32 (byte sources), uint16/uint32 (token files, dirs), read-only
    val: np.ndarray
    vocab_size: int  # the model vocab the tokens were checked against (all tokens < it)
    description: str
    # Per-token loss weights (weights[p]: the weight of predicting token p), or None: all 1.
    train_weights: np.ndarray | None = None
    val_weights: np.ndarray | None = None
    block: int = 0  # windows start at multiples of this (independent sequences); 0: anywhere
    # Steps before warm_steps draw from `warm` ((tokens, weights): an easier stream, e.g.
    # recall with every answer near its fact) instead of `train`.
    warm_steps: int = 0
    warm: tuple | None = None

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> dict:
        """Training batch of `step` (batch_at with this corpus's weights and block)."""
        tokens, weights = ((self.train, self.train_weights) if step >= self.warm_steps
                           else self.warm)
        return batch_at(tokens, step, batch_size, seq_len, seed, weights=weights,
                        block=self.block)

    def eval_batches(self, n_batches: int, batch_size: int, seq_len: int,
                     seed: int = 0) -> list[dict]:
        return eval_batches(self.val, n_batches, batch_size, seq_len, seed,
                            weights=self.val_weights, block=self.block)

    def val_windows(self, seq_len: int, batch_size: int, max_tokens: int = 0):
        """The validation split in consecutive windows (`split_windows`)."""
        return split_windows(self.val, seq_len, batch_size, max_tokens,
                             weights=self.val_weights, block=self.block)


# ----------------------------------------------------------------------------- byte codec
def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as int32 tokens: the tokenizer of every byte-level corpus."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
    """Inverse of `encode`; invalid UTF-8 (e.g. a sample cut mid-character) becomes U+FFFD."""
    arr = np.asarray(tokens).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise InputError(f"decode: byte tokens must be in [0, 255], got {arr.min()}..{arr.max()}")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------- splitting
def is_val_file(relpath: str, val_fraction: float) -> bool:
    """Stable by-file split: depends only on the path, so it never moves between runs."""
    bucket = zlib.crc32(relpath.replace(os.sep, "/").encode("utf-8")) % _HASH_BUCKETS
    return bucket < val_fraction * _HASH_BUCKETS


def split_files(relpaths, val_fraction: float) -> tuple[list[str], list[str]]:
    """(train, val) relative paths, each in the given order."""
    train, val = [], []
    for r in relpaths:
        (val if is_val_file(r, val_fraction) else train).append(r)
    return train, val


def _budgets(max_bytes: int, val_fraction: float) -> tuple[int | None, int | None]:
    """Cap train and val separately in proportion, so a small cap still leaves validation."""
    if not max_bytes:
        return None, None
    val = max(1, round(max_bytes * val_fraction))
    return max(1, max_bytes - val), val


def _tail_split_len(n: int, val_fraction: float, what: str) -> int:
    """Validation length of a contiguous tail split: round(n * val_fraction), in [1, n-1]."""
    if n < 2:
        raise InputError(f"{what}: {n} token(s) is too few to split into train and validation")
    return min(max(1, round(n * val_fraction)), n - 1)


def _read_joined(paths, budget: int | None) -> tuple[bytes, int]:
    """Files joined by FILE_SEPARATOR in order, cut at `budget` bytes; reading stops there.

    Returns (bytes, number of files that contributed).
    """
    parts, total, used = [], 0, 0
    for p in paths:
        if parts:
            parts.append(FILE_SEPARATOR)
            total += len(FILE_SEPARATOR)
        if budget is not None and total >= budget:
            break
        with open(p, "rb") as f:
            data = f.read() if budget is None else f.read(budget - total)
        parts.append(data)
        total += len(data)
        used += 1
    out = b"".join(parts)
    return (out if budget is None else out[:budget]), used


def _bytes_to_tokens(data: bytes) -> np.ndarray:
    arr = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
    arr.flags.writeable = False
    return arr


def _check_vocab(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """Out-of-range ids would be silently clamped by a JAX embedding gather: refuse them."""
    if tokens.size:
        top = int(tokens.max())
        if top >= vocab_size:
            raise InputError(
                f"{what}: max token {top} is out of range for model vocab_size {vocab_size}"
            )


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB"


def _split_byte_files(root: Path, relpaths, val_fraction: float, max_bytes: int, name: str):
    """Train/val token arrays from many files, split by file; the tail fallback keeps a
    split non-empty when the hash happens to put every file on one side."""
    train_rel, val_rel = split_files(relpaths, val_fraction)
    if not train_rel or not val_rel:
        data, used = _read_joined([root / r for r in relpaths], max_bytes or None)
        n_val = _tail_split_len(len(data), val_fraction, name)
        desc = (f"{name}: {used} files, {_mb(len(data))}, "
                f"last {n_val} bytes as validation (by-file split left one side empty)")
        return _bytes_to_tokens(data[:-n_val]), _bytes_to_tokens(data[-n_val:]), desc
    b_train, b_val = _budgets(max_bytes, val_fraction)
    train, n_tr = _read_joined([root / r for r in train_rel], b_train)
    val, n_va = _read_joined([root / r for r in val_rel], b_val)
    capped = bool(max_bytes) and (n_tr < len(train_rel) or n_va < len(val_rel)
                                  or len(train) == b_train or len(val) == b_val)
    desc = (f"{name}: {n_tr + n_va} files ({n_tr} train, {n_va} val), "
            f"{_mb(len(train) + len(val))}" + (" (capped by data.max_bytes)" if capped else ""))
    return _bytes_to_tokens(train), _bytes_to_tokens(val), desc


# ----------------------------------------------------------------------------- stdlib corpus
def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=None)
def _stdlib_files() -> tuple[str, ...]:
    """Relative posix paths of the stdlib's .py files (no site-packages), sorted."""
    root = _stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__")]
        for f in files:
            if f.endswith(".py"):
                out.append(Path(os.path.relpath(os.path.join(d, f), root)).as_posix())
    return tuple(sorted(out))


@functools.lru_cache(maxsize=8)
def _stdlib_corpus(val_fraction: float, max_bytes: int):
    """Cached: tests and the trainer load it repeatedly; the arrays are read-only."""
    files = _stdlib_files()
    if not files:
        raise InputError(f"stdlib corpus: no .py files under {_stdlib_root()}")
    return _split_byte_files(_stdlib_root(), files, val_fraction, max_bytes, "stdlib")


def _load_token_files(paths: list[Path], data_cfg: DataConfig, vocab_size: int):
    """uint16 tokens, memory-mapped when there is one file; the tail is validation."""
    arrays = []
    for p in paths:
        size = p.stat().st_size
        if size % 2:
            raise InputError(f"{p}: {size} bytes is not a whole number of uint16 tokens")
        arr = np.memmap(p, dtype="<u2", mode="r") if size else np.zeros(0, np.uint16)
        _check_vocab(arr, vocab_size, str(p))
        arrays.append(arr)
    tokens = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    total = len(tokens)
    if data_cfg.max_bytes:
        tokens = tokens[: data_cfg.max_bytes // 2]
    name = str(paths[0]) if len(paths) == 1 else f"{len(paths)} token files"
    if not len(tokens):
        raise InputError(f"{name}: empty corpus (no tokens)")
    n_val = _tail_split_len(len(tokens), data_cfg.val_fraction, name)
    train, val = tokens[:-n_val], tokens[-n_val:]
    for a in (train, val):
        a.flags.writeable = False
    capped = f" of {total:,} (capped by data.max_bytes)" if len(tokens) < total else ""
    desc = f"{name}: {len(tokens):,} uint16 tokens{capped}, last {n_val:,} as validation"
    return train, val, desc


def _load_text_files(paths: list[Path], data_cfg: DataConfig):
    source = data_cfg.source.text
    if len(paths) == 1:
        p = paths[0]
        data, _ = _read_joined([p], data_cfg.max_bytes or None)
        if not data:
            raise InputError(f"{p}: empty corpus (0 bytes)")
        n_val = _tail_split_len(len(data), data_cfg.val_fraction, str(p))
        desc = f"{p}: {_mb(len(data))}, last {n_val:,} bytes as validation"
        return _bytes_to_tokens(data[:-n_val]), _bytes_to_tokens(data[-n_val:]), desc
    # Hash paths relative to the matches' common folder: the split survives a change of cwd.
    root = Path(os.path.commonpath([str(p.resolve()) for p in paths]))
    rel = [p.resolve().relative_to(root).as_posix() for p in paths]
    if sum(p.stat().st_size for p in paths) == 0:
        raise InputError(f"{source!r}: empty corpus ({len(paths)} files, 0 bytes)")
    return _split_byte_files(root, rel, data_cfg.val_fraction, data_cfg.max_bytes, repr(source))


def _check_dir_vocab(tokens: int, vocab_size: int, source: str) -> None:
    """Ids up to the tokenizer's vocab (`tokens`) may occur: the model must have room for all
    of them."""
    if vocab_size < tokens:
        raise ConfigError(
            f"data.source {source!r}: its tokenizer has {tokens} tokens, more than "
            f"model.vocab_size {vocab_size} (set model.vocab_size >= {tokens}, or "
            f"leave it unset to take the tokenizer's)")


def _load_token_dir(path: Path, data_cfg: DataConfig, vocab_size: int):
    """The directory's own train/val split (memory-mapped), each capped by data.max_bytes in
    proportion; every shard was checked against its sha256 and its ids bounded by the vocab
    of meta.json (tokendir.verify)."""
    meta, train, val = tokendir.read(path)
    _check_dir_vocab(meta["vocab_size"], vocab_size, data_cfg.source.text)
    total = len(train) + len(val)
    b_train, b_val = _budgets(data_cfg.max_bytes, data_cfg.val_fraction)
    if b_train is not None:
        train, val = train[: b_train // train.itemsize], val[: b_val // val.itemsize]
    if not len(train) or not len(val):
        raise InputError(f"{path}: empty corpus (train {len(train)}, val {len(val)} tokens)")
    capped = f" of {total:,} (capped by data.max_bytes)" if len(train) + len(val) < total else ""
    desc = (f"{path}: {len(train) + len(val):,} {meta['dtype']} tokens{capped}, "
            f"{len(val):,} as validation (vocab {meta['vocab_size']}, {meta['tokenizer']})")
    return train, val, desc


@functools.lru_cache(maxsize=4)
def recall_streams(spec: recall_lib.RecallSpec, val_fraction: float, max_bytes: int):
    """(train, val, description) of a recall source (dsattn.recall; its `DataSource.recall`);
    cached: every Trainer of a sweep and every probe set reads the same streams."""
    if spec.format == "mqar":
        train, val, _, _, desc = recall_lib.mqar_streams(spec, val_fraction)
        return train, val, desc
    filler = None
    if spec.corpus:  # facts planted in a corpus's bytes
        corpus = load_corpus(DataConfig(source=spec.corpus, val_fraction=val_fraction,
                                        max_bytes=max_bytes), 256)
        filler = corpus.train, corpus.val
    return recall_lib.byte_streams(spec, val_fraction, filler)


def _recall_corpus(spec: recall_lib.RecallSpec, data_cfg: DataConfig, vocab_size: int) -> Corpus:
    if vocab_size < 256:
        raise ConfigError(f"data.source: recall is byte-level and needs model.vocab_size >= "
                          f"256, got {vocab_size}")
    if spec.format == "mqar":
        train, val, w_train, w_val, desc = recall_lib.mqar_streams(spec, data_cfg.val_fraction)
        warm = recall_lib.mqar_warm_stream(spec) if spec.warm_steps else None
        return Corpus(train, val, vocab_size, desc, train_weights=w_train, val_weights=w_val,
                      block=spec.block, warm_steps=spec.warm_steps, warm=warm)
    train, val, desc = recall_streams(spec, data_cfg.val_fraction, data_cfg.max_bytes)
    return Corpus(train, val, vocab_size, desc)


# ----------------------------------------------------------------------------- public API
def _byte_corpus(train, val, desc: str, what: str, vocab_size: int) -> Corpus:
    """A byte corpus (stdlib, text), its ids checked against the vocab."""
    if not len(train) or not len(val):
        raise InputError(f"{what}: empty corpus (train {len(train)}, val {len(val)} tokens)")
    _check_vocab(train, vocab_size, what)
    _check_vocab(val, vocab_size, what)
    return Corpus(train, val, vocab_size, desc)


def _stdlib_source(src: DataSource, data_cfg: DataConfig, vocab_size: int) -> Corpus:
    return _byte_corpus(*_stdlib_corpus(data_cfg.val_fraction, data_cfg.max_bytes),
                        "stdlib corpus", vocab_size)


def _text_source(src: DataSource, data_cfg: DataConfig, vocab_size: int) -> Corpus:
    return _byte_corpus(*_load_text_files(list(src.files()), data_cfg),
                        f"data.source {src.text!r}", vocab_size)


def _token_files_source(src: DataSource, data_cfg: DataConfig, vocab_size: int) -> Corpus:
    train, val, desc = _load_token_files(list(src.files()), data_cfg, vocab_size)  # ids checked
    return Corpus(train, val, vocab_size, desc)


def _token_dir_source(src: DataSource, data_cfg: DataConfig, vocab_size: int) -> Corpus:
    # shards hashed, ids bounded by the tokenizer's vocab (tokendir.read)
    train, val, desc = _load_token_dir(src.paths[0], data_cfg, vocab_size)
    return Corpus(train, val, vocab_size, desc)


def _recall_source(src: DataSource, data_cfg: DataConfig, vocab_size: int) -> Corpus:
    return _recall_corpus(src.recall, data_cfg, vocab_size)  # synthetic (dsattn/recall.py)


LOADERS = {  # SourceKind -> (source, data config, vocab size) -> Corpus
    SourceKind.STDLIB: _stdlib_source,
    SourceKind.RECALL: _recall_source,
    SourceKind.TEXT: _text_source,
    SourceKind.TOKENS: _token_files_source,
    SourceKind.TOKEN_DIR: _token_dir_source,
}


def load_corpus(data_cfg: DataConfig, vocab_size: int) -> Corpus:
    """Train/val tokens for `data_cfg.source`, checked against the model's vocab."""
    return LOADERS[data_cfg.source.kind](data_cfg.source, data_cfg, vocab_size)


def with_source_vocab(cfg: config_lib.Config, explicit: bool = False) -> config_lib.Config:
    """`cfg` with model.vocab_size set to a token directory's vocab, unless `explicit` (the
    user set model.vocab_size): then a smaller one is refused (ConfigError) and a larger one
    kept with a warning (its extra rows are never trained). Other sources: `cfg` unchanged.
    Call before a model is built."""
    src = cfg.data.source
    if src.vocab_size is None:
        return cfg
    if not explicit and cfg.model.vocab_size != src.vocab_size:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, vocab_size=src.vocab_size))
        config_lib.validate(cfg)  # e.g. a tensor axis must still divide the vocab
    _check_dir_vocab(src.vocab_size, cfg.model.vocab_size, src.text)
    if cfg.model.vocab_size > src.vocab_size:
        warnings.warn(f"model.vocab_size={cfg.model.vocab_size} is larger than the "
                      f"{src.vocab_size} tokens of {src.text!r}'s tokenizer: "
                      f"{cfg.model.vocab_size - src.vocab_size:,} rows of the embedding "
                      f"are never trained (leave model.vocab_size unset to follow it)")
    return cfg


def batch_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int, *,
             weights: np.ndarray | None = None, block: int = 0) -> dict:
    """Batch of step `step`: random windows from ``default_rng([seed, step])``.

    A pure function of (seed, step), so resuming needs no data-iterator state. With `block`,
    windows start at multiples of it (a corpus of independent blocks) and hold part of one
    block or whole blocks; with `weights` (one per token), the batch also has "weights": the
    loss weight of each target.
    """
    n = len(tokens)
    if n < seq_len + 1:
        raise InputError(f"batch_at: {n} tokens is shorter than seq_len + 1 = {seq_len + 1}")
    if seed < 0 or step < 0:
        raise InputError(f"batch_at: seed and step must be >= 0, got seed={seed}, step={step}")
    rng = np.random.default_rng([seed, step])
    if block:
        if seq_len > block and seq_len % block:
            raise InputError(f"batch_at: seq_len {seq_len} must be at most the corpus's "
                             f"sequences of {block} tokens, or whole ones")
        starts = rng.integers(0, (n - seq_len - 1) // block + 1, size=batch_size) * block
    else:
        starts = rng.integers(0, n - seq_len, size=batch_size)  # last start is n - seq_len - 1
    idx = starts[:, None] + np.arange(seq_len + 1)
    window = np.asarray(tokens)[idx].astype(np.int32)
    out = {"inputs": window[:, :-1], "targets": window[:, 1:]}
    if weights is not None:
        out["weights"] = np.asarray(weights, np.float32)[idx[:, 1:]]
    return out


def eval_batches(tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int,
                 seed: int = 0, *, weights: np.ndarray | None = None,
                 block: int = 0) -> list[dict]:
    """Fixed validation batches: the same every eval, so losses are comparable over a run."""
    return [batch_at(tokens, i, batch_size, seq_len, _EVAL_SEED_BASE + seed, weights=weights,
                     block=block) for i in range(n_batches)]


def split_windows(tokens: np.ndarray, seq_len: int, batch_size: int, max_tokens: int = 0, *,
                  weights: np.ndarray | None = None, block: int = 0):
    """Batches ({"inputs", "targets"[, "weights"]}) of a split cut into consecutive windows:
    each scores the seq_len tokens after the last one's, so every token is scored once (with
    `block`, windows start at its multiples). At most `max_tokens` are scored (0: all), the
    windows then spread evenly over the split; whole batches of `batch_size` rows (one
    shape, one compiled program), or one batch of every window when there are fewer.
    Returns (number of windows, a generator of the batches)."""
    stride = seq_len if not block else -(-seq_len // block) * block
    starts = np.arange(0, len(tokens) - seq_len, stride)  # each needs seq_len + 1 tokens
    k = len(starts) if not max_tokens else min(len(starts), max(1, max_tokens // seq_len))
    if k >= batch_size:
        k -= k % batch_size
    starts = starts[np.linspace(0, len(starts) - 1, k).round().astype(int)] if k else starts[:0]
    rows = min(batch_size, k)

    def batches():
        for i in range(0, k, rows):
            idx = starts[i:i + rows, None] + np.arange(seq_len + 1)
            window = np.asarray(tokens)[idx].astype(np.int32)
            out = {"inputs": window[:, :-1], "targets": window[:, 1:]}
            if weights is not None:
                out["weights"] = np.asarray(weights, np.float32)[idx[:, 1:]]
            yield out

    return k, batches()


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the token frequencies: the loss of a model that ignores context."""
    tokens = np.asarray(tokens).reshape(-1)
    if not tokens.size:
        raise InputError("unigram_entropy: no tokens")
    counts = np.bincount(tokens, minlength=vocab_size)
    if len(counts) > vocab_size:
        raise InputError(
            f"unigram_entropy: max token {int(tokens.max())} >= vocab_size {vocab_size}"
        )
    p = counts[counts > 0] / tokens.size
    return float(-(p * np.log(p)).sum())


__all__ = ["Corpus", "load_corpus", "LOADERS", "with_source_vocab", "batch_at", "eval_batches",
           "split_windows", "unigram_entropy", "encode", "decode", "split_files", "is_val_file"]
