"""Contiguous per-row cache: slot = position, one vector per slot, stored in a cache format.

Used by the baseline families (MHA/GQA/MQA, MLA) whose cache grows with every token. Writes
scatter each row's new positions into its own slots; padded positions are dropped, so a
ragged batch never writes garbage where a later token will look.

Capacity is max_len slots, the model's own capacity: a position >= max_len would be dropped
too, but never arrives, since generate refuses (and flags) a row that would pass max_len
before any layer sees it (see generate.check_cache).
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
    ([B, G, L, ...] heads first), with the format and layout as static fields."""

    stored: dict
    # A scanned layer's copy (cache.stacked): stored stays stacked, used at [copy].
    copy: jax.Array | None = struct.field(default=None, kw_only=True)
    fmt: str = struct.field(pytree_node=False)
    rope: int = struct.field(pytree_node=False)
    heads_first: bool = struct.field(pytree_node=False)

    storage = "stored"  # the stored vectors (cache.protocol)

    @property
    def max_len(self) -> int:
        return next(iter(self.stored.values())).shape[len(self.at) + (2 if self.heads_first
                                                                      else 1)]

    def specs(self, lead: tuple, rows, tensor: int):
        """Heads first (MHA's K/V): heads also split over tensor when they divide it."""
        if not self.heads_first:
            return super().specs(lead, rows, tensor)
        heads = next(iter(self.stored.values())).shape[len(lead) + 1]
        split = "tensor" if tensor > 1 and heads % tensor == 0 else None
        return jax.tree.map(lambda _: P(*lead, rows, split), self)

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
    stored, max_len = c.stored, c.max_len
    slots = jnp.where(valid, positions, max_len)  # out of range -> dropped
    rows = jnp.arange(values.shape[0])[:, None]
    enc = formats.encode(c.fmt, values, c.rope)
    if c.heads_first:  # [B, T, G, ...] values into [B, G, L, ...] storage
        heads = jnp.arange(values.shape[2])[None, :, None]
        return c.replace(stored=formats.store(
            stored, c.at + (rows[:, None], heads, slots[:, None]),
            {k: jnp.swapaxes(v, 1, 2) for k, v in enc.items()}))
    return c.replace(stored=formats.store(stored, c.at + (rows, slots), enc))


def read(c: Contiguous, dtype) -> jax.Array:
    """All slots decoded to the compute dtype: [B, L, *inner, w] ([B, G, L, w])."""
    return formats.decode(c.fmt, {k: a[c.at] for k, a in c.stored.items()}, dtype)
