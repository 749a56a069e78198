"""The serving benchmark's equal-memory sizing (dsattn.bench.serving.fit): every preset gets
the largest pool that fits MHA's cache bytes, checked against byte counts of real caches."""

import jax
import numpy as np
import pytest

from dsattn import generate
from dsattn.bench import serving
from dsattn.serve.pool import with_pool
from dsattn.serve.request import Request
from dsattn.serve.scheduler import Scheduler
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


def test_the_fcfs_floor_queues_requests_by_hand():
    """Rows free up in arrival order; a request's first token comes when it takes a row, its
    row then decodes its other max_new_tokens - 1 steps."""
    req = lambda n: Request((1,), n)  # noqa: E731
    # one row, three requests at 0 s of 3 tokens (2 steps of 0.5 s): first tokens at 0, 1, 2
    assert serving.fcfs_floor([(0.0, req(3))] * 3, rows=1, step_s=0.5) == {
        "floor_ttft_median_s": 1.0, "floor_wall_s": 3.0}
    # two rows: 0 s (5 tokens: busy to 4 s), 0 s (2: to 1 s), 0.5 s (3: takes the second row
    # at 1 s, to 3 s), 6 s (1 token: no step, a free row at once; the wall ends at 6 s)
    got = serving.fcfs_floor([(0.0, req(5)), (0.0, req(2)), (0.5, req(3)), (6.0, req(1))],
                             rows=2, step_s=1.0)
    assert got == {"floor_ttft_median_s": float(np.median([0, 0, 0.5, 0])),
                   "floor_wall_s": 6.0}


def test_a_shared_prefix_is_reused_and_held_once():
    """Two requests with a common prefix, both at once: with the prefix cache on the second
    restores the deepest prefix the first published within what they share (points at
    multiples of the stride and the first prompt's last block boundary, up to the second's
    length - 1), with the same outputs and fewer pages in use than with it off."""
    eng = generate.Engine(tiny_model("v4", SMALL_PAGES, "model.n_layers=1",
                                     "attention.layers=csa"))
    load = serving.Load(requests=2, prompt=(3, 6), output=(2, 4), shared_prefix=32)
    # both submitted before the first step: the same schedule every run
    arrivals = [(0.0, r) for _, r in serving.stream(load, eng.cfg.model.vocab_size)]
    (_, first), (_, second) = arrivals
    scheds = {c: Scheduler(eng, 2, MAX_LEN, max_chunk=16, prefix_cache=c) for c in (True, False)}
    on, off = (serving.serve(scheds[c], arrivals, load.shared_prefix) for c in (True, False))
    # what the second can restore, from the prompts alone
    p, q = first.prompt, second.prompt
    common = next((k for k in range(min(len(p), len(q))) if p[k] != q[k]), min(len(p), len(q)))
    stride, block = 16, 4  # S = lcm(page 4, CSA's 4, chunk 16), >= the window 16
    assert (scheds[True].stride, scheds[True].block) == (stride, block)
    ends = {*range(stride, len(p), stride), (len(p) - 1) // block * block}
    hit = max(e for e in ends if e <= min(common, len(q) - 1))
    assert common >= 32 and hit == 32
    assert on["prefix_hit_tokens"] == hit and on["prefix_prompt_tokens"] == len(p) + len(q)
    assert on["prefix_hit_rate"] == hit / (len(p) + len(q))
    assert off["prefix_hit_tokens"] == 0 and off["prefix_hit_rate"] == 0.0
    assert on["outputs"] == off["outputs"] and sorted(on["outputs"]) == [0, 1]
    for m in (on, off):  # two rows, two requests: a row at once; TTFT is all prefill
        assert m["queue_median_s"] + m["prefill_median_s"] == pytest.approx(m["ttft_median_s"])
        assert 0 <= m["queue_median_s"] < m["prefill_median_s"]
    # pages: CSA's pool holds 4 entries of 4 positions a page; the prefix's 2 once, each
    # request's prompt + output - 1 positions past them
    pages = lambda n: -(-(n // 4) // 4)  # noqa: E731
    whole = 2 + sum(pages(len(r.prompt) + r.max_new_tokens - 1) - 2 for _, r in arrivals)
    assert on["ideal_pages_load"] == off["ideal_pages_load"] == whole
    assert 0 < on["ideal_pages"] <= whole and 0 < off["ideal_pages"] <= whole
    assert off["ideal_pages"] <= off["peak_row_pages"] == off["peak_pages"]  # a copy a row
    assert on["ideal_pages"] <= on["peak_row_pages"] <= on["peak_pages"] < off["peak_pages"]
    slots = serving.default_prefix_nodes(2)  # what the run charges with charge_snapshots
    assert on["snapshot_bytes"] == slots * serving.snapshot_slot_bytes(eng, MAX_LEN) > 0
    assert off["snapshot_bytes"] == 0
    # the load's floor (prefill free, each step the fastest of one row alone) is below both
    times = serving.decode_step_times(Scheduler(eng, 2, MAX_LEN, max_chunk=16), 16,
                                      eng.cfg.model.vocab_size)
    assert times.shape == (32,)
    step = float(times.min())
    floor = serving.fcfs_floor(arrivals, 2, step)
    assert 0 < step and 0 < floor["floor_wall_s"] < min(on["wall_s"], off["wall_s"])
    assert floor["floor_ttft_median_s"] == 0.0  # two rows, two requests: nobody waits
