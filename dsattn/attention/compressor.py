"""Token compressor: m tokens -> one entry by per-channel softmax pooling (docs/design.md,
"Attention families" and "V4.1 mechanisms"). One module serves HCA, CSA and CSA2.

Per token: candidates C = x·W^KV and scores Z = x·W^Z + B[pos mod m] (B only with a position
bias). Entry i is complete once its span [i·m, (i+1)·m) is; it is, per channel,
Σ_rows softmax_rows(Z) ⊙ C, then RMSNorm (and RoPE at position i·m, applied separately).

- No overlap (HCA, CSA2): the rows are the m tokens of span i. With m = 1 and no overlap there
  is no W^Z: the single token passes through (entry = RMSNorm(x·W^KV)).
- Overlap (CSA): C and Z are 2·width wide, halves a = [:width] and b = [width:]. Entry i reads
  2m rows, the a-halves of span i−1 and the b-halves of span i, under one softmax per channel.
  Entry 0 has no previous span (those rows are absent: kv 0, score −inf).

Two ways to compute the same entries:

- `block(x)`: training forward over a sequence starting at position 0, a reshape and one
  softmax per entry.
- `init_state` / `step`: streaming over cached prefill chunks and decode steps. The state
  holds, per row and per open entry, running per-channel (max, denominator, weighted sum)
  accumulators — O(width), exact through log-sum-exp rescaling (docs/design.md, "Caches").
  A chunk is folded in without a loop over its tokens: each row's chunk is shifted so spans
  line up (a per-row gather), reshaped to [spans, m], reduced densely per span, and the
  per-span statistics are merged with the carried state (see `step`; chunks shorter than m,
  such as decode steps, use a token-in-span mask instead of padding to m rows).

Softmax statistics run in at least float32 (float64 stays float64).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from dsattn.attention.common import softmax_dtype
from dsattn.cache.compressor_state import PoolState
from dsattn.nn.layers import dense
from dsattn.nn.norms import RMSNorm
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope_last


def _merge(a, b):
    """Merge two (max, den, num) softmax-pooling accumulators exactly (log-sum-exp)."""
    (ma, da, na), (mb, db, nb) = a, b
    mx = jnp.maximum(ma, mb)
    safe = jnp.where(jnp.isfinite(mx), mx, 0.0)  # both empty: keep (−inf, 0, 0)
    sa, sb = jnp.exp(ma - safe), jnp.exp(mb - safe)
    return mx, da * sa + db * sb, na * sa + nb * sb


def _pool_stats(z, c, axis):
    """(max, den, num) of softmax pooling over `axis`; rows with z = −inf are absent."""
    mx = jnp.max(z, axis=axis)
    safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    e = jnp.exp(z - jnp.expand_dims(safe, axis))
    return mx, jnp.sum(e, axis=axis), jnp.sum(e * c, axis=axis)


class Compressor(nnx.Module):
    """Compresses every `ratio` tokens of a d_in-wide stream into one `width`-wide entry.
    `dtype`: the compute dtype or a Precision (parameters float32 by default)."""

    def __init__(self, d_in: int, width: int, ratio: int, *, overlap: bool, pos_bias: bool,
                 norm_eps: float, dtype, rngs: nnx.Rngs, std: float = 0.02):
        if ratio < 1:
            raise ValueError(f"Compressor ratio must be >= 1, got {ratio}")
        self.d_in, self.width, self.ratio = d_in, width, ratio
        self.overlap = overlap
        self.coff = 2 if overlap else 1
        prec = Precision.make(dtype)
        self.dtype = prec.dtype
        out = self.coff * width
        self.wkv = dense(d_in, out, rngs, prec, std)
        # m = 1 without overlap pools a single token: no gate, and a bias would be inert.
        gated = ratio > 1 or overlap
        self.wgate = dense(d_in, out, rngs, prec, std) if gated else None
        self.ape = (nnx.Param(jnp.zeros((ratio, out), prec.param_dtype)) if pos_bias and gated
                    else None)
        self.norm = RMSNorm(width, norm_eps, dtype=prec)

    # -- shared pieces -----------------------------------------------------------------
    @property
    def stat_dtype(self):
        return softmax_dtype(self.dtype)

    def max_entries(self, chunk_len: int) -> int:
        """Static bound on entries completing inside a chunk of `chunk_len` tokens.

        A chunk of T consecutive positions holds at most ceil(T/m) <= T//m + 1 span ends.
        """
        return chunk_len // self.ratio + 1

    def _project(self, x):
        """C, Z as [..., coff, width] in the statistics dtype (Z without the bias)."""
        sd = self.stat_dtype
        shape = x.shape[:-1] + (self.coff, self.width)
        c = self.wkv(x).astype(sd).reshape(shape)
        if self.wgate is None:
            return c, jnp.zeros_like(c)
        return c, self.wgate(x).astype(sd).reshape(shape)

    def _bias(self):
        """B as [m, coff, width] in the statistics dtype, or None."""
        if self.ape is None:
            return None
        return self.ape[...].astype(self.stat_dtype).reshape(self.ratio, self.coff, self.width)

    def _finish(self, pooled):
        """Pooled rows (statistics dtype) -> entries in the compute dtype, RMS-normed (the
        norm reads the pooled rows as they are: one rounding, after it)."""
        return self.norm(pooled)

    # -- training forward --------------------------------------------------------------
    def block(self, x):
        """Entries [B, T // m, width] (RMS-normed, before RoPE) of a sequence from position 0."""
        b = x.shape[0]
        m, n, w = self.ratio, x.shape[1] // self.ratio, self.width
        if n == 0:
            return jnp.zeros((b, 0, w), self.dtype)
        c, z = self._project(x[:, : n * m].reshape(b, n, m, self.d_in))  # [B, n, m, coff, w]
        if self.wgate is None:  # m = 1, no overlap: the single token passes through
            return self._finish(c[:, :, 0, 0])
        bias = self._bias()
        if bias is not None:
            z = z + bias
        if self.overlap:
            # rows of entry i: a-halves of span i-1 (none for i = 0), then b-halves of span i
            pad = ((0, 0), (1, 0), (0, 0))
            ca = jnp.pad(c[:, :-1, :, 0], pad + ((0, 0),))
            za = jnp.pad(z[:, :-1, :, 0], pad + ((0, 0),), constant_values=-jnp.inf)
            c = jnp.concatenate([ca, c[:, :, :, 1]], axis=2)  # [B, n, 2m, w]
            z = jnp.concatenate([za, z[:, :, :, 1]], axis=2)
        else:
            c, z = c[:, :, :, 0], z[:, :, :, 0]
        zmax = jax.lax.stop_gradient(jnp.max(z, axis=2, keepdims=True))  # finite: b rows
        e = jnp.exp(z - zmax)
        pooled = jnp.sum(e * c, axis=2) / jnp.sum(e, axis=2)
        return self._finish(pooled)

    def rope_entries(self, entries, entry_index, rope_dim: int, theta: float):
        """RoPE on the last `rope_dim` dims of entries [B, E, width] at position index·m."""
        pos = jnp.broadcast_to(entry_index, entries.shape[:2]) * self.ratio
        return apply_rope_last(entries, pos, theta, rope_dim)

    # -- streaming ---------------------------------------------------------------------
    def init_state(self, batch: int):
        """Empty accumulators: slot 0 is the open entry (the span holding the next position);
        with overlap slot 1 is the entry after it (it already holds the open span's a-halves).
        Each is a per-channel (max, den, num) triple, [B, coff, width] in the stats dtype."""
        shape, sd = (batch, self.coff, self.width), self.stat_dtype
        return PoolState(jnp.full(shape, -jnp.inf, sd), jnp.zeros(shape, sd),
                         jnp.zeros(shape, sd))

    def _span_stats_aligned(self, c, z, r0, n_valid, n_span):
        """Per-span (max, den, num) [B, n_span, coff, w]: shift each row right by r0 so slot u
        holds relative position u, reshape to [spans, m] and reduce densely (long chunks)."""
        b, t = c.shape[:2]
        m = self.ratio
        src = jnp.arange(n_span * m, dtype=jnp.int32)[None] - r0[:, None]  # token of slot u
        live = (src >= 0) & (src < n_valid[:, None])
        idx = jnp.clip(src, 0, t - 1)[:, :, None, None]
        shape = (b, n_span, m, self.coff, self.width)
        c = jnp.where(live[:, :, None, None], jnp.take_along_axis(c, idx, axis=1), 0.0)
        z = jnp.take_along_axis(z, idx, axis=1).reshape(shape)
        bias = self._bias()
        if bias is not None:
            z = z + bias  # slot u sits at in-span offset u mod m
        z = jnp.where(live.reshape(shape[:3])[..., None, None], z, -jnp.inf)
        return _pool_stats(z, c.reshape(shape), axis=2)

    def _span_stats_by_token(self, c, z, r0, n_valid, n_span):
        """Same statistics through a token x span membership mask, O(T·n_span) instead of
        O(n_span·m): short chunks (decode) with a large m would otherwise pad to m rows."""
        t = c.shape[1]
        m = self.ratio
        rel = r0[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # position − s0·m
        bias = self._bias()
        if bias is not None:
            z = z + bias[rel % m]
        live = rel - r0[:, None] < n_valid[:, None]
        member = live[..., None] & (rel[..., None] // m == jnp.arange(n_span)[None, None])
        z = jnp.where(member[..., None, None], z[:, :, None], -jnp.inf)  # [B, T, S, coff, w]
        return _pool_stats(z, c[:, :, None], axis=1)

    def step(self, state, x, positions, valid):
        """Fold a chunk into the state and emit the entries it completes.

        x [B, T, d_in]; positions [B, T] absolute, consecutive along a row's valid tokens;
        valid [B, T] a per-row prefix (a row may feed nothing). Row b's chunk starts at
        positions[b, 0], which need not be a span boundary, but the state must be the one
        left after feeding positions [0, positions[b, 0]).

        Returns (state, entries [B, E, width] RMS-normed and before RoPE, entry_index [B, E],
        entry_valid [B, E]) with E = T // m + 1; the valid entries come first, in increasing
        entry_index, and invalid slots hold zeros.

        Vectorised over the chunk, no loop over its tokens. With s0 = positions[b, 0] // m,
        the chunk touches relative spans 0 … S−1 (S static). Per-span (max, den, num) come
        from one of two equal reductions, chosen statically: T >= m shifts each row right by
        positions[b, 0] mod m (one gather) so the rows reshape to [S, m] and reduce densely;
        T < m (decode) reduces over a [T, S] token-in-span mask instead of padding to m rows.
        Span j's b-halves (the whole row without overlap) feed entry slot j and, with overlap,
        its a-halves slot j + 1; slots 0 (and 1) also merge the carried state, all by exact
        log-sum-exp merges. Entries whose span ended inside the chunk are emitted; the next
        coff slots become the new state.
        """
        t = x.shape[1]
        m, coff = self.ratio, self.coff
        n_span = (t + 2 * m - 2) // m  # spans a chunk of t tokens can touch
        n_ent = self.max_entries(t)
        n_slot = max(n_span, n_ent) + coff
        length = n_span * m

        valid = valid.astype(bool)
        n_valid = jnp.sum(valid, axis=1).astype(jnp.int32)
        p0 = positions[:, 0].astype(jnp.int32)
        s0, r0 = p0 // m, p0 % m

        c, z = self._project(x)  # [B, T, coff, w]
        tok = jnp.arange(t, dtype=jnp.int32)[None]
        c = jnp.where((tok < n_valid[:, None])[..., None, None], c, 0.0)
        if t * n_span < length:
            mx, den, num = self._span_stats_by_token(c, z, r0, n_valid, n_span)
        else:
            mx, den, num = self._span_stats_aligned(c, z, r0, n_valid, n_span)

        def place(stats, first):  # per-span stats -> entry slots [first, first + n_span)
            pads = ((0, 0), (first, n_slot - n_span - first), (0, 0))
            return (jnp.pad(stats[0], pads, constant_values=-jnp.inf),
                    jnp.pad(stats[1], pads), jnp.pad(stats[2], pads))

        half = lambda k: (mx[:, :, k], den[:, :, k], num[:, :, k])  # noqa: E731
        acc = place(half(coff - 1), 0)  # own span (b-halves, or the whole row)
        if self.overlap:
            acc = _merge(acc, place(half(0), 1))  # a-halves feed the next entry
        carry_pad = ((0, 0), (0, n_slot - coff), (0, 0))
        carried = (jnp.pad(state.max, carry_pad, constant_values=-jnp.inf),
                   jnp.pad(state.den, carry_pad), jnp.pad(state.num, carry_pad))
        acc_max, acc_den, acc_num = _merge(carried, acc)  # [B, n_slot, w]

        # spans completed in this chunk: those ending at or before the last fed position
        n_done = jnp.where(n_valid > 0, (p0 + n_valid) // m - s0, 0)
        slot = jnp.arange(n_ent, dtype=jnp.int32)[None]
        entry_valid = slot < n_done[:, None]
        pooled = acc_num[:, :n_ent] / jnp.where(acc_den[:, :n_ent] > 0, acc_den[:, :n_ent], 1.0)
        entries = jnp.where(entry_valid[..., None], self._finish(pooled), 0.0)
        entries = entries.astype(self.dtype)
        entry_index = s0[:, None] + slot

        keep = (n_done[:, None] + jnp.arange(coff, dtype=jnp.int32)[None])[..., None]
        new_state = PoolState(jnp.take_along_axis(acc_max, keep, axis=1),
                              jnp.take_along_axis(acc_den, keep, axis=1),
                              jnp.take_along_axis(acc_num, keep, axis=1))
        return new_state, entries, entry_index, entry_valid
