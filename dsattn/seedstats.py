"""Uncertainty over seeds: a sweep row's metric as mean, standard deviation and a 95%
interval, and whether two rows differ by more than their seeds spread.

The interval is Student's t over the row's seeds (mean ± t₀.₉₇₅,ₙ₋₁ · s/√n, s with n - 1
degrees of freedom), the honest interval for a handful of seeds. Two rows differ beyond
their seed spread when Welch's 95% interval for the difference of their means excludes 0.
One seed gives a mean and no interval (NaN): nothing can be said about its spread; two give
t with 1 degree of freedom, an interval too wide to tell rows apart (`few_seeds` says so).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

LEVEL = 0.95
ENOUGH_SEEDS = 3  # fewer: intervals that say little (two) or none (one)


def few_seeds(n: int) -> str | None:
    """What intervals over `n` seeds mean when n is below ENOUGH_SEEDS; None from it on."""
    if n >= ENOUGH_SEEDS:
        return None
    if n < 2:
        return "no intervals, so no difference between rows can be told from seed noise"
    t1, t2 = (float(stats.t.ppf(0.5 + LEVEL / 2, dof)) for dof in (1, 2))
    return (f"their {LEVEL:.0%} intervals are Student's t with 1 degree of freedom, the mean "
            f"+-{t1:.1f} x s/sqrt(2) = +-{t1 / math.sqrt(2):.1f} standard deviations of the "
            f"seeds: too wide to tell rows apart; 3 seeds give +-{t2 / math.sqrt(3):.1f}")


def summary(values, within: tuple[float, float] = (-math.inf, math.inf)) -> dict:
    """{n, mean, std, lo, hi} of a metric's values over seeds (NaN where undefined), the
    interval clipped to the range the metric can take (`within`: a loss >= 0, a recall in
    [0, 1]): t's symmetric interval spills past a bound with few seeds."""
    v = np.asarray([x for x in values if x is not None], float)
    n = len(v)
    if n == 0:
        return {"n": 0, "mean": math.nan, "std": math.nan, "lo": math.nan, "hi": math.nan}
    mean = float(v.mean())
    if n == 1:
        return {"n": 1, "mean": mean, "std": math.nan, "lo": math.nan, "hi": math.nan}
    std = float(v.std(ddof=1))
    half = float(stats.t.ppf(0.5 + LEVEL / 2, n - 1)) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "lo": max(mean - half, within[0]),
            "hi": min(mean + half, within[1])}


def difference(a, b, within: tuple[float, float] = (-math.inf, math.inf)) -> dict:
    """Welch's interval for mean(a) - mean(b): {diff, lo, hi, exceeds} where `exceeds` says
    the interval excludes 0 (None with fewer than two seeds on either side); the interval
    clipped to the range a difference can take (`within`: [-1, 1] for recalls)."""
    a, b = (np.asarray([x for x in v if x is not None], float) for v in (a, b))
    diff = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return {"diff": diff, "lo": math.nan, "hi": math.nan, "exceeds": None}
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:  # identical seeds on both sides: any difference is exact
        return {"diff": diff, "lo": diff, "hi": diff, "exceeds": diff != 0}
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + LEVEL / 2, dof)) * se
    return {"diff": diff, "lo": max(diff - half, within[0]), "hi": min(diff + half, within[1]),
            "exceeds": bool(diff - half > 0 or diff + half < 0)}


def overlaps_front(points: list[dict], front: list[int]) -> list[int]:
    """Rows off the Pareto front (lower x and lower y are better; y a `summary`) whose y
    interval reaches the interval of a front row at no larger x: within seed noise of it."""
    out = []
    for i, p in enumerate(points):
        if i in front or math.isnan(p["y"]["lo"]):
            continue
        if any(points[j]["x"] <= p["x"] and p["y"]["lo"] <= points[j]["y"]["hi"]
               for j in front if not math.isnan(points[j]["y"]["hi"])):
            out.append(i)
    return out
