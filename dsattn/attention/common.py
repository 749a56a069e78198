"""Pieces every dense-attention family shares: causal masks and a masked softmax."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsattn.nn.precision import at_least_f32


# Scores and softmax run in at least float32: the precision module's float32 island.
softmax_dtype = at_least_f32


def causal_mask(q_pos, k_pos):
    """[B, Tq, Tk] True where key position <= query position."""
    return k_pos[:, None, :] <= q_pos[:, :, None]


def masked_softmax(scores, mask):
    """Softmax over the last axis of scores [B, H, Tq, Tk] with mask [B, Tq, Tk].

    Rows with no visible key (padding queries) give zeros instead of NaN.
    """
    return softmax(jnp.where(mask[:, None], scores, -jnp.inf))


def softmax(scores):
    """Softmax over the last axis of scores that are -inf where masked; a row of -inf (no
    visible key) gives zeros instead of NaN."""
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(scores - jax.lax.stop_gradient(m))
    return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(e.dtype).tiny)


def split_keys(p, sizes):
    """p [..., sum(sizes)] cut along its last (key) axis into parts of `sizes`."""
    bounds = np.cumsum(sizes)[:-1].tolist()
    return jnp.split(p, bounds, axis=-1)


# Scores are accumulated and returned in softmax_dtype (float32 for bfloat16 inputs), so their
# cotangent dS arrives in float32 and autodiff would run dQ = dS·K and dK = dSᵀ·Q as float32
# matmuls. As flash attention does, the backward takes dS in the inputs' dtype: with bfloat16
# inputs every matmul of the training step runs in bfloat16 (accumulating in float32).
def wide_product(product, a, b):
    """product(a, b, preferred_element_type=...) (an einsum or dot_general with everything
    else fixed) accumulated and returned in softmax_dtype; its backward in the inputs' dtype.
    At float32 or wider it is the plain product and its plain gradient."""
    dt = jnp.promote_types(a.dtype, b.dtype)
    if softmax_dtype(dt) == dt:
        return product(a, b, preferred_element_type=dt)
    return _narrow_backward(product, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _narrow_backward(product, a, b):
    return product(a, b, preferred_element_type=softmax_dtype(jnp.promote_types(a.dtype, b.dtype)))


def _narrow_backward_fwd(product, a, b):
    return _narrow_backward(product, a, b), (a, b)


def _narrow_backward_bwd(product, res, ct):
    a, b = res
    dt = jnp.promote_types(a.dtype, b.dtype)
    _, vjp = jax.vjp(lambda a, b: product(a, b, preferred_element_type=dt), a, b)
    return vjp(ct.astype(dt))


_narrow_backward.defvjp(_narrow_backward_fwd, _narrow_backward_bwd)


# Products against keys shared by every query and head ([B, S, c]: a cache as stored). Written
# as one [B, T·H, c] x [B, S, c] dot_general so XLA reads the keys in their stored layout; the
# equivalent 4-D einsum made XLA:CPU transpose (copy) all S keys first.
def shared_scores(q, keys, precision=None):
    """q [B, T, H, c] · keys [B, S, c] -> [B, T, H, S] in softmax_dtype (wide_product)."""
    b, t, h, c = q.shape
    dt = jnp.promote_types(q.dtype, keys.dtype)
    dims = (((2,), (2,)), ((0,), (0,)))
    product = functools.partial(jax.lax.dot_general, dimension_numbers=dims,
                                precision=precision)
    s = wide_product(product, q.reshape(b, t * h, c).astype(dt), keys.astype(dt))
    return s.reshape(b, t, h, -1)


def shared_mix(p, values):
    """p [B, T, H, S] · values [B, S, c] -> [B, T, H, c]."""
    b, t, h, n = p.shape
    dt = jnp.promote_types(p.dtype, values.dtype)
    o = jax.lax.dot_general(p.reshape(b, t * h, n).astype(dt), values.astype(dt), (((2,), (1,)), ((0,), (0,))))
    return o.reshape(b, t, h, -1)
