"""The fused selected-entries read (dsattn/kernels/sparse_attention.py) against its jnp
reference and today's XLA path (attention/reference.py's `block_attention` over picks gathered by
attention/reads.py), in the generic Pallas interpreter on CPU; and its lowering for CUDA
inside jit + grad.

One input set serves every numeric test: 5 queries (block_t=2: not a multiple), 20 picks per
query over 7 entries (block_k=16: two pick blocks, the second part padding; k above the
available entries, so most ids are -1), ids out of range on both sides, duplicate ids (one
within a block, one across the two blocks), and two queries with no valid pick. The
backward runs in chunks of one query block (bwd_bytes=1). The kernel's jitted forward +
VJP + entry mass is compiled once per variant (`_kernel`) and shared by the tests.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn.attention import reads, reference
from dsattn import targets
from dsattn.kernels import sparse_attention as sa

B, T, H, C, N, K = 2, 5, 3, 24, 7, 20
SCALE = 0.3  # not C ** -0.5: a kernel that scaled by its own rule would differ
TILES = dict(block_t=2, block_k=16)
EMPTY = [(0, 0), (1, 4)]  # queries with no valid pick
TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.float64: dict(rtol=1e-12, atol=1e-12)}


def _inputs(dtype, seed=0):
    """(q, store, idx, sink, cotangent on out, cotangent on lse)."""
    rng = np.random.default_rng(seed)
    idx = np.full((B, T, K), -1, np.int32)
    for b in range(B):
        for t in range(T):
            avail = rng.integers(1, N + 1)  # a selection of k above the available entries
            idx[b, t, :avail] = rng.permutation(N)[:avail]
            rng.shuffle(idx[b, t])  # no-picks anywhere, not only at the end
    idx[0, 0] = -1
    idx[1, 4] = rng.choice([-3, -1, N, N + 5], K)  # out of range on both sides
    idx[1, 0, 5] = N + 2
    idx[0, 2, 0], idx[0, 2, K - 1] = 3, 3  # a duplicate across the two pick blocks
    idx[1, 1, 2], idx[1, 1, 3] = 6, 6  # and one within a block
    f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    return f(B, T, H, C), f(B, N, C), jnp.asarray(idx), f(H), f(B, T, H, C), f(B, T, H)


def _read_and_vjp(read, q, store, idx, sink, ct_out, ct_lse):
    """(out, lse, (dq, dstore[, dsink])) of a read, pulled back from cotangents on both."""
    args = (q, store) if sink is None else (q, store, sink)
    f = (lambda q, s: read(q, s, idx)) if sink is None else \
        (lambda q, s, sk: read(q, s, idx, sink=sk))
    (out, lse), pull = jax.vjp(f, *args)
    return out, lse, pull((ct_out, ct_lse))


@functools.cache
def _kernel(with_sink: bool):
    """The fused read's out, lse, gradients and entry mass, jitted once per variant."""
    read = functools.partial(sa.attention, scale=SCALE, interpret=True, bwd_bytes=1, **TILES)

    def run(q, store, idx, sink, ct_out, ct_lse):
        out, lse, grads = _read_and_vjp(read, q, store, idx, sink if with_sink else None,
                                        ct_out, ct_lse)
        mass = sa.entry_mass(q, store, idx, lse, scale=SCALE, interpret=True, **TILES)
        return out, lse, grads, mass

    return jax.jit(run)


@functools.partial(jax.jit, static_argnums=6)
def _reference(q, store, idx, sink, ct_out, ct_lse, with_sink):
    read = functools.partial(sa.reference, scale=SCALE)
    out, lse, grads = _read_and_vjp(read, q, store, idx, sink if with_sink else None,
                                    ct_out, ct_lse)
    return out, lse, grads, sa.entry_mass_reference(q, store, idx, lse, scale=SCALE)


def _close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL[dtype])


@pytest.mark.parametrize("with_sink", [True, False])
def test_read_and_gradients_equal_the_reference(with_sink):
    """out, lse and dq, dstore (and dsink), from cotangents on out and on lse, in float32."""
    args = _inputs(jnp.float32)
    got = _kernel(with_sink)(*args)
    want = _reference(*args, with_sink)
    assert got[0].shape == (B, T, H, C) and got[0].dtype == jnp.float32
    assert got[1].shape == (B, T, H) and got[1].dtype == jnp.float32
    _close(got[0], want[0], jnp.float32)
    _close(got[1], want[1], jnp.float32)
    assert len(got[2]) == (3 if with_sink else 2)
    for g, w in zip(got[2], want[2]):
        _close(g, w, jnp.float32)


@pytest.mark.full
def test_read_and_gradients_equal_the_reference_in_float64():
    args = _inputs(jnp.float64)
    read = functools.partial(sa.attention, scale=SCALE, interpret=True, bwd_bytes=1, **TILES)
    got = jax.jit(functools.partial(_read_and_vjp, read))(*args)
    want = jax.jit(functools.partial(_read_and_vjp, functools.partial(sa.reference,
                                                                      scale=SCALE)))(*args)
    assert got[0].dtype == got[1].dtype == jnp.float64
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _close(g, w, jnp.float64)


@pytest.mark.parametrize("with_sink", [True, False])
def test_a_query_with_no_pick_reads_zero_with_finite_gradients(with_sink):
    """No valid id (all -1, or out of range): out 0; lse the sink (or -inf); no gradient
    reaches its query, and nothing anywhere is NaN."""
    args = _inputs(jnp.float32)
    out, lse, grads, mass = _kernel(with_sink)(*args)
    sink = np.asarray(args[3])
    for b, t in EMPTY:
        assert np.all(np.asarray(out[b, t]) == 0)
        want = sink if with_sink else np.full(H, -np.inf)
        np.testing.assert_allclose(np.asarray(lse[b, t]), want, rtol=1e-6)
        assert np.all(np.asarray(grads[0][b, t]) == 0)
        assert np.all(np.asarray(mass[b, t]) == 0)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("with_sink", [True, False])
def test_entry_mass_equals_the_reference_and_sums_to_the_heads(with_sink):
    """Per pick, the probability summed over heads; with the sink's mass every query sums to
    H (without a sink: H where it has a pick, 0 where not); no pick weighs 0."""
    args = _inputs(jnp.float32)
    _, lse, _, mass = _kernel(with_sink)(*args)
    want = jax.jit(functools.partial(sa.entry_mass_reference, scale=SCALE))(*args[:3], lse)
    assert mass.shape == (B, T, K) and mass.dtype == jnp.float32
    _close(mass, want, jnp.float32)
    idx = np.asarray(args[2])
    assert np.all(np.asarray(mass)[(idx < 0) | (idx >= N)] == 0)
    total = np.asarray(mass).sum(-1)
    if with_sink:
        total += np.exp(np.asarray(args[3])[None, None] - np.asarray(lse)).sum(-1)
        np.testing.assert_allclose(total, H, rtol=1e-5)
    else:
        has = np.any((idx >= 0) & (idx < N), axis=-1)
        np.testing.assert_allclose(total, np.where(has, H, 0), rtol=1e-5, atol=1e-6)


def _window(seed=1, size=6):
    """A dense part: entries [B, S, C] shared by the queries, with a visibility mask."""
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T, size)) < 0.6
    mask[0, 0] = False  # the query with no pick sees no window entry either: the sink alone
    return jnp.asarray(rng.standard_normal((B, size, C)), jnp.float32), jnp.asarray(mask)


def test_merging_with_a_dense_part_by_lse_equals_the_xla_path():
    """The fused read of the picks merged by lse with a separately read window equals
    reference.block_attention's one softmax over [picks | window] with the sink: out, the gradients of q,
    the store and the sink (the merge sends a cotangent into the read's lse), and the
    indexer's KL target (the picks' probabilities summed over heads) from the merged lse."""
    q, store, idx, sink, ct_out, _ = _inputs(jnp.float32)
    win, win_mask = _window()
    win_ids = jnp.where(win_mask, jnp.arange(win.shape[1]), -1)

    def merge(o_s, lse_s, q):
        o_d, lse_d = sa.reference(q, win, win_ids, scale=SCALE)
        lse = jnp.logaddexp(lse_s, lse_d)
        w = lambda l: jnp.exp(l - lse)[..., None]  # noqa: E731
        return w(lse_s) * o_s + w(lse_d) * o_d, lse

    # today's XLA path: core scales by C ** -0.5, so it gets q rescaled to SCALE
    def xla(q, store, sink):
        vals, picked = reads.Entries({"entry": store}).gather("entry", idx)
        out, probs = reference.block_attention(q * (SCALE * C ** 0.5), [(vals, picked), (win, win_mask)],
                                 sink)
        return out, probs[0].sum(axis=2)

    @jax.jit
    def xla_and_vjp(q, store, sink):
        (out, mass), pull = jax.vjp(xla, q, store, sink)
        return out, mass, pull((ct_out, jnp.zeros_like(mass)))

    xla_out, xla_mass, xla_grads = xla_and_vjp(q, store, sink)

    o_s, lse_s, _, _ = _kernel(True)(q, store, idx, sink, ct_out, jnp.zeros((B, T, H), jnp.float32))

    @jax.jit
    def merged_and_vjp(o_s, lse_s, q):
        (out, lse), pull = jax.vjp(merge, o_s, lse_s, q)
        return out, lse, pull((ct_out, jnp.zeros_like(lse)))

    out, lse, (ct_o_s, ct_lse_s, dq_dense) = merged_and_vjp(o_s, lse_s, q)
    assert np.any(np.asarray(ct_lse_s) != 0)  # the merge does send a cotangent into lse
    _, _, (dq, dstore, dsink), _ = _kernel(True)(q, store, idx, sink, ct_o_s, ct_lse_s)
    mass = sa.entry_mass(q, store, idx, lse, scale=SCALE, interpret=True, **TILES)

    _close(out, xla_out, jnp.float32)
    _close(mass, xla_mass, jnp.float32)
    for g, w in zip((dq + dq_dense, dstore, dsink), xla_grads):
        _close(g, w, jnp.float32)


@pytest.mark.full
def test_bfloat16_inputs_stay_within_their_rounding_of_the_float32_reference():
    """bfloat16 q, store and cotangents (float32 sink and lse cotangent): the kernel's
    float32 accumulation (p and ds cast to bfloat16 for their matmuls, as flash attention
    does) stays within 2% of each output's largest magnitude of the float32 reference."""
    q, store, idx, sink, ct_out, ct_lse = _inputs(jnp.bfloat16)
    args = (q, store, idx, sink.astype(jnp.float32), ct_out, ct_lse.astype(jnp.float32))
    read = functools.partial(sa.attention, scale=SCALE, interpret=True, bwd_bytes=1, **TILES)
    got = jax.jit(functools.partial(_read_and_vjp, read))(*args)
    wide = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    want = jax.jit(functools.partial(_read_and_vjp, functools.partial(sa.reference,
                                                                      scale=SCALE)))(*wide)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g.astype(jnp.float32)), np.asarray(w)
        seen = np.isfinite(w)
        assert np.array_equal(np.isfinite(g), seen)
        np.testing.assert_allclose(g[seen], w[seen], rtol=0, atol=0.02 * np.abs(w[seen]).max())


@pytest.mark.full
def test_a_separate_value_equals_the_reference():
    """V != K: value [B, N, dv] (dv=8, padded to 16 in-kernel), no sink; out, lse and the
    gradients of q, the store and the value."""
    q, store, idx, _, _, ct_lse = _inputs(jnp.float32)
    rng = np.random.default_rng(3)
    value = jnp.asarray(rng.standard_normal((B, N, 8)), jnp.float32)
    ct_out = jnp.asarray(rng.standard_normal((B, T, H, 8)), jnp.float32)

    def run(read):
        (out, lse), pull = jax.vjp(lambda q, s, v: read(q, s, idx, value=v), q, store, value)
        return out, lse, pull((ct_out, ct_lse))

    got = jax.jit(lambda: run(functools.partial(sa.attention, scale=SCALE, interpret=True,
                                                bwd_bytes=1, **TILES)))()
    want = jax.jit(lambda: run(functools.partial(sa.reference, scale=SCALE)))()
    assert got[0].shape == (B, T, H, 8)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _close(g, w, jnp.float32)


def test_the_training_step_lowers_for_cuda_with_the_gather_inside_the_kernel():
    """jit(grad) of a loss over the fused read and the entry mass lowers for CUDA on this
    CPU (Pallas -> Triton IR: every op, tile and dtype has a Triton lowering), in bfloat16
    with a sink: forward, backward and mass are Triton calls, and the program around them
    holds no gather (the picks are gathered inside the kernels)."""
    q = jax.ShapeDtypeStruct((B, T, H, C), jnp.bfloat16)
    store = jax.ShapeDtypeStruct((B, N, C), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((B, T, K), jnp.int32)
    sink = jax.ShapeDtypeStruct((H,), jnp.float32)

    def loss(q, store, sink, idx):
        out, lse = sa.attention(q, store, idx, scale=SCALE, sink=sink, **TILES)
        mass = sa.entry_mass(q, store, idx, lse, scale=SCALE, **TILES)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse) + jnp.sum(mass)

    # the loss's value too: the mass has no gradient, so grad alone drops its kernel
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    text = step.trace(q, store, sink, idx).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3
    assert "stablehlo.gather" not in text


@pytest.mark.parametrize("bad, message", [
    (dict(idx=jnp.zeros((B, T, K), jnp.float32)), "integer ids"),
    (dict(sink=jnp.zeros((H + 1,))), "one logit per head"),
    (dict(value=jnp.zeros((B, N + 1, 8))), "value must be"),
    (dict(store=jnp.zeros((B, N, C + 1))), "disagree"),
    (dict(idx=jnp.zeros((B, T, 0), jnp.int32)), "nothing to read"),
    (dict(store=jnp.zeros((B, N, C), jnp.bfloat16)), "share a dtype"),
])
def test_bad_inputs_are_refused_with_a_clear_error(bad, message):
    args = dict(q=jnp.zeros((B, T, H, C)), store=jnp.zeros((B, N, C)),
                idx=jnp.zeros((B, T, K), jnp.int32))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        sa.attention(scale=SCALE, interpret=True, **args)


def test_picks_per_step_shrink_to_the_gpus_shared_memory():
    """An H100's 227 KiB: V4's 256-wide entries take 64 picks a step, DSA's 288-wide latents
    (padded to 512) 32 (64 asks for 273 KiB, as compiled); a GPU with half the room, 16."""
    h100 = targets.load("h100")
    assert (sa.fitting_block_k(12, 256), sa.fitting_block_k(12, 288, 256)) == (64, 32)
    half = dataclasses.replace(h100, gpu={**h100.gpu, "shared_memory_per_block_optin": 100 << 10})
    with targets.building_for(half):
        assert (sa.fitting_block_k(12, 256), sa.fitting_block_k(12, 288, 256)) == (32, 16)
