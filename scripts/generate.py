#!/usr/bin/env python
"""Continue a prompt with a trained run.

    python scripts/generate.py RUN_DIR [--prompt TEXT | --prompt-file FILE] [--max-new 200]
        [--step S] [--max-len L] [--temperature 0.8] [--top-p 0.95] [--seed 0] [--stop TEXT]
        [KEY=VALUE ...]

Loads RUN_DIR/config.yaml and the latest (or --step) checkpoint, then writes the prompt and
its continuation to stdout while they are produced, and the speed to stderr. Text goes
through the run's tokenizer: the tokenizer.json a run on a token directory keeps
(scripts/prepare_data.py), else bytes (written raw, as the tokens are bytes). KEY=VALUE
overrides may change how the run executes, not the model: its layout
(model.scan_layers=false decodes unrolled, faster for MHA at long context on a CPU) or block
sizes (attention.query_block).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import cli  # noqa: E402


def parser():
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("run_dir", help="a run directory written by scripts/train.py")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default="def ", help="prompt text, UTF-8 (default: 'def ')")
    src.add_argument("--prompt-file", type=Path, default=None,
                     help="read the prompt from this file (raw bytes for a byte-level run)")
    ap.add_argument("--max-new", type=cli.nonnegative_int, default=200,
                    help="new tokens to generate at most (default 200)")
    ap.add_argument("--step", type=cli.nonnegative_int, default=None,
                    help="checkpoint step to load (default: the latest)")
    ap.add_argument("--max-len", type=cli.positive_int, default=None,
                    help="cache length in tokens, prompt included (default: prompt + max-new "
                         "rounded up to a power of two, at least 64)")
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="sampling temperature; 0 is greedy (default 0.8)")
    ap.add_argument("--top-p", type=float, default=0.95,
                    help="nucleus sampling: keep the smallest set of tokens with this much "
                         "probability (default 0.95)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--stop", action="append", default=[], metavar="TEXT",
                    help="stop once the output ends with TEXT's tokens (repeatable)")
    return ap


def main(argv=None):
    ap = parser()
    args = cli.parse(ap, argv)
    prompt = (args.prompt_file.read_bytes() if args.prompt_file is not None
              else args.prompt.encode("utf-8"))
    if not prompt:
        ap.error("the prompt is empty")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        ap.error("need --temperature >= 0 and 0 < --top-p <= 1")
    from dsattn import tokenizer

    tok = tokenizer.for_run(args.run_dir)
    ids = tok.encode_bytes(prompt)
    if args.max_len is not None and len(ids) + args.max_new > args.max_len:
        ap.error(f"--max-len {args.max_len} cannot hold the {len(ids)}-token prompt plus "
                 f"--max-new {args.max_new}")
    from dsattn import generate  # after the usage checks: they need no model

    model, cfg, step = cli.load_run(args.run_dir, args.step, args.overrides)
    out = sys.stdout.buffer
    out.write(prompt)
    out.flush()
    stream = tok.streamer()  # bytes, or text once the tokens so far make whole characters

    def show(_row, token):
        out.write(stream.push(token))
        out.flush()

    t0 = time.perf_counter()
    new = generate.generate(model, [ids], args.max_new, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, max_len=args.max_len,
                            stop=[tok.encode(s) for s in args.stop], on_token=show)[0]
    dt = time.perf_counter() - t0
    out.write(stream.flush() + b"\n")
    out.flush()
    print(f"[{len(new)} tokens in {dt:.2f} s = {len(new) / dt:.1f} tokens/s incl. compile; "
          f"checkpoint step {step}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    cli.run(main)
