"""The fused decode read (dsattn/kernels/decode_attention.py): its reference equals today's
decode attention (`reference.block_attention`, the V4 core's read, over the parts `V4Attention.extend` builds: the ring read
before the write + the step's own key, and the picks `paged.gather` returns), and the kernel
(Pallas interpreter on CPU) equals the reference, for the stored formats the V4 presets use;
and the kernel lowers for CUDA.

Inputs: 3 rows with ragged lengths appended in two rounds (page tables interleave), a row
whose window is not yet full, k above the available entries (-1 ids, and ids past a row's
length), a sink."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn.attention import reference
from dsattn.cache import paged, ring
from dsattn.kernels import decode_attention as da

B, H, C, R, W, K, PS = 3, 4, 128, 64, 8, 20, 4
SCALE = 0.07  # not C ** -0.5 in the kernel test: a kernel with its own rule would differ
NARROW = W - 3  # the kernel test's window, narrower than the ring: its mask decides
_append, _write = jax.jit(paged.append), jax.jit(ring.write)  # the state: few compiles


def _state(local_fmt, main_fmt, seed=0):
    """(q, q_pos, ring after the step's write, ring before it, the step's key, paged cache,
    idx, sink)."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    cache = paged.empty({"entry": paged.Field(main_fmt, C, R)}, B, 24, PS)
    for n in ([5, 9, 0], [7, 2, 3]):  # ragged rows, interleaved pages
        cache = _append(cache, {"entry": f32(B, 9, C)}, jnp.asarray(n))
    lengths = np.asarray(cache.length)
    idx = np.full((B, K), -1, np.int32)
    for b in range(B):
        got = rng.permutation(lengths[b])[:6]
        idx[b, :len(got)] = got
        idx[b, 8] = lengths[b] + 1  # past the row's entries: no pick
        rng.shuffle(idx[b])
    pos = np.array([30, 5, 11])  # row 1: window not yet full
    r = ring.empty(local_fmt, B, W, C, R, jnp.float32)
    hist = np.arange(31)
    r = _write(r, f32(B, 31, C), jnp.asarray(np.stack([hist] * B)),
                   jnp.asarray(hist[None] < pos[:, None]))
    kv = f32(B, 1, C)
    after = _write(r, kv, jnp.asarray(pos[:, None]), jnp.ones((B, 1), bool))
    return (f32(B, H, C), jnp.asarray(pos, jnp.int32), after, r, kv, cache,
            jnp.asarray(idx), 0.5 * f32(H))


V4 = ("fp8_ue8m0_rope_bf16", "fp8_ue8m0_rope_bf16")  # configs/deepseek/v4_flash.yaml
V41 = ("fp8_ue8m0", "fp4_e4m3")  # configs/deepseek/v4_1_flash.yaml
FAST = [V4, V41]
FULL = [("bf16", "bf16"), ("native", "native"), ("bf16", "fp4_ue8m0")]
CASES = FAST + [pytest.param(*f, marks=pytest.mark.full) for f in FULL]


@pytest.mark.parametrize("local_fmt,main_fmt", CASES)
def test_reference_is_todays_decode_attention(local_fmt, main_fmt):
    q, pos, after, before, kv, cache, idx, sink = _state(local_fmt, main_fmt)
    keys, key_pos = ring.local_keys(before, jnp.float32, kv, pos[:, None],
                                    jnp.ones((B, 1), bool), W)
    picked, got = cache.gather("entry", idx[:, None], jnp.float32)
    today, _ = reference.block_attention(q[:, None], [(picked, got),
                                        (keys, ring.window_mask(key_pos, pos[:, None], W))],
                           sink)
    out, lse = da.reference(q, pos, after, cache, idx, window=W, scale=C ** -0.5, sink=sink)
    np.testing.assert_allclose(out, today[:, 0], rtol=2e-5, atol=2e-5)
    # lse: the sink and the read keys' exp-sum, independently
    mask = jnp.concatenate([got[:, 0], ring.window_mask(key_pos, pos[:, None], W)[:, 0]], 1)
    ent = jnp.concatenate([picked[:, 0], keys], 1)
    s = jnp.where(mask[:, None], jnp.einsum("bhc,bsc->bhs", q, ent) * C ** -0.5, -jnp.inf)
    want = jnp.log(jnp.exp(s).sum(-1) + jnp.exp(sink))
    np.testing.assert_allclose(lse, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("local_fmt,main_fmt", CASES)
def test_kernel_equals_reference(local_fmt, main_fmt):
    q, pos, after, _, _, cache, idx, sink = _state(local_fmt, main_fmt, seed=1)
    want = da.reference(q, pos, after, cache, idx, window=NARROW, scale=SCALE, sink=sink)
    got = jax.jit(lambda q, pos, r, c, i, s: da.attention(
        q, pos, r, c, i, window=NARROW, scale=SCALE, sink=s, block_k=16, splits=2,
        interpret=True))(q, pos, after, cache, idx, sink)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_lowers_for_cuda():
    q, pos, after, _, _, cache, idx, sink = _state(*V41)
    f = jax.jit(lambda q, pos, r, c, i, s: da.attention(
        q.astype(jnp.bfloat16), pos, r, c, i, window=W, scale=SCALE, sink=s))
    text = f.trace(q, pos, after, cache, idx, sink).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
