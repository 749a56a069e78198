"""Queries in blocks: the training forward and a prefill chunk run their attention (and the
indexer's top-k) over blocks of `attention.query_block` queries, one block at a time, so what
is live scales with the block, not with T x T.

`map_queries` splits per-query arrays [B, T, ...] into blocks (padding the last), runs one
body per block under `lax.map` and joins the outputs. The body is checkpointed: under
autodiff a block's intermediates (scores, probabilities, gathered entries) are recomputed in
the backward pass instead of kept for every block, so a training step holds one block's.
A sequence of at most one block runs the body directly (decode, short training sequences).

`map_causal` runs the training forward's blocks in a few causal segments, each reading only
what is complete before its end (query t is position t there), so the work causal masking
would throw away is mostly never done.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def map_queries(body, size: int, per_query, policy=None):
    """Run ``body(start, block) -> (per_query_out, sums)`` over blocks of ``size`` queries.

    ``per_query``: a pytree of arrays [B, T, ...] (the same T); the body gets each sliced to
    [B, size, ...] (padded with zeros past T: give the body a validity mask that pads False
    when padded queries must not count) and the block's first query index ``start``. Returns
    the per-query outputs joined back to [B, T, ...] and ``sums`` added over the blocks.
    ``policy``: what the checkpointed body keeps for the backward pass (a jax.checkpoint
    policy; None: nothing, the body is recomputed).
    """
    t = jax.tree.leaves(per_query)[0].shape[1]
    if t <= size:
        return body(jnp.int32(0), per_query)
    n_blk = -(-t // size)

    def join(a):
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape((a.shape[0], n_blk * size) + a.shape[3:])[:, :t]

    one = jax.checkpoint(lambda j, blk: body(j * size, blk), prevent_cse=False, policy=policy)
    outs, sums = jax.lax.map(lambda xs: one(*xs),
                             (jnp.arange(n_blk, dtype=jnp.int32),
                              jax.tree.map(lambda a: split(a, 1, size), per_query)))
    return jax.tree.map(join, outs), jax.tree.map(lambda s: jnp.sum(s, axis=0), sums)


def split(a, axis: int, size: int):
    """`a` cut along `axis` into blocks of `size`, the blocks' axis first: [n_blk, ...,
    size, ...]; the last block padded with zeros (False in a mask)."""
    n = a.shape[axis]
    n_blk = -(-n // size)
    a = jnp.pad(a, [(0, n_blk * size - n) if d == axis else (0, 0) for d in range(a.ndim)])
    return jnp.moveaxis(a.reshape(a.shape[:axis] + (n_blk, size) + a.shape[axis + 1:]), axis, 0)


def per_step(block: int, query_block: int, n_queries: int) -> int:
    """Items a step of a blocked read (keys scored, entries attended) takes for a block of
    `n_queries` queries: `block` for a full block of `query_block`, proportionally more for
    fewer (a decode step), so the live scores stay query_block x block and decode is one
    pass."""
    return max(block, block * query_block // max(n_queries, 1))


# A training forward's query block reads nothing past its last position, yet one compiled
# block body must read as far as the last block does. Running the blocks in a few segments,
# each reading only what precedes its end, leaves (n + 1) / 2n of that work for n equal
# segments (5/8 for 4), at one compiled block body per segment.
CAUSAL_SEGMENTS = 4


def segments(t: int, size: int, count: int) -> list[tuple[int, int]]:
    """[start, end) query ranges of whole blocks of `size` covering T: at most `count`, each
    of two blocks or more (a lone block would run outside `map_queries`' loop, and XLA then
    holds several blocks' recomputation at once: 1.4x the temporaries at 4 blocks)."""
    n_blk = -(-t // size)
    count = max(1, min(count, n_blk // 2))
    edges = [min(t, (i * n_blk // count) * size) for i in range(count)] + [t]
    return list(zip(edges[:-1], edges[1:]))


def map_causal(body, size: int, per_query, policy=None):
    """`map_queries` for a training forward (query t at position t), in `CAUSAL_SEGMENTS`
    segments of whole blocks: ``body(start, block, end)`` gets its segment's end (a static
    int), past which no query of the block reads anything."""
    t = jax.tree.leaves(per_query)[0].shape[1]
    outs, sums = [], None
    for lo, hi in segments(t, size, CAUSAL_SEGMENTS):
        out, part = map_queries(lambda start, blk, lo=lo, hi=hi: body(lo + start, blk, hi),
                                size, jax.tree.map(lambda a, lo=lo, hi=hi: a[:, lo:hi],
                                                   per_query), policy)
        outs.append(out)
        sums = part if sums is None else jax.tree.map(jnp.add, sums, part)
    if len(outs) == 1:
        return outs[0], sums
    return jax.tree.map(lambda *o: jnp.concatenate(o, 1), *outs), sums
