"""The attention core shared by the V4 family: one entry of width c serves as K and V for
every head; scores over [selected compressed entries | window entries]; a learned sink
logit per head in the softmax denominator (zero value); inverse RoPE of the output's last r
dims at the query position; grouped low-rank output projection (g groups -> r_o -> D).
The read itself goes through `attend.attend` (SHARED layout).
"""

import jax.numpy as jnp
from flax import nnx

from dsattn.attention import attend
from dsattn.kernels import registry
from dsattn.nn.layers import dense
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope_last


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
        # a logit of the softmax, which the read computes in at least float32
        self.sink = nnx.Param(jnp.zeros((a.n_heads,), Precision.of(cfg.model).param_dtype))
        self.out = GroupedOutput(cfg, rngs)
        self.rope_dim, self.query_block, self.entry_block = (a.rope_dim, a.query_block,
                                                             a.entry_block)
        self.dtype = Precision.of(cfg.model).dtype
        self.impl = registry.resolve(registry.Op.ATTENTION, cfg, a.impl)

    def __call__(self, q, positions, valid, window, read, theta, target=None):
        """q [B, T, H, c] at positions [B, T]; window: a `local.Window`; read: what the
        selector returned (None: window only). Returns (output [B, T, D], with a target the
        indexer's (KL loss, recall terms), else None)."""
        def epilogue(o, pos):
            return self.out(apply_rope_last(o.astype(q.dtype), pos, theta, self.rope_dim,
                                            inverse=True))

        parts = (window,) if read is None else (read, window)
        return attend.attend(
            attend.Read(q, positions, valid, parts, self.sink[...], target,
                        attend.Layout.SHARED, q.shape[-1] ** -0.5, self.query_block, q.dtype,
                        entry_block=self.entry_block),
            self.impl, epilogue=epilogue)
