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
    overflow     bool [G]                      sticky: an append could not get a page (pool
                                               exhausted) or would pass max_entries
    fields, page_size, max_entries             static (not pytree leaves): the stored fields'
                                               formats and widths, and the geometry

Pool groups (``groups`` G, default 1): the rows are split into G equal consecutive blocks
and the pool into G equal page ranges; block g's rows take pages only from range g, and its
page table holds ids local to the range (the free stack likewise: ``free`` is G stacks of
n_pages / G local ids). So no row ever points into another block's pages: with the rows and
the pages split the same way across devices (dsattn.sharding), every read and write stays
on its device. Every function runs per group (``jax.vmap``) on one group's pool.

Allocation happens lazily in ``append``: a row holds exactly ceil(length / page_size) pages,
popped from the free stack in row order (a cumulative sum of the rows' needs; deterministic).
An append is all-or-nothing per row: a row whose pages cannot be granted (or whose new length
would pass max_entries) keeps its length and writes nothing, and ``overflow`` is set; other
rows proceed. Call ``check(cache)`` on the host after a step to turn overflow into a
``CacheExhausted`` error.

Reads (``gather``, ``read_all``) are masked by length: an index outside [0, length[b]) reads
as zeros with valid False, whatever bytes a recycled page still holds. ``release`` pushes a
row's pages back on the free stack (LIFO, so they are reused first) without clearing them;
a row that later gets such a page only ever reads indices below its own length, all of which
it has written itself.
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
from dsattn.cache.protocol import Container, batch_axes, flat_rows
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
        n_free=jnp.zeros((1,), jnp.int32), overflow=jnp.zeros((1,), bool),
        fields=FrozenDict(fields), page_size=page_size, max_entries=max_entries)
    return regroup(cache, groups)


def regroup(cache: PagedCache, groups: int) -> PagedCache:
    """An EMPTY cache (as `empty` or a model's init_cache makes it, any leading axes) with
    its rows and pool split into `groups` (for a mesh: one group per row shard)."""
    batch, n_pages = cache.length.shape[-1], cache.n_pages
    if groups <= 0 or batch % groups or n_pages % groups:
        raise ValueError(f"paged: {groups} pool groups must divide the batch ({batch}) and "
                         f"the pool ({n_pages} pages)")
    lead, per = cache.free.shape[:-1], n_pages // groups
    # Each group's stack reversed, so that a fresh pool hands out pages 0, 1, 2, ... in order.
    free = jnp.tile(jnp.arange(per - 1, -1, -1, dtype=jnp.int32), groups)
    return cache.replace(free=jnp.broadcast_to(free, lead + (n_pages,)),
                         n_free=jnp.full(lead + (groups,), per, jnp.int32),
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
                            free=_split_rows(cache.free, g))
    axes = cache.replace(pages=batch_axes(cache.pages, 0), page_table=0, length=0, free=0,
                         n_free=0, overflow=0)
    rows = [jax.tree.map(lambda x: _split_rows(x, g), r) for r in rows]
    out = jax.vmap(fn, in_axes=(axes,) + (0,) * len(rows),
                   out_axes=axes if returns_cache else 0)(grouped, *rows)
    if not returns_cache:
        return jax.tree.map(_join_rows, out)
    return out.replace(pages=jax.tree.map(_join_rows, out.pages, is_leaf=_is_array),
                       page_table=_join_rows(out.page_table), length=_join_rows(out.length),
                       free=_join_rows(out.free))


def _ceil_div(a, b: int):
    return (a + (b - 1)) // b


def append(cache: PagedCache, new: Mapping[str, jax.Array], n_new) -> PagedCache:
    """Append each row's first ``n_new[b]`` entries of ``new[name]`` [B, E, width].

    Every field of the cache must be given (they share one length). ``n_new`` is clipped to
    [0, E]. Rows needing pages get them from their group's free stack in row order; a row
    that cannot get all the pages it needs, or would pass max_entries, writes nothing, keeps
    its length, and sets its group's ``overflow``.
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
    need = jnp.where(fits, _ceil_div(new_len, ps) - have, 0)
    cum = jnp.cumsum(need)  # inclusive, row order
    start = cum - need
    # Rows needing pages are granted while the running total fits: granted rows with need > 0
    # form a prefix of the needing rows, so their `start` offsets are exact.
    granted = fits & ((need == 0) | (cum <= n_free))
    taken = jnp.sum(jnp.where(granted, need, 0), dtype=jnp.int32)
    overflow = cache.overflow | jnp.any((n > 0) & ~granted)

    # Page table: slot j of row b gets the (j - have[b])-th page popped for that row.
    j = jnp.arange(per_row, dtype=jnp.int32)[None, :]
    k = j - have[:, None]
    fresh = granted[:, None] & (k >= 0) & (k < need[:, None])
    pop = jnp.clip(n_free - 1 - (start[:, None] + k), 0, n_pages - 1)
    table = jnp.where(fresh, cache.free[pop], table)
    n_free_new = n_free - taken
    free = jnp.where(jnp.arange(n_pages) < n_free_new, cache.free, -1)

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
        pages[name] = formats.store(cache.pages[name], (page, slot), enc)

    return cache.replace(pages=pages, page_table=table,
                         length=jnp.where(granted, new_len, length), free=free,
                         n_free=n_free_new, overflow=overflow)


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
    """Return the pages of rows where ``rows`` [B] is True to the free stack; reset the rows.

    Pages are pushed in row-major (row, page slot) order and are not cleared: reads are
    masked by length, so their old bytes are never visible to the next owner.
    """
    B = cache.length.shape[0]
    return _by_group(_release, cache, jnp.asarray(rows, bool).reshape(B))


def _release(cache: PagedCache, rows) -> PagedCache:
    table = cache.page_table
    held = rows[:, None] & (table >= 0)
    flat_held = held.reshape(-1)
    offs = jnp.cumsum(flat_held) - flat_held
    dest = jnp.where(flat_held, cache.n_free + offs, cache.n_pages)
    return cache.replace(
        free=cache.free.at[dest].set(table.reshape(-1), mode="drop"),
        n_free=cache.n_free + jnp.sum(flat_held, dtype=jnp.int32),
        page_table=jnp.where(rows[:, None], -1, table),
        length=jnp.where(rows, 0, cache.length))


def pages_in_use(cache: PagedCache) -> jax.Array:
    """int32: pages currently owned by rows (n_pages - the free pages of every group)."""
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
