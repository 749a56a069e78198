"""Every indexed preset decodes through the Pallas TPU score kernel (interpret mode on CPU)
with the same logits as the XLA path; `indexer.impl` dispatch and its errors."""

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


@pytest.mark.parametrize("name, extra", [
    ("dsa", ("attention.top_k=8", "model.n_layers=2")),
    ("v4", ("attention.layers=swa, csa, hca", "model.n_layers=3")),
    ("v41", ("cache.key_format=fp4_ue8m0",)),  # keys dequantized from FP4 in-kernel
])
def test_pallas_tpu_interpret_decode_equals_xla(name, extra):
    toks = np.random.RandomState(0).randint(0, 256, (2, 30))
    lengths, n = [6, 19], 5
    xla = decode_logits(preset(name, "model.dtype=float32", "indexer.impl=xla", *extra),
                        toks, lengths, n)
    kernel = decode_logits(preset(name, "model.dtype=float32", "indexer.impl=pallas_tpu",
                                  "indexer.interpret=true", *extra), toks, lengths, n)
    np.testing.assert_allclose(kernel, xla, atol=2e-4, rtol=2e-4)


def test_impl_resolution():
    assert indexer.resolve_impl("auto", "native") == "xla"  # CPU: the reference path
    assert indexer.resolve_impl("pallas_tpu", "bf16") == "pallas_tpu"
    assert indexer.resolve_impl("pallas_tpu", "fp4_ue8m0") == "pallas_tpu"  # V4 key format
    with pytest.raises(NotImplementedError, match="key_format='fp4_e4m3'"):
        indexer.resolve_impl("pallas_tpu", "fp4_e4m3")
    with pytest.raises(NotImplementedError, match="pallas_gpu"):
        indexer.resolve_impl("pallas_gpu", "native")
