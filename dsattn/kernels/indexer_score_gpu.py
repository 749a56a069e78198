"""Indexer score pass over the paged global cache as a Pallas kernel for NVIDIA GPUs (Triton).

Same contract as ``indexer_score.paged_scores_tpu`` (see that module for the arguments, the
visibility rule, the formats and ``block_max``); only the way keys reach the kernel differs,
because the Triton backend has no scalar prefetch and no DMA:

- the page table, lengths and key pools are ordinary inputs passed whole; a program reads its
  keys' page ids from the page table ref and loads the keys from the pool ref by row index
  (page * page_size + offset). Any page size works, and a key block may span several pages.
- grid (row, query block, key block); a program scores ``block_k`` consecutive entries of one
  row against ``block_t`` query positions and skips the loads when its block starts at or past
  the row's length.
- Triton lowers power-of-two tiles only and ``tl.dot`` needs every dim >= 16. Query rows are
  (position, head) pairs (row t*H + h), zero-padded to a power of two >= 16, so the q·k dot is
  one [rows, n] x [n, block_k] matmul per scale block; the head sum Σ_h w·ReLU(·) is a second
  matmul with a [T16, rows] weight matrix holding w[t, h] at (t, t*H + h). Loads are sliced
  from refs per scale block (no slicing or reshaping of loaded values).

``block_k`` (power of two >= 16) and ``block_t`` are parameters; ``DEFAULTS`` holds the
defaults used on a GPU (and in interpret mode). ``interpret=True`` runs the kernel in the
generic Pallas interpreter, which is how the tests check it on CPU; compiled, it needs a GPU.
Without one, tests/test_kernels.py still lowers it to Triton IR (``lowering_platforms=
("cuda",)``), which checks every op, tile shape and dtype against the Triton lowering.
``precision``: HIGHEST (the default, equal to the reference) makes Triton run IEEE float32
dots on CUDA cores, which spill registers at H=64, d=128; DEFAULT uses TF32 tensor cores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsattn.cache import formats
from dsattn.kernels import platform
from dsattn.kernels.indexer_score import (block_maxima, check_block_max, dequant_dots,
                                          kernel_inputs, truncate)

DEFAULTS = dict(block_k=64, rows=64, num_warps=4, num_stages=2)  # rows: q rows per program


def _score_kernel(pt_ref, len_ref, q_ref, w_ref, nv_ref, *rest, fmt, d, ps, n_slots, bk,
                  n_keys, block_max, precision):
    # pt_ref int32 [B, P] and len_ref int32 [B]: whole arrays. q_ref [R, d] rows (t, h);
    # w_ref [T16, R]; nv_ref int32 [T16, 1]; key refs: whole pools [n_pages * ps, width];
    # outputs [T16, bk] (+ maxima [T16, bk / block_max]).
    key_refs, out_refs = rest[:n_keys], rest[n_keys:]
    b, j = pl.program_id(0), pl.program_id(2)
    length = len_ref[b]
    start = j * bk

    @pl.when(start >= length)
    def _empty():
        for r in out_refs:
            r[...] = jnp.full(r.shape, -jnp.inf, jnp.float32)

    @pl.when(start < length)
    def _compute():
        s = start + jax.lax.iota(jnp.int32, bk)  # this block's entries
        slot = jnp.minimum(jax.lax.div(s, jnp.int32(ps)), n_slots - 1)
        page = jnp.maximum(pt_ref[b, slot], 0)  # unassigned (-1) slots are masked below
        rows = page * ps + jax.lax.rem(s, jnp.int32(ps))  # [bk] rows of the flattened pool

        def load_q(lo, n):
            return q_ref[:, pl.ds(lo, n)].astype(jnp.float32)

        def load_k(a, lo, n):
            return key_refs[a][rows, pl.ds(lo, n)]

        dots = jnp.maximum(dequant_dots(fmt, d, load_q, load_k, precision), 0.0)  # [R, bk]
        acc = jax.lax.dot_general(w_ref[...], dots, (((1,), (0,)), ((), ())),
                                  precision=precision, preferred_element_type=jnp.float32)
        col = start + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 1)
        score = jnp.where(col < jnp.minimum(nv_ref[...], length), acc, -jnp.inf)
        out_refs[0][...] = score
        if block_max is not None:
            out_refs[1][...] = block_maxima(score, block_max)


def paged_scores_gpu(q, w, pages, page_table, length, n_visible, fmt: str, *,
                     interpret: bool | None = None, max_entries: int | None = None,
                     block_max: int | None = None, block_k: int | None = None,
                     block_t: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None,
                     precision=jax.lax.Precision.HIGHEST):
    """Pallas GPU (Triton) score pass: float32 [B, T, P*page_size] (-inf where invisible),
    equal to ``reference_scores``; (scores, maxima) with ``block_max``.

    ``block_k``: entries per program (power of two >= 16; raised to ``block_max`` if smaller);
    ``block_t``: query positions per program (default: as many as fit ``DEFAULTS["rows"]``
    (position, head) rows). ``precision`` of the in-kernel dots: HIGHEST (IEEE float32, equal
    to the reference) by default; DEFAULT lets Triton use TF32 tensor cores.
    """
    who = "paged_scores_gpu"
    q32, key_arrays = kernel_inputs(q, pages, fmt, who)
    page_table = jnp.asarray(page_table, jnp.int32)
    length = jnp.asarray(length, jnp.int32)
    n_visible = jnp.asarray(n_visible, jnp.int32)
    B, T, H, d = q.shape
    P = page_table.shape[1]
    ps = key_arrays[0].shape[1]
    check_block_max(block_max, ps, who)
    bk = DEFAULTS["block_k"] if block_k is None else block_k
    if block_max is not None:
        bk = max(bk, block_max)
    if bk < 16 or bk & (bk - 1) or (block_max is not None and bk % block_max):
        raise ValueError(f"{who}: block_k={bk} must be a power of two >= 16 and a multiple "
                         f"of block_max={block_max} (Triton tiles are powers of two)")
    if not formats.spec(fmt).block and (d < 16 or d & (d - 1)):  # loaded whole (else per block)
        raise ValueError(f"{who}: {fmt} keys are loaded as [block_k, d] tiles: d={d} must be "
                         f"a power of two >= 16")
    if block_t is None:
        block_t = max(1, min(T, DEFAULTS["rows"] // H))
    n_t = -(-T // block_t)
    n_rows = max(16, pl.next_power_of_2(block_t * H))  # (position, head) query rows per program
    t16 = max(16, pl.next_power_of_2(block_t))
    n_j = -(-(P * ps) // bk)

    # Queries as rows (t, h) per query block; the head weights as a [t16, rows] matrix.
    w32 = jnp.asarray(w, jnp.float32)
    pad_t = n_t * block_t - T
    q32 = jnp.pad(q32, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    w32 = jnp.pad(w32, ((0, 0), (0, pad_t), (0, 0))).reshape(B, n_t, block_t, H)
    q_rows = q32.reshape(B, n_t, block_t * H, d)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, n_rows - block_t * H), (0, 0)))
    eye = jnp.eye(block_t, dtype=jnp.float32)
    w_mat = (eye[:, :, None] * w32[:, :, None, :, :]).reshape(B, n_t, block_t, block_t * H)
    w_mat = jnp.pad(w_mat, ((0, 0), (0, 0), (0, t16 - block_t), (0, n_rows - block_t * H)))
    nv = jnp.pad(n_visible, ((0, 0), (0, pad_t))).reshape(B, n_t, block_t)
    nv = jnp.pad(nv, ((0, 0), (0, 0), (0, t16 - block_t)))[..., None]  # [B, n_t, t16, 1]
    flat_keys = [a.reshape((-1,) + a.shape[2:]) for a in key_arrays]  # [n_pages * ps, width]

    in_specs = [  # page table, lengths and key pools whole (no_block_spec): indexed in-kernel
        pl.no_block_spec, pl.no_block_spec,
        pl.BlockSpec((None, None, n_rows, d), lambda b, t, j: (b, t, 0, 0)),
        pl.BlockSpec((None, None, t16, n_rows), lambda b, t, j: (b, t, 0, 0)),
        pl.BlockSpec((None, None, t16, 1), lambda b, t, j: (b, t, 0, 0)),
    ] + [pl.no_block_spec] * len(flat_keys)
    widths = [bk] + ([] if block_max is None else [bk // block_max])
    out_specs = [pl.BlockSpec((None, None, t16, n), lambda b, t, j: (b, t, 0, j))
                 for n in widths]
    out_shape = [jax.ShapeDtypeStruct((B, n_t, t16, n_j * n), jnp.float32) for n in widths]
    kernel = functools.partial(_score_kernel, fmt=fmt, d=d, ps=ps, n_slots=P, bk=bk,
                               n_keys=len(flat_keys), block_max=block_max,
                               precision=precision)
    params = plgpu.CompilerParams(
        num_warps=DEFAULTS["num_warps"] if num_warps is None else num_warps,
        num_stages=DEFAULTS["num_stages"] if num_stages is None else num_stages)
    outs = platform.pallas_call(
        kernel,
        grid=(B, n_t, n_j),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret, name="indexer_score",
    )(page_table, length, q_rows, w_mat, nv, *flat_keys)
    # [B, n_t, t16, cols] -> [B, T, cols]; the tile columns past P*ps are dropped.
    outs = [o[:, :, :block_t].reshape(B, n_t * block_t, -1)[:, :T] for o in outs]
    scores = outs[0][..., :P * ps]
    maxima = outs[1][..., :P * ps // block_max] if block_max is not None else None
    return truncate(scores, maxima, block_max, max_entries)
