"""The reference implementation of an attention read (`attend.Read`): blocked XLA code, the
registry's "xla" entry and the semantics every fused kernel is checked against.

Queries run in blocks of `query_block` (`blocks.map_queries`; in the training forward
`blocks.map_causal`, whose segments read only what is complete before their end), so no
[T, T] array exists. Per block each part gives its keys and mask (a `Keys` slice, the
window's slice, the block's picks gathered, or every complete item), the layout forms the
scores, one softmax spans the parts (with the sink in its denominator), and the layout
mixes the values. Where no probabilities are wanted a long shared part is read a block of
entries at a time by an online softmax (`_online`). With the indexer's KL target the block
also computes its KL terms from the attention mass on each global item (`indexer.kl_terms`),
and where it reads a selection densely (the dense warm-up) optionally the selection's recall
of that mass (`indexer.recall_terms`).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from dsattn.attention import blocks, indexer, reads
from dsattn.attention.attend import GLOBAL, Keys, Layout, Read
from dsattn.attention.common import (causal_mask, shared_mix, shared_scores, softmax,
                                     softmax_dtype, split_keys, wide_product)
from dsattn.attention.local import Window


# -- the layouts' scores and mixing ------------------------------------------------------
# Each: prepare(q, items) once per block; scores(q, arrays) -> unscaled scores with the key axis
# last; mix(p, arrays) -> that part's weighted values; finish(sum of mixes, q) -> [B,Tq,H,dv].
# head_axis: where the heads sit in the scores; key_axis: the keys' axis in the arrays.

class _Grouped:
    """MHA/GQA/MQA: dot_generals batched over (B, G) with K/V in their stored [S, d] layout
    (q·Kᵀ contracts both minor dims, p·V is a plain matmul), which XLA runs in place.
    Scores [B, H, Tq, S]."""

    head_axis, key_axis = 1, 2
    batch = ((0, 1), (0, 1))

    @staticmethod
    def prepare(q, items):
        """q [B, Tq, H, d] -> [B, G, g·Tq, d], once for every part."""
        b, tq, h, d = q.shape
        g = items[0][0][0].shape[1]
        q = jnp.transpose(q.reshape(b, tq, g, h // g, d), (0, 2, 3, 1, 4))
        return q.reshape(b, g, -1, d), (b, tq, h)

    @classmethod
    def scores(cls, qq, arrays):
        q, (b, tq, h) = qq
        product = functools.partial(jax.lax.dot_general,
                                    dimension_numbers=(((3,), (3,)), cls.batch))
        return wide_product(product, q, arrays[0]).reshape(b, h, tq, -1)

    @classmethod
    def mix(cls, p, arrays, value_dim):
        v = arrays[1]
        b, _, tq, n = p.shape
        p = p.reshape(b, v.shape[1], -1, n)
        return jax.lax.dot_general(p.astype(v.dtype), v, (((3,), (2,)), cls.batch))

    @staticmethod
    def finish(o, qq):
        _, (b, tq, h) = qq
        g = o.shape[1]
        o = jnp.transpose(o.reshape(b, g, h // g, tq, -1), (0, 3, 1, 2, 4))
        return o.reshape(b, tq, h, -1)


class _PerHead:
    """MLA's naive path: per-head K^C and V expanded from the latent, K^R shared by all
    heads. Scores [B, H, Tq, S]."""

    head_axis, key_axis = 1, 1

    @staticmethod
    def prepare(q, items):
        return q

    @staticmethod
    def scores(q, arrays):
        (q_nope, q_pe), (k_nope, k_pe, _) = q, arrays
        s = wide_product(functools.partial(jnp.einsum, "bqhn,bshn->bhqs"), q_nope, k_nope)
        return s + wide_product(functools.partial(jnp.einsum, "bqhr,bsr->bhqs"), q_pe, k_pe)

    @staticmethod
    def mix(p, arrays, value_dim):
        v = arrays[2]
        return jnp.einsum("bhqs,bshv->bqhv", p.astype(v.dtype), v)

    @staticmethod
    def finish(o, q):
        return o


class _Shared:
    """One entry per key is K and V for every head: entries [B, S, c] shared by the block's
    queries, or [B, Tq, S, c] gathered per query. Scores [B, Tq, H, S]. With ``value_dim``
    the values are each entry's first value_dim channels (MLA's latent without K^R; a shared
    part mixes whole stored rows and slices after: slicing them first would copy them)."""

    head_axis, key_axis = 2, 1

    @staticmethod
    def prepare(q, items):
        chex.assert_rank(q, 4)
        return q

    @staticmethod
    def scores(q, arrays):
        entries = arrays[0]
        chex.assert_rank(entries, {3, 4})
        if entries.ndim == 3:
            return shared_scores(q, entries)
        return wide_product(functools.partial(jnp.einsum, "bthc,btsc->bths"), q, entries)

    @staticmethod
    def mix(p, arrays, value_dim):
        entries = arrays[0]
        if entries.ndim == 3:
            return _values(shared_mix(p.astype(entries.dtype), entries), value_dim)
        return jnp.einsum("bths,btsc->bthc", p.astype(entries.dtype),
                          _values(entries, value_dim))

    @staticmethod
    def finish(o, q):
        return o


def _values(x, value_dim):
    """The first value_dim channels of x (all when None)."""
    return x if value_dim is None else x[..., :value_dim]


LAYOUTS = {Layout.GROUPED: _Grouped, Layout.PER_HEAD: _PerHead, Layout.SHARED: _Shared}


# -- one softmax over the parts -------------------------------------------------------------
def _at_heads(x, ndim: int, axis: int):
    """A per-head [H] vector shaped to broadcast against scores with heads at ``axis``."""
    return x.reshape(tuple(-1 if d == axis else 1 for d in range(ndim)))


def _masked(lay, s, mask, scale):
    """Scores s scaled, -inf where the mask [B, Tq, S] is False."""
    chex.assert_type(mask, bool)
    return jnp.where(jnp.expand_dims(mask, lay.head_axis), s * scale, -jnp.inf)


def _softmax(s, sink, head_axis: int):
    """Softmax over the last axis of masked scores s. With a sink [H] (a logit of zero
    value in every row's denominator) the running max is finite; without, a row that sees
    nothing (a padded query) gives zeros instead of NaN."""
    if sink is None:
        return softmax(s)
    sink = _at_heads(sink.astype(s.dtype), s.ndim, head_axis)
    m = jax.lax.stop_gradient(jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink))
    e = jnp.exp(s - m)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))


def block_attention(q, parts, sink, entry_block: int | None = None, scale=None):
    """The V4 core's attention of one query block (SHARED layout): q [B, T, H, c] over
    parts [(entries [B, S, c] shared or [B, T, S, c] gathered, mask [B, T, S])] under one
    softmax with the sink [H], scale c^-1/2 unless given. Returns (out [B, T, H, c], the
    probabilities per part [B, T, H, S], None when ``entry_block`` read a long shared part
    by the online softmax)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    items = [((e,), m) for e, m in parts]
    return _attend_parts(_Shared, _Shared.prepare(q, items), items, sink, scale, None,
                         entry_block)


def _attend_parts(lay, q, items, sink, scale, value_dim, per_step):
    """(out [B, Tq, H, dv], probabilities per part or None) of prepared queries over the
    block's items [(arrays, mask)]."""
    if per_step is not None and lay is _Shared and any(
            a[0].ndim == 3 and a[0].shape[1] > per_step for a, _ in items):
        return _online(q, items, sink, scale, value_dim, per_step), None
    # the parts' scores and masks joined, then scaled and masked once
    s, mask = (jnp.concatenate(x, axis=-1) if len(x) > 1 else x[0]
               for x in zip(*((lay.scores(q, arrays), mask) for arrays, mask in items)))
    p = _softmax(_masked(lay, s, mask, scale), sink, lay.head_axis)
    probs = split_keys(p, [m.shape[-1] for _, m in items]) if len(items) > 1 else [p]
    out = sum(lay.mix(pp, arrays, value_dim) for (arrays, _), pp in zip(items, probs))
    return lay.finish(out, q), probs


def _online(q, items, sink, scale, value_dim, block: int):
    """The output by a running (max, sum, weighted sum) over the parts, a shared part
    longer than `block` a block of entries at a time: no [B, Tq, H, S] array. It starts
    from the sink, which every row's denominator holds (zero value): the running max is
    finite from the start, and a row that sees no entry gets zeros."""
    sd = softmax_dtype(q.dtype)
    sink = sink.astype(sd)[None, None, :, None]
    m = jax.lax.stop_gradient(jnp.broadcast_to(sink, q.shape[:3] + (1,)))
    state = (m, jnp.exp(sink - m), jnp.zeros(q.shape, sd))

    def absorb(state, arrays, mask):
        m, l, acc = state
        s = _masked(_Shared, _Shared.scores(q, arrays), mask, scale)
        m_new = jnp.maximum(m, jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
        e, decay = jnp.exp(s - m_new), jnp.exp(m - m_new)
        return (m_new, l * decay + jnp.sum(e, axis=-1, keepdims=True),
                acc * decay + _Shared.mix(e, arrays, None).astype(sd))

    for arrays, mask in items:
        entries = arrays[0]
        if entries.ndim == 4 or entries.shape[1] <= block:
            state = absorb(state, arrays, mask)
            continue
        # padding is masked
        xs = (blocks.split(entries, 1, block), blocks.split(mask, 2, block))
        state = jax.lax.scan(lambda st, x: (absorb(st, (x[0],), x[1]), None), state, xs)[0]
    _, l, acc = state
    return _values((acc / l).astype(jnp.result_type(*(a[0].dtype for a, _ in items))),
                   value_dim)


# -- the blocked pass ---------------------------------------------------------------------------
def run(read: Read, prologue, epilogue):
    """(epilogue's output [B, T, ...], the indexer's KL loss or None) of ``read`` by query
    blocks (module docstring); with a KL target (KL loss, recall terms) for the loss."""
    lay = LAYOUTS[read.layout]
    glob, target = read.global_read, read.target
    if glob is None:
        target = None
    dense = isinstance(glob, reads.Visible) or (isinstance(glob, reads.Picked)
                                                and glob.selection.dense is not None)
    everything = None
    if dense:  # shared by every block: read once
        everything = glob.store.read_all("entry", read.dtype)
        if target is not None:
            everything += (glob.store.read_all("key", read.dtype)[0],)
    picks = (glob.selection.idx, glob.selection.ok) if isinstance(glob, reads.Picked) else ()
    tq = (target.q, target.w) if target is not None else ()
    # the entry block of an online softmax (none when the KL target needs probabilities)
    entry_block = read.entry_block if target is None else None

    def items_all(pos, limit):
        vals, stored = (a[:, :limit] for a in everything[:2])
        return ((vals,), stored[:, None, :] & reads.visible(pos, glob.stride, vals.shape[1]),
                everything[2][:, :limit] if target is not None else None)

    def items_picked(pos, idx, ok):
        vals, got = glob.store.gather("entry", idx, read.dtype)
        keys = glob.store.gather("key", idx, read.dtype)[0] if target is not None else None
        return (vals,), ok & got, keys

    def local(part, start, pos, end):
        """A `Keys` or `Window` part's (arrays, mask) for the block."""
        if isinstance(part, Window):
            keys, key_pos = part.block(start, pos.shape[1])
            return (keys,), part.mask(key_pos, pos)
        arrays, kpos, seen = part.arrays, part.pos, part.seen
        if part.sequence and end is not None:  # keys before the causal segment's end
            arrays = tuple(jax.lax.slice_in_dim(a, 0, end, axis=lay.key_axis)
                           for a in arrays)
            kpos = kpos[:, :end]
        mask = causal_mask(pos, kpos)
        return arrays, mask if seen is None else mask & seen[:, None]

    def one(start, blk, glob_items, end, picks=None):
        (q_blk, pos, ok_rows), _, tq_blk = blk
        items = [local(p, start, pos, end) for p in read.parts if not isinstance(p, GLOBAL)]
        if glob_items is not None:
            items.insert(0, glob_items[:2])
        qq = lay.prepare(prologue(q_blk), items)
        per_step = (None if entry_block is None
                    else blocks.per_step(entry_block, read.query_block, pos.shape[1]))
        out, probs = _attend_parts(lay, qq, items, read.sink, read.scale, read.value_dim,
                                   per_step)
        y = epilogue(out, pos)
        if target is None:
            return y, ()
        # attention mass per global item, summed over heads: the indexer's KL target
        mass = probs[0].sum(axis=lay.head_axis)
        iq, w = tq_blk
        keys, mask = glob_items[2], glob_items[1]
        score = (indexer.scores(iq, w, keys) if keys.ndim == 3
                 else indexer.gathered_scores(iq, w, keys))
        mask = mask & ok_rows[..., None]
        # a dense read's selection (`picks`) against the mass's own top-k; none in the other
        return y, (indexer.kl_terms(score, mass, mask),
                   indexer.no_recall(mass) if picks is None
                   else indexer.recall_terms(mass, mask, *picks))

    def body(start, blk, end):
        (_, pos, _), picks_blk, _ = blk
        if glob is None:
            return one(start, blk, None, end)
        limit = None if end is None else max(1, end // glob.stride)
        if isinstance(glob, reads.Visible):
            return one(start, blk, items_all(pos, limit), end)
        picked = lambda: one(start, blk, items_picked(pos, *picks_blk), end)  # noqa: E731
        if glob.selection.dense is None:
            return picked()
        return jax.lax.cond(glob.selection.dense,
                            lambda: one(start, blk, items_all(pos, limit), end, picks_blk),
                            picked)

    per_block = ((read.q, read.positions, read.valid), picks, tq)
    # the training forward's own keys or items (query t at position t) read causal segments
    causal = (any(isinstance(p, Keys) and p.sequence for p in read.parts)
              or (dense and isinstance(glob.store, reads.Entries)))
    if causal:
        out, sums = blocks.map_causal(body, read.query_block, per_block)
    else:
        out, sums = blocks.map_queries(lambda start, blk: body(start, blk, None),
                                       read.query_block, per_block)
    if target is None:
        return out, None
    (total, count), recall = sums
    return out, (total / jnp.maximum(count, 1), recall)

