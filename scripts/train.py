#!/usr/bin/env python
"""Train a preset on its data (default: the embedded stdlib corpus).

    python scripts/train.py CONFIG [KEY=VALUE ...] [--run-dir DIR] [--quiet] [--strict]
        [--scale-schedule] [--estimate] [--init-from RUN_DIR[:STEP]]

It prints the run's parameters, vocabulary (a token directory's: its tokenizer's, unless
model.vocab_size is set), tokens per step and schedule at its start, and the validation loss
beside the corpus's unigram baseline and in bits per byte at its end. Once its first steps
are done it says its compile time, their s/step and about how long its steps take;
--estimate says that (and the validations' share) before anything runs, then stops.

Rerunning the same command resumes from the run directory's latest checkpoint. The run
directory (default runs/<config name>) holds config.yaml, metrics.jsonl and checkpoints/.
A resume with another batch size, sequence length, seed or data warns and is recorded in
metrics.jsonl (exact_resume: false); --strict refuses it.

Several devices: mesh overrides, e.g. `mesh.data=4 mesh.tensor=2` (-1: the rest). Several
hosts: run the same command on each; with JAX_COORDINATOR_ADDRESS (plus JAX_NUM_PROCESSES
and JAX_PROCESS_ID) or under SLURM / Open MPI / Cloud TPU the processes join one job.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import baseline, cli, config, progress, rundir, sharding, train  # noqa: E402


def main(argv=None):
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("config", help="YAML preset, e.g. configs/tiny/mla.yaml")
    ap.add_argument("--run-dir", default=None, help="default: runs/<config name>")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--strict", action="store_true",
                    help="refuse to resume with another batch size, sequence length, seed or "
                         "data (the steps would train on other batches than the run's)")
    ap.add_argument("--scale-schedule", action="store_true",
                    help="a train.steps override shorter than the preset's scales its "
                         "warmup_steps, indexer.dense_warmup_steps, eval_every, ckpt_every "
                         "and log_every by the same factor (those not overridden too; at most "
                         "train.steps) and prints what else a short run may want (lr, top-k, "
                         "window); the run directory records the scaling (schedule.json), and "
                         "a rerun with more steps keeps the values the run trained with")
    ap.add_argument("--init-from", metavar="RUN_DIR[:STEP]", default=None,
                    help="start a new run from another run's weights (its latest checkpoint, "
                         "or STEP's), under this config's design: parameters whose path and "
                         "shape match are copied, conversion rules derive the rest where "
                         "the attention changes (MHA->MLA, MLA->DSA, dense->V4; "
                         "docs/conversion.md), indexers, compressors and sinks start fresh; "
                         "prints a table of what was copied, derived and new. A run that has "
                         "checkpoints resumes from them instead")
    ap.add_argument("--estimate", action="store_true",
                    help="compile the run's step, time a few steps and a validation, print "
                         "s/step, tokens/s, the compile time and the run's expected time, and "
                         "stop (nothing is written to the run directory)")
    cli.progress_option(ap)
    args = cli.parse(ap, argv)
    sharding.initialize_distributed()  # before jax touches a device
    cfg, run_dir, scaled = rundir.load_config(args.config, args.overrides, args.run_dir,
                                              scale_schedule=args.scale_schedule)
    given = config.overridden_keys(args.overrides)
    advice = args.scale_schedule and config.short_run_advice(
        cfg, config.preset_steps(args.config), given)
    if advice:  # what the scaling leaves at the preset's scale, before anything compiles
        print("for a short run consider:\n" + "\n".join(f"  {a}" for a in advice), flush=True)
    explicit_vocab = ("model", "vocab_size") in given
    if args.estimate:  # a scratch directory: the run directory is only read
        progress.say(f"estimate for {cfg.name}: compiling and timing its step and a "
                     f"validation (minutes for a big model)")
        print(train.estimate_line(cfg, train.estimate(cfg, run_dir,
                                                      explicit_vocab=explicit_vocab)))
        return None
    trainer = train.Trainer(cfg, run_dir, quiet=args.quiet, strict=args.strict,
                            progress_every=args.progress_every, explicit_vocab=explicit_vocab,
                            schedule=scaled, init_from=args.init_from)
    if trainer.conversion is not None:
        print(trainer.conversion.table(), flush=True)
    elif args.init_from:
        print(f"{run_dir} resumes from its own checkpoint (step {trainer.step}); "
              f"--init-from applies to a run's start only", flush=True)
    print(trainer.summary(), flush=True)
    out = trainer.run()
    print(f"step {out['step']}: validation loss "
          f"{baseline.compared(out['val_loss'], trainer.corpus, trainer.cfg.data.source)} "
          f"(run directory {run_dir})")
    return out


if __name__ == "__main__":
    cli.run(main)
