"""Continuous batching's core promise: a request's tokens never depend on which requests
share its batch or had its pages or its row before. Each request served by the scheduler
(random arrival steps, prompt lengths and stop points, a pool small enough that pages are
reused and rows preempted, every released page and every free row's window ring,
compressor state and position poisoned after each step) equals its own solo
Engine.generate output, cut where its eos token or stop sequence first appears, for every
family (float64 models, so rounding cannot flip a draw). The fast tier runs one small mix
on a 3-layer V4; the full tier every preset and a randomized search."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn import generate
from dsattn.bench.compiles import compilations
from dsattn.cache.paged import PagedCache
from dsattn.cache.protocol import is_container
from dsattn.errors import InputError
from dsattn.model import layer_caches, with_layer_caches
from dsattn.serve import programs
from dsattn.serve.pool import with_pool
from dsattn.serve.request import Finish, Request
from dsattn.serve.scheduler import Scheduler
from tests.helpers import tiny_model

FAMILIES = ["mha", "mla", "dsa", "v4", "v41"]
PAGED = {"dsa", "v4", "v41"}
ROWS, MAX_LEN, CHUNK = 3, 48, 16
POOL_TOKENS = 32  # pages for ~1 request of the mix: admission waits, rows are preempted
SMALL_PAGES = "cache.page_size=4"  # rows of MAX_LEN hold several pages: pools run short


def cut(tokens, eos_id=None, stop=()):
    """(Engine.generate's output with an eos token (not kept) or stop sequences (kept)
    applied to an uncut solo output, how it finished)."""
    out = []
    for t in tokens:
        if t == eos_id:
            return out, Finish.STOP
        out.append(t)
        if any(tuple(out[-len(s):]) == tuple(s) for s in stop if len(out) >= len(s)):
            return out, Finish.STOP
    return out, Finish.LENGTH


def solo(eng, req: Request, replay=None):
    """The request's output run alone: Engine.generate (or, under replay, its host loop
    over Engine.prefill(replay=...) and decode_step, drawing as generate does), uncut."""
    if replay is None:
        # the host loop (on_token): the same tokens as the compiled loop, one program
        # fewer to compile for greedy and sampled requests together
        return eng.generate([list(req.prompt)], req.max_new_tokens,
                            temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                            max_len=MAX_LEN, on_token=lambda row, tok: None)[0]
    cache = eng.init_cache(1, MAX_LEN)
    logits, cache = eng.prefill(np.array([req.prompt]), None, cache, replay=replay)
    key, out = jax.random.PRNGKey(req.seed), []
    for step in range(req.max_new_tokens):
        tok = generate.sample(logits, jax.random.fold_in(key, step), req.temperature,
                              req.top_p)
        out.append(int(tok[0]))
        if step + 1 < req.max_new_tokens:
            logits, cache = eng.decode_step(tok, cache)
    return out


def _rows(mask, a):
    return mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim))


@partial(jax.jit, static_argnums=0)
def poison(cfg, state, free_rows):
    """`state` with what released pages and free rows (`free_rows` [B]) hold overwritten:
    every page on a free stack NaN; free rows' local caches (window rings, compressor
    states, contiguous K/V) NaN, their ring slots claiming positions 0..W-1, their position
    7. None of it may reach the next owner."""
    def one(c):
        if isinstance(c, PagedCache):
            n = c.n_pages
            ids = jnp.where(jnp.arange(n) < c.n_free[0], c.free, n)
            bad = jnp.zeros(n + 1, bool).at[ids].set(True)[:n]
            nan = lambda a: (jnp.where(_rows(bad, a), jnp.nan, a)  # noqa: E731
                             if jnp.issubdtype(a.dtype, jnp.floating) else a)
            return c.replace(pages=jax.tree.map(nan, c.pages))
        if not is_container(c):
            return c

        def leaf(a):
            if jnp.issubdtype(a.dtype, jnp.floating):
                return jnp.where(_rows(free_rows, a), jnp.nan, a)
            return jnp.where(_rows(free_rows, a), jnp.arange(a.shape[-1], dtype=a.dtype), a)

        return jax.tree.map(leaf, c)

    caches = [jax.tree.map(one, lc, is_leaf=is_container) for lc in layer_caches(cfg, state)]
    return with_layer_caches(cfg, state, caches).replace(
        pos=jnp.where(free_rows, 7, state.pos))


LONG = 2  # the first requests: long, arriving together, they outgrow the pool decoding


def random_mix(rng, n, vocab, sampled: int):
    """n requests (the last `sampled` ones sampled with their own seed) and arrival steps;
    the first LONG prompts fill a chunk and run 13 tokens each, all from step 0, so both are
    admitted and the pool runs out while they decode."""
    reqs = []
    for i in range(n):
        hot = i >= n - sampled
        length = CHUNK - 1 if i < LONG else rng.randint(1, CHUNK + 1)
        reqs.append(Request(rng.randint(0, vocab, length).tolist(),
                            13 if i < LONG else int(rng.randint(1, 14)),
                            temperature=0.8 if hot else 0.0, top_p=0.9 if hot else 1.0,
                            seed=int(rng.randint(0, 1000))))
    arrivals = np.sort(rng.randint(0, 6, n))
    arrivals[:LONG] = 0
    return reqs, arrivals


def with_stops(rng, req, uncut):
    """The request with an eos token or a stop sequence drawn from its own uncut output
    (so it stops early), or unchanged."""
    kind = rng.randint(3)
    if kind == 0 or len(uncut) < 2:
        return req
    k = rng.randint(1, len(uncut))
    if kind == 1:
        return Request(req.prompt, req.max_new_tokens, req.temperature, req.top_p, req.seed,
                       eos_id=uncut[k])
    return Request(req.prompt, req.max_new_tokens, req.temperature, req.top_p, req.seed,
                   stop=(tuple(uncut[k - 1: k + 1]),))


def serve(eng, reqs, arrivals, replay=None, poisoned=True):
    """(each request's output, preemptions, the finish of each) served by one scheduler,
    request i submitted before step arrivals[i], released pages and free rows poisoned
    after every step."""
    s = Scheduler(eng, ROWS, MAX_LEN, pool_tokens=POOL_TOKENS, token_budget=ROWS + CHUNK,
                  max_chunk=CHUNK, replay=replay)
    ids, out, finish, step = {}, {}, {}, 0
    order = list(np.argsort(arrivals, kind="stable"))
    while order or not s.idle:
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            ids[s.submit(reqs[i])] = i
        for ev in s.step():
            i = ids[ev.request_id]
            out.setdefault(i, [])
            if ev.token is not None:
                out[i].append(ev.token)
            if ev.finish is not None:
                finish[i] = ev.finish
        if poisoned:
            free = np.zeros(ROWS, bool)
            free[s.free_rows()] = True
            s.cache = poison(eng.cfg, s.cache, jnp.asarray(free))
        step += 1
    return [out.get(i, []) for i in range(len(reqs))], s.preemptions, finish


def check_isolation(name, seed, n, sampled, replay=None, overrides=()):
    eng = generate.Engine(tiny_model(name, SMALL_PAGES, *overrides))
    rng = np.random.RandomState(seed)
    reqs, arrivals = random_mix(rng, n, eng.cfg.model.vocab_size, sampled)
    uncut = [solo(eng, r, replay) for r in reqs]
    reqs = reqs[:LONG] + [with_stops(rng, r, u) for r, u in zip(reqs[LONG:], uncut[LONG:])]
    got, preemptions, finish = serve(eng, reqs, arrivals, replay)
    for i, (r, u) in enumerate(zip(reqs, uncut)):
        want, why = cut(u, r.eos_id, r.stop)
        assert got[i] == want, (name, i, r, got[i], want)
        assert finish[i] is why, (i, finish[i])
    return preemptions


# The fast tier serves a 3-layer V4 (window ring, compressor state and paged pools in one
# model); every family's preset runs in the full tier (each costs minutes of compiling).
FAST = {"v4": ("model.n_layers=3", "attention.layers=swa, csa, hca")}


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.full)
                                  for n in FAMILIES])
def test_each_request_equals_its_solo_generate(name):
    preemptions = check_isolation(name, seed=1, n=6, sampled=2, overrides=FAST.get(name, ()))
    if name in PAGED:  # the small pool made rows give their pages back and recompute
        assert preemptions > 0


@pytest.mark.full
def test_v41_bounded_replay_equals_its_solo_replay_prefill():
    check_isolation("v41", seed=2, n=5, sampled=1, replay=True)


@pytest.mark.full
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("seed", [10, 11, 12])
def test_random_mixes_equal_their_solo_outputs(name, seed):
    check_isolation(name, seed, n=10, sampled=4)


@pytest.mark.full
@pytest.mark.parametrize("seed", [20, 21])
def test_random_replay_mixes_equal_their_solo_outputs(seed):
    check_isolation("v41", seed, n=8, sampled=3, replay=True)


def test_a_request_that_can_never_fit_is_refused_at_submission():
    eng = generate.Engine(tiny_model("v4", SMALL_PAGES, *FAST["v4"]))
    s = Scheduler(eng, ROWS, MAX_LEN, pool_tokens=16, max_chunk=CHUNK)
    with pytest.raises(InputError, match="exceeds the cache's 48 positions"):
        s.submit(Request([1] * 40, 9))
    with pytest.raises(InputError, match="whose whole pool has"):
        s.submit(Request([1] * 40, 8))  # fits max_len, not the pool
    with pytest.raises(InputError, match="max_new_tokens must be an integer >= 0"):
        s.submit(Request([1], -1))
    assert s.idle and s.queued == 0


def test_rows_taken_out_and_put_back_replace_only_those_rows():
    """take_rows/put_rows against numpy: rows 1 and 0 of a leaf with rows on axis 0 and one
    with rows on axis 1 are taken (an index past the batch takes a stand-in, a copy of the
    last row), changed, and put back; the stand-in is dropped, rows 2 and 3 are unchanged."""
    a = np.arange(4 * 3, dtype=np.float64).reshape(4, 3)
    b = np.arange(2 * 4, dtype=np.int32).reshape(2, 4)
    idx = jnp.array([1, 0, 4], jnp.int32)
    taken = programs.take_rows((0, 1), [jnp.asarray(a), jnp.asarray(b)], idx)
    np.testing.assert_array_equal(taken[0], a[[1, 0, 3]])
    np.testing.assert_array_equal(taken[1], b[:, [1, 0, 3]])
    changed = [taken[0] * 10 + 1, taken[1] - 100]  # the stand-in changed too
    put = programs.put_rows((0, 1), [jnp.asarray(a), jnp.asarray(b)], idx, changed)
    want_a, want_b = a.copy(), b.copy()
    want_a[[1, 0]] = a[[1, 0]] * 10 + 1
    want_b[:, [1, 0]] = b[:, [1, 0]] - 100
    np.testing.assert_array_equal(put[0], want_a)
    np.testing.assert_array_equal(put[1], want_b)


def test_row_axes_find_the_rows_and_leave_the_pools_shared():
    """In a V4 decode state every leaf whose size follows the row count has a row axis; the
    page pools, their free stacks, reference counts and overflow flags (one per pool) have
    none."""
    eng = generate.Engine(tiny_model("v4", "model.n_layers=2", "attention.layers=swa, csa"))
    state = with_pool(eng.cfg, eng.init_cache(3, MAX_LEN), 40)
    axes = programs.row_axes(lambda b: with_pool(eng.cfg, eng.init_cache(b, MAX_LEN), 1))
    leaves = jax.tree.leaves(state)
    assert len(axes) == len(leaves)
    paged = [c for c in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, PagedCache))
             if isinstance(c, PagedCache)]
    pool = {id(x) for c in paged
            for x in jax.tree.leaves((c.pages, c.free, c.n_free, c.refs, c.overflow))}
    assert pool
    for x, a in zip(leaves, axes):
        if id(x) in pool:
            assert a is None
        else:
            assert a is not None and x.shape[a] == 3


@pytest.mark.parametrize("name", ["mha", "v4"])
def test_prompts_prefilling_beside_decoding_rows_equal_their_solo_outputs(name):
    """Five rows decode while three long prompts arrive: the three prefill as a sub-batch of
    four rows (one stand-in for the last row of the batch, row 7, which one of them holds),
    the five take one token each over the batch; every request equals its solo output."""
    eng = generate.Engine(tiny_model(name, "model.n_layers=2") if name == "mha" else
                          tiny_model(name, "model.n_layers=2", "attention.layers=swa, csa"))
    vocab = eng.cfg.model.vocab_size
    rng = np.random.RandomState(5)
    short = [Request(rng.randint(0, vocab, 3).tolist(), 20) for _ in range(5)]
    long = [Request(rng.randint(0, vocab, 40).tolist(), 4) for _ in range(3)]
    s = Scheduler(eng, 8, MAX_LEN, max_chunk=CHUNK)
    ids = [s.submit(r) for r in short]
    out = {i: [] for i in range(len(short) + len(long))}
    for _ in range(3):  # the five are decoding
        for ev in s.step():
            out[ev.request_id] += [] if ev.token is None else [ev.token]
    ids += [s.submit(r) for r in long]
    while not s.idle:
        for ev in s.step():
            out[ev.request_id] += [] if ev.token is None else [ev.token]
    for rid, req in zip(ids, short + long):
        assert out[rid] == solo(eng, req), rid


def test_after_warm_up_serving_compiles_nothing():
    """warm_up compiles every program a step can run: serving a mix afterwards (decoding
    rows, prefill chunks of every width over sub-batches and the whole batch, retirement)
    compiles no program, and gives each request its solo output."""
    eng = generate.Engine(tiny_model("mha", "model.n_layers=1"))
    s = Scheduler(eng, 4, MAX_LEN, max_chunk=CHUNK)
    assert s.warm_up() == 2 + 2  # widths 1 and 16 over the 4 rows; 16 over 1 and over 2
    rng = np.random.RandomState(2)
    reqs = [Request(rng.randint(0, 50, n).tolist(), m)
            for n, m in [(3, 9), (20, 2), (30, 3), (5, 6), (17, 1), (9, 4)]]
    with compilations() as compiled:
        ids = [s.submit(r) for r in reqs[:3]]
        first = s.step()
        ids += [s.submit(r) for r in reqs[3:]]
        outs = s.run()
    assert compiled.n == 0
    for rid, req in zip(ids, reqs):
        drawn = [ev.token for ev in first if ev.request_id == rid and ev.token is not None]
        assert drawn + outs.get(rid, []) == solo(eng, req)


def test_the_first_request_after_warm_up_compiles_nothing_with_a_checkpoint_s_weights():
    """A checkpoint's weights come back committed to a device (scripts/serve.py's), so every
    step's outputs are committed too, while a fresh decode state is not: jit compiles a
    program once per commitment of its arguments. The first request after warm_up (a chunk
    over a sub-batch, decoding rows, a retired row) still compiles nothing. warm_up reports
    each step program as it is compiled (scripts/serve.py's progress lines)."""
    from flax import nnx

    graphdef, state = nnx.split(tiny_model("mha", "model.n_layers=1"))
    eng = generate.Engine(nnx.merge(graphdef, jax.device_put(state, jax.devices()[0])))
    s = Scheduler(eng, 2, MAX_LEN, max_chunk=CHUNK)
    said = []
    assert s.warm_up(lambda width, rows, seconds: said.append((width, rows))) == 3
    assert said == s.warm_up_shapes() == [(1, 2), (16, 2), (16, 1)]
    with compilations() as compiled:
        rid = s.submit(Request(list(range(1, 21)), 3))
        out = s.run()
    assert compiled.n == 0 and len(out[rid]) == 3


def test_a_prefill_step_advances_every_prefilling_row_by_its_width():
    """A step runs one [rows, width] program whatever the token budget leaves, so every
    prefilling row rides along: three prompts of 12 tokens (one 16-wide chunk each) admitted
    together all draw their first token in the first step, with the budget the default
    rows + max_chunk (which one 12-token chunk and a part of the next would exhaust)."""
    eng = generate.Engine(tiny_model("mha", "model.n_layers=1"))
    s = Scheduler(eng, ROWS, MAX_LEN, max_chunk=CHUNK)
    assert s.token_budget < ROWS * 12
    ids = [s.submit(Request(list(range(1 + i, 13 + i)), 2)) for i in range(ROWS)]
    first = s.step()
    assert sorted(ev.request_id for ev in first if ev.token is not None) == ids
    outs = s.run()
    for i, rid in enumerate(ids):  # and each still equals its solo output
        want = solo(eng, Request(list(range(1 + i, 13 + i)), 2))
        assert [ev.token for ev in first if ev.request_id == rid] + outs[rid] == want
