"""The attention core shared by the V4 family: one entry of width c serves as K and V for
every head; scores over [selected compressed entries | window entries]; a learned sink
logit per head in the softmax denominator (zero value); inverse RoPE of the output's last r
dims at the query position; grouped low-rank output projection (g groups -> r_o -> D).
"""

import functools

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from dsattn.attention import blocks, reads
from dsattn.attention.common import (shared_mix, shared_scores, softmax_dtype, split_keys,
                                     wide_product)
from dsattn.nn.layers import dense
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope_last


def _logits(q, entries, mask):
    """Scaled scores of q [B,T,H,c] over one part, -inf where masked: [B,T,H,S]."""
    chex.assert_rank(entries, {3, 4})
    chex.assert_shape(mask, q.shape[:2] + entries.shape[-2:-1])
    chex.assert_type(mask, bool)
    if entries.ndim == 3:
        s = shared_scores(q, entries)
    else:
        s = wide_product(functools.partial(jnp.einsum, "bthc,btsc->bths"), q, entries)
    return jnp.where(mask[:, :, None, :], s * q.shape[-1] ** -0.5, -jnp.inf)


def _mix(p, entries):
    """Weights p [B,T,H,S] over one part's entries -> [B,T,H,c]."""
    if entries.ndim == 3:
        return shared_mix(p.astype(entries.dtype), entries)
    return jnp.einsum("bths,btsc->bthc", p.astype(entries.dtype), entries)


def attend(q, parts, sink, entry_block: int | None = None):
    """Sink attention of q [B,T,H,c] over several key sets.

    Each part is (entries, mask): entries [B, S, c] shared by all queries or [B, T, S, c]
    gathered per query, mask [B, T, S]. K = V = entry. Returns (out [B,T,H,c], probs per part
    [B,T,H,S] for the indexer's training target).

    With ``entry_block`` (no probabilities wanted) a shared part longer than that is read a
    block of entries at a time by an online softmax (`_online`): no [B,T,H,S] array; probs
    is then None.
    """
    chex.assert_rank(q, 4)
    sd = softmax_dtype(q.dtype)
    if entry_block is not None and any(e.ndim == 3 and e.shape[1] > entry_block
                                       for e, _ in parts):
        return _online(q, parts, sink.astype(sd), entry_block, sd), None
    logits = [_logits(q, entries, mask) for entries, mask in parts]
    s = jnp.concatenate(logits, axis=-1)
    sink = sink.astype(sd)[None, None, :, None]
    m = jax.lax.stop_gradient(jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink))
    e = jnp.exp(s - m)
    p = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))
    probs = split_keys(p, [l.shape[-1] for l in logits])
    out = sum(_mix(pp, entries) for (entries, _), pp in zip(parts, probs))
    return out, probs


def _online(q, parts, sink, block: int, sd):
    """`attend`'s output by a running (max, sum, weighted sum) over the parts, a shared part
    longer than `block` a block of entries at a time. It starts from the sink, which every
    row's denominator holds (zero value): the running max is finite from the start, and a
    row that sees no entry gets zeros, as in `attend`."""
    m = jax.lax.stop_gradient(jnp.broadcast_to(sink[None, None, :, None], q.shape[:3] + (1,)))
    state = (m, jnp.exp(sink[None, None, :, None] - m), jnp.zeros(q.shape, sd))

    def absorb(state, entries, mask):
        m, l, acc = state
        s = _logits(q, entries, mask)
        m_new = jnp.maximum(m, jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
        e, scale = jnp.exp(s - m_new), jnp.exp(m - m_new)
        return (m_new, l * scale + jnp.sum(e, axis=-1, keepdims=True),
                acc * scale + _mix(e, entries).astype(sd))

    for entries, mask in parts:
        n = entries.shape[1]
        if entries.ndim == 4 or n <= block:
            state = absorb(state, entries, mask)
            continue
        # padding is masked
        xs = (blocks.split(entries, 1, block), blocks.split(mask, 2, block))
        state = jax.lax.scan(lambda st, x: (absorb(st, *x), None), state, xs)[0]
    _, l, acc = state
    return (acc / l).astype(jnp.result_type(*(e.dtype for e, _ in parts)))


class GroupedOutput(nnx.Module):
    """Heads in g groups; each group [H/g · c] -> r_o with its own W^{O,a}; concat -> D."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        a, m = cfg.attention, cfg.model
        dt = Precision.of(m)
        self.dtype = dt.dtype
        self.g, self.h, self.c = a.o_groups, a.n_heads, a.entry_dim
        group_in = (self.h // self.g) * self.c
        init = nnx.initializers.normal(m.init_std)
        self.wo_a = nnx.Param(init(rngs.params(), (self.g, group_in, a.o_lora_rank),
                                   dt.param_dtype))
        self.wo_b = dense(self.g * a.o_lora_rank, m.d_model, rngs, dt, m.init_std)

    def __call__(self, o):
        b, t = o.shape[:2]
        o = o.reshape(b, t, self.g, -1)
        z = jnp.einsum("btgi,gir->btgr", o, self.wo_a[...].astype(self.dtype))
        return self.wo_b(z.reshape(b, t, -1))


class SinkAttentionOutput(nnx.Module):
    """Sink attention over [global items read | window], inverse RoPE and the grouped output,
    by query blocks of `attention.query_block` (attention/reads.py)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        a = cfg.attention
        # a logit of the softmax, which `attend` computes in at least float32
        self.sink = nnx.Param(jnp.zeros((a.n_heads,), Precision.of(cfg.model).param_dtype))
        self.out = GroupedOutput(cfg, rngs)
        self.rope_dim, self.query_block, self.entry_block = (a.rope_dim, a.query_block,
                                                             a.entry_block)

    def __call__(self, q, positions, valid, window, read, theta, target=None):
        """q [B, T, H, c] at positions [B, T]; window: a `local.Window`; read: what the
        selector returned (None: window only). Returns (output [B, T, D], the indexer's KL
        loss or None)."""
        sink = self.sink[...]
        # the indexer's KL target needs the per-entry probabilities: no online softmax then
        entry_block = self.entry_block if target is None else None

        def one(start, q_blk, pos, items):
            keys, key_pos = window.block(start, q_blk.shape[1])
            parts = [(keys, window.mask(key_pos, pos))]
            if items is not None:
                parts.insert(0, items)
            per_step = (None if entry_block is None
                        else blocks.per_step(entry_block, self.query_block, q_blk.shape[1]))
            o, probs = attend(q_blk, parts, sink, per_step)
            o = apply_rope_last(o.astype(q.dtype), pos, theta, self.rope_dim, inverse=True)
            # attention mass per global item, summed over heads: the indexer's KL target
            if target is None or items is None:
                return self.out(o), None
            return self.out(o), probs[0].sum(axis=2)

        return reads.attend_blocks(one, self.query_block, q, positions, valid, read, q.dtype,
                                   target)
