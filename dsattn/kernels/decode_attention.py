"""One decode step's V4-family sink attention, read straight from the caches.

    s_j   = scale · q[b, h] · e_j     over (a) the window's ring slots, (b) the picked entries
    lse   = log(Σ_j exp(s_j) + exp(sink[h]))
    out   = Σ_j exp(s_j - lse) · e_j                       (K = V = the entry, all heads)

(a) ring slot j is read when its position p_j satisfies q_pos - window < p_j <= q_pos
(``ring.window_mask``; -1 = empty slot, so a row whose window is not yet full reads only
what it holds); (b) pick id i of row b is read when 0 <= i < length[b] (an id -1, or past the
row's entries, is no pick), from the paged cache through the row's page table. Both are read
in their stored cache format (``dsattn.cache.formats.FORMATS``: element and scale codecs)
and dequantized inside the kernel. Returns (out [B, H, c] in q's dtype, lse [B, H] float32;
scores, partials and lse are float64 for float64 inputs).

- ``reference``: the same from today's reads (``paged.gather``, ``ring.read``,
  ``ring.window_mask``) and one plain-jnp softmax: the oracle. tests/test_decode_attention.py
  checks that it equals ``attention.reference.block_attention`` over the parts ``V4Attention.extend``
  builds (ring read before the write + the step's own key), and the kernel against it.
- ``attention``: the Pallas kernel (Triton-style ``jax.experimental.pallas``; interpret=True
  on CPU; it lowers for CUDA). Forward only (decode needs no gradient).

How a layer calls it: `attention.impl=pallas_gpu` (kernels/pallas_reads.py) routes a V4
family decode step here from the adapter (attention/fused.py): after ``ring.write`` of the
step's key (the ring then holds exactly the window q_pos - W + 1 .. q_pos that
``ring.local_keys`` builds before the write; the layer passes it as ``Window.ring``) and the
source's append and selection, ``attention(q[:, 0], positions[:, 0], ring, the paged cache
(own or borrowed), idx, window=W, scale, sink)`` with idx the selection's ids where ``ok``
(else -1); HCA passes every visible id. Then the inverse RoPE and the grouped output
projection as before. It needs of the caches only the ring's stored arrays and positions and
one paged field's pool and page table (``paged.pool``).

Kernel: grid (batch row, split). Splits 0..S-1 each walk a contiguous share of the picks,
``block_k`` at a time (flash-decoding: split-K over the picks, each split an online softmax
with its partial (out, lse)); split S walks the ring. A block's rows are found in-kernel
(id -> page table -> pool row; slot -> ring row), loaded once for all heads (heads are the M
dim of the [H, c] x [c, bk] score dot and the [H, bk] x [bk, c] mixing dot) and dequantized
chunk by chunk: an entry's stored arrays are cut into power-of-two column chunks (Triton
tiles; a packed E2M1 chunk is read twice, its low then its high nibbles), each chunk's scale
columns broadcast over it, and q is permuted in the wrapper so each chunk meets its own
channels (the output is permuted back). The S + 1 partials and the sink merge in XLA by
their lse. On a GPU this one launch replaces today's gather + dequantize + two score
products + softmax + mix (and the ring's decode): what the picks and the window cost is one
read of their stored bytes. Its speed is not measured (no GPU in this session).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsattn.cache import formats, paged, ring as ring_lib

DEFAULTS = dict(block_k=64, splits=4, num_warps=4, num_stages=2)
_NT = (((1,), (1,)), ((), ()))  # [M, d] x [N, d] -> [M, N]
_NN = (((1,), (0,)), ((), ()))  # [M, d] x [d, N] -> [M, N]


def _check(q, q_pos, ring, cache, idx, name, sink):
    if q.ndim != 3 or idx.ndim != 2 or q_pos.shape != q.shape[:1]:
        raise ValueError(f"decode_attention: want q [B, H, c], q_pos [B], idx [B, k]; got "
                         f"q {q.shape}, q_pos {q_pos.shape}, idx {idx.shape}")
    b, h, c = q.shape
    if idx.shape[0] != b or ring.pos.shape[0] != b or cache.length.shape[-1] != b:
        raise ValueError("decode_attention: q, idx, the ring and the paged cache disagree on B")
    if cache.fields[name].width != c:
        raise ValueError(f"decode_attention: field {name!r} has width "
                         f"{cache.fields[name].width}, q has {c}")
    if sink is not None and sink.shape != (h,):
        raise ValueError(f"decode_attention: sink must be [{h}], got {sink.shape}")


# -- the semantics from today's reads --------------------------------------------------------
def reference(q, q_pos, ring, cache, idx, *, window: int, scale: float, sink=None,
              name: str = "entry"):
    """(out [B, H, c] in q's dtype, lse [B, H] float32) from ``paged.gather`` of the picks
    and ``ring.read`` of the window (module docstring)."""
    _check(q, q_pos, ring, cache, idx, name, sink)
    sd = jnp.promote_types(q.dtype, jnp.float32)
    picked, got = cache.gather(name, idx, q.dtype)  # [B, k, c]
    keys, key_pos = ring_lib.read(ring, q.dtype)  # [B, W, c]
    seen = ring_lib.window_mask(key_pos, q_pos[:, None], window)[:, 0]
    entries = jnp.concatenate([picked, keys], axis=1).astype(sd)
    mask = jnp.concatenate([got, seen], axis=1)
    s = jnp.einsum("bhc,bsc->bhs", q.astype(sd), entries,
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    if sink is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sink.astype(sd)[:, None], s.shape[:2] + (1,))],
                            axis=-1)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None])[..., :entries.shape[1]]
    out = jnp.einsum("bhs,bsc->bhc", p, entries, precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype), lse


# -- how the kernel reads a format -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Chunk:
    """A power-of-two run of stored columns of one array, read as one tile."""

    array: int  # index into the format's kernel arrays (values, scale, rope)
    lo: int
    n: int
    nibble: int | None  # packed E2M1: 0 the low nibbles, 1 the high; None: not packed
    scale_cols: int  # stored columns per scale (0: not scaled)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A format's entry as the kernel reads it: its arrays (names), chunks, the entry channel
    each chunk column holds (``perm``) and the spec (for the codecs)."""

    names: tuple
    chunks: tuple
    perm: tuple
    spec: formats.FormatSpec


def _pow2_runs(n: int):
    """(lo, size) runs of powers of two covering 0..n, largest first."""
    runs, lo = [], 0
    for bit in reversed(range(n.bit_length())):
        if n >> bit & 1:
            runs.append((lo, 1 << bit))
            lo += 1 << bit
    return runs


def _layout(fmt: str, width: int, rope: int) -> _Layout:
    sp = formats.spec(fmt)
    if not sp.block:
        return _Layout(("v",), tuple(_Chunk(0, lo, n, None, 0) for lo, n in _pow2_runs(width)),
                       tuple(range(width)), sp)
    body = width - rope if sp.needs_rope_split else width
    per, chunks, perm = sp.per_item, [], []
    nibbles = range(per) if per > 1 else (None,)
    for nib in nibbles:
        for lo, n in _pow2_runs(body // per):
            chunks.append(_Chunk(0, lo, n, nib, sp.block // per))
            perm += [(lo + i) * per + (nib or 0) for i in range(n)]
    names = ("q", "scale")
    if sp.needs_rope_split:
        names += ("rope",)
        for lo, n in _pow2_runs(rope):
            chunks.append(_Chunk(2, lo, n, None, 0))
            perm += [body + lo + i for i in range(n)]
    return _Layout(names, tuple(chunks), tuple(perm), sp)


def _kernel_arrays(layout: _Layout, stored: dict, fmt: str):
    """The stored arrays as the kernel reads them, rows flattened: floats by a bitcast,
    scales the kernel takes as bytes as uint8."""
    a = formats.as_floats(fmt, {k: v[...] for k, v in stored.items()})
    out = []
    for k in layout.names:
        x = a[k]
        if k == "scale" and layout.spec.scale_type.kernel_bytes:
            x = jax.lax.bitcast_convert_type(x, jnp.uint8)
        out.append(x.reshape((-1,) + x.shape[2:]))
    return out


def _tile(layout: _Layout, refs, rows, chunk: _Chunk, dtype):
    """One chunk of the entries at ``rows`` [bk], dequantized: [bk, chunk.n] in ``dtype``."""
    sp = layout.spec
    x = refs[chunk.array][rows, pl.ds(chunk.lo, chunk.n)]
    if chunk.nibble is not None:
        x = formats.e2m1_values((x >> (4 * chunk.nibble)) & 0xF)
    elif chunk.array == 0 and sp.element is not None:
        x = sp.element.decode(x)
    if chunk.scale_cols:
        col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) // chunk.scale_cols
        first = chunk.lo // chunk.scale_cols
        scale = jnp.zeros(x.shape, jnp.float32)
        for i in range(chunk.n // chunk.scale_cols):
            s = sp.scale_type.to_f32(refs[1][rows, pl.ds(first + i, 1)])  # [bk, 1]
            scale = jnp.where(col == i, s, scale)
        x = x.astype(jnp.float32) * scale
    return x.astype(dtype)


@dataclasses.dataclass(frozen=True)
class _Plan:
    scale: float
    window: int
    slots: int  # ring slots W
    page_size: int
    n_slots: int  # page slots per row
    block_k: int
    blocks_per_split: int
    ring_blocks: int
    splits: int
    interpret: bool
    precision: object
    num_warps: int
    num_stages: int
    acc: object  # accumulators: float32, float64 for float64 inputs


def _kernel(q_main_ref, q_win_ref, qpos_ref, idx_ref, len_ref, pt_ref, rpos_ref, *rest,
            plan, main, win):
    nm, nw = len(main.names), len(win.names)
    main_refs, win_refs = rest[:nm], rest[nm:nm + nw]
    o_ref, lse_ref = rest[nm + nw:]
    b, j = pl.program_id(0), pl.program_id(1)
    acc = plan.acc
    bk = plan.block_k

    def walk(layout, refs, q_ref, n_blocks, locate):
        q = q_ref[...]
        heads = q.shape[0]

        def step(i, state):
            m, l, outs = state
            ok, rows = locate(i)
            tiles = [_tile(layout, refs, rows, ch, q.dtype) for ch in layout.chunks]
            s, off = 0.0, 0
            for ch, t in zip(layout.chunks, tiles):
                s = s + jax.lax.dot_general(q_ref[:, pl.ds(off, ch.n)], t, _NT,
                                            precision=plan.precision,
                                            preferred_element_type=acc)
                off += ch.n
            s = jnp.where(ok[None, :], s * plan.scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0)
            p = jnp.exp(s - shift[:, None])
            alpha = jnp.exp(m - shift)
            outs = tuple(o * alpha[:, None] + jax.lax.dot_general(
                p.astype(t.dtype), t, _NN, precision=plan.precision,
                preferred_element_type=acc) for o, t in zip(outs, tiles))
            return m_new, l * alpha + jnp.sum(p, axis=1), outs

        start = (jnp.full((heads,), -jnp.inf, acc), jnp.zeros((heads,), acc),
                 tuple(jnp.zeros((heads, ch.n), acc) for ch in layout.chunks))
        m, l, outs = jax.lax.fori_loop(0, n_blocks, step, start)
        seen = l > 0
        l = jnp.where(seen, l, 1)
        off = 0
        for ch, o in zip(layout.chunks, outs):
            o_ref[:, pl.ds(off, ch.n)] = o / l[:, None]
            off += ch.n
        lse_ref[...] = jnp.where(seen, m + jnp.log(l), -jnp.inf)

    length = len_ref[b]

    def pick_block(i):  # ids -> page table -> pool rows
        ids = idx_ref[pl.ds((j * plan.blocks_per_split + i) * bk, bk)]
        ok = (ids >= 0) & (ids < length)
        safe = jnp.where(ok, ids, 0)
        slot = jnp.minimum(jax.lax.div(safe, jnp.int32(plan.page_size)), plan.n_slots - 1)
        page = jnp.maximum(pt_ref[b, slot], 0)
        return ok, page * plan.page_size + jax.lax.rem(safe, jnp.int32(plan.page_size))

    qpos = qpos_ref[b]

    def ring_block(i):  # ring slots -> ring rows
        slot = i * bk + jax.lax.iota(jnp.int32, bk)
        pos = rpos_ref[pl.ds(i * bk, bk)]
        ok = (slot < plan.slots) & (pos >= 0) & (pos <= qpos) & (pos > qpos - plan.window)
        return ok, b * plan.slots + jnp.minimum(slot, plan.slots - 1)

    @pl.when(j < plan.splits)
    def _picks():
        walk(main, main_refs, q_main_ref, plan.blocks_per_split, pick_block)

    @pl.when(j == plan.splits)
    def _window():
        walk(win, win_refs, q_win_ref, plan.ring_blocks, ring_block)


def _pow2_tile(n: int) -> int:
    return max(16, pl.next_power_of_2(n))


def attention(q, q_pos, ring, cache, idx, *, window: int, scale: float, sink=None,
              name: str = "entry", block_k: int | None = None, splits: int | None = None,
              interpret: bool = False, precision=None, num_warps: int | None = None,
              num_stages: int | None = None):
    """(out [B, H, c] in q's dtype, lse [B, H] float32) of one decode step (module
    docstring) by the Pallas kernel. q [B, H, c] at positions q_pos int [B]; ``ring`` a
    `ring.Ring` (after this step's write), ``cache`` a `paged.PagedCache` whose field
    ``name`` holds the entries, idx int [B, k] pick ids (-1: none). ``block_k`` (a power of
    two >= 16) entries per step; ``splits`` programs per row share the picks."""
    _check(q, q_pos, ring, cache, idx, name, sink)
    bsz, h, c = q.shape
    fld = cache.fields[name]
    main, win = _layout(fld.fmt, c, fld.rope), _layout(ring.fmt, c, ring.rope)
    pool, table = paged.pool(cache, name)
    main_arrays = _kernel_arrays(main, pool, fld.fmt)
    win_arrays = _kernel_arrays(win, ring.kv, ring.fmt)
    bk = DEFAULTS["block_k"] if block_k is None else block_k
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"decode_attention: block_k={bk} must be a power of two >= 16")
    k, w_slots = idx.shape[1], ring.pos.shape[1]
    bk = min(bk, _pow2_tile(max(k, w_slots)))
    n_blocks = -(-k // bk)
    n_splits = max(1, min(DEFAULTS["splits"] if splits is None else splits, n_blocks))
    per_split = -(-n_blocks // n_splits)
    ring_blocks = -(-w_slots // bk)
    hp = _pow2_tile(h)
    plan = _Plan(scale=float(scale), window=int(window), slots=w_slots,
                 page_size=cache.page_size, n_slots=table.shape[1], block_k=bk,
                 blocks_per_split=per_split, ring_blocks=ring_blocks, splits=n_splits,
                 interpret=interpret, precision=precision,
                 acc=jnp.promote_types(q.dtype, jnp.float32),
                 num_warps=DEFAULTS["num_warps"] if num_warps is None else num_warps,
                 num_stages=DEFAULTS["num_stages"] if num_stages is None else num_stages)
    qh = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
    q_main, q_win = qh[..., np.array(main.perm)], qh[..., np.array(win.perm)]
    idx = jnp.pad(idx.astype(jnp.int32), ((0, 0), (0, n_splits * per_split * bk - k)),
                  constant_values=-1)
    rpos = jnp.pad(ring.pos, ((0, 0), (0, ring_blocks * bk - w_slots)), constant_values=-1)
    row = lambda *tail: pl.BlockSpec((None,) + tail, lambda b, j: (b,) + (0,) * len(tail))  # noqa: E731
    in_specs = ([row(hp, c), row(hp, c), pl.no_block_spec, row(idx.shape[1]), pl.no_block_spec,
                 pl.no_block_spec, row(rpos.shape[1])]
                + [pl.no_block_spec] * (len(main_arrays) + len(win_arrays)))
    out, lse = pl.pallas_call(
        functools.partial(_kernel, plan=plan, main=main, win=win),
        grid=(bsz, n_splits + 1),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, hp, c), lambda b, j: (b, j, 0, 0)),
                   pl.BlockSpec((None, None, hp), lambda b, j: (b, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((bsz, n_splits + 1, hp, c), plan.acc),
                   jax.ShapeDtypeStruct((bsz, n_splits + 1, hp), plan.acc)],
        compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                             num_stages=plan.num_stages),
        interpret=interpret, name="decode_attention",
    )(q_main, q_win, jnp.asarray(q_pos, jnp.int32), idx, cache.length.reshape(-1), table,
      rpos, *main_arrays, *win_arrays)
    # each part's channels back in entry order, then the partials and the sink merged by lse
    out = jnp.concatenate([out[:, :n_splits][..., np.argsort(main.perm)],
                           out[:, n_splits:][..., np.argsort(win.perm)]], axis=1)[:, :, :h]
    lse = lse[:, :, :h]
    parts = lse if sink is None else jnp.concatenate(
        [lse, jnp.broadcast_to(sink.astype(plan.acc), (bsz, 1, h))], axis=1)
    total = jax.nn.logsumexp(parts, axis=1)
    weight = jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0)[:, None])
    return jnp.sum(weight[..., None] * out, axis=1).astype(q.dtype), total
