"""Multi-head latent attention (DeepSeek-V2/V3; the DeepSeek-V2 report, "Multi-Head Latent
Attention").

The cache keeps one latent C^KV (kv_lora_rank dims, RMS-normed) and one rotary key K^R
(qk_rope_dim dims, shared by all heads) per token, stored together as one main-role vector
[C^KV | K^R]. Two paths compute the same attention:

- naive (training forward): expand per-head K^C = C^KV W^UK and V = C^KV W^UV;
- absorbed (cached prefill/decode): fold W^UK into the query and apply W^UV after the
  weighted sum, so keys and values are never expanded.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsattn.attention import blocks
from dsattn.attention.common import causal_mask, masked_softmax, split_keys, wide_product
from dsattn.cache import contiguous, formats
from dsattn.cache.layer_caches import MLACache
from dsattn.nn.layers import dense
from dsattn.nn.norms import RMSNorm
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope, scaled, softmax_mscale


class MLA(nnx.Module):
    def __init__(self, cfg, spec, rngs: nnx.Rngs):
        a, m = cfg.attention, cfg.model
        prec = Precision.of(m)
        self.dtype = prec.dtype
        self.h, self.dc, self.dr = a.n_heads, a.kv_lora_rank, a.qk_rope_dim
        self.dn, self.dv = a.qk_nope_dim, a.v_head_dim
        self.theta = scaled(cfg, a.rope_theta)  # every MLA/DSA layer's rope is YaRN-scaled
        self.query_block = a.query_block
        self.scale = (self.dn + self.dr) ** -0.5 * softmax_mscale(cfg)
        self.fmt = cfg.cache.main_format
        self.fake_quant = cfg.cache.fake_quant
        d, std, dt = m.d_model, m.init_std, prec
        qd = self.h * (self.dn + self.dr)
        if a.q_lora_rank:
            self.wq_a = dense(d, a.q_lora_rank, rngs, dt, std)
            self.q_norm = RMSNorm(a.q_lora_rank, m.norm_eps, dtype=dt)
            self.wq_b = dense(a.q_lora_rank, qd, rngs, dt, std)
        else:
            self.wq_a = self.q_norm = None
            self.wq_b = dense(d, qd, rngs, dt, std)
        self.wkv_a = dense(d, self.dc + self.dr, rngs, dt, std)
        self.kv_norm = RMSNorm(self.dc, m.norm_eps, dtype=dt)
        self.wkv_b = dense(self.dc, self.h * (self.dn + self.dv), rngs, dt, std)
        self.wo = dense(self.h * self.dv, d, rngs, dt, std)

    # -- shared projections -----------------------------------------------------------
    def query_latent(self, x):
        """C^Q (what DSA's indexer also reads); x itself when there is no query latent."""
        return x if self.wq_a is None else self.q_norm(self.wq_a(x))

    def queries(self, cq, positions):
        b, t = cq.shape[:2]
        q = self.wq_b(cq).reshape(b, t, self.h, self.dn + self.dr)
        return q[..., : self.dn], apply_rope(q[..., self.dn:], positions, self.theta)

    def latents(self, x, positions):
        """[C^KV | K^R] per token: [B, T, dc + dr]."""
        kv = self.wkv_a(x)
        ckv = self.kv_norm(kv[..., : self.dc])
        kr = apply_rope(kv[..., self.dc:], positions, self.theta)
        return jnp.concatenate([ckv, kr], axis=-1)

    def _up(self):
        # read as a weight, not through the layer: cast to the compute dtype as it would be
        w = self.wkv_b.kernel[...].astype(self.dtype).reshape(self.dc, self.h,
                                                               self.dn + self.dv)
        return w[..., : self.dn], w[..., self.dn:]  # W^UK [dc,H,dn], W^UV [dc,H,dv]

    # -- naive path --------------------------------------------------------------------
    def expand(self, lat):
        """Per-head keys and values from latents [B, S, dc+dr]: (K^C [B,S,H,dn], the shared
        K^R [B,S,dr], V [B,S,H,dv])."""
        w_uk, w_uv = self._up()
        c = lat[..., : self.dc]
        return (jnp.einsum("bsc,chn->bshn", c, w_uk), lat[..., self.dc:],
                jnp.einsum("bsc,chv->bshv", c, w_uv))

    def naive_scores(self, q_nope, q_pe, lat, expanded=None):
        """Per-head scores [B, H, Tq, Tk] through expanded keys."""
        k_nope, k_pe, _ = self.expand(lat) if expanded is None else expanded
        s = wide_product(functools.partial(jnp.einsum, "bqhn,bshn->bhqs"), q_nope, k_nope)
        s = s + wide_product(functools.partial(jnp.einsum, "bqhr,bsr->bhqs"), q_pe, k_pe)
        return s * self.scale

    def naive_output(self, p, lat, expanded=None):
        v = (self.expand(lat) if expanded is None else expanded)[2]
        o = jnp.einsum("bhqs,bshv->bqhv", p.astype(v.dtype), v)
        return self.wo(o.reshape(o.shape[0], o.shape[1], self.h * self.dv))

    # -- absorbed path -----------------------------------------------------------------
    def absorbed_scores(self, q_nope, q_pe, lat):
        """Scores over latents [B, S, dc+dr] shared by all queries, or [B, Tq, K, dc+dr]
        gathered per query (DSA decode reads only the selected tokens)."""
        w_uk, _ = self._up()
        q_abs = jnp.einsum("bqhn,chn->bqhc", q_nope, w_uk)  # fold W^UK into the query
        if lat.ndim == 3:  # one [B, Tq·H, dc+dr] x [B, S, dc+dr] product, cache read in place
            b, tq, h = q_abs.shape[:3]
            qq = jnp.concatenate([q_abs, q_pe.astype(q_abs.dtype)], -1).reshape(b, tq * h, -1)
            product = functools.partial(jax.lax.dot_general,
                                        dimension_numbers=(((2,), (2,)), ((0,), (0,))))
            s = wide_product(product, qq, lat.astype(qq.dtype))
            return jnp.transpose(s.reshape(b, tq, h, -1), (0, 2, 1, 3)) * self.scale
        s = wide_product(functools.partial(jnp.einsum, "bqhc,bqsc->bhqs"), q_abs,
                         lat[..., : self.dc])
        s = s + wide_product(functools.partial(jnp.einsum, "bqhr,bqsr->bhqs"), q_pe,
                             lat[..., self.dc:])
        return s * self.scale

    def absorbed_output(self, p, lat):
        _, w_uv = self._up()
        if lat.ndim == 3:  # [B, Tq·H, S] x [B, S, dc]: a plain batched matmul over the cache
            b, h, tq, n = p.shape
            pp = jnp.transpose(p, (0, 2, 1, 3)).reshape(b, tq * h, n).astype(lat.dtype)
            # over the whole stored row (slicing off the rope dims first would copy the cache)
            o_lat = jax.lax.dot_general(pp, lat, (((2,), (1,)), ((0,), (0,))))
            o_lat = o_lat.reshape(b, tq, h, -1)[..., : self.dc]
        else:
            o_lat = jnp.einsum("bhqs,bqsc->bqhc", p.astype(lat.dtype), lat[..., : self.dc])
        o = jnp.einsum("bqhc,chv->bqhv", o_lat, w_uv)  # W^UV after the weighted sum
        return self.wo(o.reshape(o.shape[0], o.shape[1], self.h * self.dv))

    # -- entry points ------------------------------------------------------------------
    def __call__(self, x, positions, step=None, ctx=None):
        """Training forward: (output, no aux losses, the context unchanged)."""
        q_nope, q_pe = self.queries(self.query_latent(x), positions)
        lat = self.latents(x, positions)
        lat = formats.as_stored(self.fmt, lat, self.dr, self.fake_quant)
        kv = self.expand(lat)  # once; each query block reads it (attention/blocks.py)

        def one(start, blk, end):  # keys before the causal segment's end
            qn, qp, pos = blk
            kv_seen = jax.tree.map(lambda a: a[:, :end], kv)
            p = masked_softmax(self.naive_scores(qn, qp, None, kv_seen),
                               causal_mask(pos, positions[:, :end]))
            return self.naive_output(p, None, kv_seen), ()

        return blocks.map_causal(one, self.query_block, (q_nope, q_pe, positions))[0], {}, ctx

    def init_cache(self, batch: int, max_len: int):
        return MLACache(contiguous.empty(self.fmt, batch, max_len, (), self.dc + self.dr,
                                         self.dr, self.dtype))

    def extend(self, x, positions, valid, cache, ctx=None):
        q_nope, q_pe = self.queries(self.query_latent(x), positions)
        lat = self.latents(x, positions)

        def attend(segments):
            def one(start, blk):  # a prefill chunk by query blocks; decode is one block
                qn, qp, pos = blk
                s = jnp.concatenate([self.absorbed_scores(qn, qp, lats) for (lats,), _, _
                                     in segments], -1)
                p = masked_softmax(s, jnp.concatenate(
                    [causal_mask(pos, k_pos) & seen[:, None] for _, k_pos, seen in segments], -1))
                parts = split_keys(p, [k_pos.shape[1] for _, k_pos, _ in segments])
                return sum(self.absorbed_output(ps, lats)
                           for ps, ((lats,), _, _) in zip(parts, segments)), ()

            return blocks.map_queries(one, self.query_block, (q_nope, q_pe, positions))[0]

        out, (stored,) = contiguous.extend((cache.latent,), (lat,), positions, valid, attend,
                                           self.dtype)
        return out, MLACache(stored), ctx
