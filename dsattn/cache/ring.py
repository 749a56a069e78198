"""Local ring cache: per row, the last W positions (V4's sliding-window KV), stored in a format.

A `Ring` holds ``kv`` (the format's storage [B, W, ...]) and ``pos`` (int32 [B, W]), with its
format and rotary width as static fields: slot ``p % W`` holds position ``p``'s vector and
``pos[b, s]`` is the absolute position stored in slot ``s`` of row ``b`` (-1: empty). Rows are independent: positions are absolute per row and a ragged
batch advances each row by its own number of valid entries.

All functions are pure jnp with static shapes (format names and rope widths are static), so
they run under ``jax.jit``; a step's chunk of T new entries may be longer than the window.

Typical use in one local-attention layer, for a chunk (prefill) or a single token (decode)::

    keys, key_pos = ring.local_keys(r, dtype, kv, pos, valid, W)
    mask = ring.window_mask(key_pos, pos, W)        # [B, T, W + T]
    ...attend(q, keys, mask)...
    r = ring.write(r, kv, pos, valid)
"""

import jax
import jax.numpy as jnp
from flax import struct

from dsattn.cache import formats
from dsattn.cache.protocol import Container


@struct.dataclass
class Ring(Container):
    kv: dict  # the format's stored arrays [B, W, ...]
    pos: jax.Array  # int32 [B, W]: position held by each slot, -1 empty
    fmt: str = struct.field(pytree_node=False)
    rope: int = struct.field(pytree_node=False)  # trailing rotary dims

    storage = "kv"  # the stored vectors (cache.protocol)

    def filled(self, n: int, stride: int, rand):
        """The last W of n positions held, slot = position mod W."""
        w = self.pos.shape[-1]
        first = max(n - w, 0)
        pos = first + (jnp.arange(w) - first) % w
        return self.replace(kv=jax.tree.map(lambda a: rand(a.shape, a.dtype), self.kv),
                            pos=jnp.broadcast_to(jnp.where(pos < n, pos, -1),
                                                 self.pos.shape).astype(jnp.int32))


def _window(ring: Ring) -> int:
    return ring.pos.shape[1]


def empty(fmt: str, batch: int, window: int, width: int, rope: int, dtype) -> Ring:
    """An empty ring of ``window`` slots per row for vectors of ``width`` dims.

    ``kv`` is zeroed storage of the format (decodes to 0.0); ``pos`` is -1 everywhere.
    """
    if window < 1:
        raise ValueError(f"ring window must be >= 1, got {window}")
    return Ring(formats.empty(fmt, (batch, window), width, rope, dtype),
                jnp.full((batch, window), -1, jnp.int32), fmt=fmt, rope=rope)


def write(ring: Ring, values, positions, valid) -> Ring:
    """Store values [B, T, w] at absolute positions [B, T] where valid [B, T]; slot = p mod W.

    Valid positions of a row must be distinct and >= 0 (they normally are consecutive).
    T may exceed W: only each row's last W valid positions (p > max valid p - W) are written,
    since two kept positions would otherwise share a slot and XLA's scatter with duplicate
    indices applies them in an unspecified order. After the write, slots of such a row holding
    positions <= max - W (out of its window; only possible when the row's positions jump) are
    marked empty. Rows with no valid entry are untouched (storage and positions). Values are
    encoded in the ring's format before the scatter.
    """
    w_slots = _window(ring)
    positions = jnp.asarray(positions).astype(jnp.int32)
    valid = jnp.asarray(valid).astype(bool)
    has = jnp.any(valid, axis=1)  # [B]
    top = jnp.max(jnp.where(valid, positions, -1), axis=1)  # [B] max valid position (-1: none)
    keep = valid & (positions > top[:, None] - w_slots)
    slots = jnp.where(keep, positions % w_slots, w_slots)  # out of range -> dropped
    rows = jnp.arange(positions.shape[0])[:, None]

    enc = formats.encode(ring.fmt, values, ring.rope)
    kv = formats.store(ring.kv, (rows, slots), enc)
    pos = ring.pos.at[rows, slots].set(positions, mode="drop")
    stale = has[:, None] & (pos <= top[:, None] - w_slots)
    return ring.replace(kv=kv, pos=jnp.where(stale, -1, pos))


def read(ring: Ring, dtype):
    """All slots decoded: (values [B, W, w] in ``dtype``, positions int32 [B, W], -1 empty)."""
    kv = {k: a[...] for k, a in ring.kv.items()}
    return formats.decode(ring.fmt, kv, dtype), ring.pos


def window_mask(slot_pos, q_pos, window: int):
    """bool [B, T, S]: key ``s`` is visible to query ``t`` of the same row.

    True where the key position is valid (>= 0), key <= query and key > query - window, i.e.
    the key lies in the query's window {query - window + 1 .. query}. Works for any key set:
    a ring's slots, a chunk's own keys, or their concatenation (``local_keys``). A padded
    query (position -1) sees nothing; callers must not let its all-masked row produce NaNs.
    """
    k = jnp.asarray(slot_pos)[:, None, :]
    q = jnp.asarray(q_pos)[:, :, None]
    return (k >= 0) & (k <= q) & (k > q - window)


def local_keys(ring: Ring, dtype, chunk_values, chunk_pos, chunk_valid, window: int):
    """Keys a chunk's queries attend over: concat[ring BEFORE this chunk's write, the chunk].

    Returns (keys [B, W + T, w] in ``dtype``, key_pos int32 [B, W + T]); invalid chunk entries
    get position -1. With ``window_mask(key_pos, chunk_pos, window)`` every query q of the
    chunk sees exactly the positions {q - window + 1 .. q}, each once.

    Why not just write the chunk and attend over the ring: the ring keeps only the last W
    positions, so after writing a chunk longer than W (or one that wraps the ring) the slots
    of the window of the chunk's EARLIER queries have been overwritten by its later positions.
    Read before the write, the ring holds the last W positions before the chunk (the part of
    every window that precedes the chunk; ``window`` <= W) and the chunk supplies the rest.
    Ring keys and chunk keys never share a position, since the chunk continues the row.

    The ring's part comes in position order: index i < W holds position p0 - W + i (if
    stored), p0 = the row's first chunk position, and index W + t the chunk's entry t. So a
    query at chunk index t finds its window at indices (t + W - window, t + W], and a block
    of queries a contiguous slice (``attention.local.Window``).

    Chunk keys go through the ring's ``decode(encode(.))``, i.e. they carry exactly the numbers
    the ring will hold after ``write``, so a query's result does not depend on how the
    sequence was chunked (or whether it is decoded token by token). For ``native`` this is
    the identity.
    """
    w_slots = _window(ring)
    if window > w_slots:
        raise ValueError(f"window {window} exceeds the ring's {w_slots} slots")
    ring_vals, ring_pos = read(ring, dtype)
    p0 = jnp.asarray(chunk_pos).astype(jnp.int32)[:, :1]
    order = (p0 + jnp.arange(w_slots, dtype=jnp.int32)) % w_slots  # slot of p0 - W + i
    ring_vals = jnp.take_along_axis(ring_vals, order[..., None], axis=1)
    ring_pos = jnp.take_along_axis(ring_pos, order, axis=1)
    chunk_values = jnp.asarray(chunk_values)
    chunk_keys = formats.decode(ring.fmt, formats.encode(ring.fmt, chunk_values, ring.rope),
                                dtype)
    cpos = jnp.where(jnp.asarray(chunk_valid).astype(bool),
                     jnp.asarray(chunk_pos).astype(jnp.int32), -1)
    keys = jnp.concatenate([ring_vals, chunk_keys], axis=1)
    key_pos = jnp.concatenate([ring_pos, cpos], axis=1)
    return keys, key_pos
