"""The V4-family attention layer, built from parts (DESIGN §2):

    query (own) + local window KV (own) + a global source + a selector + the shared core.

| kind | global source                               | selector                       |
|------|---------------------------------------------|--------------------------------|
| swa  | none                                        | none                           |
| hca  | own compressor, no overlap, bias B (m'=128) | every complete entry           |
| csa  | own compressor, overlap, bias B (m=4)       | own indexer (own key compressor)|

Training runs the whole sequence with dense masks (short sequences); cached execution
(prefill chunks and decode) keeps the window in a ring buffer, the compressor's open span as
streaming state and complete entries in the paged global cache, and gathers only the
selected entries.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict

from dsattn.attention import indexer
from dsattn.attention.compressor import Compressor
from dsattn.attention.core import SinkAttentionOutput
from dsattn.attention.local import LocalKV, window_mask_dense
from dsattn.attention.query import Query
from dsattn.cache import formats, paged, ring


class V4Attention(nnx.Module):
    def __init__(self, cfg, layer: int, rngs: nnx.Rngs):
        a, m, ix, c = cfg.attention, cfg.model, cfg.indexer, cfg.cache
        dt = jnp.dtype(m.dtype)
        self.dtype = dt
        self.kind, self.ratio = cfg.kind(layer), cfg.layer_ratio(layer)
        # Compressed layers use their own RoPE base (V4: compress_rope_theta), SWA the plain one.
        self.theta = a.compress_rope_theta if self.ratio else a.rope_theta
        self.window, self.top_k, self.rope_dim = a.window, a.top_k, a.rope_dim
        self.local_fmt, self.page_size, self.fake_quant = c.local_format, c.page_size, c.fake_quant
        self.loss_weight, self.warmup = ix.loss_weight, ix.dense_warmup_steps
        self.query = Query(cfg, rngs)
        self.local = LocalKV(cfg, rngs)
        self.core = SinkAttentionOutput(cfg, rngs)
        fields = {}
        compressor = key_compressor = index_q = None
        if self.kind in ("hca", "csa"):
            compressor = Compressor(m.d_model, a.head_dim, self.ratio,
                                    overlap=self.kind == "csa", pos_bias=True,
                                    norm_eps=m.norm_eps, dtype=dt, rngs=rngs, std=m.init_std)
            fields["entry"] = paged.Field(c.main_format, a.head_dim, a.rope_dim)
        if self.kind == "csa":
            key_compressor = Compressor(m.d_model, ix.head_dim, self.ratio, overlap=True,
                                        pos_bias=True, norm_eps=m.norm_eps, dtype=dt,
                                        rngs=rngs, std=m.init_std)
            index_q = indexer.IndexerQuery(cfg, a.q_lora_rank, rngs)
            fields["key"] = paged.Field(c.key_format, ix.head_dim, ix.rope_dim)
        self.key_rope = ix.rope_dim
        # Sub-modules or None, assigned once (NNX fixes an attribute's data/static status).
        self.compressor = nnx.data(compressor)
        self.key_compressor = nnx.data(key_compressor)
        self.index_q = nnx.data(index_q)
        self.fields = FrozenDict(fields)  # hashable: module attributes are static under jit

    # -- helpers ---------------------------------------------------------------------------
    def _qdq(self, fmt, v, rope):
        return formats.quantize_dequantize(fmt, v, rope) if self.fake_quant else v

    def _entries(self, comp, pre_rope, index, rope_dim, field):
        """Entries after RoPE, rounded as the cache will store them when fake-quantizing."""
        f = self.fields[field]
        return self._qdq(f.fmt, comp.rope_entries(pre_rope, index, rope_dim, self.theta), f.rope)

    def _n_visible(self, positions):
        """Complete entries at each query position: entry j is visible iff j < (t+1)//m."""
        return (positions + 1) // self.ratio

    # -- training forward ------------------------------------------------------------------
    def __call__(self, x, positions, step=None):
        q, qr = self.query(x, positions, self.theta)
        kv = self._qdq(self.local_fmt, self.local(x, positions, self.theta), self.rope_dim)
        parts = [(kv, window_mask_dense(positions, positions, self.window))]
        aux = {}
        n = x.shape[1] // self.ratio if self.ratio else 0
        if n:
            idx = jnp.broadcast_to(jnp.arange(n), (x.shape[0], n))
            ent = self._entries(self.compressor, self.compressor.block(x), idx, self.rope_dim,
                                "entry")
            visible = jnp.arange(n) < self._n_visible(positions)[..., None]  # [B, T, n]
            mask = visible
            if self.kind == "csa":
                xs = jax.lax.stop_gradient(x)
                keys = self._entries(self.key_compressor, self.key_compressor.block(xs), idx,
                                     self.key_rope, "key")
                iq, w = self.index_q(qr, x, positions, self.theta)
                score = indexer.scores(iq, w, keys)
                sel, ok = indexer.select(score, visible, self.top_k)
                mask = indexer.selection_mask(sel, ok, n)
                if self.warmup and step is not None:
                    mask = jnp.where(step < self.warmup, visible, mask)
            parts.insert(0, (ent, mask))
        y, probs = self.core(q, parts, positions, self.theta)
        if n and self.kind == "csa":
            target = jnp.sum(probs[0], axis=2)  # attention mass per entry, summed over heads
            aux["indexer_loss"] = self.loss_weight * indexer.kl_loss(score, target, mask)
        return y, aux

    # -- cached execution ------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int):
        a_c = self.local.wkv.out_features
        cache = {"ring": ring.empty(self.local_fmt, batch, self.window, a_c, self.rope_dim,
                                    self.dtype)}
        if self.compressor is not None:
            cache["comp"] = self.compressor.init_state(batch)
            cache["global"] = paged.empty(self.fields, batch, max(max_len // self.ratio, 1),
                                          self.page_size, self.dtype)
        if self.key_compressor is not None:
            cache["key_comp"] = self.key_compressor.init_state(batch)
        return cache

    def extend(self, x, positions, valid, cache, ctx):
        q, qr = self.query(x, positions, self.theta)
        kv = self.local(x, positions, self.theta)
        keys, key_pos = ring.local_keys(cache["ring"], self.local_fmt, self.dtype, kv,
                                        positions, valid, self.window, self.rope_dim)
        new_cache = {"ring": ring.write(cache["ring"], self.local_fmt, kv, positions, valid,
                                        self.rope_dim)}
        parts = [(keys, ring.window_mask(key_pos, positions, self.window))]
        if self.compressor is not None:
            state, ent, ent_idx, ent_ok = self.compressor.step(cache["comp"], x, positions, valid)
            new_cache["comp"] = state
            new = {"entry": self.compressor.rope_entries(ent, ent_idx, self.rope_dim, self.theta)}
            if self.key_compressor is not None:
                kstate, kent, kidx, _ = self.key_compressor.step(cache["key_comp"], x, positions,
                                                                 valid)
                new_cache["key_comp"] = kstate
                new["key"] = self.key_compressor.rope_entries(kent, kidx, self.key_rope,
                                                              self.theta)
            g = paged.append(cache["global"], self.fields, new,
                             jnp.sum(ent_ok, -1, dtype=jnp.int32))
            new_cache["global"] = g
            n_vis = self._n_visible(positions)[..., None]  # [B, T, 1]
            if self.kind == "hca":  # every complete entry
                ents, stored = paged.read_all(g, self.fields, "entry", self.dtype)
                mask = stored[:, None, :] & (jnp.arange(ents.shape[1]) < n_vis)
                parts.insert(0, (ents, mask))
            else:  # csa: scan the search keys, gather only the top-k entries
                skeys, stored = paged.read_all(g, self.fields, "key", self.dtype)
                iq, w = self.index_q(qr, x, positions, self.theta)
                score = indexer.scores(iq, w, skeys)
                visible = stored[:, None, :] & (jnp.arange(skeys.shape[1]) < n_vis)
                sel, ok = indexer.select(score, visible, self.top_k)
                ents, got = paged.gather(g, self.fields, "entry", sel, self.dtype)
                parts.insert(0, (ents, ok & got))
        y, _ = self.core(q, parts, positions, self.theta)
        return y, new_cache
