"""Contiguous per-row cache: slot = position, one vector per slot, stored in a cache format.

Used by the baseline families (MHA/GQA/MQA, MLA) whose cache grows with every token. Writes
scatter each row's new positions into its own slots; padded positions are dropped, so a
ragged batch never writes garbage where a later token will look.

Capacity is max_len slots, the model's own capacity: a position >= max_len would be dropped
too, but never arrives, since generate refuses (and flags) a row that would pass max_len
before any layer sees it (see generate.check_cache).

A scanned layer group keeps one array per copy, not one stacked array. A layer reads all of
its slots every step, and XLA's dots read an operand only where it lies whole in memory: a
copy's slice of a stacked array was copied out every step (the whole layer's cache, twice the
traffic of the read). So `extend` runs the reading computation under a `lax.switch` on the
copy, each branch with its own copy's arrays (read in place), over the copy's slots before
the chunk and the chunk itself; the copy's chunk goes to `pending` (the copies' chunks,
stacked: small), and `end_scan` writes each copy's chunk into its arrays after the scan, in
place: one scatter per copy per step.
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
    # During a scan over the copies (begin_scan .. end_scan): each copy's chunk, encoded and
    # stacked [copies, ...] in the storage layout with T slots, and the chunk's slots [B, T].
    pending: dict | None = struct.field(default=None, kw_only=True)
    slots: jax.Array | None = struct.field(default=None, kw_only=True)
    fmt: str = struct.field(pytree_node=False)
    rope: int = struct.field(pytree_node=False)
    heads_first: bool = struct.field(pytree_node=False)
    copies: int = struct.field(pytree_node=False, default=0, kw_only=True)  # 0: not stacked

    storage = "stored"  # the stored vectors (cache.protocol)
    whole = ("pending", "slots")  # a copy's view keeps them whole: it writes at [copy]

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

    def begin_scan(self, positions, valid):
        if not self.copies:
            return self
        t = positions.shape[1]
        axis = 2 if self.heads_first else 1

        def chunk(a):
            shape = list(a.shape)
            shape[axis] = t
            return jnp.zeros((self.copies, *shape), a.dtype)

        return self.replace(pending=jax.tree.map(chunk, self.stored[0]),
                            slots=jnp.where(valid, positions, self.max_len))

    def end_scan(self):
        if self.pending is None:
            return self
        stored = tuple(_store(self, s, self.slots, {k: a[j] for k, a in self.pending.items()})
                       for j, s in enumerate(self.stored))
        return self.replace(stored=stored, pending=None, slots=None)


def empty(fmt: str, batch: int, max_len: int, inner: tuple, width: int, rope: int, dtype,
          heads_first: bool = False) -> Contiguous:
    """Zeroed storage for [batch, max_len, *inner] vectors of `width` dims, or
    [batch, head, max_len] ones with `heads_first` (one inner dim)."""
    shape = ((batch,) + tuple(inner) + (max_len,) if heads_first
             else (batch, max_len) + tuple(inner))
    return Contiguous(formats.empty(fmt, shape, width, rope, dtype), fmt=fmt, rope=rope,
                      heads_first=heads_first)


def _encoded(c: Contiguous, values) -> dict:
    """values [B, T, *inner, w] encoded in the storage layout ([B, G, T, ...] heads first)."""
    enc = formats.encode(c.fmt, values, c.rope)
    return {k: jnp.swapaxes(v, 1, 2) for k, v in enc.items()} if c.heads_first else enc


def _store(c: Contiguous, stored: dict, slots, enc: dict) -> dict:
    """`stored` (one copy's arrays) with `enc` written at slots [B, T] (max_len: dropped)."""
    rows = jnp.arange(slots.shape[0])[:, None]
    if c.heads_first:
        heads = jnp.arange(next(iter(enc.values())).shape[1])[None, :, None]
        return formats.store(stored, (rows[:, None], heads, slots[:, None]), enc)
    return formats.store(stored, (rows, slots), enc)


def _write(c: Contiguous, enc: dict, positions, valid) -> Contiguous:
    """`c` with a chunk (`_encoded`) stored at slots positions [B, T] where valid [B, T]
    (inside a scan over a group's copies: the copy's pending chunk, written by `end_scan`)."""
    if c.pending is not None:
        return c.replace(pending={k: a.at[c.copy].set(enc[k]) for k, a in c.pending.items()})
    if c.copies:
        raise ValueError("contiguous.extend: a scanned group's cache is written only inside "
                         "a scan over its copies (between begin_scan and end_scan)")
    return c.replace(stored=_store(c, c.stored, jnp.where(valid, positions, c.max_len), enc))


def extend(caches: tuple, new: tuple, positions, valid, fn, dtype):
    """(fn(segments), the caches with the chunk written): a chunk of tokens (positions, valid
    [B, T]) appended to one layer's caches (the same copy of a scanned group, if any) and
    attending over them. `new`: the chunk's values for each cache, [B, T, *inner, w].
    `segments`: [(values, key positions [B, S], visible [B, S])], values one per cache
    decoded to `dtype` in the storage layout, read in place; one softmax spans them.

    Unscanned: the chunk is written first and fn reads every slot (one segment). In a scan
    over a group's copies: fn reads the copy's slots before each row's chunk, then the
    chunk's tokens as the cache will return them (two segments), and the chunk is pending
    until `end_scan` (reading a cache before a write into it, XLA:CPU copies the cache)."""
    first = caches[0]
    slots = jnp.broadcast_to(jnp.arange(first.max_len), (positions.shape[0], first.max_len))
    decoded = lambda stored: tuple(formats.decode(c.fmt, s, dtype)  # noqa: E731
                                   for c, s in zip(caches, stored))
    encoded = tuple(_encoded(c, v) for c, v in zip(caches, new))
    caches = tuple(_write(c, e, positions, valid) for c, e in zip(caches, encoded))
    if not first.copies:
        return fn([(decoded(c.stored for c in caches), slots, slots >= 0)]), caches
    fresh = (decoded(encoded), positions, valid)
    before = slots < positions[:, :1]  # each row's chunk starts at its first position

    def branch(j):
        return lambda: fn([(decoded(c.stored[j] for c in caches), slots, before), fresh])

    return jax.lax.switch(first.copy, [branch(j) for j in range(first.copies)]), caches
