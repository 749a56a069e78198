"""Flax's dtype / param_dtype pair (docs/design.md, "Precision").

Parameters are created in `param_dtype` (float32 unless the config says otherwise) and every
layer computes in `dtype`, the parameters cast to it where they are used. Parameters are
never narrower than the compute dtype: the stored type is jnp.promote_types(param_dtype,
dtype), so a float64 run keeps float64 weights and its exact float64 semantics.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def stored_dtype(dtype, param_dtype=None):
    """The dtype parameters are stored in: `param_dtype` (None: float32), widened to the
    compute `dtype` where that is wider."""
    return jnp.dtype(jnp.promote_types(jnp.float32 if param_dtype is None else param_dtype,
                                       dtype))


def at_least_f32(dtype):
    """The dtype of a float32 island (softmax statistics, norms, scores, losses): float32,
    or the compute dtype where that is wider (float64 stays float64)."""
    return jnp.dtype(jnp.promote_types(dtype, jnp.float32))


@dataclasses.dataclass(frozen=True)
class Precision:
    """Compute dtype and parameter dtype of a module (hashable: a static attribute)."""

    dtype: jnp.dtype
    param_dtype: jnp.dtype

    @classmethod
    def of(cls, model_cfg) -> "Precision":
        """`model.dtype` and `model.param_dtype` of a config's model section."""
        return cls.make(model_cfg.dtype, model_cfg.param_dtype)

    @classmethod
    def make(cls, dtype, param_dtype=None) -> "Precision":
        """`dtype` may itself be a Precision (returned as it is); `param_dtype` None means
        float32 (widened to `dtype` where that is wider, as always)."""
        if isinstance(dtype, Precision):
            return dtype
        return cls(jnp.dtype(dtype), stored_dtype(dtype, param_dtype))
