"""Where a V4-family layer's global entries come from (docs/design.md, "Attention families"): its own compressor, or
the latest full layer's entries (borrowed).

An own source compresses its input (a CED decoder full layer: the encoder's output) into
entries, and makes one search key per entry the way its kind says (`plan.Key`): a second
compressor (CSA) or a projection of the pre-RoPE entry (CSA2). Training computes every entry
of the sequence at once; cached execution streams the input through the compressors and
appends complete entries to the layer's paged global cache. A layer whose kind `shares`
publishes its entries (training) or its cache (cached) in the context it returns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict

from dsattn.attention import indexer
from dsattn.attention.compressor import Compressor
from dsattn.attention.context import CachedContext, StackContext
from dsattn.attention.reads import Entries
from dsattn.cache import formats, paged
from dsattn.nn.layers import dense
from dsattn.nn.norms import RMSNorm
from dsattn.nn.precision import Precision
from dsattn.plan import Key, LayerSpec, Source


def paged_fields(cfg, spec: LayerSpec) -> FrozenDict:
    """The paged layout of the global cache a layer reads: name -> Field (hashable, so it
    can be a static module attribute)."""
    return FrozenDict({name: paged.Field(getattr(cfg.cache, v.role.format_key), v.width, v.rope)
                       for name, v in spec.fields})


class CompressedKeys(nnx.Module):
    """CSA: search keys from a second, overlapping compressor over the (detached) input."""

    def __init__(self, cfg, ratio: int, rngs: nnx.Rngs):
        m, ix = cfg.model, cfg.indexer
        self.compressor = Compressor(m.d_model, ix.head_dim, ratio, overlap=True,
                                     pos_bias=True, norm_eps=m.norm_eps,
                                     dtype=Precision.of(m), rngs=rngs, std=m.init_std)

    def block(self, entry_compressor, src, pre_rope):
        return self.compressor, self.compressor.block(jax.lax.stop_gradient(src))

    def init_state(self, batch: int):
        return self.compressor.init_state(batch)

    def step(self, state, entry_compressor, src, positions, valid, pre, index):
        """(the key compressor's new state, the compressor that made the keys, keys before
        RoPE, their entry indices)."""
        state, kpre, kidx, _ = self.compressor.step(state, src, positions, valid)
        return state, self.compressor, kpre, kidx


class ProjectedKeys(nnx.Module):
    """CSA2: the search key is RMSNorm(W^IK entry) of the pre-RoPE entry (no second pass)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        a, m, ix = cfg.attention, cfg.model, cfg.indexer
        dt = Precision.of(m)
        self.key_proj = dense(a.entry_dim, ix.head_dim, rngs, dt, m.init_std)
        self.key_norm = RMSNorm(ix.head_dim, m.norm_eps, dtype=dt)

    def block(self, entry_compressor, src, pre_rope):
        return entry_compressor, self.key_norm(self.key_proj(jax.lax.stop_gradient(pre_rope)))

    def init_state(self, batch: int):
        return None  # no state: a key is a projection of its entry

    def step(self, state, entry_compressor, src, positions, valid, pre, index):
        return state, entry_compressor, self.key_norm(self.key_proj(pre)), index


KEY_BUILDERS = {Key.COMPRESSOR: lambda cfg, spec, rngs: CompressedKeys(cfg, spec.ratio, rngs),
                Key.ENTRY: lambda cfg, spec, rngs: ProjectedKeys(cfg, rngs),
                Key.NONE: lambda cfg, spec, rngs: None}


class OwnEntries(nnx.Module):
    """Entries from the layer's own compressor, stored in its own paged global cache."""

    def __init__(self, cfg, spec: LayerSpec, theta: float, rngs: nnx.Rngs):
        a, m, c = cfg.attention, cfg.model, cfg.cache
        dt = Precision.of(m)
        self.spec, self.theta, self.dtype = spec, theta, dt.dtype
        self.rope_dim, self.key_rope = a.rope_dim, cfg.indexer.rope_dim
        self.page_size, self.fake_quant = c.page_size, c.fake_quant
        self.rotate_keys = indexer.rotates_keys(cfg)
        self.fields = paged_fields(cfg, spec)
        self.compressor = Compressor(m.d_model, a.entry_dim, spec.ratio,
                                     overlap=spec.kind.overlap, pos_bias=spec.kind.pos_bias,
                                     norm_eps=m.norm_eps, dtype=dt, rngs=rngs, std=m.init_std)
        self.keys = nnx.data(KEY_BUILDERS[spec.kind.key](cfg, spec, rngs))
        self.source_norm = nnx.data(RMSNorm(m.d_model, m.norm_eps, dtype=dt)
                                    if spec.from_encoder else None)

    def _keys(self, comp, pre, index):
        """Search keys after RoPE (and the rotation before low-bit storage)."""
        return indexer.rotated(comp.rope_entries(pre, index, self.key_rope, self.theta),
                               self.rotate_keys)

    def _stored(self, field: str, v):
        """`v` rounded as the cache stores it when fake-quantizing."""
        f = self.fields[field]
        return formats.as_stored(f.fmt, v, f.rope, self.fake_quant)

    def __call__(self, x, ctx: StackContext, n: int):
        """Training: (the items: entries [B, n, c] and search keys [B, n, d] if the kind has
        them, as `reads.Entries`; the next context)."""
        src = self.source_norm(ctx.encoder_out) if self.source_norm is not None else x
        index = jnp.broadcast_to(jnp.arange(n), (x.shape[0], n))
        pre = self.compressor.block(src)
        items = {"entry": self._stored("entry", self.compressor.rope_entries(
            pre, index, self.rope_dim, self.theta))}
        if self.keys is not None:
            comp, kpre = self.keys.block(self.compressor, src, pre)
            items["key"] = self._stored("key", self._keys(comp, kpre, index))
        store = Entries(items)
        if self.spec.kind.shares:
            ctx = ctx.replace(entries=store)
        return store, ctx

    def init_cache(self, cache, batch: int, max_len: int):
        """The layer's cache (layer_caches.V4Cache) with its pages and compressor states."""
        return cache.replace(
            pages=paged.empty(self.fields, batch, max(max_len // self.spec.ratio, 1),
                              self.page_size, self.dtype),
            compressor=self.compressor.init_state(batch),
            key_compressor=None if self.keys is None else self.keys.init_state(batch))

    def extend(self, cache, x, positions, valid, ctx: CachedContext):
        """Stream the source through the compressor(s) and append complete entries.

        Returns (the paged cache to read, the layer's cache updated, the next context)."""
        if self.source_norm is not None:
            enc = ctx.encoder_out
            x, positions, valid = self.source_norm(enc.x), enc.positions, enc.valid
        state, pre, index, done = self.compressor.step(cache.compressor, x, positions, valid)
        new = {"entry": self.compressor.rope_entries(pre, index, self.rope_dim, self.theta)}
        key_state = cache.key_compressor
        if self.keys is not None:
            key_state, comp, kpre, kidx = self.keys.step(key_state, self.compressor, x,
                                                         positions, valid, pre, index)
            new["key"] = self._keys(comp, kpre, kidx)
        g = paged.append(cache.pages, new, jnp.sum(done, -1, dtype=jnp.int32))
        if self.spec.kind.shares:
            ctx = ctx.replace(global_cache=g)
        return g, cache.replace(pages=g, compressor=state, key_compressor=key_state), ctx


class BorrowedEntries(nnx.Module):
    """The latest full layer's entries and keys (training) or paged cache (cached); no
    parameters and no cache of its own."""

    def __call__(self, x, ctx: StackContext, n: int):
        return ctx.entries, ctx

    def init_cache(self, cache, batch: int, max_len: int):
        return cache

    def extend(self, cache, x, positions, valid, ctx: CachedContext):
        return ctx.global_cache, cache, ctx


def published(spec: LayerSpec, cache):
    """The paged cache a layer's cached run publishes to later layers, or None."""
    return cache.pages if spec.kind.shares else None


SOURCES = {  # (cfg, spec, theta, rngs) -> the source; None: window only (or not V4)
    Source.COMPRESSOR: OwnEntries,
    Source.BORROWED: lambda cfg, spec, theta, rngs: BorrowedEntries(),
}


def make(cfg, spec: LayerSpec, theta: float, rngs: nnx.Rngs):
    """The layer's global source by its kind."""
    factory = SOURCES.get(spec.kind.source)
    return factory(cfg, spec, theta, rngs) if factory else None
