"""A sweep file: its schema, loading and validation (every row's config built before
any training), and where its runs live."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import json
import re
from pathlib import Path

import yaml

from dsattn import config as config_lib
from dsattn import recall
from dsattn.ablate.full_size import full_size_config
from dsattn.ablate.sweep import Row, Sweep  # noqa: F401  (re-exported: the sweep's types)
from dsattn.errors import ConfigError
from dsattn.migrations import RENAMED



SWEEP_KEYS = ("name", "base", "full_size", "overrides", "rows", "grid", "seeds", "recall",
              "recall_warmup",
              "decode_context", "lengths", "vmap_seeds", "out")
RECALL_KEYS = ("distances", "per_distance", "seq_len", "through_cache")
ROW_KEYS = ("name", "overrides", "control", "init")
WARMUP_KEYS = {"steps": "warm_steps", "dist": "warm_dist"}  # recall_warmup -> data.source
# What KEY=VALUE on the command line may set besides config keys: the sweep keys but its
# rows and overrides (--rows picks rows; section.key=value adds an override), and one key of
# recall or recall_warmup at a time
COMMAND_LINE_KEYS = (*(k for k in SWEEP_KEYS if k not in ("rows", "overrides")),
                     *(f"recall.{k}" for k in RECALL_KEYS),
                     *(f"recall_warmup.{k}" for k in WARMUP_KEYS))
CONFIG_KEYS = config_lib.keys_of(*config_lib.Kind)  # (section, key) of every config key


def unknown_key(key: str, valid, what: str) -> ConfigError:
    """An unknown key's error: the closest valid key first (a likely typo), then all."""
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"{key}: unknown {what}{hint}; valid: {', '.join(valid)}")


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


def load(path, overrides=(), out=None, scale_schedule: bool = False) -> Sweep:
    """Read and validate a sweep file; `overrides` (`command_line`): its sweep keys set, the
    config's appended to its shared overrides; `scale_schedule`: from_dict's."""
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
        return from_dict(raw, overrides, out, default_name=path.stem,
                         scale_schedule=scale_schedule)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def command_line(raw: dict, overrides=()) -> tuple[dict, tuple[str, ...], set[str]]:
    """Command-line KEY=VALUE overrides split: (the sweep file's mapping with the sweep keys
    they set, the config overrides, the sweep keys set). A sweep key's value is YAML
    (lengths=[2], seeds=[0,1], decode_context=0); KEY.SUB=VALUE sets one key of `recall` or
    `recall_warmup` (recall.per_distance=16, recall_warmup.steps=40), the file's others kept;
    a config key is section.key=value. Any other key is one error naming the closest of
    both kinds, before any row is built (a typo is the command line's, not a row's)."""
    raw, config, given = dict(raw), [], set()
    for ov in overrides:
        key, eq, value = ov.partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(f"{ov!r}: expected KEY=VALUE, e.g. train.steps=200 or seeds=[0,1]")
        if tuple(key.split(".", 1)) in CONFIG_KEYS:
            config.append(ov)
            continue
        if tuple(key.split(".", 1)) in RENAMED:
            sec, old = key.split(".", 1)
            raise ConfigError(f"{key}: renamed to {sec}.{RENAMED[sec, old]}")
        if key not in COMMAND_LINE_KEYS:
            raise _unknown_command_line_key(key)
        try:
            parsed = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"{key}: not a YAML value: {value!r} ({e.problem})") from None
        head, dot, sub = key.partition(".")
        if dot:
            if not isinstance(raw.get(head) or {}, dict):
                raise ConfigError(f"{key}: the sweep file's {head} is not a mapping")
            raw[head] = {**(raw.get(head) or {}), sub: parsed}
        else:
            raw[head] = parsed
        given.add(key)
    return raw, tuple(config), given


def _unknown_command_line_key(key: str) -> ConfigError:
    """One line: the closest of the sweep keys and config keys (a command line mixes both)."""
    if key in ("rows", "overrides"):
        return ConfigError(f"{key}: not settable on the command line; "
                           + ("--rows NAME,NAME picks rows" if key == "rows"
                              else "give each override as section.key=value"))
    every = [*COMMAND_LINE_KEYS, *(f"{sec}.{k}" for sec, k in CONFIG_KEYS)]
    close = difflib.get_close_matches(key, every, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"{key}: unknown key{hint}; a sweep key ({', '.join(COMMAND_LINE_KEYS)}) "
                       f"or a config key section.key, section one of "
                       f"{', '.join(config_lib.sections_of(*config_lib.Kind))}")


def from_dict(raw: dict, overrides=(), out=None, default_name="sweep",
              scale_schedule: bool = False) -> Sweep:
    """A Sweep from a sweep file's mapping and command-line overrides (`command_line`);
    `scale_schedule`: a train.steps shorter than the sweep file's scales each row's
    schedule with it (`_scaled`)."""
    raw, overrides, given = command_line(raw, overrides)
    for k in raw:
        if k not in SWEEP_KEYS:
            raise unknown_key(k, SWEEP_KEYS, "sweep key")
    if "base" not in raw:
        raise ConfigError("base: missing (the preset every row starts from)")
    rows = []
    for i, r in enumerate(raw.get("rows") or [], start=1):
        # a row is named by its name where it has one, else by its place (from 1)
        where = f"row {r['name']!r}" if isinstance(r, dict) and "name" in r else f"row {i} of rows"
        if not isinstance(r, dict):
            raise ConfigError(f"{where}: expected {{name: ..., overrides: [...]}}, got {r!r}")
        for k in r:
            if k not in ROW_KEYS:
                e = unknown_key(k, ROW_KEYS, "row key")
                raise ConfigError(f"{where}: {e}; a row is {{name: ..., overrides: [...]}}")
        if "name" not in r:
            raise ConfigError(f"{where}: no name; a row is {{name: ..., overrides: [...]}}")
        if not isinstance(r.get("control", False), bool):
            raise ConfigError(f"{where}: control: expected true or false, got {r['control']!r}")
        init = r.get("init")
        if init is not None and init not in [row.name for row in rows]:
            raise ConfigError(f"{where}: init: {init!r} is not a row before it (a row starts "
                              f"from an earlier row's runs)")
        rows.append(Row(str(r["name"]), _override_list(r.get("overrides"), f"row {r['name']!r}"),
                        r.get("control", False), init=init))
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
    if not isinstance(rc, dict):
        raise ConfigError(f"recall: expected a mapping of {', '.join(RECALL_KEYS)}, got {rc!r}")
    for k in rc:
        if k not in RECALL_KEYS:
            raise unknown_key(f"recall.{k}", [f"recall.{x}" for x in RECALL_KEYS], "key")
    in_file = _with_recall_warmup(_override_list(raw.get("overrides"), "overrides"),
                                  raw.get("recall_warmup"))
    shared = in_file + tuple(overrides)
    scaled_from = 0
    if scale_schedule:
        keep_warmup = bool(given & {"recall_warmup", "recall_warmup.steps"})
        scaled = [_scaled(str(raw["base"]), in_file, overrides, row, keep_warmup) for row in rows]
        rows = [row for row, _ in scaled]
        scaled_from = max(steps for _, steps in scaled)  # one count: the rows that scale
    decode = raw.get("decode_context", 4096)
    if not isinstance(decode, int) or decode < 0:
        raise ConfigError(f"decode_context: expected an integer >= 0, got {decode!r}")
    lengths = raw.get("lengths", [2, 4])
    if not isinstance(lengths, list) or not all(
            isinstance(m, int) and not isinstance(m, bool) and m >= 2 for m in lengths):
        raise ConfigError(f"lengths: expected a list of integers >= 2 (multiples of "
                          f"train.seq_len), got {lengths!r}")
    through_cache = rc.get("through_cache", False)
    if not isinstance(through_cache, bool):
        raise ConfigError(f"recall.through_cache: expected true or false, got {through_cache!r}")
    vmap_seeds = raw.get("vmap_seeds", True)
    if not isinstance(vmap_seeds, bool):
        raise ConfigError(f"vmap_seeds: expected true or false, got {vmap_seeds!r}")
    name = str(raw.get("name", default_name))
    sweep = Sweep(name=name, base=str(raw["base"]), full_size=raw.get("full_size"),
                  overrides=shared, rows=tuple(rows), seeds=tuple(seeds),
                  distances=tuple(rc.get("distances", ())), per_distance=rc.get("per_distance", 32),
                  probe_len=rc.get("seq_len", 0), decode_context=decode,
                  lengths=tuple(dict.fromkeys(lengths)), vmap_seeds=vmap_seeds,
                  through_cache=through_cache, scaled_from_steps=scaled_from,
                  out=Path(out or raw.get("out") or f"runs/ablations/{name}"))
    return _validate(sweep)


def _with_recall_warmup(shared: tuple[str, ...], warmup) -> tuple[str, ...]:
    """The shared overrides with `recall_warmup: {steps: S, dist: D}` (the first S steps'
    facts at most D tokens back) written into their recall data.source, as its own
    warm_steps=S,warm_dist=D would be (that older spelling still reads the same)."""
    if warmup is None:
        return shared
    if not isinstance(warmup, dict) or not warmup:
        raise ConfigError(f"recall_warmup: expected {{steps: N, dist: D}}, got {warmup!r}")
    for k, v in warmup.items():
        if k not in WARMUP_KEYS:
            raise unknown_key(f"recall_warmup.{k}", [f"recall_warmup.{x}" for x in WARMUP_KEYS],
                              "key")
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"recall_warmup.{k}: expected an integer, got {v!r}")
    sources = [i for i, o in enumerate(shared) if o.startswith("data.source=recall:")]
    if not sources:
        raise ConfigError("recall_warmup: the sweep's overrides set no recall data.source "
                          "(data.source=recall:...) to warm up")
    i = sources[-1]
    spelled = [WARMUP_KEYS[k] for k in warmup if f"{WARMUP_KEYS[k]}=" in shared[i]]
    if spelled:
        raise ConfigError(f"recall_warmup: data.source already sets {', '.join(spelled)}; "
                          f"give the warm-up in one place")
    extra = ",".join(f"{WARMUP_KEYS[k]}={v}" for k, v in warmup.items())
    return shared[:i] + (f"{shared[i]},{extra}",) + shared[i + 1:]


def _scaled(base: str, in_file, given, row: Row, keep_warmup: bool = False
            ) -> tuple[Row, int]:
    """`row` with its schedule scaled as scripts/train.py --scale-schedule scales a run's, by
    the command line's train.steps over the sweep file's (`in_file`: its shared overrides;
    the row's own count too): config.SCHEDULE_STEPS (warm-up, the indexer's dense warm-up,
    validation interval), config.CADENCE_STEPS (checkpoint and log cadence) and the recall
    source's curriculum (recall_warmup.steps), each at least 1, the keys the command line sets (`given`, `keep_warmup`) left alone. The scaled
    values are the row's `schedule` overrides, applied after its own. Returns (the row, the
    sweep file's train.steps it was scaled from; 0: not scaled)."""
    try:
        planned = config_lib.load(base, [*in_file, *row.overrides]).train.steps
        cfg = config_lib.load(base, [*in_file, *given, *row.overrides])
    except ConfigError:
        return row, 0  # _validate names the error, as it does without --scale-schedule
    steps = cfg.train.steps
    if not 0 < steps < planned:
        return row, 0
    told = config_lib.overridden_keys(given)
    scaled = config_lib.scale_schedule_of(cfg, planned, told)
    out = [f"{sec}.{key}={_value(scaled, sec, key)}" for sec, key in config_lib.SCALED_STEPS
           if _value(scaled, sec, key) != _value(cfg, sec, key)]
    spec = recall_spec(cfg)
    if spec is not None and spec.warm_steps and not keep_warmup and (
            "data", "source") not in told:
        warm = max(1, round(spec.warm_steps * steps / planned))
        if warm != spec.warm_steps:
            out.append("data.source=" + re.sub(r"\bwarm_steps=\d+", f"warm_steps={warm}",
                                               cfg.data.source.text))
    return dataclasses.replace(row, schedule=tuple(out)), planned if out else 0


def _value(cfg, sec: str, key: str):
    return getattr(getattr(cfg, sec), key)


def scaling(sweep: Sweep) -> list[str]:
    """What --scale-schedule changed: a line per distinct change, naming its rows
    ("--scale-schedule: train.warmup_steps 30 -> 12 (every row; train.steps 1000 -> 400)");
    [] when it changed nothing."""
    changed: dict[tuple, list[str]] = {}  # (key, before, after) -> rows
    steps = None
    for row in sweep.rows:
        if not row.schedule:
            continue
        plain = config_lib.load(sweep.base, [*sweep.overrides, *row.overrides])
        cfg = config_lib.load(sweep.base, [*sweep.overrides, *row.overrides, *row.schedule])
        steps = cfg.train.steps
        for sec, key in config_lib.SCALED_STEPS:
            if _value(plain, sec, key) != _value(cfg, sec, key):
                changed.setdefault((f"{sec}.{key}", _value(plain, sec, key),
                                    _value(cfg, sec, key)), []).append(row.name)
        before, after = recall_spec(plain), recall_spec(cfg)
        if before is not None and before.warm_steps != after.warm_steps:
            changed.setdefault(("recall_warmup.steps", before.warm_steps, after.warm_steps),
                               []).append(row.name)
    order = [f"{sec}.{key}" for sec, key in config_lib.SCALED_STEPS] + ["recall_warmup.steps"]
    lines = []
    for (key, before, after), names in sorted(changed.items(), key=lambda c: order.index(c[0][0])):
        rows = ("every row" if len(names) == len(sweep.rows) else
                f"row{'s' if len(names) > 1 else ''} {', '.join(names)}")
        lines.append(f"--scale-schedule: {key} {before} -> {after} ({rows}; train.steps "
                     f"{sweep.scaled_from_steps} -> {steps})")
    return lines


def recall_spec(cfg) -> recall.RecallSpec | None:
    """The recall parameters of a row's data.source (None: not a recall source)."""
    return cfg.data.source.recall


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
            recall_spec(cfg)  # a recall source's parameters checked now
            full_size_config(sweep, row)
        except ConfigError as e:
            raise ConfigError(f"row {row.name!r}: {e}") from None
        cfgs.append(cfg)
    _warn_long_warmups(sweep, cfgs[0])
    probe_len = sweep.probe_len or cfgs[0].train.seq_len
    spec = recall_spec(cfgs[0]) or recall.RecallSpec()
    least, most, every = recall.distance_bounds(spec, probe_len)
    dists = sweep.distances or tuple(d for d in (8, 16, 32, 64, 96, 128, 192, 256)
                                     if d <= most)
    for d in dists:
        if not isinstance(d, int) or not least <= d <= most or d % every:
            raise ConfigError(f"recall.distances: {d!r} must be an integer in [{least}, {most}]"
                              + (f" and a multiple of {every}" if every > 1 else ""))
    if spec.format == "mqar" and probe_len > spec.block:
        raise ConfigError(f"recall format=mqar: probe rows must fit a block of {spec.block} "
                          f"tokens, got seq_len {probe_len}")
    for row, cfg in zip(sweep.rows, cfgs):
        longest = max((m * max(probe_len, cfg.train.seq_len) for m in sweep.lengths),
                      default=0)
        if longest > cfg.model.max_seq_len:
            raise ConfigError(f"row {row.name!r}: lengths {list(sweep.lengths)} evaluate "
                              f"{longest} tokens, beyond model.max_seq_len="
                              f"{cfg.model.max_seq_len}")
    return dataclasses.replace(sweep, distances=tuple(dists), probe_len=probe_len)


def from_resolved(raw: dict) -> Sweep:
    """The Sweep a sweep directory's sweep.yaml records (written before its runs train)."""
    fields = {f.name for f in dataclasses.fields(Sweep)}
    raw = {k: v for k, v in raw.items() if k in fields}
    rows = tuple(Row(r["name"], tuple(r["overrides"]), r.get("control", False),
                     tuple(r.get("schedule") or ()), r.get("init"))
                 for r in raw.pop("rows"))
    out = Path(raw.pop("out"))
    return Sweep(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()},
                 rows=rows, out=out)


WARMUP_SHARE = 0.25  # a warm-up longer than this share of train.steps is likely unscaled


def _warn_long_warmups(sweep: Sweep, cfg) -> None:
    """Warm-ups are counted in steps: a recipe shrunk with train.steps=N keeps them, and a
    short run spends most of itself warming up. Scale them with train.steps (docs/ablations)."""
    import warnings

    steps = cfg.train.steps
    spec = recall_spec(cfg)
    for key, n in (("train.warmup_steps", cfg.train.warmup_steps),
                   ("indexer.dense_warmup_steps", cfg.indexer.dense_warmup_steps),
                   ("recall_warmup.steps", spec.warm_steps if spec else 0)):
        if n > WARMUP_SHARE * steps:
            warnings.warn(f"sweep {sweep.name}: {key}={n} is {n / steps:.0%} of train.steps="
                          f"{steps}; warm-ups do not scale with train.steps: scale them with "
                          f"it (ablate.py --scale-schedule; docs/ablations/README.md, 'Scaling "
                          f"a recipe')")


def select(sweep: Sweep, rows=None, seeds=None) -> Sweep:
    """The sweep with only these rows (names) and seeds, in the sweep's order (None: all);
    a name or seed the sweep lacks is a ConfigError naming what it has."""
    if rows is not None:
        names = [r.name for r in sweep.rows]
        for name in rows:
            if name not in names:
                raise ConfigError(f"--rows: {unknown_key(name, names, 'row')}")
        sweep = dataclasses.replace(sweep, rows=tuple(r for r in sweep.rows if r.name in rows))
    if seeds is not None:
        for seed in seeds:
            if seed not in sweep.seeds:
                raise ConfigError(f"--seeds: no seed {seed}; the sweep's seeds are: "
                                  f"{', '.join(map(str, sweep.seeds))}")
        sweep = dataclasses.replace(sweep, seeds=tuple(s for s in sweep.seeds if s in seeds))
    return sweep


def run_dir(sweep: Sweep, row: Row, seed: int) -> Path:
    return sweep.out / "runs" / row.name / f"seed{seed}"
