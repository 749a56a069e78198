"""A sweep's results: one line per run (results.csv/json), per-row statistics over seeds
(summary.csv, dsattn.seedstats) and the printed report.

Recall is read at each row's window reach (dsattn.ablate.reach): `recall_within` averages
the probed distances its sliding windows reach, `recall_beyond` the farther ones, where only
compression (or an unwindowed layer) carries a fact and a window-only row is at chance. Two
rows are compared at the shorter of their reaches."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np

from dsattn import runlog, seedstats
from dsattn.ablate import reach as reach_lib


def write_json(path: Path, obj) -> None:
    runlog.atomic_write(path, json.dumps(obj, indent=1))


def flat(result: dict) -> dict:
    """One CSV row: scalars, recall accuracy per distance, kv figures (full_* at full size)."""
    out = {k: result.get(k) for k in ("row", "seed", "steps", "val_loss", "params",
                                      "train_tokens_per_s", "decode_context", "decode_ms",
                                      "wall_s")}
    out["reach"] = result.get("reach")
    out.update({f"recall_{side}": v for side, v in _split(result, "recall").items()})
    out.update({f"recall_d{d}": a for d, a in result.get("recall", {}).items()})
    out.update({f"recall_cache_d{d}": a for d, a in result.get("recall_cache", {}).items()})
    out.update(_beyond(result))
    out.update(result.get("kv") or {})
    out.update({f"full_{k}": v for k, v in (result.get("kv_full") or {}).items()})
    out["overrides"] = " ".join(result.get("overrides", []))
    if "error" in result:
        out["error"] = result["error"]
    return out


def _split(result: dict, key: str, acc: dict | None = None, at="own") -> dict:
    """{"within", "beyond"}: a run's recall (result[key], or `acc`) split at its own reach
    or at `at`; {} when the reach is unknown (results saved before it was recorded)."""
    if at == "own":
        if "reach" not in result:
            return {}
        at = result["reach"]
    acc = result.get(key) if acc is None else acc
    return reach_lib.split(acc, at) if acc else {}


def _metrics(result: dict) -> dict:
    """A run's metrics that vary with the seed: the scalars, recall within and beyond its
    reach, its mean over every distance and per distance, and the same beyond the training
    length."""
    acc = result.get("recall") or {}
    out = {k: result.get(k) for k in ("val_loss", "train_tokens_per_s", "decode_ms")}
    out.update({f"recall_{side}": v for side, v in _split(result, "recall").items()})
    out["recall_mean"] = float(np.mean(list(acc.values()))) if acc else None
    out.update({f"recall_d{d}": a for d, a in acc.items()})
    if "recall_cache" in result:
        cached = result["recall_cache"]
        out.update({f"recall_cache_{side}": v
                    for side, v in _split(result, "recall_cache").items()})
        out["recall_cache_mean"] = float(np.mean(list(cached.values())))
        out.update({f"recall_cache_d{d}": a for d, a in cached.items()})
    out.update(_beyond(result))
    return out


def _beyond(result: dict) -> dict:
    """Columns of the evaluation beyond the training length: val_loss_x2, recall_x2_within,
    recall_x2_beyond (split at the row's reach in tokens, like recall), recall_x2_d96..."""
    out = {}
    for m, b in (result.get("beyond") or {}).items():
        out[f"val_loss_x{m}"] = b["val_loss"]
        out.update({f"recall_x{m}_{side}": v
                    for side, v in _split(result, "", b["recall"]).items()})
        out.update({f"recall_x{m}_d{d}": a for d, a in b["recall"].items()})
    return out


def row_summaries(results: list[dict]) -> dict:
    """{row: {metric: seedstats.summary}} over each row's finished seeds."""
    out = {}
    for name, rs in by_row(results).items():
        runs = [_metrics(r) for r in rs]
        keys = list(dict.fromkeys(k for m in runs for k in m))
        out[name] = {k: seedstats.summary([m.get(k) for m in runs], value_range(k))
                     for k in keys}
    return out


def value_range(metric: str) -> tuple[float, float]:
    """The values a metric can take: a recall is a fraction, every other one (loss, bytes,
    tokens/s, ms) is >= 0."""
    return (0.0, 1.0) if "recall" in metric else (0.0, math.inf)


def _write_csv(path: Path, rows: list[dict]) -> None:
    text = io.StringIO()
    w = csv.DictWriter(text, list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)
    runlog.atomic_write(path, text.getvalue())


def write_results(out: Path, sweep_name: str, results: list[dict]) -> None:
    summaries = row_summaries(results)
    write_json(out / "results.json", {"sweep": sweep_name, "runs": results, "rows": {
        name: {k: {st: None if isinstance(v, float) and np.isnan(v) else v
                   for st, v in m.items()} for k, m in ms.items()}
        for name, ms in summaries.items()}})
    _write_csv(out / "results.csv", [flat(r) for r in results])
    _write_csv(out / "summary.csv", summary_rows(results, summaries))


# Per-row facts in summary.csv: the same for every seed of a row.
FACT_KEYS = ("reach", "recall_chance", "loss_unit")
KV_KEYS = ("cache_formats", "storage_bytes_per_token", "storage_bf16_bytes_per_token",
           "read_bytes_128k", "read_bf16_bytes_128k")


def summary_rows(results: list[dict], summaries: dict | None = None) -> list[dict]:
    """summary.csv: per row its facts (reach, chance, loss unit), KV bytes per token and
    reads per decode step at 128K (own config in its cache formats and in BF16; full_*: the
    sweep's full-size preset with the row's overrides), then mean/std/lo/hi of every metric
    over its seeds. A metric no run has (e.g. decode_ms without decode timing) is left out."""
    summaries = summaries or row_summaries(results)
    rows, present = by_row(results), set()
    for m in summaries.values():
        present |= {k for k, v in m.items() if v["n"]}
    out = []
    for name, m in summaries.items():
        first = rows[name][0]
        line = {"row": name, "seeds": next(iter(m.values()))["n"]}
        line.update({k: first[k] for k in FACT_KEYS if k in first})
        line.update({k: (first.get("kv") or {})[k] for k in KV_KEYS if k in (first.get("kv") or {})})
        line.update({f"full_{k}": first["kv_full"][k] for k in KV_KEYS
                     if k in (first.get("kv_full") or {})})
        line.update({f"{k}_{stat}": v[stat] for k, v in m.items() if k in present
                     for stat in ("mean", "std", "lo", "hi")})
        out.append(line)
    return out


def by_row(results):
    rows = {}
    for r in results:
        if "error" not in r:
            rows.setdefault(r["row"], []).append(r)
    return rows


def _interval(m: dict | None, fmt: str) -> str | None:
    """mean [lo, hi] (mean alone with one seed); None when no run has the metric."""
    if not m or not m["n"]:
        return None
    if np.isnan(m["lo"]):
        return format(m["mean"], fmt)
    return f"{format(m['mean'], fmt)} [{format(m['lo'], fmt)}, {format(m['hi'], fmt)}]"


def _num(x, fmt: str) -> str | None:
    return None if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, fmt)


def _si(x) -> str | None:
    """Bytes with a decimal prefix (3.5 kB, 1.2 GB)."""
    if x is None:
        return None
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.4g} B"


# Columns that may be empty, and the line that says why when every row's is.
WHY_EMPTY = {
    "full B/tok": "full B/tok, full rd 128K: the sweep names no full_size preset",
    "dec ms": "dec ms: the sweep's decode_context is 0 (no decode timing)",
    "reach": "reach, recall<=reach, recall>reach: results saved before the reach was "
             "recorded and no sweep to read it from (recall: every distance)",
    "recall>reach": "recall>reach: every probed distance is within each row's reach",
}


def _columns(rows: dict, summaries: dict) -> list[tuple[str, list]]:
    """(header, one cell per row) of the report's table; cells None where there is no value."""
    times = sorted({int(m) for rs in rows.values() for r in rs for m in r.get("beyond") or {}})
    cols: dict[str, list] = {}

    def add(head, cell):
        cols.setdefault(head, []).append(cell)

    known = all("reach" in rs[0] for rs in rows.values())
    for name, rs in rows.items():
        m, first = summaries[name], rs[0]
        kv, full = first.get("kv") or {}, first.get("kv_full") or {}
        add("row", name + (" (control)" if first.get("control") else ""))
        add("n", str(len(rs)))
        add("loss", _interval(m["val_loss"], ".4f"))
        for t in times:
            add(f"loss x{t}", _interval(m.get(f"val_loss_x{t}"), ".3f"))
        add("reach", None if "reach" not in first else
            "all" if first["reach"] is None else str(first["reach"]))
        add("recall<=reach", _interval(m.get("recall_within"), ".3f"))
        add("recall>reach", _interval(m.get("recall_beyond"), ".3f"))
        if not known:
            add("recall", _interval(m.get("recall_mean"), ".3f"))
        for t in times:
            add(f"x{t} recall>reach", _interval(m.get(f"recall_x{t}_beyond"), ".3f"))
        add("B/tok", _num(kv.get("storage_bytes_per_token"), ".1f"))
        add("B/tok bf16", _num(kv.get("storage_bf16_bytes_per_token"), ".1f"))
        add("rd 128K", _si(kv.get("read_bytes_128k")))
        add("full B/tok", _num(full.get("storage_bytes_per_token"), ".1f"))
        add("full rd 128K", _si(full.get("read_bytes_128k")))
        add("params", f"{first['params']:,}")
        add("tok/s", _num(m["train_tokens_per_s"]["mean"], ".0f"))
        add("dec ms", _num(m["decode_ms"]["mean"], ".2f"))
    return list(cols.items())


def _format(cols: list[tuple[str, list]]) -> list[str]:
    widths = [max(len(h), *(len(c or "-") for c in cells)) for h, cells in cols]
    line = lambda cells: " ".join(  # noqa: E731
        (c or "-").ljust(w) if i == 0 else (c or "-").rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line([h for h, _ in cols])]
    out.append("-" * len(out[0]))
    out += [line(cells) for cells in zip(*(c for _, c in cols))]
    return out


def _notes(rows: dict, left_out: list[str]) -> list[str]:
    """What the columns are in, one line each, and why a column is missing."""
    first = next(iter(rows.values()))[0]
    kv, full = first.get("kv") or {}, first.get("kv_full") or {}
    out = [f"loss: held-out, {first.get('loss_unit', 'nats per token')}; mean [95% interval "
           f"over seeds, Student's t]"]
    two = [name for name, rs in rows.items() if len(rs) == 2]
    if two:  # t with 1 degree of freedom: intervals like [0.0000, 18.4963] around 1.41
        out.append(f"2 seeds ({', '.join(two)}): {seedstats.few_seeds(2)}")
    if any(rs[0].get("control") for rs in rows.values()):
        out.append("(control): a reference row the others are read against (the sweep "
                   "file's control: true), kept off pareto.png's front")
    if "reach" in first:
        chance = first.get("recall_chance")
        out.append("reach: tokens back the row's sliding windows reach, n_layers x (window - 1)"
                   " (all: a layer without a window); recall<=reach / recall>reach: mean "
                   "accuracy over the probed distances within / beyond it"
                   + (f"; chance {chance:.4g}" if chance else ""))
    if kv:
        out.append(f"B/tok: KV bytes stored per token, rd 128K: bytes one decode step reads at "
                   f"128K cached tokens, of the run's own config in its cache formats "
                   f"({kv.get('cache_formats', 'as configured')}); B/tok bf16: every vector BF16")
    if full:
        out.append(f"full B/tok, full rd 128K: the same at full size "
                   f"({full.get('cache_formats', 'its formats')})")
    out += _length_notes(rows)
    if first.get("recall_chance") and "reach" in first:
        out.append("at chance: a row's mean within the 95% range of a guesser's recall over "
                   "its probes (binomial; without a probe count, a seed interval holding "
                   "chance). Every row and seed answers the same probes, so a guess (e.g. one "
                   "value for every far fact) scores that value's share of them: seeds that "
                   "guess alike score alike (a zero-width interval)")
    out += [f"not shown: {WHY_EMPTY[h]}" for h in left_out if h in WHY_EMPTY
            and not (h == "recall>reach" and "reach" in left_out)]
    return out


def _times(rows: dict) -> list[int]:
    """The multiples of the training length the runs were evaluated at."""
    return sorted({int(m) for rs in rows.values() for r in rs for m in r.get("beyond") or {}})


def _length_notes(rows: dict) -> list[str]:
    """A line per multiple M saying what was evaluated (measure's recorded lengths): recall
    on rows of M x the probe length (multi-query recall: the 1x rows after earlier tokens,
    or in results measured before, probes of their own; byte recall: new probes with the
    facts M times farther back), held-out loss on windows
    of M x each row's train.seq_len; and a line per row whose xM recall rows are not longer
    than its own training rows (its xM recall is not past its training length)."""
    out, flags = [], {}
    for t in _times(rows):
        runs = [(name, r, r["beyond"][str(t)]) for name, rs in rows.items() for r in rs
                if str(t) in (r.get("beyond") or {})]
        if any("recall_seq_len" not in b for _, _, b in runs):
            continue  # saved before the lengths were recorded, no sweep to fill them in
        n = runs[0][2]["recall_seq_len"]
        r0 = runs[0][1]
        earlier = n - r0.get("probe_len", n // t)
        if all(b.get("same_probes_as_1x") for _, _, b in runs):
            what = (f"the 1x probe rows after {earlier} earlier tokens (the same facts and "
                    f"distances)")
        elif set(runs[0][2]["recall"]) == set(r0.get("recall") or {}):
            what = (f"probes after {earlier} earlier tokens with the facts at the 1x "
                    f"distances, each length its own draw (measured before xM rows were the "
                    f"1x rows)")
        else:
            what = f"new probes with the facts {t}x farther back"
        lens = {name: b["loss_seq_len"] for name, _, b in runs}
        loss = (f"{next(iter(lens.values()))} tokens" if len(set(lens.values())) == 1 else
                ", ".join(f"{name} {v}" for name, v in lens.items()) + " tokens")
        out.append(f"x{t}: recall on {n}-token rows: {what}; loss x{t}: held-out loss over "
                   f"windows of {t} x each row's train.seq_len ({loss})")
        for name, r, b in runs:
            trained = r.get("train_seq_len")
            if trained is not None and b["recall_seq_len"] <= trained:
                flags.setdefault(name, {})[t] = (b["recall_seq_len"], trained)
    for name, at in flags.items():
        out.append(f"{name}: " + "; ".join(
            f"x{t} recall rows ({n} tokens) are not past its training length ({trained})"
            for t, (n, trained) in at.items()))
    return out


# How a row's recall beyond its reach reads against chance (`_versus_chance`), in the order
# the reading lists them
CHANCE_CLASSES = ("at chance", "within the seed spread of chance", "seeds spread across chance",
                  "above chance", "below chance")


def _guess_range(r: dict, t: int | None) -> tuple[float, float, int] | None:
    """(lo, hi, n): the 95% range of a guesser's recall (binomial at the chance level) over
    the run's probes beyond its reach at multiple `t` (None: 1x); None without the counts."""
    from scipy import stats

    chance, per, reach = r.get("recall_chance"), r.get("per_distance"), r.get("reach")
    acc = r.get("recall") if t is None else (r.get("beyond") or {}).get(str(t), {}).get("recall")
    if not chance or not per or not acc or reach is None:  # None: no distance beyond it
        return None
    n = per * sum(1 for d in acc if int(d) > reach)
    if not n:
        return None
    lo, hi = stats.binom.interval(0.95, n, chance)
    return float(lo) / n, float(hi) / n, n


def _versus_chance(m: dict, guess, chance: float) -> str | None:
    """A row's recall beyond its reach (a seedstats summary) against chance: at chance when
    its mean is within a guesser's range (`guess`), above/below when both that range and the
    seed interval exclude chance, else its seeds spread across it; without a guesser's
    range, the seed interval alone (None with one seed)."""
    mean, lo, hi = m["mean"], m["lo"], m["hi"]
    has_interval = not math.isnan(lo)
    if guess is None:
        if not has_interval:
            return None
        return ("within the seed spread of chance" if lo <= chance <= hi else
                "above chance" if lo > chance else "below chance")
    if guess[0] <= mean <= guess[1]:
        return "at chance"
    if mean > guess[1] and (not has_interval or lo > chance):
        return "above chance"
    if mean < guess[0] and (not has_interval or hi < chance):
        return "below chance"
    return "seeds spread across chance"


def _listed(groups: dict, order, n_rows: int, first_note: str = "") -> str:
    """'label (note): a, b; label: c' in `order`, 'every row' for a group of all rows."""
    parts = []
    for label in order:
        names = groups.get(label)
        if names:
            note = first_note if not parts else ""
            parts.append(f"{label}{note}: " + ("every row" if len(names) == n_rows
                                                else ", ".join(names)))
    return "; ".join(parts)


def reading(rows: dict, summaries: dict) -> list[str]:
    """What the rows show, in sentences computed from the results: at each length, which
    rows are at chance beyond their reach and which above it (`_versus_chance`), and at a
    longer length which score there what they score at 1x on every seed; then each row
    against each control on recall beyond the pair's shorter reach, or without a control,
    on loss against the row of lowest mean loss (Welch's 95% interval over seeds)."""
    out = []
    first = next(iter(rows.values()))[0]
    chance = first.get("recall_chance")
    known = all("reach" in rs[0] for rs in rows.values())
    if chance and known:
        for t in (None, *_times(rows)):
            key = "recall_beyond" if t is None else f"recall_x{t}_beyond"
            groups, ranges = {}, set()
            for name, rs in rows.items():
                m = summaries[name].get(key)
                if not m or not m["n"]:
                    continue
                guess = _guess_range(rs[0], t)
                ranges.add(guess)
                label = _versus_chance(m, guess, chance)
                if label is not None:
                    groups.setdefault(label, []).append(name)
            if not groups:
                continue
            if t is None:
                (guess,) = ranges if len(ranges) == 1 else (None,)
                note = (f" ({chance:.4g}; a guesser's 95% range over {guess[2]} probes "
                        f"{guess[0]:.3f}-{guess[1]:.3f})" if guess else
                        f" ({chance:.4g}; a guesser's 95% range over each row's probes)"
                        if any(ranges) else f" ({chance:.4g})")
                out.append(f"Beyond each row's reach: "
                           f"{_listed(groups, CHANCE_CLASSES, len(rows), note)}.")
            else:
                same = [name for name, rs in rows.items() if _same_as_1x(rs, t)]
                out.append(f"At x{t}, beyond the reach: "
                           f"{_listed(groups, CHANCE_CLASSES, len(rows))}"
                           + (f"; the same as at 1x on every seed: {', '.join(same)}"
                              if same else "") + ".")
    out += _against_controls(rows, summaries)
    return out


def _same_as_1x(rs: list[dict], t: int) -> bool:
    """Every seed's recall beyond its reach at multiple t equals its 1x value."""
    pairs = [(_split(r, "recall").get("beyond"),
              _split(r, "", ((r.get("beyond") or {}).get(str(t)) or {}).get("recall")).get(
                  "beyond")) for r in rs]
    return bool(pairs) and all(a is not None and b is not None and abs(a - b) < 1e-9
                               for a, b in pairs)


VERDICTS = ("within the seed spread", "above it", "below it", "one seed: spread unknown")


def _verdict(d: dict) -> str:
    if d["exceeds"] is None:
        return VERDICTS[3]
    return VERDICTS[0] if not d["exceeds"] else VERDICTS[1] if d["diff"] > 0 else VERDICTS[2]


def _against_controls(rows: dict, summaries: dict) -> list[str]:
    """A sentence per control row: every other row's recall beyond the pair's shorter
    reach against it; without controls, every row's loss against the lowest mean loss."""
    controls = [name for name, rs in rows.items() if rs[0].get("control")]
    others = [name for name in rows if name not in controls]
    out = []
    known = all("reach" in rs[0] for rs in rows.values())
    for c in controls if known else ():
        groups = {}
        for name in others:
            at = reach_lib.shorter(rows[c][0]["reach"], rows[name][0]["reach"])
            d = _difference(rows[name], rows[c], "beyond", at)
            if d is not None:
                groups.setdefault(_verdict(d), []).append(name)
        if groups:
            out.append(f"Against the control {c}, recall beyond the pair's shorter reach "
                       f"(Welch's 95% interval over seeds): "
                       f"{_listed(groups, VERDICTS, len(others))}.")
    if not controls and len(rows) > 1:
        best = min(rows, key=lambda n: summaries[n]["val_loss"]["mean"])
        groups = {}
        for name in rows:
            if name != best:
                groups.setdefault(_verdict(_difference(rows[name], rows[best], "val_loss")),
                                  []).append(name)
        out.append(f"Loss against the lowest mean loss ({best}; Welch's 95% interval over "
                   f"seeds): {_listed(groups, VERDICTS, len(rows) - 1)}.")
    return out


def _difference(a: list[dict], b: list[dict], key: str, at: int | None = None) -> dict | None:
    """One metric of two rows over their seeds (seedstats.difference): the loss, or recall
    `key` ("within" / "beyond") split at distance `at`; None where a run lacks it."""
    if key == "val_loss":
        return seedstats.difference([r["val_loss"] for r in a], [r["val_loss"] for r in b])
    va = [_split(r, "recall", at=at).get(key) for r in a]
    vb = [_split(r, "recall", at=at).get(key) for r in b]
    if None in va or None in vb:
        return None
    return seedstats.difference(va, vb, (-1.0, 1.0))


def _compare(a: list[dict], b: list[dict], key: str, label: str, fmt: str,
             at: int | None = None) -> str | None:
    """One metric of two rows: difference of means [Welch 95% interval] and its verdict."""
    d = _difference(a, b, key, at)
    if d is None:
        return None
    verdict = {None: "one seed: spread unknown", True: "exceeds the seed spread",
               False: "within the seed spread"}[d["exceeds"]]
    shown = (format(d["diff"], fmt) if np.isnan(d["lo"]) else
             f"{format(d['diff'], fmt)} [{format(d['lo'], fmt)}, {format(d['hi'], fmt)}]")
    return f"{label} {shown} ({verdict})"


MAX_PAIRS_ROWS = 8  # up to this many rows every pair is compared, beyond it each vs the best


def comparisons(rows: dict, summaries: dict) -> list[str]:
    """Row against row: loss, and recall within and beyond the pair's shorter window reach
    (the distances where at least one of them depends on compression), as the difference of
    means with Welch's 95% interval and whether it exceeds the seed spread."""
    names = list(rows)
    if len(names) < 2:
        return []
    if len(names) <= MAX_PAIRS_ROWS:
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
        what = "every pair of rows"
    else:
        best = min(names, key=lambda n: summaries[n]["val_loss"]["mean"])
        pairs = [(n, best) for n in names if n != best]
        what = f"each row against the lowest mean loss ({best})"
    known = all("reach" in rs[0] for rs in rows.values())
    out = ["", f"{what}: first minus second, mean difference [Welch's 95% interval over seeds]; "
               + ("recall split at the pair's shorter reach R: d<=R within it, d>R beyond"
                  if known else "recall over every probed distance")]
    for a, b in pairs:
        ra, rb = rows[a], rows[b]
        parts = [_compare(ra, rb, "val_loss", "loss", "+.4f")]
        if known:
            at = reach_lib.shorter(ra[0]["reach"], rb[0]["reach"])
            parts += [_compare(ra, rb, "within", "recall all d" if at is None
                               else f"recall d<={at}", "+.3f", at),
                      _compare(ra, rb, "beyond", f"recall d>{at}", "+.3f", at)]
        else:
            parts.append(_compare_mean(ra, rb))
        out.append(f"  {a} vs {b}: " + "; ".join(p for p in parts if p))
    return out


def _compare_mean(a: list[dict], b: list[dict]) -> str:
    d = seedstats.difference([_metrics(r)["recall_mean"] for r in a],
                             [_metrics(r)["recall_mean"] for r in b])
    verdict = {None: "one seed: spread unknown", True: "exceeds the seed spread",
               False: "within the seed spread"}[d["exceeds"]]
    return f"recall (all d) {d['diff']:+.3f} ({verdict})"


def table(results: list[dict]) -> str:
    """The printed report: per row its seeds, loss, reach and recall within and beyond it
    (mean [95% interval] over seeds), the same past the training length, KV bytes
    (own config: deployed formats and BF16; full size), params, tokens/s, decode ms; under
    it what the rows show in a few sentences (`reading`); a line per unit, per length
    evaluated and per column left out; then rows compared (`comparisons`)."""
    rows, summaries = by_row(results), row_summaries(results)
    lines = []
    if rows:
        cols = _columns(rows, summaries)
        left_out = [h for h, cells in cols if all(c is None for c in cells)]
        cols = [(h, cells) for h, cells in cols if h not in left_out]
        said = reading(rows, summaries)
        lines = (_format(cols) + [""] + said + ([""] if said else []) + _notes(rows, left_out)
                 + comparisons(rows, summaries))
    for r in results:
        if "error" in r:
            lines.append(f"{r['row']} seed {r['seed']}: FAILED: {r['error']}")
    return "\n".join(lines)
