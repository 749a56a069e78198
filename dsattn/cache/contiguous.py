"""Contiguous per-row cache: slot = position, one vector per slot, stored in a cache format.

Used by the baseline families (MHA/GQA/MQA, MLA) whose cache grows with every token. Writes
scatter each row's new positions into its own slots; padded positions are dropped, so a
ragged batch never writes garbage where a later token will look.

Capacity is max_len slots, the model's own capacity: a position >= max_len would be dropped
too, but never arrives, since generate refuses (and flags) a row that would pass max_len
before any layer sees it (see generate.check_cache).

A step reads every slot (`reads_whole`): it writes the chunk, then reads the slots before
each row's chunk in place (`protocol.reading`) and the chunk's own tokens as the cache
will return them, two segments under one softmax. Reading the chunk from what was just
written would give the same numbers; keeping it apart lets a view that holds its write
(cache.protocol) run the same code.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from dsattn.cache import formats
from dsattn.cache.protocol import Container, reading


@struct.dataclass
class Contiguous(Container):
    """One vector per (row, slot), slot = position: the format's stored arrays, [B, L, ...]
    ([B, G, L, ...] heads first), with the format and layout as static fields."""

    stored: dict
    fmt: str = struct.field(pytree_node=False)
    rope: int = struct.field(pytree_node=False)
    heads_first: bool = struct.field(pytree_node=False)

    storage = "stored"  # the stored vectors (cache.protocol)
    reads_whole = True

    @property
    def max_len(self) -> int:
        return next(iter(self.stored.values())).shape[2 if self.heads_first else 1]

    def specs(self, rows, tensor: int):
        """Rows split; heads first (MHA's K/V): heads also split over tensor when they
        divide it."""
        split = None
        if self.heads_first:
            heads = next(iter(self.stored.values())).shape[1]
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


def _encoded(c: Contiguous, values) -> dict:
    """values [B, T, *inner, w] encoded in the storage layout ([B, G, T, ...] heads first)."""
    enc = formats.encode(c.fmt, values, c.rope)
    return {k: jnp.swapaxes(v, 1, 2) for k, v in enc.items()} if c.heads_first else enc


def _store(c: Contiguous, stored: dict, slots, enc: dict) -> dict:
    """`stored` (its arrays) with `enc` written at slots [B, T] (max_len: dropped)."""
    rows = jnp.arange(slots.shape[0])[:, None]
    if c.heads_first:
        heads = jnp.arange(next(iter(enc.values())).shape[1])[None, :, None]
        return formats.store(stored, (rows[:, None], heads, slots[:, None]), enc)
    return formats.store(stored, (rows, slots), enc)


@struct.dataclass
class Slots:
    """Slots 0 .. count[b] - 1 of each row of a (not heads-first) contiguous cache, as
    stored (``stored`` [B, L, ...]): what a kernel may read in place of their decoded
    values (kernels/decode_attention.py)."""

    stored: dict
    count: jax.Array
    fmt: str = struct.field(pytree_node=False)
    rope: int = struct.field(pytree_node=False)


class Segment(NamedTuple):
    """Keys under one softmax: ``values`` one per cache, decoded, in the storage layout;
    key positions [B, S]; which are visible [B, S]; ``slots`` (one `Slots` per cache) when
    they are a prefix of each row's stored slots, else None."""

    values: tuple
    pos: jax.Array
    seen: jax.Array
    slots: tuple | None = None


def extend(caches: tuple, new: tuple, positions, valid, fn, dtype):
    """(fn(segments), the caches with the chunk written): a chunk of tokens (positions, valid
    [B, T]) appended to one layer's caches and attending over them. `new`: the chunk's
    values for each cache, [B, T, *inner, w]. `segments`: two `Segment`s under one softmax:
    every slot before each row's chunk (read in place), then the chunk's tokens as the
    cache returns them."""
    first = caches[0]
    slots = jnp.broadcast_to(jnp.arange(first.max_len), (positions.shape[0], first.max_len))
    decoded = lambda stored: tuple(formats.decode(c.fmt, s, dtype)  # noqa: E731
                                   for c, s in zip(caches, stored))
    encoded = tuple(_encoded(c, v) for c, v in zip(caches, new))
    at = jnp.where(valid, positions, first.max_len)
    caches = tuple(c.replace(stored=_store(c, c.stored, at, e)) for c, e in zip(caches, encoded))
    fresh = Segment(decoded(encoded), positions, valid)
    start = positions[:, 0]  # each row's chunk starts at its first position
    before = slots < start[:, None]

    def prefix(stored):
        held = None if first.heads_first else tuple(
            Slots(s, start, c.fmt, c.rope) for c, s in zip(caches, stored))
        return Segment(decoded(stored), slots, before, held)

    out = reading(tuple(c.stored for c in caches), lambda stored: fn([prefix(stored), fresh]))
    return out, caches
