"""The host's view of a decode state's page pools: which layers keep a paged global cache,
how many pages a row holds after n positions (so admission and preemption are decided
before a step runs, never by an append that finds the pool empty), and pools sized to a
number of tokens rather than to every row's max_len.

A layer of stride s (plan.LayerSpec.stride: 1 for DSA's tokens, the ratio m for compressed
entries) holds n // s complete entries after n positions, ceil(that / page_size) pages.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dsattn import plan
from dsattn.cache.protocol import PagePool, is_container
from dsattn.model import DecodeState, layer_caches, with_layer_caches


@dataclasses.dataclass(frozen=True)
class PoolLayer:
    """One layer's page pool, as the host accounts for it."""

    layer: int
    stride: int
    page_size: int
    n_pages: int

    def pages(self, positions) -> np.ndarray:
        """Pages a row holds after `positions` positions (any shape)."""
        entries = np.asarray(positions, np.int64) // self.stride
        return -(-entries // self.page_size)


def _pool_of(layer_cache) -> PagePool | None:
    """The page pool of a layer's caches (cache.protocol's `page_pool`): its first pooled
    container's; None if none is pooled."""
    found = [c.page_pool() for c in jax.tree.leaves(layer_cache, is_leaf=is_container)
             if is_container(c) and c.page_pool() is not None]
    return found[0] if found else None


def pool_layers(cfg, state: DecodeState) -> tuple[PoolLayer, ...]:
    """The layers of `state` that own a paged cache, or any container declaring a page
    pool (cache.protocol's `page_pool`; borrowers read another layer's)."""
    out = []
    for spec, lc in zip(plan.resolve(cfg), layer_caches(cfg, state)):
        p = _pool_of(lc)
        if p is not None:
            out.append(PoolLayer(spec.index, spec.stride, p.page_size, p.n_pages))
    return tuple(out)


def with_pool(cfg, state: DecodeState, pool_tokens: int) -> DecodeState:
    """An EMPTY `state` whose paged layers each hold pages for `pool_tokens` positions in
    all (shared by the rows) instead of every row's max_len: ceil(pool_tokens / stride /
    page_size) pages, never more than the state has."""
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be >= 1, got {pool_tokens}")
    specs = plan.resolve(cfg)

    def shrink(spec, c):
        p = c.page_pool() if is_container(c) else None
        if p is None:
            return c
        return c.with_pages(min(p.n_pages, max(1, math.ceil(pool_tokens / spec.stride
                                                             / p.page_size))))

    caches = [jax.tree.map(lambda c, s=spec: shrink(s, c), lc, is_leaf=is_container)
              for spec, lc in zip(specs, layer_caches(cfg, state))]
    return with_layer_caches(cfg, state, caches).replace(host_pos=state.host_pos)
