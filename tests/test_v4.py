"""V3.2 DSA and V4 (SWA, CSA, HCA): cached prefill + decode == teacher-forced forward, the
window is always visible, entries only once complete, and the indexer learns from its KL."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn import plan, train
from dsattn.attention import indexer, reference, selectors
from tests.helpers import (check_decode_matches_forward, check_two_chunk_prefill, forward, preset,
                           tiny_model)


@pytest.mark.parametrize("name", ["dsa", "v4"])
def test_prefill_decode_equals_forward(name):
    # dsa: top_k 32 < visible tokens; v4: window 16 wraps ~4 times, csa m=4 / hca m'=16 spans
    # complete many times, top_k 8 < visible csa entries, prompts end mid-span.
    model = tiny_model(name, "attention.top_k=8")
    check_decode_matches_forward(model, lengths=[5, 37, 22], n_decode=30, max_len=80)


def test_v4_chunked_prefill_equals_forward():
    # the first chunk ends mid-span; the second is longer than the window W = 16
    check_two_chunk_prefill(tiny_model("v4", "attention.top_k=8"), [21, 13], 38, max_len=64)


@pytest.mark.parametrize("name", ["v4", "dsa"])
def test_future_tokens_never_leak(name):
    """Logits at t do not depend on tokens after t: an entry is never visible before its
    span completes, and top-k never reaches ahead."""
    model = tiny_model(name, "attention.top_k=4")
    toks = np.random.RandomState(0).randint(0, 256, (1, 48))
    base = np.asarray(forward(model, toks))
    for t in (2, 15, 30, 33):  # inside spans and on span ends (m=4, m'=16)
        other = toks.copy()
        other[0, t + 1:] = (other[0, t + 1:] + 7) % 256
        np.testing.assert_allclose(np.asarray(forward(model, other))[0, : t + 1],
                                   base[0, : t + 1], rtol=1e-12, atol=1e-12)


def test_entry_visibility_counts():
    spec = plan.resolve(preset("v4"))[2]  # the first csa layer, m = 4
    assert spec.name == "csa" and spec.stride == 4
    pos = jnp.arange(10)[None]
    assert np.asarray(selectors.n_visible(pos, spec.stride))[0].tolist() == [
        0, 0, 0, 1, 1, 1, 1, 2, 2, 2]


def test_window_stays_visible_when_indexer_selects_nothing():
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(1, 3, 2, 8))
    window = jnp.asarray(rng.randn(1, 5, 8))
    wmask = jnp.asarray(np.tril(np.ones((3, 5), bool), 2)[None])
    entries = jnp.asarray(rng.randn(1, 3, 4, 8))  # gathered per query, all picks invalid
    none_valid = jnp.zeros((1, 3, 4), bool)
    sink = jnp.asarray([0.3, -1.0])
    with_entries, probs = reference.block_attention(q, [(entries, none_valid), (window, wmask)],
                                                    sink)
    window_only, _ = reference.block_attention(q, [(window, wmask)], sink)
    np.testing.assert_allclose(with_entries, window_only, atol=1e-12)
    assert float(jnp.max(probs[0])) == 0.0
    assert bool(jnp.all(jnp.sum(probs[1], -1) > 0))


def test_sink_is_a_zero_valued_logit():
    q = jnp.ones((1, 1, 1, 4))
    keys = jnp.asarray([[[1.0, 0, 0, 0], [0, 2.0, 0, 0]]])
    mask = jnp.ones((1, 1, 2), bool)
    out, _ = reference.block_attention(q, [(keys, mask)], jnp.asarray([0.5]))
    l = np.array([1.0, 2.0]) / 2  # q·k / sqrt(4)
    e = np.exp(l)
    expect = (e[0] * np.array([1, 0, 0, 0]) + e[1] * np.array([0, 2, 0, 0])) / (e.sum() + np.exp(0.5))
    np.testing.assert_allclose(np.asarray(out)[0, 0, 0], expect, rtol=1e-12)


def test_indexer_kl_zero_at_target_positive_otherwise():
    rng = np.random.RandomState(0)
    score = jnp.asarray(rng.randn(2, 3, 6))
    mask = jnp.asarray(rng.rand(2, 3, 6) > 0.3).at[..., 0].set(True)
    target = jax.nn.softmax(jnp.where(mask, score, -jnp.inf), -1) * 4.0  # summed over 4 heads
    assert abs(float(indexer.kl_loss(score, target, mask))) < 1e-12
    other = jnp.asarray(rng.rand(2, 3, 6))
    assert float(indexer.kl_loss(score, other, mask)) > 1e-3


def test_select_breaks_ties_toward_lowest_index_and_marks_invalid():
    score = jnp.asarray([[[1.0, 3.0, 3.0, 0.5, 3.0]]])
    visible = jnp.asarray([[[True, True, True, True, False]]])
    idx, ok = indexer.select(score, visible, 3)
    assert np.asarray(idx).tolist() == [[[1, 2, 0]]]
    idx, ok = indexer.select(score, jnp.asarray([[[True, False, False, False, False]]]), 3)
    assert np.asarray(ok).tolist() == [[[True, False, False]]]


def test_v4_training_lowers_both_losses(tmp_path):
    cfg = preset("v4", "train.batch_size=4", "train.seq_len=64", "train.steps=50",
                 "train.eval_every=50", "train.ckpt_every=50", "train.eval_batches=2",
                 "train.log_every=1", "indexer.dense_warmup_steps=10")
    out = train.Trainer(cfg, tmp_path, quiet=True).run()
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = np.mean([r["ce"] for r in rows[:5]]), np.mean([r["indexer_loss"] for r in rows[:5]])
    last = np.mean([r["ce"] for r in rows[-5:]]), np.mean([r["indexer_loss"] for r in rows[-5:]])
    assert last[0] < first[0] - 1.0, (first, last)
    assert last[1] < first[1], (first, last)
    assert np.isfinite(out["val_loss"])


@pytest.mark.parametrize("name, formats", [
    ("v4", ["cache.local_format=fp8_ue8m0", "cache.main_format=fp4_e4m3",
            "cache.key_format=fp4_ue8m0", "attention.layers=swa, csa, hca", "model.n_layers=3"]),
    ("dsa", ["cache.main_format=fp8_ds_mla", "attention.kv_lora_rank=128",
             "cache.key_format=fp4_ue8m0", "model.n_layers=2"]),
    ("mla", ["cache.main_format=fp8_ds_mla", "attention.kv_lora_rank=128", "model.n_layers=2"]),
    ("mha", ["cache.main_format=bf16", "model.n_layers=2"]),
])
def test_quantized_cache_decode_equals_fake_quant_forward(name, formats):
    """A model whose forward applies the formats' quantize-dequantize decodes from caches
    stored in those formats with the forward's numbers."""
    model = tiny_model(name, "cache.fake_quant=true", "attention.top_k=8", *formats)
    check_decode_matches_forward(model, lengths=[6, 19], n_decode=12, max_len=48, atol=1e-6)
