#!/usr/bin/env python
"""Held-out loss of a trained run at chosen context lengths, longer than training included.

    python scripts/eval.py RUN_DIR [--seq-len 128,512] [--step S] [--data SOURCE]
        [--max-tokens N | --batches N] [--batch-size B] [--json FILE] [--quiet]
        [KEY=VALUE ...]

Loads RUN_DIR/config.yaml and the latest (or --step) checkpoint and prints, per length, the
mean next-token cross-entropy of the validation split in nats per token and bits per byte
(bits = nats / ln 2, over the bytes per token: 1 on bytes, a token directory's from its
meta.json), each with its standard error over the windows scored, then the unigram
baseline of the split. By default the split is scored in consecutive windows of the length,
every token once, up to --max-tokens tokens (default 65,536, the windows then spread over
the split; 0: all of it); --batches N scores N fixed batches of random windows instead, the
validation training runs (with N = the run's train.eval_batches, at the training length,
the loss is the one training logged as val_loss). The validation split is that of the run's
data.source, or of --data (a text file or glob, a .u16/.bin token file, or a token directory;
a run trained on a token directory reads one prepared with the same tokenizer); KEY=VALUE
overrides such as data.val_fraction=0.5 apply to the run's config (model sections may not
change).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import cli  # noqa: E402

# Tokens scored per length by default: 64 times what training's validation scores on the
# tiny presets (4 x 8 x 32), and a 314K-token split's fifth, in seconds on a 2-core CPU.
MAX_TOKENS = 65_536


def parser():
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("run_dir", help="a run directory written by scripts/train.py")
    ap.add_argument("--seq-len", type=cli.int_list, action="append", default=None,
                    metavar="N[,N...]",
                    help="context lengths to evaluate (repeatable; default: the run's "
                         "train.seq_len and 4 times it)")
    ap.add_argument("--step", type=cli.nonnegative_int, default=None,
                    help="checkpoint step to evaluate (default: the latest)")
    ap.add_argument("--data", default=None, metavar="SOURCE",
                    help="evaluate on this data.source's validation split instead")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--max-tokens", type=cli.nonnegative_int, default=MAX_TOKENS,
                     metavar="N", help=f"tokens of the split scored per length, in consecutive "
                                       f"windows (default {MAX_TOKENS:,}; 0: all of it)")
    how.add_argument("--batches", type=cli.positive_int, default=None,
                     help="score this many fixed batches of random windows instead (the "
                          "run's train.eval_batches: training's validation)")
    ap.add_argument("--batch-size", type=cli.positive_int, default=None,
                    help="sequences per batch (default: the run's train.batch_size)")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="also write the rows as JSON to FILE")
    ap.add_argument("--quiet", action="store_true", help="no progress bar or lines")
    cli.progress_option(ap, "batches")
    return ap


def warn_overlap(rows, split_tokens: int) -> None:
    """The batches' windows are drawn from the validation split: scoring more tokens than it
    holds scores the same tokens again, so the loss rests on fewer tokens than it says."""
    import warnings

    for r in rows:
        if r["tokens"] > split_tokens:
            warnings.warn(f"seq_len {r['seq_len']}: {r['tokens']} tokens scored from a "
                          f"validation split of {split_tokens}: its windows overlap, so the "
                          f"loss rests on at most {split_tokens} distinct tokens (fewer "
                          f"--batches or --batch-size, or a larger data.val_fraction)")


def main(argv=None):
    args = cli.parse(parser(), argv)
    # after parsing: usage errors skip JAX
    from dsattn import baseline, checkpoint, data, evaluate, tokenizer

    overrides = args.overrides + ([f"data.source={args.data}"] if args.data else [])
    cfg = checkpoint.load_run_config(args.run_dir, overrides)
    lens = ([n for group in args.seq_len for n in group] if args.seq_len
            else [cfg.train.seq_len, 4 * cfg.train.seq_len])
    # a run on a token directory is measured only on ids of its tokenizer
    tokenizer.check_run_data(args.run_dir, cfg.data.source, "evaluated")
    corpus = data.load_corpus(cfg.data, cfg.model.vocab_size)
    evaluate.check_lengths(corpus, lens)  # before the (slow) checkpoint restore
    model, cfg, step = cli.load_run(args.run_dir, args.step, overrides)
    rows = evaluate.evaluate(model, cfg, lens, n_batches=args.batches,
                             batch_size=args.batch_size, corpus=corpus, quiet=args.quiet,
                             progress_every=args.progress_every,
                             max_tokens=None if args.batches else args.max_tokens)
    if args.batches:  # random windows may overlap; the split's windows never do
        warn_overlap(rows, len(corpus.val))
    how = (f"{args.batches} fixed batches of random windows" if args.batches else
           "consecutive windows" + (f", at most {args.max_tokens:,} tokens a length"
                                    if args.max_tokens else ""))
    print(f"{args.run_dir} (step {step}), validation split of {cfg.data.source} "
          f"({len(corpus.val):,} tokens) in {how}; trained at seq_len {cfg.train.seq_len}")
    print(f"{'seq_len':>8} {'tokens':>9} {'nats/token ± se':>17} {'bits/byte ± se':>17}")
    for r in rows:
        bpb = (f"{r['bits_per_byte']:.4f} ± {r['bits_per_byte_se']:.4f}"
               if r["bits_per_byte"] is not None else "-")
        nats = f"{r['nats_per_token']:.4f} ± {r['nats_per_token_se']:.4f}"
        print(f"{r['seq_len']:>8} {r['tokens']:>9,} {nats:>17} {bpb:>17}")
    print("se: the standard error of the mean over the windows scored ("
          + ", ".join(f"{r['windows']:,} of {r['seq_len']}" for r in rows) + ")")
    print(f"unigram baseline {baseline.unigram_nats(corpus):.4f} nats/token (a model that "
          f"ignores context)")
    if args.json:
        args.json.write_text(json.dumps({"run_dir": str(args.run_dir), "step": step,
                                         "data": cfg.data.source.text, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    cli.run(main)
