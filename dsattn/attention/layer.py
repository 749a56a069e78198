"""The V4-family attention layer, built from parts (DESIGN §2):

    query (own) + local window KV (own) + a global source + a selector + the shared core.

| kind    | global source                                | selector                          |
|---------|----------------------------------------------|-----------------------------------|
| swa     | none                                         | none                              |
| hca     | own compressor, no overlap, bias B (m'=128)  | every complete entry              |
| csa     | own compressor, overlap, bias B (m=4)        | own indexer (own key compressor)  |
| full    | own CSA2 compressor (no overlap, no B)       | own indexer; key = W^IK(entry)    |
| reindex | borrowed from the latest full layer          | own indexer (inside the pool)     |
| reuse   | borrowed from the latest full layer          | the latest full/reindex selection |

What layers share travels in `ctx` along the stack: the latest full layer's entries and
search keys, the latest selection and (hierarchical indexer) the candidate pool; never an
attention result. Under CED a decoder full layer compresses the encoder's output
(`ctx["encoder_out"]`), not its own input.

Training runs the whole sequence with dense masks (short sequences); cached execution keeps
the window in a ring buffer, the compressor's open span as streaming state and complete
entries in the paged global cache, and gathers only the selected entries.
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
from dsattn.nn.layers import dense
from dsattn.nn.norms import RMSNorm

OWNS_GLOBAL = ("hca", "csa", "full")
OWN_INDEXER = ("csa", "full", "reindex")


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
        self.key_rope = ix.rope_dim
        self.pool_blocks, self.pool_block = a.pool_blocks, a.pool_block_size
        self.interpret, self.topk = ix.interpret, ix.topk
        self.impl = indexer.resolve_impl(cfg) if self.kind in OWN_INDEXER else ""
        # Under CED, decoder full layers compress the encoder's output.
        self.from_encoder = bool(a.ced_split) and layer >= a.ced_split and self.kind == "full"
        self.query = Query(cfg, rngs)
        self.local = LocalKV(cfg, rngs)
        self.core = SinkAttentionOutput(cfg, rngs)
        fields, parts = {}, dict(compressor=None, key_compressor=None, key_proj=None,
                                 key_norm=None, index_q=None, source_norm=None)
        if self.kind in OWNS_GLOBAL:
            csa2 = self.kind == "full"
            parts["compressor"] = Compressor(
                m.d_model, a.head_dim, self.ratio, overlap=self.kind == "csa",
                pos_bias=not csa2, norm_eps=m.norm_eps, dtype=dt, rngs=rngs, std=m.init_std)
            fields["entry"] = paged.Field(c.main_format, a.head_dim, a.rope_dim)
        if self.kind == "csa":
            parts["key_compressor"] = Compressor(
                m.d_model, ix.head_dim, self.ratio, overlap=True, pos_bias=True,
                norm_eps=m.norm_eps, dtype=dt, rngs=rngs, std=m.init_std)
        if self.kind == "full":  # CSA2: the search key is a projection of the pre-RoPE entry
            parts["key_proj"] = dense(a.head_dim, ix.head_dim, rngs, dt, m.init_std)
            parts["key_norm"] = RMSNorm(ix.head_dim, m.norm_eps, dtype=dt)
        if self.kind in ("csa", "full", "reindex", "reuse"):  # borrowers read the same layout
            fields["entry"] = paged.Field(c.main_format, a.head_dim, a.rope_dim)
            fields["key"] = paged.Field(c.key_format, ix.head_dim, ix.rope_dim)
        if self.kind in OWN_INDEXER:
            parts["index_q"] = indexer.IndexerQuery(cfg, a.q_lora_rank, rngs)
        if self.from_encoder:
            parts["source_norm"] = RMSNorm(m.d_model, m.norm_eps, dtype=dt)
        # Sub-modules or None, assigned once (NNX fixes an attribute's data/static status).
        for name, module in parts.items():
            setattr(self, name, nnx.data(module))
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

    def _source(self, x, ctx):
        """What this layer compresses: its own input, or (CED decoder) the encoder output."""
        if not self.from_encoder:
            return x
        return self.source_norm(ctx["encoder_out"])

    def _search_keys(self, src, pre_rope, index):
        """Search keys, one per entry: own key compressor (CSA) or W^IK(entry) (CSA2)."""
        if self.kind == "csa":
            pre = self.key_compressor.block(jax.lax.stop_gradient(src))
            comp = self.key_compressor
        else:
            pre = self.key_norm(self.key_proj(jax.lax.stop_gradient(pre_rope)))
            comp = self.compressor
        return self._entries(comp, pre, index, self.key_rope, "key")

    # -- training forward ------------------------------------------------------------------
    def __call__(self, x, positions, step=None, ctx=None):
        ctx = {} if ctx is None else ctx
        q, qr = self.query(x, positions, self.theta)
        kv = self._qdq(self.local_fmt, self.local(x, positions, self.theta), self.rope_dim)
        parts = [(kv, window_mask_dense(positions, positions, self.window))]
        aux, score = {}, None
        n = x.shape[1] // self.ratio if self.ratio else 0
        if n:
            visible = jnp.arange(n) < self._n_visible(positions)[..., None]  # [B, T, n]
            if self.kind in OWNS_GLOBAL:
                src = self._source(x, ctx)
                idx = jnp.broadcast_to(jnp.arange(n), (x.shape[0], n))
                pre = self.compressor.block(src)
                ent = self._entries(self.compressor, pre, idx, self.rope_dim, "entry")
                keys = self._search_keys(src, pre, idx) if self.kind != "hca" else None
                if self.kind == "full":
                    ctx["shared"] = (ent, keys)
            else:
                ent, keys = ctx["shared"]
            mask = visible
            if self.kind in OWN_INDEXER:
                iq, w = self.index_q(qr, x, positions, self.theta)
                score = indexer.scores(iq, w, keys)
                candidates = visible
                if self.kind == "reindex" and "pool" in ctx:
                    candidates = visible & ctx["pool"]
                sel, ok = indexer.select(score, candidates, self.top_k, self.topk)
                mask = indexer.selection_mask(sel, ok, n)
                if self.warmup and step is not None:
                    mask = jnp.where(step < self.warmup, visible, mask)
                if self.kind == "full" and self.pool_blocks:
                    pidx, pok = indexer.candidate_pool(
                        indexer.block_scores(score, visible, self.pool_block),
                        self._n_visible(positions), self.pool_block, self.pool_blocks)
                    ctx["pool"] = indexer.selection_mask(pidx, pok, n)
                ctx["selection"] = mask
            elif self.kind == "reuse":
                mask = ctx["selection"]
            parts.insert(0, (ent, mask))
        y, probs = self.core(q, parts, positions, self.theta)
        if score is not None:
            target = jnp.sum(probs[0], axis=2)  # attention mass per entry, summed over heads
            aux["indexer_loss"] = self.loss_weight * indexer.kl_loss(score, target, mask)
        return y, aux

    # -- cached execution ------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int):
        """The ring always; streaming state and pages only for layers that own entries."""
        c = self.local.wkv.out_features
        cache = {"ring": ring.empty(self.local_fmt, batch, self.window, c, self.rope_dim,
                                    self.dtype)}
        if self.kind in OWNS_GLOBAL:
            cache["comp"] = self.compressor.init_state(batch)
            cache["global"] = paged.empty(self.fields, batch, max(max_len // self.ratio, 1),
                                          self.page_size, self.dtype)
        if self.kind == "csa":
            cache["key_comp"] = self.key_compressor.init_state(batch)
        return cache

    def _append(self, cache, new_cache, src, src_pos, src_valid):
        """Stream the source through the compressor(s); append complete entries to pages."""
        state, pre, ent_idx, ent_ok = self.compressor.step(cache["comp"], src, src_pos,
                                                           src_valid)
        new_cache["comp"] = state
        rope = self.compressor.rope_entries
        new = {"entry": rope(pre, ent_idx, self.rope_dim, self.theta)}
        if self.kind == "csa":
            kstate, kpre, kidx, _ = self.key_compressor.step(cache["key_comp"], src, src_pos,
                                                             src_valid)
            new_cache["key_comp"] = kstate
            new["key"] = self.key_compressor.rope_entries(kpre, kidx, self.key_rope, self.theta)
        elif self.kind == "full":
            new["key"] = rope(self.key_norm(self.key_proj(pre)), ent_idx, self.key_rope,
                              self.theta)
        g = paged.append(cache["global"], self.fields, new, jnp.sum(ent_ok, -1, dtype=jnp.int32))
        new_cache["global"] = g
        return g

    def _select(self, g, qr, x, positions, n_vis, ctx):
        """Top-k entry ids [B, T, k] from this layer's own indexer query."""
        iq, w = self.index_q(qr, x, positions, self.theta)
        if self.kind == "reindex" and "pool" in ctx:  # score only the pooled candidates
            pidx, pok = ctx["pool"]
            keys, got = paged.gather(g, self.fields, "key", pidx, self.dtype)
            score = jnp.einsum("btns,btn->bts", jax.nn.relu(
                jnp.einsum("btnd,btsd->btns", iq, keys)), w)
            pick, ok = indexer.select(score, pok & got, self.top_k, self.topk)
            return jnp.take_along_axis(pidx, pick, axis=-1), ok
        if self.kind == "full" and self.pool_blocks:  # the pool ranks blocks by their maxima
            score, maxima = indexer.paged_scores(iq, w, g, self.fields, n_vis[..., 0],
                                                 self.impl, self.interpret, self.dtype,
                                                 block_max=self.pool_block)
            ctx["pool"] = indexer.candidate_pool(maxima, n_vis[..., 0], self.pool_block,
                                                 self.pool_blocks)
        else:
            score = indexer.paged_scores(iq, w, g, self.fields, n_vis[..., 0], self.impl,
                                         self.interpret, self.dtype)
        return indexer.select(score, score > -jnp.inf, self.top_k, self.topk)

    def extend(self, x, positions, valid, cache, ctx):
        q, qr = self.query(x, positions, self.theta)
        kv = self.local(x, positions, self.theta)
        keys, key_pos = ring.local_keys(cache["ring"], self.local_fmt, self.dtype, kv,
                                        positions, valid, self.window, self.rope_dim)
        new_cache = {"ring": ring.write(cache["ring"], self.local_fmt, kv, positions, valid,
                                        self.rope_dim)}
        parts = [(keys, ring.window_mask(key_pos, positions, self.window))]
        if self.ratio:
            n_vis = self._n_visible(positions)[..., None]  # [B, T, 1]
            if self.kind in OWNS_GLOBAL:
                if self.from_encoder:
                    src, src_pos, src_valid = ctx["encoder_out"]
                    src = self.source_norm(src)
                else:
                    src, src_pos, src_valid = x, positions, valid
                g = self._append(cache, new_cache, src, src_pos, src_valid)
                if self.kind == "full":
                    ctx["global"] = g
            else:
                g = ctx["global"]
            if self.kind == "hca":  # every complete entry
                ents, stored = paged.read_all(g, self.fields, "entry", self.dtype)
                parts.insert(0, (ents, stored[:, None, :] & (jnp.arange(ents.shape[1]) < n_vis)))
            else:  # gather only the selected entries
                if self.kind == "reuse":
                    sel, ok = ctx["selection"]
                else:
                    sel, ok = self._select(g, qr, x, positions, n_vis, ctx)
                    ctx["selection"] = (sel, ok)
                ents, got = paged.gather(g, self.fields, "entry", sel, self.dtype)
                parts.insert(0, (ents, ok & got))
        y, _ = self.core(q, parts, positions, self.theta)
        return y, new_cache
