"""Contiguous per-row cache: slot = position, one vector per slot, stored in a cache format.

Used by the baseline families (MHA/GQA/MQA, MLA) whose cache grows with every token. Writes
scatter each row's new positions into its own slots; padded positions are dropped, so a
ragged batch never writes garbage where a later token will look.

Capacity is max_len slots, the model's own capacity: a position >= max_len would be dropped
too, but never arrives, since generate refuses (and flags) a row that would pass max_len
before any layer sees it (see generate.check_cache).

A scanned layer group keeps one array per copy, not one stacked array. A layer reads all of
its slots every step, and XLA's dots read an operand only where it lies whole in memory: the
copy's slice of a stacked array was copied out every step (the whole layer's cache, twice the
traffic of the read). So `attend` runs the reading computation under a `lax.switch` on the
copy, each branch with its own copy's arrays (read in place), and `write` stores into every
copy's arrays with the slots of the other copies out of range (dropped): all in place.
"""

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from dsattn.cache import formats
from dsattn.cache.protocol import Container


@struct.dataclass
class Contiguous(Container):
    """One vector per (row, slot), slot = position: the format's stored arrays, [B, L, ...]
    ([B, G, L, ...] heads first), with the format and layout as static fields. A scanned
    group's cache holds a tuple of such dicts, one per copy (`copies` of them)."""

    stored: dict | tuple
    # A scanned layer's copy (cache.stacked): `stored` is every copy's, this one is [copy].
    copy: jax.Array | None = struct.field(default=None, kw_only=True)
    fmt: str = struct.field(pytree_node=False)
    rope: int = struct.field(pytree_node=False)
    heads_first: bool = struct.field(pytree_node=False)
    copies: int = struct.field(pytree_node=False, default=0, kw_only=True)  # 0: not stacked

    storage = "stored"  # the stored vectors (cache.protocol)

    @property
    def per_copy(self) -> tuple:
        """Every copy's stored arrays (one dict if not a scanned group's)."""
        return self.stored if self.copies else (self.stored,)

    @property
    def max_len(self) -> int:
        return next(iter(self.per_copy[0].values())).shape[2 if self.heads_first else 1]

    def stack(self, copies: int):
        return self.replace(stored=tuple(jax.tree.map(jnp.copy, self.stored)
                                         for _ in range(copies)), copies=copies)

    def copy_at(self, c: int):
        return self.replace(stored=self.stored[c], copies=0)

    @classmethod
    def stacked(cls, caches: list):
        return caches[0].replace(stored=tuple(c.stored for c in caches), copies=len(caches))

    def specs(self, lead: tuple, rows, tensor: int):
        """Rows split (no copies axis: one array per copy); heads first (MHA's K/V): heads
        also split over tensor when they divide it."""
        split = None
        if self.heads_first:
            heads = next(iter(self.per_copy[0].values())).shape[1]
            split = "tensor" if tensor > 1 and heads % tensor == 0 else None
        return jax.tree.map(lambda _: P(rows, split) if split else P(rows), self)

    def filled(self, n: int, stride: int, rand):
        return self.replace(stored=jax.tree.map(lambda a: rand(a.shape, a.dtype), self.stored))


def empty(fmt: str, batch: int, max_len: int, inner: tuple, width: int, rope: int, dtype,
          heads_first: bool = False) -> Contiguous:
    """Zeroed storage for [batch, max_len, *inner] vectors of `width` dims, or
    [batch, head, max_len] ones with `heads_first` (one inner dim)."""
    shape = ((batch,) + tuple(inner) + (max_len,) if heads_first
             else (batch, max_len) + tuple(inner))
    return Contiguous(formats.empty(fmt, shape, width, rope, dtype), fmt=fmt, rope=rope,
                      heads_first=heads_first)


def write(c: Contiguous, values, positions, valid) -> Contiguous:
    """Store values [B, T, *inner, w] at slots positions [B, T] where valid [B, T]."""
    max_len = c.max_len
    rows = jnp.arange(values.shape[0])[:, None]
    enc = formats.encode(c.fmt, values, c.rope)
    if c.heads_first:  # [B, T, G, ...] values into [B, G, L, ...] storage
        enc = {k: jnp.swapaxes(v, 1, 2) for k, v in enc.items()}

    def one(stored, mine):
        slots = jnp.where(valid & mine, positions, max_len)  # out of range -> dropped
        if c.heads_first:
            heads = jnp.arange(values.shape[2])[None, :, None]
            return formats.store(stored, (rows[:, None], heads, slots[:, None]), enc)
        return formats.store(stored, (rows, slots), enc)

    if not c.copies:
        return c.replace(stored=one(c.stored, True))
    return c.replace(stored=tuple(one(s, c.copy == j) for j, s in enumerate(c.stored)))


def attend(caches: tuple, fn, dtype):
    """fn(*values) with each cache's slots decoded to the compute dtype ([B, L, *inner, w];
    [B, G, L, w] heads first), its stored arrays read in place: caches of one layer (the
    same copy of a scanned group, if any)."""
    read = lambda *stored: fn(*(formats.decode(c.fmt, s, dtype)  # noqa: E731
                                for c, s in zip(caches, stored)))
    first = caches[0]
    if not first.copies:
        return read(*(c.stored for c in caches))
    branches = [lambda j=j: read(*(c.stored[j] for c in caches)) for j in range(first.copies)]
    return jax.lax.switch(first.copy, branches)
