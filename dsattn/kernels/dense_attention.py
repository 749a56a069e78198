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

``reference`` is the oracle: plain XLA ops over the whole score array. ``attention`` runs it
or the fused kernel (``implementation``); the kernel follows Pallas's GPU (Triton)
conventions, so it compiles for an NVIDIA GPU, and ``interpret=True`` runs it on any backend
in the Pallas interpreter (how the tests check it on a CPU).

The kernel (flash attention 2's scheme):

- forward, grid (batch, head group, query block): a program's rows are ``block_q`` query
  positions x ``block_h`` query heads of ONE key head (row t * block_h + h), so GQA/MQA heads
  share each loaded K/V block and K/V are never repeated per query head. It walks the key
  blocks ``block_k`` at a time with an online softmax (running max, denominator and
  unnormalised output, float32) and adds the sink once, in the final normalisation. It
  writes out and lse only: no score array leaves the program.
- block skipping: before the call, XLA reduces positions and validity to per-block minima and
  maxima and marks the (query block, key block) pairs where some key may be visible (a valid
  key; causal: the block's smallest valid key position <= the query block's largest
  position; window: its largest valid key position > the query block's smallest - window).
  Each program loops over the span of marked key blocks only (per-element masks inside still
  decide). This is exact for any positions; it is tight (the causal / window band) when
  positions increase along the sequence, as they do for training, prefill and chunked
  prefill.
- backward, recomputed from the saved lse (no probabilities kept): delta = rowsum(dO * O) -
  dlse (the lse cotangent enters only here: dS = P (dP - delta)); a dq kernel on the
  forward's grid, and a dk/dv kernel on (batch, key head, key block) that loops over the
  query blocks that may see its keys and over the key head's query heads, block_h at a time,
  so dk and dv are summed over a GQA group inside the kernel. dsink = -sum P_sink * delta
  comes from lse in XLA.
- head dims: Triton tiles are powers of two, so a head dim is read in power-of-two pieces
  (192 = 128 + 64, 576 = 512 + 64) and dots are summed over pieces; dims must be multiples of
  16 (``unsupported`` says what a shape breaks). Rows past Tq and keys past S are masked on
  load, so Tq and S need not be multiples of the blocks.

Block sizes (``DEFAULTS``, not yet tuned on a GPU): block_q = block_k = 64, shrunk to the
sequence for short reads; block_h = the largest power of two dividing the heads per key head
with block_q * block_h <= 128 rows (decode and short chunks pack heads instead of positions);
rows >= 16 because Triton's dot needs 16 in every dim. Wide heads take smaller tiles: fewer
stages, then fewer keys, then fewer rows, until a program's shared memory (``smem_bytes``,
measured on compiled kernels) fits the GPU the program is built for (dsattn.targets: 227 KiB
a block on an H100 or H200; d = 256 runs 32 keys a step in two stages). Dots run in the inputs' dtype with
float32 accumulation; float32 inputs on a GPU use Triton's default (TF32) precision, the
interpreter computes them exactly.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsattn import targets
from dsattn.kernels import platform


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


# --- The fused kernel (Pallas, Triton-style GPU conventions; interpret=True on a CPU).


class Implementation(enum.Enum):
    """Who computes the read: the XLA reference, or the fused Pallas kernel."""
    REFERENCE = "reference"
    PALLAS = "pallas"


DEFAULTS = dict(block_q=64, block_k=64, max_rows=128, num_stages=2)  # not yet tuned on a GPU
# Shared memory a program asks for, per channel of dk + dv: about 2 bytes x rows (the q and
# dO tiles) plus SMEM_PER_KEY_CHANNEL[(block_k, num_stages)] (key and value tiles, staged).
# Read off Triton compiles for an H100 (the largest request of the forward, dq and dk/dv
# kernels; head dims 64-288 at 128 rows; `scripts/aot_check.py --tiles` measures them).
SMEM_PER_KEY_CHANNEL = {(64, 2): 266, (64, 1): 256, (32, 2): 138, (32, 1): 64, (16, 2): 74,
                        (16, 1): 32}
_NT = (((1,), (1,)), ((), ()))  # [M, d] x [N, d] -> [M, N]
_TN = (((0,), (0,)), ((), ()))  # [M, N] x [M, d] -> [N, d]
_NN = (((1,), (0,)), ((), ()))  # [M, N] x [N, d] -> [M, d]


def _pieces(d: int):
    """(offset, width) power-of-two pieces of a head dim, widest first (192 -> 128 + 64): Triton
    tiles are powers of two, so a dim like 192 is read in pieces rather than padded."""
    out, off = [], 0
    while off < d:
        n = 1 << ((d - off).bit_length() - 1)
        out.append((off, n))
        off += n
    return tuple(out)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n and <= cap (at least 1)."""
    g = 1
    while n % (2 * g) == 0 and 2 * g <= cap:
        g *= 2
    return g


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static shape of one call: block sizes (rows = block_q positions x block_h heads) and
    what the kernels close over."""
    scale: float
    causal: bool
    window: int | None
    has_sink: bool
    tq: int
    s: int
    groups: int  # query heads per key head
    block_q: int
    block_k: int
    block_h: int
    dk: tuple
    dv: tuple
    num_warps: int
    num_stages: int
    interpret: bool | None


def unsupported(q_shape, k_shape, v_shape, *, block_q=None, block_k=None, block_h=None):
    """Why the Pallas kernel cannot take these shapes and block sizes (None: it can). Triton
    tiles are powers of two and its dots need every dim >= 16."""
    dk, dv = q_shape[-1], v_shape[-1]
    if dk % 16 or dv % 16:
        return f"head dims dk={dk}, dv={dv} must be multiples of 16"
    for name, b in (("block_q", block_q), ("block_k", block_k), ("block_h", block_h)):
        if b is not None and (b < 1 or b & (b - 1)):
            return f"{name}={b} must be a power of two"
    if block_k is not None and block_k < 16:
        return f"block_k={block_k} must be >= 16"
    G = q_shape[2] // k_shape[2]
    if block_h is not None and G % block_h:
        return f"block_h={block_h} must divide the {G} query heads per key head"
    return None


def _plan(q, k, v, *, scale, causal, window, has_sink, block_q, block_k, block_h, num_warps,
          num_stages, interpret) -> _Plan:
    why = unsupported(q.shape, k.shape, v.shape, block_q=block_q, block_k=block_k,
                      block_h=block_h)
    if why:
        raise ValueError(f"dense attention (pallas): {why}")
    B, Tq, H, dk = q.shape
    S, Hk, dv = k.shape[1], k.shape[2], v.shape[3]
    G = H // Hk
    bq, bk, max_rows, stages = _fitting_tiles(dk + dv, block_q, block_k, num_stages)
    bq = min(bq, pl.next_power_of_2(Tq))
    bk = min(bk, max(16, pl.next_power_of_2(S)))
    bh = _pow2_divisor(G, max(1, max_rows // bq)) if block_h is None else block_h
    bq = max(bq, -(-16 // bh))  # rows (block_q * block_h) >= 16 for Triton's dot
    if num_warps is None:
        num_warps = 4 if max(dk, dv) <= 64 else 8
    return _Plan(scale=float(scale), causal=causal, window=window, has_sink=has_sink, tq=Tq,
                 s=S, groups=G, block_q=bq, block_k=bk, block_h=bh, dk=_pieces(dk),
                 dv=_pieces(dv), num_warps=num_warps, num_stages=stages, interpret=interpret)


def smem_bytes(channels: int, rows: int, block_k: int, num_stages: int) -> int:
    """Shared memory (bytes) a program of the kernels asks for at dk + dv = `channels`."""
    return channels * (2 * rows + SMEM_PER_KEY_CHANNEL[(block_k, min(num_stages, 2))])


def _fitting_tiles(channels: int, block_q, block_k, num_stages) -> tuple[int, int, int, int]:
    """(block_q, block_k, max_rows, num_stages): `DEFAULTS`' tiles, or the largest smaller
    ones (fewer stages, then fewer keys, then fewer rows) whose programs fit the shared
    memory of the GPU the program is built for (dsattn.targets). A size the caller set is
    kept as it is."""
    limit = targets.shared_memory()
    bq = DEFAULTS["block_q"] if block_q is None else block_q
    keys = (DEFAULTS["block_k"], 32, 16) if block_k is None else (block_k,)
    stages = (DEFAULTS["num_stages"], 1) if num_stages is None else (num_stages,)
    rows = DEFAULTS["max_rows"]
    while rows > 16:
        for bk in keys:
            for st in stages:
                if ((bk, min(st, 2)) not in SMEM_PER_KEY_CHANNEL
                        or smem_bytes(channels, rows, bk, st) <= limit):
                    return min(bq, rows), bk, rows, st
        rows //= 2
    return min(bq, rows), keys[-1], rows, stages[-1]  # the smallest: the compile will tell


def _block_visibility(q_positions, k_positions, k_valid, p: _Plan):
    """Boolean [B, n_q, n_k]: may any query of q block i see any key of key block j? False
    only where no key can be visible (no valid key, or every key after every query for
    causal, or every key out of every query's window), judged from per-block position minima
    and maxima: exact for any positions, and tight when positions increase along the
    sequence (then only the causal / window band of blocks is read)."""
    B = q_positions.shape[0]
    nq, nk = -(-p.tq // p.block_q), -(-p.s // p.block_k)
    qp = jnp.pad(q_positions, ((0, 0), (0, nq * p.block_q - p.tq)), mode="edge")
    qp = qp.reshape(B, nq, p.block_q)
    kp = jnp.pad(k_positions, ((0, 0), (0, nk * p.block_k - p.s))).reshape(B, nk, p.block_k)
    kv = jnp.pad(k_valid, ((0, 0), (0, nk * p.block_k - p.s))).reshape(B, nk, p.block_k)
    big = jnp.iinfo(jnp.int32)
    kmin = jnp.min(jnp.where(kv, kp, big.max), axis=-1)[:, None, :]
    kmax = jnp.max(jnp.where(kv, kp, big.min), axis=-1)[:, None, :]
    need = jnp.broadcast_to(jnp.any(kv, axis=-1)[:, None, :], (B, nq, nk))
    if p.causal:
        need = need & (kmin <= jnp.max(qp, axis=-1)[:, :, None])
    if p.window is not None:
        need = need & (kmax > jnp.min(qp, axis=-1)[:, :, None] - p.window)
    return need


def _span(need, axis: int):
    """int32 (first, last + 1) of the True entries along ``axis`` ((0, 0) where none): the
    block loop's bounds; blocks inside the span that are not needed are read and masked."""
    n = need.shape[axis]
    idx = jax.lax.broadcasted_iota(jnp.int32, need.shape, axis)
    lo = jnp.min(jnp.where(need, idx, n), axis=axis)
    hi = jnp.max(jnp.where(need, idx + 1, 0), axis=axis)
    return jnp.minimum(lo, hi).astype(jnp.int32), hi.astype(jnp.int32)


def _dot(a, b, dims):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32
                               if a.dtype != jnp.float64 else jnp.float64)


def _scores(p: _Plan, q_parts, k_ref, rows_vis_fn, start, sd):
    """Scaled, masked scores [R, block_k] of the row tile against keys start..start+block_k."""
    cols = start + jax.lax.iota(jnp.int32, p.block_k)
    col_ok = cols < p.s
    s = None
    for (off, n), qp in zip(p.dk, q_parts):
        kp = plgpu.load(k_ref.at[pl.ds(start, p.block_k), pl.ds(off, n)],
                        mask=col_ok[:, None], other=0)
        d = _dot(qp, kp, _NT)
        s = d if s is None else s + d
    s = s.astype(sd) * p.scale
    return jnp.where(rows_vis_fn(start, col_ok), s, -jnp.inf)


def _row_visibility(p: _Plan, qpos_rows, row_ok, kpos_ref, kval_ref):
    """A function (key block start, col_ok) -> boolean [R, block_k] for one row tile."""
    def vis(start, col_ok):
        sl = pl.ds(start, p.block_k)
        kpos = plgpu.load(kpos_ref.at[sl], mask=col_ok, other=0)[None, :]
        ok = (plgpu.load(kval_ref.at[sl], mask=col_ok, other=0) != 0) & col_ok
        m = ok[None, :] & row_ok[:, None]
        if p.causal:
            m = m & (kpos <= qpos_rows[:, None])
        if p.window is not None:
            m = m & (qpos_rows[:, None] - kpos < p.window)
        return m
    return vis


def _rows(x, p: _Plan):
    """[block_q, ...] per position -> [R] per (position, head) row (row = t * block_h + h)."""
    R = p.block_q * p.block_h
    return jnp.broadcast_to(x[:, None], (p.block_q, p.block_h)).reshape(R)


def _load_tile(ref, p: _Plan, pieces, row_ok, t0=None, h0=None):
    """A [block_q, block_h, d] tile as [R, n] pieces (rows past Tq read as 0). With t0/h0 the
    ref is the whole sequence / head group and the tile starts there."""
    R = p.block_q * p.block_h
    lead = (slice(None), slice(None)) if t0 is None else (pl.ds(t0, p.block_q),
                                                          pl.ds(h0, p.block_h))
    return [plgpu.load(ref.at[lead + (pl.ds(off, n),)], mask=row_ok[:, None, None],
                       other=0).reshape(R, n) for off, n in pieces]


def _load_rowvec(ref, p: _Plan, row_ok, t0=None, h0=None):
    """A [block_q, block_h] per-row statistic as [R] (rows past Tq read as 0)."""
    if t0 is not None:
        ref = ref.at[pl.ds(t0, p.block_q), pl.ds(h0, p.block_h)]
    return plgpu.load(ref, mask=row_ok[:, None], other=0).reshape(p.block_q * p.block_h)


def _fwd_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, qpos_ref, kpos_ref, kval_ref, sink_ref,
                o_ref, lse_ref, *, p: _Plan):
    # Program (b, head group g, query block i): rows (t, h) of block_q positions x block_h
    # heads, all reading key head g * block_h // groups. Online softmax over key blocks lo..hi.
    b, i = pl.program_id(0), pl.program_id(2)
    sd = lse_ref.dtype
    R = p.block_q * p.block_h
    row_ok = i * p.block_q + jax.lax.iota(jnp.int32, p.block_q) < p.tq
    qpos = _rows(plgpu.load(qpos_ref, mask=row_ok, other=0), p)
    row_ok_r = _rows(row_ok, p)
    q_parts = _load_tile(q_ref, p, p.dk, row_ok)
    vis = _row_visibility(p, qpos, row_ok_r, kpos_ref, kval_ref)

    def body(j, carry):
        m, l, acc = carry
        start = j * p.block_k
        s = _scores(p, q_parts, k_ref, vis, start, sd)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet: exp -> 0
        alpha = jnp.exp(m - shift)
        e = jnp.exp(s - shift[:, None])
        col_ok = (start + jax.lax.iota(jnp.int32, p.block_k) < p.s)[:, None]
        acc = tuple(alpha[:, None] * a + _dot(
            e.astype(v_ref.dtype),
            plgpu.load(v_ref.at[pl.ds(start, p.block_k), pl.ds(off, n)], mask=col_ok,
                       other=0), _NN).astype(sd)
            for (off, n), a in zip(p.dv, acc))
        return m_new, alpha * l + jnp.sum(e, axis=1), acc

    init = (jnp.full((R,), -jnp.inf, sd), jnp.zeros((R,), sd),
            tuple(jnp.zeros((R, n), sd) for _, n in p.dv))
    m, l, acc = jax.lax.fori_loop(lo_ref[b, i], hi_ref[b, i], body, init)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    if p.has_sink:  # the sink joins the denominator once, here
        sink = jnp.broadcast_to(sink_ref[...].astype(sd)[None, :], (p.block_q, p.block_h))
        sink = sink.reshape(R)
        top = jnp.maximum(m, sink)
        keep = jnp.exp(m - top)
        l = l * keep + jnp.exp(sink - top)
        acc = tuple(a * keep[:, None] for a in acc)
        m = top
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    for (off, n), a in zip(p.dv, acc):
        plgpu.store(o_ref.at[:, :, pl.ds(off, n)],
                    (a / safe[:, None]).reshape(p.block_q, p.block_h, n).astype(o_ref.dtype),
                    mask=row_ok[:, None, None])
    lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
    plgpu.store(lse_ref, lse.reshape(p.block_q, p.block_h), mask=row_ok[:, None])


def _dq_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref,
               kpos_ref, kval_ref, dq_ref, *, p: _Plan):
    # Same programs as the forward; dq = scale * sum_j ds_ij k_j over the same key blocks.
    b, i = pl.program_id(0), pl.program_id(2)
    sd = lse_ref.dtype
    R = p.block_q * p.block_h
    row_ok = i * p.block_q + jax.lax.iota(jnp.int32, p.block_q) < p.tq
    qpos = _rows(plgpu.load(qpos_ref, mask=row_ok, other=0), p)
    q_parts = _load_tile(q_ref, p, p.dk, row_ok)
    do_parts = _load_tile(do_ref, p, p.dv, row_ok)
    lse = _load_rowvec(lse_ref, p, row_ok)
    delta = _load_rowvec(delta_ref, p, row_ok)
    vis = _row_visibility(p, qpos, _rows(row_ok, p), kpos_ref, kval_ref)

    def body(j, dq):
        start = j * p.block_k
        ds = _ds(p, q_parts, do_parts, lse, delta, k_ref, v_ref, vis, start, sd)[1]
        col_ok = (start + jax.lax.iota(jnp.int32, p.block_k) < p.s)[:, None]
        return tuple(a + _dot(ds.astype(k_ref.dtype), plgpu.load(
            k_ref.at[pl.ds(start, p.block_k), pl.ds(off, n)], mask=col_ok, other=0),
            _NN).astype(sd) for (off, n), a in zip(p.dk, dq))

    dq = jax.lax.fori_loop(lo_ref[b, i], hi_ref[b, i], body,
                           tuple(jnp.zeros((R, n), sd) for _, n in p.dk))
    for (off, n), a in zip(p.dk, dq):
        plgpu.store(dq_ref.at[:, :, pl.ds(off, n)],
                    (a * p.scale).reshape(p.block_q, p.block_h, n).astype(dq_ref.dtype),
                    mask=row_ok[:, None, None])


def _ds(p: _Plan, q_parts, do_parts, lse, delta, k_ref, v_ref, vis, start, sd):
    """Recomputed probabilities P [R, block_k] and dS = P * (dP - delta) of one key block
    (delta already holds rowsum(dO * O) - dlse, the lse cotangent)."""
    s = _scores(p, q_parts, k_ref, vis, start, sd)
    prob = jnp.exp(s - lse[:, None])  # lse of a row that saw nothing is passed as 0: exp(-inf)
    col_ok = (start + jax.lax.iota(jnp.int32, p.block_k) < p.s)[:, None]
    dp = None
    for (off, n), dop in zip(p.dv, do_parts):
        vp = plgpu.load(v_ref.at[pl.ds(start, p.block_k), pl.ds(off, n)], mask=col_ok, other=0)
        d = _dot(dop, vp, _NT)
        dp = d if dp is None else dp + d
    return prob, prob * (dp.astype(sd) - delta[:, None])


def _dkv_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref,
                kpos_ref, kval_ref, dk_ref, dv_ref, *, p: _Plan):
    # Program (b, key head, key block j): dK, dV of block_k keys, summed over the query blocks
    # lo..hi that may see them and over the key head's query heads, block_h at a time.
    b, j = pl.program_id(0), pl.program_id(2)
    sd = delta_ref.dtype
    start = j * p.block_k
    col_ok = (start + jax.lax.iota(jnp.int32, p.block_k) < p.s)[:, None]

    def q_block(i, carry):
        t0 = i * p.block_q
        row_ok = t0 + jax.lax.iota(jnp.int32, p.block_q) < p.tq
        qpos = _rows(plgpu.load(qpos_ref.at[pl.ds(t0, p.block_q)], mask=row_ok, other=0), p)
        vis = _row_visibility(p, qpos, _rows(row_ok, p), kpos_ref, kval_ref)

        def head_group(g, carry):
            dk, dv = carry
            h0 = g * p.block_h
            q_parts = _load_tile(q_ref, p, p.dk, row_ok, t0, h0)
            do_parts = _load_tile(do_ref, p, p.dv, row_ok, t0, h0)
            lse = _load_rowvec(lse_ref, p, row_ok, t0, h0)
            delta = _load_rowvec(delta_ref, p, row_ok, t0, h0)
            prob, ds = _ds(p, q_parts, do_parts, lse, delta, k_ref, v_ref, vis, start, sd)
            dv = tuple(a + _dot(prob.astype(do_ref.dtype), d, _TN).astype(sd)
                       for a, d in zip(dv, do_parts))
            dk = tuple(a + _dot(ds.astype(q_ref.dtype), qp, _TN).astype(sd)
                       for a, qp in zip(dk, q_parts))
            return dk, dv

        return jax.lax.fori_loop(0, p.groups // p.block_h, head_group, carry)

    init = (tuple(jnp.zeros((p.block_k, n), sd) for _, n in p.dk),
            tuple(jnp.zeros((p.block_k, n), sd) for _, n in p.dv))
    dk, dv = jax.lax.fori_loop(lo_ref[b, j], hi_ref[b, j], q_block, init)
    for (off, n), a in zip(p.dk, dk):
        plgpu.store(dk_ref.at[:, pl.ds(off, n)], (a * p.scale).astype(dk_ref.dtype),
                    mask=col_ok)
    for (off, n), a in zip(p.dv, dv):
        plgpu.store(dv_ref.at[:, pl.ds(off, n)], a.astype(dv_ref.dtype), mask=col_ok)


def _call(kernel, p: _Plan, grid, in_specs, out_specs, out_shape, name, *args):
    return platform.pallas_call(
        functools.partial(kernel, p=p), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=p.interpret, name=name,
        compiler_params=plgpu.CompilerParams(num_warps=p.num_warps,
                                             num_stages=p.num_stages))(*args)


def _row_specs(p: _Plan, *dims):
    """Specs of per-row arrays on the (b, head group, q block) grid: [B, Tq, H, d] tiles for an
    int d, [B, Tq, H] statistics for None."""
    return [pl.BlockSpec((None, p.block_q, p.block_h) + ((d,) if d else ()),
                         lambda b, g, i, d=d: (b, i, g) + ((0,) if d else ())) for d in dims]


def _key_specs(p: _Plan, key_head, *dims):
    """Whole-sequence specs of the key head ``key_head(g)``: [B, S, Hk, d] for an int d,
    [B, S] (positions, validity) for None; the kernels index key blocks themselves."""
    return [pl.BlockSpec((None, p.s, None, d), lambda b, g, i: (b, 0, key_head(g), 0)) if d
            else pl.BlockSpec((None, p.s), lambda b, g, i: (b, 0)) for d in dims]


def _forward(p: _Plan, q, k, v, sink, q_positions, k_positions, k_valid):
    B, Tq, H, dk = q.shape
    dv = v.shape[3]
    nq = -(-Tq // p.block_q)
    lo, hi = _span(_block_visibility(q_positions, k_positions, k_valid != 0, p), axis=2)
    sink_arr = jnp.zeros((H,), jnp.float32) if sink is None else sink
    sd = score_dtype(q.dtype)
    in_specs = ([pl.no_block_spec, pl.no_block_spec] + _row_specs(p, dk)
                + _key_specs(p, lambda g: g * p.block_h // p.groups, dk, dv)
                + [pl.BlockSpec((None, p.block_q), lambda b, g, i: (b, i))]
                + _key_specs(p, None, None, None)
                + [pl.BlockSpec((p.block_h,), lambda b, g, i: (g,))])
    return _call(_fwd_kernel, p, (B, H // p.block_h, nq), in_specs, _row_specs(p, dv, None),
                 [jax.ShapeDtypeStruct((B, Tq, H, dv), q.dtype),
                  jax.ShapeDtypeStruct((B, Tq, H), sd)], "dense_attention_fwd",
                 lo, hi, q, k, v, q_positions, k_positions, k_valid, sink_arr)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(p: _Plan, q, k, v, sink, q_positions, k_positions, k_valid):
    return _forward(p, q, k, v, sink, q_positions, k_positions, k_valid)


def _fused_fwd(p, q, k, v, sink, q_positions, k_positions, k_valid):
    out, lse = _forward(p, q, k, v, sink, q_positions, k_positions, k_valid)
    return (out, lse), (q, k, v, sink, q_positions, k_positions, k_valid, out, lse)


def _fused_bwd(p, res, cts):
    q, k, v, sink, q_positions, k_positions, k_valid, out, lse = res
    dout, dlse = cts
    B, Tq, H, dk = q.shape
    Hk, dv = k.shape[2], v.shape[3]
    sd = lse.dtype
    # dS = P (dP - delta) with delta = rowsum(dO * O) - dlse: the lse cotangent enters here.
    delta = jnp.sum(dout.astype(sd) * out.astype(sd), axis=-1) - dlse.astype(sd)
    lse0 = jnp.where(lse == -jnp.inf, 0.0, lse)  # rows that saw nothing: P = exp(-inf - 0) = 0
    need = _block_visibility(q_positions, k_positions, k_valid != 0, p)
    q_lo, q_hi = _span(need, axis=2)
    k_lo, k_hi = _span(need, axis=1)
    nq, nk = need.shape[1], need.shape[2]
    kpos_specs = _key_specs(p, None, None, None)

    dq = _call(_dq_kernel, p, (B, H // p.block_h, nq),
               [pl.no_block_spec, pl.no_block_spec] + _row_specs(p, dk)
               + _key_specs(p, lambda g: g * p.block_h // p.groups, dk, dv)
               + _row_specs(p, dv, None, None)
               + [pl.BlockSpec((None, p.block_q), lambda b, g, i: (b, i))] + kpos_specs,
               _row_specs(p, dk)[0], jax.ShapeDtypeStruct(q.shape, q.dtype),
               "dense_attention_dq", q_lo, q_hi, q, k, v, dout, lse0, delta, q_positions,
               k_positions, k_valid)

    G = p.groups  # program (b, key head h, key block j) reads all G query heads of h
    group = lambda d: pl.BlockSpec((None, Tq, G) + ((d,) if d else ()),  # noqa: E731
                                   lambda b, h, j: (b, 0, h) + ((0,) if d else ()))
    key_block = lambda d: pl.BlockSpec((None, p.block_k, None, d),  # noqa: E731
                                       lambda b, h, j: (b, j, h, 0))
    dk_, dv_ = _call(_dkv_kernel, p, (B, Hk, nk),
                     [pl.no_block_spec, pl.no_block_spec, group(dk)]
                     + _key_specs(p, lambda h: h, dk, dv)
                     + [group(dv), group(None), group(None),
                        pl.BlockSpec((None, Tq), lambda b, h, j: (b, 0))] + kpos_specs,
                     [key_block(dk), key_block(dv)],
                     [jax.ShapeDtypeStruct(k.shape, k.dtype),
                      jax.ShapeDtypeStruct(v.shape, v.dtype)],
                     "dense_attention_dkv", k_lo, k_hi, q, k, v, dout, lse0, delta,
                     q_positions, k_positions, k_valid)
    dsink = None
    if sink is not None:  # the sink is one more logit with zero value: dsink = -P_sink delta
        p_sink = jnp.exp(sink.astype(sd) - lse)
        dsink = -jnp.sum(p_sink * delta, axis=(0, 1)).astype(sink.dtype)
    return dq, dk_, dv_, dsink, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def attention(q, k, v, *, scale: float, q_positions, k_positions, causal: bool = True,
              window: int | None = None, sink=None, k_valid=None,
              implementation: Implementation = Implementation.PALLAS,
              interpret: bool | None = None,
              block_q: int | None = None, block_k: int | None = None,
              block_h: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None):
    """The dense / window read (see the module docstring): (out, lse), differentiable in q, k,
    v and sink.

    ``implementation``: ``REFERENCE`` (plain XLA, any backend) or ``PALLAS`` (the fused
    kernel: compiled for an NVIDIA GPU, or run by the Pallas interpreter with
    ``interpret=True``, which is how a CPU runs it). Kernel tiling: ``block_q`` query positions
    x ``block_h`` query heads of one key head form a program's rows; ``block_k`` keys per
    step (powers of two; defaults in ``DEFAULTS``, fitted to the shapes). ``num_warps`` /
    ``num_stages``: Triton's launch parameters.
    """
    implementation = Implementation(implementation)
    if implementation is Implementation.REFERENCE:
        return reference(q, k, v, scale=scale, q_positions=q_positions,
                         k_positions=k_positions, causal=causal, window=window, sink=sink,
                         k_valid=k_valid)
    q_positions = jnp.asarray(q_positions, jnp.int32)
    k_positions = jnp.asarray(k_positions, jnp.int32)
    B, S = k.shape[0], k.shape[1]
    k_valid = jnp.ones((B, S), bool) if k_valid is None else jnp.asarray(k_valid, bool)
    _check(q, k, v, q_positions, k_positions, sink, k_valid, window)
    p = _plan(q, k, v, scale=scale, causal=causal, window=window, has_sink=sink is not None,
              block_q=block_q, block_k=block_k, block_h=block_h, num_warps=num_warps,
              num_stages=num_stages, interpret=interpret)
    return _fused(p, q, k, v, sink, q_positions, k_positions, k_valid.astype(jnp.int32))
