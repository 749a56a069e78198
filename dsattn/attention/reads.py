"""What a layer's queries read from its global items.

The items (compressed entries, or DSA's tokens) live in a store: `Entries` in the training
forward (the whole sequence's items as computed), the paged cache in cached execution. Both
answer `gather(name, idx, dtype)` and `read_all(name, dtype)`, so selectors and attention
cores are the same code in both modes. A layer reads either

- `Visible`: every item complete at the query (HCA; the dense warm-up), or
- `Picked`: the items its selection names per query (top-k of an indexer, or reused),

as one part of an attention read (attention/attend.py); the reference implementation
gathers each query block's picks only, so nothing of shape [T, H, items] or [T, T] exists.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Selection:
    """Per-query entry ids [B, T, k] and which of them are real picks; `dense` (a scalar
    bool, training only) true while the dense warm-up reads every complete entry instead."""

    idx: jax.Array
    ok: jax.Array
    dense: jax.Array | None = None


@struct.dataclass
class Entries:
    """The training forward's items: name -> [B, n, width], every one stored."""

    fields: dict

    def gather(self, name: str, idx, dtype=None):
        """(values [B, ..., K, width] at per-row ids idx [B, ..., K], which ids are items)."""
        a = self.fields[name]
        flat = idx.reshape(idx.shape[0], -1)
        vals = jnp.take_along_axis(a, jnp.clip(flat, 0, a.shape[1] - 1)[..., None], axis=1)
        return vals.reshape(idx.shape + a.shape[-1:]), (idx >= 0) & (idx < a.shape[1])

    def read_all(self, name: str, dtype=None):
        a = self.fields[name]
        return a, jnp.ones(a.shape[:2], bool)


def visible(positions, stride: int, n: int):
    """bool [B, T, n]: item j is complete at position t once j < (t + 1) // stride."""
    return jnp.arange(n) < ((positions + 1) // stride)[..., None]


@struct.dataclass
class Visible:
    """Every item complete at the query, of a store."""

    store: Any
    stride: int = struct.field(pytree_node=False)


@struct.dataclass
class Picked:
    """The items a selection names per query. With ``selection.dense`` true (the dense
    warm-up) every complete item instead."""

    store: Any
    selection: Selection
    stride: int = struct.field(pytree_node=False)


@struct.dataclass
class KLTarget:
    """The indexer query [B, T, n, d] and head weights [B, T, n] whose scores over the read
    items learn the attention mass on them (training only)."""

    q: jax.Array
    w: jax.Array
