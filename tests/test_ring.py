"""Local ring cache against a plain reference: per row, the last W positions in Python lists.

Every step of a ragged chunked prefill and of the decode that follows is checked: after each
write, ``read`` holds exactly the reference window (slot p % W holds position p; other slots
-1), and through ``local_keys`` + ``window_mask`` every query of a chunk sees exactly the
(position, value) pairs {max(0, q-W+1) .. q}. One jitted step per (format, B, T, W) keeps the
file fast: chunk arrays are [B, 1] or [B, 17] (padded), so shapes are few.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsattn.cache import formats
from dsattn.cache import ring as R

WIDTH = 32  # a multiple of fp8_ue8m0's 32-channel scale block
CHUNKS = (1, 2, 3, 5, 8, 17)  # chunk lengths: shorter than, equal to and longer than W
PAD_T = 17  # chunks of 2+ entries are [B, 17] arrays (the rest padded, invalid): T = 1 or 17


_steps = {}
_write = jax.jit(R.write)
_read = jax.jit(R.read, static_argnums=1)


def _step(fmt, batch, t, window):
    """jit(local_keys + window_mask, then write + read) for one shape (compiled once)."""
    key = (fmt, batch, t, window)
    if key not in _steps:
        def step(ring, values, positions, valid):
            keys, key_pos = R.local_keys(ring, jnp.float64, values, positions, valid, window)
            mask = R.window_mask(key_pos, positions, window)
            new = R.write(ring, values, positions, valid)
            vals, pos = R.read(new, jnp.float64)
            return keys, key_pos, mask, new, vals, pos
        _steps[key] = jax.jit(step)
    return _steps[key]


_roundtrip = jax.jit(lambda fmt, x: formats.decode(fmt, formats.encode(fmt, x), jnp.float64),
                     static_argnums=0)


def _check_values(fmt, got, want, want_stored):
    """got == what the ring stores for want: exact for native, rounded to the format else."""
    if fmt == "native":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_array_equal(got, want_stored)
    if fmt == "bf16":
        # Within BF16 rounding of the float64 value (8 significant bits; f64->f32->bf16).
        np.testing.assert_array_less(np.abs(got - want), np.abs(want) * 2.0**-8 + 1e-300)


def _run(fmt, window, prompt_lens, chunk_sizes, n_decode, seed):
    """Chunked ragged prefill, then decode; check the ring and the visible keys every step."""
    batch = len(prompt_lens)
    rng = np.random.default_rng(seed)
    # One table shape for every scenario (3 rows, 3W + 2W + 2 positions at W = 8), so the
    # format round trip below compiles once per format.
    table = rng.standard_normal((3, 42, WIDTH)) * 4.0
    table_stored = np.asarray(_roundtrip(fmt, jnp.asarray(table)))
    hist = [[] for _ in range(batch)]  # reference: positions written so far, per row
    ring = R.empty(fmt, batch, window, WIDTH, 0, jnp.float64)

    def feed(t, counts):
        nonlocal ring
        starts = [len(h) for h in hist]
        positions = np.array([[s + i for i in range(t)] for s in starts], np.int32)
        valid = np.array([[i < c for i in range(t)] for c in counts])
        values = np.full((batch, t, WIDTH), np.nan)  # padded entries: NaN must never show up
        for b in range(batch):
            for i in range(counts[b]):
                values[b, i] = table[b, starts[b] + i]
        old_pos = np.asarray(ring.pos)
        old_kv = {k: np.asarray(a) for k, a in ring.kv.items()}
        keys, key_pos, mask, ring, vals, pos = _step(fmt, batch, t, window)(
            ring, jnp.asarray(values), jnp.asarray(positions), jnp.asarray(valid))
        keys, key_pos, mask = np.asarray(keys), np.asarray(key_pos), np.asarray(mask)
        vals, pos = np.asarray(vals), np.asarray(pos)
        assert keys.shape == (batch, window + t, WIDTH) and mask.shape == (batch, t, window + t)

        for b in range(batch):
            # Every valid query sees exactly its window, each position once, with its value.
            for i in range(counts[b]):
                q = starts[b] + i
                seen = key_pos[b][mask[b, i]]
                want = np.arange(max(0, q - window + 1), q + 1)
                order = np.argsort(seen)
                np.testing.assert_array_equal(seen[order], want)
                _check_values(fmt, keys[b][mask[b, i]][order], table[b, want],
                              table_stored[b, want])
            hist[b].extend(range(starts[b], starts[b] + counts[b]))

            # The ring holds exactly the last W positions of the row.
            last = hist[b][-window:]
            want_pos = np.full(window, -1)
            for p in last:
                want_pos[p % window] = p
            np.testing.assert_array_equal(pos[b], want_pos)
            filled = want_pos >= 0
            _check_values(fmt, vals[b][filled], table[b, want_pos[filled]],
                          table_stored[b, want_pos[filled]])
            if counts[b] == 0:  # a row with nothing valid is untouched
                np.testing.assert_array_equal(pos[b], old_pos[b])
                for k, a in ring.kv.items():
                    np.testing.assert_array_equal(
                        np.asarray(a[b]).view(np.uint8), old_kv[k][b].view(np.uint8))

    # Chunked prefill: each row consumes its own prompt; rows that are done get 0 valid.
    left = list(prompt_lens)
    for t in chunk_sizes:
        if not any(left):
            break
        counts = [min(t, n) for n in left]
        feed(1 if t == 1 else PAD_T, counts)
        left = [n - c for n, c in zip(left, counts)]
    while any(left):  # finish with the longest chunk
        counts = [min(PAD_T, n) for n in left]
        feed(PAD_T, counts)
        left = [n - c for n, c in zip(left, counts)]
    for _ in range(n_decode):  # decode: T = 1, every row valid
        feed(1, [1] * batch)


@st.composite
def scenarios(draw):
    window = draw(st.integers(1, 8))
    batch = draw(st.integers(1, 3))
    prompt_lens = draw(st.lists(st.integers(0, 3 * window), min_size=batch, max_size=batch))
    chunks = draw(st.lists(st.sampled_from(CHUNKS), min_size=1, max_size=4))
    n_decode = draw(st.integers(0, 2 * window + 1))
    seed = draw(st.integers(0, 2**31 - 1))
    return window, prompt_lens, chunks, n_decode, seed


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_chunked_prefill_then_decode_native(sc):
    _run("native", *sc)


def test_chunked_prefill_then_decode_bf16():
    """bf16: values within BF16 rounding of the float64 inputs (and equal to encode->decode)."""
    _run("bf16", 3, [9, 2], [2, 17, 1, 5], 7, seed=3)


def test_quantized_format_fixed():
    """fp8_ue8m0 (q + e8m0 scale arrays): the ring and the chunk keys carry encode->decode."""
    _run("fp8_ue8m0", 4, [11, 0, 5], [3, 17, 1], 5, seed=1)


def test_long_prefill_keeps_last_window():
    w, t = 4, 11
    ring = R.empty("native", 2, w, 3, 0, jnp.float64)
    pos = np.tile(np.arange(t, dtype=np.int32), (2, 1))
    valid = np.arange(t)[None, :] < np.array([[t], [6]])
    vals = np.arange(2 * t * 3, dtype=np.float64).reshape(2, t, 3)
    ring = _write(ring, vals, pos, valid)
    got_v, got_p = _read(ring, jnp.float64)
    np.testing.assert_array_equal(got_p, [[8, 9, 10, 7], [4, 5, 2, 3]])
    np.testing.assert_array_equal(got_v[0], vals[0, [8, 9, 10, 7]])
    np.testing.assert_array_equal(got_v[1], vals[1, [4, 5, 2, 3]])
    # The ring after the write no longer holds position 3..6 for query 7 of row 0: that is
    # why a chunk attends over local_keys (ring before the write + its own keys).
    assert 6 not in np.asarray(got_p[0])

    # Order within the chunk does not matter: only the last W positions are scattered (a
    # scatter of all 11 would put several positions in one slot, in an unspecified order).
    perm = np.random.default_rng(0).permutation(t)[::-1].copy()
    for order in (np.arange(t)[::-1].copy(), perm):
        ring = _write(R.empty("native", 2, w, 3, 0, jnp.float64), vals[:, order],
                      pos[:, order], valid[:, order])
        got_v, got_p = _read(ring, jnp.float64)
        np.testing.assert_array_equal(got_p, [[8, 9, 10, 7], [4, 5, 2, 3]])
        np.testing.assert_array_equal(got_v[0], vals[0, [8, 9, 10, 7]])


def test_empty_and_window_mask():
    ring = R.empty("fp8_ue8m0", 2, 5, 64, 0, jnp.float32)
    assert ring.pos.dtype == jnp.int32 and (np.asarray(ring.pos) == -1).all()
    assert ring.kv["q"].shape == (2, 5, 64) and ring.kv["scale"].shape == (2, 5, 2)
    vals, pos = R.read(ring, jnp.float32)
    assert vals.shape == (2, 5, 64) and (np.asarray(vals) == 0).all()

    m = np.asarray(R.window_mask(jnp.array([[-1, 0, 1, 2, 3, 4]]), jnp.array([[2, 4, -1]]), 3))
    np.testing.assert_array_equal(m[0], [[0, 1, 1, 1, 0, 0],
                                         [0, 0, 0, 1, 1, 1],
                                         [0, 0, 0, 0, 0, 0]])
    with pytest.raises(ValueError):
        R.local_keys(ring, jnp.float32, jnp.zeros((2, 1, 64)),
                     jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), bool), 6)


def test_position_jump_clears_out_of_window_slots():
    ring = R.empty("native", 1, 4, 2, 0, jnp.float64)
    ring = _write(ring, np.ones((1, 4, 2)), np.arange(4)[None], np.ones((1, 4), bool))
    ring = _write(ring, np.full((1, 1, 2), 2.0), np.array([[9]]), np.ones((1, 1), bool))
    np.testing.assert_array_equal(ring.pos, [[-1, 9, -1, -1]])


def test_jit_compiles_once_per_shape():
    traces = []

    def f(ring, values, positions, valid):
        traces.append(1)
        return R.write(ring, values, positions, valid)

    jf = jax.jit(f)
    ring = R.empty("bf16", 2, 3, 4, 0, jnp.float32)
    eager = R.empty("bf16", 2, 3, 4, 0, jnp.float32)
    rng = np.random.default_rng(0)
    for step in range(4):
        vals = jnp.asarray(rng.standard_normal((2, 5, 4)), jnp.float32)
        pos = jnp.asarray(5 * step + np.arange(5)[None].repeat(2, 0), jnp.int32)
        valid = jnp.asarray([[True] * 5, [True] * 2 + [False] * 3])
        ring = jf(ring, vals, pos, valid)
        eager = R.write(eager, vals, pos, valid)
    assert len(traces) == 1
    np.testing.assert_array_equal(ring.pos, eager.pos)
    np.testing.assert_array_equal(ring.kv["v"].astype(jnp.float32),
                                  eager.kv["v"].astype(jnp.float32))
