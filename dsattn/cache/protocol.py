"""What every cache container declares once, so the code around caches (scanned groups,
sharding, generate's checks, the benchmarks) needs no switch on cache types.

A container is a flax struct dataclass deriving from `Container`, with

- `storage`: the name of its field holding the stored vectors (what kvbytes counts); in a
  scanned group's per-copy view they stay stacked and are read and written at `at`. None:
  bookkeeping only (a compressor's open spans), sliced per copy like any array;
- `copy`: that copy's index (None: not a view), hence `at`, the index prefix of the stored
  vectors;
- how a scanned group keeps its copies (`stack`, `copy_at`, `stacked`): by default every leaf
  gains a leading copies axis; `whole`, fields a copy's view keeps whole; `begin_scan` and
  `end_scan`, what it does around a scan over the copies (a contiguous cache writes each
  copy's chunk after it);
- its bookkeeping: every other pytree field (positions, page tables, lengths...), sliced
  per copy like any array;

and may override the hooks below (the defaults suit a container whose rows are
independent and whose stored vectors are one per row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


class Container:
    storage: str | None  # the field of stored vectors (None: none)
    whole: tuple = ()  # other fields a copy's view keeps whole (not sliced per copy)
    copy: jax.Array | None

    @property
    def at(self) -> tuple:
        """The index prefix of this cache's stored vectors (its copy, if a stacked view)."""
        return () if self.copy is None else (self.copy,)

    @property
    def vectors(self):
        """The stored vectors (the `storage` field's value; {} if it has none)."""
        return {} if self.storage is None else getattr(self, self.storage)

    def with_vectors(self, value):
        return self if self.storage is None else self.replace(**{self.storage: value})

    def stack(self, copies: int):
        """This (empty) cache for each of `copies` copies of a scanned layer group."""
        return jax.tree.map(lambda a: jnp.broadcast_to(a, (copies,) + a.shape).copy(), self)

    def copy_at(self, c: int):
        """Copy `c` of a scanned group's cache (as `stack` made it), as an unstacked cache."""
        return jax.tree.map(lambda a: index(a, c), self)

    @classmethod
    def stacked(cls, caches: list):
        """The inverse of `copy_at`: one scanned group's cache from its copies' caches."""
        return jax.tree.map(lambda *a: jnp.stack(a), *caches)

    def begin_scan(self, positions, valid):
        """Before a scan over a group's copies with a chunk at positions, valid [B, T]."""
        return self

    def end_scan(self):
        """After that scan: what the copies deferred, done."""
        return self

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

    def specs(self, lead: tuple, rows, tensor: int):
        """PartitionSpecs of every leaf on a mesh: `lead` (a scanned group's copies axis),
        then rows over `rows`; `tensor` is the mesh's tensor size."""
        return jax.tree.map(lambda _: P(*lead, rows), self)

    def filled(self, n: int, stride: int, rand):
        """As if `n` positions had been written (entries every `stride`), with `rand(shape,
        dtype)` values: a benchmark's synthetic context."""
        return self


def is_container(node) -> bool:
    return isinstance(node, Container)


def index(a, c: int):
    """a[c] along the leading axis, for arrays and abstract shapes (eval_shape'd states)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    return a[c]
