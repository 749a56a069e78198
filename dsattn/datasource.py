"""data.source, parsed: what a run's tokens come from, as a typed value.

A config's ``data.source`` text is parsed once, when its DataConfig is built (config load,
an override, ``dataclasses.replace``), into a `DataSource`: its `SourceKind`, the files it
names, a recall source's checked parameters (dsattn.recall) and a token directory's
tokenizer. Every reader takes that value (dsattn.data.load_corpus, evaluate, the run
directory's tokenizer copy, the sweeps' recall probes); none parses the text again.

The text is one of (the same spellings as ever):

    stdlib                         the running interpreter's standard library, as bytes
    recall[:key=value,...]         the synthetic recall task (dsattn.recall.make_spec checks it)
    DIR                            a token directory of scripts/prepare_data.py (meta.json)
    FILE or GLOB                   text files read as bytes, or .u16/.bin token files (~ expanded)

Files are looked up when the text is parsed: a directory is a token directory (a directory
without meta.json is refused), a glob's matches must be all token files or all text. A path
that matches nothing yet is kept (a run directory's config loads on a machine without its
data): its kind follows its suffix, and reading it (`files`) raises FileNotFoundError.
"""

from __future__ import annotations

import enum
import glob as _glob
import os
from dataclasses import dataclass, field
from pathlib import Path

from dsattn import recall as recall_lib
from dsattn import tokendir
from dsattn.errors import ConfigError, InputError

TOKEN_SUFFIXES = (".u16", ".bin")  # raw little-endian uint16 token files


class SourceKind(enum.Enum):
    """What a data.source names (dsattn.data has one loader per kind)."""

    STDLIB = "stdlib"  # the standard library's .py files, as bytes
    RECALL = "recall"  # the synthetic recall task (dsattn.recall)
    TEXT = "text"  # text files (a file or glob), as bytes
    TOKENS = "tokens"  # raw uint16 token files (.u16/.bin)
    TOKEN_DIR = "token_dir"  # a token directory (dsattn.tokendir)

    @property
    def byte_level(self) -> bool:
        """Whether a token is a UTF-8 byte (vocab 256)."""
        return self not in (SourceKind.TOKENS, SourceKind.TOKEN_DIR)


@dataclass(frozen=True)
class DataSource:
    """A parsed data.source (`parse`). Equal, and hashed, by its kind and text: a config is a
    static argument under jit, and its matched files may be many."""

    kind: SourceKind
    text: str  # the data.source text as given (what config.yaml keeps)
    # TEXT/TOKENS: the files matched, sorted (none: nothing matched when parsed);
    # TOKEN_DIR: the directory
    paths: tuple[Path, ...] = field(default=(), compare=False)
    recall: recall_lib.RecallSpec | None = field(default=None, compare=False)  # RECALL only
    tokenizer: Path | None = field(default=None, compare=False)  # TOKEN_DIR: its tokenizer file
    vocab_size: int | None = field(default=None, compare=False)  # TOKEN_DIR: its tokenizer's

    def __str__(self) -> str:
        return self.text

    @property
    def byte_level(self) -> bool:
        return self.kind.byte_level

    def files(self) -> tuple[Path, ...]:
        """The matched files (TEXT, TOKENS); FileNotFoundError when none matched."""
        if not self.paths:
            raise FileNotFoundError(
                f"data.source {self.text!r} matches no file (expected 'stdlib', a text file "
                f"or glob, a .u16/.bin file or a token directory)")
        return self.paths


def _is_token_file(path) -> bool:
    return Path(path).suffix.lower() in TOKEN_SUFFIXES


def _recall(text: str, tail: str) -> DataSource:
    params = {}
    for item in filter(None, (s.strip() for s in tail.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"data.source: recall parameter {item!r} is not key=value "
                              f"(e.g. recall:min_dist=8,max_dist=64)")
        params[key.strip()] = value.strip()
    return DataSource(SourceKind.RECALL, text, recall=recall_lib.make_spec(params))


def _token_dir(text: str, path: str) -> DataSource:
    meta = tokendir.read_meta(path)  # raises for a directory without meta.json
    return DataSource(SourceKind.TOKEN_DIR, text, (Path(path),),
                      tokenizer=Path(path) / meta["tokenizer"], vocab_size=meta["vocab_size"])


def _files(text: str, path: str) -> DataSource:
    matches = tuple(Path(p) for p in sorted(_glob.glob(path, recursive=True))
                    if os.path.isfile(p))
    is_tok = [_is_token_file(p) for p in matches] or [_is_token_file(path)]
    if any(is_tok) and not all(is_tok):
        raise InputError(f"data.source {text!r} mixes token files "
                         f"({'/'.join(TOKEN_SUFFIXES)}) with text files")
    return DataSource(SourceKind.TOKENS if all(is_tok) else SourceKind.TEXT, text, matches)


def parse(text) -> DataSource:
    """The DataSource a data.source text names (the module docstring); ConfigError for a
    malformed recall spec or a text that is not a string, InputError for a glob mixing
    token and text files or a directory that is not a token directory."""
    if isinstance(text, DataSource):
        return text
    if not isinstance(text, str):
        raise ConfigError(f"data.source: expected a string, got {text!r}")
    head, _, tail = text.partition(":")
    if head == "recall":
        return _recall(text, tail)
    if text == "stdlib":
        return DataSource(SourceKind.STDLIB, text)
    path = os.path.expanduser(text)
    return _token_dir(text, path) if os.path.isdir(path) else _files(text, path)


STDLIB = parse("stdlib")

__all__ = ["DataSource", "SourceKind", "parse", "STDLIB", "TOKEN_SUFFIXES"]
