"""V4-family queries: a low-rank query latent c^Q, per-head queries of width c, optional
per-head unweighted RMS norm (V4 on, V4.1 off), RoPE on the last r dims."""

from flax import nnx

from dsattn.nn.layers import dense
from dsattn.nn.norms import RMSNorm, rms_normalize
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope_last


class Query(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        a, m = cfg.attention, cfg.model
        dt = Precision.of(m)
        self.h, self.c, self.rope_dim = a.n_heads, a.entry_dim, a.rope_dim
        self.head_norm, self.eps = a.query_norm, m.norm_eps
        self.wq_a = dense(m.d_model, a.q_lora_rank, rngs, dt, m.init_std)
        self.q_norm = RMSNorm(a.q_lora_rank, m.norm_eps, dtype=dt)
        self.wq_b = dense(a.q_lora_rank, self.h * self.c, rngs, dt, m.init_std)

    def __call__(self, x, positions, theta):
        """(queries [B, T, H, c], query latent [B, T, q_lora_rank])."""
        b, t = x.shape[:2]
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(b, t, self.h, self.c)
        if self.head_norm:
            q = rms_normalize(q, self.eps)
        return apply_rope_last(q, positions, theta, self.rope_dim), qr
