"""Uncertainty over seeds (dsattn.seedstats) against hand-computed Student t and Welch
intervals."""

import math

import pytest

from dsattn import seedstats


def test_summary_is_the_student_t_interval():
    s = seedstats.summary([1.0, 2.0, 3.0])
    half = 4.302652729749462 / math.sqrt(3)  # t(0.975, 2 dof) * s / sqrt(n), s = 1
    assert s["n"] == 3 and s["mean"] == 2.0 and s["std"] == pytest.approx(1.0)
    assert (s["lo"], s["hi"]) == pytest.approx((2 - half, 2 + half), rel=1e-9)


def test_one_seed_has_no_interval_and_missing_values_are_skipped():
    s = seedstats.summary([0.5, None])
    assert s["n"] == 1 and s["mean"] == 0.5 and math.isnan(s["lo"]) and math.isnan(s["std"])
    assert seedstats.summary([])["n"] == 0


def test_welch_difference():
    # va = vb = 1/3, se = sqrt(2/3), Welch dof = 4, t(0.975, 4) = 2.7764451051977987
    d = seedstats.difference([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    half = 2.7764451051977987 * math.sqrt(2 / 3)
    assert d["diff"] == -3.0 and (d["lo"], d["hi"]) == pytest.approx((-3 - half, -3 + half))
    assert d["exceeds"] is True
    assert seedstats.difference([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])["exceeds"] is False
    assert seedstats.difference([1.0], [2.0, 3.0])["exceeds"] is None


def test_rows_whose_interval_reaches_the_front():
    def pt(x, mean, half):
        return {"x": x, "y": {"mean": mean, "lo": mean - half, "hi": mean + half}}

    points = [pt(10, 2.0, 0.1), pt(20, 1.0, 0.1), pt(30, 2.05, 0.1), pt(30, 3.0, 0.1),
              pt(5, 2.5, 0.1)]
    front = [4, 0, 1]  # (5, 2.5), (10, 2.0), (20, 1.0)
    # row 2 (2.05 +- 0.1) reaches row 0's interval (<= 2.1) at larger x; row 3 does not
    assert seedstats.overlaps_front(points, front) == [2]
