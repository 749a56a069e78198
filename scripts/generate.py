#!/usr/bin/env python
"""Continue a prompt with a trained run:
`python scripts/generate.py RUN_DIR --prompt "def main(" [--max-new 200] [--temperature 0.8]`

Loads the run's config and latest checkpoint; prints the continuation as it is produced.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import checkpoint, data, generate  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--max-new", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    args = ap.parse_args(argv)
    model, cfg, step = checkpoint.load_params(args.run_dir)
    prompt = data.encode(args.prompt).tolist()
    pending = bytearray()

    def show(_row, tok):  # bytes may split a UTF-8 character: print whole characters only
        pending.append(tok)
        try:
            text = pending.decode("utf-8")
        except UnicodeDecodeError:
            if len(pending) < 4:
                return
            text = pending.decode("utf-8", errors="replace")
        print(text, end="", flush=True)
        pending.clear()

    print(args.prompt, end="", flush=True)
    t0 = time.perf_counter()
    out = generate.generate(model, [prompt], args.max_new, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed,
                            stop=[data.encode(s).tolist() for s in args.stop], on_token=show)
    dt = time.perf_counter() - t0
    print(f"\n[{len(out[0])} tokens in {dt:.2f}s = {len(out[0]) / dt:.1f} tokens/s "
          f"incl. compile; checkpoint step {step}]")
    return out[0]


if __name__ == "__main__":
    main()
