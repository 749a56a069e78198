"""What a cache container is, declared once, so the code around caches (the layer stack,
sharding, generate's checks, the benchmarks) needs no switch on cache types.

A container is a flax struct dataclass deriving from `Container`, with

- `storage`: the name of its field holding the stored vectors (what kvbytes counts); None:
  bookkeeping only (a compressor's open spans);
- `reads_whole`: whether a step reads every stored vector (a contiguous cache, read by
  dots) rather than what it selects; such a container reads them through `reading`;
- its bookkeeping: every other pytree field (positions, page tables, lengths...), with its
  rows along the leading axis, like the stored vectors;

and may override the hooks below (the defaults suit a container whose rows are
independent). A container whose rows draw pages from one pool they share (a paged cache)
says so through `page_pool`, `with_pages`, `cleared` and `retained`, which the server's page accounting
and row clearing (dsattn/serve/) call, so a new kind serves without a switch there. A container indexes its stored arrays as arrays (`a[idx]`, `a.at[idx].set`);
what it is given may be an array-like view of a larger array (dsattn/scan.py), which
`batch_axes` and `flat_rows` let code that vmaps or flattens them handle.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


class PagePool(NamedTuple):
    """A pool of pages the rows of a container share: entries per page, and pages."""

    page_size: int
    n_pages: int


class Container:
    storage: str | None  # the field of stored vectors (None: none)
    reads_whole: bool = False  # a step reads every stored vector (through `reading`)

    @property
    def vectors(self):
        """The stored vectors (the `storage` field's value; {} if it has none)."""
        return {} if self.storage is None else getattr(self, self.storage)

    def with_vectors(self, value):
        return self if self.storage is None else self.replace(**{self.storage: value})

    def stored_bytes(self) -> int:
        """Bytes of the stored vectors, without the bookkeeping."""
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(self.vectors))

    def split_rows(self, groups: int):
        """This (empty) cache with its rows in `groups` independent parts, one per row shard
        of a mesh (a paged pool splits; others are unchanged)."""
        return self

    def check(self) -> None:
        """Host-side: raise CacheExhausted if the cache dropped a write (e.g. a page pool
        ran out)."""

    def specs(self, rows, tensor: int):
        """PartitionSpecs of every leaf on a mesh: rows over `rows`; `tensor` is the mesh's
        tensor size."""
        return jax.tree.map(lambda _: P(rows), self)

    def page_pool(self) -> PagePool | None:
        """The pool of pages its rows share, for the host's page accounting
        (serve/pool.py); None: each row holds its own storage."""
        return None

    def with_pages(self, n: int):
        """This (empty) cache with a pool of `n` pages (a pooled one; others are
        unchanged)."""
        return self

    def cleared(self, rows, blank):
        """This cache with the rows where `rows` [B] is True emptied for their next owner:
        they take the values of `blank` (the same container for one empty row), so nothing
        of the last owner survives (a pooled one releases their pages instead)."""
        return blanked(self, rows, blank)

    def retained(self, rows):
        """This cache with one more holder of everything pooled that the rows where `rows`
        [B] is True hold: their state was just copied to a snapshot, or from one (a prefix
        cache's), so two places now point at the same pages. A pooled container counts
        the holder (its pages stay until every holder released them); others hold nothing
        shared and are unchanged."""
        return self

    def filled(self, n: int, stride: int, rand):
        """As if `n` positions had been written (entries every `stride`), with `rand(shape,
        dtype)` values: a benchmark's synthetic context."""
        return self


def is_container(node) -> bool:
    return isinstance(node, Container)


def blanked(tree, rows, blank):
    """`tree` with the rows where `rows` [B] is True (every leaf's leading axis) taking the
    values of `blank` (the same tree for one row)."""
    at = lambda a: rows.reshape((-1,) + (1,) * (a.ndim - 1))  # noqa: E731
    return jax.tree.map(lambda old, new: jnp.where(at(old), new, old), tree, blank)


def _is_view(a) -> bool:
    return hasattr(a, "batch_axes") or hasattr(a, "read_in_place")


def reading(tree, f):
    """f(tree), for code that reads stored vectors whole (`reads_whole`): `tree` holds them
    (arrays, or views that run f where their arrays lie)."""
    views = [a for a in jax.tree.leaves(tree, is_leaf=_is_view) if hasattr(a, "read_in_place")]
    return views[0].read_in_place(tree, f) if views else f(tree)


def batch_axes(tree, axis: int):
    """jax.vmap axes mapping dimension `axis` of each stored array of `tree` (a view maps
    its own)."""
    movable = lambda a: hasattr(a, "batch_axes")  # noqa: E731
    return jax.tree.map(lambda a: a.batch_axes(axis) if movable(a) else axis, tree,
                        is_leaf=movable)


def flat_rows(a):
    """(an array holding `a`'s rows [rows, ...] among others, the first of `a`'s rows in it):
    `a` itself and 0 for an array."""
    return a.flat_rows() if hasattr(a, "flat_rows") else (a, 0)
