"""Global (paged) cache: compressed entries, search keys and MLA latents in a shared page pool.

A pool of ``n_pages`` pages of ``page_size`` entries is shared by all rows of a batch. Every
row has a page table (page id per page slot, -1 = unassigned) and a length (entries stored).
Entry ``i`` of row ``b`` lives at ``pages[page_table[b, i // page_size], i % page_size]``.
Several named fields (e.g. the main entry and the indexer's search key) share one page table
and one length; each is stored in its own cache format (``dsattn/cache/formats.py``).

The cache is a `PagedCache` pytree (all functions pure, jit-compatible, static shapes)::

    pages        {name: formats.empty(fmt, (n_pages, page_size), width, rope, dtype)}
    page_table   int32 [B, pages_per_row]      pages_per_row = ceil(max_entries / page_size)
    length       int32 [B]                     entries stored per row
    free         int32 [n_pages]               stack of free page ids: free[:n_free] are free,
                                               the top (next popped) is free[n_free-1]; slots
                                               >= n_free hold -1
    n_free       int32 [G]                     free pages per pool group (below)
    refs         int32 [n_pages]               each page's holders: the page tables' slots
                                               pointing at it plus the references taken by
                                               `hold` (a prefix index's); 0 = free (on the
                                               stack), laid out like ``free`` (local ids)
    overflow     bool [G]                      sticky: an append could not get a page (pool
                                               exhausted) or would pass max_entries
    fields, page_size, max_entries             static (not pytree leaves): the stored fields'
                                               formats and widths, and the geometry

Pool groups (``groups`` G, default 1): the rows are split into G equal consecutive blocks
and the pool into G equal page ranges; block g's rows take pages only from range g, and its
page table holds ids local to the range (the free stack and ``refs`` likewise: ``free`` is G
stacks of n_pages / G local ids). So no row ever points into another block's pages: with the
rows and the pages split the same way across devices (dsattn.sharding), every read and write
stays on its device. Every function runs per group (``jax.vmap``) on one group's pool.

Allocation happens lazily in ``append``: a row holds exactly ceil(length / page_size) pages,
popped from the free stack in row order (a cumulative sum of the rows' needs; deterministic),
each with refs 1. A page may have several holders (``share``: a row takes another's table
prefix; ``hold``: an index keeps pages), and the single-owner rule applies: a row writes
only pages it alone holds. A row appending into a partly filled last page with refs > 1
(`_must_copy`) first pops one more page, copies the old page's stored arrays there and
points its slot at the copy (old refs - 1, new 1); the copy is popped before the row's new
pages. An append is all-or-nothing per row: a row whose pages (its copy included) cannot be
granted, or whose new length would pass max_entries, keeps its length and writes nothing,
and ``overflow`` is set; other rows proceed. Call ``check(cache)`` on the host after a step
to turn overflow into a ``CacheExhausted`` error. Without sharing no page has refs > 1 and
no copy is made.

Reads (``gather``, ``read_all``) are masked by length: an index outside [0, length[b]) reads
as zeros with valid False, whatever bytes a recycled page still holds. ``release`` drops a
row's references and pushes the pages left with none back on the free stack (LIFO, so they
are reused first) without clearing them; a row that later gets such a page only ever reads
indices below its own length, all of which it has written itself (or, through ``share``,
the rows it shares them with wrote, and nobody writes them while they are shared).
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.core import FrozenDict

from dsattn.cache import formats
from dsattn.cache.protocol import Container, PagePool, batch_axes, flat_rows
from dsattn.errors import CacheExhausted  # noqa: F401  (re-exported)


class Field(NamedTuple):
    """One stored field: cache format, vector width and its number of trailing rotary dims."""

    fmt: str
    width: int
    rope: int = 0


@struct.dataclass
class PagedCache(Container):
    pages: dict  # name -> the format's stored arrays [n_pages, page_size, ...]
    page_table: jax.Array
    length: jax.Array
    free: jax.Array
    n_free: jax.Array
    refs: jax.Array
    overflow: jax.Array
    fields: FrozenDict = struct.field(pytree_node=False)  # name -> Field
    page_size: int = struct.field(pytree_node=False)
    max_entries: int = struct.field(pytree_node=False)

    storage = "pages"  # the stored vectors (cache.protocol)

    @property
    def n_pages(self) -> int:
        return self.free.shape[-1]

    @property
    def groups(self) -> int:
        return self.n_free.shape[-1] if self.n_free.ndim else 1

    def gather(self, name: str, idx, dtype=jnp.float32):
        """``gather`` as a method: the paged cache is one of the stores attention reads
        (attention/reads.py)."""
        return gather(self, name, idx, dtype)

    def read_all(self, name: str, dtype=jnp.float32):
        return read_all(self, name, dtype)

    def split_rows(self, groups: int) -> "PagedCache":
        return regroup(self, groups)

    def check(self) -> None:
        check(self)

    def page_pool(self) -> PagePool:
        return PagePool(self.page_size, self.n_pages)

    def with_pages(self, n: int) -> "PagedCache":
        """This EMPTY cache with a pool of its first `n` pages, every one free, in one pool
        group (`split_rows` splits it)."""
        return regroup(self.replace(pages=jax.tree.map(lambda a: a[:n], self.pages),
                                    free=jnp.zeros((n,), jnp.int32),
                                    refs=jnp.zeros((n,), jnp.int32)), 1)

    def cleared(self, rows, blank) -> "PagedCache":
        """The rows' pages released (`release`); `blank` is not needed."""
        return release(self, rows)

    def retained(self, rows) -> "PagedCache":
        """Each page the rows hold gains a holder (`hold` + 1 over their tables)."""
        ids = jnp.where(jnp.asarray(rows, bool)[:, None], self.page_table, -1)
        return hold(self, ids.reshape(self.groups, -1), 1)

    def filled(self, n: int, stride: int, rand) -> "PagedCache":
        """n // stride entries appended to every row."""
        e, b = n // stride, self.length.shape[-1]
        new = {f: rand((b, e, fld.width), jnp.float32) for f, fld in self.fields.items()}
        return _append_jit(self, new, jnp.full((b,), e, jnp.int32))


def empty(fields: Mapping[str, Field], batch: int, max_entries: int, page_size: int,
          dtype=jnp.float32, n_pages: int | None = None, groups: int = 1) -> PagedCache:
    """An empty paged cache for ``batch`` rows of up to ``max_entries`` entries each.

    ``n_pages`` defaults to batch * ceil(max_entries / page_size), which never runs out;
    a smaller pool is allowed (appends then may overflow, see ``check``). ``dtype`` is the
    storage dtype of "native" fields. ``groups`` splits rows and pool (module docstring).
    """
    if page_size <= 0 or max_entries <= 0 or batch <= 0:
        raise ValueError(f"paged.empty: batch ({batch}), max_entries ({max_entries}) and "
                         f"page_size ({page_size}) must be positive")
    per_row = math.ceil(max_entries / page_size)
    if n_pages is None:
        n_pages = batch * per_row
    if n_pages <= 0:
        raise ValueError(f"paged.empty: n_pages must be positive, got {n_pages}")
    for name, f in fields.items():
        formats.check_width(f.fmt, f.width, f.rope, f"paged field {name!r}")
    cache = PagedCache(
        pages={name: formats.empty(f.fmt, (n_pages, page_size), f.width, f.rope, dtype)
               for name, f in fields.items()},
        page_table=jnp.full((batch, per_row), -1, jnp.int32),
        length=jnp.zeros((batch,), jnp.int32), free=jnp.zeros((n_pages,), jnp.int32),
        n_free=jnp.zeros((1,), jnp.int32), refs=jnp.zeros((n_pages,), jnp.int32),
        overflow=jnp.zeros((1,), bool),
        fields=FrozenDict(fields), page_size=page_size, max_entries=max_entries)
    return regroup(cache, groups)


def regroup(cache: PagedCache, groups: int) -> PagedCache:
    """An EMPTY cache (as `empty` or a model's init_cache makes it, any leading axes) with
    its rows and pool split into `groups` (for a mesh: one group per row shard), every page
    free: ``free``, ``n_free``, ``refs`` and ``overflow`` are made anew, sized by the pool's
    page count (``free``'s last axis)."""
    batch, n_pages = cache.length.shape[-1], cache.n_pages
    if groups <= 0 or batch % groups or n_pages % groups:
        raise ValueError(f"paged: {groups} pool groups must divide the batch ({batch}) and "
                         f"the pool ({n_pages} pages)")
    lead, per = cache.free.shape[:-1], n_pages // groups
    # Each group's stack reversed, so that a fresh pool hands out pages 0, 1, 2, ... in order.
    free = jnp.tile(jnp.arange(per - 1, -1, -1, dtype=jnp.int32), groups)
    return cache.replace(free=jnp.broadcast_to(free, lead + (n_pages,)),
                         n_free=jnp.full(lead + (groups,), per, jnp.int32),
                         refs=jnp.zeros(lead + (n_pages,), jnp.int32),
                         overflow=jnp.zeros(lead + (groups,), bool))


def _is_array(x) -> bool:
    """A stored array or an array-like view of one (cache.protocol)."""
    return hasattr(x, "shape")


def _split_rows(x, g: int, axis: int = 0):
    return x.reshape(x.shape[:axis] + (g, x.shape[axis] // g) + x.shape[axis + 1:])


def _join_rows(x, axis: int = 0):
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _by_group(fn, cache: PagedCache, *rows, returns_cache: bool = True):
    """`fn(one group's cache, *its rows)` for every pool group (vmapped), joined back. A
    group's cache has one pool of n_pages / G pages, with scalar n_free and overflow."""
    g = cache.groups
    grouped = cache.replace(pages=jax.tree.map(lambda x: _split_rows(x, g), cache.pages,
                                               is_leaf=_is_array),
                            page_table=_split_rows(cache.page_table, g),
                            length=_split_rows(cache.length, g),
                            free=_split_rows(cache.free, g), refs=_split_rows(cache.refs, g))
    axes = cache.replace(pages=batch_axes(cache.pages, 0), page_table=0, length=0, free=0,
                         n_free=0, refs=0, overflow=0)
    rows = [jax.tree.map(lambda x: _split_rows(x, g), r) for r in rows]
    out = jax.vmap(fn, in_axes=(axes,) + (0,) * len(rows),
                   out_axes=axes if returns_cache else 0)(grouped, *rows)
    if not returns_cache:
        return jax.tree.map(_join_rows, out)
    return out.replace(pages=jax.tree.map(_join_rows, out.pages, is_leaf=_is_array),
                       page_table=_join_rows(out.page_table), length=_join_rows(out.length),
                       free=_join_rows(out.free), refs=_join_rows(out.refs))


def _ceil_div(a, b: int):
    return (a + (b - 1)) // b


def append(cache: PagedCache, new: Mapping[str, jax.Array], n_new) -> PagedCache:
    """Append each row's first ``n_new[b]`` entries of ``new[name]`` [B, E, width].

    Every field of the cache must be given (they share one length). ``n_new`` is clipped to
    [0, E]. Rows needing pages get them from their group's free stack in row order, each
    page with refs 1; a row appending into a partly filled last page that others hold too
    (refs > 1, `_must_copy`) writes into a copy of it, popped first (module docstring). A
    row that cannot get all the pages it needs, its copy included, or would pass
    max_entries, writes nothing, keeps its length, and sets its group's ``overflow``.
    """
    fields = cache.fields
    if set(new) != set(fields):
        raise ValueError(f"paged.append: got fields {sorted(new)}, cache has {sorted(fields)}")
    B = cache.length.shape[0]
    E = next(iter(new.values())).shape[1]
    for name, x in new.items():
        if x.shape[:2] != (B, E) or x.shape[-1] != fields[name].width:
            raise ValueError(f"paged.append: field {name!r} has shape {x.shape}, expected "
                             f"({B}, {E}, {fields[name].width})")
    n = jnp.broadcast_to(jnp.asarray(n_new, jnp.int32), (B,))
    return _by_group(_append, cache, dict(new), n)


def _must_copy(n_new, length, last_refs, page_size: int):
    """bool [B]: whether a row's append must first copy its last page (the single-owner
    rule): it appends something (``n_new`` > 0) into a partly filled last page (``length``
    not a multiple of ``page_size``) that someone else holds too (``last_refs`` > 1: that
    page's refs; 0 for a row holding no page)."""
    return (n_new > 0) & (length % page_size != 0) & (last_refs > 1)


def _append(cache: PagedCache, new: Mapping[str, jax.Array], n_new) -> PagedCache:
    fields = cache.fields
    n_pages, ps, max_entries = cache.n_pages, cache.page_size, cache.max_entries
    table, length = cache.page_table, cache.length
    B, per_row = table.shape
    E = next(iter(new.values())).shape[1]
    n_free = cache.n_free

    n = jnp.clip(jnp.asarray(n_new, jnp.int32).reshape(B), 0, E)
    new_len = length + n
    fits = new_len <= max_entries
    have = _ceil_div(length, ps)  # pages a row holds
    last = jnp.take_along_axis(table, jnp.clip(have - 1, 0, per_row - 1)[:, None], 1)[:, 0]
    last = jnp.where(have > 0, last, -1)  # the row's last page (-1: none)
    last_refs = jnp.where(last >= 0, cache.refs[jnp.maximum(last, 0)], 0)
    copy = fits & jnp.broadcast_to(jnp.asarray(_must_copy(n, length, last_refs, ps), bool),
                                   (B,))
    need = jnp.where(fits, _ceil_div(new_len, ps) - have + copy, 0)
    cum = jnp.cumsum(need)  # inclusive, row order
    start = cum - need
    # Rows needing pages are granted while the running total fits: granted rows with need > 0
    # form a prefix of the needing rows, so their `start` offsets are exact.
    granted = fits & ((need == 0) | (cum <= n_free))
    taken = jnp.sum(jnp.where(granted, need, 0), dtype=jnp.int32)
    overflow = cache.overflow | jnp.any((n > 0) & ~granted)
    copy = granted & copy

    # Page table: a row's popped pages fill its slots from `base` on, in order: a copying
    # row's first one replaces its last page (slot have - 1), the others are new slots.
    base = have - copy
    j = jnp.arange(per_row, dtype=jnp.int32)[None, :]
    k = j - base[:, None]
    fresh = granted[:, None] & (k >= 0) & (k < need[:, None])
    pop = jnp.clip(n_free - 1 - (start[:, None] + k), 0, n_pages - 1)
    table = jnp.where(fresh, cache.free[pop], table)
    n_free_new = n_free - taken
    free = jnp.where(jnp.arange(n_pages) < n_free_new, cache.free, -1)
    refs = cache.refs.at[jnp.where(fresh, table, n_pages)].set(1, mode="drop")

    # Copy on write: the copy (in slot have - 1) takes every stored array of the old page.
    src = jnp.maximum(last, 0)
    dst = jnp.where(copy, table[jnp.arange(B), jnp.maximum(base, 0)], n_pages)  # n_pages: none
    stored = {name: formats.store(cache.pages[name], (dst,),
                                  {a: v[src] for a, v in cache.pages[name].items()})
              for name in fields}

    # Scatter the new entries to (page, slot); everything not written goes out of range.
    e = jnp.arange(E, dtype=jnp.int32)[None, :]
    pos = length[:, None] + e  # [B, E]
    write = granted[:, None] & (e < n[:, None])
    pslot = jnp.clip(pos // ps, 0, per_row - 1)
    page = jnp.take_along_axis(table, pslot, axis=1)
    page = jnp.where(write & (page >= 0), page, n_pages)  # n_pages: dropped
    slot = pos % ps
    pages = {}
    for name, f in fields.items():
        enc = formats.encode(f.fmt, new[name], f.rope)
        pages[name] = formats.store(stored[name], (page, slot), enc)

    out = cache.replace(pages=pages, page_table=table,
                        length=jnp.where(granted, new_len, length), free=free,
                        n_free=n_free_new, refs=refs, overflow=overflow)
    # The copied pages lose a holder; one all of whose holders copied it now goes free.
    return _unref(out, last, copy)


def _unref(cache: PagedCache, ids, drop) -> PagedCache:
    """One group's cache with a reference to page ``ids[i]`` dropped wherever ``drop[i]``
    (ids [N] local, any order, repeats counted; a negative id is ignored), and every page
    left with none pushed on the free stack, in the order of its first dropped reference."""
    n_pages = cache.n_pages
    ids = jnp.asarray(ids, jnp.int32).reshape(-1)
    drop = jnp.asarray(drop, bool).reshape(-1) & (ids >= 0)
    at = jnp.where(drop, ids, n_pages)  # n_pages: dropped
    refs = cache.refs.at[at].add(-1, mode="drop")
    i = jnp.arange(ids.shape[0], dtype=jnp.int32)
    first = jnp.full((n_pages,), ids.shape[0], jnp.int32).at[at].min(i, mode="drop")
    safe = jnp.clip(ids, 0, n_pages - 1)
    push = drop & (first[safe] == i) & (refs[safe] == 0)
    offs = jnp.cumsum(push) - push
    dest = jnp.where(push, cache.n_free + offs, n_pages)
    return cache.replace(free=cache.free.at[dest].set(ids, mode="drop"),
                         n_free=cache.n_free + jnp.sum(push, dtype=jnp.int32), refs=refs)


def gather(cache: PagedCache, name: str, idx, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Decode the entries at per-row indices ``idx`` [B, ..., K] (see ``_gather``)."""
    return _by_group(lambda c, i: _gather(c, name, i, dtype), cache,
                     jnp.asarray(idx, jnp.int32), returns_cache=False)


def _gather(cache: PagedCache, name: str, idx, dtype) -> tuple[jax.Array, jax.Array]:
    """Decode the entries at per-row indices ``idx`` [B, ..., K].

    Returns (values [B, ..., K, width] in ``dtype``, valid [B, ..., K]) with
    valid = 0 <= idx < length[b]; invalid positions read as zeros. Only the selected entries
    are gathered and decoded.
    """
    ps = cache.page_size
    table, length = cache.page_table, cache.length
    B, per_row = table.shape
    idx = jnp.asarray(idx, jnp.int32)
    flat = idx.reshape(B, -1)
    valid = (flat >= 0) & (flat < length[:, None])
    safe = jnp.where(valid, flat, 0)
    page = jnp.take_along_axis(table, jnp.clip(safe // ps, 0, per_row - 1), axis=1)
    page = jnp.where(valid, jnp.maximum(page, 0), 0)
    slot = safe % ps
    picked = {a: v[page, slot] for a, v in cache.pages[name].items()}  # [B, N, ...]
    vals = formats.decode(cache.fields[name].fmt, picked, dtype)
    vals = jnp.where(valid[..., None], vals, jnp.zeros((), vals.dtype))
    return vals.reshape(idx.shape + (vals.shape[-1],)), valid.reshape(idx.shape)


def read_all(cache: PagedCache, name: str, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Every entry slot of every row: (values [B, max_entries, width], valid [B, max_entries]).

    valid = index < length[b]; invalid slots are zeros.
    """
    return _by_group(lambda c: _read_all(c, name, dtype), cache, returns_cache=False)


def _read_all(cache: PagedCache, name: str, dtype) -> tuple[jax.Array, jax.Array]:
    ps, max_entries = cache.page_size, cache.max_entries
    table, length = cache.page_table, cache.length
    B, per_row = table.shape
    pages = jnp.maximum(table, 0)  # unassigned slots are masked below
    picked = {a: v[pages] for a, v in cache.pages[name].items()}
    rows = {a: v.reshape((B, per_row * ps) + v.shape[3:])[:, :max_entries]
            for a, v in picked.items()}
    vals = formats.decode(cache.fields[name].fmt, rows, dtype)
    valid = jnp.arange(max_entries)[None, :] < length[:, None]
    vals = jnp.where(valid[..., None], vals, jnp.zeros((), vals.dtype))
    return vals, valid


def pool(cache: PagedCache, name: str) -> tuple[dict, jax.Array]:
    """One field's pages as a single pool [pages, page_size, ...] and the page table into it
    (what the kernels read): a group's pages are its range of the pool, which may itself
    be a range of a larger array (protocol.flat_rows)."""
    table, (B, _) = cache.page_table, cache.page_table.shape
    group = jnp.arange(B, dtype=jnp.int32) // (B // cache.groups)
    flat = {a: flat_rows(v) for a, v in cache.pages[name].items()}
    first = next(iter(flat.values()))[1]
    offset = first + group * (cache.n_pages // cache.groups)
    table = jnp.where(table >= 0, table + offset[:, None], -1)
    return {a: v for a, (v, _) in flat.items()}, table


def release(cache: PagedCache, rows) -> PagedCache:
    """Drop the page references of rows where ``rows`` [B] is True and reset the rows.

    Each held page's refs falls by its holders among them (a page two released rows share
    drops by 2); the pages left with no holder are pushed on the free stack in row-major
    (row, page slot) order of their first released holder, and are not cleared: reads are
    masked by length, so their old bytes are never visible to the next owner. A page still
    held (by another row or by `hold`) stays where it is, untouched.
    """
    B = cache.length.shape[0]
    return _by_group(_release, cache, jnp.asarray(rows, bool).reshape(B))


def _release(cache: PagedCache, rows) -> PagedCache:
    table = cache.page_table
    cache = _unref(cache, table, rows[:, None] & (table >= 0))
    return cache.replace(page_table=jnp.where(rows[:, None], -1, table),
                         length=jnp.where(rows, 0, cache.length))


def hold(cache: PagedCache, ids, delta) -> PagedCache:
    """References to pages taken or dropped by something other than a row (a prefix index:
    +1 at publication, -1 at eviction): ``refs[ids[i]] += delta`` (``delta`` an int, or per
    id; repeats counted, a negative id is ignored), and every page left with no holder is
    pushed on the free stack, in the order of its first dropped reference.

    ``ids`` are local page ids [N] of a cache of one pool group, or [G, N] (group g's
    [g]). A page must be held to be dropped: refs never go below 0 on a consistent cache.
    """
    G = cache.groups
    ids = jnp.asarray(ids, jnp.int32)
    if ids.ndim == 1 and G == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != G:
        raise ValueError(f"paged.hold: ids must be [N] (one pool group) or [G, N] with G = "
                         f"{G}, got shape {ids.shape}")
    delta = jnp.broadcast_to(jnp.asarray(delta, jnp.int32).reshape(
        (1,) * (2 - jnp.ndim(delta)) + jnp.shape(delta)), ids.shape)
    return _by_group(_hold, cache, ids.reshape(-1), delta.reshape(-1))


def _hold(cache: PagedCache, ids, delta) -> PagedCache:
    n_pages, valid = cache.n_pages, ids >= 0
    refs = cache.refs.at[jnp.where(valid & (delta > 0), ids, n_pages)].add(delta, mode="drop")
    # A drop of d references: d - 1 of them here, the last one by _unref (which pushes).
    down = valid & (delta < 0)
    refs = refs.at[jnp.where(down, ids, n_pages)].add(delta + 1, mode="drop")
    return _unref(cache.replace(refs=refs), ids, down)


def share(cache: PagedCache, rows, tables, lengths) -> PagedCache:
    """Rows where ``rows`` [B] is True take the table prefix ``tables[b, :ceil(lengths[b] /
    page_size)]`` (local page ids; the rest of the row's table is -1) and length
    ``lengths[b]`` [B]: a restored or forked row, reading the entries another row or an index
    wrote. Each page so taken gains a holder (refs + 1); the row's earlier pages are released
    (as `release`, after the new references are taken, so a page in both stays held). The
    pages must be held already (a live row's or `hold`'s), and nothing writes them while
    they are shared: an append copies such a page first (`_must_copy`).
    """
    B = cache.length.shape[0]
    tables = jnp.broadcast_to(jnp.asarray(tables, jnp.int32), cache.page_table.shape)
    lengths = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (B,))
    return _by_group(_share, cache, jnp.asarray(rows, bool).reshape(B), tables, lengths)


def _share(cache: PagedCache, rows, tables, lengths) -> PagedCache:
    per_row = cache.page_table.shape[1]
    lengths = jnp.clip(lengths, 0, cache.max_entries)
    keep = jnp.arange(per_row)[None, :] < _ceil_div(lengths, cache.page_size)[:, None]
    taken = jnp.where(keep & (tables >= 0), tables, -1)
    at = jnp.where(rows[:, None] & (taken >= 0), taken, cache.n_pages)
    cache = cache.replace(refs=cache.refs.at[at].add(1, mode="drop"))
    cache = _release(cache, rows)
    return cache.replace(page_table=jnp.where(rows[:, None], taken, cache.page_table),
                         length=jnp.where(rows, lengths, cache.length))


def pages_in_use(cache: PagedCache) -> jax.Array:
    """int32: pages currently held (refs > 0): n_pages - the free pages of every group."""
    return jnp.int32(cache.n_pages) - jnp.sum(cache.n_free, -1, dtype=jnp.int32)


def check(cache: PagedCache) -> None:
    """Host-side: raise CacheExhausted if any append overflowed (any leading axes)."""
    if not bool(np.any(np.asarray(jax.device_get(cache.overflow)))):
        return
    n_pages, page_size = cache.n_pages, cache.page_size
    raise CacheExhausted(
        f"global cache pool exhausted: {n_pages} pages of {page_size} entries "
        f"({n_pages * page_size} entries) shared by {cache.length.shape[-1]} rows, at most "
        f"{cache.max_entries} entries per row; an append that could not get a page or would "
        f"pass its row's limit was dropped (that row keeps its earlier entries). init_cache("
        f"..., max_len=...) sizes both so that every row can reach max_len: use a larger "
        f"max_len (or a larger n_pages for a pool made with paged.empty)")


_append_jit = jax.jit(append)  # one compile per cache layout (benchmark contexts)
