"""Rotary position embedding over a chosen slice of dims, and its inverse.

Pairs are interleaved (2i, 2i+1), as in DeepSeek's MLA and V4 code. `inverse=True` rotates
by the negative angle: V4 applies it to the attention output so each value's contribution
depends on relative position only.
"""

import jax.numpy as jnp


def rope_angles(positions, dim: int, theta: float, dtype):
    """Angles [*positions.shape, dim // 2] for integer positions."""
    freqs = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float64 if dtype == jnp.float64
                                  else jnp.float32) / dim)
    return positions[..., None].astype(freqs.dtype) * freqs


def apply_rope(x, positions, theta: float, *, inverse: bool = False):
    """Rotate all of x's last axis. x: [B, T, ..., d]; positions: [B, T] (or broadcastable)."""
    d = x.shape[-1]
    ang = rope_angles(positions, d, theta, x.dtype)  # [B, T, d/2]
    ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    if inverse:
        sin = -sin
    x1, x2 = x[..., 0::2], x[..., 1::2]
    y1 = x1 * cos - x2 * sin
    y2 = x1 * sin + x2 * cos
    return jnp.stack([y1, y2], axis=-1).reshape(x.shape)


def apply_rope_last(x, positions, theta: float, rope_dim: int, *, inverse: bool = False):
    """Rotate only the last `rope_dim` dims of x (V4's partial RoPE)."""
    if rope_dim == x.shape[-1]:
        return apply_rope(x, positions, theta, inverse=inverse)
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    return jnp.concatenate([head, apply_rope(tail, positions, theta, inverse=inverse)], -1)
