"""The serving benchmark's equal-memory sizing (dsattn.bench.serving.fit): every preset gets
the largest pool that fits MHA's cache bytes, checked against byte counts of real caches."""

import jax
import numpy as np

from dsattn import generate
from dsattn.bench import serving
from dsattn.serve.pool import with_pool
from tests.helpers import tiny_model
from tests.test_serve_isolation import FAST, SMALL_PAGES

MAX_LEN = 64


def test_v4_gets_the_largest_pool_within_a_budget():
    mha = generate.Engine(tiny_model("mha"))
    # the isolation tests' fast model (one build per process)
    v4 = generate.Engine(tiny_model("v4", SMALL_PAGES, *FAST["v4"]))
    rows = 8
    made = lambda p: serving.cache_bytes(jax.eval_shape(  # noqa: E731
        lambda: with_pool(v4.cfg, v4.init_cache(rows, MAX_LEN), p)))
    budget = (made(1) + made(rows * MAX_LEN)) // 2  # rings and one page fit, whole pools not
    got_rows, pool = serving.fit(v4, rows, MAX_LEN, budget)
    assert got_rows == rows and pool is not None and made(pool) <= budget
    # the next pool size that adds a page takes more than the budget
    bigger = next(p for p in range(pool + 1, rows * MAX_LEN + 1) if made(p) > made(pool))
    assert made(bigger) > budget
    # MHA has no pools: its rows of max_len are its memory
    mha_bytes = serving.cache_bytes(mha.init_cache(2, MAX_LEN))
    assert serving.fit(mha, 2, MAX_LEN, mha_bytes) == (2, None)
    assert serving.fit(mha, 3, MAX_LEN, mha_bytes)[0] == 2


def test_the_load_arrives_in_order_within_its_lengths():
    load = serving.Load(requests=50, rate=10.0, prompt=(3, 9), output=(2, 5))
    arrivals = serving.stream(load, vocab=256)
    times = np.array([t for t, _ in arrivals])
    assert np.all(np.diff(times) >= 0) and times[0] > 0
    assert all(3 <= len(r.prompt) <= 9 and 2 <= r.max_new_tokens <= 5 for _, r in arrivals)
    # Poisson arrivals at 10/s: the mean gap is 0.1 s (50 gaps: within 4 standard errors)
    assert abs(times[-1] / 50 - 0.1) < 4 * 0.1 / np.sqrt(50)
