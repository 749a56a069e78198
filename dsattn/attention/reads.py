"""What a layer's queries read from its global items, and the blocked pass that reads it.

The items (compressed entries, or DSA's tokens) live in a store: `Entries` in the training
forward (the whole sequence's items as computed), the paged cache in cached execution. Both
answer `gather(name, idx, dtype)` and `read_all(name, dtype)`, so selectors and attention
cores are the same code in both modes. A layer reads either

- `Visible`: every item complete at the query (HCA; the dense warm-up), or
- `Picked`: the items its selection names per query (top-k of an indexer, or reused),

and `attend_blocks` runs a core's attention over query blocks (`blocks.map_queries`): per
block it gathers only that block's picks, so nothing of shape [T, H, items] or [T, T] exists,
and it computes the indexer's KL loss on the same block from the attention mass the core
reports (see `indexer.kl_terms`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from dsattn.attention import blocks, indexer


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


def attend_blocks(attend: Callable, size: int, per_query, positions, valid, read, dtype,
                  target: KLTarget | None = None):
    """Attention over query blocks of ``size``.

    ``attend(start, block, pos, items) -> (out [B, Tq, ...], mass [B, Tq, S] or None)``:
    the core's attention for a block, given the block's slices of ``per_query`` and
    ``positions`` and ``items``,
    the block's (values, mask [B, Tq, S]) of the global read (values [B, S, w] shared by the
    block or [B, Tq, S, w] per query), or None when the layer reads no global items; ``mass``
    is the attention probability on each of them summed over heads. Returns (out [B, T, ...],
    the indexer's KL loss or None).

    A dense read of the training forward's own items (`Entries`: query t is position t)
    runs in causal segments of query blocks (`blocks.map_causal`), each over the items
    complete before its end only (items after it are masked for every query of it).
    """
    everything = None
    dense = isinstance(read, Visible) or (isinstance(read, Picked)
                                          and read.selection.dense is not None)
    if dense:  # shared by every block: read once
        everything = read.store.read_all("entry", dtype)
        if target is not None:
            everything += (read.store.read_all("key", dtype)[0],)
    picks = (read.selection.idx, read.selection.ok) if isinstance(read, Picked) else ()
    tq = (target.q, target.w) if target is not None else ()

    def items_all(pos, limit):
        vals, stored = (a[:, :limit] for a in everything[:2])
        return vals, stored[:, None, :] & visible(pos, read.stride, vals.shape[1]), \
            everything[2][:, :limit] if target is not None else None

    def items_picked(pos, idx, ok):
        vals, got = read.store.gather("entry", idx, dtype)
        keys = read.store.gather("key", idx, dtype)[0] if target is not None else None
        return vals, ok & got, keys

    def one(start, blk, items):
        (q_blk, pos, ok_rows), picks_blk, tq_blk = blk
        if items is None:
            return attend(start, q_blk, pos, None)[0], ()
        vals, mask, keys = items
        out, mass = attend(start, q_blk, pos, (vals, mask))
        if target is None:
            return out, ()
        iq, w = tq_blk
        score = (indexer.scores(iq, w, keys) if keys.ndim == 3
                 else indexer.gathered_scores(iq, w, keys))
        return out, indexer.kl_terms(score, mass, mask & ok_rows[..., None])

    def body(start, blk, limit):
        (_, pos, _), picks_blk, _ = blk
        if read is None:
            return one(start, blk, None)
        if isinstance(read, Visible):
            return one(start, blk, items_all(pos, limit))
        picked = lambda: one(start, blk, items_picked(pos, *picks_blk))  # noqa: E731
        if read.selection.dense is None:
            return picked()
        return jax.lax.cond(read.selection.dense, lambda: one(start, blk, items_all(pos, limit)),
                            picked)

    per_block = ((per_query, positions, valid), picks, tq)
    if dense and isinstance(read.store, Entries):
        # items complete before the segment's end (at least one: no empty arrays)
        out, sums = blocks.map_causal(
            lambda start, blk, end: body(start, blk, max(1, end // read.stride)), size,
            per_block)
    else:
        out, sums = blocks.map_queries(lambda start, blk: body(start, blk, None), size,
                                       per_block)
    if target is None or read is None:
        return out, None
    total, count = sums
    return out, total / jnp.maximum(count, 1)
