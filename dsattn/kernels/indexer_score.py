"""Indexer score pass over the paged global cache: a Pallas TPU kernel and its jnp reference.

    I[b, t, s] = Σ_j w[b, t, j] · ReLU(q[b, t, j, :] · k[b, s, :])     (float32)

for queries at one or a few positions per row (decode, chunked prefill), keys read from the
paged cache (``dsattn/cache/paged.py``) through the row's page table and dequantized in-kernel.
Entry ``s`` is visible to query ``(b, t)`` iff ``s < n_visible[b, t]`` and ``s < length[b]``;
invisible scores are ``-inf``. ``n_visible`` int32 [B, T] carries the "entry complete at t"
rule (callers pass min(visible, length)). Top-k runs afterwards in XLA.

Shared arguments:
    q           [B, T, H, d]   indexer queries (any float dtype; computed in float32)
    w           [B, T, H]      head weights
    pages       the stored arrays of ONE field, ``cache.pages[name]``: a dict with leading
                dims [n_pages, page_size] (``formats.encode`` output)
    page_table  int32 [B, P]   page id per page slot, -1 = unassigned
    length      int32 [B]      entries stored per row
    n_visible   int32 [B, T]   entries visible to each query
    fmt         the field's cache format
Output: float32 [B, T, P * page_size] (or [B, T, max_entries] when ``max_entries`` is given).
With ``block_max=Bk`` (Bk divides page_size) every function returns (scores, maxima) where
maxima[b, t, i] = max of the visible scores i*Bk .. (i+1)*Bk-1 (-inf if none), float32
[B, T, ceil(width / Bk)]: the block maxima of V4.1's hierarchical pool, computed in-kernel.

``paged_scores_tpu`` runs a grid over (row, query block, page slot). The page table
(flattened) and lengths are scalar-prefetched (``pltpu.PrefetchScalarGridSpec``); each step's
key BlockSpec index_map picks page ``max(page_table[b, p], 0)`` of the pool, so only the row's
own pages are fetched, one page per step; slots at or past the row's length skip the matmul
and write -inf. The prefetched table lives in SMEM (1 MiB on v5e and v6e), so a batch whose
table is larger runs as a loop of calls over groups of rows (``rows_per_call_for``). A query block is at most ``query_block_for``'s rows, so that a prefill chunk's
thousand queries fit VMEM as a decode step's one does (v5e's scoped VMEM is 16 MiB; a chunk's
queries and dots in one block asked for more and failed the compile). Every block's last two
dims equal the full array dims (keys [1, page_size, d], scales [1, page_size, d/128] or
[1, page_size, d/32], scores [1, 1, Tq, page_size]), so any page_size/d is legal for Mosaic;
for efficiency on real TPUs use page_size a multiple of 8 and d a multiple of 128. The wrapper
pads T up to whole query blocks (a multiple of 8, the sublane tile) and slices it back. Kernel formats: "native",
"bf16", "fp8_fp32", "fp8_ue8m0", "fp4_ue8m0" (E8M0 scales passed as their uint8 bytes and
decoded in-kernel as 2^(byte-127); fp4 queries reordered [even | odd] channels to match the
low/high nibbles); others: use ``reference_scores``. In a program lowered for a CPU the
kernel runs in the Pallas interpreter (kernels/platform.py), which is how the tests check it:
the generic one, since the TPU interpreter's ordered callbacks would leak into every program
that traces the kernel beside another platform's path (a `platform_dependent` branch).

The GPU (Triton) variant lives in ``indexer_score_gpu.py``; both kernels share this module's
input preparation (``kernel_inputs``), in-kernel dequantization (``dequant_dots``), masking
and block maxima (``block_maxima``), so a format is decoded the same way everywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsattn.cache import formats
from dsattn.kernels import platform

KERNEL_FORMATS = tuple(name for name, sp in formats.FORMATS.items() if sp.kernel)
_NT = (((1,), (1,)), ((), ()))  # dot_general: contract the last dims, [M, d] x [N, d] -> [M, N]


def _visible(n_visible, length, n_cols: int):
    """Boolean [B, T, n_cols]: entry s visible to (b, t)."""
    s = jnp.arange(n_cols, dtype=jnp.int32)[None, None, :]
    nv = jnp.minimum(jnp.asarray(n_visible, jnp.int32), jnp.asarray(length, jnp.int32)[:, None])
    return s < nv[..., None]


def check_block_max(block_max, page_size: int, who: str) -> None:
    """Block maxima tile pages exactly: ``block_max`` must divide the page size."""
    if block_max is not None and (block_max <= 0 or page_size % block_max):
        raise ValueError(f"{who}: block_max={block_max} must be a positive divisor of the "
                         f"page size {page_size}")


def truncate(out, maxima, block_max, max_entries):
    """Cut scores (and maxima) to ``max_entries`` columns; the pair when block_max is set."""
    if max_entries is not None:
        out = out[..., :max_entries]
        if maxima is not None:
            maxima = maxima[..., :-(-max_entries // block_max)]
    return out if block_max is None else (out, maxima)


def reference_scores(q, w, pages, page_table, length, n_visible, fmt: str, *,
                     max_entries: int | None = None, block_max: int | None = None):
    """Pure-jnp score pass (any cache format): float32 [B, T, P*page_size] with -inf where
    invisible; columns truncated to ``max_entries`` when given; (scores, maxima) with
    ``block_max``."""
    page_table = jnp.asarray(page_table, jnp.int32)
    B, P = page_table.shape
    first = next(iter(pages.values()))
    ps = first.shape[1]
    check_block_max(block_max, ps, "reference_scores")
    rows = {a: v[jnp.maximum(page_table, 0)].reshape((B, P * ps) + v.shape[2:])
            for a, v in pages.items()}
    keys = formats.decode(fmt, rows, jnp.float32)  # [B, S, d]
    q32, w32 = jnp.asarray(q, jnp.float32), jnp.asarray(w, jnp.float32)
    dots = jnp.einsum("btjd,bsd->btjs", q32, keys, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)
    score = jnp.einsum("btjs,btj->bts", jax.nn.relu(dots), w32,
                       precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    vis = _visible(n_visible, length, P * ps)
    score = jnp.where(vis, score, -jnp.inf)
    maxima = None
    if block_max is not None:
        maxima = jnp.max(score.reshape(score.shape[:-1] + (-1, block_max)), axis=-1)
    return truncate(score, maxima, block_max, max_entries)


# -- shared by the TPU and GPU kernels -----------------------------------------------------
def kernel_inputs(q, pages, fmt: str, who: str):
    """(float32 queries, stored key arrays) as the kernels read them, after checking that a
    kernel can: E8M0 scales become their uint8 bytes (a same-width bitcast, decoded in-kernel)
    and FP4 query channels are reordered [even | odd] to match the low/high nibbles."""
    if fmt not in KERNEL_FORMATS:
        raise NotImplementedError(
            f"{who}: format {fmt!r} has no kernel (supported: {', '.join(KERNEL_FORMATS)}); "
            f"use reference_scores")
    sp = formats.spec(fmt)
    d = q.shape[-1]
    pages = formats.as_floats(fmt, pages)  # stored bits as the kernel's floats: a bitcast
    if not sp.block:
        key_arrays = [pages["v"]]
    else:
        if d % sp.block:
            raise ValueError(f"{who}: {fmt} needs d % {sp.block} == 0, got d={d}")
        scale = pages["scale"]
        if sp.scale_type.kernel_bytes:
            scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
        key_arrays = [pages["q"], scale]
    key_w = key_arrays[0].shape[2] * sp.per_item
    if key_w != d:
        raise ValueError(f"{who}: key width {key_w} != query d {d}")
    q32 = jnp.asarray(q, jnp.float32)
    if sp.per_item == 2:
        q32 = jnp.concatenate([q32[..., 0::2], q32[..., 1::2]], axis=-1)
    return q32, key_arrays


def dequant_dots(fmt: str, d: int, load_q, load_k, precision):
    """q·k for a tile of stored keys, dequantized per scale block: float32 [M, N].

    ``load_q(lo, n)`` -> float32 [M, n] query columns lo..lo+n (FP4: of the [even | odd]
    reordered queries); ``load_k(a, lo, n)`` -> columns lo..lo+n of stored array ``a`` (0: the
    values, 1: the scales) for the tile's N keys. A kernel loads these from refs or slices them
    from loaded values, whichever its backend lowers.
    """
    def dot(a, b):
        return jax.lax.dot_general(a, b, _NT, precision=precision,
                                   preferred_element_type=jnp.float32)

    sp = formats.spec(fmt)
    if not sp.block:
        return dot(load_q(0, d), load_k(0, 0, d).astype(jnp.float32))
    dots = None
    if sp.per_item == 2:  # packed E2M1 pairs: channel 2i in the low nibble, 2i+1 in the high
        half, bb = d // 2, sp.block // 2  # bytes per scale block
        for i in range(half // bb):
            kp = load_k(0, i * bb, bb)
            s = sp.scale_type.to_f32(load_k(1, i, 1))
            part = (dot(load_q(i * bb, bb), formats.e2m1_values(kp & 0xF) * s)
                    + dot(load_q(half + i * bb, bb), formats.e2m1_values(kp >> 4) * s))
            dots = part if dots is None else dots + part
        return dots
    blk = sp.block
    for i in range(d // blk):
        s = sp.scale_type.to_f32(load_k(1, i, 1))  # E8M0 scales as their bytes: 2^(byte-127)
        part = dot(load_q(i * blk, blk), load_k(0, i * blk, blk).astype(jnp.float32) * s)
        dots = part if dots is None else dots + part
    return dots


def block_maxima(score, block: int):
    """Max of each ``block`` consecutive columns of a tile [R, N] -> [R, N // block], built
    without reshapes (a column-masked max per block, placed with iota) so Mosaic and Triton
    both lower it."""
    rows, n = score.shape
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, n), 1)
    out_col = jax.lax.broadcasted_iota(jnp.int32, (rows, n // block), 1)
    out = jnp.full((rows, n // block), -jnp.inf, jnp.float32)
    for i in range(n // block):
        inside = (col >= i * block) & (col < (i + 1) * block)
        m = jnp.max(jnp.where(inside, score, -jnp.inf), axis=1, keepdims=True)
        out = jnp.where(out_col == i, m, out)
    return out


# -- TPU (Mosaic) ----------------------------------------------------------------------------
def _score_kernel(pt_ref, len_ref, q_ref, w_ref, nv_ref, *rest, fmt, n_heads, t8, ps,
                  n_keys, block_max):
    # pt_ref [B*P] and len_ref [B] live in SMEM (scalar prefetch).
    # q_ref [1, 1, H*T8, d] (a query block's rows, head-major), w_ref [1, T8, H],
    # nv_ref [1, T8, 1], key refs [1, ps, d] (+ scale [1, ps, d/blk]; fp4: q [1, ps, d/2]),
    # o_ref [1, 1, T8, ps] (+ maxima [1, 1, T8, ps/block_max]); T8: the query block.
    del pt_ref
    key_refs, out_refs = rest[:n_keys], rest[n_keys:]
    b, p = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]
    start = p * ps

    @pl.when(start >= length)
    def _empty():
        for r in out_refs:
            r[0, 0] = jnp.full(r.shape[2:], -jnp.inf, jnp.float32)

    @pl.when(start < length)
    def _compute():
        q = q_ref[0, 0].astype(jnp.float32)  # [H*T8, d]
        keys = [r[0] for r in key_refs]
        dots = dequant_dots(fmt, q.shape[-1], lambda lo, n: q[:, lo:lo + n],
                            lambda a, lo, n: keys[a][:, lo:lo + n], jax.lax.Precision.HIGHEST)
        dots = jnp.maximum(dots, 0.0)  # [H*T8, ps]
        wv = w_ref[0].astype(jnp.float32)  # [T8, H]
        acc = jnp.zeros((t8, ps), jnp.float32)
        for j in range(n_heads):
            acc = acc + wv[:, j:j + 1] * dots[j * t8:(j + 1) * t8, :]
        col = start + jax.lax.broadcasted_iota(jnp.int32, (t8, ps), 1)
        nv = jnp.minimum(nv_ref[0], length)  # [T8, 1]
        score = jnp.where(col < nv, acc, -jnp.inf)
        out_refs[0][0, 0] = score
        if block_max is not None:
            out_refs[1][0, 0] = block_maxima(score, block_max)


# Bytes of VMEM a query block's working set may take: half of v5e's 16 MiB scoped default
# (v6e has 32), the rest left to the key pages' buffers and Mosaic's own temporaries.
VMEM_BUDGET = 8 << 20


def query_block_for(T: int, n_heads: int, d: int, page_size: int) -> int:
    """Queries per grid step: a multiple of 8 (the sublane tile) whose working set fits
    VMEM_BUDGET (per query: its double-buffered rows of every head, one page's dots per head,
    the score row's temporaries and double-buffered output), the blocks as even as
    T allows (a chunk of 1024 runs as 3 x 344, not 440 + 440 + 144 padded to 3 x 440)."""
    per_query = 4 * (2 * n_heads * d + 2 * n_heads * page_size + 8 * page_size + 2 * n_heads)
    most = max(8, VMEM_BUDGET // per_query // 8 * 8)
    t8 = -(-T // 8) * 8
    n_blocks = -(-t8 // most)
    return -(-t8 // n_blocks // 8) * 8 if n_blocks > 1 else t8


# Bytes of SMEM one call's scalar-prefetched page table may take: a quarter of v5e's and v6e's
# 1 MiB (a whole table of 32 rows x 8,192 pages filled it and failed the compile). A batch
# whose table is larger runs as a loop of calls, each over a group of rows.
SMEM_TABLE_BUDGET = 256 << 10


def rows_per_call_for(n_pages: int) -> int:
    """Rows whose page tables (int32, ``n_pages`` slots each) fit SMEM_TABLE_BUDGET."""
    rows = SMEM_TABLE_BUDGET // (4 * n_pages)
    if rows < 1:
        raise ValueError(
            f"paged_scores_tpu: a row's page table of {n_pages} pages ({4 * n_pages} bytes) "
            f"passes the kernel's SMEM budget of {SMEM_TABLE_BUDGET} bytes; use larger pages "
            f"(cache.page_size) or indexer.impl=xla")
    return rows


def paged_scores_tpu(q, w, pages, page_table, length, n_visible, fmt: str, *,
                     interpret: bool | None = None, max_entries: int | None = None,
                     block_max: int | None = None, query_block: int | None = None,
                     rows_per_call: int | None = None):
    """Pallas TPU score pass: float32 [B, T, P*page_size] (-inf where invisible), equal to
    ``reference_scores``; (scores, maxima) with ``block_max``. ``interpret``: as
    kernels/platform.py's (None: compiled for a TPU, interpreted for a CPU);
    ``query_block``: queries per grid step, a multiple of 8 (None: ``query_block_for``);
    ``rows_per_call``: rows per kernel call, more run as a loop of calls (None:
    ``rows_per_call_for``, what SMEM holds of the page table)."""
    q32, key_arrays = kernel_inputs(q, pages, fmt, "paged_scores_tpu")
    page_table = jnp.asarray(page_table, jnp.int32)
    length = jnp.asarray(length, jnp.int32)
    n_visible = jnp.asarray(n_visible, jnp.int32)
    B, T, H, d = q.shape
    P = page_table.shape[1]
    ps = key_arrays[0].shape[1]
    check_block_max(block_max, ps, "paged_scores_tpu")
    tq = query_block or query_block_for(T, H, d, ps)
    if tq % 8:
        raise ValueError(f"paged_scores_tpu: query_block={tq} must be a multiple of 8")

    n_q = -(-T // tq)
    pad_t = n_q * tq - T
    w32 = jnp.asarray(w, jnp.float32)
    if pad_t:
        q32 = jnp.pad(q32, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
        w32 = jnp.pad(w32, ((0, 0), (0, pad_t), (0, 0)))
        n_visible = jnp.pad(n_visible, ((0, 0), (0, pad_t)))
    # [B, query blocks, H * tq, d]: each block's rows head-major
    q_hm = jnp.transpose(q32.reshape(B, n_q, tq, H, d), (0, 1, 3, 2, 4)).reshape(
        B, n_q, H * tq, d)
    nv3 = n_visible[..., None]  # [B, T, 1]

    def key_map(b, i, p, pt, ln):
        return (jnp.maximum(pt[b * P + p], 0), 0, 0)

    def out_map(b, i, p, pt, ln):
        return (b, p, i, 0)

    in_specs = [
        pl.BlockSpec((1, 1, H * tq, d), lambda b, i, p, pt, ln: (b, i, 0, 0)),
        pl.BlockSpec((1, tq, H), lambda b, i, p, pt, ln: (b, i, 0)),
        pl.BlockSpec((1, tq, 1), lambda b, i, p, pt, ln: (b, i, 0)),
    ] + [pl.BlockSpec((1, ps, a.shape[2]), key_map) for a in key_arrays]
    widths = [ps] + ([] if block_max is None else [ps // block_max])
    out_specs = [pl.BlockSpec((1, 1, tq, n), out_map) for n in widths]
    kernel = functools.partial(_score_kernel, fmt=fmt, n_heads=H, t8=tq, ps=ps,
                               n_keys=len(key_arrays), block_max=block_max)

    def call(table, lengths, q_rows, w_rows, nv_rows):
        """One kernel call over ``len(table)`` rows."""
        rows = table.shape[0]
        # the page slot innermost: a query block is fetched once and scored against every page
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(rows, n_q, P), in_specs=in_specs, out_specs=out_specs)
        return platform.pallas_call(
            kernel, grid_spec=grid_spec,
            out_shape=[jax.ShapeDtypeStruct((rows, P, n_q * tq, n), jnp.float32)
                       for n in widths],
            interpret=interpret, name="indexer_score",
        )(table.reshape(-1), lengths, q_rows, w_rows, nv_rows, *key_arrays)

    per_call = rows_per_call or rows_per_call_for(P)
    args = (page_table, length, q_hm, w32, nv3)
    if B <= per_call:
        outs = call(*args)
    else:  # groups of rows, the last padded with empty rows (length 0: nothing is read)
        groups = -(-B // per_call)
        grouped = [jnp.pad(a, [(0, groups * per_call - B)] + [(0, 0)] * (a.ndim - 1)).reshape(
            (groups, per_call) + a.shape[1:]) for a in args]
        outs = [o.reshape((groups * per_call,) + o.shape[2:])[:B]
                for o in jax.lax.map(lambda g: call(*g), grouped)]
    outs = [jnp.transpose(o, (0, 2, 1, 3)).reshape(B, n_q * tq, -1)[:, :T] for o in outs]
    return truncate(outs[0], outs[1] if block_max else None, block_max, max_entries)
