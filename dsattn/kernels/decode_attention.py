"""One decode step's attention over entries every head reads whole as key and value (the V4
family's window and compressed entries, MLA's absorbed latents, DSA's picked tokens), read
straight from the caches in their stored formats.

    s_j   = scale · q[b, h] · e_j     over the entries j of every part
    lse   = log(Σ_j exp(s_j) [+ exp(sink[h])])
    out   = Σ_j exp(s_j - lse) · e_j[:value_dim]           (K = V = the entry, all heads)

A read is a few parts under one softmax, each one of two kinds:

- `Paged`: entries in the pages of a pool, found through each row's page table: the ids a
  selection picks (`picks`: V4's CSA and V4.1's shared picks, DSA's tokens), or every id
  below a bound (`visible`: HCA's complete entries; `prefix`: a contiguous cache's slots
  before the step, MLA's latents, as one page per row). An id is read when 0 <= id <
  ``limit[b]``; -1 and ids past it are no pick, so k may exceed the entries there are.
- `Own`: each row's own few entries with their positions: the window's ring (`window`; read
  when q_pos - window < p <= q_pos, -1 an empty slot, so a window not yet full reads only
  what it holds) or the step's own token as computed (`values`).

Returns (out [B, H, value_dim] in q's dtype, lse [B, H]: float32, float64 for float64 inputs).

- ``reference``: the same by gathering and decoding every part in XLA (``formats.decode``)
  and one plain softmax: the oracle. tests/test_decode_attention.py checks it against
  today's reads (``paged.gather``, ``ring.read``, a contiguous cache decoded whole) and
  ``attention.reference.block_attention``, and the kernel against it.
- ``attention``: the Pallas kernel (Triton-style ``jax.experimental.pallas``; interpret=True
  on CPU; it lowers for CUDA). Forward only (decode needs no gradient).

Kernel: grid (batch row, program, block of heads). Each part has its programs: a `Paged`
part of picks splits its ids into equal shares; a `Paged` part read by bound shares the
row's live blocks (ceil(limit / block_k), known only at run time: the walk's trip count is
dynamic, so a row reads what its context holds, not the cache's capacity); an `Own` part is
one program. Flash-decoding: a program walks its share ``block_k`` entries at a time with
an online softmax and writes its partial (out in q's dtype, lse); the partials and the sink
merge in XLA by their lse. A block's rows are found in the kernel (id -> page table -> pool
row; slot -> row), loaded once for the program's block of heads (up to `head_block`: the M
dim of the [H, c] x [c, bk] score dot and the [H, bk] x [bk, c] mixing dot) and
dequantized chunk by chunk: an entry's stored arrays are cut into power-of-two column
chunks (Triton tiles; a packed E2M1 chunk is read twice, its low then its high nibbles),
each chunk's scale columns broadcast over it; a chunk's entry channels are an arithmetic
progression (stride 2 for a nibble), so it meets q's channels and writes its output's by
strided loads and stores, with no permutation around the kernel. A chunk holding no value
channel (MLA's rotary dims) is not mixed. On a GPU this one launch replaces the gather, the
dequantize, two score products, the softmax and the mix: a step's entries cost one read of
their stored bytes per block of heads. Its speed is not measured (no GPU in the sessions
that wrote it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsattn.cache import formats, paged
from dsattn.kernels import platform

DEFAULTS = dict(
    block_k=64,  # entries per step (fewer when a tile would pass tile_bytes)
    tile_bytes=64 * 1024,  # one [block_k, c] tile in q's dtype: Triton keeps it on chip
    # Programs per row of a part of picks or read by bound: enough that the batch's fill
    # `programs` (two per SM of an H100/H200), few enough that the partials they write stay
    # under 1 / `partial_share` of the entries the part can hold, never more than its blocks.
    programs=264, partial_share=4,
    # heads a program reads the entries for: its [heads, c] accumulators stay in registers
    # (more heads: more programs, each reading the entries again)
    head_block=16,
    num_warps=4, num_stages=2)
_NT = (((1,), (1,)), ((), ()))  # [M, d] x [N, d] -> [M, N]
_NN = (((1,), (0,)), ((), ()))  # [M, d] x [d, N] -> [M, N]


# -- what a step reads ---------------------------------------------------------------------
@struct.dataclass
class Paged:
    """Entries in the pages of a pool: ``stored`` the format's arrays [pages, page_size,
    ...], ``table`` int [B, slots] the page of each row's slot (id // page_size), ``limit``
    int [B] (ids read are below it), ``ids`` int [B, k] the ids to read (-1: none), or None:
    every id below the limit."""

    stored: dict
    table: jax.Array
    limit: jax.Array
    ids: jax.Array | None
    fmt: str = struct.field(pytree_node=False)
    rope: int = struct.field(pytree_node=False)

    @property
    def page_size(self) -> int:
        return next(iter(self.stored.values())).shape[1]


@struct.dataclass
class Own:
    """Each row's own entries: ``stored`` the format's arrays [B, n, ...], ``pos`` int
    [B, n] (-1: empty); read when pos <= q_pos and, with a ``window``, pos > q_pos - window."""

    stored: dict
    pos: jax.Array
    fmt: str = struct.field(pytree_node=False)
    rope: int = struct.field(pytree_node=False)
    window: int | None = struct.field(pytree_node=False)


def picks(cache: paged.PagedCache, idx, name: str = "entry") -> Paged:
    """The entries ``idx`` [B, k] (-1: none) of a paged cache's field."""
    pages, table = paged.pool(cache, name)
    f = cache.fields[name]
    return Paged(pages, table, cache.length.reshape(-1), jnp.asarray(idx, jnp.int32), f.fmt,
                 f.rope)


def visible(cache: paged.PagedCache, q_pos, stride: int, name: str = "entry") -> Paged:
    """Every entry of a paged cache's field complete at q_pos [B] (id < (q_pos + 1) //
    stride)."""
    pages, table = paged.pool(cache, name)
    f = cache.fields[name]
    limit = jnp.minimum(cache.length.reshape(-1), (jnp.asarray(q_pos) + 1) // stride)
    return Paged(pages, table, limit.astype(jnp.int32), None, f.fmt, f.rope)


def prefix(stored: dict, fmt: str, rope: int, count) -> Paged:
    """Slots 0 .. count[b] - 1 of a contiguous cache (``stored`` [B, L, ...]): one page per
    row."""
    rows = jnp.asarray(count).shape[0]
    return Paged(stored, jnp.arange(rows, dtype=jnp.int32)[:, None],
                 jnp.asarray(count, jnp.int32), None, fmt, rope)


def window(ring, size: int) -> Own:
    """A ring's slots (`cache.ring.Ring`, after the step's write) inside a window of
    ``size`` positions."""
    return Own(ring.kv, ring.pos, ring.fmt, ring.rope, int(size))


def values(v, pos) -> Own:
    """Entries as computed, v [B, n, c] at positions pos [B, n] (-1: none)."""
    return Own({"v": v}, pos, "native", 0, None)


def _check(q, q_pos, parts, sink):
    if q.ndim != 3 or q_pos.shape != q.shape[:1]:
        raise ValueError(f"decode_attention: want q [B, H, c] and q_pos [B]; got q {q.shape},"
                         f" q_pos {q_pos.shape}")
    if not parts:
        raise ValueError("decode_attention: nothing to read (no parts)")
    b, h, c = q.shape
    for p in parts:
        rows = p.table.shape[0] if isinstance(p, Paged) else p.pos.shape[0]
        if rows != b or (isinstance(p, Paged) and p.ids is not None and p.ids.shape[0] != b):
            raise ValueError(f"decode_attention: q has {b} rows, a {type(p).__name__} part "
                             f"{rows}")
        want = formats.abstract(p.fmt, (), c, p.rope)
        if sorted(want) != sorted(p.stored) or any(
                p.stored[k].shape[2:] != want[k].shape for k in want):
            raise ValueError(f"decode_attention: a {type(p).__name__} part's {p.fmt!r} "
                             f"arrays do not hold entries of q's width {c}")
    if sink is not None and sink.shape != (h,):
        raise ValueError(f"decode_attention: sink must be [{h}], got {sink.shape}")


# -- the semantics by XLA gathers ------------------------------------------------------------
def _gathered(part, q_pos, dtype):
    """(entries [B, n, c] in ``dtype``, read [B, n]) of one part."""
    if isinstance(part, Own):
        kv = {k: a[...] for k, a in part.stored.items()}
        pos = part.pos[...]
        read = (pos >= 0) & (pos <= q_pos[:, None])
        if part.window is not None:
            read &= pos > q_pos[:, None] - part.window
        return formats.decode(part.fmt, kv, dtype), read
    ps, slots = part.page_size, part.table.shape[1]
    ids = (jnp.broadcast_to(jnp.arange(slots * ps, dtype=jnp.int32), (part.table.shape[0],
                                                                      slots * ps))
           if part.ids is None else part.ids)
    read = (ids >= 0) & (ids < part.limit[:, None]) & (ids < slots * ps)
    safe = jnp.where(read, ids, 0)
    page = jnp.maximum(jnp.take_along_axis(part.table, safe // ps, axis=1), 0)
    kv = {k: a[...][page, safe % ps] for k, a in part.stored.items()}
    return formats.decode(part.fmt, kv, dtype), read


def reference(q, q_pos, parts, *, scale: float, sink=None, value_dim: int | None = None):
    """(out [B, H, value_dim] in q's dtype, lse [B, H]) of `parts` (module docstring) by
    gathering and decoding them in XLA."""
    _check(q, q_pos, parts, sink)
    sd = jnp.promote_types(q.dtype, jnp.float32)
    got = [_gathered(p, q_pos, q.dtype) for p in parts]
    entries = jnp.concatenate([e for e, _ in got], axis=1).astype(sd)
    mask = jnp.concatenate([r for _, r in got], axis=1)
    s = jnp.einsum("bhc,bsc->bhs", q.astype(sd), entries,
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(mask[:, None, :], s, -jnp.inf)
    if sink is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sink.astype(sd)[:, None], s.shape[:2] + (1,))],
                            axis=-1)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None])[..., :entries.shape[1]]
    out = jnp.einsum("bhs,bsc->bhc", p, entries[..., :value_dim],
                     precision=jax.lax.Precision.HIGHEST)
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
    channel: int  # the entry channel of its first column
    step: int = 1  # ... and between its columns' channels

    @property
    def channels(self):
        """Its columns' entry channels, as a Pallas index."""
        return pl.ds(self.channel, self.n, self.step if self.step > 1 else None)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A format's entry as the kernel reads it: its arrays (names), chunks and the spec (for
    the codecs)."""

    names: tuple
    chunks: tuple
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
        return _Layout(("v",), tuple(_Chunk(0, lo, n, None, 0, lo)
                                     for lo, n in _pow2_runs(width)), sp)
    body = width - rope if sp.needs_rope_split else width
    per, chunks = sp.per_item, []
    nibbles = range(per) if per > 1 else (None,)
    for nib in nibbles:  # stored column i holds channels i * per + nibble
        for lo, n in _pow2_runs(body // per):
            chunks.append(_Chunk(0, lo, n, nib, sp.block // per, lo * per + (nib or 0), per))
    names = ("q", "scale")
    if sp.needs_rope_split:
        names += ("rope",)
        for lo, n in _pow2_runs(rope):
            chunks.append(_Chunk(2, lo, n, None, 0, body + lo))
    return _Layout(names, tuple(chunks), sp)


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


# -- the kernel ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _PartPlan:
    """One part as the kernel walks it: its programs [first, first + programs), the refs it
    reads (indices into the kernel's inputs) and how it finds a block's rows."""

    layout: _Layout
    mixed: tuple  # per chunk: whether it holds a value channel
    first: int
    programs: int
    q: int
    arrays: tuple
    paged: bool
    ids: int | None  # Paged: the ids' ref (None: every id below the limit)
    limit: int | None
    table: int | None
    page_size: int
    n_slots: int  # Paged: the table's slots per row; Own: the row's entries
    blocks: int  # Paged with ids, Own: blocks per program; Paged by bound: at most, per row
    pos: int | None  # Own: the positions' ref
    window: int | None


@dataclasses.dataclass(frozen=True)
class _Plan:
    scale: float
    block_k: int
    qpos: int
    parts: tuple
    precision: object
    acc: object  # accumulators: float32, float64 for float64 inputs


def _bounds(part: _PartPlan, refs, b, jj, bk):
    """(first block, end block) program jj of the part walks in row b."""
    if not part.paged or part.ids is not None:
        return 0, part.blocks
    live = jnp.minimum((refs[part.limit][b] + bk - 1) // bk, part.blocks)
    per = (live + part.programs - 1) // part.programs
    lo = jnp.minimum(jj * per, live)
    return lo, jnp.minimum(lo + per, live)


def _locate(part: _PartPlan, refs, b, jj, i, qpos, bk):
    """(which of block i's entries are read [bk], their rows in the flattened arrays)."""
    if not part.paged:  # a row's own entries: slot -> row
        slot = i * bk + jax.lax.iota(jnp.int32, bk)
        pos = refs[part.pos][pl.ds(i * bk, bk)]
        ok = (slot < part.n_slots) & (pos >= 0) & (pos <= qpos)
        if part.window is not None:
            ok &= pos > qpos - part.window
        return ok, b * part.n_slots + jnp.minimum(slot, part.n_slots - 1)
    if part.ids is None:
        ids = i * bk + jax.lax.iota(jnp.int32, bk)
    else:
        ids = refs[part.ids][pl.ds((jj * part.blocks + i) * bk, bk)]
    ps = jnp.int32(part.page_size)
    ok = (ids >= 0) & (ids < refs[part.limit][b]) & (ids < part.n_slots * ps)
    safe = jnp.where(ok, ids, 0)
    slot = jnp.minimum(jax.lax.div(safe, ps), part.n_slots - 1)
    page = jnp.maximum(refs[part.table][b, slot], 0)
    return ok, page * ps + jax.lax.rem(safe, ps)


def _walk(plan: _Plan, part: _PartPlan, refs, b, jj, o_ref, lse_ref):
    """The part's share of row b as a partial (out, lse): an online softmax over blocks."""
    layout, acc, bk = part.layout, plan.acc, plan.block_k
    arrays = [refs[i] for i in part.arrays]
    q_ref, qpos = refs[part.q], refs[plan.qpos][b]
    heads = q_ref.shape[0]

    def step(i, state):
        m, l, outs = state
        ok, rows = _locate(part, refs, b, jj, i, qpos, bk)
        tiles = [_tile(layout, arrays, rows, ch, q_ref.dtype) for ch in layout.chunks]
        s = 0.0
        for ch, t in zip(layout.chunks, tiles):
            s = s + jax.lax.dot_general(q_ref[:, ch.channels], t, _NT,
                                        precision=plan.precision, preferred_element_type=acc)
        s = jnp.where(ok[None, :], s * plan.scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0)
        p = jnp.exp(s - shift[:, None])
        alpha = jnp.exp(m - shift)
        outs = tuple(o if not mix else o * alpha[:, None] + jax.lax.dot_general(
            p.astype(t.dtype), t, _NN, precision=plan.precision, preferred_element_type=acc)
            for o, t, mix in zip(outs, tiles, part.mixed))
        return m_new, l * alpha + jnp.sum(p, axis=1), outs

    start = (jnp.full((heads,), -jnp.inf, acc), jnp.zeros((heads,), acc),
             tuple(jnp.zeros((heads, ch.n), acc) for ch in layout.chunks))
    lo, hi = _bounds(part, refs, b, jj, bk)
    m, l, outs = jax.lax.fori_loop(lo, hi, step, start)
    seen = l > 0
    l = jnp.where(seen, l, 1)
    for ch, o, mix in zip(layout.chunks, outs, part.mixed):
        if mix:
            o_ref[:, ch.channels] = (o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(l), -jnp.inf)


def _kernel(*refs, plan: _Plan):
    o_ref, lse_ref = refs[-2:]
    b, j = pl.program_id(0), pl.program_id(1)
    for part in plan.parts:
        pl.when((j >= part.first) & (j < part.first + part.programs))(
            functools.partial(_walk, plan, part, refs, b, j - part.first, o_ref, lse_ref))


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def attention(q, q_pos, parts, *, scale: float, sink=None, value_dim: int | None = None,
              block_k: int | None = None, splits: int | None = None,
              head_block: int | None = None, interpret: bool | None = None,
              precision=None,
              num_warps: int | None = None, num_stages: int | None = None):
    """(out [B, H, value_dim] in q's dtype, lse [B, H]) of one decode step (module
    docstring) by the Pallas kernel. q [B, H, c] at positions q_pos int [B]; ``parts`` a
    sequence of `Paged` and `Own` (their entries c wide); ``sink`` [H] or None;
    ``value_dim`` the value channels (None: all c). ``block_k`` (a power of two >= 16)
    entries per step; ``splits`` programs per row of each part of picks or read by bound
    (never more than it has blocks; None: by `DEFAULTS`); ``head_block`` (a power of two
    >= 16) heads per program."""
    q_pos = jnp.asarray(q_pos, jnp.int32)
    parts = tuple(parts)
    _check(q, q_pos, parts, sink)
    bsz, h, c = q.shape
    dv = c if value_dim is None else value_dim
    if not 0 < dv <= c:
        raise ValueError(f"decode_attention: value_dim={value_dim} must be in 1..{c}")
    bk = DEFAULTS["block_k"] if block_k is None else block_k
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"decode_attention: block_k={bk} must be a power of two >= 16")
    bk = min(bk, max(16, _pow2_floor(DEFAULTS["tile_bytes"] // (c * q.dtype.itemsize))))
    longest = max(p.ids.shape[1] if isinstance(p, Paged) and p.ids is not None
                  else p.table.shape[1] * p.page_size if isinstance(p, Paged)
                  else p.pos.shape[1] for p in parts)
    bk = min(bk, max(16, pl.next_power_of_2(longest)))
    hb = DEFAULTS["head_block"] if head_block is None else head_block
    if hb < 16 or hb & (hb - 1):
        raise ValueError(f"decode_attention: head_block={hb} must be a power of two >= 16")
    hb = min(hb, max(16, pl.next_power_of_2(h)))
    groups = -(-h // hb)  # of heads, each its own programs
    hp = groups * hb
    partial_bytes = hp * c * q.dtype.itemsize

    def programs(p, n_blocks):
        """Programs per row of a part of picks or read by bound."""
        if splits is not None:
            return max(1, min(n_blocks, splits))
        held = n_blocks * bk * formats.bytes_per_vector(p.fmt, c, p.rope)
        return max(1, min(n_blocks, -(-DEFAULTS["programs"] // (bsz * groups)),
                          held // (DEFAULTS["partial_share"] * partial_bytes)))

    qh = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
    inputs = [q_pos]
    row = lambda *tail: pl.BlockSpec((None,) + tail, lambda b, j, g: (b,) + (0,) * len(tail))  # noqa: E731
    specs = [pl.no_block_spec]
    add = lambda x, spec: (inputs.append(x), specs.append(spec), len(inputs) - 1)[2]  # noqa: E731
    plans, first = [], 0
    q_ref = add(qh, pl.BlockSpec((None, hb, c), lambda b, j, g: (b, g, 0)))
    for p in parts:
        layout = _layout(p.fmt, c, p.rope)
        mixed = tuple(ch.channel < dv for ch in layout.chunks)
        if isinstance(p, Own):
            n = p.pos.shape[1]
            blocks = -(-n // bk)
            pos = jnp.pad(p.pos[...].astype(jnp.int32), ((0, 0), (0, blocks * bk - n)),
                          constant_values=-1)
            refs = dict(paged=False, ids=None, limit=None, table=None, page_size=0,
                        n_slots=n, blocks=blocks, pos=add(pos, row(blocks * bk)),
                        window=p.window)
            count = 1
        else:
            n = p.table.shape[1] * p.page_size if p.ids is None else p.ids.shape[1]
            n_blocks = -(-n // bk)
            count = programs(p, n_blocks)
            blocks = n_blocks if p.ids is None else -(-n_blocks // count)
            ids = None
            if p.ids is not None:
                padded = jnp.pad(p.ids.astype(jnp.int32), ((0, 0), (0, count * blocks * bk - n)),
                                 constant_values=-1)
                ids = add(padded, row(count * blocks * bk))
            refs = dict(paged=True, ids=ids, limit=add(p.limit.astype(jnp.int32), pl.no_block_spec),
                        table=add(p.table.astype(jnp.int32), pl.no_block_spec),
                        page_size=p.page_size, n_slots=p.table.shape[1], blocks=blocks,
                        pos=None, window=None)
        arrays = tuple(add(a, pl.no_block_spec) for a in _kernel_arrays(layout, p.stored, p.fmt))
        plans.append(_PartPlan(layout=layout, mixed=mixed, first=first, programs=count,
                               q=q_ref, arrays=arrays, **refs))
        first += count
    acc = jnp.promote_types(q.dtype, jnp.float32)
    plan = _Plan(scale=float(scale), block_k=bk, qpos=0, parts=tuple(plans),
                 precision=precision, acc=acc)
    out, lse = platform.pallas_call(
        functools.partial(_kernel, plan=plan),
        grid=(bsz, first, groups),
        in_specs=specs,
        out_specs=[pl.BlockSpec((None, None, hb, c), lambda b, j, g: (b, j, g, 0)),
                   pl.BlockSpec((None, None, hb), lambda b, j, g: (b, j, g))],
        # the partial outputs in q's dtype (what the step's output is rounded to anyway),
        # their lse in the accumulators'
        out_shape=[jax.ShapeDtypeStruct((bsz, first, hp, c), q.dtype),
                   jax.ShapeDtypeStruct((bsz, first, hp), acc)],
        compiler_params=plgpu.CompilerParams(
            num_warps=DEFAULTS["num_warps"] if num_warps is None else num_warps,
            num_stages=DEFAULTS["num_stages"] if num_stages is None else num_stages),
        interpret=interpret, name="decode_attention",
    )(*inputs)
    # the partials and the sink merged by lse
    out, lse = out[:, :, :h, :dv], lse[:, :, :h]
    merged = lse if sink is None else jnp.concatenate(
        [lse, jnp.broadcast_to(sink.astype(acc), (bsz, 1, h))], axis=1)
    total = jax.nn.logsumexp(merged, axis=1)
    weight = jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0)[:, None])
    return jnp.sum(weight[..., None] * out.astype(acc), axis=1).astype(q.dtype), total
