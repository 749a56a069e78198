#!/usr/bin/env python
"""Run an ablation sweep, or redraw a finished one's plots and table.

    python scripts/ablate.py SWEEP.yaml [KEY=VALUE ...] [--out DIR] [--quiet]
        [--rows NAME,NAME] [--seeds 0,1] [--scale-schedule] [--no-estimate]
    python scripts/ablate.py --report SWEEP_DIR
    python scripts/ablate.py SWEEP.yaml [KEY=VALUE ...] --estimate

KEY=VALUE overrides: a config key (section.key=value) applies to every row (e.g.
train.steps=2000 to scale a shipped sweep up); a sweep key below sets the file's, its value
YAML (seeds=[0,1,2], lengths=[2], decode_context=0, recall.per_distance=16,
recall_warmup.steps=40; rows and overrides excepted). Warm-ups do not follow train.steps:
--scale-schedule scales them with a shorter train.steps and prints what it changed
(docs/ablations/README.md). Before training it prints the expected time of what is left,
each row shape timed (compile, steps, validation, measurement: minutes for many shapes);
--no-estimate skips that timing (the progress and its ETA stay), --estimate prints only
the estimate. Rerunning the same command resumes: finished runs are skipped, an
interrupted one resumes from its checkpoint. The sweep directory (default
runs/ablations/<name>) holds runs/<row>/seed<k>/, results.csv, summary.csv, results.json,
pareto.png, recall.png and curves.png. The report compares every pair of rows on loss and
on recall within and beyond their window reach, n_layers x (window - 1).

The sweep file (YAML; commented example: examples/csa_ratio_sweep.yaml; docs/ablations/):
  name: csa_ratio                    default: the file's name
  base: configs/tiny/v4.yaml         required: the preset every row starts from
  full_size: configs/deepseek/v4_flash.yaml   optional: KV bytes also at full size
  overrides: [train.steps=400, ...]  shared by every row (list or mapping)
  rows:                              each {name, overrides}, control: true for a reference
                                     row (labelled so, kept off pareto.png's front)
    - {name: window, overrides: [attention.layers=swa]}
    - {name: csa_m2, overrides: ["attention.layers=swa, csa", attention.csa_ratio=2]}
  grid: {attention.csa_ratio: [2, 4]}   optional: one more row per combination
  seeds: [0, 1, 2]                   default [0]; fewer than 3 warn (2 seeds' intervals are
                                     Student's t with 1 degree of freedom: +-9 s wide)
  recall: {distances: [2, 16, 62], per_distance: 64, seq_len: 0, through_cache: false}
  recall_warmup: {steps: 200, dist: 8}   the first 200 steps' facts at most 8 tokens back
                                     (a recall data.source; its warm_steps=,warm_dist=
                                     spelling inside data.source still reads the same)
  lengths: [2, 4]                    also evaluated at these multiples M: loss on M x
                                     train.seq_len tokens, recall on M x recall.seq_len
                                     (multi-query: the 1x probes after earlier tokens)
  decode_context: 4096               decode step timing context (0: none)
  vmap_seeds: true                   a row's seeds as one vmapped model
  out: runs/ablations/csa_ratio      the sweep directory (--out wins)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import ablate, cli, progress  # noqa: E402


def main(argv=None):
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("sweep", nargs="?", help="sweep file, e.g. configs/ablations/ratios.yaml")
    ap.add_argument("--report", metavar="SWEEP_DIR", help="redraw plots and table, no training")
    ap.add_argument("--out", help="sweep directory (default runs/ablations/<name>)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars (no estimate)")
    ap.add_argument("--estimate", action="store_true",
                    help="print the expected training time and stop")
    ap.add_argument("--no-estimate", action="store_true",
                    help="train without timing each row shape first (that pass takes minutes "
                         "for many shapes); the progress and its ETA stay")
    ap.add_argument("--scale-schedule", action="store_true",
                    help="a train.steps override shorter than the sweep file's scales each "
                         "row's train.warmup_steps, indexer.dense_warmup_steps, "
                         "train.eval_every and recall_warmup.steps by the same factor (at "
                         "least 1; those set on the command line kept), as train.py "
                         "--scale-schedule does a run's; it prints what it changed. Resume "
                         "with the same command")
    ap.add_argument("--rows", type=lambda t: [x.strip() for x in t.split(",") if x.strip()],
                    metavar="NAME,NAME", help="only these rows of the sweep (default: all)")
    ap.add_argument("--seeds", type=lambda t: [int(x) for x in t.split(",") if x.strip()],
                    metavar="0,1", help="only these of the sweep's seeds (default: all)")
    cli.progress_option(ap, "steps of each run",
                        "none: off a terminal, one line per finished run")
    args = cli.parse(ap, argv)
    if bool(args.report) == bool(args.sweep):
        ap.error("give a sweep file or --report SWEEP_DIR")
    if args.report:
        print(ablate.report(args.report))
        print(f"plots redrawn in {args.report}")
        return None
    if args.estimate and args.no_estimate:
        ap.error("--estimate and --no-estimate: give one")
    sweep = ablate.load(args.sweep, args.overrides, out=args.out,  # validates every row
                        scale_schedule=args.scale_schedule)
    sweep = ablate.select(sweep, args.rows, args.seeds)
    for line in ablate.scaling(sweep):  # before anything is timed or trained
        progress.say(line)
    if args.estimate:
        ablate.warn_few_seeds(sweep)
        print(ablate.estimate_line(sweep, ablate.estimate(sweep, say=progress.say)))
        return None
    results = ablate.run(sweep, quiet=args.quiet, progress_every=args.progress_every,
                         estimate_first=not args.no_estimate)
    print(ablate.table(results))
    print(f"results and plots in {sweep.out}")
    return results


if __name__ == "__main__":
    cli.run(main)
