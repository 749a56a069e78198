"""Normalisations: statistics, the scaling and the weight's product run in at least float32
and round once to the compute dtype (under bfloat16 compute, norms are float32 islands)."""

import jax
import jax.numpy as jnp
from flax import nnx

from dsattn.nn.precision import Precision, at_least_f32


def _rms_scaled(x, eps: float):
    """x [..., d] over its RMS, in at least float32."""
    xf = x.astype(at_least_f32(x.dtype))
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_normalize(x, eps: float):
    """Unweighted RMS normalisation over the last axis (V4's per-head query norm)."""
    return _rms_scaled(x, eps).astype(x.dtype)


class _Norm(nnx.Module):
    """`dtype`: the compute (output) dtype or a Precision, None: the input's; parameters in
    `param_dtype` (default float32), never narrower than the compute dtype."""

    def __init__(self, eps: float, dtype, param_dtype):
        self.eps = eps
        if dtype is None:
            self.dtype, self.param_dtype = None, jnp.dtype(param_dtype or jnp.float32)
        else:
            p = Precision.make(dtype, param_dtype)
            self.dtype, self.param_dtype = p.dtype, p.param_dtype

    def _out(self, y, x):
        return y.astype(self.dtype or x.dtype)


class RMSNorm(_Norm):
    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=None, param_dtype=None):
        super().__init__(eps, dtype, param_dtype)
        self.weight = nnx.Param(jnp.ones((dim,), self.param_dtype))

    def __call__(self, x):
        y = _rms_scaled(x, self.eps)
        return self._out(y * self.weight[...].astype(y.dtype), x)


class LayerNorm(_Norm):
    """LayerNorm with weight and bias (DSA's indexer key norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype=None, param_dtype=None):
        super().__init__(eps, dtype, param_dtype)
        self.weight = nnx.Param(jnp.ones((dim,), self.param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), self.param_dtype))

    def __call__(self, x):
        xf = x.astype(at_least_f32(x.dtype))
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
        return self._out(y * self.weight[...].astype(y.dtype) + self.bias[...].astype(y.dtype),
                         x)
