"""Global paged cache: ragged appends, row isolation, masking, exhaustion, release and reuse;
shared pages (reference counts, copy on write, `share`, `hold`), also against a numpy model
of the pool.

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


# -- reference counts and copy on write -------------------------------------------------------
def share_ops(fields_items):
    """The sharing operations, jitted once per field set (beside `ops`)."""
    op = ops(fields_items)
    if "share" not in op:
        op["share"] = jax.jit(paged.share)
        op["hold"] = jax.jit(paged.hold)
    return op


def stored_pages(cache, ids):
    """Every field's stored arrays of pages `ids`, on the host."""
    return {name: {a: np.asarray(v)[list(ids)] for a, v in stored.items()}
            for name, stored in cache.pages.items()}


def assert_same_pages(a, b):
    for name in a:
        for arr in a[name]:
            np.testing.assert_array_equal(a[name][arr], b[name][arr], err_msg=f"{name}.{arr}")


def assert_refs(cache, held=()):
    """The reference counts: each page's refs = the page table slots pointing at it plus the
    `hold`s in `held` (page ids, repeats counted); the free stack holds exactly the pages
    with refs 0, each once, and -1 above its top. One pool group."""
    table, refs = np.asarray(cache.page_table), np.asarray(cache.refs)
    n_pages, n_free = cache.n_pages, int(cache.n_free.sum())
    want = np.bincount(np.concatenate([table[table >= 0], np.asarray(held, int)]),
                       minlength=n_pages)
    np.testing.assert_array_equal(refs, want)
    free = np.asarray(cache.free)
    assert sorted(free[:n_free].tolist()) == np.flatnonzero(want == 0).tolist()
    assert (free[n_free:] == -1).all()
    assert int(paged.pages_in_use(cache)) == int((want > 0).sum())


def shared_cache(fields_items, rng, n_pages=None, B=3, max_entries=12, ps=4):
    """Row 0 holds 6 entries (a full page and a half-filled one), row 1 shares them
    (`share`), row 2 holds 3 entries of its own; returns (cache, Ref)."""
    op = share_ops(fields_items)
    cache = paged.empty(dict(fields_items), B, max_entries, ps, jnp.float64, n_pages=n_pages)
    ref = Ref(fields_items, B)
    new = random_new(rng, fields_items, B, 6, scale=3.0)
    n_new = [6, 0, 3][:B] + [0] * (B - 3)
    cache = op["append"](cache, new, jnp.asarray(n_new, jnp.int32))
    ref.append(new, n_new)
    rows = np.arange(B) == 1
    cache = op["share"](cache, jnp.asarray(rows), cache.page_table[np.zeros(B, int)],
                        cache.length[np.zeros(B, int)])  # every row given row 0's
    ref.rows[1] = {name: list(v) for name, v in ref.rows[0].items()}
    np.testing.assert_array_equal(np.asarray(cache.page_table[1]), np.asarray(cache.page_table[0]))
    return cache, ref


@pytest.mark.parametrize("fields_items", [NATIVE, QUANT], ids=["native", "quantized"])
def test_a_sharer_appending_copies_the_shared_partial_page_first(fields_items):
    """Rows 0 and 1 share a full page and a half-filled one. Row 1 appending one entry
    must not write the half-filled page: it pops a page, copies every stored array of the
    old page into it, and writes there; row 0's bytes and reads stay as they were."""
    rng = np.random.default_rng(10)
    op = share_ops(fields_items)
    cache, ref = shared_cache(fields_items, rng)
    p0, p1 = np.asarray(cache.page_table[0, :2]).tolist()
    np.testing.assert_array_equal(np.asarray(cache.refs)[[p0, p1]], [2, 2])
    assert_refs(cache)
    before = stored_pages(cache, range(cache.n_pages))
    top = int(cache.free[int(cache.n_free[0]) - 1])  # the page popped next

    new = random_new(rng, fields_items, 3, 2)
    cache = op["append"](cache, new, jnp.asarray([0, 1, 0], jnp.int32))
    ref.append(new, [0, 1, 0])
    assert not bool(cache.overflow.any())
    np.testing.assert_array_equal(np.asarray(cache.page_table[0, :3]), [p0, p1, -1])
    np.testing.assert_array_equal(np.asarray(cache.page_table[1, :3]), [p0, top, -1])
    np.testing.assert_array_equal(np.asarray(cache.refs)[[p0, p1, top]], [2, 1, 1])
    assert_refs(cache)
    after = stored_pages(cache, range(cache.n_pages))
    assert_same_pages(stored_pages(cache, [p0, p1]), {n: {a: v[[p0, p1]] for a, v in s.items()}
                                                      for n, s in before.items()})
    # The copy holds every byte of the old page but slot 2's, where the new entry went.
    for name in after:
        for a, v in after[name].items():
            np.testing.assert_array_equal(v[top, [0, 1, 3]], before[name][a][p1, [0, 1, 3]])
    assert_shared_reads(cache, ref, fields_items)

    # Row 0 now holds the half-filled page alone: it writes in place, no page is popped.
    n_free = int(cache.n_free[0])
    new = random_new(rng, fields_items, 3, 2)
    cache = op["append"](cache, new, jnp.asarray([1, 0, 0], jnp.int32))
    ref.append(new, [1, 0, 0])
    np.testing.assert_array_equal(np.asarray(cache.page_table[0, :3]), [p0, p1, -1])
    assert int(cache.n_free[0]) == n_free
    # A shared FULL last page needs no copy: row 2, taking p0 alone, grows into a new page.
    cache = op["share"](cache, jnp.asarray([False, False, True]),
                        cache.page_table[np.zeros(3, int)],
                        jnp.asarray([0, 0, 4], jnp.int32))
    ref.rows[2] = {name: list(v[:4]) for name, v in ref.rows[0].items()}
    np.testing.assert_array_equal(np.asarray(cache.refs)[p0], 3)
    new = random_new(rng, fields_items, 3, 2)
    cache = op["append"](cache, new, jnp.asarray([1, 2, 2], jnp.int32))
    ref.append(new, [1, 2, 2])
    assert int(cache.page_table[2, 0]) == p0 and int(cache.refs[p0]) == 3
    assert_same_pages(stored_pages(cache, [p0]), {n: {a: v[[p0]] for a, v in s.items()}
                                                  for n, s in before.items()})
    assert_refs(cache)
    assert_shared_reads(cache, ref, fields_items)
    assert not bool(cache.overflow.any())


def assert_shared_reads(cache, ref, fields_items):
    """Every row reads exactly its Ref entries (read_all), whoever holds its pages."""
    op = ops(fields_items)
    np.testing.assert_array_equal(np.asarray(cache.length), ref.lengths())
    for name, f in fields_items:
        vals, valid = jax.device_get(op["read_all"][name](cache))
        for b, n in enumerate(ref.lengths()):
            exp = np.zeros((cache.max_entries, f.width))
            if n:
                exp[:n] = np.stack(ref.rows[b][name])
            np.testing.assert_array_equal(vals[b], exp, err_msg=f"row {b} {name}")
            np.testing.assert_array_equal(valid[b], np.arange(cache.max_entries) < n)


def test_sharers_appending_at_once_both_copy_and_the_old_page_goes_free():
    """Both holders of a half-filled page append in one step: each writes a copy of its own
    (popped in row order), and the old page, left with no holder, is pushed on the stack."""
    rng = np.random.default_rng(11)
    op = share_ops(NATIVE)
    cache, ref = shared_cache(NATIVE, rng)
    p0, p1 = np.asarray(cache.page_table[0, :2]).tolist()
    n_free = int(cache.n_free[0])
    stack = np.asarray(cache.free)[:n_free].tolist()
    new = random_new(rng, NATIVE, 3, 2)
    cache = op["append"](cache, new, jnp.asarray([1, 2, 0], jnp.int32))
    ref.append(new, [1, 2, 0])
    np.testing.assert_array_equal(np.asarray(cache.page_table[:2, :2]),
                                  [[p0, stack[-1]], [p0, stack[-2]]])
    assert int(cache.n_free[0]) == n_free - 1 and int(cache.free[n_free - 2]) == p1
    assert_refs(cache)
    assert_shared_reads(cache, ref, NATIVE)


def test_a_page_is_freed_only_when_its_last_holder_releases_it():
    rng = np.random.default_rng(12)
    op = share_ops(NATIVE)
    cache, ref = shared_cache(NATIVE, rng)
    p0, p1 = np.asarray(cache.page_table[0, :2]).tolist()
    n_free = int(cache.n_free[0])
    cache = op["release"](cache, jnp.asarray([True, False, False]))
    ref.release([True, False, False])
    assert int(cache.n_free[0]) == n_free and int(op["in_use"](cache)) == 3
    np.testing.assert_array_equal(np.asarray(cache.refs)[[p0, p1]], [1, 1])
    assert_refs(cache)
    assert_shared_reads(cache, ref, NATIVE)  # row 1 still reads row 0's entries
    # Row 1 now holds the half-filled page alone and writes it in place.
    new = random_new(rng, NATIVE, 3, 1)
    cache = op["append"](cache, new, jnp.asarray([0, 1, 0], jnp.int32))
    ref.append(new, [0, 1, 0])
    np.testing.assert_array_equal(np.asarray(cache.page_table[1, :2]), [p0, p1])
    cache = op["release"](cache, jnp.asarray([False, True, False]))
    ref.release([False, True, False])
    assert int(cache.n_free[0]) == n_free + 2
    np.testing.assert_array_equal(np.asarray(cache.free)[n_free:n_free + 2], [p0, p1])
    assert_refs(cache)
    # Reused next, top of the stack first.
    new = random_new(rng, NATIVE, 3, 5)
    cache = op["append"](cache, new, jnp.asarray([5, 0, 0], jnp.int32))
    ref.append(new, [5, 0, 0])
    np.testing.assert_array_equal(np.asarray(cache.page_table[0, :2]), [p1, p0])
    assert_shared_reads(cache, ref, NATIVE)

    # Three holders released in one call: each page drops by 3 and is pushed once, in
    # row-major order of its first holder; a share replaces a row's own pages (released).
    cache, ref = shared_cache(NATIVE, rng)
    p0, p1 = np.asarray(cache.page_table[0, :2]).tolist()
    (p2,) = np.asarray(cache.page_table[2, :1]).tolist()
    cache = op["share"](cache, jnp.asarray([False, False, True]),
                        cache.page_table[np.zeros(3, int)],
                        jnp.asarray([0, 0, 5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.refs)[[p0, p1, p2]], [3, 3, 0])
    n_free = int(cache.n_free[0])
    assert int(cache.free[n_free - 1]) == p2  # row 2's own page went back
    assert_refs(cache)
    cache = op["release"](cache, jnp.asarray([True, True, True]))
    assert int(cache.n_free[0]) == n_free + 2 and int(op["in_use"](cache)) == 0
    np.testing.assert_array_equal(np.asarray(cache.free)[n_free:n_free + 2], [p0, p1])
    assert_refs(cache)


def test_hold_keeps_pages_until_the_index_lets_go():
    """An index's references (`hold`): a held page outlives its row, is never written (the
    row copies its half-filled last page first) and goes free when the last hold drops."""
    rng = np.random.default_rng(13)
    op = share_ops(NATIVE)
    cache = paged.empty(dict(NATIVE), 2, 12, 4, jnp.float64)
    ref = Ref(NATIVE, 2)
    new = random_new(rng, NATIVE, 2, 6)
    cache = op["append"](cache, new, jnp.asarray([6, 0], jnp.int32))
    ref.append(new, [6, 0])
    p0, p1 = np.asarray(cache.page_table[0, :2]).tolist()
    ids = jnp.asarray([p0, p1, -1], jnp.int32)  # -1: ignored
    cache = op["hold"](cache, ids, 1)
    assert_refs(cache, held=[p0, p1])
    before = stored_pages(cache, [p0, p1])
    new = random_new(rng, NATIVE, 2, 1)
    cache = op["append"](cache, new, jnp.asarray([1, 0], jnp.int32))
    ref.append(new, [1, 0])
    p2 = int(cache.page_table[0, 1])
    assert p2 not in (p0, p1)
    assert_same_pages(stored_pages(cache, [p0, p1]), before)
    assert_refs(cache, held=[p0, p1])
    assert_shared_reads(cache, ref, NATIVE)
    # The row goes: its copy is freed, the held pages stay.
    n_free = int(cache.n_free[0])
    cache = op["release"](cache, jnp.asarray([True, False]))
    assert int(cache.n_free[0]) == n_free + 1 and int(cache.free[n_free]) == p2
    assert_refs(cache, held=[p0, p1])
    # A restored row reads the held entries (share from the index's table).
    table = jnp.asarray([[p0, p1, -1]] * 2, jnp.int32)
    cache = op["share"](cache, jnp.asarray([False, True]), table, jnp.asarray([0, 6], jnp.int32))
    ref.rows[1] = {name: list(v[:6]) for name, v in ref.rows[0].items()}
    ref.release([True, False])
    assert_refs(cache, held=[p0, p1])
    assert_shared_reads(cache, ref, NATIVE)
    # Per-id deltas and repeats: p1 gets two more, then the index drops three of p1 and one
    # of p0; only the row's references are left. Then the row goes: both are pushed.
    cache = op["hold"](cache, jnp.asarray([p1, p1, p0], jnp.int32), jnp.asarray([1, 1, 0]))
    assert_refs(cache, held=[p0, p1, p1, p1])
    cache = op["hold"](cache, jnp.asarray([p1, p0], jnp.int32), jnp.asarray([-3, -1]))
    assert_refs(cache)
    n_free = int(cache.n_free[0])
    cache = op["hold"](cache, jnp.asarray([p1, p0], jnp.int32), 1)
    cache = op["release"](cache, jnp.asarray([False, True]))
    assert int(cache.n_free[0]) == n_free
    cache = op["hold"](cache, jnp.asarray([p1, p0], jnp.int32), -1)
    assert int(cache.n_free[0]) == n_free + 2
    np.testing.assert_array_equal(np.asarray(cache.free)[n_free:n_free + 2], [p1, p0])
    assert_refs(cache)
    with pytest.raises(ValueError, match=r"\[G, N\]"):
        paged.hold(paged.empty(dict(NATIVE), 2, 12, 4, groups=2), jnp.asarray([0, 1]), 1)


def test_copy_on_write_is_all_or_nothing_under_a_small_pool():
    """The copy counts as one of the row's pages: a row that cannot get its copy and its
    new pages writes nothing and sets overflow; rows after it in row order wait, as for any
    need; a row whose copy fits proceeds."""
    rng = np.random.default_rng(14)
    op = share_ops(NATIVE)
    cache, ref = shared_cache(NATIVE, rng, n_pages=4)  # 3 pages held, 1 free
    assert int(cache.n_free[0]) == 1
    snapshot = jax.device_get(cache)
    new = random_new(rng, NATIVE, 3, 3)
    grown = op["append"](cache, new, jnp.asarray([0, 3, 0], jnp.int32))  # a copy and a page
    assert bool(grown.overflow.any())
    for got, want in zip(jax.tree.leaves(grown.replace(overflow=snapshot.overflow)),
                         jax.tree.leaves(snapshot)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The copy alone fits: row 1 takes the last page; row 2, needing one after it, waits.
    new = random_new(rng, NATIVE, 3, 2)
    cache = op["append"](cache, new, jnp.asarray([0, 1, 2], jnp.int32))
    ref.append(new, [0, 1, 0])
    assert bool(cache.overflow.any()) and int(cache.n_free[0]) == 0
    np.testing.assert_array_equal(np.asarray(cache.length), [6, 7, 3])
    assert_refs(cache)
    assert_shared_reads(cache, ref, NATIVE)


def test_a_sharer_that_skipped_the_copy_would_overwrite_the_others_entries(monkeypatch):
    """The mutant the copy-on-write tests must catch: with `_must_copy` always False, a
    sharer's append writes into the shared page and the other row reads its entry."""
    rng = np.random.default_rng(10)
    cache, ref = shared_cache(NATIVE, rng)
    shared = np.asarray(cache.page_table[0, :2]).tolist()
    before = stored_pages(cache, shared)
    monkeypatch.setattr(paged, "_must_copy", lambda *args: False)
    new = random_new(rng, NATIVE, 3, 2)
    # A new function, so it is traced anew: jax.jit(paged.append) would reuse the trace that
    # jax cached for paged.append itself, made with the real _must_copy.
    mutant = jax.jit(lambda c, x, n: paged.append(c, x, n))
    cache = mutant(cache, new, jnp.asarray([0, 1, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.page_table[0]), np.asarray(cache.page_table[1]))
    with pytest.raises(AssertionError):
        assert_same_pages(stored_pages(cache, shared), before)
    # Row 0's next entry slot now holds row 1's entry (visible once row 0 reaches it).
    vals, _ = ops(NATIVE)["read_all"]["entry"](cache.replace(length=cache.length.at[0].set(7)))
    np.testing.assert_array_equal(np.asarray(vals[0, 6]), np.asarray(new["entry"][1, 0]))


# -- the pool, modelled in numpy --------------------------------------------------------------
class PoolModel:
    """One pool group in plain numpy, written from the module's rules, not its code: a LIFO
    stack of free ids, pages popped per row in row order (a row's copy first), all or
    nothing per row against the running total of the rows' needs, refs per page, pushes of
    pages left with no holder in the order of their first dropped reference. `pages` holds
    the native field "entry"'s stored vectors, byte for byte."""

    def __init__(self, B, max_entries, ps, n_pages, width):
        self.ps, self.max_entries, self.n_pages = ps, max_entries, n_pages
        self.table = np.full((B, -(-max_entries // ps)), -1)
        self.length = np.zeros(B, int)
        self.stack = list(range(n_pages - 1, -1, -1))  # top = last: pages 0, 1, ... first
        self.refs = np.zeros(n_pages, int)
        self.overflow = False
        self.pages = np.zeros((n_pages, ps, width))
        self.copies = 0

    def _drop(self, ids):
        """Drop one reference per id (in order); push the pages left with none, each once,
        in the order of their first dropped reference."""
        for p in ids:
            self.refs[p] -= 1
        for p in dict.fromkeys(ids):
            if self.refs[p] == 0:
                self.stack.append(p)

    def append(self, new, n_new):
        ps, avail, total, grants = self.ps, len(self.stack), 0, []
        for b, n in enumerate(n_new):
            new_len = self.length[b] + n
            have = -(-self.length[b] // ps)
            fits = new_len <= self.max_entries
            last = self.table[b, have - 1] if have else -1
            copy = bool(fits and n > 0 and self.length[b] % ps and self.refs[last] > 1)
            need = -(-new_len // ps) - have + copy if fits else 0
            total += need
            granted = fits and (need == 0 or total <= avail)
            self.overflow |= n > 0 and not granted
            if granted:
                grants.append((b, n, have, copy, last, need))
        dropped = []
        for b, n, have, copy, last, need in grants:
            slots = range(have - copy, have - copy + need)
            for s in slots:
                p = self.stack.pop()
                self.table[b, s] = p
                self.refs[p] = 1
            if copy:
                self.pages[self.table[b, have - 1]] = self.pages[last]
                dropped.append(last)
                self.copies += 1
            for i in range(n):
                pos = self.length[b] + i
                self.pages[self.table[b, pos // ps], pos % ps] = new[b, i]
            self.length[b] += n
        self._drop(dropped)

    def release(self, rows):
        held = [p for b in np.flatnonzero(rows) for p in self.table[b] if p >= 0]
        self.table[rows] = -1
        self.length[rows] = 0
        self._drop(held)

    def share(self, rows, tables, lengths):
        for b in np.flatnonzero(rows):
            for p in tables[b, :-(-lengths[b] // self.ps)]:
                self.refs[p] += 1
        self.release(rows)
        for b in np.flatnonzero(rows):
            k = -(-lengths[b] // self.ps)
            self.table[b] = -1
            self.table[b, :k] = tables[b, :k]
            self.length[b] = lengths[b]

    def hold(self, ids, delta):
        for p in ids:
            self.refs[p] += max(delta, 0)
        self._drop([p for p in ids for _ in range(max(-delta, 0))])

    def assert_equals(self, cache, rows, group):
        """`cache`'s group `group` (rows `rows`) equals this model, leaf by leaf."""
        per = self.n_pages
        at = slice(group * per, (group + 1) * per)
        np.testing.assert_array_equal(np.asarray(cache.page_table)[rows], self.table)
        np.testing.assert_array_equal(np.asarray(cache.length)[rows], self.length)
        assert int(cache.n_free[group]) == len(self.stack)
        np.testing.assert_array_equal(np.asarray(cache.free)[at],
                                      self.stack + [-1] * (per - len(self.stack)))
        np.testing.assert_array_equal(np.asarray(cache.refs)[at], self.refs)
        assert bool(cache.overflow[group]) == self.overflow
        np.testing.assert_array_equal(np.asarray(cache.pages["entry"]["v"])[at], self.pages)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("sharing", [False, True], ids=["alone", "shared"])
def test_random_operations_follow_a_model_of_the_pool(sharing, groups):
    """Random appends and releases on a small pool (overflow included), and with `sharing`
    also shares (a row takes a prefix of another row of its group) and holds (an index
    keeps a row's pages, later drops them): the cache equals PoolModel after every step,
    page tables, lengths, free stacks, refs, overflow and every stored byte. Without
    sharing this is today's allocator: refs are 1 for held pages, no copy is made."""
    rng = np.random.default_rng(20 + groups + 2 * sharing)
    fields_items = (("entry", Field("native", 3, 0)),)
    op = share_ops(fields_items)
    B, max_entries, ps, E, n_pages = 4 * groups, 14, 3, 5, 9 * groups
    per_b, per_p = B // groups, n_pages // groups
    cache = paged.empty(dict(fields_items), B, max_entries, ps, jnp.float64, n_pages=n_pages,
                        groups=groups)
    models = [PoolModel(per_b, max_entries, ps, per_p, 3) for _ in range(groups)]
    ref = Ref(fields_items, B)
    held = [[] for _ in range(groups)]  # the index's holds per group: lists of page ids
    for step in range(40):
        kind = rng.choice(["append", "append", "release", "share", "hold"][:5 if sharing else 3])
        if kind == "append":
            n_new = rng.integers(0, E + 1, size=B)
            new = rng.normal(size=(B, E, 3))
            cache = op["append"](cache, {"entry": jnp.asarray(new)}, jnp.asarray(n_new))
            for g, m in enumerate(models):
                m.append(new[g * per_b:(g + 1) * per_b], n_new[g * per_b:(g + 1) * per_b])
            granted = np.asarray(cache.length) - np.asarray(ref.lengths())
            ref.append({"entry": jnp.asarray(new)}, granted.tolist())
        elif kind == "release":
            rows = rng.random(B) < 0.4
            cache = op["release"](cache, jnp.asarray(rows))
            for g, m in enumerate(models):
                m.release(rows[g * per_b:(g + 1) * per_b])
            ref.release(rows)
        elif kind == "share":
            rows = rng.random(B) < 0.4
            src = np.asarray([g * per_b + rng.integers(per_b) for g in np.arange(B) // per_b])
            lengths = np.asarray([rng.integers(ref.lengths()[s] + 1) for s in src])
            tables = np.asarray(cache.page_table)[src]
            cache = op["share"](cache, jnp.asarray(rows), jnp.asarray(tables),
                                jnp.asarray(lengths))
            for g, m in enumerate(models):
                r = slice(g * per_b, (g + 1) * per_b)
                m.share(rows[r], tables[r], lengths[r])
            old = list(ref.rows)
            for b in np.flatnonzero(rows):
                ref.rows[b] = {n: list(v[:lengths[b]]) for n, v in old[src[b]].items()}
        else:  # hold: take a row's pages, or drop an earlier hold
            ids, delta = np.full((groups, 5), -1), 1 if rng.random() < 0.6 else -1
            for g, m in enumerate(models):
                if delta > 0:
                    row = m.table[rng.integers(per_b)]
                    taken = row[row >= 0][:5]
                    held[g].append(taken)
                elif held[g]:
                    taken = held[g].pop(rng.integers(len(held[g])))
                else:
                    taken = np.zeros(0, int)
                ids[g, :len(taken)] = taken
                m.hold(list(taken), delta)
            cache = op["hold"](cache, jnp.asarray(ids if groups > 1 else ids[0]), delta)
        for g, m in enumerate(models):
            m.assert_equals(cache, slice(g * per_b, (g + 1) * per_b), g)
        assert_shared_reads(cache, ref, fields_items)
        if groups == 1:
            assert_refs(cache, [p for h in held[0] for p in h])
    assert bool(cache.overflow.any())  # the small pool ran out at least once
    if sharing:
        assert sum(m.copies for m in models) > 0  # copies on write were made
    else:
        assert set(np.unique(np.asarray(cache.refs))) <= {0, 1}
