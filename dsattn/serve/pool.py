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
import jax.numpy as jnp
import numpy as np

from dsattn import plan
from dsattn.cache import paged
from dsattn.cache.paged import PagedCache
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


def _paged_of(layer_cache) -> PagedCache | None:
    found = [c for c in jax.tree.leaves(layer_cache, is_leaf=lambda n: isinstance(n, PagedCache))
             if isinstance(c, PagedCache)]
    return found[0] if found else None


def pool_layers(cfg, state: DecodeState) -> tuple[PoolLayer, ...]:
    """The layers of `state` that own a paged cache (borrowers read another layer's)."""
    out = []
    for spec, lc in zip(plan.resolve(cfg), layer_caches(cfg, state)):
        c = _paged_of(lc)
        if c is not None:
            out.append(PoolLayer(spec.index, spec.stride, c.page_size, c.n_pages))
    return tuple(out)


def with_pool(cfg, state: DecodeState, pool_tokens: int) -> DecodeState:
    """An EMPTY `state` whose paged layers each hold pages for `pool_tokens` positions in
    all (shared by the rows) instead of every row's max_len: ceil(pool_tokens / stride /
    page_size) pages, never more than the state has."""
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be >= 1, got {pool_tokens}")
    specs = plan.resolve(cfg)

    def shrink(spec, c: PagedCache) -> PagedCache:
        n = min(c.n_pages, max(1, math.ceil(pool_tokens / spec.stride / c.page_size)))
        c = c.replace(pages=jax.tree.map(lambda a: a[:n], c.pages),
                      free=jnp.zeros((n,), jnp.int32), refs=jnp.zeros((n,), jnp.int32))
        return paged.regroup(c, 1)

    caches = [jax.tree.map(lambda c, s=spec: shrink(s, c) if isinstance(c, PagedCache) else c,
                           lc, is_leaf=lambda n: isinstance(n, PagedCache))
              for spec, lc in zip(specs, layer_caches(cfg, state))]
    return with_layer_caches(cfg, state, caches).replace(host_pos=state.host_pos)
