#!/usr/bin/env python
"""Tokenize a corpus once into a token directory for data.source=DIR (nanoGPT-style).

    python scripts/prepare_data.py INPUT... -o DIR [--vocab-size 4096 | --tokenizer FILE]
        [--docs file|paragraph|line] [--val-fraction 0.05] [--eos TOKEN] [--force]
        [--errors strict|replace|skip]
    python scripts/prepare_data.py --dataset NAME [--dataset-config C] [--dataset-split train]
        [--text-field text] -o DIR ...

INPUT: text files or globs (quote them: 'notes/**/*.md'), read as UTF-8: every file that is
not is named in one error (--errors replace reads them with U+FFFD for the undecodable bytes,
--errors skip leaves them out). Each file is a document; --docs paragraph splits files at blank lines, --docs line makes each non-empty line
a document. --dataset reads a Hugging Face `datasets` dataset instead (a hub name or a local
path; needs `pip install datasets`): each row's --text-field is a document.

The tokenizer is a byte-level BPE of at most --vocab-size tokens trained here on the corpus
(offline), or the tokenizer.json given by --tokenizer. DIR gets meta.json, a copy of the
tokenizer and train/val shards of token ids (uint16 when the vocab fits, else uint32), every
document followed by the --eos token (added to a loaded tokenizer that lacks it). Documents go
to validation by a stable hash of their name, --val-fraction of them; a validation document
whose text (by content hash) is also a training document's is counted in a warning. DIR appears only once
complete; --force replaces an existing token directory (one holding only what this script
writes and none of the INPUTs), never any other non-empty DIR. Then:

    python scripts/train.py configs/tiny/v41.yaml data.source=DIR data.max_bytes=0

(model.vocab_size follows the tokenizer; generate.py and eval.py read the run's copy of it).
Each phase (reading, the tokenizer, tokenizing and writing) prints a line with its counts
and time; on a terminal a bar shows each one's progress.
"""

import contextlib
import hashlib
import os
import re
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import cli, progress  # noqa: E402

DOC_MODES = ("file", "paragraph", "line")
ERRORS = ("strict", "replace", "skip")  # what a file that is not UTF-8 gets
BATCH_DOCS = 256  # documents per encode_batch call (tokenizers encodes a batch in parallel)


def parser():
    ap = cli.parser(__doc__)
    ap.add_argument("inputs", nargs="*", metavar="INPUT", help="text files or globs")
    ap.add_argument("-o", "--out", type=Path, required=True, help="the token directory to write")
    tok = ap.add_mutually_exclusive_group()
    tok.add_argument("--vocab-size", type=cli.positive_int, default=4096,
                     help="train a byte-level BPE of at most this many tokens, >= 257: the 256 "
                          "bytes and the separator (default 4096)")
    tok.add_argument("--tokenizer", type=Path, default=None, metavar="FILE",
                     help="use this Hugging Face tokenizer.json instead of training one")
    ap.add_argument("--docs", choices=DOC_MODES, default="file",
                    help="what a document of a text file is (default: the whole file)")
    ap.add_argument("--val-fraction", type=float, default=0.05,
                    help="fraction of documents for validation (default 0.05)")
    ap.add_argument("--eos", default="<|endoftext|>", metavar="TOKEN",
                    help="the separator token after each document (default <|endoftext|>)")
    ap.add_argument("--force", action="store_true",
                    help="replace an existing token directory (never another non-empty one)")
    ap.add_argument("--errors", choices=ERRORS, default="strict",
                    help="files that are not UTF-8: strict (default) names them all and "
                         "stops, replace reads them with U+FFFD for the undecodable bytes, "
                         "skip leaves them out")
    ds = ap.add_argument_group("Hugging Face datasets (optional package)")
    ds.add_argument("--dataset", default=None, metavar="NAME",
                    help="read this datasets dataset (hub name or local path) instead of INPUTs")
    ds.add_argument("--dataset-config", default=None, metavar="C", help="its configuration")
    ds.add_argument("--dataset-split", default="train", metavar="S",
                    help="its split to read (default train)")
    ds.add_argument("--text-field", default="text", metavar="F",
                    help="the column holding a document's text (default text)")
    return ap


# ----------------------------------------------------------------------------- documents
def match_inputs(inputs) -> list[Path]:
    """Files of the INPUTs in order (each glob's matches sorted), each once."""
    import glob

    from dsattn.errors import InputError

    out = {}
    for spec in inputs:
        path = os.path.expanduser(spec)
        if os.path.isdir(path):
            raise InputError(f"{spec} is a directory; give files or a glob such as "
                             f"{os.path.join(spec, '**', '*.txt')!r}")
        found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not found:
            raise FileNotFoundError(f"{spec} matches no file")
        out.update((Path(p).resolve(), None) for p in found)
    return list(out)


def _bar(total: int, desc: str, unit: str) -> progress.Progress:
    """A phase's bar on a terminal; elsewhere its line (`main`) says it all."""
    return progress.Progress(total, desc=desc, unit=unit, quiet=not sys.stderr.isatty())


def read_files(paths: list[Path], errors: str) -> tuple[list[Path], str]:
    """(the files to read, the phase's line): every file checked to decode as UTF-8, those
    that do not named all at once (InputError, `errors` strict), left out (skip) or kept to
    be read with U+FFFD (replace)."""
    from dsattn.errors import InputError

    start, size, bad = time.perf_counter(), 0, []
    bar = _bar(len(paths), "read", "file")
    for p in paths:
        raw = p.read_bytes()
        size += len(raw)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad.append((p, e.start))
        bar.update()
    bar.close()
    if bad and errors == "strict":
        raise InputError(
            f"{len(bad)} of {len(paths)} files are not UTF-8 text: "
            + ", ".join(f"{p} (byte {at})" for p, at in bad)
            + "; --errors replace reads them with U+FFFD for the undecodable bytes, "
              "--errors skip leaves them out")
    line = (f"read {len(paths):,} files ({size / 1e6:.1f} MB) in "
            f"{time.perf_counter() - start:.1f} s")
    if bad:
        line += f"; {len(bad)} not UTF-8, " + (
            "left out (--errors skip)" if errors == "skip" else
            "read with U+FFFD for the undecodable bytes (--errors replace)")
    if errors == "skip":
        paths = [p for p in paths if p not in {q for q, _ in bad}]
    return paths, line


def file_documents(paths: list[Path], mode: str, errors: str = "strict", root=None,
                   done=None):
    """(name, text) of each non-blank document of the files; a name is the file's path
    relative to `root` (default: the files' common folder), so its split survives a move,
    plus #i within it. `errors`: replace decodes what is not UTF-8 with U+FFFD; `done()`,
    if given, after each file."""
    root = Path(root or os.path.commonpath([str(p.parent) for p in paths]))
    for p in paths:
        text = p.read_bytes().decode("utf-8", "replace" if errors == "replace" else "strict")
        rel = p.relative_to(root).as_posix()
        if mode == "file":
            pieces = [text]
        elif mode == "paragraph":
            pieces = re.split(r"\n\s*\n", text)
        else:
            pieces = text.splitlines()
        pieces = [t for t in pieces if t.strip()]
        for i, t in enumerate(pieces):
            yield (rel if mode == "file" else f"{rel}#{i}"), t
        if done is not None:
            done()


def dataset_documents(args):
    """(name, text) of each row of a Hugging Face dataset split."""
    from dsattn.errors import InputError

    try:
        import datasets
    except ImportError:
        raise InputError("--dataset needs the Hugging Face datasets package: "
                         "pip install datasets") from None
    try:
        ds = datasets.load_dataset(args.dataset, args.dataset_config, split=args.dataset_split)
    except Exception as e:  # not found, offline, bad config: all the user's to fix
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"--dataset {args.dataset}: {first}") from None
    for i, row in enumerate(ds):
        if args.text_field not in row:
            raise InputError(f"--dataset {args.dataset}: rows have no {args.text_field!r} "
                             f"field (they have {', '.join(map(str, row))}); see --text-field")
        text = row[args.text_field]
        if isinstance(text, str) and text.strip():
            yield f"{args.dataset_split}#{i}", text


# ----------------------------------------------------------------------------- main
def warn_shared_documents(names, digests, val) -> None:
    """The split goes by name: the same text under two names may land on both sides, and the
    validation loss then measures recall of training text. Warn with how many."""
    train_names = {}
    for i, d in enumerate(digests):
        if i not in val:
            train_names.setdefault(d, names[i])
    shared = [(names[i], train_names[digests[i]]) for i in sorted(val)
              if digests[i] in train_names]
    if shared:
        v, t = shared[0]
        warnings.warn(f"{len(shared):,} of {len(val):,} validation documents are identical (by "
                      f"content hash) to a training document, e.g. {v!r} and {t!r}: the "
                      f"validation loss partly measures memorised text (remove the copies)")


def main(argv=None):
    ap = parser()
    args = cli.parse(ap, argv)
    if bool(args.inputs) == bool(args.dataset):
        ap.error("give INPUT files or globs, or --dataset, one of the two")
    if not 0 < args.val_fraction < 1:
        ap.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if args.tokenizer is None and args.vocab_size < 257:
        ap.error(f"--vocab-size must be at least 257 (256 bytes and {args.eos}), "
                 f"got {args.vocab_size}")
    from dsattn import data, tokendir, tokenizer
    from dsattn.errors import InputError

    if args.dataset:
        documents, what = (lambda done=None: dataset_documents(args)), f"--dataset {args.dataset}"
        paths = []
    else:
        paths = match_inputs(args.inputs)
        what = " ".join(args.inputs)
    tokendir.check_output(args.out, args.force, paths)  # before any work
    if not args.dataset:
        # names relative to every matched file's folder: a file left out moves no other's split
        root = os.path.commonpath([str(p.parent) for p in paths])
        paths, line = read_files(paths, args.errors)
        print(line, flush=True)

        def documents(done=None):
            return file_documents(paths, args.docs, args.errors, root, done)

    # Pass 1: the documents' names (the split), their content hashes and, unless given, the
    # tokenizer.
    names, digests = [], []
    start = time.perf_counter()
    bar = _bar(len(paths), "tokenizer", "file") if paths else None

    def texts():
        for name, text in documents(bar and bar.update):
            names.append(name)
            digests.append(hashlib.sha256(text.encode("utf-8")).digest())
            yield text

    try:
        if args.tokenizer is not None:
            tok = tokenizer.HFTokenizer.from_file(args.tokenizer, args.eos)
            for _ in texts():
                pass
            doing = f"{args.tokenizer} ({tok.vocab_size:,} tokens); read"
        else:
            tok = tokenizer.train_bpe(texts(), args.vocab_size, args.eos)
            doing = f"trained a BPE of {tok.vocab_size:,} tokens on"
    finally:
        if bar is not None:
            bar.close()
    if not names:
        raise InputError(f"{what}: empty corpus (no document with text)")
    if len(names) < 2:
        raise InputError(f"{what}: one document cannot be split into train and validation "
                         f"(--docs paragraph or line splits files into more)")
    print(f"tokenizer: {doing} {len(names):,} documents in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    val = {i for i, n in enumerate(names) if data.is_val_file(n, args.val_fraction)}
    if not val:  # keep both sides non-empty whatever the hash says
        val = {len(names) - 1}
    elif len(val) == len(names):
        val.discard(0)
    warn_shared_documents(names, digests, val)
    added = tok.eos_id is None
    if added:  # a loaded tokenizer without the separator: the copy gets it
        tok.add_special(args.eos)

    # Pass 2: encode and write, documents in order.
    text_bytes = {"train": 0, "val": 0}
    start = time.perf_counter()
    bar = _bar(len(names), "tokenize and write", "document")
    with tokendir.Writer(args.out, tok.vocab_size, tok.eos_id, force=args.force) as w, \
            contextlib.closing(bar):  # closed before an error's line
        batch = []

        def flush():
            ids = tok.encode_batch([t for _, t in batch], literal_specials=True)
            for (i, t), doc in zip(batch, ids):
                split = "val" if i in val else "train"
                w.add(split, doc)
                text_bytes[split] += len(t.encode("utf-8"))
            bar.update(len(batch))
            batch.clear()

        for i, (name, text) in enumerate(documents()):
            if i >= len(names) or name != names[i]:
                raise InputError(f"{what}: the documents came in another order the second "
                                 f"time they were read")
            batch.append((i, text))
            if len(batch) == BATCH_DOCS:
                flush()
        flush()
        keep_file = args.tokenizer is not None and not added
        meta = w.commit(args.tokenizer if keep_file else tok, source=what,
                        documents=args.docs if not args.dataset else "row",
                        val_fraction=args.val_fraction, text_bytes=text_bytes)

    tokens = {s: meta["splits"][s][0]["tokens"] for s in ("train", "val")}
    n_bytes = sum(text_bytes.values())
    print(f"tokenized and wrote {len(names):,} documents ({sum(tokens.values()):,} tokens) in "
          f"{time.perf_counter() - start:.1f} s")
    print(f"{args.out}: {len(names):,} documents ({len(names) - len(val):,} train, {len(val):,} "
          f"val), {tokens['train']:,} + {tokens['val']:,} {meta['dtype']} tokens, vocab "
          f"{meta['vocab_size']:,}, {n_bytes / max(1, sum(tokens.values())):.2f} bytes/token"
          + (f"; added {args.eos} as id {tok.eos_id}" if added else ""))
    print(f"train on it: python scripts/train.py CONFIG data.source={args.out} data.max_bytes=0")
    return 0


if __name__ == "__main__":
    cli.run(main)
