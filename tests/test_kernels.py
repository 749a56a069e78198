"""Pallas kernels (TPU interpret mode on CPU) against their pure-jnp references."""

import jax.numpy as jnp
import numpy as np
import pytest

from dsattn.attention import indexer
from dsattn.cache import paged
from dsattn.kernels.indexer_score import paged_scores_tpu, reference_scores

B, MAX_ENTRIES, PS, H, D = 3, 20, 8, 4, 128


def _scrambled_cache(fmt, seed=0):
    """A paged cache whose rows hold ragged lengths (17, 5, 15) on scrambled pages."""
    rng = np.random.default_rng(seed)
    fields = {"k": paged.Field(fmt, D)}
    cache = paged.empty(fields, B, MAX_ENTRIES, PS, dtype=jnp.float32)

    def add(cache, n):
        x = jnp.asarray(rng.standard_normal((B, 9, D)), jnp.float32)
        return paged.append(cache, fields, {"k": x}, jnp.asarray(n, jnp.int32))

    cache = add(cache, [8, 8, 8])
    cache = paged.release(cache, jnp.asarray([False, True, False]))
    cache = add(cache, [9, 5, 7])  # row 1 restarts on a recycled page
    cache = paged.release(cache, jnp.asarray([True, False, False]))
    cache = add(cache, [9, 0, 0])
    cache = add(cache, [8, 0, 0])
    paged.check(cache)
    table = np.asarray(cache["page_table"])
    assert np.asarray(cache["length"]).tolist() == [17, 5, 15]
    assert not all(np.all(np.diff(r[r >= 0]) == 1) for r in table)  # not in pool order
    return fields, cache


def _queries(T, seed=1):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    nv = jnp.asarray(rng.integers(0, MAX_ENTRIES + 3, (B, T)), jnp.int32)
    nv = nv.at[0, 0].set(MAX_ENTRIES)  # one query sees its whole row
    return q, w, nv


@pytest.mark.parametrize("fmt", ["native", "bf16", "fp8_fp32", "fp8_ue8m0", "fp4_ue8m0"])
@pytest.mark.parametrize("T", [1, 3])
def test_paged_scores_kernel_matches_reference(fmt, T):
    fields, cache = _scrambled_cache(fmt)
    q, w, nv = _queries(T)
    args = (q, w, cache["pages"]["k"], cache["page_table"], cache["length"], nv, fmt)
    ref = reference_scores(*args, max_entries=MAX_ENTRIES)
    got = paged_scores_tpu(*args, interpret=True, max_entries=MAX_ENTRIES)
    assert got.shape == ref.shape == (B, T, MAX_ENTRIES) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # Full width (P * page_size) too: the padded tail is invisible.
    full = paged_scores_tpu(*args, interpret=True)
    assert full.shape == (B, T, cache["page_table"].shape[1] * PS)
    assert np.all(np.isneginf(np.asarray(full[..., MAX_ENTRIES:])))


@pytest.mark.parametrize("fmt", ["native", "bf16", "fp8_fp32", "fp8_ue8m0", "fp4_ue8m0"])
def test_reference_matches_indexer_scores(fmt):
    """Independent expectation: indexer.scores over read_all's dequantized keys, masked."""
    T = 3
    fields, cache = _scrambled_cache(fmt, seed=2)
    q, w, nv = _queries(T, seed=3)
    ref = reference_scores(q, w, cache["pages"]["k"], cache["page_table"], cache["length"],
                           nv, fmt, max_entries=MAX_ENTRIES)
    keys, valid = paged.read_all(cache, fields, "k", jnp.float32)
    dense = indexer.scores(q, w, keys)
    s = jnp.arange(MAX_ENTRIES)[None, None, :]
    vis = valid[:, None, :] & (s < nv[..., None])
    expected = jnp.where(vis, dense, -jnp.inf)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(expected), rtol=1e-5, atol=1e-5)
    # Each row has visible and invisible entries.
    assert np.any(np.isfinite(np.asarray(ref))) and np.any(np.isneginf(np.asarray(ref)))


def test_paged_scores_rejects_unsupported_format():
    fields, cache = _scrambled_cache("native")
    q, w, nv = _queries(1)
    with pytest.raises(NotImplementedError):
        paged_scores_tpu(q, w, cache["pages"]["k"], cache["page_table"], cache["length"], nv,
                         "fp4_e4m3", interpret=True)
