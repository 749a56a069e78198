"""Which global items each query attends to: every visible one, the top-k of a lightning
indexer (DSA, CSA, CSA2 full and reindex), or the selection an earlier layer made.

A selector is called with the layer's store of items (attention/reads.py: the sequence's
items in training, the paged cache in cached execution, the same code for both) and the
query side (query latent, x, positions, RoPE base), and returns what the queries read
(`reads.Visible` or `reads.Picked`), the indexer's KL target if it has an indexer, and the
next context. Item `j` is visible at position `t` once complete: j < (t + 1) // stride
(stride: the compression ratio, 1 for tokens). Selection runs by query blocks, and the
indexer scores its keys by key blocks with a running top-k (`indexer.top_k`): O(T·k) live.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dsattn.attention import blocks, indexer, reads
from dsattn.attention.context import Selection
from dsattn.kernels import registry
from dsattn.plan import LayerSpec, Selector

SELECTION = "indexer_selection"  # the name a remat policy saves selections by


def n_visible(positions, stride: int):
    """Complete items at each query position [B, T]."""
    return (positions + 1) // stride


class AllEntries(nnx.Module):
    """HCA: every complete entry."""

    def __init__(self, spec: LayerSpec):
        self.stride = spec.stride

    def __call__(self, store, q_latent, x, positions, theta, step, ctx, impl, dtype):
        return reads.Visible(store, self.stride), None, ctx


class ReusedSelection(nnx.Module):
    """V4.1 reuse: the latest full or reindex layer's selection, read from the context."""

    def __init__(self, spec: LayerSpec):
        self.stride = spec.stride

    def __call__(self, store, q_latent, x, positions, theta, step, ctx, impl, dtype):
        return reads.Picked(store, ctx.selection, self.stride), None, ctx


class IndexerSelector(nnx.Module):
    """The top-k items of its own indexer query. A layer whose pool a later layer reads
    (V4.1's decoder full layer, with attention.pool_blocks > 0) also publishes the
    hierarchical indexer's candidate pool; that reindex layer scores only inside it."""

    def __init__(self, cfg, spec: LayerSpec, q_in: int, rngs: nnx.Rngs):
        a, ix = cfg.attention, cfg.indexer
        self.index_q = indexer.IndexerQuery(cfg, q_in, rngs)
        self.stride, self.top_k, self.method = spec.stride, a.top_k, ix.topk_method
        self.loss_weight, self.warmup = ix.loss_weight, ix.dense_warmup_steps
        # indexer.interpret: the interpreter everywhere; else by the lowering platform
        self.impl, self.interpret = indexer.resolve_impl(cfg), True if ix.interpret else None
        self.query_block, self.key_block = a.query_block, ix.key_block
        self.pool_blocks = a.pool_blocks if spec.builds_pool else 0
        self.pool_block = a.pool_block_size
        self.reads_pool = spec.kind.reads_pool
        self.publishes = spec.kind.publishes_selection

    def __call__(self, store, q_latent, x, positions, theta, step, ctx, impl, dtype):
        """(`reads.Picked`, the KL target, next context). ``impl`` None: the configured
        score implementation (cached execution); training passes `indexer.IN_TRAINING`."""
        iq, w = self.index_q(q_latent, x, positions, theta)
        sel, ctx = self._select(store, jax.lax.stop_gradient(iq), jax.lax.stop_gradient(w),
                                n_visible(positions, self.stride), ctx,
                                self.impl if impl is None else impl, dtype)
        if self.warmup and step is not None:  # dense attention while the indexer warms up
            sel = sel.replace(dense=jnp.asarray(step) < self.warmup)
        if self.publishes:
            ctx = ctx.replace(selection=sel)
        return reads.Picked(store, sel, self.stride), reads.KLTarget(iq, w), ctx

    def loss(self, kl):
        return self.loss_weight * kl

    def _select(self, store, iq, w, n_vis, ctx, impl, dtype):
        if self.reads_pool and ctx.pool is not None:  # score only the pooled candidates
            def in_pool(start, blk):
                pidx, pok, iq, w = blk
                keys, got = store.gather("key", pidx, dtype)
                pick, ok = indexer.select(indexer.gathered_scores(iq, w, keys), pok & got,
                                          self.top_k, self.method)
                return Selection(jnp.take_along_axis(pidx, pick, axis=-1), ok), ()

            pool = ctx.pool
            sel, _ = blocks.map_queries(in_pool, self.query_block, (pool.idx, pool.ok, iq, w))
            return checkpoint_name(sel, SELECTION), ctx
        return registry.dispatch(
            impl, lambda name: self._scored(store, iq, w, n_vis, ctx, name, dtype))

    def _scored(self, store, iq, w, n_vis, ctx, impl: str, dtype):
        """`_select` by scoring every visible key with the score pass `impl`."""
        block_max = self.pool_block if self.pool_blocks else None
        if indexer.uses_kernel(impl):  # the compiled score pass over the pages (all of them)
            def scored(iq, w, nv, end=None):
                out = indexer.paged_scores(iq, w, store, nv, impl, self.interpret, dtype,
                                           block_max=block_max)
                score, maxima = out if block_max else (out, None)
                return (*indexer.select(score, score > -jnp.inf, self.top_k, self.method),
                        maxima)
        else:
            keys, stored = store.read_all("key", dtype)

            def scored(iq, w, nv, end):
                n = keys.shape[1]
                if end is not None:  # the keys before the causal segment's end, at least k
                    n = min(n, max(end // self.stride, self.top_k, 1))
                idx, ok, maxima = indexer.top_k(iq, w, keys[:, :n], stored[:, :n], nv,
                                                self.top_k, self.key_block, self.method,
                                                block_max, self.query_block)
                if block_max:  # the blocks past the segment hold no candidate
                    missing = -(-keys.shape[1] // block_max) - maxima.shape[-1]
                    maxima = jnp.pad(maxima, [(0, 0), (0, 0), (0, missing)],
                                     constant_values=-jnp.inf)
                return idx, ok, maxima

        def one(start, blk, end=None):
            idx, ok, maxima = scored(*blk, end)
            pool = None
            if block_max:  # the pool ranks blocks by their maxima
                pool = Selection(*indexer.candidate_pool(maxima, blk[2], self.pool_block,
                                                         self.pool_blocks))
            return (Selection(idx, ok), pool), ()

        # the training forward (its own entries, scored by xla) reads causal segments
        by_blocks = blocks.map_causal if isinstance(store, reads.Entries) else blocks.map_queries
        (sel, pool), _ = by_blocks(one, self.query_block, (iq, w, n_vis))
        # kept, not recomputed, by a rematerialised backward pass (model.remat_policy)
        sel, pool = checkpoint_name((sel, pool), SELECTION)
        if pool is not None:
            ctx = ctx.replace(pool=pool)
        return sel, ctx


SELECTORS = {  # (cfg, spec, q_in, rngs) -> the selector, None: no global items
    Selector.NONE: lambda cfg, spec, q_in, rngs: None,
    Selector.ALL: lambda cfg, spec, q_in, rngs: AllEntries(spec),
    Selector.INDEXER: IndexerSelector,
    Selector.REUSE: lambda cfg, spec, q_in, rngs: ReusedSelection(spec),
}


def make(cfg, spec: LayerSpec, q_in: int, rngs: nnx.Rngs):
    """The layer's selector by its kind."""
    return SELECTORS[spec.kind.selector](cfg, spec, q_in, rngs)
