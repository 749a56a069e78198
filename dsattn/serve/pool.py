"""The host's view of a decode state's page pools: which layers keep a paged global cache,
how many pages a row holds after n positions (so admission and preemption are decided
before a step runs, never by an append that finds the pool empty), and pools sized to a
number of tokens rather than to every row's max_len.

A layer of stride s (plan.LayerSpec.stride: 1 for DSA's tokens, the ratio m for compressed
entries) holds n // s complete entries after n positions, ceil(that / page_size) pages.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dsattn import plan
from dsattn.cache.protocol import PagePool, is_container
from dsattn.model import DecodeState, layer_caches, with_layer_caches


@dataclasses.dataclass(frozen=True)
class PoolLayer:
    """One layer's page pool, as the host accounts for it."""

    layer: int
    stride: int
    page_size: int
    n_pages: int

    def pages(self, positions) -> np.ndarray:
        """Pages a row holds after `positions` positions (any shape)."""
        entries = np.asarray(positions, np.int64) // self.stride
        return -(-entries // self.page_size)


def _pool_of(layer_cache) -> PagePool | None:
    """The page pool of a layer's caches (cache.protocol's `page_pool`): its first pooled
    container's; None if none is pooled."""
    found = [c.page_pool() for c in jax.tree.leaves(layer_cache, is_leaf=is_container)
             if is_container(c) and c.page_pool() is not None]
    return found[0] if found else None


def pool_layers(cfg, state: DecodeState) -> tuple[PoolLayer, ...]:
    """The layers of `state` that own a paged cache, or any container declaring a page
    pool (cache.protocol's `page_pool`; borrowers read another layer's)."""
    out = []
    for spec, lc in zip(plan.resolve(cfg), layer_caches(cfg, state)):
        p = _pool_of(lc)
        if p is not None:
            out.append(PoolLayer(spec.index, spec.stride, p.page_size, p.n_pages))
    return tuple(out)


def with_pool(cfg, state: DecodeState, pool_tokens: int) -> DecodeState:
    """An EMPTY `state` whose paged layers each hold pages for `pool_tokens` positions in
    all (shared by the rows) instead of every row's max_len: ceil(pool_tokens / stride /
    page_size) pages, never more than the state has."""
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be >= 1, got {pool_tokens}")
    specs = plan.resolve(cfg)

    def shrink(spec, c):
        p = c.page_pool() if is_container(c) else None
        if p is None:
            return c
        return c.with_pages(min(p.n_pages, max(1, math.ceil(pool_tokens / spec.stride
                                                             / p.page_size))))

    caches = [jax.tree.map(lambda c, s=spec: shrink(s, c), lc, is_leaf=is_container)
              for spec, lc in zip(specs, layer_caches(cfg, state))]
    return with_layer_caches(cfg, state, caches).replace(host_pos=state.host_pos)


class PageLedger:
    """The host's mirror of one pool layer's page references (one pool group: the
    scheduler's, off a mesh), over symbolic page handles: the device picks the physical
    ids (paged.py) and the host never reads them. It runs paged.py's operations, in the
    same order and by the same rules, on entries (n // stride of n positions): a row's
    new pages as it appends, all or nothing per row in row order; a copy of a shared
    partly filled last page before a row writes it (`copies`, paged._must_copy's rule),
    whose old page loses that holder and goes free when every holder copied it in one step;
    `release`, `hold` and `share`. So admission and preemption count pages as the device
    will hold them, shared ones once: `free` = n_pages - live handles."""

    def __init__(self, layer: PoolLayer, rows: int, max_entries: int | None = None):
        self.layer, self.n_pages, self.page_size = layer, layer.n_pages, layer.page_size
        self.max_entries = max_entries  # None: not checked (the scheduler's max_len is)
        self.tables: list[list[int]] = [[] for _ in range(rows)]  # handles per row
        self.length = np.zeros(rows, np.int64)  # entries per row
        self.refs: dict[int, int] = {}  # live handle -> holders (row slots and holds)
        self.overflow = False  # sticky, as the device's: an append was refused
        self.copies = 0  # pages copied on write so far
        self.held: dict[int, int] = {}  # handle -> references `hold` took (a prefix index's)
        self._next = 0

    @property
    def free(self) -> int:
        return self.n_pages - len(self.refs)

    def shared(self, row: int) -> list[bool]:
        """Which of the row's page slots another holder holds too (refs > 1)."""
        return [self.refs[h] > 1 for h in self.tables[row]]

    def _new(self) -> int:
        self._next += 1
        self.refs[self._next] = 1
        return self._next

    def _drop(self, handles) -> None:
        for h in handles:
            if self.refs.get(h, 0) < 1:
                raise AssertionError(f"page ledger: handle {h} dropped but not held")
            self.refs[h] -= 1
            if self.refs[h] == 0:
                del self.refs[h]

    def _n(self, n_new) -> np.ndarray:
        return np.clip(np.broadcast_to(np.asarray(n_new, np.int64), self.length.shape), 0, None)

    def _fits(self, n) -> np.ndarray:
        new_len = self.length + n
        return (np.ones(n.shape, bool) if self.max_entries is None
                else new_len <= self.max_entries)

    def copies_for(self, n_new) -> np.ndarray:
        """bool [rows]: the rows whose append of `n_new` entries [rows] copies its last page
        first: it appends something into a partly filled last page that someone else holds
        too (paged._must_copy, on the refs before the step)."""
        n = self._n(n_new)
        last = [self.refs[t[-1]] if t else 0 for t in self.tables]
        return (n > 0) & (self.length % self.page_size != 0) & (np.array(last) > 1)

    def needs(self, n_new) -> np.ndarray:
        """int [rows]: pages each row's append of `n_new` [rows] entries pops, its copy
        included (0 for a row that would pass max_entries)."""
        n, ps = self._n(n_new), self.page_size
        have = -(-self.length // ps)
        need = -(-(self.length + n) // ps) - have + self.copies_for(n)
        return np.where(self._fits(n), need, 0)

    def append(self, n_new) -> np.ndarray:
        """Append `n_new` [rows] entries per row, as paged.append: rows needing pages are
        granted in row order while the running total of needs fits the free pages; a row
        not granted (or past max_entries) appends nothing and sets `overflow`. Returns
        which rows were granted (bool [rows])."""
        n, ps = self._n(n_new), self.page_size
        copy, need, fits = self.copies_for(n), self.needs(n), self._fits(n)
        granted = fits & ((need == 0) | (np.cumsum(need) <= self.free))
        self.overflow |= bool(np.any((n > 0) & ~granted))
        dropped = []
        for b in np.flatnonzero(granted):
            table = self.tables[b]
            if copy[b]:
                dropped.append(table[-1])
                table[-1] = self._new()
                self.copies += 1
            table.extend(self._new() for _ in range(need[b] - copy[b]))
            self.length[b] += n[b]
            assert len(table) == -(-self.length[b] // ps)
        self._drop(dropped)  # after every row's pops, as the device pushes them
        return granted

    def release(self, rows) -> None:
        """Drop the page references of the rows where `rows` [rows] is True (their holders
        among them each drop one) and reset them, as paged.release."""
        for b in np.flatnonzero(np.broadcast_to(np.asarray(rows, bool), self.length.shape)):
            self._drop(self.tables[b])
            self.tables[b], self.length[b] = [], 0

    def hold(self, handles, delta: int) -> None:
        """References taken (delta > 0) or dropped (delta < 0) by something other than a
        row (a prefix index), `delta` per handle, repeats counted, as paged.hold."""
        for h in handles:
            if delta > 0:
                if h not in self.refs:
                    raise AssertionError(f"page ledger: hold of handle {h}, which is free")
                self.refs[h] += delta
            else:
                if self.held.get(h, 0) < -delta:
                    raise AssertionError(f"page ledger: hold of handle {h} dropped by "
                                         f"{-delta}, but only {self.held.get(h, 0)} taken")
                self._drop([h] * -delta)
            self.held[h] = self.held.get(h, 0) + delta
            if not self.held[h]:
                del self.held[h]

    def share(self, row: int, handles, length: int) -> None:
        """Row `row` takes the table prefix `handles[:ceil(length / page_size)]` and length
        `length` (a restored or forked row), each page gaining a holder; its earlier pages
        are released after, as paged.share."""
        length = length if self.max_entries is None else min(length, self.max_entries)
        taken = list(handles)[:-(-length // self.page_size)]
        if len(taken) < -(-length // self.page_size) or any(h not in self.refs for h in taken):
            raise AssertionError(f"page ledger: row {row} shares pages {taken} for {length} "
                                 f"entries, not all of them held")
        for h in taken:
            self.refs[h] += 1
        self.release(np.arange(len(self.tables)) == row)
        self.tables[row], self.length[row] = taken, length

    def assert_single_owner(self, n_new, copies=None) -> None:
        """Raise AssertionError if appending `n_new` [rows] entries would write a page slot
        that another holder holds too with no copy planned (`copies` [rows]: the rows that
        copy their last page first; default the device's rule, `copies_for`). A row writes
        its slots from length // page_size on; every later one is new."""
        n = self._n(n_new)
        copies = self.copies_for(n) if copies is None else np.asarray(copies, bool)
        for b in np.flatnonzero(n > 0):
            first = int(self.length[b] // self.page_size)
            for slot, h in enumerate(self.tables[b][first:], first):
                if self.refs[h] > 1 and not (copies[b] and slot == len(self.tables[b]) - 1):
                    raise AssertionError(
                        f"page ledger: row {b} would write slot {slot} of pool layer "
                        f"{self.layer.layer}, page {h} held {self.refs[h]} times, with no copy "
                        f"planned (the single-owner rule)")
