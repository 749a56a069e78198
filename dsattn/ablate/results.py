"""A sweep's results: one line per run (results.csv/json), per-row statistics over seeds
(summary.csv, dsattn.seedstats) and the printed table."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np

from dsattn import runlog, seedstats


def write_json(path: Path, obj) -> None:
    runlog.atomic_write(path, json.dumps(obj, indent=1))


def flat(result: dict) -> dict:
    """One CSV row: scalars, recall accuracy per distance, kv figures (full_* at full size)."""
    out = {k: result.get(k) for k in ("row", "seed", "steps", "val_loss", "params",
                                      "train_tokens_per_s", "decode_context", "decode_ms",
                                      "wall_s")}
    out.update({f"recall_d{d}": a for d, a in result.get("recall", {}).items()})
    out.update({f"recall_cache_d{d}": a for d, a in result.get("recall_cache", {}).items()})
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
    if "recall_cache" in result:
        cached = result["recall_cache"]
        out["recall_cache_mean"] = float(np.mean(list(cached.values())))
        out.update({f"recall_cache_d{d}": a for d, a in cached.items()})
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
    for name, rs in by_row(results).items():
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
    write_json(out / "results.json", {"sweep": sweep_name, "runs": results, "rows": {
        name: {k: {st: None if isinstance(v, float) and np.isnan(v) else v
                   for st, v in m.items()} for k, m in ms.items()}
        for name, ms in summaries.items()}})
    _write_csv(out / "results.csv", [flat(r) for r in results])
    _write_csv(out / "summary.csv", [
        {"row": name, "seeds": next(iter(m.values()))["n"],
         **{f"{k}_{stat}": v[stat] for k, v in m.items() for stat in ("mean", "std", "lo", "hi")}}
        for name, m in summaries.items()])


def by_row(results):
    rows = {}
    for r in results:
        if "error" not in r:
            rows.setdefault(r["row"], []).append(r)
    return rows


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
    rows, summaries = by_row(results), row_summaries(results)
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
