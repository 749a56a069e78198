"""Rotary position embedding over a chosen slice of dims, and its inverse.

Pairs are interleaved (2i, 2i+1), as in DeepSeek's MLA and V4 code. `inverse=True` rotates
by the negative angle: V4 applies it to the attention output so each value's contribution
depends on relative position only.

`theta` is a float base, or a `Yarn` (a base with YaRN context extension) where the config's
`attention.rope_scaling` is yarn: `scaled(cfg, theta)` picks which (docs/design.md, "YaRN").
"""

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Yarn:
    """A YaRN-scaled rope: frozen and hashable, so a module holds it as static, like a float."""
    theta: float
    factor: float
    original: int  # the pretraining context the correction band is measured against
    beta_fast: float
    beta_slow: float
    attn_factor: float = 1.0  # multiplies cos/sin of the forward rotation (1 in every preset)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's 0.1 * mscale * ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_active(cfg) -> bool:
    # DeepSeek's reference applies YaRN only when the model's context exceeds the original.
    a = cfg.attention
    return a.rope_scaling == "yarn" and cfg.model.max_seq_len > a.yarn_original_max_position


def scaled(cfg, theta: float):
    """The rope a scaled role uses: theta itself unless the config's YaRN is active."""
    a = cfg.attention
    if not yarn_active(cfg):
        return theta
    f, m, mall = a.yarn_factor, a.yarn_mscale, a.yarn_mscale_all_dim
    # cos/sin factor as HF computes it from mscale/mscale_all_dim; without both it is 1, as
    # in DeepSeek's reference code (which never scales cos/sin) and HF's V4 compress rope.
    attn = yarn_mscale(f, m) / yarn_mscale(f, mall) if m and mall else 1.0
    return Yarn(float(theta), float(f), int(a.yarn_original_max_position),
                float(a.yarn_beta_fast), float(a.yarn_beta_slow), attn)


def softmax_mscale(cfg) -> float:
    """Factor on the MLA/MHA softmax scale: mscale(factor, mscale_all_dim)^2 under YaRN."""
    a = cfg.attention
    if not yarn_active(cfg) or not a.yarn_mscale_all_dim:
        return 1.0
    return yarn_mscale(a.yarn_factor, a.yarn_mscale_all_dim) ** 2


def yarn_inv_freq(y: Yarn, dim: int) -> np.ndarray:
    """float64 inverse frequencies [dim // 2]: extrapolated (the plain ones) below the
    correction band, interpolated (divided by factor) above it, a linear ramp across it."""
    plain = y.theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)

    def band_dim(rotations):  # the dim whose wavelength fits `rotations` times in original
        return dim * math.log(y.original / (rotations * 2 * math.pi)) / (2 * math.log(y.theta))

    low = max(math.floor(band_dim(y.beta_fast)), 0)
    high = min(math.ceil(band_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a one-point band: avoid 0/0, as the reference does
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return plain * (1 - ramp) + plain / y.factor * ramp


def rope_angles(positions, dim: int, theta, dtype):
    """Angles [*positions.shape, dim // 2] for integer positions."""
    fdt = jnp.float64 if dtype == jnp.float64 else jnp.float32
    if isinstance(theta, Yarn):
        freqs = jnp.asarray(yarn_inv_freq(theta, dim), dtype=fdt)
    else:
        freqs = theta ** (-jnp.arange(0, dim, 2, dtype=fdt) / dim)
    return positions[..., None].astype(freqs.dtype) * freqs


def apply_rope(x, positions, theta, *, inverse: bool = False):
    """Rotate all of x's last axis. x: [B, T, ..., d]; positions: [B, T] (or broadcastable)."""
    d = x.shape[-1]
    ang = rope_angles(positions, d, theta, x.dtype)  # [B, T, d/2]
    ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if isinstance(theta, Yarn) and theta.attn_factor != 1.0 and not inverse:
        cos, sin = cos * theta.attn_factor, sin * theta.attn_factor
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    if inverse:
        sin = -sin
    x1, x2 = x[..., 0::2], x[..., 1::2]
    y1 = x1 * cos - x2 * sin
    y2 = x1 * sin + x2 * cos
    return jnp.stack([y1, y2], axis=-1).reshape(x.shape)


def apply_rope_last(x, positions, theta, rope_dim: int, *, inverse: bool = False):
    """Rotate only the last `rope_dim` dims of x (V4's partial RoPE)."""
    if rope_dim == x.shape[-1]:
        return apply_rope(x, positions, theta, inverse=inverse)
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    return jnp.concatenate([head, apply_rope(tail, positions, theta, inverse=inverse)], -1)
