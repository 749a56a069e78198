"""The attention core shared by the V4 family: one entry of width c serves as K and V for
every head; scores over [selected compressed entries | window entries]; a learned sink
logit per head in the softmax denominator (zero value); inverse RoPE of the output's last r
dims at the query position; grouped low-rank output projection (g groups -> r_o -> D).
"""

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from dsattn.attention import reads
from dsattn.attention.common import shared_mix, shared_scores, softmax_dtype
from dsattn.nn.layers import dense
from dsattn.nn.rope import apply_rope_last


def attend(q, parts, sink):
    """Sink attention of q [B,T,H,c] over several key sets.

    Each part is (entries, mask): entries [B, S, c] shared by all queries or [B, T, S, c]
    gathered per query, mask [B, T, S]. K = V = entry. Returns (out [B,T,H,c], probs per part
    [B,T,H,S] for the indexer's training target).
    """
    chex.assert_rank(q, 4)
    sd = softmax_dtype(q.dtype)
    scale = q.shape[-1] ** -0.5
    logits = []
    for entries, mask in parts:
        chex.assert_rank(entries, {3, 4})
        chex.assert_shape(mask, q.shape[:2] + entries.shape[-2:-1])
        chex.assert_type(mask, bool)
        if entries.ndim == 3:
            s = shared_scores(q, entries, preferred_element_type=sd) * scale
        else:
            s = jnp.einsum("bthc,btsc->bths", q, entries, preferred_element_type=sd) * scale
        logits.append(jnp.where(mask[:, :, None, :], s, -jnp.inf))
    sizes = [l.shape[-1] for l in logits]
    s = jnp.concatenate(logits, axis=-1)
    sink = sink.astype(sd)[None, None, :, None]
    m = jax.lax.stop_gradient(jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink))
    e = jnp.exp(s - m)
    p = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))
    out, probs, start = 0, [], 0
    for (entries, _), size in zip(parts, sizes):
        pp = p[..., start: start + size]
        start += size
        probs.append(pp)
        if entries.ndim == 3:
            out = out + shared_mix(pp.astype(entries.dtype), entries)
        else:
            out = out + jnp.einsum("bths,btsc->bthc", pp.astype(entries.dtype), entries)
    return out, probs


class GroupedOutput(nnx.Module):
    """Heads in g groups; each group [H/g · c] -> r_o with its own W^{O,a}; concat -> D."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        a, m = cfg.attention, cfg.model
        dt = jnp.dtype(m.dtype)
        self.g, self.h, self.c = a.o_groups, a.n_heads, a.entry_dim
        group_in = (self.h // self.g) * self.c
        init = nnx.initializers.normal(m.init_std)
        self.wo_a = nnx.Param(init(rngs.params(), (self.g, group_in, a.o_lora_rank), dt))
        self.wo_b = dense(self.g * a.o_lora_rank, m.d_model, rngs, dt, m.init_std)

    def __call__(self, o):
        b, t = o.shape[:2]
        o = o.reshape(b, t, self.g, -1)
        z = jnp.einsum("btgi,gir->btgr", o, self.wo_a[...])
        return self.wo_b(z.reshape(b, t, -1))


class SinkAttentionOutput(nnx.Module):
    """Sink attention over [global items read | window], inverse RoPE and the grouped output,
    by query blocks of `attention.query_block` (attention/reads.py)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        a = cfg.attention
        self.sink = nnx.Param(jnp.zeros((a.n_heads,), jnp.dtype(cfg.model.dtype)))
        self.out = GroupedOutput(cfg, rngs)
        self.rope_dim, self.query_block = a.rope_dim, a.query_block

    def __call__(self, q, positions, valid, window, read, theta, target=None):
        """q [B, T, H, c] at positions [B, T]; window: a `local.Window`; read: what the
        selector returned (None: window only). Returns (output [B, T, D], the indexer's KL
        loss or None)."""
        sink = self.sink[...]

        def one(start, q_blk, pos, items):
            keys, key_pos = window.block(start, q_blk.shape[1])
            parts = [(keys, window.mask(key_pos, pos))]
            if items is not None:
                parts.insert(0, items)
            o, probs = attend(q_blk, parts, sink)
            o = apply_rope_last(o.astype(q.dtype), pos, theta, self.rope_dim, inverse=True)
            # attention mass per global item, summed over heads: the indexer's KL target
            return self.out(o), (probs[0].sum(axis=2) if items is not None else None)

        return reads.attend_blocks(one, self.query_block, q, positions, valid, read, q.dtype,
                                   target)
