"""The Hadamard rotation before low-bit indexer keys (indexer.hadamard): an orthonormal
matrix, scores unchanged by it, on only where keys are FP8/FP4, and the same numbers in the
training forward and the decode caches."""

import numpy as np
import pytest
import scipy.linalg

from dsattn import config, migrations
from dsattn.errors import ConfigError
from dsattn.nn import hadamard
from tests.helpers import check_decode_matches_forward, forward, preset, tiny_model


@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 128])
def test_matrix_is_scipys_hadamard_normalised(n):
    h = np.asarray(hadamard.matrix(n, np.float64))
    np.testing.assert_array_equal(h, scipy.linalg.hadamard(n) / np.sqrt(n))
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-15)


def test_rotation_keeps_dot_products_and_spreads_an_outlier():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 5, 64))
    k[:, 3] = 40.0  # one outlier channel
    rq, rk = (np.asarray(hadamard.rotate(v)) for v in (q, k))
    np.testing.assert_allclose(rq @ rk.T, q @ k.T, rtol=1e-12, atol=1e-12)
    # the outlier's energy ends up spread evenly: max |.| falls to about RMS
    assert np.abs(rk).max(-1).max() < 0.5 * np.abs(k).max()


def test_non_power_of_two_widths_are_refused():
    with pytest.raises(ConfigError, match="power-of-two"):
        hadamard.matrix(24)
    with pytest.raises(ConfigError, match="indexer.hadamard.*head_dim, got 48"):
        preset("v4", "cache.key_format=fp4_e4m3", "indexer.head_dim=48", "indexer.rope_dim=16")
    preset("v4", "cache.key_format=fp4_e4m3", "indexer.head_dim=48", "indexer.rope_dim=16",
           "indexer.hadamard=false")  # accepted unrotated
    preset("v4", "indexer.head_dim=48", "indexer.rope_dim=16")  # native keys: no rotation


def test_on_by_default_only_for_low_bit_keys():
    assert config.rotates_keys(preset("v4", "cache.key_format=fp4_ue8m0"))
    assert config.rotates_keys(preset("v4", "cache.key_format=fp8_ue8m0"))
    assert not config.rotates_keys(preset("v4", "cache.key_format=bf16"))
    assert not config.rotates_keys(preset("v4"))
    assert not config.rotates_keys(preset("v4", "cache.key_format=fp4_ue8m0",
                                          "indexer.hadamard=false"))


def test_runs_saved_before_the_rotation_stay_unrotated():
    raw = {"indexer": {"n_heads": 4}, "cache": {"key_format": "fp4_ue8m0"}}
    assert migrations.upgrade_saved(raw)["indexer"]["hadamard"] is False
    assert migrations.upgrade_saved({"indexer": {"hadamard": True}})["indexer"]["hadamard"]


LOW_BIT_KEYS = {  # every family with an indexer, keys stored FP8 (no fake quant) or FP4
    "dsa": ("attention.top_k=8", "model.n_layers=2"),
    "v4": ("attention.layers=swa, csa", "model.n_layers=2", "attention.top_k=4"),
    "v41": ("model.n_layers=4", "attention.ced_split=0", "attention.ratios=0, 2, 2, 2",
            "attention.layers=swa, full, reindex, reuse", "attention.top_k=4"),
}


@pytest.mark.parametrize("name", list(LOW_BIT_KEYS))
def test_float64_forward_is_unchanged_by_the_rotation(name):
    """Keys stored FP8 in the cache, the forward unquantized: rotating both queries and keys
    leaves the scores, so the selections and the logits, as they were (float64)."""
    toks = np.random.RandomState(1).randint(0, 256, (2, 40))
    on, off = (forward(tiny_model(name, "cache.key_format=fp8_ue8m0", f"indexer.hadamard={v}",
                                  "indexer.dense_warmup_steps=0", *LOW_BIT_KEYS[name]), toks)
               for v in ("true", "false"))
    np.testing.assert_allclose(np.asarray(on), np.asarray(off), atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("name", list(LOW_BIT_KEYS))
def test_rotated_fp4_keys_decode_equals_the_fake_quant_forward(name):
    """Training (fake quant of the rotated keys) and the cache (rotated keys stored FP4,
    queries rotated alike) read the same numbers."""
    model = tiny_model(name, "cache.fake_quant=true", "cache.key_format=fp4_ue8m0",
                       "indexer.dense_warmup_steps=0", *LOW_BIT_KEYS[name])
    assert config.rotates_keys(model.cfg)
    check_decode_matches_forward(model, lengths=[6, 19], n_decode=10, max_len=48, atol=1e-6)


def test_rotation_raises_fp4_topk_agreement_on_keys_with_an_outlier_channel():
    """Keys with one channel ~12x the others (the kind of outlier the rotation is for): FP4
    keys' top-k recovers more of the full-precision top-k when rotated first. Without the
    outlier the rotation neither helps nor hurts much (docs/bench/rotation.txt measures
    keys of trained tiny models)."""
    from dsattn.bench.rotation import topk_agreement

    rng = np.random.default_rng(0)
    b, t, s, n, d = 2, 16, 96, 4, 32
    q, keys = rng.normal(size=(b, t, n, d)), rng.normal(size=(b, s, d))
    w = rng.uniform(0.5, 1.5, size=(b, t, n))
    visible = np.ones((b, t, s), bool)
    plain = {rot: topk_agreement(q, w, keys, visible, 8, "fp4_ue8m0", rot)
             for rot in (False, True)}
    keys[..., 5] *= 12.0
    outlier = {rot: topk_agreement(q, w, keys, visible, 8, "fp4_ue8m0", rot)
               for rot in (False, True)}
    assert outlier[True] > outlier[False] + 0.05, outlier  # measured 0.809 -> 0.906
    assert abs(plain[True] - plain[False]) < 0.03, plain  # measured 0.898, 0.895
    assert topk_agreement(q, w, keys, visible, 8, None, False) == 1.0  # the reference itself
