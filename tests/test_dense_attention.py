"""The fused dense / window attention kernel (dsattn/kernels/dense_attention.py), run by the
Pallas interpreter on this CPU, against its plain-XLA reference: outputs, lse and the
gradients of q, k, v and the sink for cotangents on both outputs. The reference itself is
checked against jax.nn.dot_product_attention and the sink's closed form. Shapes are tiny and
never multiples of the 16-wide blocks, so every case also reads partial blocks."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn import targets
from dsattn.kernels import dense_attention as da
from dsattn.kernels.dense_attention import Implementation

BLOCKS = dict(block_q=16, block_k=16)  # small blocks: several q and key blocks per row
F32 = dict(rtol=2e-5, atol=2e-5)  # float32: the kernel sums in another order than XLA
F64 = dict(rtol=1e-12, atol=1e-12)


def _arrays(seed, B, Tq, S, H, Hk, dk, dv, dtype, sink: bool):
    """q, k, v, sink (or None) and cotangents for (out, lse); numpy, so building them compiles
    nothing."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape, dt=dtype: rng.standard_normal(shape).astype(dt)  # noqa: E731
    cts = (normal(B, Tq, H, dv), normal(B, Tq, H, dt=da.score_dtype(dtype)))
    return (normal(B, Tq, H, dk), normal(B, S, Hk, dk), normal(B, S, Hk, dv),
            normal(H) if sink else None, cts)


def _read_and_grads(fn, args, cts):
    """fn(*args) = (out, lse) and the cotangents of args for cotangents ``cts`` on (out, lse),
    in one jitted program."""
    def run(*args):
        res, pull = jax.vjp(fn, *args)
        return res, pull(cts)
    return jax.jit(run)(*args)


def _assert_close(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert np.array_equal(np.isneginf(g), np.isneginf(w))
        np.testing.assert_allclose(np.where(np.isneginf(w), 0, g), np.where(np.isneginf(w), 0, w),
                                   **tol)


def _compare(arrays, k_is_v=False, tol=F32, **kw):
    """Kernel (interpreted) vs reference: out, lse, dq, dk, dv (and dsink); returns the
    reference's ((out, lse), grads)."""
    q, k, v, sink, cts = arrays
    args = (q, k) + (() if k_is_v else (v,)) + (() if sink is None else (sink,))

    def read(impl):
        def fn(q, k, *rest):  # rest: (v,) (sink,) (v, sink) or ()
            return da.attention(q, k, k if k_is_v else rest[0], sink=rest[-1] if sink is not
                                None else None, implementation=impl, interpret=True,
                                **BLOCKS, **kw)
        return fn

    want = _read_and_grads(read(Implementation.REFERENCE), args, cts)
    got = _read_and_grads(read(Implementation.PALLAS), args, cts)
    _assert_close(got, want, tol)
    return want


def _positions(B, Tq, S):
    """Keys at 0..S-1, queries at the last Tq of them (chunked prefill: queries at the end of a
    longer key sequence)."""
    kp = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    return kp[:, S - Tq:], kp


def _lengths(S, *n):
    """k_valid [len(n), S]: row b's first n[b] keys valid (padded rows)."""
    return np.arange(S)[None, :] < np.array(n)[:, None]


def test_gqa_window_sink_ragged_offset_positions():
    """GQA (2 query heads per key head), dk=48 / dv=32 (MLA's 192/128 scaled down), causal,
    a window shorter than Tq, the sink, queries at the end of a longer key sequence, and the
    second row padded (its last 6 keys invalid)."""
    B, Tq, S = 2, 20, 37
    qp, kp = _positions(B, Tq, S)
    k_valid = _lengths(S, S, S - 6)
    arrays = _arrays(0, B, Tq, S, 4, 2, 48, 32, jnp.float32, sink=True)
    # window 3: the last key of key blocks 0 and 1 (positions 15, 31) is the oldest key the
    # first query of q blocks 0 and 1 (positions 17, 33) sees, so skipping one block too many
    # changes the result; and key block 2 starts at q block 0's last position (causal edge).
    _compare(arrays, scale=48 ** -0.5, q_positions=qp, k_positions=kp, causal=True, window=3,
             k_valid=k_valid)


def test_mha_window_longer_than_t_and_a_row_that_sees_nothing():
    """MHA, a window longer than the sequence, no sink, keys out of position order in row 1
    (block skipping must not assume sorted keys) and a query that sees no key: row 0's first
    query only sees key 0, which is invalid; that query gets out 0, lse -inf and zero,
    finite gradients."""
    B, T = 2, 19
    qp, kp = _positions(B, T, T)
    kp = kp.copy()
    kp[1] = np.random.default_rng(7).permutation(T)
    k_valid = _lengths(T, T, T)
    k_valid[0, 0] = False
    arrays = _arrays(1, B, T, T, 2, 2, 16, 16, jnp.float32, sink=False)
    (out, lse), grads = _compare(arrays, scale=0.3, q_positions=qp, k_positions=kp,
                                 causal=True, window=100, k_valid=k_valid)
    assert np.all(np.asarray(out[0, 0]) == 0) and np.all(np.isneginf(np.asarray(lse[0, 0])))
    assert np.all(np.isfinite(np.asarray(lse[0, 1:])))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    assert np.all(np.asarray(grads[0][0, 0]) == 0)  # dq of the row that saw nothing


def test_mqa_with_k_is_v_and_sink_not_causal():
    """MQA (one key head for 4 query heads), K = V = one array (V4's entries), no causal mask,
    a sink and ragged key validity: the shared array's gradient is dk + dv."""
    B, Tq, S = 2, 9, 21
    qp, kp = _positions(B, Tq, S)
    k_valid = _lengths(S, S, 11)
    arrays = _arrays(2, B, Tq, S, 4, 1, 32, 32, jnp.float32, sink=True)
    _compare(arrays, k_is_v=True, scale=0.2, q_positions=qp, k_positions=kp, causal=False,
             k_valid=k_valid)


def test_float64_equals_the_reference_to_1e_12():
    """The kernel computes in float64 for float64 inputs (decode == forward checks run in
    float64): GQA, causal, window, sink, offset positions."""
    B, Tq, S = 1, 18, 33
    qp, kp = _positions(B, Tq, S)
    arrays = _arrays(3, B, Tq, S, 4, 2, 32, 16, jnp.float64, sink=True)
    _compare(arrays, tol=F64, scale=0.25, q_positions=qp, k_positions=kp, causal=True,
             window=7)


def _merged(parts):
    """Merge reads of disjoint key sets by their lse."""
    lse = functools.reduce(jnp.logaddexp, [l for _, l in parts])
    safe = jnp.where(jnp.isneginf(lse), 0.0, lse)
    out = sum(jnp.exp(l - safe)[..., None] * o for o, l in parts)
    return out, lse


def test_two_key_halves_merged_by_lse_equal_the_whole_read():
    """A layer reads its window and its compressed entries separately and merges them by
    lse: the merged output, lse and gradients (through both parts' lse) equal one read of all
    keys. Causal, GQA, with positions such that some queries see keys of one half only; the
    kernel at its default block sizes (fitted to these short reads)."""
    B, Tq, S = 2, 17, 34
    qp, kp = _positions(B, Tq, S)
    q, k, v, _, cts = _arrays(4, B, Tq, S, 4, 2, 16, 32, jnp.float32, sink=False)
    kw = dict(scale=0.3, q_positions=qp, causal=True, window=12)
    half = S // 2

    def whole(q, k, v):
        return da.reference(q, k, v, k_positions=kp, **kw)

    def parts(q, k, v):
        return _merged([da.attention(q, k[:, sl], v[:, sl], k_positions=kp[:, sl],
                                     interpret=True, **kw)  # the default blocks
                        for sl in (slice(None, half), slice(half, None))])

    _assert_close(_read_and_grads(parts, (q, k, v), cts),
                  _read_and_grads(whole, (q, k, v), cts), F32)


def test_reference_equals_jax_dot_product_attention_and_the_sink_closed_form():
    """Independent expectations for the oracle: jax.nn.dot_product_attention (XLA, GQA, the
    visibility as a boolean mask) without a sink; with a sink, lse = logaddexp(lse_0, sink)
    and out = out_0 * exp(lse_0 - lse)."""
    B, Tq, S, H, Hk = 2, 6, 10, 4, 2
    qp, kp = _positions(B, Tq, S)
    k_valid = _lengths(S, S, 8)
    q, k, v, sink, _ = _arrays(5, B, Tq, S, H, Hk, 8, 8, jnp.float64, sink=True)
    kw = dict(scale=0.4, q_positions=qp, k_positions=kp, causal=True, window=4,
              k_valid=k_valid)
    mask = da.visible(qp, kp, k_valid, causal=True, window=4)[:, None]  # [B, 1, Tq, S]

    @jax.jit
    def reads(q, k, v, sink):
        return (da.reference(q, k, v, **kw), da.reference(q, k, v, sink=sink, **kw),
                jax.nn.dot_product_attention(q, k, v, mask=mask, scale=0.4))

    (out0, lse0), (out, lse), want = jax.tree.map(np.asarray, reads(q, k, v, sink))
    # jax computes its softmax in float32 even for float64 inputs
    np.testing.assert_allclose(out0, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, np.logaddexp(lse0, sink), **F64)
    np.testing.assert_allclose(out, out0 * np.exp(lse0 - lse)[..., None], **F64)


def test_lowers_for_cuda_inside_jit_and_grad():
    """The forward and both backward kernels lower through Pallas's Triton backend for CUDA on
    this CPU (every op, tile shape and dtype has a Triton lowering), at MLA's head dims
    (dk=192 read as 128 + 64) in bfloat16, GQA rows with the sink and a window."""
    B, Tq, S, H, Hk = 1, 24, 40, 4, 2
    q = jnp.zeros((B, Tq, H, 192), jnp.bfloat16)
    k = jnp.zeros((B, S, Hk, 192), jnp.bfloat16)
    v = jnp.zeros((B, S, Hk, 128), jnp.bfloat16)
    qp, kp = _positions(B, Tq, S)

    def loss(q, k, v, sink):
        out, lse = da.attention(q, k, v, scale=192 ** -0.5, q_positions=qp, k_positions=kp,
                                window=16, sink=sink, **BLOCKS)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(
        q, k, v, jnp.zeros((H,), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("dense_attention_fwd", "dense_attention_dq", "dense_attention_dkv"):
        assert name in text, name
    assert text.count("xla.gpu.triton") == 3


@pytest.mark.parametrize("change, match", [
    (dict(k=jnp.zeros((1, 5, 3, 16)), v=jnp.zeros((1, 5, 3, 16))), "not a multiple of 3 key heads"),
    (dict(v=jnp.zeros((1, 4, 2, 16))), "must share"),
    (dict(sink=jnp.zeros((3,))), "sink must be"),
    (dict(window=0), "window=0"),
    (dict(block_k=24), "block_k=24 must be a power of two"),
    (dict(q=jnp.zeros((1, 3, 4, 8)), k=jnp.zeros((1, 5, 2, 8))), "multiples of 16"),
])
def test_bad_inputs_are_named(change, match):
    args = dict(q=jnp.zeros((1, 3, 4, 16)), k=jnp.zeros((1, 5, 2, 16)),
                v=jnp.zeros((1, 5, 2, 16)), scale=1.0,
                q_positions=jnp.zeros((1, 3), jnp.int32),
                k_positions=jnp.zeros((1, 5), jnp.int32), interpret=True)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        da.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason=f"the compiled kernel needs an NVIDIA GPU; backend is "
                           f"{jax.default_backend()} (the interpreted tests above cover CPU)")
def test_compiled_kernel_equals_the_reference_on_a_gpu():
    """Compiled by Triton (interpret=False): GQA, causal, window, sink, ragged rows. float32
    inputs run TF32 dots on a GPU (10-bit mantissa), hence the tolerance."""
    B, Tq, S = 2, 40, 77
    qp, kp = _positions(B, Tq, S)
    arrays = _arrays(6, B, Tq, S, 8, 2, 64, 32, jnp.float32, sink=True)
    q, k, v, sink, cts = arrays
    kw = dict(scale=0.125, q_positions=qp, k_positions=kp, window=9,
              k_valid=_lengths(S, S, S - 10))
    want = _read_and_grads(lambda q, k, v, s: da.reference(q, k, v, sink=s, **kw),
                           (q, k, v, sink), cts)
    got = _read_and_grads(lambda q, k, v, s: da.attention(q, k, v, sink=s, **BLOCKS, **kw),
                          (q, k, v, sink), cts)
    _assert_close(got, want, dict(rtol=1e-2, atol=1e-2))


@pytest.mark.parametrize("smem_kib, tiles", [(2048, (64, 64, 128, 2)), (227, (64, 32, 128, 2)),
                                             (100, (64, 32, 64, 1))])
def test_tiles_shrink_to_the_gpus_shared_memory(smem_kib, tiles):
    """d = 256 (dk + dv = 512 channels): an H100's 227 KiB takes 32 keys a step (64 would
    ask for 257 KiB, as compiled), a roomier GPU the defaults, a smaller one fewer rows; the
    chosen programs fit by the measured model."""
    h100 = targets.load("h100")
    gpu = dataclasses.replace(h100, gpu={**h100.gpu,
                                         "shared_memory_per_block_optin": smem_kib * 1024})
    with targets.building_for(gpu):
        got = da._fitting_tiles(512, None, None, None)
    assert got == tiles
    bq, bk, rows, stages = got
    assert da.smem_bytes(512, rows, bk, stages) <= smem_kib * 1024
