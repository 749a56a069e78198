"""Compressor (HCA / CSA / CSA2 token compression): block forward against a direct numpy
implementation of the formulas, and streaming (token by token, ragged chunks) == block.

Compiles dominate on CPU, so each configuration is built once (`setup`) and its jitted block
and step are shared by the tests; streams use B = 3 rows and chunk widths 1 or 3m + 1 (plus
3 in one test)."""

from functools import lru_cache

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dsattn.attention.compressor import Compressor
from dsattn.nn.rope import apply_rope_last

D_IN, WIDTH, EPS, ROWS = 6, 8, 1e-6, 3


def make(ratio, overlap, pos_bias, seed=0, dtype=jnp.float64):
    comp = Compressor(D_IN, WIDTH, ratio, overlap=overlap, pos_bias=pos_bias, norm_eps=EPS,
                      dtype=dtype, rngs=nnx.Rngs(seed), std=0.5)
    rng = np.random.default_rng(seed + 100)
    comp.norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, WIDTH), dtype)
    if comp.ape is not None:
        comp.ape[...] = jnp.asarray(rng.normal(size=comp.ape.shape) * 2.0, dtype)
    return comp


@lru_cache(maxsize=None)
def setup(m, overlap, pos_bias):
    """(module, params, jitted step, jitted block) for one configuration."""
    comp = make(m, overlap, pos_bias, seed=10 * m + 2 * overlap + pos_bias)
    gdef, params = nnx.split(comp)
    step = jax.jit(lambda p, s, x, pos, v: nnx.merge(gdef, p).step(s, x, pos, v))
    block = jax.jit(lambda p, x: nnx.merge(gdef, p).block(x))
    return comp, params, step, block


def seq_len(m):
    return 9 * m + 3


def ref_block(comp, x):
    """Entries of one row x [T, D] straight from the formulas, in numpy."""
    m, w = comp.ratio, WIDTH
    cc = x @ np.asarray(comp.wkv.kernel[...])
    zz = (x @ np.asarray(comp.wgate.kernel[...]) if comp.wgate is not None
          else np.zeros_like(cc))
    if comp.ape is not None:
        zz = zz + np.asarray(comp.ape[...])[np.arange(len(x)) % m]
    out = []
    for i in range(len(x) // m):
        own = range(i * m, (i + 1) * m)
        if comp.overlap:  # a-halves of the previous span (none for entry 0), b-halves of own
            prev = range((i - 1) * m, i * m) if i > 0 else range(0)
            rows_c = [cc[j, :w] for j in prev] + [cc[j, w:] for j in own]
            rows_z = [zz[j, :w] for j in prev] + [zz[j, w:] for j in own]
        else:
            rows_c, rows_z = [cc[j] for j in own], [zz[j] for j in own]
        rc, rz = np.stack(rows_c), np.stack(rows_z)
        p = np.exp(rz - rz.max(0))
        e = (p / p.sum(0) * rc).sum(0)  # per-channel softmax over the rows
        out.append(e / np.sqrt(np.mean(e * e) + EPS) * np.asarray(comp.norm.weight[...]))
    return np.asarray(out).reshape(-1, w)


CONFIGS = [(m, ov, pb) for m in (1, 2, 4) for ov in (False, True) for pb in (False, True)]


# -- block -----------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("pos_bias", [False, True])
def test_block_matches_numpy(m, overlap, pos_bias):
    comp, params, _, block = setup(m, overlap, pos_bias)
    t = seq_len(m)  # 9 complete spans and an incomplete tail, which is dropped
    x = np.random.default_rng(1).normal(size=(ROWS, t, D_IN))
    got = np.asarray(block(params, jnp.asarray(x)))
    assert got.shape == (ROWS, t // m, WIDTH)
    for r in range(ROWS):
        np.testing.assert_allclose(got[r], ref_block(comp, x[r]), rtol=1e-12, atol=1e-12)


def test_block_shorter_than_a_span():
    comp = make(4, True, True)
    assert comp.block(jnp.zeros((2, 3, D_IN))).shape == (2, 0, WIDTH)


def test_params():
    kw = dict(norm_eps=EPS, dtype=jnp.float32, rngs=nnx.Rngs(0))
    csa = Compressor(4, 8, 4, overlap=True, pos_bias=True, **kw)
    assert csa.wkv.kernel.shape == csa.wgate.kernel.shape == (4, 16)
    assert csa.ape.shape == (4, 16) and isinstance(csa.ape, nnx.Param)
    hca = Compressor(4, 8, 128, overlap=False, pos_bias=True, **kw)
    assert hca.wkv.kernel.shape == hca.wgate.kernel.shape == (4, 8) and hca.ape.shape == (128, 8)
    csa2 = Compressor(4, 8, 2, overlap=False, pos_bias=False, **kw)
    assert csa2.ape is None and csa2.wgate is not None and csa2.norm.weight.shape == (8,)
    one = Compressor(4, 8, 1, overlap=False, pos_bias=False, **kw)
    assert one.wgate is None and one.ape is None
    with pytest.raises(ValueError):
        Compressor(4, 8, 0, overlap=False, pos_bias=False, **kw)


def test_block_float32_and_grads_finite():
    """float32 model: entries stay float32; gradients through the −inf rows of entry 0 are
    finite."""
    comp = make(4, True, True, dtype=jnp.float32)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 12, D_IN)), jnp.float32)
    gdef, params = nnx.split(comp)
    loss = lambda p: jnp.sum(nnx.merge(gdef, p).block(x) ** 2)  # noqa: E731
    val, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert comp.block(x).dtype == jnp.float32 and np.isfinite(float(val))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.sum(jnp.abs(grads["ape"][...]))) > 0


def test_rope_entries_at_span_start():
    comp = make(4, True, True)
    ent = comp.block(jnp.asarray(np.random.default_rng(4).normal(size=(1, 12, D_IN))))
    idx = jnp.arange(3)[None]
    got = np.asarray(comp.rope_entries(ent, idx, 4, 10000.0))
    # two separately compiled programs: equal to rounding, not bit for bit
    np.testing.assert_allclose(got, np.asarray(apply_rope_last(ent, idx * 4, 10000.0, 4)),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(got[..., :-4], np.asarray(ent[..., :-4]))
    # the first pair of the rotated tail (frequency 1) turns by angle i·m
    a, e = 4.0 * np.arange(3), np.asarray(ent[0, :, -4:-2])
    rot = np.stack([e[:, 0] * np.cos(a) - e[:, 1] * np.sin(a),
                    e[:, 0] * np.sin(a) + e[:, 1] * np.cos(a)], -1)
    np.testing.assert_allclose(got[0, :, -4:-2], rot, atol=1e-12)


# -- streaming -------------------------------------------------------------------------------
def test_entry_bound():
    """E = T // m + 1 bounds the span ends inside any T consecutive positions."""
    for m in (1, 2, 3, 4, 128):
        for t in list(range(1, 3 * m + 3))[:: max(1, m // 8)]:
            worst = max(sum((p % m) == m - 1 for p in range(s, s + t)) for s in range(m))
            assert worst == -(-t // m) <= t // m + 1


def stream(cfg, xs, schedule):
    """Feed rows xs [ROWS, S, D]: schedule is a list of (chunk width, tokens per row). Padding
    holds garbage (values and positions). Returns ({entry_index: entry} per row, fed)."""
    comp, params, step, _ = setup(*cfg)
    m = comp.ratio
    rng = np.random.default_rng(7)
    fed = np.zeros(ROWS, int)
    state = comp.init_state(ROWS)
    got = [dict() for _ in range(ROWS)]
    for t, counts in schedule:
        x = rng.normal(size=(ROWS, t, D_IN)) * 50.0
        pos = rng.integers(-5, 1000, size=(ROWS, t))
        valid = np.zeros((ROWS, t), bool)
        for r, n in enumerate(counts):
            x[r, :n] = xs[r, fed[r]: fed[r] + n]
            pos[r, :n] = fed[r] + np.arange(n)
            valid[r, :n] = True
        state, ent, idx, ok = step(params, state, jnp.asarray(x), jnp.asarray(pos),
                                   jnp.asarray(valid))
        ent, idx, ok = np.asarray(ent), np.asarray(idx), np.asarray(ok)
        assert ent.shape == (ROWS, t // m + 1, WIDTH) and idx.shape == ok.shape == ent.shape[:2]
        fed += np.asarray(counts)
        for r in range(ROWS):
            sel = idx[r][ok[r]]
            assert np.all(ok[r][: len(sel)]) and np.all(np.diff(sel) == 1)  # valid first, in order
            assert np.all(ent[r][~ok[r]] == 0)
            for i, e in zip(sel, ent[r][ok[r]]):
                assert i * m + m - 1 <= fed[r] - 1, "entry emitted before its span completed"
                assert int(i) not in got[r], "entry emitted twice"
                got[r][int(i)] = e
    return got, fed


def check(cfg, xs, got, fed):
    """Every entry complete in what each row fed was emitted and equals block's."""
    comp, params, _, block = setup(*cfg)
    want = np.asarray(block(params, jnp.asarray(xs)))  # entries only see their own spans
    for r in range(ROWS):
        n = fed[r] // comp.ratio
        assert sorted(got[r]) == list(range(n)), "missing or extra entries"
        if n:
            np.testing.assert_allclose(np.stack([got[r][i] for i in range(n)]), want[r, :n],
                                       rtol=0, atol=1e-10)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_stream_token_by_token(cfg):
    m = cfg[0]
    s = seq_len(m)
    xs = np.random.default_rng(5).normal(size=(ROWS, s, D_IN))
    # row 0 feeds every step; row 1 stops mid-span; row 2 starts late and pauses
    sched = [(1, [1, int(k < s - m - 1), int(k >= 2 and k % 5 != 0)]) for k in range(s)]
    got, fed = stream(cfg, xs, sched)
    assert fed[0] == s and fed[1] == s - m - 1
    check(cfg, xs, got, fed)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_stream_ragged_chunks(cfg):
    m = cfg[0]
    t, s = 3 * m + 1, seq_len(m)
    rng = np.random.default_rng(6 + m)
    xs = rng.normal(size=(ROWS, s, D_IN))
    # row 0: long chunks (several entries each) and single tokens; rows 1-2 random ragged
    # pieces, row 2 starting late; chunk starts are not aligned to spans
    fed = np.zeros(ROWS, int)
    sched = []
    for k in range(40):
        width = 1 if k % 3 == 2 else t
        want = [width, rng.integers(0, width + 1), 0 if k < 2 else rng.integers(1, width + 1)]
        counts = [int(min(n, s - f)) for n, f in zip(want, fed)]
        fed += counts
        sched.append((width, counts))
        if min(fed) == s:
            break
    got, fed = stream(cfg, xs, sched)
    assert fed[0] == s and min(fed) >= 3 * m
    check(cfg, xs, got, fed)


@pytest.mark.parametrize("overlap", [False, True])
def test_short_and_bound_chunks(overlap):
    """m = 4. Chunks of T = 3 < m touching two spans (the token-in-span reduction), and a
    chunk of T = 3m + 1 from offset 3 that completes T // m + 1 = 4 entries, the bound."""
    cfg, m = (4, overlap, True), 4
    xs = np.random.default_rng(8).normal(size=(ROWS, seq_len(m), D_IN))
    sched = [(3, [3, 2, 0]), (3 * m + 1, [3 * m + 1, 0, 3 * m + 1]), (3, [3, 3, 2])]
    got, fed = stream(cfg, xs, sched)
    assert sorted(got[0]) == [0, 1, 2, 3] and list(fed) == [19, 5, 15]
    check(cfg, xs, got, fed)


def test_ratio_one_passes_through():
    """m = 1 without overlap: entry i is exactly RMSNorm(W^KV x_i), in block and in step."""
    comp, params, step, block = setup(1, False, False)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(ROWS, 4, D_IN)))
    want = np.asarray(comp.norm(comp.wkv(x)))
    np.testing.assert_allclose(np.asarray(comp.block(x)), want, rtol=1e-12, atol=1e-12)
    pos = jnp.broadcast_to(jnp.arange(4) + 5, (ROWS, 4))
    _, ent, idx, ok = step(params, comp.init_state(ROWS), x, pos, jnp.ones((ROWS, 4), bool))
    assert bool(jnp.all(ok[:, :4])) and not bool(jnp.any(ok[:, 4:]))
    np.testing.assert_array_equal(np.asarray(idx[:, :4]), np.asarray(pos))
    # another compiled program may fuse the norm differently: equal to rounding
    np.testing.assert_allclose(np.asarray(ent[:, :4]), want, rtol=1e-12, atol=1e-12)
