"""Multi-head attention with grouped K/V heads: MHA (groups = heads), GQA, MQA (one group).

The cache keeps each K/V head's vector per token (main cache role).
"""

import jax.numpy as jnp
from flax import nnx

from dsattn.attention.common import causal_mask, masked_softmax, softmax_dtype
from dsattn.cache import contiguous, formats
from dsattn.nn.layers import dense
from dsattn.nn.rope import apply_rope


class MHA(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        a, m = cfg.attention, cfg.model
        self.dtype = jnp.dtype(m.dtype)
        self.n_heads, self.head_dim = a.n_heads, a.head_dim
        self.n_kv = a.n_kv_heads or a.n_heads
        self.theta = a.rope_theta
        self.fmt = cfg.cache.main_format
        self.fake_quant = cfg.cache.fake_quant
        std = m.init_std
        self.wq = dense(m.d_model, self.n_heads * self.head_dim, rngs, self.dtype, std)
        self.wk = dense(m.d_model, self.n_kv * self.head_dim, rngs, self.dtype, std)
        self.wv = dense(m.d_model, self.n_kv * self.head_dim, rngs, self.dtype, std)
        self.wo = dense(self.n_heads * self.head_dim, m.d_model, rngs, self.dtype, std)

    def _qkv(self, x, positions):
        b, t, _ = x.shape
        q = self.wq(x).reshape(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).reshape(b, t, self.n_kv, self.head_dim)
        v = self.wv(x).reshape(b, t, self.n_kv, self.head_dim)
        return apply_rope(q, positions, self.theta), apply_rope(k, positions, self.theta), v

    def _attend(self, q, k, v, mask):
        """q [B,Tq,H,d], k/v [B,Tk,G,d], mask [B,Tq,Tk] -> [B,Tq,D]."""
        b, tq = q.shape[:2]
        g = self.n_heads // self.n_kv
        q = q.reshape(b, tq, self.n_kv, g, self.head_dim)
        sd = softmax_dtype(q.dtype)
        s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=sd)
        s = s * (self.head_dim ** -0.5)
        p = masked_softmax(s.reshape(b, self.n_heads, tq, -1), mask)
        p = p.reshape(b, self.n_kv, g, tq, -1).astype(v.dtype)
        o = jnp.einsum("bkgqs,bskd->bqkgd", p, v)
        return self.wo(o.reshape(b, tq, self.n_heads * self.head_dim))

    def __call__(self, x, positions, step=None, ctx=None):
        """Teacher-forced causal attention over x [B, T, D]."""
        q, k, v = self._qkv(x, positions)
        if self.fake_quant:  # the numbers decode will read back from the cache
            k, v = (formats.quantize_dequantize(self.fmt, t) for t in (k, v))
        return self._attend(q, k, v, causal_mask(positions, positions)), {}

    # -- cached path ------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int):
        mk = lambda: contiguous.empty(self.fmt, batch, max_len, (self.n_kv,), self.head_dim,
                                      0, self.dtype)
        return {"k": mk(), "v": mk()}

    def extend(self, x, positions, valid, cache, ctx):
        """Append x's tokens at `positions` (where `valid`) and attend over the cache."""
        q, k, v = self._qkv(x, positions)
        cache = {"k": contiguous.write(cache["k"], self.fmt, k, positions, valid),
                 "v": contiguous.write(cache["v"], self.fmt, v, positions, valid)}
        keys = contiguous.read(cache["k"], self.fmt, self.dtype)
        vals = contiguous.read(cache["v"], self.fmt, self.dtype)
        k_pos = jnp.broadcast_to(jnp.arange(keys.shape[1]), keys.shape[:2])
        return self._attend(q, keys, vals, causal_mask(positions, k_pos)), cache
