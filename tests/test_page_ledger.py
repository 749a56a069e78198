"""The host's page ledger (serve/pool.PageLedger) counts what the device's PagedCache holds:
random appends, shares of one row's prefix into another, holds and releases on a small pool,
applied to both, agree after every operation on each row's pages (handles mapped one to one
onto physical ids), which slots are shared (each page's refs), the free count and which rows
an append grants (all or nothing per row). Named cases: two rows sharing a partly filled
page both append in one step (two copies; the old page goes free unless held), and the
single-owner assertion."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn.cache import paged
from dsattn.cache.paged import Field
from dsattn.serve.pool import PageLedger, PoolLayer

FIELDS = {"entry": Field("native", 1, 0)}
OPS = {"append": jax.jit(paged.append), "release": jax.jit(paged.release),
       "share": jax.jit(paged.share), "hold": jax.jit(paged.hold)}


class Pair:
    """A device cache and its ledger, run through the same operations."""

    def __init__(self, rows, max_entries, page_size, n_pages, width=6):
        self.cache = paged.empty(FIELDS, rows, max_entries, page_size, n_pages=n_pages)
        self.ledger = PageLedger(PoolLayer(0, 1, page_size, n_pages), rows, max_entries)
        self.rows, self.width = rows, width
        self.held = []  # the holds: (handle, page id)

    def append(self, n_new):
        n_new = np.asarray(n_new)
        before = np.asarray(self.cache.page_table).copy()
        length = np.asarray(self.cache.length).copy()
        copies = self.ledger.copies_for(n_new)
        self.ledger.assert_single_owner(n_new)
        new = {"entry": jnp.zeros((self.rows, self.width, 1))}
        self.cache = OPS["append"](self.cache, new, jnp.asarray(n_new, jnp.int32))
        granted = self.ledger.append(n_new)
        grew = np.asarray(self.cache.length) != length
        np.testing.assert_array_equal(granted & (n_new > 0), grew)
        after, ps = np.asarray(self.cache.page_table), self.cache.page_size
        for b in np.flatnonzero(granted & copies):  # the device copied those rows' pages
            assert after[b, length[b] // ps] != before[b, length[b] // ps]
        return granted

    def release(self, rows):
        self.cache = OPS["release"](self.cache, jnp.asarray(rows))
        self.ledger.release(rows)

    def share(self, row, src, length):
        table = np.asarray(self.cache.page_table)
        rows = np.arange(self.rows) == row
        self.cache = OPS["share"](self.cache, jnp.asarray(rows),
                                  jnp.asarray(np.broadcast_to(table[src], table.shape)),
                                  jnp.full((self.rows,), length, jnp.int32))
        self.ledger.share(row, list(self.ledger.tables[src]), length)

    def hold(self, pairs, delta):
        ids = np.full(8, -1)
        ids[:len(pairs)] = [p for _, p in pairs]
        self.cache = OPS["hold"](self.cache, jnp.asarray(ids), delta)
        self.ledger.hold([h for h, _ in pairs], delta)

    def row_pairs(self, b):
        """(handle, page id) of each of row b's slots."""
        table = np.asarray(self.cache.page_table)[b]
        return list(zip(self.ledger.tables[b], table[table >= 0].tolist()))

    def check(self):
        """The ledger agrees with the device: lengths, each row's pages (a one-to-one map of
        handles onto ids over every row slot and hold), refs per page and so which slots are
        shared, the free count, overflow."""
        c, led = self.cache, self.ledger
        table, refs = np.asarray(c.page_table), np.asarray(c.refs)
        np.testing.assert_array_equal(np.asarray(c.length), led.length)
        ids = {}
        for b in range(self.rows):
            assert len(led.tables[b]) == int((table[b] >= 0).sum())
            assert (table[b, len(led.tables[b]):] == -1).all()
            assert led.shared(b) == [bool(refs[p] > 1) for _, p in self.row_pairs(b)]
        for h, p in [x for b in range(self.rows) for x in self.row_pairs(b)] + self.held:
            assert ids.setdefault(h, p) == p, f"handle {h} maps to pages {ids[h]} and {p}"
        assert len(set(ids.values())) == len(ids), "two handles on one page"
        assert set(ids) == set(led.refs)  # every live handle is held by a row or a hold
        for h, p in ids.items():
            assert led.refs[h] == refs[p], f"handle {h} (page {p}): {led.refs[h]} vs {refs[p]}"
        assert led.free == int(c.n_free.sum()) == c.n_pages - int(paged.pages_in_use(c))
        assert led.overflow == bool(c.overflow.any())


@pytest.mark.parametrize("seed", range(3))
def test_random_operations_agree_with_the_device(seed):
    rng = np.random.default_rng(seed)
    rows, max_entries, ps, n_pages = 4, 14, 3, 10
    pair = Pair(rows, max_entries, ps, n_pages)
    pair.check()
    for _ in range(60):
        kind = rng.choice(["append", "append", "append", "share", "share", "hold", "release"])
        if kind == "append":
            pair.append(rng.integers(0, pair.width + 1, size=rows) * (rng.random(rows) < 0.7))
        elif kind == "share":
            row, src = rng.integers(rows, size=2)
            pair.share(row, src, int(rng.integers(pair.ledger.length[src] + 1)))
        elif kind == "hold":
            if pair.held and rng.random() < 0.4:
                pair.hold([pair.held.pop(rng.integers(len(pair.held)))], -1)
            else:
                taken = pair.row_pairs(rng.integers(rows))[:3]
                pair.hold(taken, 1)
                pair.held += taken
        else:
            pair.release(rng.random(rows) < 0.4)
        pair.check()
    assert pair.ledger.overflow  # the small pool ran out
    assert pair.ledger.copies > 0  # shared partly filled pages were copied on write


def test_sharers_of_a_partial_page_both_append_in_one_step():
    """Rows 0 and 1 share a full page and a half-filled one; both append in one step: each
    copies the half-filled page (two copies), which then has no holder and goes free; with a
    hold on it, it stays."""
    for held in (False, True):
        pair = Pair(rows=3, max_entries=12, page_size=4, n_pages=8)
        pair.append([6, 0, 0])
        pair.share(1, 0, 6)
        pair.check()
        assert pair.ledger.shared(0) == pair.ledger.shared(1) == [True, True]
        assert pair.ledger.free == 6
        if held:
            taken = pair.row_pairs(0)[1:]
            pair.hold(taken, 1)
            pair.held += taken
        np.testing.assert_array_equal(pair.ledger.copies_for([1, 1, 0]), [True, True, False])
        assert pair.append([1, 1, 0]).all()
        pair.check()
        assert pair.ledger.copies == 2
        assert pair.ledger.shared(0) == pair.ledger.shared(1) == [True, False]
        assert pair.ledger.free == 8 - 3 - held  # the full page, two copies (and the held one)


def test_an_append_is_all_or_nothing_per_row_on_a_small_pool():
    """A row whose pages (its copy included) do not fit appends nothing; the rows after it
    in row order wait too (their running total includes its need), as on the device."""
    pair = Pair(rows=3, max_entries=12, page_size=4, n_pages=4, width=10)
    pair.append([2, 0, 0])
    pair.share(1, 0, 2)  # row 1 shares row 0's half-filled page
    assert pair.ledger.needs([1, 9, 1]).tolist() == [1, 3, 1]  # copy; copy + 2; 1
    granted = pair.append([1, 9, 1])  # free 3: row 0 (1), row 1 (cum 4) refused, row 2 too
    pair.check()
    assert granted.tolist() == [True, False, False] and pair.ledger.overflow
    assert pair.ledger.length.tolist() == [3, 2, 0]


def test_single_owner_is_asserted_when_no_copy_is_planned():
    pair = Pair(rows=2, max_entries=12, page_size=4, n_pages=6)
    pair.append([6, 0])
    pair.share(1, 0, 6)
    pair.ledger.assert_single_owner([1, 0])  # the device's rule plans row 0's copy
    pair.ledger.assert_single_owner([0, 0])
    with pytest.raises(AssertionError, match="row 0 would write slot 1.*single-owner"):
        pair.ledger.assert_single_owner([1, 0], copies=[False, False])
    pair.share(1, 0, 4)  # a full page shared: appending writes only new pages
    pair.ledger.assert_single_owner([0, 3], copies=[False, False])
