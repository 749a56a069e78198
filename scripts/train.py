#!/usr/bin/env python
"""Train a preset: `python scripts/train.py CONFIG [key=value ...] [--run-dir DIR]`.

Rerunning the same command resumes from the run directory's latest checkpoint.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import config, train  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("config", help="YAML preset, e.g. configs/tiny/mla.yaml")
    ap.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.steps=100")
    ap.add_argument("--run-dir", default=None, help="default: runs/<config name>")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    cfg = config.load(args.config, args.overrides)
    run_dir = Path(args.run_dir or f"runs/{cfg.name}")
    out = train.train(cfg, run_dir, quiet=args.quiet)
    print(f"step {out['step']}: validation loss {out['val_loss']:.4f} nats/token "
          f"(run directory {run_dir})")
    return out


if __name__ == "__main__":
    main()
