"""Multi-head attention with grouped K/V heads: MHA (groups = heads), GQA, MQA (one group).

The cache keeps each K/V head's vector per token (main cache role).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsattn.attention import blocks
from dsattn.attention.common import causal_mask, masked_softmax, split_keys, wide_product
from dsattn.cache import contiguous, formats
from dsattn.cache.layer_caches import MHACache
from dsattn.nn.layers import dense
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope, scaled, softmax_mscale


class MHA(nnx.Module):
    def __init__(self, cfg, spec, rngs: nnx.Rngs):
        a, m = cfg.attention, cfg.model
        prec = Precision.of(m)
        self.dtype = prec.dtype
        self.n_heads, self.head_dim = a.n_heads, a.head_dim
        self.n_kv = a.n_kv_heads or a.n_heads
        self.theta = scaled(cfg, a.rope_theta)
        self.scale = self.head_dim ** -0.5 * softmax_mscale(cfg)
        self.query_block = a.query_block
        self.fmt = cfg.cache.main_format
        self.fake_quant = cfg.cache.fake_quant
        std = m.init_std
        self.wq = dense(m.d_model, self.n_heads * self.head_dim, rngs, prec, std)
        self.wk = dense(m.d_model, self.n_kv * self.head_dim, rngs, prec, std)
        self.wv = dense(m.d_model, self.n_kv * self.head_dim, rngs, prec, std)
        self.wo = dense(self.n_heads * self.head_dim, m.d_model, rngs, prec, std)

    def _qkv(self, x, positions):
        b, t, _ = x.shape
        q = self.wq(x).reshape(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).reshape(b, t, self.n_kv, self.head_dim)
        v = self.wv(x).reshape(b, t, self.n_kv, self.head_dim)
        return apply_rope(q, positions, self.theta), apply_rope(k, positions, self.theta), v

    def _attend(self, q, segments):
        """q [B,Tq,H,d] over key segments [(k, v head-major [B,G,Tk,d], mask [B,Tq,Tk])],
        one softmax over all of them -> [B,Tq,D].

        Written as dot_generals batched over (B, G) with k/v in their stored [Tk, d] layout
        (q·Kᵀ contracts both minor dims, p·V is a plain matmul), which XLA runs in place."""
        b, tq = q.shape[:2]
        g = self.n_heads // self.n_kv
        q = jnp.transpose(q.reshape(b, tq, self.n_kv, g, self.head_dim), (0, 2, 3, 1, 4))
        q = q.reshape(b, self.n_kv, g * tq, self.head_dim)  # [B, G, g·Tq, d]
        batch = ((0, 1), (0, 1))
        product = functools.partial(jax.lax.dot_general, dimension_numbers=(((3,), (3,)), batch))
        s = jnp.concatenate([wide_product(product, q, k) for k, _, _ in segments],
                            -1) * self.scale
        p = masked_softmax(s.reshape(b, self.n_heads, tq, -1),
                           jnp.concatenate([m for _, _, m in segments], -1))
        p = p.reshape(b, self.n_kv, g * tq, -1)
        o = sum(jax.lax.dot_general(ps.astype(v.dtype), v, (((3,), (2,)), batch))
                for ps, (_, v, _) in zip(split_keys(p, [k.shape[2] for k, _, _ in segments]),
                                         segments))  # [B, G, g·Tq, d]
        o = jnp.transpose(o.reshape(b, self.n_kv, g, tq, self.head_dim), (0, 3, 1, 2, 4))
        return self.wo(o.reshape(b, tq, self.n_heads * self.head_dim))

    def __call__(self, x, positions, step=None, ctx=None):
        """Teacher-forced causal attention over x [B, T, D], by query blocks against the
        keys before their causal segment's end (attention/blocks.py): O(T·query_block) scores
        live, as the V4 family's."""
        q, k, v = self._qkv(x, positions)
        k, v = (formats.as_stored(self.fmt, t, 0, self.fake_quant) for t in (k, v))
        k, v = (jnp.swapaxes(a, 1, 2) for a in (k, v))  # [B, G, T, d]

        def one(start, blk, end):  # keys before the causal segment's end
            q_blk, pos = blk
            return self._attend(q_blk, [(k[:, :, :end], v[:, :, :end],
                                         causal_mask(pos, positions[:, :end]))]), ()

        return blocks.map_causal(one, self.query_block, (q, positions))[0], {}, ctx

    # -- cached path ------------------------------------------------------------------
    # Head-major cache [B, G, L, d]: each head's keys are one contiguous [L, d] matrix, so
    # decode's q·K and p·V read it in place (a [B, L, G, d] cache made XLA transpose the
    # whole cache every step: ~8x slower at 64K tokens on CPU).
    def init_cache(self, batch: int, max_len: int):
        mk = lambda: contiguous.empty(self.fmt, batch, max_len, (self.n_kv,), self.head_dim,
                                      0, self.dtype, heads_first=True)
        return MHACache(mk(), mk())

    def extend(self, x, positions, valid, cache, ctx=None):
        """Append x's tokens at `positions` (where `valid`) and attend over the cache."""
        q, k, v = self._qkv(x, positions)

        def attend(segments):
            def one(start, blk):  # a prefill chunk by query blocks; decode is one block
                q_blk, pos = blk
                return self._attend(q_blk, [(keys, vals, causal_mask(pos, k_pos) & seen[:, None])
                                            for (keys, vals), k_pos, seen in segments]), ()

            return blocks.map_queries(one, self.query_block, (q, positions))[0]

        out, (ck, cv) = contiguous.extend((cache.k, cache.v), (k, v), positions, valid,
                                          attend, self.dtype)
        return out, MHACache(ck, cv), ctx
