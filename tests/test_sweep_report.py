"""A sweep report's intervals stay in their metric's range, and every column comparing rows
has one (dsattn.ablate.results, dsattn.seedstats)."""

import importlib
import math

import numpy as np
from scipy import stats

from dsattn import seedstats
from dsattn.ablate import results


def t_half(values):
    v = np.asarray(values, float)
    return stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))


def test_intervals_are_clipped_to_the_metrics_range():
    recall = [1.0, 1.0, 0.55]  # mean 0.85: t's upper bound would pass 1
    s = seedstats.summary(recall, (0.0, 1.0))
    assert np.mean(recall) + t_half(recall) > 1
    assert s["hi"] == 1.0 and s["lo"] == np.mean(recall) - t_half(recall)
    loss = [0.05, 0.1, 1.2]
    s = seedstats.summary(loss, (0.0, math.inf))
    assert np.mean(loss) - t_half(loss) < 0 and s["lo"] == 0.0
    d = seedstats.difference([1.0, 1.0, 0.2], [0.0, 0.0, 0.9], (-1.0, 1.0))
    assert -1.0 <= d["lo"] and d["hi"] <= 1.0


def run(row, seed, loss, recall, loss_x2, recall_x2):
    """A finished run's result as dsattn.ablate saves it: recall at d=4 (within a reach of
    8) and d=40 (beyond), and again at twice the training length."""
    return {"row": row, "seed": seed, "val_loss": loss, "params": 1000, "reach": 8,
            "train_tokens_per_s": 100.0, "decode_ms": None,
            "recall": {"4": 1.0, "40": recall},
            "beyond": {"2": {"val_loss": loss_x2, "recall": {"4": 1.0, "40": recall_x2}}}}


def test_every_row_comparing_column_has_a_clipped_interval():
    rs = [run("a", s, lo, r, lx, rx) for s, (lo, r, lx, rx) in enumerate(
        [(0.05, 1.0, 0.04, 1.0), (0.1, 1.0, 0.1, 1.0), (1.2, 0.55, 1.5, 0.5)])]
    rs += [run("b", s, 2.0 + s, 0.1 * s, 2.5, 0.1) for s in range(3)]
    summaries = results.row_summaries(rs)
    a = summaries["a"]
    for key in ("val_loss", "val_loss_x2"):
        assert a[key]["lo"] == 0.0 and a[key]["hi"] > a[key]["mean"]
    for key in ("recall_beyond", "recall_x2_beyond"):
        assert a[key]["hi"] == 1.0 and 0 <= a[key]["lo"] < a[key]["mean"]
    b = summaries["b"]["recall_x2_beyond"]
    assert (b["lo"], b["hi"]) == (b["mean"], b["mean"]) == (0.1, 0.1) or \
        abs(b["hi"] - b["lo"]) < 1e-12
    # the printed table shows the x2 columns' intervals, as computed
    table = results.table(rs)
    for key in ("val_loss_x2", "recall_x2_beyond"):
        m = a[key]
        assert f"{m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]" in table, key


def point(x, mean, lo, hi):
    return {"x": x, "y": {"n": 3, "mean": mean, "lo": lo, "hi": hi}}


def test_controls_stay_off_the_pareto_front():
    plots = importlib.import_module("dsattn.ablate.plots")  # the package's `plots` is a function
    # a 0-byte control with the lowest loss would be the front's only point
    pts = [point(0, 0.1, 0.05, 0.15), point(100, 1.0, 0.9, 1.1), point(200, 0.8, 0.7, 0.9),
           point(300, 0.9, 0.85, 0.95)]
    assert plots.front_of(pts, [False] * 4)[0] == [0]
    front, near = plots.front_of(pts, [True, False, False, False])
    assert front == [1, 2] and 0 not in near and near == [3]


def test_a_control_row_is_parsed_kept_and_labelled():
    from dsattn import ablate
    sweep = ablate.from_dict(yaml_sweep(), out="/tmp/unused")
    assert [r.control for r in sweep.rows] == [True, False]
    rs = [dict(run("full", s, 1.0 + s / 10, 1.0, 1.0, 1.0), control=True) for s in range(2)]
    rs += [run("csa", s, 1.2 + s / 10, 0.5, 1.3, 0.5) for s in range(2)]
    rows = [line.split()[:2] for line in results.table(rs).splitlines()[2:4]]
    assert rows == [["full", "(control)"], ["csa", "2"]]


def yaml_sweep():
    return {"base": "configs/tiny/v4.yaml", "overrides": ["model.n_layers=2"],
            "rows": [{"name": "full", "control": True, "overrides": ["attention.layers=swa"]},
                     {"name": "csa", "overrides": ["attention.layers=swa, csa"]}],
            "seeds": [0, 1, 2]}


def test_rows_and_seeds_are_picked_from_the_command_line():
    import pytest

    from dsattn import ablate
    from dsattn.errors import ConfigError
    sweep = ablate.from_dict(yaml_sweep(), out="/tmp/unused")
    picked = ablate.select(sweep, ["csa"], [2, 0])
    assert [r.name for r in picked.rows] == ["csa"] and picked.seeds == (0, 2)
    assert ablate.select(sweep).rows == sweep.rows
    with pytest.raises(ConfigError, match="did you mean csa"):
        ablate.select(sweep, ["cs"])
    with pytest.raises(ConfigError, match="0, 1, 2"):
        ablate.select(sweep, None, [5])


def test_the_recall_warmup_has_its_own_key_and_the_old_spelling_reads_the_same():
    import pytest

    from dsattn import ablate
    from dsattn.errors import ConfigError
    source = ("data.source=recall:format=mqar,joint=1,block=64,pairs=8,keys=8,values=16,"
              "min_dist=2,max_dist=62,length=1000000")
    raw = {**yaml_sweep(), "overrides": ["model.n_layers=2", "train.seq_len=64",
                                        "train.steps=1000", source]}
    new = ablate.from_dict({**raw, "recall_warmup": {"steps": 200, "dist": 8}}, out="/tmp/u")
    old_spelling = [*raw["overrides"][:-1], source + ",warm_steps=200,warm_dist=8"]
    old = ablate.from_dict({**raw, "overrides": old_spelling}, out="/tmp/u")
    for row in new.rows:
        assert new.config(row, 0) == old.config(row, 0)
        assert ablate.fingerprint(new, row, 0) == ablate.fingerprint(old, row, 0)
    corpus_spec = ablate.spec.recall_spec(new.config(new.rows[0], 0))
    assert (corpus_spec.warm_steps, corpus_spec.warm_dist) == (200, 8)
    with pytest.raises(ConfigError, match="one place"):  # both spellings at once
        ablate.from_dict({**raw, "overrides": [source + ",warm_steps=5"],
                          "recall_warmup": {"steps": 200}}, out="/tmp/u")


def test_two_seeds_say_what_their_interval_means():
    """Two seeds' intervals are Student's t with 1 degree of freedom (mean +- 9.0 s): the
    table says so under it; three seeds' do not need the line."""
    two = [run("a", s, 1.0 + s / 10, 1.0, 1.0, 1.0) for s in range(2)]
    two += [run("b", s, 1.5 + s / 10, 0.5, 1.0, 0.5) for s in range(3)]
    lines = [line for line in results.table(two).splitlines() if "1 degree of freedom" in line]
    assert len(lines) == 1 and lines[0].startswith("2 seeds (a):") and "9.0" in lines[0], lines
    assert "3 seeds give +-2.5" in lines[0]
    three = [run("a", s, 1.0 + s / 10, 1.0, 1.0, 1.0) for s in range(3)]
    assert "degree of freedom" not in results.table(three)


def test_a_sweep_of_fewer_than_three_seeds_warns_at_its_start(tmp_path, monkeypatch):
    import pytest

    from dsattn import ablate
    monkeypatch.setattr(ablate, "_run", lambda *a: [])  # the start alone, nothing trained
    for seeds, needle in (([0, 1], "2 seeds: their 95% intervals are Student's t with 1 "
                                   "degree of freedom"),
                          ([0], "1 seed: no intervals")):
        sweep = ablate.from_dict({**yaml_sweep(), "seeds": seeds}, out=str(tmp_path / "s"))
        with pytest.warns(UserWarning, match=needle):
            ablate.run(sweep, quiet=True)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ablate.run(ablate.from_dict(yaml_sweep(), out=str(tmp_path / "s")), quiet=True)


def _kv(storage, full_window=None):
    kv = {"storage_bytes_per_token": storage, "storage_bf16_bytes_per_token": storage}
    return {**kv, "full_window_bytes_per_token": full_window} if full_window else kv


def test_pareto_axes_labels_legend_and_an_empty_recall_panel_say_what_they_show():
    """pareto.png read without its pixels: a 0-byte row alone is on a symlog axis that starts
    at 0 (it was a linear -0.04..0.04 labelled log), the legend sits below the panels off
    every axes, an empty recall panel says why, and a full-attention control (a window the
    whole sequence) stands at its ring bytes per token, not at 0 as window-ring-only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = importlib.import_module("dsattn.ablate.plots")
    window = [dict(run("window", s, 2.0 + s / 10, 0.1, 2.0, 0.1), kv=_kv(0.0),
                   recall={"4": 1.0}, control=True) for s in range(3)]
    fig = plots.pareto_figure(window)
    ax, ax_r = fig.axes[:2]
    for a in (ax, ax_r):
        assert a.get_xscale() == "symlog" and a.get_xlim()[0] >= -1 and a.get_xlim()[1] > 1
        assert "0 B" in a.get_xlabel() and a.get_legend() is None
    why = " ".join(t.get_text() for t in ax_r.texts)
    assert "within" in why and "reach 8" in why, why  # every probed distance is within it
    plt.close(fig)
    full = [dict(run("full", s, 1.0 + s / 10, 1.0, 1.0, 1.0), kv=_kv(0.0, 512.0),
                 control=True) for s in range(3)]
    csa = [dict(run("csa", s, 1.2 + s / 10, 0.5, 1.0, 0.5), kv=_kv(96.0)) for s in range(3)]
    fig = plots.pareto_figure(window + full + csa)
    ax, ax_r = fig.axes[:2]
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert "full (control) (full attention at its length: window ring bytes per token)" in labels
    assert "window (control) (0 B/token: window ring only)" in labels
    points = {c.get_label(): c.lines[0].get_xydata()[0, 0] for c in ax.containers}
    assert points[next(lab for lab in labels if lab.startswith("full"))] == 512.0
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    for a in (ax, ax_r):
        assert not box.overlaps(a.get_tightbbox(renderer)), "the legend covers a panel"
    assert not ax_r.texts  # recall beyond the reach to show: no note
    plt.close(fig)
