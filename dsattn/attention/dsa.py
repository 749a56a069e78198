"""DeepSeek Sparse Attention (V3.2): MLA whose queries read only the top-k tokens a lightning
indexer picks (REFERENCE.md §1.3).

The indexer key is LayerNorm(W^K x) with RoPE on its last `indexer.rope_dim` dims, one per
token, stored beside MLA's latent in the paged global cache. Decode scans the keys, takes
the top-k and gathers only those tokens' latents for the absorbed MLA path.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict

from dsattn.attention import indexer
from dsattn.attention.common import causal_mask, masked_softmax
from dsattn.attention.mla import MLA
from dsattn.cache import formats, paged
from dsattn.nn.layers import dense
from dsattn.nn.norms import LayerNorm, RMSNorm
from dsattn.nn.rope import apply_rope_last


class DSA(MLA):
    def __init__(self, cfg, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        ix, m = cfg.indexer, cfg.model
        dt = jnp.dtype(m.dtype)
        self.top_k, self.loss_weight = cfg.attention.top_k, ix.loss_weight
        self.warmup = ix.dense_warmup_steps
        self.key_rope = ix.rope_dim
        self.page_size = cfg.cache.page_size
        self.impl = indexer.resolve_impl(cfg)
        self.interpret, self.topk = ix.interpret, ix.topk
        self.fake_quant = cfg.cache.fake_quant
        self.fields = FrozenDict({  # hashable: module attributes are static under jit
            "latent": paged.Field(cfg.cache.main_format, self.dc + self.dr, self.dr),
            "key": paged.Field(cfg.cache.key_format, ix.head_dim, ix.rope_dim)})
        self.index_q = indexer.IndexerQuery(cfg, cfg.attention.q_lora_rank or m.d_model, rngs)
        self.wk = dense(m.d_model, ix.head_dim, rngs, dt, m.init_std)
        norm = LayerNorm if ix.key_norm == "layernorm" else RMSNorm
        self.k_norm = norm(ix.head_dim, m.norm_eps, dtype=dt)

    def _qdq(self, name, v):
        f = self.fields[name]
        return formats.quantize_dequantize(f.fmt, v, f.rope) if self.fake_quant else v

    def index_keys(self, x, positions):
        k = self.k_norm(self.wk(jax.lax.stop_gradient(x)))
        if self.key_rope:
            k = apply_rope_last(k, positions, self.theta, self.key_rope)
        return k

    def __call__(self, x, positions, step=None, ctx=None):
        cq = self.query_latent(x)
        q_nope, q_pe = self.queries(cq, positions)
        lat = self._qdq("latent", self.latents(x, positions))
        keys = self._qdq("key", self.index_keys(x, positions))
        iq, w = self.index_q(cq, x, positions, self.theta)
        score = indexer.scores(iq, w, keys)
        visible = causal_mask(positions, positions)
        idx, ok = indexer.select(score, visible, self.top_k, self.topk)
        mask = indexer.selection_mask(idx, ok, x.shape[1])
        if self.warmup and step is not None:
            mask = jnp.where(step < self.warmup, visible, mask)
        p = masked_softmax(self.naive_scores(q_nope, q_pe, lat), mask)
        loss = indexer.kl_loss(score, jnp.sum(p, axis=1), mask)
        return self.naive_output(p, lat), {"indexer_loss": self.loss_weight * loss}

    def init_cache(self, batch: int, max_len: int):
        return {"global": paged.empty(self.fields, batch, max_len, self.page_size, self.dtype)}

    def extend(self, x, positions, valid, cache, ctx):
        cq = self.query_latent(x)
        q_nope, q_pe = self.queries(cq, positions)
        new = {"latent": self.latents(x, positions), "key": self.index_keys(x, positions)}
        g = paged.append(cache["global"], self.fields, new, jnp.sum(valid, -1, dtype=jnp.int32))
        iq, w = self.index_q(cq, x, positions, self.theta)
        score = indexer.paged_scores(iq, w, g, self.fields, positions + 1, self.impl,
                                     self.interpret, self.dtype)
        idx, ok = indexer.select(score, score > -jnp.inf, self.top_k, self.topk)
        lat, _ = paged.gather(g, self.fields, "latent", idx, self.dtype)  # only the top-k
        p = masked_softmax(self.absorbed_scores(q_nope, q_pe, lat), ok)
        return self.absorbed_output(p, lat), {"global": g}



