#!/usr/bin/env python
"""Train a preset on a recall source and record its learning curve on recall probes.

    python scripts/recall_curve.py CONFIG [KEY=VALUE ...] [--every 50] [--distances 8,16,...]
        [--per-distance 64] [--probe-len N] [--run-dir DIR] [--out curve.json]

Trains in chunks of --every steps (dsattn.train.Trainer, the same step as scripts/train.py);
after each chunk scores recall_eval.accuracy on fixed probes (one pair at each exact distance,
teacher-forced argmax on the answer tokens, contexts from the source's validation stream)
and prints a line: step, train seconds so far (steps only, no compile or probes), wall
seconds since start, the step's loss, mean accuracy and accuracy per distance. The curve
goes to --out (JSON) as well.

--stages LEN:STEPS,... (format=mqar): a curriculum of shorter sequences first. Each stage
trains its STEPS on blocks of LEN tokens (block=LEN, max_dist capped at LEN - 2, pairs capped
at LEN / 8, batch scaled by block / LEN so a step has as many tokens), resuming the same
run (one learning-rate schedule over train.steps); the rest of train.steps use the config.
Probes are always the final ones (train.seq_len).

--row NAME: CONFIG is a sweep file (scripts/ablate.py) and the run is that row's, seed
--seed, with the sweep's shared overrides (KEY=VALUE still apply after them), e.g. the
ratios sweep's controls:
    python scripts/recall_curve.py configs/ablations/ratios.yaml --row window --every 100 \
        --distances 2,4,8,12,16,24,32,48,62 --out window.json
"""

import dataclasses

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import ablate, cli, config, data, recall, recall_eval, runlog  # noqa: E402
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
    ap.add_argument("--stages", default="", help="curriculum LEN:STEPS,... (format=mqar)")
    ap.add_argument("--row", default=None, help="CONFIG is a sweep file: train this row")
    ap.add_argument("--seed", type=int, default=0, help="with --row: the run's seed")
    args = cli.parse(ap, argv)
    if args.row is None:
        cfg = config.load(args.config, args.overrides)
    else:
        sweep = ablate.load(args.config, args.overrides)
        rows = {r.name: r for r in sweep.rows}
        if args.row not in rows:
            raise SystemExit(f"--row: {args.row!r} is not a row of {args.config}; rows: "
                             f"{', '.join(rows)}")
        cfg = sweep.config(rows[args.row], args.seed)
    spec = cfg.data.source.recall
    if spec is None:
        raise SystemExit(f"data.source {cfg.data.source.text!r} is not a recall source")
    probe_len = args.probe_len or cfg.train.seq_len
    dists = args.distances or [d for d in (4, 8, 16, 32, 48, 64, 80, 96, 112, 126)
                               if d <= probe_len - 2]
    background = data.recall_streams(spec, cfg.data.val_fraction, cfg.data.max_bytes)[1]
    probes = recall.probes(dists, args.per_distance, probe_len, spec, background)
    stages, end = [], 0
    for item in filter(None, args.stages.split(",")):
        n, steps = (int(x) for x in item.split(":"))
        end += steps
        stages.append((end, _stage_cfg(cfg, spec, n)))
    stages.append((cfg.train.steps, cfg))
    with tempfile.TemporaryDirectory() as tmp:
        curve, train_s, tr = [], 0.0, None
        for until, stage_cfg in stages:
            if tr is None or tr.cfg is not stage_cfg:
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    tr = Trainer(stage_cfg, args.run_dir or tmp, quiet=True)
                print(f"{cfg.name}: until step {until}: batch {stage_cfg.train.batch_size} x "
                      f"{stage_cfg.train.seq_len}: {tr.corpus.description}", flush=True)
            while tr.step < until:
                t0 = time.time()
                tr.run(min(tr.step + args.every, until))
                train_s += time.time() - t0
                acc = recall_eval.accuracy(tr.model(), probes)
                last = (runlog.records(tr.run_dir) or [{}])[-1]
                point = {"step": tr.step, "train_s": round(train_s, 1),
                         "wall_s": round(time.time() - t_start, 1), "loss": last.get("ce"),
                         "val_loss": last.get("val_loss"),
                         "mean_acc": sum(acc.values()) / len(acc), "acc": acc}
                curve.append(point)
                ce = float("nan") if point["loss"] is None else point["loss"]  # 0.0 is a loss
                print(f"step {tr.step:5d} train {train_s:6.1f}s wall {point['wall_s']:6.1f}s "
                      f"ce {ce:.3f} mean {point['mean_acc']:.3f} | "
                      + " ".join(f"{d}:{a:.2f}" for d, a in acc.items()), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps({"config": cfg.to_dict(), "curve": curve},
                                                         indent=1))
    return curve


def _stage_cfg(cfg, spec, n: int):
    """cfg with blocks of n tokens (format=mqar) and a batch of as many tokens."""
    if spec.format != "mqar" or n > spec.block or n % 2:
        raise SystemExit(f"--stages: {n} needs format=mqar and an even length <= block")
    source = recall.source_text(dataclasses.replace(
        spec, block=n, max_dist=min(spec.max_dist, n - 2), min_dist=min(spec.min_dist, n - 2),
        pairs=max(1, min(spec.pairs, n // 8))))
    train = dataclasses.replace(cfg.train, seq_len=n,
                                batch_size=cfg.train.batch_size * cfg.train.seq_len // n)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=source),
                               train=train)


if __name__ == "__main__":
    cli.run(main)
