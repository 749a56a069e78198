"""A sweep's plots: held-out loss against KV bytes with the Pareto front, recall by
distance and loss curves; means over seeds with their 95% intervals."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dsattn import recall, seedstats
from dsattn.ablate.results import by_row, row_summaries


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (lower is better),
    ordered by x."""
    front = [i for i, (x, y) in enumerate(points)
             if not any(x2 <= x and y2 <= y and (x2, y2) != (x, y) for x2, y2 in points)]
    return sorted(front, key=lambda i: points[i])


def front_of(points: list[dict], controls: list[bool]) -> tuple[list[int], list[int]]:
    """(front, near) over `points` ({"x", "y": a seedstats summary}): the Pareto front of the
    means and the points whose interval reaches it (seedstats.overlaps_front), both among
    the rows that are not controls: a control is a reference, not a design to choose."""
    rows = [i for i, control in enumerate(controls) if not control]
    front = [rows[j] for j in pareto([(points[i]["x"], points[i]["y"]["mean"]) for i in rows])]
    near = seedstats.overlaps_front([points[i] for i in rows],
                                    [rows.index(i) for i in front])
    return front, [rows[j] for j in near]


def _band(ax, xs, runs: np.ndarray, colour, label: str) -> None:
    """The mean over seeds (rows of `runs`) as a line, its 95% interval as a band."""
    st = [seedstats.summary(col) for col in runs.T]
    ax.plot(xs, [x["mean"] for x in st], "o-" if len(xs) < 20 else "-", color=colour,
            label=label)
    if runs.shape[0] > 1:
        ax.fill_between(xs, [x["lo"] for x in st], [x["hi"] for x in st], color=colour,
                        alpha=0.2)


def plots(out, results: list[dict]) -> list[Path]:
    """pareto.png (loss, and recall beyond the window's reach, against KV bytes per token;
    window-only rows at 0), recall.png (by distance, each row's window reach marked),
    curves.png: one colour per row, the mean over seeds and its 95% interval (seedstats;
    none with one seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, rows = Path(out), by_row(results)
    if not rows:
        return []
    colours = plt.get_cmap("tab20" if len(rows) > 10 else "tab10")
    col = {name: colours(i % colours.N) for i, name in enumerate(rows)}
    summaries = row_summaries(results)
    paths = []

    unit = next(iter(rows.values()))[0].get("loss_unit", "nats per token")
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(13, 5.5))
    xs = {name: rs[0]["kv"]["storage_bytes_per_token"] for name, rs in rows.items()}
    pts = []
    for name, rs in rows.items():
        y = summaries[name]["val_loss"]
        pts.append({"x": xs[name], "y": y})
        err = None if np.isnan(y["lo"]) else [[y["mean"] - y["lo"]], [y["hi"] - y["mean"]]]
        # a window-only stack stores nothing per token: drawn at 0 on the linear stretch
        label = name + (" (control)" if rs[0].get("control") else "") + (
            " (0 B/token: window ring only)" if xs[name] <= 0 else "")
        ax.errorbar(xs[name], y["mean"], yerr=err, fmt="o", color=col[name], capsize=3,
                    label=label)
        b = summaries[name].get("recall_beyond")
        if b and b["n"]:
            err = None if np.isnan(b["lo"]) else [[b["mean"] - b["lo"]], [b["hi"] - b["mean"]]]
            ax_r.errorbar(xs[name], b["mean"], yerr=err, fmt="o", color=col[name], capsize=3,
                          label=label)
    front, near = front_of(pts, [bool(rs[0].get("control")) for rs in rows.values()])
    ax.plot([pts[i]["x"] for i in front], [pts[i]["y"]["mean"] for i in front], "k--", lw=1,
            label="Pareto front (means; controls off it)")
    ax.scatter([pts[i]["x"] for i in front], [pts[i]["y"]["mean"] for i in front], s=160,
               facecolors="none", edgecolors="k")
    if near:
        ax.scatter([pts[i]["x"] for i in near], [pts[i]["y"]["mean"] for i in near], s=160,
                   facecolors="none", edgecolors="grey", linestyles="dotted",
                   label="interval reaches the front")
    positive = [x for x in xs.values() if x > 0]
    for a in (ax, ax_r):
        if positive and len(positive) < len(xs):  # 0 has no place on a log axis
            a.set_xscale("symlog", linthresh=min(positive))
        elif positive:
            a.set_xscale("log")
        a.set_xlabel("KV storage per token (bytes, log scale; run's own config and formats)")
        if a.get_legend_handles_labels()[0]:  # no recall beyond any reach: nothing to label
            a.legend(fontsize=7, ncol=2)
    ax.set_ylabel(f"held-out loss ({unit})")
    ax.set_title("held-out loss vs KV bytes per token\n(mean, bars: 95% interval over seeds)")
    ax_r.axhline(results[0].get("recall_chance", recall.CHANCE), color="grey", ls=":")
    ax_r.set_ylabel("recall beyond the row's window reach (mean over those distances)")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.set_title("recall beyond the window's reach vs KV bytes per token\n"
                   "(mean, bars: 95% interval over seeds; dotted: chance)")
    paths.append(_save(fig, out / "pareto.png"))

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, rs in rows.items():
        ds = sorted(int(d) for d in rs[0]["recall"])
        _band(ax, ds, np.array([[r["recall"][str(d)] for d in ds] for r in rs]), col[name],
              name)
    ax.axhline(results[0].get("recall_chance", recall.CHANCE), color="grey", ls=":",
               label="chance")
    reaches: dict = {}
    for name, rs in rows.items():
        if rs[0].get("reach") is not None:
            reaches.setdefault(rs[0]["reach"], []).append(name)
    top = max((int(d) for rs in rows.values() for d in rs[0]["recall"]), default=0)
    for at, names in reaches.items():
        if at < top:  # a reach past the farthest probe has nothing beyond it to mark
            ax.axvline(at + 0.5, color=col[names[0]] if len(names) == 1 else "k", ls="--",
                       lw=1, label=f"window reach {at} ({', '.join(names)}): beyond it, "
                                   f"only compression recalls")
    ax.set_xlabel("fact-to-query distance (tokens)")
    ax.set_ylabel("recall accuracy on answers (fraction)")
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
    ax.set_ylabel(f"held-out loss ({unit})")
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
