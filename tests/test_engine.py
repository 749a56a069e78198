"""generate.Engine: a model split once, with its own programs and the record of the caches it
produced (host row positions, evaluation counts, decode compilations)."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import generate
from dsattn.bench.compiles import compilations
from dsattn.errors import CacheExhausted, InputError
from dsattn.model import Transformer
from tests.helpers import preset, tiny_model

MLA = ("mla", "model.n_layers=1")  # the same cached model as test_limits' small("mla")
# A CED model: encoder layer 0, decoder layer 1 (test_limits' small("v41")).
V41 = ("v41", "model.n_layers=2", "attention.layers=full, full", "attention.ratios=2, 1",
       "attention.ced_split=1")


def test_engine_decodes_like_the_module_functions_and_compiles_decode_once():
    model = tiny_model(*MLA)
    toks = np.random.RandomState(0).randint(0, 256, (2, 16))
    lengths = np.array([5, 3])
    shared = generate.engine(model)
    assert generate.engine(model) is shared and generate.engine(shared) is shared

    def decode(step, steps=6):
        logits, cache = generate.prefill(model, toks[:, :5], lengths,
                                         generate.init_cache(model, 2, 16))
        out = [np.asarray(logits)]
        for s in range(steps):
            logits, cache = step(jnp.asarray(toks[:, 5 + s]), cache)
            out.append(np.asarray(logits))
        return np.stack(out), cache

    def counted(step, counts):  # the programs each decode step compiles
        def run(*args):
            with compilations() as c:
                out = step(*args)
            counts.append(c.n)
            return out
        return run

    expected, _ = decode(lambda *a: generate.decode_step(model, *a))
    # The module functions and engine(model) share one engine: nothing compiles again.
    again_counts, eng_counts = [], []
    again, _ = decode(counted(shared.decode_step, again_counts))
    assert sum(again_counts) == 0
    np.testing.assert_array_equal(again, expected)
    # A new Engine compiles its own decode program, once for all its steps (and reads the
    # positions of a cache it did not produce once).
    eng = generate.Engine(model)
    got, cache = decode(counted(eng.decode_step, eng_counts))
    np.testing.assert_array_equal(got, expected)
    assert eng_counts == [1, 0, 0, 0, 0, 0]
    np.testing.assert_array_equal(np.asarray(cache.pos), lengths + 6)


def test_host_position_check_refuses_without_reading_or_touching_the_cache(monkeypatch):
    model = tiny_model(*MLA)
    toks = np.random.RandomState(1).randint(0, 256, (2, 16))
    eng = generate.engine(model)
    _, cache = eng.prefill(toks, [16, 4], eng.init_cache(2, 16))
    snap = jax.tree.map(np.array, cache)
    reads = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(x) or real(x))
    tok = jnp.asarray([1, 2])
    for _ in range(2):
        with pytest.raises(CacheExhausted, match="decode_step: row 0 reached max_len=16"):
            eng.decode_step(tok, cache)
    assert reads == []  # the engine knew the positions: no device read
    with pytest.raises(CacheExhausted, match="row 0 reached max_len=16"):
        generate.Engine(model).decode_step(tok, cache)  # another engine reads them once
    assert len(reads) == 1
    assert not cache.pos.is_deleted()  # not donated: nothing ran
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, cache), snap)


def test_replay_prefill_evaluation_count():
    model = tiny_model(*V41)
    a = model.cfg.attention
    enc, dec = a.ced_split, model.cfg.model.n_layers - a.ced_split
    toks = np.random.RandomState(2).randint(0, 256, (2, 16))
    lengths = [12, 9]
    eng = generate.engine(model)
    _, cache = eng.prefill(toks[:, :12], lengths, eng.init_cache(2, 16), replay=4)
    # (Exact prefill: test_v41's test_replay_evaluation_count; decode steps adding every row
    # in every layer: test_decode's test_prefill_in_chunks_equals_one_chunk.)
    assert eng.evaluations(cache) == enc * sum(lengths) + dec * 2 * 4
    with pytest.raises(InputError, match="did not produce this cache"):
        generate.Engine(model).evaluations(cache)


def test_module_engine_goes_with_the_model_and_sees_new_weights():
    model = Transformer(preset("mla", "model.n_layers=1", "model.dtype=float64"),
                        rngs=nnx.Rngs(1))
    eng = generate.engine(model)
    state = eng.state
    assert generate.engine(model) is eng and eng.state is state  # unchanged: nothing re-read
    emb = next(v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
    emb.set_value(emb.get_value() * 2)  # in place, as an optimizer step or nnx.update does
    assert generate.engine(model) is eng and eng.state is not state
    assert any(leaf is emb.get_raw_value() for leaf in jax.tree.leaves(eng.state))
    ref = weakref.ref(eng)
    del model, eng, emb
    gc.collect()
    assert ref() is None
