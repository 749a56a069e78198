"""Global paged cache: ragged appends, row isolation, masking, exhaustion, release and reuse.

Every cache operation runs under jax.jit; results are compared with a per-row Python list
reference (exact in float64 for the native format; for quantized formats the reference is
formats.decode(formats.encode(x)) of the same vectors).
"""

import math
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn.cache import formats, paged
from dsattn.cache.paged import Field

NATIVE = (("entry", Field("native", 8, 0)), ("key", Field("native", 4, 0)))
QUANT = (("entry", Field("fp8_ue8m0_rope_bf16", 128, 64)), ("key", Field("fp4_ue8m0", 64, 0)),
         ("lat", Field("fp8_ue8m0", 64, 0)))


@lru_cache(maxsize=None)
def ops(fields_items: tuple):
    """Jitted cache operations for one (hashable) field set."""
    fields = dict(fields_items)
    return {
        "append": jax.jit(paged.append),
        "gather": {name: jax.jit(lambda c, idx, name=name: paged.gather(c, name, idx,
                                                                         jnp.float64))
                   for name in fields},
        "read_all": {name: jax.jit(lambda c, name=name: paged.read_all(c, name, jnp.float64))
                     for name in fields},
        "release": jax.jit(paged.release),
        "in_use": jax.jit(paged.pages_in_use),
    }


@lru_cache(maxsize=None)
def qdq(f: Field):
    """decode(encode(x)) of one field's format, to float64 (identity for native)."""
    if f.fmt == "native":
        return lambda x: x
    return jax.jit(lambda x: formats.decode(f.fmt, formats.encode(f.fmt, x, f.rope),
                                            jnp.float64))


class Ref:
    """Per-row lists of the expected decoded vectors of each field."""

    def __init__(self, fields_items, batch):
        self.fields = dict(fields_items)
        self.rows = [{name: [] for name in self.fields} for _ in range(batch)]

    def append(self, new, n_new):
        for name, f in self.fields.items():
            x = np.asarray(qdq(f)(new[name]))  # whole [B, E, w] at once: one compile
            for b, n in enumerate(n_new):
                self.rows[b][name].extend(list(x[b, :n]))

    def release(self, mask):
        for b, r in enumerate(mask):
            if r:
                self.rows[b] = {name: [] for name in self.fields}

    def lengths(self):
        return [len(r[next(iter(self.fields))]) for r in self.rows]


def random_new(rng, fields_items, batch, e, scale=1.0):
    return {name: jnp.asarray(rng.normal(size=(batch, e, f.width)) * scale, jnp.float64)
            for name, f in fields_items}


def assert_matches(cache, ref, fields_items, rng, max_entries):
    """read_all, gather (random valid and invalid indices) and the allocation invariants."""
    op = ops(fields_items)
    lengths = ref.lengths()
    np.testing.assert_array_equal(np.asarray(cache.length), lengths)
    B = len(lengths)
    idx = rng.integers(-3, max_entries + 3, size=(B, 2, 7))
    idx[:, 0, 0] = -1
    idx[:, 0, 1] = max_entries + 100
    for name, f in fields_items:
        vals, valid = op["read_all"][name](cache)
        assert vals.shape == (B, max_entries, f.width) and vals.dtype == jnp.float64
        gv, gvalid = op["gather"][name](cache, jnp.asarray(idx, jnp.int32))
        assert gv.shape == (B, 2, 7, f.width)
        vals, valid, gv, gvalid = jax.device_get((vals, valid, gv, gvalid))
        for b in range(B):
            n = lengths[b]
            exp = np.zeros((max_entries, f.width))
            if n:
                exp[:n] = np.stack(ref.rows[b][name])
            np.testing.assert_array_equal(vals[b], exp)
            np.testing.assert_array_equal(valid[b], np.arange(max_entries) < n)
            ok = (idx[b] >= 0) & (idx[b] < n)
            np.testing.assert_array_equal(gvalid[b], ok)
            np.testing.assert_array_equal(gv[b],
                                          exp[np.clip(idx[b], 0, max_entries - 1)]
                                          * ok[..., None])
    # Allocation invariants: a row holds exactly ceil(length / page_size) distinct pages, no
    # page belongs to two rows or to a row and the free stack, and together they are the pool.
    table = np.asarray(cache.page_table)
    n_free = int(cache.n_free.sum())
    ps = next(iter(cache.pages["entry"].values())).shape[1]
    owned = []
    for b in range(B):
        k = math.ceil(lengths[b] / ps)
        assert (table[b, :k] >= 0).all() and (table[b, k:] == -1).all()
        owned.extend(table[b, :k].tolist())
    free = np.asarray(cache.free)[:n_free].tolist()
    n_pages = cache.free.shape[0]
    assert sorted(owned + free) == list(range(n_pages))
    assert int(op["in_use"](cache)) == len(owned)


@pytest.mark.parametrize("fields_items", [NATIVE, QUANT], ids=["native", "quantized"])
def test_ragged_appends_match_reference(fields_items):
    rng = np.random.default_rng(0)
    B, max_entries, ps, E = 3, 21, 4, 5  # max_entries not a multiple of the page size
    fields = dict(fields_items)
    cache = paged.empty(fields, B, max_entries, ps, jnp.float64)
    assert cache.page_table.shape == (B, 6) and cache.free.shape == (18,)
    assert cache.pages["entry"][next(iter(cache.pages["entry"]))].shape[:2] == (18, ps)
    ref = Ref(fields_items, B)
    op = ops(fields_items)
    assert_matches(cache, ref, fields_items, rng, max_entries)
    for step, n_new in enumerate([[3, 0, 5], [0, 4, 1], [5, 5, 0], [2, 0, 4], [4, 1, 5],
                                  [1, 2, 0]]):
        new = random_new(rng, fields_items, B, E, scale=3.0)
        cache = op["append"](cache, new, jnp.asarray(n_new, jnp.int32))
        ref.append(new, n_new)
        if step % 2 or fields_items is NATIVE:
            assert_matches(cache, ref, fields_items, rng, max_entries)
    assert_matches(cache, ref, fields_items, rng, max_entries)
    assert not bool(cache.overflow.any())
    paged.check(cache)


def test_rows_sharing_a_pool_never_see_each_other():
    fields_items = (("entry", Field("native", 8, 0)),)
    B, max_entries, ps, E = 2, 24, 2, 3
    cache = paged.empty(dict(fields_items), B, max_entries, ps, jnp.float64)
    op = ops(fields_items)
    ones = jnp.ones((B, E, 8), jnp.float64) * jnp.asarray([1.0, -1.0])[:, None, None]
    lengths = np.zeros(2, int)
    for i in range(8):  # interleaved: row 0, row 1, both, ...
        n_new = [[3, 0], [0, 3], [1, 2]][i % 3]
        cache = op["append"](cache, {"entry": ones}, jnp.asarray(n_new, jnp.int32))
        lengths += n_new
    table = np.asarray(cache.page_table)
    # The rows' pages interleave in the pool (so isolation is really exercised).
    used0, used1 = table[0][table[0] >= 0], table[1][table[1] >= 0]
    assert set(used0).isdisjoint(used1)
    assert used0.min() < used1.max() and used1.min() < used0.max()
    idx = jnp.broadcast_to(jnp.arange(-2, max_entries + 2, dtype=jnp.int32), (B, max_entries + 4))
    vals, valid = op["gather"]["entry"](cache, idx)
    for b, sign in enumerate([1.0, -1.0]):
        ok = (np.arange(-2, max_entries + 2) >= 0) & (np.arange(-2, max_entries + 2) < lengths[b])
        np.testing.assert_array_equal(np.asarray(valid[b]), ok)
        np.testing.assert_array_equal(np.asarray(vals[b]), sign * ok[:, None] * np.ones((1, 8)))


def test_invalid_indices_read_zeros():
    fields_items = NATIVE
    rng = np.random.default_rng(1)
    B, max_entries, ps = 3, 21, 4
    cache = paged.empty(dict(fields_items), B, max_entries, ps, jnp.float64)
    op = ops(fields_items)
    new = random_new(rng, fields_items, B, 5)
    cache = op["append"](cache, new, jnp.asarray([5, 2, 0], jnp.int32))  # row 2: no pages
    idx = np.array([[-1, 5, 6, 20, 21, 1000, -1000, 4],
                    [-1, 2, 3, 4, 24, 7, 1, 0],
                    [0, 1, -1, 3, 4, 20, 21, 2]], np.int32)
    vals, valid = op["gather"]["entry"](cache, jnp.asarray(idx))
    expect_valid = np.array([[0, 0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 1, 1],
                             [0] * 8], bool)
    np.testing.assert_array_equal(np.asarray(valid), expect_valid)
    assert not np.asarray(vals)[~expect_valid].any()
    np.testing.assert_array_equal(np.asarray(vals[0, 7]), np.asarray(new["entry"][0, 4]))
    np.testing.assert_array_equal(np.asarray(vals[1, 6]), np.asarray(new["entry"][1, 1]))
    np.testing.assert_array_equal(np.asarray(vals[1, 7]), np.asarray(new["entry"][1, 0]))
    # Row 2 owns no page: its table is all -1 and nothing it reads is valid.
    assert (np.asarray(cache.page_table[2]) == -1).all()


def test_pool_exhaustion_sets_overflow_and_keeps_data():
    fields_items = NATIVE
    rng = np.random.default_rng(2)
    B, max_entries, ps, E = 3, 16, 4, 8
    fields = dict(fields_items)
    cache = paged.empty(fields, B, max_entries, ps, jnp.float64, n_pages=4)
    op = ops(fields_items)
    ref = Ref(fields_items, B)

    def step(cache, n_new):
        new = random_new(rng, fields_items, B, E)
        return op["append"](cache, new, jnp.asarray(n_new, jnp.int32)), new

    cache, new = step(cache, [6, 3, 0])  # 2 + 1 pages of 4
    ref.append(new, [6, 3, 0])
    paged.check(cache)
    assert int(op["in_use"](cache)) == 3
    # One free page, rows 0 and 2 each need one: row order decides (row 0 gets it); row 1
    # fits in its own page and still appends.
    cache, new = step(cache, [3, 1, 2])
    ref.append(new, [3, 0 + 1, 0])
    assert bool(cache.overflow.any())
    np.testing.assert_array_equal(np.asarray(cache.length), [9, 4, 0])
    assert int(cache.n_free.sum()) == 0 and (np.asarray(cache.page_table[2]) == -1).all()
    assert_matches(cache, ref, fields_items, rng, max_entries)
    with pytest.raises(paged.CacheExhausted, match="global cache pool exhausted: 4 pages of 4"):
        paged.check(cache)
    # Exhausted pool: every row that needs a page is refused, existing data untouched; a row
    # filling its own last page still proceeds, and overflow stays set.
    cache, new = step(cache, [3, 1, 1])
    ref.append(new, [3, 0, 0])
    np.testing.assert_array_equal(np.asarray(cache.length), [12, 4, 0])
    assert_matches(cache, ref, fields_items, rng, max_entries)
    assert bool(cache.overflow.any())
    assert issubclass(paged.CacheExhausted, RuntimeError)


def test_page_table_limit_is_overflow():
    fields_items = NATIVE
    rng = np.random.default_rng(3)
    B, max_entries, ps, E = 3, 21, 4, 5  # the page table holds 24, the limit is 21
    cache = paged.empty(dict(fields_items), B, max_entries, ps, jnp.float64)
    op = ops(fields_items)
    ref = Ref(fields_items, B)
    for _ in range(4):
        new = random_new(rng, fields_items, B, E)
        cache = op["append"](cache, new, jnp.asarray([5, 5, 5], jnp.int32))
        ref.append(new, [5, 5, 5])
    new = random_new(rng, fields_items, B, E)
    cache = op["append"](cache, new, jnp.asarray([2, 1, 0], jnp.int32))  # row 0 would reach 22
    ref.append(new, [0, 1, 0])  # row 1 reaches exactly 21
    assert bool(cache.overflow.any())
    assert_matches(cache, ref, fields_items, rng, max_entries)
    with pytest.raises(paged.CacheExhausted, match=r"init_cache\(\.\.\., max_len=\.\.\.\)"):
        paged.check(cache)


def test_release_and_reuse_never_exposes_old_data():
    fields_items = (("entry", Field("native", 8, 0)),)
    B, max_entries, ps, E = 2, 12, 4, 6
    cache = paged.empty(dict(fields_items), B, max_entries, ps, jnp.float64, n_pages=3)
    op = ops(fields_items)
    plus = jnp.ones((B, E, 8), jnp.float64)
    cache = op["append"](cache, {"entry": plus}, jnp.asarray([6, 0], jnp.int32))
    old_pages = np.asarray(cache.page_table[0, :2]).tolist()
    cache = op["release"](cache, jnp.asarray([True, False]))
    assert int(op["in_use"](cache)) == 0
    np.testing.assert_array_equal(np.asarray(cache.page_table[0]), [-1, -1, -1])
    vals, valid = op["read_all"]["entry"](cache)
    assert not np.asarray(valid).any() and not np.asarray(vals).any()
    # Row 1 takes the released pages (the half-full one first: LIFO), writing -1s into
    # slot 0 only; the stale +1s behind it must stay invisible.
    cache = op["append"](cache, {"entry": -plus}, jnp.asarray([0, 1], jnp.int32))
    assert int(cache.page_table[1, 0]) == old_pages[1]
    vals, valid = op["read_all"]["entry"](cache)
    expect = np.zeros((B, max_entries, 8))
    expect[1, 0] = -1.0
    np.testing.assert_array_equal(np.asarray(vals), expect)
    np.testing.assert_array_equal(np.asarray(valid[1]), np.arange(max_entries) < 1)
    idx = jnp.asarray([[0, 1, 2, 5], [0, 1, 2, 3]], jnp.int32)
    g, gvalid = op["gather"]["entry"](cache, idx)
    np.testing.assert_array_equal(np.asarray(gvalid), [[0, 0, 0, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(g[1, :, 0]), [-1.0, 0.0, 0.0, 0.0])
    assert not np.asarray(g[0]).any()
    # Row 1 grows into the other stale page; row 0 refills from scratch. Still no +1 leaks.
    cache = op["append"](cache, {"entry": -plus}, jnp.asarray([0, 5], jnp.int32))
    cache = op["append"](cache, {"entry": 2 * plus}, jnp.asarray([1, 0], jnp.int32))
    assert int(cache.page_table[1, 1]) == old_pages[0]
    vals, valid = op["read_all"]["entry"](cache)
    expect[1, :6] = -1.0
    expect[0, 0] = 2.0
    np.testing.assert_array_equal(np.asarray(vals), expect)
    assert not bool(cache.overflow.any())


def test_scrambled_pages_random_appends_and_releases():
    fields_items = NATIVE
    rng = np.random.default_rng(4)
    B, max_entries, ps, E = 3, 21, 4, 5
    cache = paged.empty(dict(fields_items), B, max_entries, ps, jnp.float64)
    op = ops(fields_items)
    ref = Ref(fields_items, B)
    scrambled = False
    for step in range(14):
        if step % 3 == 2:
            mask = rng.random(B) < 0.5
            mask[step % B] = True
            cache = op["release"](cache, jnp.asarray(mask))
            ref.release(mask)
        else:
            room = max_entries - np.asarray(ref.lengths())
            n_new = np.minimum(rng.integers(0, E + 1, size=B), room)
            n_new[rng.integers(B)] = 0
            new = random_new(rng, fields_items, B, E)
            cache = op["append"](cache, new, jnp.asarray(n_new, jnp.int32))
            ref.append(new, n_new.tolist())
        assert_matches(cache, ref, fields_items, rng, max_entries)
        table = np.asarray(cache.page_table)
        # Allocation order no longer follows row order: some row's pages are not increasing.
        scrambled |= any((np.diff(r[r >= 0]) < 0).any() for r in table)
    assert scrambled
    assert not bool(cache.overflow.any())


def test_check_message_and_stacked_overflow():
    fields = {"entry": Field("native", 8, 0)}
    cache = paged.empty(fields, 2, 8, 4, jnp.float64, n_pages=2)
    paged.check(cache)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), cache)
    stacked = stacked.replace(overflow=jnp.asarray([False, True]))
    with pytest.raises(paged.CacheExhausted) as e:
        paged.check(stacked)
    assert "2 pages of 4 entries" in str(e.value) and "at most 8 entries per row" in str(e.value)


def test_append_and_release_keep_every_leaf_dtype():
    """A cache is a loop carry (decode programs, scanned layers): its leaves must keep their
    dtypes through appends and releases, also with jax_enable_x64 (this suite's setting)."""
    cache = paged.empty({"e": Field("native", 4)}, 2, 8, 2)
    dtypes = [a.dtype for a in jax.tree.leaves(cache)]
    cache = paged.append(cache, {"e": jnp.ones((2, 3, 4))}, jnp.array([3, 1]))
    assert [a.dtype for a in jax.tree.leaves(cache)] == dtypes
    cache = paged.release(cache, jnp.array([True, False]))
    assert [a.dtype for a in jax.tree.leaves(cache)] == dtypes


def test_pool_groups_behave_as_separate_caches():
    """A cache of G pool groups (one per row shard of a mesh) is G independent caches side
    by side: block g of rows takes pages only from range g of the pool, with group-local
    page ids, whatever the other blocks append or release. `pool` (what the kernels read)
    maps every row's table into the whole pool."""
    rng = np.random.default_rng(7)
    fields = {"entry": Field("native", 4)}
    B, G, max_entries, ps, E = 4, 2, 9, 2, 3
    grouped = paged.empty(fields, B, max_entries, ps, jnp.float64, groups=G)
    parts = [paged.empty(fields, B // G, max_entries, ps, jnp.float64,
                         n_pages=grouped.n_pages // G) for _ in range(G)]
    rows = lambda x, g: x[g * (B // G):(g + 1) * (B // G)]
    for step in range(8):
        if step % 3 == 2:
            mask = rng.random(B) < 0.5
            grouped = paged.release(grouped, jnp.asarray(mask))
            parts = [paged.release(p, jnp.asarray(rows(mask, g))) for g, p in enumerate(parts)]
        else:
            n_new = rng.integers(0, E + 1, size=B)
            new = rng.normal(size=(B, E, 4))
            grouped = paged.append(grouped, {"entry": jnp.asarray(new)}, jnp.asarray(n_new))
            parts = [paged.append(p, {"entry": jnp.asarray(rows(new, g))},
                                  jnp.asarray(rows(n_new, g))) for g, p in enumerate(parts)]
        idx = jnp.asarray(rng.integers(-1, max_entries + 1, size=(B, 5)), jnp.int32)
        got, ok = paged.gather(grouped, "entry", idx)
        everything, _ = paged.read_all(grouped, "entry", jnp.float64)
        for g, p in enumerate(parts):
            np.testing.assert_array_equal(rows(np.asarray(grouped.page_table), g),
                                          np.asarray(p.page_table))
            assert int(grouped.n_free[g]) == int(p.n_free.sum())
            want, want_ok = paged.gather(p, "entry", rows(idx, g))
            np.testing.assert_array_equal(rows(np.asarray(got), g), np.asarray(want))
            np.testing.assert_array_equal(rows(np.asarray(ok), g), np.asarray(want_ok))
            np.testing.assert_array_equal(rows(np.asarray(everything), g),
                                          np.asarray(paged.read_all(p, "entry", jnp.float64)[0]))
    assert int(grouped.length.sum()) > 0
    pages, table = paged.pool(grouped, "entry")
    table, length = np.asarray(table), np.asarray(grouped.length)
    for b in range(B):
        per = grouped.n_pages // G
        held = table[b][table[b] >= 0]
        assert ((held // per) == b // (B // G)).all()  # inside its group's range
        entries = [np.asarray(pages["v"])[table[b, i // ps], i % ps] for i in range(length[b])]
        np.testing.assert_array_equal(np.asarray(everything)[b, :length[b]],
                                      np.reshape(entries, (length[b], 4)))
