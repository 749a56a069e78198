"""Normalisations. Statistics are computed in at least float32 whatever the compute dtype."""

import jax
import jax.numpy as jnp
from flax import nnx


def _stat_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def rms_normalize(x, eps: float):
    """Unweighted RMS normalisation over the last axis (V4's per-head query norm)."""
    xf = x.astype(_stat_dtype(x.dtype))
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        return rms_normalize(x, self.eps) * self.weight[...].astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias (DSA's indexer key norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))

    def __call__(self, x):
        xf = x.astype(_stat_dtype(x.dtype))
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        y = ((xf - mu) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return y * self.weight[...].astype(x.dtype) + self.bias[...].astype(x.dtype)
