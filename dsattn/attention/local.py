"""Each V4-family layer's own window KV: one entry per token, RMSNorm, RoPE on the last r
dims at the token's position. Kept for the last W positions in a ring buffer."""

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dsattn.cache import ring

from dsattn.nn.layers import dense
from dsattn.nn.norms import RMSNorm
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope_last


class LocalKV(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        a, m = cfg.attention, cfg.model
        dt = Precision.of(m)
        self.rope_dim = a.rope_dim
        self.wkv = dense(m.d_model, a.entry_dim, rngs, dt, m.init_std)
        self.norm = RMSNorm(a.entry_dim, m.norm_eps, dtype=dt)

    def __call__(self, x, positions, theta):
        return apply_rope_last(self.norm(self.wkv(x)), positions, theta, self.rope_dim)


@struct.dataclass
class Window:
    """Every query's window keys as one sequence: keys [B, L + T, c] and their positions
    (-1: none), the chunk's T keys after L earlier ones in position order, so the query at
    index t finds its window at indices (t + L - size, t + L]: a block of queries reads one
    contiguous slice, O(T·W) in all, never a [T, T] mask."""

    keys: jax.Array
    pos: jax.Array
    lead: int = struct.field(pytree_node=False)  # L
    size: int = struct.field(pytree_node=False)  # W
    # cached execution: the ring after this step's write (it then holds every query's
    # window in its stored format), for a kernel that reads the window from the cache
    ring: Any = None  # a ring.Ring

    @classmethod
    def of_sequence(cls, kv, positions, size: int):
        """Training: a whole sequence from position 0 (L = W - 1 empty keys before it)."""
        pad = size - 1
        return cls(jnp.pad(kv, ((0, 0), (pad, 0), (0, 0))),
                   jnp.pad(positions, ((0, 0), (pad, 0)), constant_values=-1), lead=pad,
                   size=size)

    def block(self, start, n: int):
        """(keys [B, n + W - 1, c], their positions) for queries start..start+n-1 (`mask`
        turns the positions into visibility). A last, padded block may run past the end: the
        slice then starts earlier (dynamic_slice clamps), which still holds every real
        query's window, and the mask goes by positions."""
        lo = start + self.lead - self.size + 1
        width = min(n + self.size - 1, self.keys.shape[1])
        return (jax.lax.dynamic_slice_in_dim(self.keys, lo, width, axis=1),
                jax.lax.dynamic_slice_in_dim(self.pos, lo, width, axis=1))

    def mask(self, key_pos, q_pos):
        return ring.window_mask(key_pos, q_pos, self.size)
