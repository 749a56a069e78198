"""Each V4-family layer's own window KV: one entry per token, RMSNorm, RoPE on the last r
dims at the token's position. Kept for the last W positions in a ring buffer."""

import jax.numpy as jnp
from flax import nnx

from dsattn.nn.layers import dense
from dsattn.nn.norms import RMSNorm
from dsattn.nn.rope import apply_rope_last


class LocalKV(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        a, m = cfg.attention, cfg.model
        dt = jnp.dtype(m.dtype)
        self.rope_dim = a.rope_dim
        self.wkv = dense(m.d_model, a.entry_dim, rngs, dt, m.init_std)
        self.norm = RMSNorm(a.entry_dim, m.norm_eps, dtype=dt)

    def __call__(self, x, positions, theta):
        return apply_rope_last(self.norm(self.wkv(x)), positions, theta, self.rope_dim)


def window_mask_dense(q_pos, k_pos, window: int):
    """[B, Tq, Tk]: key visible iff q - W < k <= q (training forward over a whole sequence)."""
    d = q_pos[:, :, None] - k_pos[:, None, :]
    return (d >= 0) & (d < window)
