"""MLA's two paths agree; grouped K/V heads equal MHA with duplicated K/V weights."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import plan
from dsattn.attention import attend
from dsattn.attention.mha import MHA
from dsattn.attention.mla import MLA
from dsattn.nn.rope import apply_rope, apply_rope_last
from tests.helpers import preset


def _x(b=2, t=7, d=128, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randn(b, t, d))


def _layer(cls, cfg, seed):
    """Layer 0 of `cfg` as a `cls` module."""
    return cls(cfg, plan.resolve(cfg)[0], nnx.Rngs(seed))


def test_mla_naive_equals_absorbed():
    cfg = preset("mla", "model.dtype=float64")
    mla = _layer(MLA, cfg, 1)
    x = _x()
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    q = mla.queries(mla.query_latent(x), pos)
    lat = mla.latents(x, pos)
    # the naive path (the training forward) against the absorbed read of the same latents
    absorbed = mla.absorbed(q, pos, None, (attend.Keys((lat,), pos),))[0]
    np.testing.assert_allclose(mla(x, pos)[0], absorbed, rtol=1e-10, atol=1e-12)
    # The cache holds only dc + dr numbers per token.
    assert lat.shape[-1] == cfg.attention.kv_lora_rank + cfg.attention.qk_rope_dim


def _expand_kv(gqa: MHA, mha: MHA):
    """Give `mha` gqa's weights with each K/V head repeated for the query heads it serves."""
    g = gqa.n_heads // gqa.n_kv
    for name in ("wq", "wo"):
        getattr(mha, name).kernel[...] = getattr(gqa, name).kernel[...]
    for name in ("wk", "wv"):
        w = getattr(gqa, name).kernel[...].reshape(-1, gqa.n_kv, gqa.head_dim)
        getattr(mha, name).kernel[...] = jnp.repeat(w, g, axis=1).reshape(w.shape[0], -1)


def test_grouped_kv_equals_mha_with_repeated_heads():
    x = _x()
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    mha = _layer(MHA, preset("mha", "model.dtype=float64"), 0)
    for name in ("gqa", "mqa"):
        grouped = _layer(MHA, preset(name, "model.dtype=float64"), 3)
        assert grouped.n_kv < grouped.n_heads
        _expand_kv(grouped, mha)
        np.testing.assert_allclose(grouped(x, pos)[0], mha(x, pos)[0], rtol=1e-10, atol=1e-12)


def test_mha_matches_plain_numpy_attention():
    cfg = preset("mha", "model.dtype=float64")
    att = _layer(MHA, cfg, 0)
    x = _x(b=1, t=5)
    pos = jnp.arange(5)[None]
    h, d = att.n_heads, att.head_dim
    q = np.asarray(apply_rope(att.wq(x).reshape(1, 5, h, d), pos, 1e4))[0]
    k = np.asarray(apply_rope(att.wk(x).reshape(1, 5, h, d), pos, 1e4))[0]
    v = np.asarray(att.wv(x).reshape(1, 5, h, d))[0]
    out = np.zeros((5, h, d))
    for head in range(h):
        s = q[:, head] @ k[:, head].T / np.sqrt(d)
        s[np.triu_indices(5, 1)] = -np.inf
        w = np.exp(s - s.max(1, keepdims=True))
        out[:, head] = (w / w.sum(1, keepdims=True)) @ v[:, head]
    expect = out.reshape(5, h * d) @ np.asarray(att.wo.kernel[...])
    np.testing.assert_allclose(att(x, pos)[0][0], expect, rtol=1e-9, atol=1e-12)


def test_rope_is_a_rotation_and_inverse_undoes_it():
    x = jnp.asarray(np.random.RandomState(0).randn(2, 6, 3, 8))
    pos = jnp.broadcast_to(jnp.arange(6) * 7, (2, 6))
    y = apply_rope(x, pos, 1e4)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1))
    np.testing.assert_allclose(apply_rope(y, pos, 1e4, inverse=True), x, atol=1e-12)
    # relative property: <R(a)q, R(b)k> depends on b - a only
    q, k = x[:1, :1], x[1:, :1]
    d1 = jnp.sum(apply_rope(q, jnp.array([[3]]), 1e4) * apply_rope(k, jnp.array([[10]]), 1e4))
    d2 = jnp.sum(apply_rope(q, jnp.array([[5]]), 1e4) * apply_rope(k, jnp.array([[12]]), 1e4))
    np.testing.assert_allclose(d1, d2, rtol=1e-10)
    # partial rope leaves the leading dims alone
    z = apply_rope_last(x, pos, 1e4, 4)
    np.testing.assert_array_equal(z[..., :4], x[..., :4])
