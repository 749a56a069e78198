"""The central invariant: prefill + decode_step logits == teacher-forced forward logits, for
every tiny preset, over a ragged batch, in float64; decode compiles once. And the engine's
bfloat16 inference weights, within a stated bfloat16 tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import generate
from dsattn.bench.compiles import compilations
from dsattn.model import Transformer
from tests.helpers import (check_decode_matches_forward, check_two_chunk_prefill, forward,
                           preset, tiny_model)

BASELINES = ["mha", "gqa", "mqa", "mla"]


@pytest.mark.parametrize("name", BASELINES)
def test_prefill_decode_equals_forward(name):
    model = tiny_model(name, "model.n_layers=2")
    check_decode_matches_forward(model, lengths=[3, 17, 9], n_decode=6, max_len=32)


def test_chunked_prefill_equals_one_prefill():
    check_two_chunk_prefill(tiny_model("mla", "model.n_layers=2"), [8, 5], 12, max_len=32)


def test_decode_step_compiles_once():
    model = tiny_model("gqa", "model.n_layers=1")
    cache = generate.init_cache(model, 2, 24)
    logits, cache = generate.prefill(model, np.ones((2, 4), int), [4, 2], cache)
    tok, steps = jnp.argmax(logits, -1), 0
    for _ in range(8):
        with compilations() as step:
            logits, cache = generate.decode_step(model, tok, cache)
        steps += step.n
        tok = jnp.argmax(logits, -1)
    assert steps <= 1  # the model's engine may have compiled it in an earlier test
    with compilations() as later:
        for _ in range(8):
            logits, cache = generate.decode_step(model, tok, cache)
            tok = jnp.argmax(logits, -1)
    assert later.n == 0  # nothing at all compiled during the later steps


def test_generate_greedy_matches_argmax_of_forward():
    model = tiny_model("mha", "model.n_layers=1")
    prompts = [[5, 6, 7], [9, 1]]
    outs = generate.generate(model, prompts, 5)
    for p, out in zip(prompts, outs):
        seq = list(p)
        for tok in out:
            logits = np.asarray(forward(model, [seq]))[0, -1]
            assert tok == int(np.argmax(logits))
            seq.append(tok)


def test_generate_stops_at_eos_and_stop_sequences():
    model = tiny_model("mha", "model.n_layers=1")
    free = generate.generate(model, [[1, 2, 3]], 6)[0]
    eos = free[2]
    cut = generate.generate(model, [[1, 2, 3]], 6, eos_id=eos)[0]
    assert cut == free[: free.index(eos)]
    stop = free[1:3]
    first_end = next(i for i in range(2, 7) if free[i - 2:i] == stop)
    stopped = generate.generate(model, [[1, 2, 3]], 6, stop=[stop])[0]
    assert stopped == free[:first_end]


def test_sampling_top_p_keeps_only_the_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 200)
    draws = {int(generate.sample(logits, k, temperature=1.0, top_p=0.7)[0]) for k in keys}
    assert draws == {0, 1}
    assert int(generate.sample(logits, keys[0])[0]) == 0  # greedy


# v41 with replay: the encoder's chunks run exactly, the decoder's replay spans a chunk
# boundary. (Chunks continuing a cache exactly: test_v4.py's chunked prefill.)
SMALL_V41 = ("model.n_layers=4", "attention.layers=swa, full, full, reuse",
             "attention.ratios=0, 2, 1, 1", "attention.ced_split=2")  # encoder | decoder


@pytest.mark.parametrize("name, overrides, replay", [("v41", SMALL_V41, 20)])
def test_prefill_in_chunks_equals_one_chunk(name, overrides, replay):
    """A prompt longer than `chunk` runs chunk by chunk (ragged rows end in different chunks,
    replay spans a chunk boundary): the same logits, and decoding on from either cache gives
    the same logits (pages may be allocated in another order)."""
    model = tiny_model(name, *overrides)
    lengths = np.asarray([45, 20, 33])
    toks = np.random.RandomState(3).randint(0, 256, (3, 52))
    runs = []
    for chunk in (16, 64):
        cache = generate.init_cache(model, 3, 64)
        logits, cache = generate.prefill(model, toks[:, :45], lengths, cache, replay=replay,
                                         chunk=chunk)
        out = [np.asarray(logits)]
        for s in range(4):
            logits, cache = generate.decode_step(model, toks[np.arange(3), lengths + s], cache)
            out.append(np.asarray(logits))
        runs.append((np.stack(out), generate.evaluations(cache)))
    np.testing.assert_allclose(runs[0][0], runs[1][0], atol=1e-9)
    assert runs[0][1] == runs[1][1]
    if replay:  # the decoder ran over exactly R prompt positions per row, then 4 steps
        a = model.cfg.attention
        enc, dec = a.ced_split, len(a.layers) - a.ced_split
        assert runs[0][1] == enc * (lengths.sum() + 12) + dec * (replay * 3 + 12)


ON_DEVICE_MODELS = [  # one MHA layer (a contiguous cache) fast; a V4.1 stack (ring and
    # paged caches, CED, reuse) in the full tier: the loop is the same for every cache
    pytest.param(("mha", "model.n_layers=1"), id="mha"),
    pytest.param(("v41", "model.n_layers=4", "attention.layers=swa, full, full, reuse",
                  "attention.ratios=0, 2, 1, 1", "attention.ced_split=2"),
                 id="v41", marks=pytest.mark.full)]


@pytest.mark.parametrize("preset", ON_DEVICE_MODELS)
def test_generate_on_the_device_equals_the_host_loop(preset):
    """generate's compiled token loop gives the tokens of the host loop (the one on_token
    streams from), row by row: sampling with eos and a stop sequence, ragged prompts, and
    rows that stop at different steps."""
    model = tiny_model(*preset)
    prompts = [[1, 2, 3, 4, 5], [9], [7, 7, 7]]
    free = generate.generate(model, prompts, 12, temperature=1.0, top_p=0.9, seed=4,
                             on_token=lambda *_: None)
    kw = dict(temperature=1.0, top_p=0.9, seed=4, eos_id=free[1][3], stop=[free[2][4:6]])
    streamed = []
    host = generate.generate(model, prompts, 12, on_token=lambda i, t: streamed.append((i, t)),
                             **kw)
    device = generate.generate(model, prompts, 12, **kw)
    assert device == host and sorted(streamed) == sorted(
        (i, t) for i, out in enumerate(host) for t in out)


    def cut(out):  # the rule: eos ends a row (left out), a stop sequence ends it (kept)
        kept = []
        for t in out:
            if t == kw["eos_id"]:
                break
            kept.append(t)
            if kept[-2:] == kw["stop"][0]:
                break
        return kept

    assert device == [cut(out) for out in free]  # a row's draws do not depend on the others
    assert len({len(out) for out in device}) > 1  # rows stopped at different steps
    assert generate.generate(model, prompts, 12, temperature=1.0, top_p=0.9, seed=4) == free


# -- bfloat16 inference weights ---------------------------------------------------------
# Stated tolerance of a bfloat16 decode against another bfloat16 (or a float32) evaluation:
# 0.03 on logits of magnitude <= ~2.5 (bfloat16 keeps 8 significant bits: one ulp is 2**-7
# at 1-2; measured differences are 1-2 ulps).
BF16_ATOL = 0.03
# mha in the fast tier; v4 (window, CSA/HCA paged caches, sink: minutes to compile here) full.
BF16_PRESETS = [("mha", ("model.n_layers=1",)),
                pytest.param("v4", (), marks=pytest.mark.full)]


def _engine_logits(eng, toks, lengths, n_decode, max_len=32):
    """Logits [1 + n_decode, B, V] of a ragged prefill and then the true next tokens."""
    b, lengths = len(lengths), np.asarray(lengths)
    logits, cache = eng.prefill(toks[:, : lengths.max()], lengths, eng.init_cache(b, max_len))
    out = [logits]
    for s in range(n_decode):
        logits, cache = eng.decode_step(toks[np.arange(b), lengths + s], cache)
        out.append(logits)
    return np.asarray(jnp.stack(out), np.float64)


@pytest.mark.parametrize("name, overrides", BF16_PRESETS)
def test_bf16_weights_decode_matches_the_same_weights_forward(name, overrides):
    # Parameters stored in bfloat16: the forward and the engine read the same weights.
    model = Transformer(preset(name, "model.dtype=bfloat16", "model.param_dtype=bfloat16",
                               *overrides), rngs=nnx.Rngs(0))
    eng = generate.Engine(model)
    lengths, n_decode = np.array([3, 12, 9]), 5
    toks = np.random.RandomState(0).randint(0, 256, (3, 12 + n_decode))
    got = _engine_logits(eng, toks, lengths, n_decode)
    full = np.asarray(forward(model, toks), np.float64)
    want = np.stack([full[np.arange(3), lengths - 1 + s] for s in range(n_decode + 1)])
    np.testing.assert_allclose(got, want, atol=BF16_ATOL)


@pytest.mark.parametrize("name, overrides", BF16_PRESETS)
def test_bf16_engine_holds_half_the_bytes_and_agrees_with_float32(name, overrides):
    m16 = Transformer(preset(name, "model.dtype=bfloat16", *overrides), rngs=nnx.Rngs(0))
    m32 = Transformer(preset(name, "model.dtype=float32", *overrides), rngs=nnx.Rngs(0))
    held, wide = generate.Engine(m16), generate.Engine(m16, weights_dtype=jnp.float32)
    # Bytes: matrices at 2 bytes, vectors (norm scales, sinks) at their stored 4.
    params = jax.tree.leaves(nnx.state(m16, nnx.Param))
    assert held.weight_bytes == sum(x.size * (2 if x.ndim >= 2 else 4) for x in params)
    assert wide.weight_bytes == sum(x.size * 4 for x in params)
    lengths, n_decode = np.array([4, 10]), 4
    toks = np.random.RandomState(1).randint(0, 256, (2, 10 + n_decode))
    got = _engine_logits(held, toks, lengths, n_decode)
    # The layers cast their matrices to bfloat16 where they use them: holding them in it
    # changes nothing.
    np.testing.assert_array_equal(got, _engine_logits(wide, toks, lengths, n_decode))
    # Against float32 compute of the same weights: logits within the tolerance, and the
    # same greedy token wherever float32's top two are further apart than twice it.
    ref = _engine_logits(generate.Engine(m32), toks, lengths, n_decode)
    np.testing.assert_allclose(got, ref, atol=BF16_ATOL)
    top2 = np.sort(ref, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 2 * BF16_ATOL
    assert clear.mean() > 0.5
    np.testing.assert_array_equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
