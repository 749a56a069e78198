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
    pages       the stored arrays of ONE field, ``cache["pages"][name]``: a dict with leading
                dims [n_pages, page_size] (``formats.encode`` output)
    page_table  int32 [B, P]   page id per page slot, -1 = unassigned
    length      int32 [B]      entries stored per row
    n_visible   int32 [B, T]   entries visible to each query
    fmt         the field's cache format
Output: float32 [B, T, P * page_size] (or [B, T, max_entries] when ``max_entries`` is given).

``paged_scores_tpu`` runs a grid over (row, page slot). The page table (flattened) and lengths
are scalar-prefetched (``pltpu.PrefetchScalarGridSpec``); each step's key BlockSpec index_map
picks page ``max(page_table[b, p], 0)`` of the pool, so only the row's own pages are fetched,
one page per step; slots at or past the row's length skip the matmul and write -inf. Every
block's last two dims equal the full array dims (keys [1, page_size, d], scales
[1, page_size, d/128] or [1, page_size, d/32], scores [1, 1, T8, page_size]), so any
page_size/d is legal for Mosaic;
for efficiency on real TPUs use page_size a multiple of 8 and d a multiple of 128. The wrapper
pads T up to a multiple of 8 (sublane tile) and slices it back. Kernel formats: "native",
"bf16", "fp8_fp32", "fp8_ue8m0", "fp4_ue8m0" (E8M0 scales passed as their uint8 bytes and
decoded in-kernel as 2^(byte-127); fp4 queries reordered [even | odd] channels to match the
low/high nibbles); others: use ``reference_scores``. ``interpret=True`` runs the kernel in
the TPU interpreter (``pltpu.InterpretParams()``), which is how the tests check it on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsattn.cache import formats

KERNEL_FORMATS = ("native", "bf16", "fp8_fp32", "fp8_ue8m0", "fp4_ue8m0")
_FP8_BLOCK = 128  # fp8_fp32: one float32 scale per 128 channels
_UE8M0_BLOCK = 32  # fp8_ue8m0 / fp4_ue8m0: one E8M0 scale per 32 channels


def _visible(n_visible, length, n_cols: int):
    """Boolean [B, T, n_cols]: entry s visible to (b, t)."""
    s = jnp.arange(n_cols, dtype=jnp.int32)[None, None, :]
    nv = jnp.minimum(jnp.asarray(n_visible, jnp.int32), jnp.asarray(length, jnp.int32)[:, None])
    return s < nv[..., None]


def reference_scores(q, w, pages, page_table, length, n_visible, fmt: str, *,
                     max_entries: int | None = None):
    """Pure-jnp score pass (any cache format): float32 [B, T, P*page_size] with -inf where
    invisible; columns truncated to ``max_entries`` when given."""
    page_table = jnp.asarray(page_table, jnp.int32)
    B, P = page_table.shape
    first = next(iter(pages.values()))
    ps = first.shape[1]
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
    return score if max_entries is None else score[..., :max_entries]


def _score_kernel(pt_ref, len_ref, q_ref, w_ref, nv_ref, *rest, fmt, n_heads, t8, ps):
    # pt_ref [B*P] and len_ref [B] live in SMEM (scalar prefetch).
    # q_ref [1, H*T8, d] (head-major rows), w_ref [1, T8, H], nv_ref [1, T8, 1],
    # key refs [1, ps, d] (+ scale [1, ps, d/blk]; fp4: q [1, ps, d/2]), o_ref [1, 1, T8, ps].
    del pt_ref
    o_ref = rest[-1]
    key_refs = rest[:-1]
    b, p = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]
    start = p * ps

    @pl.when(start >= length)
    def _empty():
        o_ref[0, 0] = jnp.full((t8, ps), -jnp.inf, jnp.float32)

    @pl.when(start < length)
    def _compute():
        q = q_ref[0].astype(jnp.float32)  # [H*T8, d]
        nt = (((1,), (1,)), ((), ()))  # contract d with d: [M, d] x [N, d] -> [M, N]
        hi = jax.lax.Precision.HIGHEST
        if fmt in ("native", "bf16"):
            k = key_refs[0][0].astype(jnp.float32)  # [ps, d]
            dots = jax.lax.dot_general(q, k, nt, precision=hi,
                                       preferred_element_type=jnp.float32)
        elif fmt in ("fp8_fp32", "fp8_ue8m0"):  # per scale block, q8 * scale
            blk = _FP8_BLOCK if fmt == "fp8_fp32" else _UE8M0_BLOCK
            k8, sc = key_refs[0][0], key_refs[1][0]  # [ps, d], [ps, d/blk]
            # fp8_ue8m0 scales arrive as their uint8 bytes: 2^(byte-127).
            sc = sc.astype(jnp.float32) if fmt == "fp8_fp32" else formats.e8m0_to_f32(sc)
            dots = None
            for i in range(k8.shape[-1] // blk):
                lo, hi_c = i * blk, (i + 1) * blk
                kb = k8[:, lo:hi_c].astype(jnp.float32) * sc[:, i:i + 1]
                part = jax.lax.dot_general(q[:, lo:hi_c], kb, nt, precision=hi,
                                           preferred_element_type=jnp.float32)
                dots = part if dots is None else dots + part
        else:  # fp4_ue8m0: packed E2M1 pairs, q columns pre-split into [even | odd] halves
            kp, sc = key_refs[0][0], key_refs[1][0]  # uint8 [ps, d/2], uint8 [ps, d/32]
            sc = formats.e8m0_to_f32(sc)
            half = kp.shape[-1]
            k_even = formats.e2m1_values(kp & 0xF)  # channel 2i: low nibble
            k_odd = formats.e2m1_values(kp >> 4)  # channel 2i+1: high nibble
            bb = _UE8M0_BLOCK // 2  # bytes per scale block
            dots = None
            for i in range(half // bb):
                lo, hi_c = i * bb, (i + 1) * bb
                s_i = sc[:, i:i + 1]
                part = (jax.lax.dot_general(q[:, lo:hi_c], k_even[:, lo:hi_c] * s_i, nt,
                                            precision=hi, preferred_element_type=jnp.float32)
                        + jax.lax.dot_general(q[:, half + lo:half + hi_c],
                                              k_odd[:, lo:hi_c] * s_i, nt, precision=hi,
                                              preferred_element_type=jnp.float32))
                dots = part if dots is None else dots + part
        dots = jnp.maximum(dots, 0.0)  # [H*T8, ps]
        wv = w_ref[0].astype(jnp.float32)  # [T8, H]
        acc = jnp.zeros((t8, ps), jnp.float32)
        for j in range(n_heads):
            acc = acc + wv[:, j:j + 1] * dots[j * t8:(j + 1) * t8, :]
        col = start + jax.lax.broadcasted_iota(jnp.int32, (t8, ps), 1)
        nv = jnp.minimum(nv_ref[0], length)  # [T8, 1]
        o_ref[0, 0] = jnp.where(col < nv, acc, -jnp.inf)


def paged_scores_tpu(q, w, pages, page_table, length, n_visible, fmt: str, *,
                     interpret: bool = False, max_entries: int | None = None):
    """Pallas TPU score pass: float32 [B, T, P*page_size] (-inf where invisible), equal to
    ``reference_scores``. ``interpret=True`` runs it in the TPU interpreter (CPU tests)."""
    if fmt not in KERNEL_FORMATS:
        raise NotImplementedError(
            f"paged_scores_tpu: format {fmt!r} has no kernel (supported: "
            f"{', '.join(KERNEL_FORMATS)}); use reference_scores")
    page_table = jnp.asarray(page_table, jnp.int32)
    length = jnp.asarray(length, jnp.int32)
    n_visible = jnp.asarray(n_visible, jnp.int32)
    B, T, H, d = q.shape
    P = page_table.shape[1]
    if fmt in ("native", "bf16"):
        key_arrays = [pages["v"]]
    else:
        blk = _FP8_BLOCK if fmt == "fp8_fp32" else _UE8M0_BLOCK
        if d % blk:
            raise ValueError(f"paged_scores_tpu: {fmt} needs d % {blk} == 0, got d={d}")
        scale = pages["scale"]
        if fmt != "fp8_fp32":  # E8M0 -> its uint8 byte (same-width bitcast, decoded in-kernel)
            scale = jax.lax.bitcast_convert_type(scale, jnp.uint8)
        key_arrays = [pages["q"], scale]
    ps = key_arrays[0].shape[1]
    key_w = key_arrays[0].shape[2] * (2 if fmt == "fp4_ue8m0" else 1)
    if key_w != d:
        raise ValueError(f"paged_scores_tpu: key width {key_w} != query d {d}")

    t8 = -(-T // 8) * 8
    pad_t = t8 - T
    q32 = jnp.asarray(q, jnp.float32)
    w32 = jnp.asarray(w, jnp.float32)
    if pad_t:
        q32 = jnp.pad(q32, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
        w32 = jnp.pad(w32, ((0, 0), (0, pad_t), (0, 0)))
        n_visible = jnp.pad(n_visible, ((0, 0), (0, pad_t)))
    if fmt == "fp4_ue8m0":  # channels reordered [even | odd] to match the packed nibbles
        q32 = jnp.concatenate([q32[..., 0::2], q32[..., 1::2]], axis=-1)
    q_hm = jnp.transpose(q32, (0, 2, 1, 3)).reshape(B, H * t8, d)  # head-major rows
    nv3 = n_visible[..., None]  # [B, T8, 1]

    def key_map(b, p, pt, ln):
        return (jnp.maximum(pt[b * P + p], 0), 0, 0)

    in_specs = [
        pl.BlockSpec((1, H * t8, d), lambda b, p, pt, ln: (b, 0, 0)),
        pl.BlockSpec((1, t8, H), lambda b, p, pt, ln: (b, 0, 0)),
        pl.BlockSpec((1, t8, 1), lambda b, p, pt, ln: (b, 0, 0)),
    ] + [pl.BlockSpec((1, ps, a.shape[2]), key_map) for a in key_arrays]
    out_spec = pl.BlockSpec((1, 1, t8, ps), lambda b, p, pt, ln: (b, p, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, P), in_specs=in_specs, out_specs=out_spec)
    kernel = functools.partial(_score_kernel, fmt=fmt, n_heads=H, t8=t8, ps=ps)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, P, t8, ps), jnp.float32),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(page_table.reshape(-1), length, q_hm, w32, nv3, *key_arrays)
    out = jnp.transpose(out, (0, 2, 1, 3)).reshape(B, t8, P * ps)[:, :T]
    return out if max_entries is None else out[..., :max_entries]
