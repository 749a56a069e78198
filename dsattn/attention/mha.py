"""Multi-head attention with grouped K/V heads: MHA (groups = heads), GQA, MQA (one group).

The cache keeps each K/V head's vector per token (main cache role).
"""

import jax.numpy as jnp
from flax import nnx

from dsattn.attention import attend
from dsattn.cache import contiguous, formats
from dsattn.cache.layer_caches import MHACache
from dsattn.kernels import registry
from dsattn.nn.layers import dense
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope_last, scaled, softmax_mscale


class MHA(nnx.Module):
    def __init__(self, cfg, spec, rngs: nnx.Rngs):
        a, m = cfg.attention, cfg.model
        prec = Precision.of(m)
        self.dtype = prec.dtype
        self.n_heads, self.head_dim = a.n_heads, a.head_dim
        self.n_kv = a.n_kv_heads or a.n_heads
        self.rope_dim = a.mha_rope_dim or a.head_dim  # the last rope_dim dims rotate
        self.theta = scaled(cfg, a.rope_theta)
        self.scale = self.head_dim ** -0.5 * softmax_mscale(cfg)
        self.query_block = a.query_block
        self.fmt = cfg.cache.main_format
        self.fake_quant = cfg.cache.fake_quant
        self.impl = registry.resolve(registry.Op.ATTENTION, cfg, a.impl)
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
        rope = lambda t: apply_rope_last(t, positions, self.theta, self.rope_dim)  # noqa: E731
        return rope(q), rope(k), v

    def _read(self, q, positions, parts):
        """q [B, T, H, d] over key sets `parts` (attend.Keys of head-major K/V [B, G, S, d])
        under one softmax, through attend.attend -> [B, T, D]."""
        read = attend.Read(q, positions, None, parts, None, None, attend.Layout.GROUPED,
                           self.scale, self.query_block, self.dtype)
        return attend.attend(read, self.impl, epilogue=self._output)[0]

    def _output(self, o, pos):
        return self.wo(o.reshape(o.shape[0], o.shape[1], self.n_heads * self.head_dim))

    def __call__(self, x, positions, step=None, ctx=None):
        """Teacher-forced causal attention over x [B, T, D], by query blocks against the
        keys before their causal segment's end (attention/blocks.py): O(T·query_block) scores
        live, as the V4 family's."""
        q, k, v = self._qkv(x, positions)
        k, v = (formats.as_stored(self.fmt, t, 0, self.fake_quant) for t in (k, v))
        k, v = (jnp.swapaxes(a, 1, 2) for a in (k, v))  # [B, G, T, d]
        return self._read(q, positions, (attend.Keys((k, v), positions, sequence=True),)), {}, ctx

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

        def read(segments):  # a prefill chunk by query blocks; decode is one block
            return self._read(q, positions, tuple(attend.Keys(seg.values, seg.pos, seg.seen)
                                                  for seg in segments))

        out, (ck, cv) = contiguous.extend((cache.k, cache.v), (k, v), positions, valid,
                                          read, self.dtype)
        return out, MHACache(ck, cv), ctx
