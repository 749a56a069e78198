"""Every indexed preset decodes through the Pallas score kernels (TPU and GPU variants, both
interpreted on CPU) with the same logits as the XLA path; `indexer.impl` dispatch and its
errors."""

from functools import lru_cache

import numpy as np
import pytest
from flax import nnx

from dsattn import generate
from dsattn.attention import indexer
from dsattn.model import Transformer
from tests.conftest import preset


def decode_logits(cfg, toks, lengths, n_decode):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    bound = generate.bind(model)
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
    "v4": ("attention.layers=swa, csa, hca", "model.n_layers=3"),
    "v41": ("cache.key_format=fp4_ue8m0",),  # keys dequantized from FP4 in-kernel; pool maxima
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


def test_impl_resolution():
    assert indexer.resolve_impl("auto", "native") == "xla"  # CPU: the reference path
    assert indexer.resolve_impl("pallas_tpu", "bf16") == "pallas_tpu"
    assert indexer.resolve_impl("pallas_tpu", "fp4_ue8m0") == "pallas_tpu"  # V4 key format
    assert indexer.resolve_impl("pallas_gpu", "fp8_ue8m0") == "pallas_gpu"
    for impl in ("pallas_tpu", "pallas_gpu"):
        with pytest.raises(NotImplementedError, match=f"{impl}.*key_format='fp4_e4m3'"):
            indexer.resolve_impl(impl, "fp4_e4m3")


@pytest.mark.parametrize("backend, expected", [("gpu", "pallas_gpu"), ("tpu", "pallas_tpu"),
                                               ("cpu", "xla")])
def test_auto_picks_the_backends_kernel(monkeypatch, backend, expected):
    monkeypatch.setattr(indexer.jax, "default_backend", lambda: backend)
    assert indexer.resolve_impl("auto", "fp8_fp32") == expected
    assert indexer.resolve_impl("auto", "fp4_e4m3") == "xla"  # no kernel reads this format
