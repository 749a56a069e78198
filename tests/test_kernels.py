"""Pallas kernels against their pure-jnp references: the TPU kernel in TPU interpret mode, the
GPU (Triton) kernel in the generic interpreter and lowered to Triton IR, all on CPU; compiled
on the backend's own kernel when a GPU or TPU is present."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn.attention import indexer
from dsattn.cache import paged
from dsattn.kernels.indexer_score import (KERNEL_FORMATS, paged_scores_tpu, reference_scores,
                                          rows_per_call_for)
from dsattn.kernels.indexer_score_gpu import paged_scores_gpu

B, MAX_ENTRIES, PS, H, D = 3, 20, 8, 4, 128


def _scrambled_cache(fmt, seed=0):
    """A paged cache whose rows hold ragged lengths (17, 5, 15) on scrambled pages."""
    rng = np.random.default_rng(seed)
    fields = {"k": paged.Field(fmt, D)}
    cache = paged.empty(fields, B, MAX_ENTRIES, PS, dtype=jnp.float32)

    def add(cache, n):
        x = jnp.asarray(rng.standard_normal((B, 9, D)), jnp.float32)
        return paged.append(cache, {"k": x}, jnp.asarray(n, jnp.int32))

    cache = add(cache, [8, 8, 8])
    cache = paged.release(cache, jnp.asarray([False, True, False]))
    cache = add(cache, [9, 5, 7])  # row 1 restarts on a recycled page
    cache = paged.release(cache, jnp.asarray([True, False, False]))
    cache = add(cache, [9, 0, 0])
    cache = add(cache, [8, 0, 0])
    paged.check(cache)
    table = np.asarray(cache.page_table)
    assert np.asarray(cache.length).tolist() == [17, 5, 15]
    assert not all(np.all(np.diff(r[r >= 0]) == 1) for r in table)  # not in pool order
    return fields, cache


def _queries(T, seed=1):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    nv = jnp.asarray(rng.integers(0, MAX_ENTRIES + 3, (B, T)), jnp.int32)
    nv = nv.at[0, 0].set(MAX_ENTRIES)  # one query sees its whole row
    return q, w, nv


# block_k=16 on GPU: two 8-entry pages per program, so a key block spans scrambled pages.
KERNELS = {"tpu": paged_scores_tpu, "gpu": functools.partial(paged_scores_gpu, block_k=16)}
BLOCK = 4  # block maxima over 4 entries (divides PS)


def check_kernel(kernel, fmt, T, cache, interpret, tol=1e-5):
    """kernel == reference_scores: scores truncated to max_entries, and at full width
    (P * page_size, the padded tail invisible) with block maxima == indexer.block_scores."""
    q, w, nv = _queries(T)
    args = (q, w, cache.pages["k"], cache.page_table, cache.length, nv, fmt)
    ref = reference_scores(*args, max_entries=MAX_ENTRIES)
    got = kernel(*args, interpret=interpret, max_entries=MAX_ENTRIES)
    assert got.shape == ref.shape == (B, T, MAX_ENTRIES) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=tol, atol=tol)
    full, maxima = kernel(*args, interpret=interpret, block_max=BLOCK)
    width = cache.page_table.shape[1] * PS
    assert full.shape == (B, T, width) and maxima.shape == (B, T, width // BLOCK)
    np.testing.assert_allclose(np.asarray(full[..., :MAX_ENTRIES]), np.asarray(ref),
                               rtol=tol, atol=tol)
    assert np.all(np.isneginf(np.asarray(full[..., MAX_ENTRIES:])))
    ref_full = reference_scores(*args)
    expected = indexer.block_scores(ref_full, ref_full > -jnp.inf, BLOCK)
    np.testing.assert_allclose(np.asarray(maxima), np.asarray(expected), rtol=tol, atol=tol)
    assert np.any(np.isneginf(np.asarray(maxima))) and np.any(np.isfinite(np.asarray(maxima)))


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_paged_scores_kernel_matches_reference(backend, fmt, T):
    fields, cache = _scrambled_cache(fmt)
    check_kernel(KERNELS[backend], fmt, T, cache, interpret=True)


@pytest.mark.parametrize("fmt", ["native", "fp8_ue8m0"])
def test_tpu_kernel_tiles_many_queries_into_blocks(fmt):
    """A prefill chunk's queries run in blocks of query_block rows (VMEM holds one block):
    19 queries as 3 blocks of 8, the last padded, score as the reference does."""
    fields, cache = _scrambled_cache(fmt)
    check_kernel(functools.partial(paged_scores_tpu, query_block=8), fmt, 19, cache,
                 interpret=True)


def test_tpu_kernel_runs_a_large_batch_as_calls_over_groups_of_rows():
    """A page table larger than SMEM holds runs as a loop of calls over groups of rows: 3 rows
    as 2 groups of 2, the last padded with an empty row, score as the reference does."""
    fields, cache = _scrambled_cache("fp8_ue8m0")
    check_kernel(functools.partial(paged_scores_tpu, rows_per_call=2), "fp8_ue8m0", 3, cache,
                 interpret=True)
    assert rows_per_call_for(8192) == 8  # 32 KiB of table a row at 128K entries, 16 a page
    with pytest.raises(ValueError, match="page table of 100000 pages"):
        rows_per_call_for(100_000)


def test_reference_block_maxima_and_truncation():
    fields, cache = _scrambled_cache("native")
    q, w, nv = _queries(3)
    args = (q, w, cache.pages["k"], cache.page_table, cache.length, nv, "native")
    score, maxima = reference_scores(*args, max_entries=MAX_ENTRIES, block_max=BLOCK)
    np.testing.assert_array_equal(
        np.asarray(maxima), np.asarray(indexer.block_scores(score, score > -jnp.inf, BLOCK)))
    assert maxima.shape == (B, 3, -(-MAX_ENTRIES // BLOCK))


@pytest.mark.parametrize("kernel", [reference_scores, KERNELS["tpu"], KERNELS["gpu"]])
def test_block_max_must_divide_the_page(kernel):
    fields, cache = _scrambled_cache("native")
    q, w, nv = _queries(1)
    with pytest.raises(ValueError, match="block_max=3"):
        kernel(q, w, cache.pages["k"], cache.page_table, cache.length, nv, "native",
               block_max=3)


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_gpu_kernel_lowers_to_triton(fmt):
    """The GPU kernel lowers through the Pallas Triton backend (JAX -> Triton IR) on a CPU-only
    machine: every op, tile shape and dtype it uses has a Triton lowering."""
    fields, cache = _scrambled_cache(fmt)
    q, w, nv = _queries(3)
    f = jax.jit(functools.partial(paged_scores_gpu, fmt=fmt, block_k=16, block_max=BLOCK))
    lowered = f.trace(q, w, cache.pages["k"], cache.page_table, cache.length,
                      nv).lower(lowering_platforms=("cuda",))
    assert "xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("fmt", ["native", "bf16", "fp8_fp32", "fp8_ue8m0", "fp4_ue8m0"])
def test_reference_matches_indexer_scores(fmt):
    """Independent expectation: indexer.scores over read_all's dequantized keys, masked."""
    T = 3
    fields, cache = _scrambled_cache(fmt, seed=2)
    q, w, nv = _queries(T, seed=3)
    ref = reference_scores(q, w, cache.pages["k"], cache.page_table, cache.length,
                           nv, fmt, max_entries=MAX_ENTRIES)
    keys, valid = paged.read_all(cache, "k", jnp.float32)
    dense = indexer.scores(q, w, keys)
    s = jnp.arange(MAX_ENTRIES)[None, None, :]
    vis = valid[:, None, :] & (s < nv[..., None])
    expected = jnp.where(vis, dense, -jnp.inf)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(expected), rtol=1e-5, atol=1e-5)
    # Each row has visible and invisible entries.
    assert np.any(np.isfinite(np.asarray(ref))) and np.any(np.isneginf(np.asarray(ref)))


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_paged_scores_rejects_unsupported_format(backend):
    fields, cache = _scrambled_cache("native")
    q, w, nv = _queries(1)
    with pytest.raises(NotImplementedError, match="fp4_e4m3"):
        KERNELS[backend](q, w, cache.pages["k"], cache.page_table, cache.length, nv,
                         "fp4_e4m3", interpret=True)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"),
                    reason=f"compiled kernels need a GPU or TPU; backend is "
                           f"{jax.default_backend()} (interpret-mode tests above cover CPU)")
class TestCompiled:
    """The backend's own kernel compiled (interpret=False) == reference."""

    @pytest.mark.parametrize("fmt", KERNEL_FORMATS)
    @pytest.mark.parametrize("T", [1, 3])
    def test_compiled_kernel_matches_reference(self, fmt, T):
        fields, cache = _scrambled_cache(fmt)
        check_kernel(KERNELS[jax.default_backend()], fmt, T, cache, interpret=False,
                     tol=1e-4)


@pytest.mark.parametrize("score", [indexer.scores, indexer.gathered_scores])
def test_indexer_scores_ask_for_ieee_float32_dots_on_gpu(score):
    """The indexer's scores decide top-k, and decode scores with a kernel whose dots are IEEE
    float32 (HIGHEST). XLA's default precision on a GPU runs float32 dots in TF32 (10-bit
    mantissa: on an H200 indexer.scores differed from the reference by 1.4%), so the XLA path
    must ask for HIGHEST too, or training and decode may select different entries. Checked on
    the program lowered for CUDA: every dot it holds asks for HIGHEST on both operands."""
    q, w, _ = _queries(3)
    keys = jnp.ones((B, 5, D), jnp.float32)
    if score is indexer.gathered_scores:
        keys = jnp.ones((B, 3, 5, D), jnp.float32)
    text = jax.jit(score).trace(q, w, keys).lower(lowering_platforms=("cuda",)).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all("precision = [HIGHEST, HIGHEST]" in line for line in dots), dots
