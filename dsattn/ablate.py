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
    decode_context: 4096                         # 0: no decode timing
    lengths: [2, 4]                              # also evaluated at 2x, 4x train.seq_len
    vmap_seeds: true                             # a row's seeds train as one vmapped model

Every file is validated whole before any training: unknown keys, duplicate row names and
overrides that fail config validation raise ConfigError naming the row and key. Runs live in
``OUT/runs/<row>/seed<k>/`` (OUT defaults to runs/ablations/<name>); within a seed every row
sees the same batches (batches are a function of (train.seed, step) and recall streams have
their own seed). A row's seeds train together, as one model vmapped over the seed
(dsattn.train.SeedGroup: one compiled step, each seed's parameters, batches, metrics and
checkpoints its own); rows whose shapes differ train one after another. A run with ``result.json`` is finished and skipped; any other resumes from
its checkpoint; a finished run whose config or measurement settings changed since is refused
(another --out). results.json / results.csv (one line per run) and summary.csv (one line per
row: mean, standard deviation and 95% interval over its seeds of every metric,
dsattn.seedstats) are rewritten after every run, plots at the end. Every run is also evaluated
beyond its training length (`lengths`, multiples of train.seq_len): held-out loss, and recall
with probes as many times longer and facts as many times farther back.
A second process on the same sweep directory is refused (RunDirLocked naming the holder's
pid), as a second writer of a run directory is.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import itertools
import io
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from dsattn import config as config_lib
from dsattn import kvbytes, plan, progress, recall, runlog, seedstats
from dsattn.errors import ConfigError, DsattnError

SWEEP_KEYS = ("name", "base", "full_size", "overrides", "rows", "grid", "seeds", "recall",
              "decode_context", "lengths", "vmap_seeds", "out")
RECALL_KEYS = ("distances", "per_distance", "seq_len")
CONTEXTS = {"8k": 8192, "128k": 131072}
# Sections whose overrides keep a meaning at full size (model shape, training and data don't).
FULL_SIZE_SECTIONS = ("attention", "indexer", "cache")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    overrides: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    base: str
    full_size: str | None
    overrides: tuple[str, ...]
    rows: tuple[Row, ...]
    seeds: tuple[int, ...]
    distances: tuple[int, ...]
    per_distance: int
    probe_len: int
    decode_context: int
    out: Path
    lengths: tuple[int, ...] = (2, 4)  # evaluated at these multiples of train.seq_len too
    vmap_seeds: bool = True  # a row's seeds train as one vmapped model (train.SeedGroup)

    def config(self, row: Row, seed: int):
        return config_lib.load(self.base, [*self.overrides, *row.overrides,
                                           f"train.seed={seed}"])


# ----------------------------------------------------------------------------- loading
def _override_list(value, where: str) -> tuple[str, ...]:
    """Overrides as ["k=v", ...] or {k: v}; mapping values become YAML (JSON) text."""
    if value is None:
        return ()
    if isinstance(value, dict):
        return tuple(f"{k}={v if isinstance(v, str) else json.dumps(v)}"
                     for k, v in value.items())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{where}: expected a list of key=value strings or a mapping")


def _grid_rows(grid) -> list[Row]:
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise ConfigError("grid: expected a mapping of key -> non-empty list of values")
    rows = []
    for values in itertools.product(*grid.values()):
        ovs = _override_list(dict(zip(grid, values)), "grid")
        rows.append(Row(",".join(o.split(".", 1)[-1] for o in ovs), ovs))
    return rows


def _find(name, sweep_file: Path) -> str:
    """A preset path as written (from the working directory), else from the sweep file's
    folder or one above it (configs/ablations/x.yaml names configs/tiny/...: the repo root)."""
    if name is None or Path(name).exists():
        return name
    for folder in sweep_file.resolve().parents:
        if (folder / name).exists():
            return str(folder / name)
    return name


def load(path, overrides=(), out=None) -> Sweep:
    """Read and validate a sweep file; `overrides` are appended to its shared overrides."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"sweep file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    for key in ("base", "full_size"):
        if isinstance(raw.get(key), str):
            raw[key] = _find(raw[key], path)
    try:
        return from_dict(raw, overrides, out, default_name=path.stem)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def from_dict(raw: dict, overrides=(), out=None, default_name="sweep") -> Sweep:
    for k in raw:
        if k not in SWEEP_KEYS:
            raise ConfigError(f"{k}: unknown sweep key; valid keys: {', '.join(SWEEP_KEYS)}")
    if "base" not in raw:
        raise ConfigError("base: missing (the preset every row starts from)")
    rows = []
    for i, r in enumerate(raw.get("rows") or []):
        if not isinstance(r, dict) or set(r) - {"name", "overrides"} or "name" not in r:
            raise ConfigError(f"rows[{i}]: expected {{name: ..., overrides: [...]}}")
        rows.append(Row(str(r["name"]), _override_list(r.get("overrides"), f"row {r['name']!r}")))
    if "grid" in raw:
        rows += _grid_rows(raw["grid"])
    if not rows:
        raise ConfigError("rows/grid: the sweep has no rows")
    seen = set()
    for r in rows:
        if r.name in seen:
            raise ConfigError(f"row {r.name!r}: duplicate row name")
        if not re.fullmatch(r"[\w.,=+-]+", r.name):
            raise ConfigError(f"row {r.name!r}: names may use letters, digits and _ . , = + -")
        seen.add(r.name)
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(
            isinstance(s, int) and s >= 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds: expected a list of distinct integers >= 0, got {seeds!r}")
    rc = raw.get("recall") or {}
    if not isinstance(rc, dict) or set(rc) - set(RECALL_KEYS):
        bad = sorted(set(rc) - set(RECALL_KEYS)) if isinstance(rc, dict) else ["?"]
        raise ConfigError(f"recall.{bad[0]}: unknown key; valid: {', '.join(RECALL_KEYS)}")
    shared = _override_list(raw.get("overrides"), "overrides") + tuple(overrides)
    decode = raw.get("decode_context", 4096)
    if not isinstance(decode, int) or decode < 0:
        raise ConfigError(f"decode_context: expected an integer >= 0, got {decode!r}")
    lengths = raw.get("lengths", [2, 4])
    if not isinstance(lengths, list) or not all(
            isinstance(m, int) and not isinstance(m, bool) and m >= 2 for m in lengths):
        raise ConfigError(f"lengths: expected a list of integers >= 2 (multiples of "
                          f"train.seq_len), got {lengths!r}")
    vmap_seeds = raw.get("vmap_seeds", True)
    if not isinstance(vmap_seeds, bool):
        raise ConfigError(f"vmap_seeds: expected true or false, got {vmap_seeds!r}")
    name = str(raw.get("name", default_name))
    sweep = Sweep(name=name, base=str(raw["base"]), full_size=raw.get("full_size"),
                  overrides=shared, rows=tuple(rows), seeds=tuple(seeds),
                  distances=tuple(rc.get("distances", ())), per_distance=rc.get("per_distance", 32),
                  probe_len=rc.get("seq_len", 0), decode_context=decode,
                  lengths=tuple(dict.fromkeys(lengths)), vmap_seeds=vmap_seeds,
                  out=Path(out or raw.get("out") or f"runs/ablations/{name}"))
    return _validate(sweep)


def _validate(sweep: Sweep) -> Sweep:
    """Build every row's config (and its full-size twin) now, so no error waits for a run."""
    for key in ("base", "full_size"):
        if getattr(sweep, key) and not Path(getattr(sweep, key)).exists():
            raise ConfigError(f"{key}: {getattr(sweep, key)!r} does not exist")
    for key, value, least in (("per_distance", sweep.per_distance, 1),
                              ("seq_len", sweep.probe_len, 0)):  # seq_len 0: train.seq_len
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"recall.{key}: expected an integer >= {least}, got {value!r}")
    cfgs = []
    for row in sweep.rows:
        try:
            cfg = sweep.config(row, sweep.seeds[0])
            if recall.is_recall(cfg.data.source):
                recall.parse_source(cfg.data.source)
            full_size_config(sweep, row)
        except ConfigError as e:
            raise ConfigError(f"row {row.name!r}: {e}") from None
        cfgs.append(cfg)
    probe_len = sweep.probe_len or cfgs[0].train.seq_len
    source = cfgs[0].data.source
    spec = recall.parse_source(source) if recall.is_recall(source) else recall.RecallSpec()
    least, most, every = recall.distance_bounds(spec, probe_len)
    dists = sweep.distances or tuple(d for d in (8, 16, 32, 64, 96, 128, 192, 256)
                                     if d <= most)
    for d in dists:
        if not isinstance(d, int) or not least <= d <= most or d % every:
            raise ConfigError(f"recall.distances: {d!r} must be an integer in [{least}, {most}]"
                              + (f" and a multiple of {every}" if every > 1 else ""))
    if spec.format == "mqar":
        too_long = [m for m in sweep.lengths if m * max(probe_len, cfgs[0].train.seq_len)
                    > spec.block]
        if probe_len > spec.block or too_long:
            raise ConfigError(f"recall format=mqar: probe rows and lengths x train.seq_len "
                              f"must fit a block of {spec.block} tokens (lengths: [] for none)"
                              f", got probe_len {probe_len}, lengths {list(sweep.lengths)}")
    return dataclasses.replace(sweep, distances=tuple(dists), probe_len=probe_len)


def _ratios_by_role(cfg) -> dict | None:
    """{(kind, decoder half): ratio} of a config's compressed layers, or None when two layers
    of one role differ (then per-layer ratios have no depth-independent meaning)."""
    roles: dict = {}
    for spec in plan.resolve(cfg):
        if spec.ratio and roles.setdefault((spec.name, spec.decoder), spec.ratio) != spec.ratio:
            return None
    return roles


def _translated_ratios(sweep: Sweep, row: Row, applied: list) -> str | None:
    """A per-layer `attention.ratios` override of the row, carried to the full-size preset by
    role: each full-size layer takes the ratio the row gives layers of its kind in its half
    of the stack (e.g. V4.1's encoder and decoder m). None when that is not well defined."""
    roles = _ratios_by_role(sweep.config(row, sweep.seeds[0]))
    full = config_lib.load(sweep.full_size, applied)
    if roles is None:
        return None
    ratios = [roles.get((spec.name, spec.decoder), spec.ratio) for spec in plan.resolve(full)]
    return "attention.ratios=" + ", ".join(map(str, ratios))


def full_size_config(sweep: Sweep, row: Row):
    """The full-size preset with the row's attention/indexer/cache overrides that validate
    there (each tried on its own); a per-layer `attention.ratios` list is carried over by
    layer role (kind and CED half). Returns (config, applied, skipped) or Nones."""
    if not sweep.full_size:
        return None, [], []
    applied, skipped = [], []
    for ov in (*sweep.overrides, *row.overrides):
        if ov.split(".", 1)[0] not in FULL_SIZE_SECTIONS:
            continue
        tries = [ov]
        if ov.split("=", 1)[0].strip() == "attention.ratios":
            tries.append(_translated_ratios(sweep, row, applied))
        for attempt in filter(None, tries):
            try:
                config_lib.load(sweep.full_size, [*applied, attempt])
                applied.append(attempt)
                break
            except ConfigError:
                continue
        else:
            skipped.append(ov)
    return config_lib.load(sweep.full_size, applied), applied, skipped


# ----------------------------------------------------------------------------- measures
def kv_figures(cfg) -> dict:
    out = {"storage_bytes_per_token": kvbytes.storage_per_token(cfg),
           "local_bytes": float(kvbytes.local_bytes(cfg))}
    for tag, ctx in CONTEXTS.items():
        out[f"read_bytes_{tag}"] = float(kvbytes.report(cfg, ctx)["read_bytes"])
    return out


def _curve(run_dir: Path) -> list[list[float]]:
    """Held-out loss along training, from metrics.jsonl (the last record per step wins)."""
    points = {r["step"]: r["val_loss"] for r in runlog.records(run_dir) if "val_loss" in r}
    return [[s, points[s]] for s in sorted(points)]


def _tokens_per_s(run_dir: Path):
    """Median training tokens/s over the run's metrics records (the Trainer times the steps
    between records; compile, validation and checkpoint time are not in it)."""
    rates = [float(r["tokens_per_s"]) for r in runlog.records(run_dir) if "tokens_per_s" in r]
    return float(np.median(rates)) if rates else None


def _held_out_loss(model, cfg, seq_len: int) -> float | None:
    """Nats per token of the validation split at `seq_len` (None if the split is shorter)."""
    from dsattn import evaluate

    try:
        return evaluate.evaluate(model, cfg, [seq_len])[0]["nats_per_token"]
    except DsattnError:  # the validation split holds fewer than seq_len + 1 tokens
        return None


@dataclasses.dataclass
class Trained:
    """A run trained to its last step: its Trainer, final held-out loss, this session's
    training seconds (a group's over its seeds) and how many seeds trained together."""
    trainer: object  # dsattn.train.Trainer
    val_loss: float
    train_s: float = 0.0
    together: int = 1


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
                         progress_every=progress_every)
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


def run_dir(sweep: Sweep, row: Row, seed: int) -> Path:
    return sweep.out / "runs" / row.name / f"seed{seed}"


def measure(sweep: Sweep, row: Row, run: Trained, probes) -> dict:
    """A trained run's result: its held-out loss curve, recall at the sweep's distances and
    beyond the training length (`probes` by multiple of it, 1: the sweep's own), held-out
    loss there, KV figures (own and full size) and decode step time."""
    import jax

    from dsattn.bench import measures as bench

    start = time.perf_counter()
    trainer, cfg = run.trainer, run.trainer.cfg
    model = trainer.model()
    acc = recall.accuracy(model, probes[1])
    beyond = {str(m): {"val_loss": _held_out_loss(model, cfg, m * cfg.train.seq_len),
                       "recall": {str(d): a for d, a in recall.accuracy(model, p).items()}}
              for m, p in probes.items() if m > 1}
    decode_ms = None
    if sweep.decode_context:
        decode_ms = bench.time_decode(model, sweep.decode_context, batch=1, steps=5,
                                      warmup=1)["step_ms"]
    full, applied, skipped = full_size_config(sweep, row)
    return {
        "row": row.name, "seed": cfg.train.seed, "overrides": list(row.overrides),
        "steps": trainer.step, "val_loss": run.val_loss, "curve": _curve(trainer.run_dir),
        "params": int(sum(np.size(x) for x in jax.tree.leaves(trainer.params))),
        "train_tokens_per_s": _tokens_per_s(trainer.run_dir),
        "seeds_together": run.together,  # trained as one vmapped model with this many seeds
        "decode_context": sweep.decode_context or None, "decode_ms": decode_ms,
        "recall": {str(d): a for d, a in acc.items()},
        "recall_chance": recall.chance(cfg.data.source),
        "beyond": beyond,  # {multiple of train.seq_len: held-out loss, recall by distance}
        "kv": kv_figures(cfg),
        "kv_full": kv_figures(full) if full is not None else None,
        "full_overrides_applied": applied, "full_overrides_skipped": skipped,
        # this session's share of the run: its training (a group's time over its seeds)
        # and its measurements
        "wall_s": run.train_s + time.perf_counter() - start,
    }


# ----------------------------------------------------------------------------- the sweep
def fingerprint(sweep: Sweep, row: Row, seed: int) -> str:
    """What a finished run's numbers depend on: its config and the sweep's measurements."""
    what = {"config": sweep.config(row, seed).to_dict(), "distances": sweep.distances,
            "per_distance": sweep.per_distance, "probe_len": sweep.probe_len,
            "decode_context": sweep.decode_context, "lengths": sweep.lengths,
            "full_size": sweep.full_size and Path(sweep.full_size).name}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _check_finished(sweep: Sweep) -> None:
    """A finished run measured under other settings would be skipped with stale numbers
    (e.g. a sweep rerun with train.steps=...): refuse before training anything."""
    for row in sweep.rows:
        for seed in sweep.seeds:
            done = sweep.out / "runs" / row.name / f"seed{seed}" / "result.json"
            if done.exists() and json.loads(done.read_text()).get(
                    "fingerprint") != fingerprint(sweep, row, seed):
                raise ConfigError(
                    f"row {row.name!r} seed {seed}: {done.parent} finished with other settings "
                    f"(config or measurements); give another --out or delete it")


def _write_json(path: Path, obj) -> None:
    runlog.atomic_write(path, json.dumps(obj, indent=1))


def flat(result: dict) -> dict:
    """One CSV row: scalars, recall accuracy per distance, kv figures (full_* at full size)."""
    out = {k: result.get(k) for k in ("row", "seed", "steps", "val_loss", "params",
                                      "train_tokens_per_s", "decode_context", "decode_ms",
                                      "wall_s")}
    out.update({f"recall_d{d}": a for d, a in result.get("recall", {}).items()})
    out.update(_beyond(result))
    out.update(result.get("kv") or {})
    out.update({f"full_{k}": v for k, v in (result.get("kv_full") or {}).items()})
    out["overrides"] = " ".join(result.get("overrides", []))
    if "error" in result:
        out["error"] = result["error"]
    return out


def _metrics(result: dict) -> dict:
    """A run's metrics that vary with the seed: the scalars, mean recall and recall per
    distance, and the same beyond the training length."""
    acc = result.get("recall") or {}
    out = {k: result.get(k) for k in ("val_loss", "train_tokens_per_s", "decode_ms")}
    out["recall_mean"] = float(np.mean(list(acc.values()))) if acc else None
    out.update({f"recall_d{d}": a for d, a in acc.items()})
    out.update(_beyond(result))
    return out


def _beyond(result: dict) -> dict:
    """Columns of the evaluation beyond the training length: val_loss_x2, recall_x2_d96..."""
    out = {}
    for m, b in (result.get("beyond") or {}).items():
        out[f"val_loss_x{m}"] = b["val_loss"]
        out.update({f"recall_x{m}_d{d}": a for d, a in b["recall"].items()})
    return out


def row_summaries(results: list[dict]) -> dict:
    """{row: {metric: seedstats.summary}} over each row's finished seeds."""
    out = {}
    for name, rs in _by_row(results).items():
        runs = [_metrics(r) for r in rs]
        keys = list(dict.fromkeys(k for m in runs for k in m))
        out[name] = {k: seedstats.summary([m.get(k) for m in runs]) for k in keys}
    return out


def _write_csv(path: Path, rows: list[dict]) -> None:
    text = io.StringIO()
    w = csv.DictWriter(text, list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)
    runlog.atomic_write(path, text.getvalue())


def write_results(out: Path, sweep_name: str, results: list[dict]) -> None:
    summaries = row_summaries(results)
    _write_json(out / "results.json", {"sweep": sweep_name, "runs": results, "rows": {
        name: {k: {st: None if isinstance(v, float) and np.isnan(v) else v
                   for st, v in m.items()} for k, m in ms.items()}
        for name, ms in summaries.items()}})
    _write_csv(out / "results.csv", [flat(r) for r in results])
    _write_csv(out / "summary.csv", [
        {"row": name, "seeds": next(iter(m.values()))["n"],
         **{f"{k}_{stat}": v[stat] for k, v in m.items() for stat in ("mean", "std", "lo", "hi")}}
        for name, m in summaries.items()])


def estimate(sweep: Sweep, timed_steps: int = 3) -> dict:
    """The expected training time of the runs a sweep has left, before any of them starts:
    its first unfinished row's step (its seeds vmapped together, as the sweep trains them)
    compiled and timed for `timed_steps` steps in a scratch directory, then extrapolated to
    every unit left (a row's seeds together, or a seed alone) as compile + steps x step
    time. Every row is costed as the first; validation, checkpoints and measurements are
    not in it. {"units", "compile_s", "step_s", "seconds"}; seconds 0 when nothing is left."""
    import tempfile

    import jax

    from dsattn.train import SeedGroup, Trainer

    left = {row: [s for s in sweep.seeds if not (run_dir(sweep, row, s) / "result.json")
                  .exists()] for row in sweep.rows}
    left = {row: seeds for row, seeds in left.items() if seeds}
    if not left:
        return {"units": 0, "compile_s": 0.0, "step_s": 0.0, "seconds": 0.0}
    row, seeds = next(iter(left.items()))
    together = sweep.vmap_seeds
    with tempfile.TemporaryDirectory() as tmp:
        trainers = [Trainer(sweep.config(row, s), Path(tmp) / str(s), quiet=True)
                    for s in (seeds if together else seeds[:1])]
        unit = SeedGroup(trainers) if len(trainers) > 1 else trainers[0]
        start = time.perf_counter()
        jax.block_until_ready(unit.train_step(unit.batch_at(0), 0))
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        for step in range(1, timed_steps + 1):
            jax.block_until_ready(unit.train_step(unit.batch_at(step), step))
        step_s = (time.perf_counter() - start) / timed_steps
    units = {r: 1 if together else len(s) for r, s in left.items()}
    seconds = sum(n * (compile_s + sweep.config(r, sweep.seeds[0]).train.steps * step_s)
                  for r, n in units.items())
    return {"units": sum(units.values()), "compile_s": compile_s, "step_s": step_s,
            "seconds": seconds}


def estimate_line(sweep: Sweep, e: dict) -> str:
    if not e["units"]:
        return f"estimate for sweep {sweep.name}: every run is finished"
    return (f"estimate for sweep {sweep.name}: about {e['seconds'] / 60:.1f} min of training "
            f"left: {e['units']} x (compile {e['compile_s']:.1f} s + the steps at "
            f"{e['step_s']:.3f} s each), every row timed as its first; measurements extra")


def run(sweep, overrides=(), out=None, quiet: bool = False,
        progress_every: int | None = None) -> list[dict]:
    """Run (or resume) a sweep: a Sweep or a sweep file path. Returns the per-run results.

    Progress (dsattn.progress): on a terminal a bar over the runs and one over each run's
    steps; elsewhere a line per finished run with the sweep's ETA, and a run's own lines only
    with `progress_every` (every N steps)."""
    if not isinstance(sweep, Sweep):
        sweep = load(sweep, overrides, out)
    _check_finished(sweep)
    # One sweep per directory (the run directories' lock): a second would race this one's
    # runs and overwrite its results.
    from dsattn.checkpoint import RunDirLock

    lock = RunDirLock(sweep.out, "being swept", "another --out")
    try:
        if not quiet:
            print(estimate_line(sweep, estimate(sweep)), file=sys.stderr, flush=True)
        return _run(sweep, quiet, progress_every)
    finally:
        lock.release()


def _run(sweep: Sweep, quiet: bool, progress_every: int | None) -> list[dict]:
    resolved = json.loads(json.dumps(dataclasses.asdict(sweep), default=str))
    (sweep.out / "sweep.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    cfg0 = sweep.config(sweep.rows[0], sweep.seeds[0])
    probes = {m: _probes(sweep, cfg0, m) for m in (1, *sweep.lengths)}
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
            if (row.name, seed) in finished:
                result = json.loads(finished[row.name, seed].read_text())
            else:
                try:
                    if isinstance(trained[seed], DsattnError):
                        raise trained[seed]
                    result = measure(sweep, row, trained[seed], probes)
                    result["fingerprint"] = fingerprint(sweep, row, seed)
                    _write_json(run_dir(sweep, row, seed) / "result.json", result)
                except DsattnError as e:  # e.g. a NaN loss: recorded, retried on a rerun
                    result = {"row": row.name, "seed": seed, "error": str(e)}
                bar.update(fields={"row": row.name, "seed": seed, "val_loss": (
                    f"{result['val_loss']:.4f}" if "val_loss" in result else "FAILED")})
            results.append(result)
            write_results(sweep.out, sweep.name, results)
    bar.close()
    plots(sweep.out, results)
    return results


def _probes(sweep: Sweep, cfg, times: int = 1) -> recall.Probes:
    """Recall probes shared by every run: contexts from the recall validation stream when the
    sweep trains on one, else from a fresh noise stream; with `times`, rows that many times
    longer with facts that many times farther back (distances past recall.MAX_DIST left out)."""
    spec, background = recall.RecallSpec(), None
    if recall.is_recall(cfg.data.source):
        spec = recall.parse_source(cfg.data.source)
        background = recall.streams(cfg.data.source, cfg.data.val_fraction,
                                    cfg.data.max_bytes)[1]
        if len(background) < times * sweep.probe_len:
            background = None
    most = recall.distance_bounds(spec, times * sweep.probe_len)[1]
    dists = [times * d for d in sweep.distances if times * d <= min(most, recall.MAX_DIST)]
    return recall.probes(dists, sweep.per_distance, times * sweep.probe_len, spec, background)


# ----------------------------------------------------------------------------- reporting
def _by_row(results):
    rows = {}
    for r in results:
        if "error" not in r:
            rows.setdefault(r["row"], []).append(r)
    return rows


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (lower is better),
    ordered by x."""
    front = [i for i, (x, y) in enumerate(points)
             if not any(x2 <= x and y2 <= y and (x2, y2) != (x, y) for x2, y2 in points)]
    return sorted(front, key=lambda i: points[i])


def _band(ax, xs, runs: np.ndarray, colour, label: str) -> None:
    """The mean over seeds (rows of `runs`) as a line, its 95% interval as a band."""
    st = [seedstats.summary(col) for col in runs.T]
    ax.plot(xs, [x["mean"] for x in st], "o-" if len(xs) < 20 else "-", color=colour,
            label=label)
    if runs.shape[0] > 1:
        ax.fill_between(xs, [x["lo"] for x in st], [x["hi"] for x in st], color=colour,
                        alpha=0.2)


def plots(out, results: list[dict]) -> list[Path]:
    """pareto.png, recall.png, curves.png: one colour per row, the mean over seeds and its
    95% interval (seedstats; none with one seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, rows = Path(out), _by_row(results)
    if not rows:
        return []
    colours = plt.get_cmap("tab20" if len(rows) > 10 else "tab10")
    col = {name: colours(i % colours.N) for i, name in enumerate(rows)}
    summaries = row_summaries(results)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5.5))
    pts = []
    for name, rs in rows.items():
        x = rs[0]["kv"]["storage_bytes_per_token"]
        if x <= 0:  # window-only stacks store nothing global: no place on a log axis
            continue
        y = summaries[name]["val_loss"]
        pts.append({"x": x, "y": y})
        err = None if np.isnan(y["lo"]) else [[y["mean"] - y["lo"]], [y["hi"] - y["mean"]]]
        ax.errorbar(x, y["mean"], yerr=err, fmt="o", color=col[name], capsize=3, label=name)
    front = pareto([(p["x"], p["y"]["mean"]) for p in pts])
    near = seedstats.overlaps_front(pts, front)
    ax.plot([pts[i]["x"] for i in front], [pts[i]["y"]["mean"] for i in front], "k--", lw=1,
            label="Pareto front (means)")
    ax.scatter([pts[i]["x"] for i in front], [pts[i]["y"]["mean"] for i in front], s=160,
               facecolors="none", edgecolors="k")
    if near:
        ax.scatter([pts[i]["x"] for i in near], [pts[i]["y"]["mean"] for i in near], s=160,
                   facecolors="none", edgecolors="grey", linestyles="dotted",
                   label="interval reaches the front")
    ax.set_xscale("log")
    ax.set_xlabel("KV storage per token (bytes, log scale; run's own config and formats)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("held-out loss vs KV bytes per token (mean, bars: 95% interval over seeds)")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out / "pareto.png"))

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, rs in rows.items():
        ds = sorted(int(d) for d in rs[0]["recall"])
        _band(ax, ds, np.array([[r["recall"][str(d)] for d in ds] for r in rs]), col[name],
              name)
    ax.axhline(results[0].get("recall_chance", recall.CHANCE), color="grey", ls=":",
               label="chance")
    ax.set_xlabel("fact-to-query distance (bytes)")
    ax.set_ylabel("recall accuracy on answer bytes (fraction)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("recall accuracy vs distance (mean, band: 95% interval over seeds)")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out / "recall.png"))

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, rs in rows.items():
        steps = sorted(set.intersection(*[{s for s, _ in r["curve"]} for r in rs]))
        if not steps:
            continue
        _band(ax, steps, np.array([[dict(map(tuple, r["curve"]))[s] for s in steps]
                                   for r in rs]), col[name], name)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("held-out loss during training (mean, band: 95% interval over seeds)")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out / "curves.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _mean(summaries: dict, key: str) -> float:
    return summaries[key]["mean"] if key in summaries else math.nan


def _interval(m: dict, fmt: str) -> str:
    if np.isnan(m["lo"]):
        return format(m["mean"], fmt)
    return f"{format(m['mean'], fmt)} [{format(m['lo'], fmt)}, {format(m['hi'], fmt)}]"


def table(results: list[dict]) -> str:
    """Per row: seeds, loss and mean recall (mean [95% interval] over seeds), the held-out
    loss at each multiple of the training length (mean), KV bytes/token
    (own, full size), reads at 128K full size, params, tokens/s, decode ms; then each row's
    loss and recall against the best row's, and whether the difference exceeds the spread
    of the seeds (Welch's 95% interval excludes 0)."""
    rows, summaries = _by_row(results), row_summaries(results)
    times = sorted({int(m) for rs in rows.values() for r in rs for m in r.get("beyond") or {}})
    longer = "loss " + "/".join(f"x{m}" for m in times) if times else ""
    head = (f"{'row':<28} {'n':>2} {'loss':>26} {'recall':>22} {longer:>16} {'B/tok':>9} "
            f"{'full B/tok':>10} {'full rd 128K':>12} {'params':>8} {'tok/s':>7} {'dec ms':>6}")
    lines = [head, "-" * len(head)]
    for name, rs in rows.items():
        m, full = summaries[name], rs[0].get("kv_full") or {}
        lines.append(
            f"{name:<28} {len(rs):>2} {_interval(m['val_loss'], '.4f'):>26} "
            f"{_interval(m['recall_mean'], '.3f'):>22} "
            f"{'/'.join(format(_mean(m, f'val_loss_x{t}'), '.3f') for t in times):>16} "
            f"{rs[0]['kv']['storage_bytes_per_token']:>9.1f} "
            f"{full.get('storage_bytes_per_token', float('nan')):>10.1f} "
            f"{full.get('read_bytes_128k', float('nan')):>12.3g} {rs[0]['params']:>8,} "
            f"{m['train_tokens_per_s']['mean']:>7.0f} {m['decode_ms']['mean']:>6.2f}")
    if len(rows) > 1:
        best = min(rows, key=lambda n: summaries[n]["val_loss"]["mean"])
        lines += ["", f"against the lowest mean loss ({best}): difference [95% interval]"]
        for name, rs in rows.items():
            if name == best:
                continue
            parts = []
            for key, label, fmt in (("val_loss", "loss", "+.4f"), ("recall_mean", "recall",
                                                                    "+.3f")):
                d = seedstats.difference([_metrics(r)[key] for r in rs],
                                         [_metrics(r)[key] for r in rows[best]])
                verdict = {None: "one seed: spread unknown", True: "exceeds the seed spread",
                           False: "within the seed spread"}[d["exceeds"]]
                shown = (format(d["diff"], fmt) if np.isnan(d["lo"]) else
                         f"{format(d['diff'], fmt)} [{format(d['lo'], fmt)}, "
                         f"{format(d['hi'], fmt)}]")
                parts.append(f"{label} {shown} ({verdict})")
            lines.append(f"  {name}: " + "; ".join(parts))
    for r in results:
        if "error" in r:
            lines.append(f"{r['row']} seed {r['seed']}: FAILED: {r['error']}")
    return "\n".join(lines)


def report(sweep_dir) -> str:
    """Redraw the plots from SWEEP_DIR/results.json (no training); return the table."""
    path = Path(sweep_dir) / "results.json"
    if not path.exists():
        raise FileNotFoundError(f"{sweep_dir}: no results.json; is this a sweep directory?")
    results = json.loads(path.read_text())["runs"]
    plots(sweep_dir, results)
    return table(results)
