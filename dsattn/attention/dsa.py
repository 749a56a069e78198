"""DeepSeek Sparse Attention (V3.2): MLA whose queries read only the top-k tokens a lightning
indexer picks (the DeepSeek-V3.2 report, "DeepSeek Sparse Attention").

The indexer key is LayerNorm(W^K x) with RoPE on its last `indexer.rope_dim` dims, one per
token, stored beside MLA's latent in the paged global cache. The selection is the same
indexer selector the V4 family uses (attention/selectors.py), over tokens instead of
compressed entries: decode scans the keys, takes the top-k and gathers only those tokens'
latents for the absorbed MLA path.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from dsattn.attention import indexer, reads
from dsattn.attention.context import CachedContext, StackContext
from dsattn.attention.mla import MLA
from dsattn.attention.selectors import IndexerSelector
from dsattn.attention.sources import paged_fields
from dsattn.cache import formats, paged
from dsattn.cache.layer_caches import DSACache
from dsattn.nn.layers import dense
from dsattn.nn.norms import LayerNorm, RMSNorm
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope_last


class DSA(MLA):
    def __init__(self, cfg, spec, rngs: nnx.Rngs):
        super().__init__(cfg, spec, rngs)
        ix, m = cfg.indexer, cfg.model
        dt = Precision.of(m)
        self.key_rope, self.page_size = ix.rope_dim, cfg.cache.page_size
        self.fields = paged_fields(cfg, spec)  # "entry": [C^KV | K^R], "key": search key
        self.selector = IndexerSelector(cfg, spec, cfg.attention.q_lora_rank or m.d_model,
                                        rngs)
        self.wk = dense(m.d_model, ix.head_dim, rngs, dt, m.init_std)
        norm = LayerNorm if ix.key_norm == "layernorm" else RMSNorm
        self.k_norm = norm(ix.head_dim, m.norm_eps, dtype=dt)
        self.rotate_keys = indexer.rotates_keys(cfg)

    def _as_stored(self, name, v):
        f = self.fields[name]
        return formats.as_stored(f.fmt, v, f.rope, self.fake_quant)

    def index_keys(self, x, positions):
        k = self.k_norm(self.wk(jax.lax.stop_gradient(x)))
        if self.key_rope:
            k = apply_rope_last(k, positions, self.theta, self.key_rope)
        return indexer.rotated(k, self.rotate_keys)

    def __call__(self, x, positions, step=None, ctx=StackContext()):
        cq = self.query_latent(x)
        q_nope, q_pe = self.queries(cq, positions)
        store = reads.Entries({"entry": self._as_stored("entry", self.latents(x, positions)),
                               "key": self._as_stored("key", self.index_keys(x, positions))})
        read, target, ctx = self.selector(store, cq, x, positions, self.theta, step, ctx,
                                          indexer.IN_TRAINING, self.dtype)
        # absorbed MLA over the picked tokens (the reference gathers a query block's only)
        y, (kl, recall) = self.absorbed((q_nope, q_pe), positions,
                                        jnp.ones(positions.shape, bool), (read,), target)
        # recall: (Σ, queries measured) in the dense warm-up, (0, 0) after (trainstep.loss_fn)
        return y, {"indexer_loss": self.selector.loss(kl), "indexer_recall": recall}, ctx

    def init_cache(self, batch: int, max_len: int):
        return DSACache(paged.empty(self.fields, batch, max_len, self.page_size, self.dtype))

    def extend(self, x, positions, valid, cache, ctx=CachedContext()):
        cq = self.query_latent(x)
        q_nope, q_pe = self.queries(cq, positions)
        new = {"entry": self.latents(x, positions), "key": self.index_keys(x, positions)}
        g = paged.append(cache.pages, new, jnp.sum(valid, -1, dtype=jnp.int32))
        read, _, ctx = self.selector(g, cq, x, positions, self.theta, None, ctx, None,
                                     self.dtype)  # only the top-k tokens' latents
        return (self.absorbed((q_nope, q_pe), positions, valid, (read,))[0], DSACache(g),
                ctx)
