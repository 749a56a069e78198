"""Dense / sliding-window attention read: the plain-XLA reference and a fused Pallas kernel.

    attention(q, k, v, *, scale, q_positions, k_positions, causal=True, window=None,
              sink=None, k_valid=None) -> (out, lse)

q [B, Tq, H, dk]; k [B, S, Hk, dk]; v [B, S, Hk, dv], H % Hk == 0 (MHA, GQA, MQA; dv may
differ from dk, and k may be v). Query head h reads key head h // (H // Hk). Key j is visible
to query i iff k_valid[b, j] (default: all) and, if causal, k_positions[b, j] <=
q_positions[b, i], and, with window=w, q_positions[b, i] - k_positions[b, j] < w. Positions
are int32 [B, Tq] / [B, S]. sink: optional per-head logit [H] in the softmax denominator with
zero value. Scores are float32 (float64 for float64 inputs), times ``scale``.

Returns out [B, Tq, H, dv] in q's dtype and lse [B, Tq, H] float32 (float64 for float64
inputs) = log(sum over visible j of exp(s_ij) [+ exp(sink_h)]). A query that sees no key and
has no sink gets out = 0 and lse = -inf, with finite gradients. Gradients honour a cotangent on
lse, so parts read separately merge exactly: lse = logaddexp(lse_1, lse_2), out = sum_p
exp(lse_p - lse) out_p.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(q, k, v, q_positions, k_positions, sink, k_valid, window):
    """Shapes of the contract, with a message naming what does not fit."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"dense attention: q, k, v must be [B, T, heads, dim]; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    B, Tq, H, dk = q.shape
    S, Hk = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"dense attention: k {k.shape} and v {v.shape} must share [B, S, Hk] "
                         f"with B={B} from q {q.shape}")
    if k.shape[3] != dk:
        raise ValueError(f"dense attention: q and k head dims differ ({dk} vs {k.shape[3]})")
    if H % Hk:
        raise ValueError(f"dense attention: {H} query heads are not a multiple of {Hk} key heads")
    if q_positions.shape != (B, Tq) or k_positions.shape != (B, S):
        raise ValueError(f"dense attention: positions must be [B, Tq]={B, Tq} and [B, S]="
                         f"{B, S}; got {q_positions.shape} and {k_positions.shape}")
    if sink is not None and sink.shape != (H,):
        raise ValueError(f"dense attention: sink must be [H]=[{H}]; got {sink.shape}")
    if k_valid is not None and k_valid.shape != (B, S):
        raise ValueError(f"dense attention: k_valid must be [B, S]={B, S}; got {k_valid.shape}")
    if window is not None and window < 1:
        raise ValueError(f"dense attention: window={window} must be >= 1 (or None)")


def score_dtype(dtype):
    """Scores, softmax and lse: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def visible(q_positions, k_positions, k_valid, *, causal: bool, window: int | None):
    """Boolean [..., Tq, S]: key j visible to query i (positions [..., Tq] and [..., S])."""
    qp, kp = q_positions[..., :, None], k_positions[..., None, :]
    vis = jnp.broadcast_to(k_valid[..., None, :], jnp.broadcast_shapes(qp.shape, kp.shape))
    if causal:
        vis = vis & (kp <= qp)
    if window is not None:
        vis = vis & (qp - kp < window)
    return vis


def reference(q, k, v, *, scale: float, q_positions, k_positions, causal: bool = True,
              window: int | None = None, sink=None, k_valid=None):
    """The dense read in plain XLA ops, holding the whole [B, Hk, G, Tq, S] score array: the
    semantics oracle for the kernel (and a fallback anywhere). Returns (out, lse)."""
    q_positions, k_positions = jnp.asarray(q_positions), jnp.asarray(k_positions)
    B, Tq, H, dk = q.shape
    S, Hk = k.shape[1], k.shape[2]
    k_valid = jnp.ones((B, S), bool) if k_valid is None else jnp.asarray(k_valid, bool)
    _check(q, k, v, q_positions, k_positions, sink, k_valid, window)
    G = H // Hk
    sd = score_dtype(q.dtype)
    qg = q.reshape(B, Tq, Hk, G, dk).astype(sd)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(sd),
                   precision=jax.lax.Precision.HIGHEST) * scale
    vis = visible(q_positions, k_positions, k_valid, causal=causal, window=window)
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1))  # a shift only: the result does not depend on it
    if sink is not None:
        m = jnp.maximum(m, jax.lax.stop_gradient(sink.astype(sd).reshape(Hk, G, 1)))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    denom = jnp.sum(p, axis=-1)
    if sink is not None:
        denom = denom + jnp.exp(sink.astype(sd).reshape(Hk, G, 1) - m)
    seen = denom > 0
    safe = jnp.where(seen, denom, 1.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(sd),
                     precision=jax.lax.Precision.HIGHEST) / jnp.moveaxis(safe, -1, 1)[..., None]
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)  # [B, Hk, G, Tq]
    return (out.reshape(B, Tq, H, -1).astype(q.dtype),
            jnp.moveaxis(lse, -1, 1).reshape(B, Tq, H))
