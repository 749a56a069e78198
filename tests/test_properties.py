"""Property tests of the core promises, in float64, for every tiny preset and its ablations:

1. prefill + decode_step logits == the teacher-forced forward's logits, for every row and
   step (ragged prompts, chunked prefill, bounded replay with R >= prompt, ring wrap-around,
   many completed blocks, top-k below and above the visible count, query and key blocks
   that do not divide the sequence, FP8/FP4 indexer keys rotated and trained with fake
   quant);
2. the teacher-forced forward is causal: logits at positions <= t never depend on tokens
   after t.

Hypothesis draws the ablation (from each preset's knobs), the prompt lengths, the chunk size,
the number of decode steps and the tokens. Searches are derandomized, their configs from a
small menu per preset, so compiled programs are shared across examples: `make test` (the fast
tier) runs two or three examples per preset on its first menu entry; the full tier (`full`
marker, `make test-all`) the quick search over every menu entry. The broad search (the full
tier's tests) draws every knob and random seeds:

    DSATTN_FUZZ_EXAMPLES=500 .venv/bin/python -m pytest -q -n 2 -m full tests/test_properties.py

Run it before closing any change to attention, caches or generate.
"""

import os
from functools import lru_cache

import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsattn import generate
from dsattn.model import Transformer
from tests.helpers import forward, preset

BROAD = int(os.environ.get("DSATTN_FUZZ_EXAMPLES", "0"))
ROWS = 3
MAX_LEN = 300  # cache capacity: no power of two, so pages and entry counts rarely divide it
MAX_PROMPT = 220
MAX_STEPS = 80
TOL = 1e-9  # relative, float64 (logits are O(1), so also the absolute tolerance)

# Each preset's ablation knobs: override key -> values. The first value of each is the one the
# quick search keeps unless its menu (QUICK) says otherwise.
SCAN = {"model.scan_layers": [False, True]}  # 4-layer presets: one layer, then a scan over 3
# Query blocks (attention/blocks.py) and the indexer's key blocks: larger than any T, not
# dividing T, a few tokens.
QBLOCK = {"attention.query_block": [512, 7, 32, 301]}
KBLOCK = {"indexer.key_block": [4096, 5, 16]}
# Entries per step of the online softmax over a long shared read (HCA's entries, a window)
EBLOCK = {"attention.entry_block": [2048, 3, 16]}
# Low-bit search keys (rotated by the Hadamard matrix first); trained with fake quant, which
# `ablation` adds, so the forward computes what the cache stores.
KEYS = {"cache.key_format": ["native", "fp4_ue8m0", "fp8_ue8m0"]}
KNOBS = {
    "mha": {**SCAN, **QBLOCK},
    "gqa": {**QBLOCK},
    "mqa": {},
    "mla": {"cache.page_size": [16, 7], **SCAN, **QBLOCK},
    "dsa": {"attention.top_k": [32, 5, 400], "cache.page_size": [16, 7], **SCAN, **QBLOCK,
            **KBLOCK, **KEYS},
    "v4": {"attention.top_k": [8, 3, 200], "attention.window": [16, 5, 40],
           "attention.csa_ratio": [4, 2, 3], "attention.hca_ratio": [16, 8, 5],
           "cache.page_size": [16, 7, 3], **QBLOCK, **KBLOCK, **EBLOCK, **KEYS},
    "v41": {"attention.top_k": [8, 3, 200], "attention.window": [16, 5, 40],
            "attention.pool_blocks": [3, 0, 1, 8], "attention.pool_block_size": [4, 2, 8],
            "attention.sharing": [True, False], "attention.ced_split": [5, 0],
            "attention.ratio": [0, 2, 3],  # 0: the preset's per-layer ratios (2 and 1)
            "cache.page_size": [16, 7, 5],
            **SCAN, **QBLOCK, **KBLOCK, **EBLOCK, **KEYS},  # scans with sharing off: full*3 (encoder), full*5 (decoder)
}
# The quick search's configs: a few ablations per preset, each compiled once and shared by
# that preset's examples.
QUICK = {
    "mha": [{"attention.query_block": 7}], "gqa": [{}], "mqa": [{}],
    "mla": [{"cache.page_size": 7, "attention.query_block": 32}],
    "dsa": [{"attention.top_k": 5, "cache.page_size": 7, "attention.query_block": 7,
             "indexer.key_block": 16}],
    "v4": [{"attention.top_k": 3, "attention.window": 5, "attention.hca_ratio": 5,
            "cache.page_size": 7, "attention.query_block": 32, "indexer.key_block": 5,
            "attention.entry_block": 3}],
    "v41": [{}, {"attention.top_k": 3, "attention.pool_blocks": 8,
                 "attention.pool_block_size": 2, "cache.page_size": 7,
                 "attention.query_block": 7, "indexer.key_block": 5,
                 "attention.entry_block": 16, "cache.key_format": "fp4_ue8m0"}],
}
PRESETS = list(KNOBS)


@lru_cache(maxsize=None)
def built(name: str, overrides: tuple[str, ...]):
    """(model, its bound programs) per config, built once and shared by the examples."""
    cfg = preset(name, "model.dtype=float64", *overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(7))
    return model, generate.engine(model)


def ablation(name: str, draw, tier: str) -> tuple[str, ...]:
    """tier: "fast" (the first menu entry), "quick" (the menu) or "broad" (every knob)."""
    if tier == "broad":
        chosen = {k: draw(st.sampled_from(v)) for k, v in KNOBS[name].items()}
    else:
        chosen = draw(st.sampled_from(QUICK[name][:1] if tier == "fast" else QUICK[name]))
    if chosen.get("cache.key_format", "native") != "native":
        chosen = {**chosen, "cache.fake_quant": True}
    return tuple(f"{k}={str(v).lower()}" for k, v in sorted(chosen.items()))


@st.composite
def prompt_case(draw, replayable: bool, broad: bool):
    """One batch: prompt lengths, decode steps, prefill chunk, replay R (or None), seed."""
    lengths = draw(st.lists(st.integers(1, MAX_PROMPT), min_size=ROWS, max_size=ROWS))
    steps = draw(st.integers(1, min(MAX_STEPS, MAX_LEN - max(lengths))))
    # Chunks of 16 and 32 share the bucket widths 16 and 32 (fewer compiles); 1024 (the
    # default) runs each prompt whole, in its own bucket.
    chunk = draw(st.sampled_from([16, 32, 64, 1024] if broad else [16, 32]))
    replay = None
    if replayable and draw(st.booleans()):  # R >= every prompt: must equal exact prefill
        replay = draw(st.sampled_from([MAX_LEN, max(lengths)])) if broad else MAX_LEN
    return lengths, steps, chunk, replay, draw(st.integers(0, 2**16))


@st.composite
def decode_case(draw, name, tier):
    """A config and a few batches for it (the broad search amortizes its compiles)."""
    overrides = ablation(name, draw, tier)
    ced = dict(o.split("=") for o in overrides).get("attention.ced_split",
                                                     "5" if name == "v41" else "0")
    broad = tier == "broad"
    cases = st.lists(prompt_case(ced != "0", broad), min_size=1, max_size=3 if broad else 1)
    return overrides, draw(cases)


def tier_of(full: bool) -> str:
    """The fast tier's tests stay quick whatever DSATTN_FUZZ_EXAMPLES says."""
    return ("broad" if BROAD else "quick") if full else "fast"


def search(tier: str, examples: int):
    broad = tier == "broad"
    return settings(max_examples=BROAD if broad else examples, derandomize=not broad,
                    deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_and_decode_equal_forward(name):
    """The fast tier: two drawn examples on the first menu entry."""
    decode_search(name, tier_of(full=False), examples=2)


@pytest.mark.full
@pytest.mark.parametrize("name", PRESETS)
def test_prefill_and_decode_equal_forward_search(name):
    """The full tier: the quick search over every menu entry (or the broad one)."""
    decode_search(name, tier_of(full=True), examples=3)


def decode_search(name: str, tier: str, examples: int):
    @search(tier, examples)
    @given(decode_case(name, tier))
    def check(case):
        overrides, batches = case
        model, bound = built(name, overrides)
        for lengths, steps, chunk, replay, seed in batches:
            tokens = np.random.default_rng(seed).integers(0, 256, (ROWS, MAX_LEN))
            want = np.asarray(forward(model, tokens))
            rows, lengths = np.arange(ROWS), np.asarray(lengths)
            cache = generate.init_cache(model, ROWS, MAX_LEN)
            logits, cache = generate.prefill(bound, tokens[:, : lengths.max()], lengths,
                                             cache, replay=replay, chunk=chunk)
            got = [np.asarray(logits)]
            for s in range(steps):
                logits, cache = generate.decode_step(bound, tokens[rows, lengths + s], cache)
                got.append(np.asarray(logits))
            for s, g in enumerate(got):
                np.testing.assert_allclose(
                    g, want[rows, lengths - 1 + s], rtol=TOL, atol=TOL,
                    err_msg=f"{name} {overrides}: lengths {lengths.tolist()}, chunk {chunk}, "
                            f"replay {replay}, step {s} (0 = prefill)")

    check()


@st.composite
def causal_case(draw, name, tier):
    overrides = ablation(name, draw, tier)
    t = draw(st.integers(0, MAX_LEN - 2))
    return overrides, t, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("name", PRESETS)
def test_forward_is_causal(name):
    """The fast tier: three drawn examples on the first menu entry."""
    causal_search(name, tier_of(full=False), examples=3)


@pytest.mark.full
@pytest.mark.parametrize("name", PRESETS)
def test_forward_is_causal_search(name):
    causal_search(name, tier_of(full=True), examples=4)


def causal_search(name: str, tier: str, examples: int):
    @search(tier, examples)
    @given(causal_case(name, tier))
    def check(case):
        overrides, t, seed = case
        model, _ = built(name, overrides)
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, 256, (ROWS, MAX_LEN))
        other = tokens.copy()
        other[:, t + 1:] = rng.integers(0, 256, (ROWS, MAX_LEN - t - 1))
        np.testing.assert_allclose(np.asarray(forward(model, other))[:, : t + 1],
                                   np.asarray(forward(model, tokens))[:, : t + 1],
                                   rtol=1e-12, atol=1e-12,
                                   err_msg=f"{name} {overrides}: tokens after {t} changed")

    check()
