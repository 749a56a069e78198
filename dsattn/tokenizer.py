"""Tokenizers behind one small interface: bytes, or a Hugging Face `tokenizers` tokenizer.json.

Every byte-level corpus (stdlib, text files, recall) is tokenized by `ByteTokenizer` (a token
is a UTF-8 byte, vocab 256). A token directory of scripts/prepare_data.py (dsattn.tokendir)
carries a tokenizer.json, and a run trained on one keeps a copy (`for_run`), so generation and
evaluation read text the way training did. Both tokenizers offer `vocab_size`, `eos_id`,
`encode`/`encode_bytes`, `decode` and `streamer()` (bytes to print as tokens arrive).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

from dsattn.errors import InputError

TOKENIZER_FILE = "tokenizer.json"  # the name in a token directory and in a run directory
EOS = "<|endoftext|>"  # the separator appended after each document by default


class ByteTokenizer:
    """UTF-8 bytes; decoding invalid UTF-8 (a sample cut mid-character) gives U+FFFD."""

    vocab_size = 256
    eos_id = None
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, raw: bytes) -> list[int]:
        return list(raw)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def streamer(self) -> "_ByteStream":
        return _ByteStream()


class _ByteStream:
    """Raw bytes as they come: a terminal joins the bytes of a character itself."""

    def push(self, token: int) -> bytes:
        return bytes([token])

    def flush(self) -> bytes:
        return b""


class HFTokenizer:
    """A `tokenizers.Tokenizer`. Corpus text is encoded with `literal_specials=True`: a
    document's literal "<|endoftext|>" stays text and cannot forge a document boundary; a
    prompt (the default) may name special tokens. Decoding keeps special tokens visible."""

    def __init__(self, tok, name: str = TOKENIZER_FILE, eos: str = EOS):
        self.tok, self.name = tok, name
        self._index(eos)

    def _index(self, eos: str) -> None:
        vocab = self.tok.get_vocab(with_added_tokens=True)
        # ids may have gaps (added tokens): the model needs room for the largest
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.eos_id = self.tok.token_to_id(eos)

    @classmethod
    def from_file(cls, path, eos: str = EOS) -> "HFTokenizer":
        import tokenizers

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {str(path)!r} does not exist")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any bad file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise InputError(f"{path}: not a Hugging Face tokenizers file ({first})") from None
        return cls(tok, str(path), eos)

    def encode(self, text: str, *, literal_specials: bool = False) -> list[int]:
        return self.encode_batch([text], literal_specials=literal_specials)[0]

    def encode_batch(self, texts: list[str], *, literal_specials: bool = False) -> list[list[int]]:
        self.tok.encode_special_tokens = literal_specials
        try:  # add_special_tokens=False: no [CLS]/[SEP] templates around plain text
            return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]
        finally:
            self.tok.encode_special_tokens = False

    def encode_bytes(self, raw: bytes) -> list[int]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"the prompt is not UTF-8 text (byte {e.start}); this run's "
                             f"tokenizer reads text") from None
        return self.encode(text)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def streamer(self) -> "_TextStream":
        return _TextStream(self)

    def save(self, path) -> None:
        self.tok.save(str(path))

    def add_special(self, token: str) -> int:
        """Add a special token (at the end of the vocab) and return its id."""
        self.tok.add_special_tokens([token])
        self._index(token)
        return self.eos_id


class _TextStream:
    """Incremental decoding: a piece of text is emitted once the tokens so far decode to whole
    characters (a byte-level BPE token may hold part of one). Decodes a short window only."""

    def __init__(self, tokenizer: HFTokenizer):
        self.t, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def push(self, token: int) -> bytes:
        self.ids.append(int(token))
        return self._emit(final=False)

    def flush(self) -> bytes:
        return self._emit(final=True)

    def _emit(self, final: bool) -> bytes:
        done = self.t.decode(self.ids[self.prefix:self.read])
        text = self.t.decode(self.ids[self.prefix:])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return b""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):].encode("utf-8")


def train_bpe(texts: Iterable[str], vocab_size: int, eos: str = EOS,
              min_frequency: int = 2) -> HFTokenizer:
    """A byte-level BPE of at most `vocab_size` tokens (the 256 bytes, `eos`, then merges)
    learned from `texts`; decoding gives the text back exactly (no normalizer, no prefix
    space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, TOKENIZER_FILE, eos)


def for_run(run_dir) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a run was trained with: its tokenizer.json, else bytes."""
    path = Path(run_dir) / TOKENIZER_FILE
    return HFTokenizer.from_file(path) if path.exists() else ByteTokenizer()


def check_run_data(run_dir, source, doing: str) -> None:
    """InputError unless `source` (a config's data.source, a DataSource) holds ids of the
    tokenizer run_dir keeps: another tokenizer's ids (even of the same vocab size) or bytes
    mean other strings, so the run would be `doing` (e.g. "evaluated") on nonsense. The
    tokenizer files must be the same bytes; a run on bytes (no tokenizer.json) passes."""
    kept = Path(run_dir) / TOKENIZER_FILE
    if not kept.exists():
        return  # byte-level runs: data.load_corpus checks the vocab
    theirs = source.tokenizer
    if theirs is not None and Path(theirs).read_bytes() == kept.read_bytes():
        return
    sha = lambda p: hashlib.sha256(Path(p).read_bytes()).hexdigest()[:16]  # noqa: E731
    holds = f"ids of {theirs} (sha256 {sha(theirs)})" if theirs is not None else "bytes"
    raise InputError(f"{run_dir} cannot be {doing} on {source.text!r}: the run was trained on "
                     f"ids of {kept} (sha256 {sha(kept)}), the data holds {holds}; use a token "
                     f"directory prepared with the run's tokenizer (scripts/prepare_data.py "
                     f"--tokenizer {kept})")


__all__ = ["ByteTokenizer", "HFTokenizer", "train_bpe", "for_run", "check_run_data",
           "TOKENIZER_FILE", "EOS"]
