"""generate.Engine: a model as a value (graph, weights, optional mesh) whose programs are
shared by every engine of one model structure; host positions travel with the cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import generate
from dsattn.bench.compiles import compilations
from dsattn.errors import CacheExhausted
from dsattn.model import Transformer
from tests.helpers import preset, tiny_model

MLA = ("mla", "model.n_layers=1")  # the same cached model as test_limits' small("mla")
# A CED model: encoder layer 0, decoder layer 1 (test_limits' small("v41")).
V41 = ("v41", "model.n_layers=2", "attention.layers=full, full", "attention.ratios=2, 1",
       "attention.ced_split=1")


def _decode(step, model, toks, lengths, steps=6):
    logits, cache = generate.prefill(model, toks[:, :5], lengths,
                                     generate.init_cache(model, 2, 16))
    out = [np.asarray(logits)]
    for s in range(steps):
        logits, cache = step(jnp.asarray(toks[:, 5 + s]), cache)
        out.append(np.asarray(logits))
    return np.stack(out), cache


def _counted(step, counts):  # the programs each decode step compiles
    def run(*args):
        with compilations() as c:
            out = step(*args)
        counts.append(c.n)
        return out
    return run


def test_engines_of_one_structure_share_their_programs():
    model = tiny_model(*MLA)
    toks = np.random.RandomState(0).randint(0, 256, (2, 16))
    lengths = np.array([5, 3])
    first_counts = []
    expected, _ = _decode(_counted(generate.Engine(model).decode_step, first_counts), model,
                          toks, lengths)
    assert first_counts == [1, 0, 0, 0, 0, 0]  # decode compiles once for all its steps
    # Another engine of the model, the module functions (an engine per call), and an engine
    # of another model of the same config compile nothing again.
    twin = Transformer(model.cfg, rngs=nnx.Rngs(7))
    for step, of in ((generate.Engine(model).decode_step, model),
                     (lambda *a: generate.decode_step(model, *a), model),
                     (generate.Engine(twin).decode_step, twin)):
        counts = []
        got, cache = _decode(_counted(step, counts), of, toks, lengths)
        assert sum(counts) == 0
        if of is model:
            np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(np.asarray(cache.pos), lengths + 6)


def test_host_position_check_refuses_without_reading_or_touching_the_cache(monkeypatch):
    model = tiny_model(*MLA)
    toks = np.random.RandomState(1).randint(0, 256, (2, 16))
    eng = generate.Engine(model)
    _, cache = eng.prefill(toks, [16, 4], eng.init_cache(2, 16))
    snap = jax.tree.map(np.array, cache)
    reads = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(x) or real(x))
    tok = jnp.asarray([1, 2])
    for e in (eng, generate.Engine(model)):  # the positions travel with the cache
        with pytest.raises(CacheExhausted, match="decode_step: row 0 reached max_len=16"):
            e.decode_step(tok, cache)
    assert reads == []  # no device read
    # A cache that went through a jax transformation lost them: read once.
    with pytest.raises(CacheExhausted, match="row 0 reached max_len=16"):
        eng.decode_step(tok, jax.tree.map(lambda x: x, cache))
    assert len(reads) == 1
    assert not cache.pos.is_deleted()  # not donated: nothing ran
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.array, cache), snap)


def test_host_positions_follow_prefill_and_decode():
    model = tiny_model(*MLA)
    toks = np.random.RandomState(3).randint(0, 256, (2, 16))
    eng = generate.Engine(model)
    cache = eng.init_cache(2, 16)
    np.testing.assert_array_equal(cache.host_pos, [0, 0])
    _, cache = eng.prefill(toks[:, :7], [7, 2], cache)
    np.testing.assert_array_equal(cache.host_pos, [7, 2])
    _, cache = eng.decode_step(jnp.asarray([1, 2]), cache)
    np.testing.assert_array_equal(cache.host_pos, np.asarray(cache.pos))
    np.testing.assert_array_equal(cache.host_pos, [8, 3])
    with pytest.raises(ValueError):  # read-only: it describes the device positions
        cache.host_pos[0] = 0
    moved = cache.replace(pos=cache.pos + 1)
    assert moved.host_pos is None  # a new pos without its host copy: unknown, read once
    assert generate.host_positions(moved).tolist() == [9, 4]


def test_replay_prefill_evaluation_count():
    model = tiny_model(*V41)
    a = model.cfg.attention
    enc, dec = a.ced_split, model.cfg.model.n_layers - a.ced_split
    toks = np.random.RandomState(2).randint(0, 256, (2, 16))
    lengths = [12, 9]
    eng = generate.Engine(model)
    _, cache = eng.prefill(toks[:, :12], lengths, eng.init_cache(2, 16), replay=4)
    # (Exact prefill: test_v41's test_replay_evaluation_count; decode steps adding every row
    # in every layer: test_decode's test_prefill_in_chunks_equals_one_chunk.)
    assert generate.evaluations(cache) == enc * sum(lengths) + dec * 2 * 4
    np.testing.assert_array_equal(np.asarray(cache.evaluations),
                                  enc * np.array(lengths) + dec * 4)
    _, cache = eng.decode_step(jnp.asarray([1, 2]), cache)
    assert generate.evaluations(cache) == enc * sum(lengths) + dec * 2 * 4 + 2 * (enc + dec)


def test_an_engine_keeps_its_weights_and_a_new_one_sees_updates():
    model = Transformer(preset("mla", "model.n_layers=1", "model.dtype=float64"),
                        rngs=nnx.Rngs(1))
    toks = np.random.RandomState(4).randint(0, 256, (1, 6))

    def last_logits(eng_or_model):
        eng = generate.engine(eng_or_model)
        logits, _ = eng.prefill(toks, None, eng.init_cache(1, 16))
        return np.asarray(logits)

    old = generate.Engine(model)
    before = last_logits(old)
    emb = next(v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
    emb.set_value(emb.get_value() * 2)  # in place, as an optimizer step or nnx.update does
    np.testing.assert_array_equal(last_logits(old), before)  # a value: its snapshot
    after = last_logits(model)  # the module functions: an engine of the current weights
    assert np.abs(after - before).max() > 1e-3
    with compilations() as c:
        np.testing.assert_array_equal(last_logits(generate.Engine(model)), after)
    assert c.n == 0


def test_comparing_graphs_changes_neither():
    """Graph equality has no side effect: comparing two equal Graphs leaves both operands'
    graphdef as they were. Graphs of one structure share one graphdef from the start
    (generate.canonical), so jit's lookups still compare by identity."""
    a, b = (nnx.graphdef(tiny_model(*MLA, seed=s)) for s in (0, 1))
    assert a == b and a is not b
    ga = generate.Graph(a)
    gb = generate.Graph(b)
    left, right = ga.graphdef, gb.graphdef
    assert ga == gb and gb == ga and hash(ga) == hash(gb)
    assert ga.graphdef is left and gb.graphdef is right
    assert right is left  # one canonical graphdef: the next comparison is by identity
    assert generate.Graph(nnx.graphdef(tiny_model("mha", "model.n_layers=1"))) != ga
