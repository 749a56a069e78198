"""Multi-head latent attention (DeepSeek-V2/V3; the DeepSeek-V2 report, "Multi-Head Latent
Attention").

The cache keeps one latent C^KV (kv_lora_rank dims, RMS-normed) and one rotary key K^R
(qk_rope_dim dims, shared by all heads) per token, stored together as one main-role vector
[C^KV | K^R]. Two paths compute the same attention:

- naive (training forward): expand per-head K^C = C^KV W^UK and V = C^KV W^UV;
- absorbed (cached prefill/decode): fold W^UK into the query and apply W^UV after the
  weighted sum, so keys and values are never expanded.
"""

import jax.numpy as jnp
from flax import nnx

from dsattn.attention import attend
from dsattn.cache import contiguous, formats
from dsattn.cache.layer_caches import MLACache
from dsattn.kernels import registry
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
        self.impl = registry.resolve(registry.Op.ATTENTION, cfg, a.impl)
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
        self.kv_norm = RMSNorm(self.dc, m.norm_eps, dtype=dt) if a.latent_norm else None
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
        ckv = kv[..., : self.dc] if self.kv_norm is None else self.kv_norm(kv[..., : self.dc])
        kr = apply_rope(kv[..., self.dc:], positions, self.theta)
        return jnp.concatenate([ckv, kr], axis=-1)

    def _up(self):
        # read as a weight, not through the layer: cast to the compute dtype as it would be
        w = self.wkv_b.kernel[...].astype(self.dtype).reshape(self.dc, self.h,
                                                               self.dn + self.dv)
        return w[..., : self.dn], w[..., self.dn:]  # W^UK [dc,H,dn], W^UV [dc,H,dv]

    # -- naive path ------------------------------------------------------------------------
    def expand(self, lat):
        """Per-head keys and values from latents [B, S, dc+dr]: (K^C [B,S,H,dn], the shared
        K^R [B,S,dr], V [B,S,H,dv])."""
        w_uk, w_uv = self._up()
        c = lat[..., : self.dc]
        return (jnp.einsum("bsc,chn->bshn", c, w_uk), lat[..., self.dc:],
                jnp.einsum("bsc,chv->bshv", c, w_uv))

    def _output(self, o, pos):
        return self.wo(o.reshape(o.shape[0], o.shape[1], self.h * self.dv))

    # -- absorbed path -----------------------------------------------------------------
    def _absorb(self, q):
        """(q_nope, q_pe) -> [q_nope W^UK | q_pe]: queries against the latents themselves."""
        q_nope, q_pe = q
        q_abs = jnp.einsum("bqhn,chn->bqhc", q_nope, self._up()[0])  # fold W^UK into the query
        return jnp.concatenate([q_abs, q_pe.astype(q_abs.dtype)], -1)

    def _absorbed_output(self, o_lat, pos):
        o = jnp.einsum("bqhc,chv->bqhv", o_lat, self._up()[1])  # W^UV after the weighted sum
        return self._output(o, pos)

    def absorbed(self, q, positions, valid, parts, target=None):
        """The absorbed path's read of ``parts`` (attend.Read: latents [B, S, dc+dr] as K
        and V for every head, V their first dc channels) for q = (q_nope, q_pe):
        (output [B, T, D], with a target its (KL loss, recall terms), else None)."""
        read = attend.Read(q, positions, valid, parts, None, target, attend.Layout.SHARED,
                           self.scale, self.query_block, self.dtype, value_dim=self.dc)
        return attend.attend(read, self.impl, self._absorb, self._absorbed_output)

    # -- entry points ------------------------------------------------------------------
    def __call__(self, x, positions, step=None, ctx=None):
        """Training forward: (output, no aux losses, the context unchanged)."""
        q_nope, q_pe = self.queries(self.query_latent(x), positions)
        lat = self.latents(x, positions)
        lat = formats.as_stored(self.fmt, lat, self.dr, self.fake_quant)
        # expanded once; each query block reads the keys before its causal segment's end
        keys = attend.Keys(self.expand(lat), positions, sequence=True)
        read = attend.Read((q_nope, q_pe), positions, None, (keys,), None, None,
                           attend.Layout.PER_HEAD, self.scale, self.query_block, self.dtype)
        return attend.attend(read, self.impl, epilogue=self._output)[0], {}, ctx

    def init_cache(self, batch: int, max_len: int):
        return MLACache(contiguous.empty(self.fmt, batch, max_len, (), self.dc + self.dr,
                                         self.dr, self.dtype))

    def extend(self, x, positions, valid, cache, ctx=None):
        q_nope, q_pe = self.queries(self.query_latent(x), positions)
        lat = self.latents(x, positions)

        def read(segments):  # a prefill chunk by query blocks; decode is one block
            parts = tuple(attend.Keys(seg.values, seg.pos, seg.seen,
                                      slots=seg.slots[0] if seg.slots else None)
                          for seg in segments)
            return self.absorbed((q_nope, q_pe), positions, None, parts)[0]

        out, (stored,) = contiguous.extend((cache.latent,), (lat,), positions, valid, read,
                                           self.dtype)
        return out, MLACache(stored), ctx
