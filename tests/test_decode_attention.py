"""The fused decode read (dsattn/kernels/decode_attention.py): its reference equals today's
decode attention (`reference.block_attention` over the parts the layers build: the V4
core's ring read before the write + the step's own key and the picks `paged.gather`
returns; MLA's contiguous cache decoded whole + the step's own latent), and the kernel
(Pallas interpreter on CPU) equals the reference, for the stored formats the presets use;
and the kernel lowers for CUDA.

Inputs: 3 rows with ragged lengths appended in two rounds (page tables interleave), a row
whose window is not yet full, k above the available entries (-1 ids, and ids past a row's
length), a sink; a contiguous cache with an empty row and a row whose own token is padding;
value channels fewer than the entry's (MLA's latent without its rotary dims)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn.attention import reference
from dsattn.cache import contiguous, formats, paged, ring
from dsattn.kernels import decode_attention as da

B, H, C, R, W, K, PS = 3, 4, 128, 64, 8, 20, 4
SCALE = 0.07  # not C ** -0.5 in the kernel test: a kernel with its own rule would differ
NARROW = W - 3  # the kernel test's window, narrower than the ring: its mask decides
L, CM, DC = 40, 192, 128  # MLA: cache slots, latent + rotary dims (R), the latent's
_append, _write = jax.jit(paged.append), jax.jit(ring.write)  # the state: few compiles


def _f32(rng):
    return lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731


def _state(local_fmt, main_fmt, seed=0, c=C):
    """(q, q_pos, ring after the step's write, ring before it, the step's key, paged cache,
    idx, sink); entries c wide."""
    rng = np.random.default_rng(seed)
    f32 = _f32(rng)
    cache = paged.empty({"entry": paged.Field(main_fmt, c, R)}, B, 24, PS)
    for n in ([5, 9, 0], [7, 2, 3]):  # ragged rows, interleaved pages
        cache = _append(cache, {"entry": f32(B, 9, c)}, jnp.asarray(n))
    lengths = np.asarray(cache.length)
    idx = np.full((B, K), -1, np.int32)
    for b in range(B):
        got = rng.permutation(lengths[b])[:6]
        idx[b, :len(got)] = got
        idx[b, 8] = lengths[b] + 1  # past the row's entries: no pick
        rng.shuffle(idx[b])
    pos = np.array([30, 5, 11])  # row 1: window not yet full
    r = ring.empty(local_fmt, B, W, c, R, jnp.float32)
    hist = np.arange(31)
    r = _write(r, f32(B, 31, c), jnp.asarray(np.stack([hist] * B)),
               jnp.asarray(hist[None] < pos[:, None]))
    kv = f32(B, 1, c)
    after = _write(r, kv, jnp.asarray(pos[:, None]), jnp.ones((B, 1), bool))
    return (f32(B, H, c), jnp.asarray(pos, jnp.int32), after, r, kv, cache,
            jnp.asarray(idx), 0.5 * f32(H))


def _latents(fmt, seed=0):
    """MLA's decode step: (q, q_pos, the contiguous cache's Slots before the step, the
    step's latent [B, 1, C], whether it is a real token [B])."""
    rng = np.random.default_rng(seed)
    f32 = _f32(rng)
    stored = formats.encode(fmt, f32(B, L, CM), R)
    pos = jnp.asarray([33, 0, 45], jnp.int32)  # row 1: nothing cached yet
    valid = jnp.asarray([True, True, False])  # row 2: a padded token past the capacity L
    return (f32(B, H, CM), pos, contiguous.Slots(stored, pos, fmt, R), f32(B, 1, CM), valid)


def _mla_parts(slots, fresh, pos, valid):
    return [da.prefix(slots.stored, slots.fmt, slots.rope, slots.count),
            da.values(fresh, jnp.where(valid, pos, -1)[:, None])]


V4 = ("fp8_ue8m0_rope_bf16", "fp8_ue8m0_rope_bf16")  # configs/deepseek/v4_flash.yaml
V41 = ("fp8_ue8m0", "fp4_e4m3")  # configs/deepseek/v4_1_flash.yaml
FAST = [V4, V41]
FULL = [("bf16", "bf16"), ("native", "native"), ("bf16", "fp4_ue8m0")]
CASES = FAST + [pytest.param(*f, marks=pytest.mark.full) for f in FULL]
MLA_FORMATS = ["bf16", pytest.param("fp8_ds_mla", marks=pytest.mark.full)]  # v2/v3, v3.2


@pytest.mark.parametrize("local_fmt,main_fmt", CASES)
def test_reference_is_todays_decode_attention(local_fmt, main_fmt):
    q, pos, after, before, kv, cache, idx, sink = _state(local_fmt, main_fmt)
    keys, key_pos = ring.local_keys(before, jnp.float32, kv, pos[:, None],
                                    jnp.ones((B, 1), bool), W)
    picked, got = cache.gather("entry", idx[:, None], jnp.float32)
    today, _ = reference.block_attention(q[:, None], [(picked, got),
                                        (keys, ring.window_mask(key_pos, pos[:, None], W))],
                                         sink)
    out, lse = da.reference(q, pos, [da.picks(cache, idx), da.window(after, W)],
                            scale=C ** -0.5, sink=sink)
    np.testing.assert_allclose(out, today[:, 0], rtol=2e-5, atol=2e-5)
    # lse: the sink and the read keys' exp-sum, independently
    mask = jnp.concatenate([got[:, 0], ring.window_mask(key_pos, pos[:, None], W)[:, 0]], 1)
    ent = jnp.concatenate([picked[:, 0], keys], 1)
    s = jnp.where(mask[:, None], jnp.einsum("bhc,bsc->bhs", q, ent) * C ** -0.5, -jnp.inf)
    want = jnp.log(jnp.exp(s).sum(-1) + jnp.exp(sink))
    np.testing.assert_allclose(lse, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("local_fmt,main_fmt", CASES)
@pytest.mark.parametrize("splits", [2, 1])  # 1: one program walks both blocks of picks
def test_kernel_equals_reference(local_fmt, main_fmt, splits):
    q, pos, after, _, _, cache, idx, sink = _state(local_fmt, main_fmt, seed=1)
    parts = lambda r, c, i: [da.picks(c, i), da.window(r, NARROW)]  # noqa: E731
    want = da.reference(q, pos, parts(after, cache, idx), scale=SCALE, sink=sink)
    got = jax.jit(lambda q, pos, r, c, i, s: da.attention(
        q, pos, parts(r, c, i), scale=SCALE, sink=s, block_k=16, splits=splits,
        interpret=True))(q, pos, after, cache, idx, sink)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_heads_past_a_block_take_programs_of_their_own():
    """40 heads in blocks of 16 (3 blocks, the last 8 heads padding): each block of heads
    walks the entries itself and every head equals the reference."""
    _, pos, after, _, _, cache, idx, _ = _state(*V41, seed=7)
    rng = np.random.default_rng(8)
    q, sink = jnp.asarray(rng.standard_normal((B, 40, C)), jnp.float32), jnp.asarray(
        rng.standard_normal(40), jnp.float32)
    parts = lambda r, c, i: [da.picks(c, i), da.window(r, NARROW)]  # noqa: E731
    want = da.reference(q, pos, parts(after, cache, idx), scale=SCALE, sink=sink)
    got = jax.jit(lambda q, r, c, i, s: da.attention(
        q, pos, parts(r, c, i), scale=SCALE, sink=s, block_k=16, splits=2, head_block=16,
        interpret=True))(q, after, cache, idx, sink)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_mla_reference_is_the_contiguous_cache_decoded_whole():
    q, pos, slots, fresh, valid = _latents("fp8_ds_mla")
    cached = formats.decode("fp8_ds_mla", slots.stored)
    before = jnp.arange(L)[None] < pos[:, None]
    today, _ = reference.block_attention(q[:, None], [(cached, before[:, None]),
                                                      (fresh, valid[:, None, None])], None)
    out, lse = da.reference(q, pos, _mla_parts(slots, fresh, pos, valid), scale=CM ** -0.5,
                            value_dim=DC)
    assert out.shape == (B, H, DC)
    np.testing.assert_allclose(out, today[:, 0, :, :DC], rtol=2e-5, atol=2e-5)
    assert np.all(np.isfinite(lse[:2])) and np.all(np.isfinite(lse[2]))  # row 2 reads its cache


@pytest.mark.parametrize("fmt", MLA_FORMATS)
@pytest.mark.parametrize("splits", [2, 1])
def test_mla_kernel_equals_reference(fmt, splits):
    """MLA's absorbed decode: the contiguous cache's slots before the step (one page per
    row, walked by bound: row 0's 3 live blocks shared by 2 programs, or all walked by one;
    the empty row walks none) and the step's own latent; value channels DC < C. A slot
    count past the cache's capacity reads the capacity."""
    q, pos, slots, fresh, valid = _latents(fmt, seed=2)
    parts = _mla_parts(slots, fresh, pos, valid)
    want = da.reference(q, pos, parts, scale=SCALE, value_dim=DC)
    got = jax.jit(lambda q, pos, sl, f, v: da.attention(
        q, pos, _mla_parts(sl, f, pos, v), scale=SCALE, value_dim=DC, block_k=16,
        splits=splits, interpret=True))(q, pos, slots, fresh, valid)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_dsa_and_hca_reads_equal_the_reference():
    """DSA: picked tokens of an fp8_ds_mla paged cache, value channels DC, no window, no
    sink. HCA: every entry complete at q_pos (stride 2), which equals the picks of those
    ids."""
    _, pos, _, _, _, cache, idx, _ = _state("bf16", "fp8_ds_mla", seed=3, c=CM)
    q = _f32(np.random.default_rng(4))(B, H, CM)
    run = jax.jit(lambda q, pos, c, i: (
        da.attention(q, pos, [da.picks(c, i)], scale=SCALE, value_dim=DC, block_k=16,
                     splits=2, interpret=True),
        da.attention(q, pos, [da.visible(c, pos, 2)], scale=SCALE, block_k=16, splits=2,
                     interpret=True)))
    (dsa, dsa_lse), (hca, hca_lse) = run(q, pos, cache, idx)
    want = da.reference(q, pos, [da.picks(cache, idx)], scale=SCALE, value_dim=DC)
    np.testing.assert_allclose(dsa, want[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dsa_lse, want[1], rtol=2e-5, atol=2e-5)
    ids = jnp.arange(24)[None]
    complete = jnp.where(ids < ((pos + 1) // 2)[:, None], ids, -1)
    want = da.reference(q, pos, [da.picks(cache, complete)], scale=SCALE)
    np.testing.assert_allclose(hca, want[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(hca_lse, want[1], rtol=2e-5, atol=2e-5)


def test_bad_reads_are_refused():
    q, pos, after, _, _, cache, idx, _ = _state(*V41)
    with pytest.raises(ValueError, match="nothing to read"):
        da.attention(q, pos, [], scale=SCALE)
    with pytest.raises(ValueError, match="head_block"):
        da.attention(q, pos, [da.picks(cache, idx)], scale=SCALE, head_block=24)
    with pytest.raises(ValueError, match="value_dim"):
        da.attention(q, pos, [da.picks(cache, idx)], scale=SCALE, value_dim=C + 1)
    with pytest.raises(ValueError, match="width 96"):
        da.attention(q[..., :96], pos, [da.picks(cache, idx)], scale=SCALE)
    with pytest.raises(ValueError, match="4 rows"):
        da.attention(jnp.concatenate([q, q[:1]]), jnp.concatenate([pos, pos[:1]]),
                     [da.window(after, W)], scale=SCALE)


def test_lowers_for_cuda():
    q, pos, after, _, _, cache, idx, sink = _state(*V41)
    f = jax.jit(lambda q, pos, r, c, i, s: da.attention(
        q.astype(jnp.bfloat16), pos, [da.picks(c, i), da.window(r, W)], scale=SCALE, sink=s))
    text = f.trace(q, pos, after, cache, idx, sink).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1
    q, pos, slots, fresh, valid = _latents("bf16")
    g = jax.jit(lambda q, pos, sl, f, v: da.attention(
        q.astype(jnp.bfloat16), pos, _mla_parts(sl, f.astype(jnp.bfloat16), pos, v),
        scale=SCALE, value_dim=DC))
    text = g.trace(q, pos, slots, fresh, valid).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason=f"the compiled kernel needs an NVIDIA GPU; backend is "
                           f"{jax.default_backend()} (the interpreted tests above cover CPU)")
@pytest.mark.parametrize("formats_", [V4, V41, ("bf16", "fp8_ds_mla")])
def test_compiled_kernel_equals_the_reference_on_a_gpu(formats_):
    """Compiled by Triton (interpret=False), bfloat16 queries: the V4 read (picks, window,
    sink), MLA's (a contiguous prefix by bound and the step's own latent, value channels DC)
    and DSA's (picks, value channels DC)."""
    c = CM if formats_[1] == "fp8_ds_mla" else C
    q, pos, after, _, _, cache, idx, sink = _state(*formats_, seed=5, c=c)
    q = q.astype(jnp.bfloat16)
    reads = [([da.picks(cache, idx), da.window(after, NARROW)], sink, None)]
    if c == CM:
        _, _, slots, fresh, valid = _latents("bf16", seed=6)
        reads = [([da.picks(cache, idx)], None, DC),
                 (_mla_parts(slots, fresh.astype(jnp.bfloat16), pos, valid), None, DC)]
    for parts, s, dv in reads:
        want = da.reference(q, pos, parts, scale=SCALE, sink=s, value_dim=dv)
        got = jax.jit(lambda q, parts, s: da.attention(q, pos, parts, scale=SCALE, sink=s,
                                                      value_dim=dv))(q, parts, s)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       rtol=2e-2, atol=2e-2)
