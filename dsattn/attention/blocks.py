"""Queries in blocks: the training forward and a prefill chunk run their attention (and the
indexer's top-k) over blocks of `attention.query_block` queries, one block at a time, so what
is live scales with the block, not with T x T.

`map_queries` splits per-query arrays [B, T, ...] into blocks (padding the last), runs one
body per block under `lax.map` and joins the outputs. The body is checkpointed: under
autodiff a block's intermediates (scores, probabilities, gathered entries) are recomputed in
the backward pass instead of kept for every block, so a training step holds one block's.
A sequence of at most one block runs the body directly (decode, short training sequences).
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

    def split(a):
        a = jnp.pad(a, [(0, 0), (0, n_blk * size - t)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape((a.shape[0], n_blk, size) + a.shape[2:]), 1, 0)

    def join(a):
        a = jnp.moveaxis(a, 0, 1)
        return a.reshape((a.shape[0], n_blk * size) + a.shape[3:])[:, :t]

    one = jax.checkpoint(lambda j, blk: body(j * size, blk), prevent_cse=False, policy=policy)
    outs, sums = jax.lax.map(lambda xs: one(*xs),
                             (jnp.arange(n_blk, dtype=jnp.int32), jax.tree.map(split, per_query)))
    return jax.tree.map(join, outs), jax.tree.map(lambda s: jnp.sum(s, axis=0), sums)
