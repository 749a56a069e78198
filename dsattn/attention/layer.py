"""The V4-family attention layer (swa, hca, csa, full, reindex, reuse), composed from parts
(docs/design.md, "Attention families"; what each kind uses is the table in dsattn/plan.py):

    query (own) + local window KV (own) + a global source + a selector + the shared core.

The source (attention/sources.py) yields entries and search keys, own or borrowed; the
selector (attention/selectors.py) picks which entries each query reads, and the core attends
by query blocks, gathering only what each block reads. Training holds the whole sequence's
entries; cached execution keeps the window in a ring buffer, the compressor's open span as
streaming state and complete entries in the paged global cache. Both take a context and
return the next one.
"""

import jax.numpy as jnp
from flax import nnx

from dsattn.attention import indexer, selectors, sources
from dsattn.attention.context import CachedContext, StackContext
from dsattn.attention.core import SinkAttentionOutput
from dsattn.attention.local import LocalKV, Window
from dsattn.attention.query import Query
from dsattn.cache import formats, ring
from dsattn.cache.layer_caches import V4Cache
from dsattn.nn.rope import scaled
from dsattn.plan import LayerSpec


class V4Attention(nnx.Module):
    def __init__(self, cfg, spec: LayerSpec, rngs: nnx.Rngs):
        a, c = cfg.attention, cfg.cache
        self.dtype = jnp.dtype(cfg.model.dtype)
        self.ratio = spec.ratio
        # Compressed layers use their own RoPE base (V4: compress_rope_theta), SWA the plain one.
        # YaRN (attention.rope_scaling) scales the compressed layers' rope only, as V4 ships.
        self.theta = scaled(cfg, a.compress_rope_theta) if spec.ratio else a.rope_theta
        self.window, self.rope_dim = a.window, a.rope_dim
        self.local_fmt, self.fake_quant = c.local_format, c.fake_quant
        self.query = Query(cfg, rngs)
        self.local = LocalKV(cfg, rngs)
        self.core = SinkAttentionOutput(cfg, rngs)
        # Sub-modules or None, assigned once (NNX fixes an attribute's data/static status).
        self.source = nnx.data(sources.make(cfg, spec, self.theta, rngs))
        self.selector = nnx.data(selectors.make(cfg, spec, a.q_lora_rank, rngs))

    def __call__(self, x, positions, step=None, ctx=StackContext()):
        """Training forward over x [B, T, D]: (output, aux losses and metrics, next
        context)."""
        q, qr = self.query(x, positions, self.theta)
        kv = formats.as_stored(self.local_fmt, self.local(x, positions, self.theta),
                               self.rope_dim, self.fake_quant)
        n = x.shape[1] // self.ratio if self.ratio else 0
        read = target = None
        if n:
            store, ctx = self.source(x, ctx, n)
            read, target, ctx = self.selector(store, qr, x, positions, self.theta, step, ctx,
                                              indexer.IN_TRAINING, self.dtype)
        y, terms = self.core(q, positions, jnp.ones(positions.shape, bool),
                             Window.of_sequence(kv, positions, self.window), read, self.theta,
                             target)
        if terms is None:
            return y, {}, ctx
        kl, recall = terms  # recall: (Σ, queries measured), (0, 0) past the dense warm-up
        return y, {"indexer_loss": self.selector.loss(kl), "indexer_recall": recall}, ctx

    def init_cache(self, batch: int, max_len: int) -> V4Cache:
        """The ring always; streaming state and pages only for layers that own entries."""
        cache = V4Cache(ring.empty(self.local_fmt, batch, self.window,
                                   self.local.wkv.out_features, self.rope_dim, self.dtype))
        return cache if self.source is None else self.source.init_cache(cache, batch, max_len)

    def extend(self, x, positions, valid, cache: V4Cache, ctx=CachedContext()):
        """Cached prefill/decode of x [B, T, D] at `positions` (where `valid`): (output, the
        layer's new cache, next context)."""
        q, qr = self.query(x, positions, self.theta)
        kv = self.local(x, positions, self.theta)
        keys, key_pos = ring.local_keys(cache.ring, self.dtype, kv, positions, valid,
                                        self.window)
        new = cache.replace(ring=ring.write(cache.ring, kv, positions, valid))
        window = Window(keys, key_pos, lead=keys.shape[1] - x.shape[1], size=self.window,
                        ring=new.ring)
        read = None
        if self.source is not None:
            g, new, ctx = self.source.extend(new, x, positions, valid, ctx)
            read, _, ctx = self.selector(g, qr, x, positions, self.theta, None, ctx, None,
                                         self.dtype)
        y, _ = self.core(q, positions, valid, window, read, self.theta)
        return y, new, ctx
