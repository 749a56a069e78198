"""Pieces every dense-attention family shares: causal masks and a masked softmax."""

import jax
import jax.numpy as jnp


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
