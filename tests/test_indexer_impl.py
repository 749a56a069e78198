"""Every indexed preset decodes through the Pallas score kernels (TPU and GPU variants, both
interpreted on CPU) with the same logits as the XLA path; `indexer.impl` dispatch and its
errors; `indexer.topk_method=approx` (approx_max_k) selects what exact top-k selects without ties."""

from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import generate
from dsattn.attention import indexer
from dsattn.model import Transformer
from tests.helpers import preset


def decode_logits(cfg, toks, lengths, n_decode):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    bound = generate.engine(model)
    cache = generate.init_cache(cfg, len(lengths), 32)
    logits, cache = generate.prefill(bound, toks[:, : max(lengths)], lengths, cache)
    out = [np.asarray(logits)]
    for s in range(n_decode):
        logits, cache = generate.decode_step(bound, toks[np.arange(len(lengths)),
                                                         np.asarray(lengths) + s], cache)
        out.append(np.asarray(logits))
    return np.stack(out)


CASES = {
    "dsa": ("attention.top_k=8", "model.n_layers=2"),
    # csa*3 scans its last two copies: the kernels read a copy's pages of the stacked pools
    "v4": ("attention.layers=swa, csa*3", "model.n_layers=4", "model.scan_layers=true",
           "attention.top_k=2"),
    # full (pool maxima from the kernel) -> reindex (scores the pool) -> reuse; FP4 keys
    "v41": ("cache.key_format=fp4_ue8m0", "model.n_layers=4", "attention.ced_split=0",
            "attention.layers=swa, full, reindex, reuse", "attention.ratios=0, 2, 2, 2"),
}


@lru_cache(maxsize=None)
def preset_logits(name, *overrides):
    toks = np.random.RandomState(0).randint(0, 256, (2, 30))
    cfg = preset(name, "model.dtype=float32", *CASES[name], *overrides)
    return decode_logits(cfg, toks, [6, 19], 5)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("name", list(CASES))
def test_pallas_interpret_decode_equals_xla(name, impl):
    kernel = preset_logits(name, f"indexer.impl={impl}", "indexer.interpret=true")
    np.testing.assert_allclose(kernel, preset_logits(name, "indexer.impl=xla"),
                               atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "tpu"),
                    reason=f"compiled kernels need a GPU or TPU; backend is "
                           f"{jax.default_backend()} (the interpret-mode cases cover CPU)")
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_kernel_decode_equals_xla(name):
    """On the device: decode through the backend's compiled kernel (indexer.impl=auto) gives
    the XLA path's logits."""
    np.testing.assert_allclose(preset_logits(name, "indexer.impl=auto"),
                               preset_logits(name, "indexer.impl=xla"), atol=2e-4, rtol=2e-4)


def resolved(*overrides, platform="cpu"):
    return indexer.resolve_impl(preset("v41", *overrides)).on(platform)


def test_impl_resolution():
    # auto: the chip's kernel in a program lowered for a GPU or TPU, the reference for a CPU
    for platform, on in (("cuda", "pallas_gpu"), ("tpu", "pallas_tpu"), ("cpu", "xla")):
        assert resolved("indexer.impl=auto", platform=platform) == on
    # a named kernel runs on every platform (interpreted for a CPU)
    assert resolved("indexer.impl=pallas_tpu", "cache.key_format=bf16") == "pallas_tpu"
    assert resolved("indexer.impl=pallas_tpu", "cache.key_format=fp4_ue8m0") == "pallas_tpu"
    assert resolved("indexer.impl=pallas_gpu", "cache.key_format=fp8_ue8m0",
                    platform="tpu") == "pallas_gpu"
    for impl in ("pallas_tpu", "pallas_gpu"):
        with pytest.raises(NotImplementedError, match=f"{impl}.*key_format='fp4_e4m3'"):
            resolved(f"indexer.impl={impl}", "cache.key_format=fp4_e4m3")


@pytest.mark.parametrize("platform, expected", [("cuda", "pallas_gpu"), ("tpu", "pallas_tpu"),
                                                ("cpu", "xla")])
def test_auto_picks_the_lowering_platforms_kernel(platform, expected):
    assert resolved("cache.key_format=fp4_ue8m0", platform=platform) == expected
    # no kernel reads this format
    assert resolved("cache.key_format=fp4_e4m3", platform=platform) == "xla"
    # a pool whose blocks do not tile the pages: the kernels cannot run it, XLA can
    assert resolved("cache.page_size=7", "attention.pool_block_size=4",
                    platform=platform) == "xla"


def test_approx_topk_selects_the_exact_set_on_tie_free_scores():
    rng = np.random.RandomState(1)
    score = jnp.asarray(rng.standard_normal((3, 4, 50)), jnp.float32)  # no ties
    visible = jnp.arange(50) < jnp.asarray(rng.randint(0, 50, (3, 4, 1)))
    visible = visible.at[0, 0].set(True)
    for k in (1, 8, 50):
        exact = indexer.select(score, visible, k)
        approx = indexer.select(score, visible, k, method="approx")
        np.testing.assert_array_equal(np.asarray(approx[1]).sum(-1), np.asarray(exact[1]).sum(-1))
        for e_idx, e_ok, a_idx, a_ok in zip(*(np.asarray(a).reshape(12, -1)
                                              for a in exact + approx)):
            assert set(a_idx[a_ok].tolist()) == set(e_idx[e_ok].tolist())


def test_topk_config_names_allowed_values():
    from dsattn.config import ConfigError

    with pytest.raises(ConfigError, match="indexer.topk_method: 'fast' is not one of: exact, "
                                          "approx"):
        preset("dsa", "indexer.topk_method=fast")
    with pytest.raises(ConfigError, match="indexer.topk: renamed to indexer.topk_method"):
        preset("dsa", "indexer.topk=approx")


def test_approx_topk_decode_equals_exact():
    np.testing.assert_allclose(preset_logits("dsa", "indexer.topk_method=approx"),
                               preset_logits("dsa", "indexer.impl=xla"), atol=2e-4, rtol=2e-4)
