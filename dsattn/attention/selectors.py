"""Which global items each query attends to (DESIGN §2): every visible one, the top-k of a
lightning indexer (DSA, CSA, CSA2 full and reindex), or the selection an earlier layer made.

A selector is called with the query side (query latent, x, positions, RoPE base) and the
items' search keys, and returns the attention mask over the items (training) or the items
it read and which are real (cached), with the next context. Item `j` is visible at position
`t` once complete: j < (t + 1) // stride (stride: the compression ratio, 1 for tokens).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dsattn.attention import indexer
from dsattn.attention.context import Selection
from dsattn.cache import paged
from dsattn.plan import LayerSpec, Selector


def n_visible(positions, stride: int):
    """Complete items at each query position [B, T]."""
    return (positions + 1) // stride


def _visible(positions, stride: int, n: int):
    return jnp.arange(n) < n_visible(positions, stride)[..., None]  # [B, T, n]


class AllEntries(nnx.Module):
    """HCA: every complete entry."""

    def __init__(self, spec: LayerSpec):
        self.stride = spec.stride

    def __call__(self, q_latent, x, positions, theta, keys, n, step, ctx):
        return _visible(positions, self.stride, n), None, ctx

    def extend(self, g, q_latent, x, positions, theta, ctx, dtype):
        entries, stored = paged.read_all(g, "entry", dtype)
        mask = stored[:, None, :] & _visible(positions, self.stride, entries.shape[1])
        return entries, mask, ctx


class ReusedSelection(nnx.Module):
    """V4.1 reuse: the latest full or reindex layer's selection, read from the context."""

    def __call__(self, q_latent, x, positions, theta, keys, n, step, ctx):
        return ctx.selection, None, ctx

    def extend(self, g, q_latent, x, positions, theta, ctx, dtype):
        entries, got = paged.gather(g, "entry", ctx.selection.idx, dtype)
        return entries, ctx.selection.ok & got, ctx


class IndexerSelector(nnx.Module):
    """The top-k items of its own indexer query. A layer whose pool a later layer reads
    (V4.1's decoder full layer, with attention.pool_blocks > 0) also publishes the
    hierarchical indexer's candidate pool; that reindex layer scores only inside it."""

    def __init__(self, cfg, spec: LayerSpec, q_in: int, rngs: nnx.Rngs):
        a, ix = cfg.attention, cfg.indexer
        self.index_q = indexer.IndexerQuery(cfg, q_in, rngs)
        self.stride, self.top_k, self.method = spec.stride, a.top_k, ix.topk_method
        self.loss_weight, self.warmup = ix.loss_weight, ix.dense_warmup_steps
        self.impl, self.interpret = indexer.resolve_impl(cfg), ix.interpret
        self.pool_blocks = a.pool_blocks if spec.builds_pool else 0
        self.pool_block = a.pool_block_size
        self.reads_pool = spec.kind.reads_pool
        self.publishes = spec.kind.publishes_selection

    def __call__(self, q_latent, x, positions, theta, keys, n, step, ctx):
        """Training: (mask [B, T, n], indexer scores [B, T, n], next context)."""
        visible = _visible(positions, self.stride, n)
        iq, w = self.index_q(q_latent, x, positions, theta)
        score = indexer.scores(iq, w, keys)
        candidates = visible
        if self.reads_pool and ctx.pool is not None:
            candidates = visible & ctx.pool
        mask = indexer.selection_mask(*indexer.select(score, candidates, self.top_k,
                                                      self.method), n)
        if self.warmup and step is not None:  # dense attention while the indexer warms up
            mask = jnp.where(step < self.warmup, visible, mask)
        if self.pool_blocks:
            pool = indexer.candidate_pool(
                indexer.block_scores(score, visible, self.pool_block),
                n_visible(positions, self.stride), self.pool_block, self.pool_blocks)
            ctx = ctx.replace(pool=indexer.selection_mask(*pool, n))
        if self.publishes:
            ctx = ctx.replace(selection=mask)
        return mask, score, ctx

    def loss(self, score, target, mask):
        """The indexer's KL loss against the attention mass `target` [B, T, n] per item."""
        return self.loss_weight * indexer.kl_loss(score, target, mask)

    def _select(self, g, iq, w, n_vis, ctx, dtype):
        if self.reads_pool and ctx.pool is not None:  # score only the pooled candidates
            pool = ctx.pool
            keys, got = paged.gather(g, "key", pool.idx, dtype)
            pick, ok = indexer.select(indexer.gathered_scores(iq, w, keys), pool.ok & got,
                                      self.top_k, self.method)
            return Selection(jnp.take_along_axis(pool.idx, pick, axis=-1), ok), ctx
        score = indexer.paged_scores(iq, w, g, n_vis, self.impl, self.interpret,
                                     dtype, block_max=self.pool_block if self.pool_blocks
                                     else None)
        if self.pool_blocks:  # the pool ranks blocks by their maxima
            score, maxima = score
            ctx = ctx.replace(pool=Selection(*indexer.candidate_pool(
                maxima, n_vis, self.pool_block, self.pool_blocks)))
        return Selection(*indexer.select(score, score > -jnp.inf, self.top_k, self.method)), ctx

    def extend(self, g, q_latent, x, positions, theta, ctx, dtype):
        """Cached: (the selected items [B, T, k, width], which are real, next context)."""
        iq, w = self.index_q(q_latent, x, positions, theta)
        sel, ctx = self._select(g, iq, w, n_visible(positions, self.stride), ctx, dtype)
        if self.publishes:
            ctx = ctx.replace(selection=sel)
        entries, got = paged.gather(g, "entry", sel.idx, dtype)
        return entries, sel.ok & got, ctx


SELECTORS = {  # (cfg, spec, q_in, rngs) -> the selector, None: no global items
    Selector.NONE: lambda cfg, spec, q_in, rngs: None,
    Selector.ALL: lambda cfg, spec, q_in, rngs: AllEntries(spec),
    Selector.INDEXER: IndexerSelector,
    Selector.REUSE: lambda cfg, spec, q_in, rngs: ReusedSelection(),
}


def make(cfg, spec: LayerSpec, q_in: int, rngs: nnx.Rngs):
    """The layer's selector by its kind."""
    return SELECTORS[spec.kind.selector](cfg, spec, q_in, rngs)
