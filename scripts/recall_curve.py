#!/usr/bin/env python
"""Train a preset on a recall source and record its learning curve on recall probes.

    python scripts/recall_curve.py CONFIG [KEY=VALUE ...] [--every 50] [--distances 8,16,...]
        [--per-distance 64] [--probe-len N] [--run-dir DIR] [--out curve.json]

Trains in chunks of --every steps (dsattn.train.Trainer, the same step as scripts/train.py);
after each chunk scores recall.accuracy on fixed probes (one pair at each exact distance,
teacher-forced argmax on the answer tokens, contexts from the source's validation stream)
and prints a line: step, train seconds so far (steps only, no compile or probes), wall
seconds since start, the step's loss, mean accuracy and accuracy per distance. The curve
goes to --out (JSON) as well.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import cli, config, recall  # noqa: E402
from dsattn.train import Trainer  # noqa: E402


def main(argv=None):
    t_start = time.time()
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("config")
    ap.add_argument("--every", type=cli.positive_int, default=50)
    ap.add_argument("--distances", type=cli.int_list, default=None,
                    help="default (format=mqar): 4,8,16,32,48,64,80,96,112,126")
    ap.add_argument("--per-distance", type=cli.positive_int, default=64)
    ap.add_argument("--probe-len", type=cli.positive_int, default=None,
                    help="default: train.seq_len")
    ap.add_argument("--run-dir", default=None, help="default: a temporary directory")
    ap.add_argument("--out", default=None, help="curve JSON")
    args = cli.parse(ap, argv)
    cfg = config.load(args.config, args.overrides)
    if not recall.is_recall(cfg.data.source):
        raise SystemExit(f"data.source {cfg.data.source!r} is not a recall source")
    spec = recall.parse_source(cfg.data.source)
    probe_len = args.probe_len or cfg.train.seq_len
    dists = args.distances or [d for d in (4, 8, 16, 32, 48, 64, 80, 96, 112, 126)
                               if d <= probe_len - 2]
    background = recall.streams(cfg.data.source, cfg.data.val_fraction, cfg.data.max_bytes)[1]
    probes = recall.probes(dists, args.per_distance, probe_len, spec, background)
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, args.run_dir or tmp, quiet=True)
        curve, train_s = [], 0.0
        print(f"{cfg.name}: {tr.corpus.description}", flush=True)
        while tr.step < cfg.train.steps:
            t0 = time.time()
            tr.run(min(tr.step + args.every, cfg.train.steps))
            train_s += time.time() - t0
            acc = recall.accuracy(tr.model(), probes)
            lines = (tr.run_dir / "metrics.jsonl").read_text().splitlines()
            last = json.loads(lines[-1]) if lines else {}
            point = {"step": tr.step, "train_s": round(train_s, 1),
                     "wall_s": round(time.time() - t_start, 1), "loss": last.get("ce"),
                     "val_loss": last.get("val_loss"),
                     "mean_acc": sum(acc.values()) / len(acc), "acc": acc}
            curve.append(point)
            print(f"step {tr.step:5d} train {train_s:6.1f}s wall {point['wall_s']:6.1f}s "
                  f"ce {point['loss'] or float('nan'):.3f} mean {point['mean_acc']:.3f} | "
                  + " ".join(f"{d}:{a:.2f}" for d, a in acc.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": cfg.to_dict(), "curve": curve},
                                             indent=1))
    return curve


if __name__ == "__main__":
    cli.run(main)
