"""Pieces every dense-attention family shares: causal masks and a masked softmax."""

import jax
import jax.numpy as jnp
import numpy as np


def softmax_dtype(dtype):
    """Scores and softmax run in at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def causal_mask(q_pos, k_pos):
    """[B, Tq, Tk] True where key position <= query position."""
    return k_pos[:, None, :] <= q_pos[:, :, None]


def masked_softmax(scores, mask):
    """Softmax over the last axis of scores [B, H, Tq, Tk] with mask [B, Tq, Tk].

    Rows with no visible key (padding queries) give zeros instead of NaN.
    """
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(scores - jax.lax.stop_gradient(m))
    return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(e.dtype).tiny)


def split_keys(p, sizes):
    """p [..., sum(sizes)] cut along its last (key) axis into parts of `sizes`."""
    bounds = np.cumsum(sizes)[:-1].tolist()
    return jnp.split(p, bounds, axis=-1)


# Products against keys shared by every query and head ([B, S, c]: a cache as stored). Written
# as one [B, T·H, c] x [B, S, c] dot_general so XLA reads the keys in their stored layout; the
# equivalent 4-D einsum made XLA:CPU transpose (copy) all S keys first.
def shared_scores(q, keys, preferred_element_type=None, precision=None):
    """q [B, T, H, c] · keys [B, S, c] -> [B, T, H, S]."""
    b, t, h, c = q.shape
    dt = jnp.promote_types(q.dtype, keys.dtype)
    s = jax.lax.dot_general(q.reshape(b, t * h, c).astype(dt), keys.astype(dt), (((2,), (2,)), ((0,), (0,))),
                            preferred_element_type=preferred_element_type, precision=precision)
    return s.reshape(b, t, h, -1)


def shared_mix(p, values):
    """p [B, T, H, S] · values [B, S, c] -> [B, T, H, c]."""
    b, t, h, n = p.shape
    dt = jnp.promote_types(p.dtype, values.dtype)
    o = jax.lax.dot_general(p.reshape(b, t * h, n).astype(dt), values.astype(dt), (((2,), (1,)), ((0,), (0,))))
    return o.reshape(b, t, h, -1)
