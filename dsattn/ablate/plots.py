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


def _colours(rows: dict) -> dict:
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab20" if len(rows) > 10 else "tab10")
    return {name: colours(i % colours.N) for i, name in enumerate(rows)}


def _bytes_per_token(first: dict) -> tuple[float, str]:
    """(x, what it is) of a row on the bytes axis: its global KV bytes per token; a
    window-only stack stores none, unless its window holds the whole training sequence
    (full attention at its length: every token's ring bytes, measure.kv_figures)."""
    kv = first["kv"]
    x = kv["storage_bytes_per_token"]
    if x > 0:
        return x, ""
    if kv.get("full_window_bytes_per_token"):
        return (kv["full_window_bytes_per_token"],
                " (full attention at its length: window ring bytes per token)")
    return x, " (0 B/token: window ring only)"


def _why_no_recall_beyond(rows: dict) -> str:
    """Why no row has recall beyond its window reach (the empty panel's note)."""
    firsts = [rs[0] for rs in rows.values()]
    if not all("reach" in r for r in firsts):
        return "no window reach recorded with these results:\nrecall is not split at it"
    reach = [r["reach"] for r in firsts if r["reach"] is not None]
    top = max((int(d) for r in firsts for d in r.get("recall") or {}), default=None)
    if top is None:
        return "no recall probes in these results"
    return (f"every probed distance (up to {top}) is within\neach row's window reach"
            + (f" (reach {min(reach)} and more)" if reach else " (no window: all of them)")
            + ":\nno recall beyond it to show")


def pareto_figure(results: list[dict]):
    """The figure of pareto.png: held-out loss and recall beyond the window's reach against
    KV bytes per token, one colour per row (means, 95% intervals over seeds), the Pareto
    front of the loss, one legend below both panels. 0 B sits on a linear stretch at the
    left of a symlog axis; an empty recall panel says why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = by_row(results)
    col, summaries = _colours(rows), row_summaries(results)
    unit = next(iter(rows.values()))[0].get("loss_unit", "nats per token")
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(13, 6.5), layout="constrained")
    xs, pts, shown = {}, [], False
    for name, rs in rows.items():
        xs[name], what = _bytes_per_token(rs[0])
        y = summaries[name]["val_loss"]
        pts.append({"x": xs[name], "y": y})
        err = None if np.isnan(y["lo"]) else [[y["mean"] - y["lo"]], [y["hi"] - y["mean"]]]
        label = name + (" (control)" if rs[0].get("control") else "") + what
        ax.errorbar(xs[name], y["mean"], yerr=err, fmt="o", color=col[name], capsize=3,
                    label=label)
        b = summaries[name].get("recall_beyond")
        if b and b["n"]:
            err = None if np.isnan(b["lo"]) else [[b["mean"] - b["lo"]], [b["hi"] - b["mean"]]]
            ax_r.errorbar(xs[name], b["mean"], yerr=err, fmt="o", color=col[name], capsize=3)
            shown = True
    front, near = front_of(pts, [bool(rs[0].get("control")) for rs in rows.values()])
    if front:
        ax.plot([pts[i]["x"] for i in front], [pts[i]["y"]["mean"] for i in front], "k--",
                lw=1, label="Pareto front (means; controls off it)")
        ax.scatter([pts[i]["x"] for i in front], [pts[i]["y"]["mean"] for i in front], s=160,
                   facecolors="none", edgecolors="k")
    if near:
        ax.scatter([pts[i]["x"] for i in near], [pts[i]["y"]["mean"] for i in near], s=160,
                   facecolors="none", edgecolors="grey", linestyles="dotted",
                   label="interval reaches the front")
    positive = [x for x in xs.values() if x > 0]
    for a in (ax, ax_r):
        if len(positive) < len(xs):  # 0 has no place on a log axis: a linear stretch for it
            lin = min(positive, default=1.0)
            a.set_xscale("symlog", linthresh=lin)
            a.set_xlim(-0.5 * lin, 3 * max(positive, default=3 * lin))
            a.set_xlabel(f"KV storage per token (bytes; run's own config and formats)\n"
                         f"log scale above {lin:g} B, linear below it down to 0 B")
        else:
            a.set_xscale("log")
            a.set_xlabel("KV storage per token (bytes, log scale; run's own config and "
                         "formats)")
    ax.set_ylabel(f"held-out loss ({unit})")
    ax.set_title("held-out loss vs KV bytes per token\n(mean, bars: 95% interval over seeds)")
    ax_r.axhline(results[0].get("recall_chance", recall.CHANCE), color="grey", ls=":")
    ax_r.set_ylabel("recall beyond the row's window reach (mean over those distances)")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.set_title("recall beyond the window's reach vs KV bytes per token\n"
                   "(mean, bars: 95% interval over seeds; dotted: chance)")
    if not shown:
        ax_r.text(0.5, 0.5, _why_no_recall_beyond(rows), transform=ax_r.transAxes,
                  ha="center", va="center", fontsize=10, color="dimgrey")
    # below both panels (the same rows in both): never over a point
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(3, len(labels)),
               fontsize=7, frameon=False)
    return fig


def plots(out, results: list[dict]) -> list[Path]:
    """pareto.png (`pareto_figure`), recall.png (by distance, each row's window reach
    marked), curves.png: one colour per row, the mean over seeds and its 95% interval
    (seedstats; none with one seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, rows = Path(out), by_row(results)
    if not rows:
        return []
    col = _colours(rows)
    paths = [_save(pareto_figure(results), out / "pareto.png", layout=False)]
    unit = next(iter(rows.values()))[0].get("loss_unit", "nats per token")

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


def _save(fig, path: Path, layout: bool = True) -> Path:
    if layout:  # (a figure with a layout engine of its own lays itself out)
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
