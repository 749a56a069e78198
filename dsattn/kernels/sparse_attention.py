"""Selected-entries attention (V4 CSA, DSA top-k): every query reads the k entries its
selection names from a store shared by all heads, K = V = the entry (or a separate value).

    s[b,t,h,j] = scale · q[b,t,h] · store[b, idx[b,t,j]]          (float32, -inf if no pick)
    lse[b,t,h] = log(Σ_j exp(s[b,t,h,j]) + exp(sink[h]))          (the sink term if given)
    out[b,t,h] = Σ_j exp(s[b,t,h,j] - lse[b,t,h]) · value[b, idx[b,t,j]]

An id outside [0, N) (-1 pads a selection shorter than k) is no pick. Every pick is one
softmax term: an id picked twice counts twice (as in the gathering XLA path). A query with no
pick and no sink returns out = 0 and lse = -inf, with finite gradients.

- ``reference`` / ``entry_mass_reference``: the semantics in plain jnp (it gathers the
  picked entries [B, T, k, c]: the oracle, not for long sequences).
- ``attention`` / ``entry_mass``: the fused Pallas kernels (Triton-style
  ``jax.experimental.pallas``; ``interpret=True`` runs them in the generic interpreter on
  CPU, and they lower for CUDA: tests/test_sparse_attention.py).

The forward kernel follows FlashMLA's sparse prefill: grid (batch row, query block); a
program walks its ``block_t`` queries one at a time and each query's picks ``block_k`` at a
time: it reads the block's ids from ``idx``, gathers those entries from the store in-kernel
(the store is passed whole and indexed by row, as the paged indexer kernel does) and loads
each entry once for all H heads: heads are the M dimension of the [H, c] x [c, block_k] score
matmul and the [H, block_k] x [block_k, dv] mixing matmul. An online softmax runs over the
pick blocks; the sink enters as the running state's start (max = sink, sum = 1), so it sits
in the final normalisation with zero value. Nothing of shape [.., k, c] or [.., H, k] leaves
the kernel.

Backward (custom VJP; Pallas has no autodiff): one kernel with the forward's pass structure
recomputes p = exp(s - lse) from the saved lse, with delta = Σ_d do·out - dlse (this is how
the lse cotangent enters: ds = p · (do·v - delta)), and accumulates dq in registers. The
store's cotangent needs a scatter-add into rows that many queries share (and one query may
pick twice). Pallas Triton's ``atomic_add`` would do it in-kernel in float32, but it has no
bfloat16 form, and its interpreter rule (jax 0.10) refuses a row vector with a column slice
and, on array indices, gathers, adds and sets (losing duplicate ids), so the CPU tests could
not check it. Instead the kernel writes each pick's entry cotangent
(dK + dV rows, float32, [B, Tc, k, c]) and XLA scatter-adds them into a float32 [B, N, c]
accumulator (``.at[].add``: correct for duplicates; on a GPU XLA's scatter uses atomics, so
the summation order, and the last bits, may vary run to run). The trade-off, honestly: those
per-pick rows are exactly the [B, T, k, c] array the fused path otherwise avoids, so the
backward runs over query chunks of Tc queries (``bwd_bytes`` bounds one chunk's rows, default
512 MiB) under a ``lax.scan``: live memory is one chunk's rows plus the accumulator, and the
extra traffic is one float32 write and read per pick and channel (about 4x the forward's
bf16 entry reads). dsink = -Σ_{b,t} exp(sink - lse) · delta is elementwise XLA.

``entry_mass`` is a second Pallas pass from the saved lse: the probability of each pick
summed over heads [B, T, k] (the indexer's KL target), under stop_gradient.

Triton's tiles are powers of two and its dots need every dim >= 16, so the wrapper pads heads,
q's and the value's widths to powers of two >= 16 (zeros; a copy of the store only when its
width c is not a power of two), the picks to a multiple of ``block_k`` (ids -1) and the
queries to a multiple of ``block_t``; padding is sliced off (and its cotangent dropped).
``DEFAULTS`` are not tuned on a device yet; block_k shrinks (64, 32, 16) until the programs
fit the shared memory of the GPU the program is built for (``smem_bytes``, measured on
compiled kernels: DSA's 288-wide latents take 32 picks a step on an H100, V4's 256-wide
entries 64).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsattn import targets
from dsattn.kernels import platform

# block_t: queries per program; block_k: picks per step (FlashMLA's 64, fewer where the
# programs would not fit the GPU's shared memory); bwd_bytes: bound on one backward chunk's
# per-pick cotangent rows
DEFAULTS = dict(block_t=1, block_k=64, num_warps=4, num_stages=2, bwd_bytes=512 << 20)
# Shared memory a program asks for, per channel of the padded entry width, as (c0, c1):
# c0 + c1 x the padded heads, by block_k: the largest request of the forward, backward and
# entry-mass kernels (either stage count, with or without a separate value) in Triton
# compiles for an H100 (heads 12-64, widths 128-1024; `scripts/aot_check.py --tiles`).
SMEM_PER_WIDTH = {64: (452, 6.04), 32: (45, 10.35), 16: (1, 10.0)}

_NT = (((1,), (1,)), ((), ()))  # [M, d] x [N, d] -> [M, N]
_NN = (((1,), (0,)), ((), ()))  # [M, d] x [d, N] -> [M, N]
_TN = (((0,), (0,)), ((), ()))  # [d, M] x [d, N] -> [M, N]


def _acc_dtype(dtype):
    """Scores and accumulators: float32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def _check(q, store, idx, sink, value, who: str):
    """Shapes and dtypes of the contract, with a clear error."""
    if q.ndim != 4 or store.ndim != 3 or idx.ndim != 3:
        raise ValueError(f"{who}: want q [B, T, H, c], store [B, N, c], idx [B, T, k]; got "
                         f"q {q.shape}, store {store.shape}, idx {idx.shape}")
    (b, t, h, c), (bs, n, cs) = q.shape, store.shape
    if bs != b or idx.shape[:2] != (b, t) or cs != c:
        raise ValueError(f"{who}: q {q.shape}, store {store.shape} and idx {idx.shape} "
                         f"disagree on B, T or c")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"{who}: idx must hold integer ids, got {idx.dtype}")
    if n == 0 or idx.shape[2] == 0:
        raise ValueError(f"{who}: nothing to read (store of {n} entries, {idx.shape[2]} "
                         f"picks per query)")
    if sink is not None and sink.shape != (h,):
        raise ValueError(f"{who}: sink must be one logit per head [{h}], got {sink.shape}")
    if value is not None and (value.ndim != 3 or value.shape[:2] != (b, n)):
        raise ValueError(f"{who}: value must be [B, N, dv] = [{b}, {n}, dv], got "
                         f"{value.shape}")


# -- the semantics in plain jnp ------------------------------------------------------------
def _gather(a, idx):
    """a [B, N, w] at the ids idx [B, T, k] (clipped into range) -> [B, T, k, w]."""
    b, t, k = idx.shape
    flat = jnp.clip(idx, 0, a.shape[1] - 1).reshape(b, t * k, 1)
    return jnp.take_along_axis(a, flat, axis=1).reshape(b, t, k, a.shape[-1])


def _reference_scores(q, store, idx, scale):
    """scale · q·entry over the picks [B, T, H, k] in float32 (float64), -inf for no pick."""
    sd = _acc_dtype(q.dtype)
    e = _gather(store, idx).astype(sd)
    s = jnp.einsum("bthc,btkc->bthk", q.astype(sd), e,
                   precision=jax.lax.Precision.HIGHEST) * scale
    picked = (idx >= 0) & (idx < store.shape[1])
    return jnp.where(picked[:, :, None, :], s, -jnp.inf)


def reference(q, store, idx, *, scale, sink=None, value=None):
    """(out [B, T, H, dv] in q's dtype, lse [B, T, H] float32) of the selected-entries read,
    by gathering the picks and one softmax over [picks | sink]."""
    _check(q, store, idx, sink, value, "sparse_attention.reference")
    sd = _acc_dtype(q.dtype)
    s = _reference_scores(q, store, idx, scale)
    k = s.shape[-1]
    if sink is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sink.astype(sd)[:, None], s.shape[:3] + (1,))],
                            axis=-1)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    seen = total > 0
    total = jnp.where(seen, total, 1)  # a row with nothing: p = 0, lse = -inf, no NaN
    lse = jnp.where(seen, jnp.log(total) + m, -jnp.inf)[..., 0]
    v = _gather(store if value is None else value, idx).astype(sd)
    out = jnp.einsum("bthk,btkd->bthd", e[..., :k] / total, v,
                     precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype), lse


def entry_mass_reference(q, store, idx, lse, *, scale):
    """Attention probability of each pick summed over heads [B, T, k] (0 for no pick)."""
    _check(q, store, idx, None, None, "sparse_attention.entry_mass_reference")
    s = _reference_scores(q, store, idx, scale)
    lse = jax.lax.stop_gradient(lse)[..., None]
    p = jnp.exp(jnp.where(s > -jnp.inf, s - jnp.where(jnp.isfinite(lse), lse, 0), -jnp.inf))
    return jax.lax.stop_gradient(p.sum(axis=2))


# -- the kernels ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static shape of one call: entries per row, tiles, and how to compile."""

    n: int  # entries per batch row of the store
    scale: float
    block_t: int
    block_k: int
    n_blocks: int  # pick blocks per query
    chunk: int  # backward: queries per chunk (a multiple of block_t)
    interpret: bool | None
    precision: object
    num_warps: int
    num_stages: int


def _finite(x):
    """x with -inf (a row that read nothing) as 0, so exp(s - x) of masked s stays 0."""
    return jnp.where(jnp.isfinite(x), x, 0)


def _picks(plan, idx_ref, row0, i, j):
    """Query i's pick block j: (which are picks [bk], their rows of the flattened store,
    whose batch row starts at row0)."""
    ids = idx_ref[i, pl.ds(j * plan.block_k, plan.block_k)]
    ok = (ids >= 0) & (ids < plan.n)
    return ok, row0 + jnp.clip(ids, 0, plan.n - 1)


def _dot(a, b, dims, plan, acc):
    return jax.lax.dot_general(a, b, dims, precision=plan.precision,
                               preferred_element_type=acc)


def _scores(plan, q, e, ok, acc):
    """[H, bk] scaled scores of query q [H, c] over the gathered entries e [bk, c]."""
    return jnp.where(ok[None, :], _dot(q, e, _NT, plan, acc) * plan.scale, -jnp.inf)


def _fwd_kernel(q_ref, idx_ref, sink_ref, store_ref, *rest, plan, has_sink, has_value):
    value_ref = rest[0] if has_value else store_ref
    o_ref, lse_ref = rest[-2:]
    heads, acc = q_ref.shape[1], lse_ref.dtype
    row0 = pl.program_id(0) * plan.n  # outside the loops: the interpreter needs it there

    def query(i, _):
        q = q_ref[i]

        def step(j, state):
            m, l, out = state
            ok, rows = _picks(plan, idx_ref, row0, i, j)
            e = store_ref[rows, :]
            v = value_ref[rows, :] if has_value else e
            s = _scores(plan, q, e, ok, acc)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            shift = _finite(m_new)  # no pick yet and no sink: everything stays 0
            p = jnp.exp(s - shift[:, None])
            alpha = jnp.exp(m - shift)
            out = out * alpha[:, None] + _dot(p.astype(v.dtype), v, _NN, plan, acc)
            return m_new, l * alpha + jnp.sum(p, axis=1), out

        if has_sink:  # exp(sink - sink) = 1 in the sum, zero value
            start = (sink_ref[...].astype(acc), jnp.ones((heads,), acc))
        else:
            start = (jnp.full((heads,), -jnp.inf, acc), jnp.zeros((heads,), acc))
        m, l, out = jax.lax.fori_loop(
            0, plan.n_blocks, step, start + (jnp.zeros((heads, o_ref.shape[-1]), acc),))
        seen = l > 0
        l = jnp.where(seen, l, 1)  # nothing read: out is 0 already, lse -inf
        o_ref[i] = (out / l[:, None]).astype(o_ref.dtype)
        lse_ref[i] = jnp.where(seen, m + jnp.log(l), -jnp.inf)

    jax.lax.fori_loop(0, plan.block_t, query, None)


def _bwd_kernel(q_ref, idx_ref, do_ref, lse_ref, delta_ref, store_ref, *rest, plan, has_value):
    value_ref = rest[0] if has_value else store_ref
    dq_ref, dk_ref = rest[-3:-1] if has_value else rest[-2:]
    dv_ref = rest[-1] if has_value else None
    acc = dk_ref.dtype
    row0 = pl.program_id(0) * plan.n

    def query(i, _):
        q, do = q_ref[i], do_ref[i]
        lse, delta = _finite(lse_ref[i]), delta_ref[i]

        def step(j, dq):
            ok, rows = _picks(plan, idx_ref, row0, i, j)
            e = store_ref[rows, :]
            v = value_ref[rows, :] if has_value else e
            p = jnp.exp(_scores(plan, q, e, ok, acc) - lse[:, None])  # [H, bk]; 0 off picks
            ds = p * (_dot(do, v, _NT, plan, acc) - delta[:, None])
            dk = _dot(ds.astype(q.dtype), q, _TN, plan, acc) * plan.scale  # [bk, c]
            dv = _dot(p.astype(do.dtype), do, _TN, plan, acc)  # [bk, dv]
            picks = pl.ds(j * plan.block_k, plan.block_k)
            if has_value:
                dk_ref[i, picks, :] = dk
                dv_ref[i, picks, :] = dv
            else:  # K = V: one row per pick
                dk_ref[i, picks, :] = dk + dv
            return dq + _dot(ds.astype(e.dtype), e, _NN, plan, acc) * plan.scale

        dq = jax.lax.fori_loop(0, plan.n_blocks, step, jnp.zeros(q.shape, acc))
        dq_ref[i] = dq.astype(dq_ref.dtype)

    jax.lax.fori_loop(0, plan.block_t, query, None)


def _mass_kernel(q_ref, idx_ref, lse_ref, store_ref, mass_ref, *, plan, heads):
    acc = mass_ref.dtype
    row0 = pl.program_id(0) * plan.n
    real = jax.lax.broadcasted_iota(jnp.int32, (q_ref.shape[1], 1), 0) < heads

    def query(i, _):
        q, lse = q_ref[i], _finite(lse_ref[i])

        def step(j, _):
            ok, rows = _picks(plan, idx_ref, row0, i, j)
            p = jnp.exp(_scores(plan, q, store_ref[rows, :], ok, acc) - lse[:, None])
            mass_ref[i, pl.ds(j * plan.block_k, plan.block_k)] = jnp.sum(
                jnp.where(real, p, 0), axis=0)

        jax.lax.fori_loop(0, plan.n_blocks, step, None)

    jax.lax.fori_loop(0, plan.block_t, query, None)


def _per_query(plan, tail):
    """BlockSpec of a per-query array [B, T, *tail]: a program's block_t queries."""
    return pl.BlockSpec((None, plan.block_t) + tail,
                        lambda b, t: (b, t) + (0,) * len(tail))


def _call(plan, kernel, batch, queries, in_specs, outs, name):
    """pallas_call over (batch row, query block); ``outs``: (per-query tail, dtype) pairs."""
    return platform.pallas_call(
        kernel, name=name,
        grid=(batch, queries // plan.block_t),
        in_specs=in_specs,
        out_specs=[_per_query(plan, tail) for tail, _ in outs],
        out_shape=[jax.ShapeDtypeStruct((batch, queries) + tail, dt) for tail, dt in outs],
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=plan.interpret,
    )


def _forward(plan, q, store, idx, sink, value):
    b, t, heads, c = q.shape
    acc = _acc_dtype(q.dtype)
    dv = c if value is None else value.shape[-1]
    specs = [_per_query(plan, (heads, c)), _per_query(plan, (idx.shape[-1],)),
             pl.BlockSpec((heads,), lambda b, t: (0,)), pl.no_block_spec]
    args = [q, idx, jnp.zeros((heads,), acc) if sink is None else sink, store]
    if value is not None:
        specs.append(pl.no_block_spec)
        args.append(value)
    kernel = functools.partial(_fwd_kernel, plan=plan, has_sink=sink is not None,
                               has_value=value is not None)
    return _call(plan, kernel, b, t, specs, [((heads, dv), q.dtype), ((heads,), acc)],
                 "sparse_attention_fwd")(*args)


def _chunk_pad(x, t_pad, fill=0):
    return jnp.pad(x, [(0, 0), (0, t_pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)


def _backward(plan, res, cts):
    q, store, idx, sink, value, out, lse = res
    do, dlse = cts
    b, t, heads, c = q.shape
    acc = lse.dtype
    # d lse / d s = p: an lse cotangent shifts every pick's ds = p·(do·v - Σ do·out + dlse)
    delta = jnp.sum(do.astype(acc) * out.astype(acc), axis=-1) - dlse
    n_chunks = -(-t // plan.chunk)
    pad = n_chunks * plan.chunk - t
    chunked = [_chunk_pad(q, pad), _chunk_pad(idx, pad, -1), _chunk_pad(do, pad),
               _chunk_pad(lse, pad), _chunk_pad(delta, pad)]
    kp, dv = idx.shape[-1], do.shape[-1]
    specs = [_per_query(plan, (heads, c)), _per_query(plan, (kp,)),
             _per_query(plan, (heads, dv)), _per_query(plan, (heads,)),
             _per_query(plan, (heads,)), pl.no_block_spec]
    outs = [((heads, c), q.dtype), ((kp, c), acc)]
    if value is not None:
        specs.append(pl.no_block_spec)
        outs.append(((kp, dv), acc))
    kernel = functools.partial(_bwd_kernel, plan=plan, has_value=value is not None)
    call = _call(plan, kernel, b, plan.chunk, specs, outs, "sparse_attention_bwd")
    n_rows = store.shape[0]

    def chunk(sums, i):
        blk = [jax.lax.dynamic_slice_in_dim(x, i * plan.chunk, plan.chunk, axis=1)
               for x in chunked]
        dq, *rows = call(*blk, store, *(() if value is None else (value,)))
        ids = blk[1]
        # each pick's row of the flattened store; no pick -> out of range, dropped
        dest = jnp.where((ids >= 0) & (ids < plan.n),
                         jnp.arange(b, dtype=ids.dtype)[:, None, None] * plan.n + ids, n_rows)
        sums = tuple(s.at[dest.reshape(-1)].add(r.reshape(-1, r.shape[-1]), mode="drop")
                     for s, r in zip(sums, rows))
        return sums, dq

    zeros = (jnp.zeros(store.shape, acc),) + (() if value is None
                                               else (jnp.zeros(value.shape, acc),))
    sums, dq = jax.lax.scan(chunk, zeros, jnp.arange(n_chunks))
    dq = jnp.moveaxis(dq, 0, 1).reshape(b, n_chunks * plan.chunk, heads, c)[:, :t]
    dsink = None
    if sink is not None:
        dsink = -jnp.sum(jnp.exp(sink.astype(acc) - lse) * delta, axis=(0, 1)).astype(sink.dtype)
    dvalue = None if value is None else sums[1].astype(value.dtype)
    return dq, sums[0].astype(store.dtype), None, dsink, dvalue


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan, q, store, idx, sink, value):
    """The padded read: q [B, Tp, Hp, cp], store [B*N, cp] (rows of all batch rows), idx
    [B, Tp, kp], sink [Hp] or None, value [B*N, dvp] or None -> (out, lse)."""
    return tuple(_forward(plan, q, store, idx, sink, value))


def _fused_fwd(plan, q, store, idx, sink, value):
    out, lse = _forward(plan, q, store, idx, sink, value)
    return (out, lse), (q, store, idx, sink, value, out, lse)


_fused.defvjp(_fused_fwd, _backward)


def _tile(n: int) -> int:
    """A Triton tile dim: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, pl.next_power_of_2(n))


def _pad_to(x, axis: int, size: int, fill=0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return x if size == x.shape[axis] else jnp.pad(x, widths, constant_values=fill)


def smem_bytes(heads: int, width: int, value_width: int | None, block_k: int,
               num_stages: int) -> int:
    """Shared memory (bytes) a program of the kernels asks for (`SMEM_PER_WIDTH`'s model; the
    value's width and the stage count stay inside its margin)."""
    c0, c1 = SMEM_PER_WIDTH[block_k]
    return int(_tile(width) * (c0 + c1 * _tile(heads)))


def fitting_block_k(heads: int, width: int, value_width: int | None = None) -> int:
    """The most picks per step (`DEFAULTS`' block_k or fewer) whose programs fit the shared
    memory of the GPU the program is built for (dsattn.targets)."""
    limit = targets.shared_memory()
    for bk in (DEFAULTS["block_k"], 32, 16):
        if smem_bytes(heads, width, value_width, bk, DEFAULTS["num_stages"]) <= limit:
            return bk
    return 16  # nothing smaller: the compile will tell


def _prepare(q, store, idx, *, scale, block_t, block_k, interpret, precision, bwd_bytes,
             num_warps, num_stages, value_width):
    """(plan, padded q, flattened store, padded idx)."""
    b, t, h, c = q.shape
    n, k = store.shape[1], idx.shape[2]
    bt = DEFAULTS["block_t"] if block_t is None else block_t
    bk = fitting_block_k(h, c, value_width) if block_k is None else block_k
    if bt < 1 or bk < 16 or bk & (bk - 1):
        raise ValueError(f"sparse_attention: block_t={bt} must be >= 1 and block_k={bk} a "
                         f"power of two >= 16 (Triton tiles)")
    bk = min(bk, _tile(k))
    n_t, n_blocks = -(-t // bt), -(-k // bk)
    width = _tile(c)
    row_bytes = b * n_blocks * bk * (width + (_tile(value_width) if value_width else 0)) * 4
    budget = DEFAULTS["bwd_bytes"] if bwd_bytes is None else bwd_bytes
    chunk = bt * max(1, min(n_t, budget // (row_bytes * bt)))
    plan = _Plan(n=n, scale=float(scale), block_t=bt, block_k=bk, n_blocks=n_blocks,
                 chunk=chunk, interpret=interpret, precision=precision,
                 num_warps=DEFAULTS["num_warps"] if num_warps is None else num_warps,
                 num_stages=DEFAULTS["num_stages"] if num_stages is None else num_stages)
    qp = _pad_to(_pad_to(_pad_to(q, 1, n_t * bt), 2, _tile(h)), 3, width)
    flat = _pad_to(store, 2, width).reshape(b * n, width)
    idx = _pad_to(_pad_to(idx.astype(jnp.int32), 1, n_t * bt, -1), 2, n_blocks * bk, -1)
    return plan, qp, flat, idx


def attention(q, store, idx, *, scale, sink=None, value=None, block_t: int | None = None,
              block_k: int | None = None, interpret: bool | None = None, precision=None,
              bwd_bytes: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None):
    """(out [B, T, H, dv] in q's dtype, lse [B, T, H] float32) of the selected-entries read
    (module docstring), by the fused Pallas kernels; differentiable in q, store, sink and
    value (custom VJP), with a cotangent on lse honoured.

    q [B, T, H, c]; store [B, N, c]; idx int [B, T, k] (ids outside [0, N): no pick); sink
    [H] or None; value [B, N, dv] or None (then V = K = the entry). q, store and value share
    one dtype. ``block_t`` queries per program, ``block_k`` picks per step (a power of two
    >= 16), ``bwd_bytes`` bounds one backward chunk's per-pick rows; ``precision`` of the
    in-kernel dots (None: the backend's default, TF32 for float32 on a GPU).
    """
    _check(q, store, idx, sink, value, "sparse_attention.attention")
    if store.dtype != q.dtype or (value is not None and value.dtype != q.dtype):
        raise ValueError(f"sparse_attention.attention: q, store and value must share a dtype "
                         f"(Triton dots), got {q.dtype}, {store.dtype}, "
                         f"{None if value is None else value.dtype}")
    b, t, h, _ = q.shape
    dv = q.shape[-1] if value is None else value.shape[-1]
    plan, qp, flat, idx = _prepare(q, store, idx, scale=scale, block_t=block_t,
                                   block_k=block_k, interpret=interpret, precision=precision,
                                   bwd_bytes=bwd_bytes, num_warps=num_warps,
                                   num_stages=num_stages, value_width=dv if value is not None
                                   else 0)
    heads = qp.shape[2]
    if sink is not None:
        sink = _pad_to(sink, 0, heads)
    if value is not None:
        value = _pad_to(value, 2, _tile(dv)).reshape(flat.shape[0], -1)
    out, lse = _fused(plan, qp, flat, idx, sink, value)
    return out[:, :t, :h, :dv], lse[:, :t, :h]


def entry_mass(q, store, idx, lse, *, scale, block_t: int | None = None,
               block_k: int | None = None, interpret: bool | None = None, precision=None,
               num_warps: int | None = None, num_stages: int | None = None):
    """The attention probability of each pick summed over heads, float32 [B, T, k] (0 where
    no pick), from the read's saved lse [B, T, H]: a second Pallas pass over the picks (the
    indexer's KL target; no gradient). Arguments as ``attention``'s."""
    _check(q, store, idx, None, None, "sparse_attention.entry_mass")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"sparse_attention.entry_mass: lse must be [B, T, H] = "
                         f"{q.shape[:3]}, got {lse.shape}")
    q, store, lse = (jax.lax.stop_gradient(x) for x in (q, store, lse))
    b, t, h, _ = q.shape
    k = idx.shape[2]
    plan, qp, flat, idx = _prepare(q, store, idx, scale=scale, block_t=block_t,
                                   block_k=block_k, interpret=interpret, precision=precision,
                                   bwd_bytes=None, num_warps=num_warps,
                                   num_stages=num_stages, value_width=0)
    heads, kp = qp.shape[2], idx.shape[2]
    lse = _pad_to(_pad_to(lse.astype(_acc_dtype(q.dtype)), 1, qp.shape[1]), 2, heads)
    specs = [_per_query(plan, (heads, qp.shape[3])), _per_query(plan, (kp,)),
             _per_query(plan, (heads,)), pl.no_block_spec]
    kernel = functools.partial(_mass_kernel, plan=plan, heads=h)
    (mass,) = _call(plan, kernel, b, qp.shape[1], specs, [((kp,), lse.dtype)],
                    "sparse_attention_mass")(qp, idx, lse, flat)
    return mass[:, :t, :k]
