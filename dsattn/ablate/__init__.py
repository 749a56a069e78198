"""Ablation sweeps: train one config per (row, seed), measure each run, tabulate and plot.

A sweep file (YAML) names a base preset, shared overrides, rows of overrides (a list of named
rows and/or a grid) and seeds (configs/ablations/ holds the shipped ones):

    name: ratios
    base: configs/tiny/v4.yaml
    full_size: configs/deepseek/v4_flash.yaml   # kvbytes also at full size (optional)
    overrides: [train.steps=200, data.source=recall:corpus=stdlib]
    rows: [{name: base, overrides: []}, {name: w32, overrides: [attention.window=32]}]
    grid: {attention.csa_ratio: [2, 4], attention.hca_ratio: [8, 16]}   # rows by product
    seeds: [0, 1]
    recall: {distances: [8, 32, 96], per_distance: 32, seq_len: 128}
    # recall.through_cache: true also scores recall through the decode cache (recall_cache)
    decode_context: 4096                         # 0: no decode timing
    lengths: [2, 4]                              # also evaluated at 2x, 4x train.seq_len
    vmap_seeds: true                             # a row's seeds train as one vmapped model

Every file is validated whole before any training: unknown keys, duplicate row names and
overrides that fail config validation raise ConfigError naming the row and key. Runs live in
``OUT/runs/<row>/seed<k>/`` (OUT defaults to runs/ablations/<name>); within a seed every row
sees the same batches (batches are a function of (train.seed, step) and recall streams have
their own seed). A row's seeds train together, as one model vmapped over the seed
(dsattn.train.SeedGroup: one compiled step, each seed's parameters, batches, metrics and
checkpoints its own); rows whose shapes differ train one after another. A run with
``result.json`` is finished and skipped; any other resumes from its checkpoint; a finished
run whose config (its execution keys aside: block sizes, remat...) or measurement
settings changed since is refused (another --out). results.json / results.csv (one line per
run) and summary.csv (one line per row: mean, standard deviation and 95% interval over its
seeds of every metric, dsattn.seedstats) are rewritten after every run, plots at the end.
Every run is also evaluated beyond its training length (`lengths`, multiples M): held-out
loss on windows of M x its train.seq_len, and recall on rows of M x the probe length
(recall.seq_len, train.seq_len by default): multi-query recall puts earlier tokens before the
1x probe rows (the same facts and distances), byte recall draws new probes with the facts M
times farther back (measure.probes_for; docs/ablations/README.md, "Past the training
length").
A second process on the same sweep directory is refused (RunDirLocked naming the holder's
pid), as a second writer of a run directory is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import yaml

from dsattn import config as config_lib
from dsattn import progress, seedstats
from dsattn.ablate.full_size import full_size_config  # noqa: F401  (public)
from dsattn.ablate.measure import (Trained, complete, kv_figures, measure,  # noqa: F401
                                   probes_for)
from dsattn.ablate.reach import window_reach  # noqa: F401  (public)
from dsattn.ablate.plots import pareto, plots  # noqa: F401  (public)
from dsattn.ablate.results import (flat, row_summaries, table,  # noqa: F401  (public)
                                   write_json, write_results)
from dsattn.ablate.spec import (Row, Sweep, from_dict, from_resolved, load,  # noqa: F401
                                run_dir, scaling, select)
from dsattn.errors import ConfigError, DsattnError


def train_row(sweep: Sweep, row: Row, seeds, quiet=False,
              progress_every: int | None = None) -> dict:
    """Train (or resume) a row's runs for `seeds`: {seed: Trained, or the DsattnError that
    stopped it}. With `sweep.vmap_seeds`, seeds at the same
    step train together as one vmapped model (train.SeedGroup); a group that fails (e.g. one
    seed's loss turns NaN) leaves each seed at its last checkpoint to go on alone."""
    from dsattn.train import SeedGroup, Trainer

    out, todo = {}, []
    for seed in seeds:
        try:
            tr = Trainer(sweep.config(row, seed), run_dir(sweep, row, seed), quiet=quiet,
                         progress_every=progress_every, init_from=init_source(sweep, row, seed))
        except DsattnError as e:
            out[seed] = e
            continue
        if tr.step < tr.cfg.train.steps:
            todo.append((seed, tr))
        else:  # trained to the end before a kill took the measurements
            out[seed] = Trained(tr, tr.validation_loss())
    groups: dict = {}
    for seed, tr in todo:
        together = sweep.vmap_seeds and tr.mesh is None
        groups.setdefault(tr.step if together else ("alone", seed), []).append((seed, tr))
    for members in groups.values():
        if len(members) > 1:
            start = time.perf_counter()
            try:
                summaries = SeedGroup([tr for _, tr in members]).run()
            except DsattnError:
                pass  # each seed goes on alone below, from its last checkpoint
            else:
                share = (time.perf_counter() - start) / len(members)
                out.update({seed: Trained(tr, s["val_loss"], share, len(members))
                            for (seed, tr), s in zip(members, summaries)})
                continue
        for seed, tr in members:
            start = time.perf_counter()
            try:
                out[seed] = Trained(tr, tr.run()["val_loss"], time.perf_counter() - start)
            except DsattnError as e:
                out[seed] = e
    return out


def _shape(cfg) -> str:
    """What a training step's cost depends on: the model's sections and the batch's shape."""
    d = cfg.to_dict()
    t = d["train"]
    return json.dumps({**{k: d[k] for k in ("model", "attention", "indexer", "cache", "mesh")},
                       "batch": [t["batch_size"], t["seq_len"], t.get("grad_accum", 1)]},
                      sort_keys=True, default=str)


def estimate(sweep: Sweep, timed_steps: int = 3, say=None) -> dict:
    """The expected time of the runs a sweep has left, before any of them starts. Each
    distinct row shape (`_shape`) with runs left is timed in a scratch directory: its step
    compiled and timed for `timed_steps` steps (its seeds vmapped together, as the sweep
    trains them), one validation, and one run's measurements (`measure`: recall, held-out
    loss past the training length, decode timing). Every unit left (a row's seeds together,
    or a seed alone) costs compile + steps left x step time + its validations; every run
    left, a measurement. Checkpoint writes are not in it. Returns {"units", "rows": {row:
    {compile_s, step_s, eval_s, measure_s}}, "train_s", "eval_s", "measure_s", "seconds",
    "timing_s"} (timing_s: how long the estimate itself took); seconds 0 when nothing is
    left. `say(line)`, before the timing starts: how many row shapes it times (minutes
    for a sweep of many shapes: silent until now)."""
    import math
    import tempfile

    import jax

    from dsattn import checkpoint
    from dsattn.train import SeedGroup, Trainer

    started = time.perf_counter()

    def steps_left(row, seed) -> int:  # 0: finished, or trained and only measurements left
        where = run_dir(sweep, row, seed)
        if (where / "result.json").exists():
            return 0
        saved = checkpoint.manager(where, 1).latest_step() if (where / "checkpoints").exists() \
            else None
        return sweep.config(row, seed).train.steps - (saved or 0)

    todo = {row: {s: steps_left(row, s) for s in sweep.seeds} for row in sweep.rows}
    unmeasured = {row: [s for s in sweep.seeds
                        if not (run_dir(sweep, row, s) / "result.json").exists()]
                  for row in sweep.rows}
    unmeasured = {row: seeds for row, seeds in unmeasured.items() if seeds}
    if not unmeasured:
        return {"units": 0, "rows": {}, "train_s": 0.0, "eval_s": 0.0, "measure_s": 0.0,
                "seconds": 0.0, "timing_s": 0.0}
    together = sweep.vmap_seeds
    cfg0 = sweep.config(sweep.rows[0], sweep.seeds[0])
    probes = {m: probes_for(sweep, cfg0, m) for m in (1, *sweep.lengths)}
    shapes = {row: _shape(sweep.config(row, seeds[0])) for row, seeds in unmeasured.items()}
    if say is not None:
        n = len(set(shapes.values()))
        say(f"estimate for sweep {sweep.name}: timing {n} row shape{'s' if n > 1 else ''}: "
            f"compile, steps, validation, measurement")
    timed: dict = {}  # shape -> its timings
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row, seeds in unmeasured.items():
            shape = shapes[row]
            if shape not in timed:
                timed[shape] = _time_row(sweep, row, seeds if together else seeds[:1],
                                         Path(tmp) / str(len(timed)), timed_steps, probes,
                                         SeedGroup, Trainer, jax)
            rows[row.name] = timed[shape]
    train_s = eval_s = measure_s = 0.0
    units = 0
    for row, seeds in unmeasured.items():
        t, cfg = rows[row.name], sweep.config(row, seeds[0])
        left = [todo[row][s] for s in seeds if todo[row][s] > 0]
        costs = [max(left)] if together and left else left
        units += len(costs)
        for n in costs:
            train_s += t["compile_s"] + n * t["step_s"]
            eval_s += math.ceil(n / cfg.train.eval_every) * t["eval_s"]
        measure_s += len(seeds) * t["measure_s"]
    return {"units": units, "rows": rows, "train_s": train_s, "eval_s": eval_s,
            "measure_s": measure_s, "seconds": train_s + eval_s + measure_s,
            "timing_s": time.perf_counter() - started}


def _time_row(sweep, row, seeds, where: Path, timed_steps, probes, SeedGroup, Trainer, jax):
    """One row shape's timings in a scratch directory: compile, a step, a validation (all
    its seeds together when they train together) and one run's measurements."""
    trainers = [Trainer(sweep.config(row, s), where / str(s), quiet=True) for s in seeds]
    unit = SeedGroup(trainers) if len(trainers) > 1 else trainers[0]
    start = time.perf_counter()
    jax.block_until_ready(unit.train_step(unit.batch_at(0), 0))
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for step in range(1, timed_steps + 1):
        jax.block_until_ready(unit.train_step(unit.batch_at(step), step))
    step_s = (time.perf_counter() - start) / timed_steps
    unit.validation_losses()  # compiles the evaluation step
    start = time.perf_counter()
    unit.validation_losses()
    eval_s = time.perf_counter() - start
    start = time.perf_counter()  # a member keeps its own (initial) weights: measured as one
    measure(sweep, row, Trained(trainers[0], float("nan")), probes)
    return {"compile_s": compile_s, "step_s": step_s, "eval_s": eval_s,
            "measure_s": time.perf_counter() - start}


def estimate_line(sweep: Sweep, e: dict) -> str:
    if not e["units"] and not e["measure_s"]:
        return f"estimate for sweep {sweep.name}: every run is finished"
    rows = "; ".join(f"{name} compile {t['compile_s']:.1f} s, step {t['step_s']:.3f} s, "
                     f"validation {t['eval_s']:.2f} s, measurement {t['measure_s']:.1f} s"
                     for name, t in e["rows"].items())
    return (f"estimate for sweep {sweep.name}: about {e['seconds'] / 60:.1f} min left "
            f"({e['units']} training units: training {e['train_s'] / 60:.1f} min, "
            f"validation {e['eval_s'] / 60:.1f} min, measurements {e['measure_s'] / 60:.1f} "
            f"min; checkpoint writes extra), each row shape timed ({rows}; timing took "
            f"{e['timing_s']:.0f} s)")


def fingerprint(sweep: Sweep, row: Row, seed: int) -> str:
    """What a finished run's numbers depend on: its config without its Kind.EXECUTION keys
    (block sizes, remat, micro-batches, mesh: how the run computed, not what), the sweep's
    measurements, and the fingerprint of the run it started from (Row.init)."""
    config = config_lib.without(sweep.config(row, seed).to_dict(), config_lib.Kind.EXECUTION)
    if row.init:
        config["init"] = fingerprint(sweep, source_row(sweep, row), seed)
    return _hashed(sweep, config)


def source_row(sweep: Sweep, row: Row) -> Row:
    """The row `row` starts from (Row.init)."""
    return next(r for r in sweep.rows if r.name == row.init)


def init_source(sweep: Sweep, row: Row, seed: int) -> str | None:
    """RUN_DIR:STEP of the run a row's seed starts from (the source row's last step), or
    None."""
    if not row.init:
        return None
    src = source_row(sweep, row)
    return f"{run_dir(sweep, src, seed)}:{sweep.config(src, seed).train.steps}"


def _legacy_fingerprint(sweep: Sweep, row: Row, seed: int, trained: dict | None) -> str:
    """The fingerprint of a result.json written before execution keys were left out: of the
    whole config, here with the execution values the run trained with (`trained`, its
    config.yaml) in place of today's."""
    config = sweep.config(row, seed).to_dict()
    for sec, key in config_lib.keys_of(config_lib.Kind.EXECUTION):
        if key in (trained or {}).get(sec, {}):
            config[sec][key] = trained[sec][key]
    return _hashed(sweep, config)


def _hashed(sweep: Sweep, config: dict) -> str:
    what = {"config": config, "distances": sweep.distances,
            "per_distance": sweep.per_distance, "probe_len": sweep.probe_len,
            "decode_context": sweep.decode_context, "lengths": sweep.lengths,
            "full_size": sweep.full_size and Path(sweep.full_size).name,
            **({"through_cache": True} if sweep.through_cache else {})}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _check_finished(sweep: Sweep) -> None:
    """A finished run measured under other settings would be skipped with stale numbers
    (e.g. a sweep rerun with train.steps=...): refuse before training anything. Execution
    keys (config.Kind.EXECUTION) may change, for runs finished before they were left out of
    the fingerprint too (their whole-config fingerprint is checked with the execution values
    of their config.yaml)."""
    from dsattn.checkpoint import saved_config

    for row in sweep.rows:
        for seed in sweep.seeds:
            done = sweep.out / "runs" / row.name / f"seed{seed}" / "result.json"
            if not done.exists():
                continue
            stored = json.loads(done.read_text()).get("fingerprint")
            if stored != fingerprint(sweep, row, seed) and stored != _legacy_fingerprint(
                    sweep, row, seed, saved_config(done.parent)):
                raise ConfigError(
                    f"row {row.name!r} seed {seed}: {done.parent} finished with other settings "
                    f"(config or measurements); give another --out or delete it")


def warn_few_seeds(sweep: Sweep) -> None:
    """A sweep of fewer than seedstats.ENOUGH_SEEDS seeds says, before it trains, what its
    report's intervals will mean."""
    import warnings

    n = len(sweep.seeds)
    if n < seedstats.ENOUGH_SEEDS:
        warnings.warn(f"sweep {sweep.name}: {n} seed{'s' if n > 1 else ''}: "
                      f"{seedstats.few_seeds(n)} (seeds: [0, 1, 2] or more)", stacklevel=3)


def run(sweep, overrides=(), out=None, quiet: bool = False,
        progress_every: int | None = None, estimate_first: bool = True) -> list[dict]:
    """Run (or resume) a sweep: a Sweep or a sweep file path. Returns the per-run results.

    Progress (dsattn.progress): on a terminal a bar over the runs and one over each run's
    steps; elsewhere a line per finished run with the sweep's ETA, and a run's own lines only
    with `progress_every` (every N steps). Before training, unless `quiet` or not
    `estimate_first`, the expected time of what is left (`estimate`: each row shape timed,
    minutes for many shapes; the progress's own ETA needs no timing pass)."""
    if not isinstance(sweep, Sweep):
        sweep = load(sweep, overrides, out)
    _check_finished(sweep)
    # One sweep per directory (the run directories' lock): a second would race this one's
    # runs and overwrite its results.
    from dsattn.checkpoint import RunDirLock

    lock = RunDirLock(sweep.out, "being swept", "another --out")
    try:
        warn_few_seeds(sweep)  # once it runs: a refused sweep says only why
        if not quiet and estimate_first:
            timing = estimate(sweep, say=lambda line: progress.say(
                f"{line} (ablate.py --no-estimate skips this)"))
            print(estimate_line(sweep, timing), file=sys.stderr, flush=True)
        return _run(sweep, quiet, progress_every)
    finally:
        lock.release()


def _run(sweep: Sweep, quiet: bool, progress_every: int | None) -> list[dict]:
    resolved = json.loads(json.dumps(dataclasses.asdict(sweep), default=str))
    (sweep.out / "sweep.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    cfg0 = sweep.config(sweep.rows[0], sweep.seeds[0])
    probes = {m: probes_for(sweep, cfg0, m) for m in (1, *sweep.lengths)}
    results = []
    finished = {(row.name, seed): run_dir(sweep, row, seed) / "result.json"
                for row in sweep.rows for seed in sweep.seeds}
    finished = {k: p for k, p in finished.items() if p.exists()}
    bar = progress.Progress(len(sweep.rows) * len(sweep.seeds), initial=len(finished),
                            desc=f"sweep {sweep.name}", unit="run", every=1,
                            quiet=quiet)  # ETA from the runs trained now
    quiet_runs = quiet or (bar.plain and progress_every is None)  # off a terminal: a line a run
    for row in sweep.rows:
        todo = [seed for seed in sweep.seeds if (row.name, seed) not in finished]
        if todo:
            bar.note(f"{row.name} seed{'s' if len(todo) > 1 else ''} "
                     f"{','.join(map(str, todo))}")
        trained = train_row(sweep, row, todo, quiet=quiet_runs, progress_every=progress_every)
        for seed in sweep.seeds:
            if (row.name, seed) in finished:  # saved before a field existed: filled in
                result = complete(sweep, [json.loads(finished[row.name, seed].read_text())])[0]
            else:
                try:
                    if isinstance(trained[seed], DsattnError):
                        raise trained[seed]
                    result = measure(sweep, row, trained[seed], probes)
                    result["fingerprint"] = fingerprint(sweep, row, seed)
                    write_json(run_dir(sweep, row, seed) / "result.json", result)
                except DsattnError as e:  # e.g. a NaN loss: recorded, retried on a rerun
                    result = {"row": row.name, "seed": seed, "error": str(e)}
                bar.update(fields={"row": row.name, "seed": seed, "val_loss": (
                    f"{result['val_loss']:.4f}" if "val_loss" in result else "FAILED")})
            results.append(result)
            write_results(sweep.out, sweep.name, results)
    bar.close()
    plots(sweep.out, results)
    return results


def report(sweep_dir, sweep=None) -> str:
    """Rewrite SWEEP_DIR's results.csv, summary.csv and plots from its results.json (no
    training) and return the printed report. Fields results saved before they existed (the
    window reach, BF16 bytes...) are filled in from `sweep` (a Sweep or sweep file), else
    from the sweep.yaml a sweep writes into its directory."""
    sweep_dir = Path(sweep_dir)
    path = sweep_dir / "results.json"
    if not path.exists():
        raise FileNotFoundError(f"{sweep_dir}: no results.json; is this a sweep directory?")
    saved = json.loads(path.read_text())
    if sweep is None and (sweep_dir / "sweep.yaml").exists():
        sweep = from_resolved(yaml.safe_load((sweep_dir / "sweep.yaml").read_text()))
    elif sweep is not None and not isinstance(sweep, Sweep):
        sweep = load(sweep)
    results = complete(sweep, saved["runs"]) if sweep is not None else saved["runs"]
    write_results(sweep_dir, saved.get("sweep", sweep_dir.name), results)
    plots(sweep_dir, results)
    return table(results)
