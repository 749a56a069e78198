"""The Hugging Face DeepseekV4 peer (dsattn.bench.peer_hf): our use of its cache reproduces its own
full forward, and the timers return sane numbers.

Skipped, with the reason, only when the optional `peer` extra (torch + transformers with
DeepseekV4) is not installed.
"""

import math

import pytest

from dsattn.bench import peer_hf
from tests.helpers import preset

WHY = peer_hf.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"peer extra not installed: {WHY}")

N, PREFILL, CHUNK = 96, 40, 16  # CSA (m=4, top_k=8) selects from t >= 35 on


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: one thread is fastest, and two spin against the other xdist worker."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cached_logits(model, ids, prefill: int, chunk: int):
    """Logits at every position: `prefill` tokens in chunks, then one token per call."""
    import torch
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    for s in range(0, prefill, chunk):
        out.append(model(input_ids=ids[:, s:min(s + chunk, prefill)], cache=cache,
                         use_cache=True).logits)
    for t in range(prefill, ids.shape[1]):
        out.append(model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits)
    assert cache.get_seq_length() == ids.shape[1]
    return torch.cat(out, 1)


def _ambiguous_from(model, ids):
    """Per row, the first position whose top-k is not unique in the full forward (a tie at
    the k-th score, e.g. ReLU zeros), or the sequence length; torch.topk may break such a tie
    differently per call, and the pick then feeds every later position. Also the full
    forward's logits."""
    import torch
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

    scores = []
    hooks = [mod.register_forward_hook(lambda _m, _i, o: scores.append(o.clone()))
             for mod in model.modules() if isinstance(mod, DeepseekV4IndexerScorer)]
    try:
        full = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    k, m = model.config.index_topk, model.config.compress_rates["compressed_sparse_attention"]
    b, n = ids.shape
    first = [n] * b
    for s in scores:  # [B, T, entries], one per CSA layer
        for row in range(b):
            for t in range(n):
                vis = (t + 1) // m
                if vis > k:
                    top = torch.sort(s[row, t, :vis], descending=True).values
                    if top[k - 1] - top[k] <= 1e-6 * max(1.0, abs(float(top[k - 1]))):
                        first[row] = min(first[row], t)
                        break
    return full, first


def test_cached_decode_matches_full_forward_all_entries():
    """With top_k above the entry count selection is a no-op, so every position must agree:
    chunked prefill and decode through the window, compressor and overlap cache state."""
    import torch

    cfg = preset("v4", "attention.top_k=1000")
    model, _ = peer_hf.build(cfg, seed=1)
    ids = torch.randint(0, cfg.model.vocab_size, (2, N),
                        generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(input_ids=ids, use_cache=False).logits
        cached = _cached_logits(model, ids, PREFILL, CHUNK)
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=0)


def test_cached_decode_matches_full_forward_top_k():
    """With the preset's top_k=8 the indexer really selects (every decode position sees more
    than 8 entries); positions before the first tied top-k agree."""
    import torch

    cfg = preset("v4")
    model, notes = peer_hf.build(cfg, seed=0)
    assert model.config.index_topk == cfg.attention.top_k == 8
    assert any(n.startswith("mHC") for n in notes) and any(n.startswith("FFN") for n in notes)
    ids = torch.randint(0, cfg.model.vocab_size, (4, N),
                        generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full, first = _ambiguous_from(model, ids)
        cached = _cached_logits(model, ids, PREFILL, CHUNK)
    compared = 0
    for row, p in enumerate(first):
        torch.testing.assert_close(cached[row, :p], full[row, :p], atol=1e-4, rtol=0)
        compared += max(0, p - PREFILL)
    # At random init many indexer weights are negative, so ReLU-zero ties are common; these
    # rows tie first at [49, 61, 53, 36], leaving 43 decode positions that all select.
    assert compared >= 24, f"only {compared} decode positions free of top-k ties: {first}"


def test_build_matches_shape():
    cfg = preset("v4")
    model, _ = peer_hf.build(cfg)
    c = model.config
    kinds = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
             "hca": "heavily_compressed_attention"}
    assert c.layer_types == [kinds[k] for k in cfg.attention.layers]
    assert c.compress_rates == {"compressed_sparse_attention": cfg.attention.csa_ratio,
                                "heavily_compressed_attention": cfg.attention.hca_ratio}
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim,
            c.sliding_window) == (cfg.model.d_model, cfg.attention.n_heads,
                                  cfg.attention.entry_dim, cfg.attention.rope_dim,
                                  cfg.attention.window)
    assert (c.index_n_heads, c.index_head_dim) == (cfg.indexer.n_heads, cfg.indexer.head_dim)
    with pytest.raises(ValueError, match="only swa/csa/hca"):
        peer_hf.build(preset("v41"))


def test_timers_at_toy_sizes():
    cfg = preset("v4", "model.n_layers=3", "attention.layers=swa,csa,hca")
    model, _ = peer_hf.build(cfg)
    d = peer_hf.time_decode(model, context=64, batch=2, steps=2, warmup=1, chunk=24)
    assert d["cache_tokens"] == 64 and "chunked prefill" in d["method"]
    for key in ("step_ms", "fill_s"):
        assert math.isfinite(d[key]) and d[key] > 0, d
    s = peer_hf.time_forward(model, 64, batch=1, repeats=2)
    assert math.isfinite(s) and s > 0
    with pytest.raises(MemoryError, match="max_bytes"):
        peer_hf.time_forward(model, 1 << 15)
