"""The recall task: distances are the ones requested, a lookup scores 1.0, a lookup limited
to a window and a random guesser score chance beyond it, and the data.source hook serves it."""

import numpy as np
import pytest
from flax import nnx

from dsattn import data, datasource, recall, recall_eval
from dsattn.datasource import SourceKind
from dsattn.config import DataConfig
from dsattn.errors import ConfigError
from dsattn.model import Transformer
from tests.helpers import preset, tiny_model

SPEC = recall.RecallSpec(min_dist=10, max_dist=40, density=0.3, length=20_000)


def _pairs(tokens):
    """(start, key, value) of every fact and query, read back from the bytes alone."""
    def at(marker):
        return [(int(i), bytes(tokens[i + 1:i + 3].astype(np.uint8)),
                 bytes(tokens[i + 3:i + 5].astype(np.uint8)))
                for i in np.flatnonzero(tokens == marker)]
    return at(recall.FACT), at(recall.QUERY)


def test_stream_distances_keys_and_values():
    tokens, facts, queries = recall.make_stream(20_000, SPEC, None, np.random.default_rng(0))
    f, q = _pairs(tokens)
    assert len(f) == len(q) == len(facts) > 300
    d = queries - facts
    assert d.min() >= 10 and d.max() <= 40 and {10, 40} <= set(d.tolist())
    by_start = {s: (k, v) for s, k, v in f}
    for fs, qs in zip(facts, queries):
        key, val = by_start[fs]
        assert (int(qs), key, val) in q
        assert val.isdigit() and key.isalpha()
        # no other fact with this key between the fact and its query: the answer is unique
        assert not [s for s, k, _ in f if fs < s < qs and k == key]


def test_parse_source():
    """datasource.parse is the one reader of data.source: a recall source's parameters come
    back checked in DataSource.recall; recall.source_text writes a spec back as a source."""
    assert datasource.parse("recall").recall == recall.RecallSpec()
    src = datasource.parse("recall:min_dist=8,max_dist=64,density=0.2,corpus=stdlib")
    s = src.recall
    assert src.kind is SourceKind.RECALL and src.byte_level
    assert (s.min_dist, s.max_dist, s.density, s.corpus) == (8, 64, 0.2, "stdlib")
    assert datasource.parse(recall.source_text(s)).recall == s
    assert recall.source_text(recall.RecallSpec()) == "recall"
    assert datasource.parse("stdlib").recall is None
    # a path that matches nothing yet parses (its files are looked up when read): no recall
    ghost = datasource.parse("no/such/dir/*.txt")
    assert ghost.kind is SourceKind.TEXT and ghost.recall is None and ghost.tokenizer is None
    assert datasource.parse("recall:other_weight=0.5").recall.other_weight == 0.5
    with pytest.raises(ConfigError, match=r"data.source: recall parameter 'min_dist' is not "
                                          r"key=value"):
        datasource.parse("recall:min_dist")
    with pytest.raises(ConfigError, match=r"data.source.*'mindist'"):
        datasource.parse("recall:mindist=8")
    with pytest.raises(ConfigError, match="data.source.*min_dist <= max_dist"):
        datasource.parse("recall:min_dist=64,max_dist=8")
    with pytest.raises(ConfigError, match="max_dist='x'"):
        datasource.parse("recall:max_dist=x")


def test_probes_place_one_pair_at_each_distance():
    p = recall.probes([6, 20, 57], 5, 64, SPEC)
    assert p.tokens.shape == (15, 64) and sorted(set(p.distance.tolist())) == [6, 20, 57]
    for row, d, ans in zip(p.tokens, p.distance, p.answer_pos):
        q = 64 - recall.PAIR_LEN
        assert row[q] == recall.QUERY and row[q - d] == recall.FACT
        assert np.array_equal(row[q + 1:], row[q - d + 1:q - d + recall.PAIR_LEN])
        assert list(ans) == [q + 3, q + 4]
        keys = [bytes(row[i + 1:i + 3].astype(np.uint8)) for i in np.flatnonzero(row == 1)]
        assert keys.count(bytes(row[q + 1:q + 3].astype(np.uint8))) == 1


def test_oracle_one_window_and_random_chance():
    window = 16
    p = recall.probes([8, 16, 24, 48], 200, 64, SPEC)
    assert recall.score(recall.oracle(p.tokens), p) == {8: 1.0, 16: 1.0, 24: 1.0, 48: 1.0}
    # A model that sees only the last `window` positions (an SWA layer) cannot do better
    # than chance beyond it: values carry no trace anywhere else.
    swa = recall.score(recall.oracle(p.tokens, lookback=window), p)
    assert swa[8] == swa[16] == 1.0
    guess = recall.score(np.random.default_rng(1).choice(recall.VALUE_ALPHABET,
                                                         p.tokens.shape), p)
    for acc in (swa[24], swa[48], *guess.values()):  # 400 answer bytes: sd 0.015
        assert abs(acc - recall.CHANCE) < 0.06


def test_data_source_hook_and_mixture():
    c = data.load_corpus(DataConfig(source="recall:min_dist=8,max_dist=32,length=8000"), 256)
    assert len(c.train) == 8000 and len(c.val) == 400 and "recall" in c.description
    b = data.batch_at(c.train, 0, 2, 32, 0)
    assert b["inputs"].shape == (2, 32)
    mix = data.load_corpus(DataConfig(source="recall:corpus=stdlib,length=50000"), 256)
    text = data.decode(mix.train)
    assert "def " in text and "import" in text  # the filler is the corpus
    assert (mix.train == recall.FACT).sum() == (mix.train == recall.QUERY).sum() > 100
    with pytest.raises(ConfigError, match="vocab_size"):
        data.load_corpus(DataConfig(source="recall"), 128)


def test_model_predictions_align_with_the_forward():
    cfg = preset("mha", "model.n_layers=1", "model.d_model=32", "model.ffn_hidden=64",
                 "attention.head_dim=8", "model.dtype=float32")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    p = recall.probes([8, 24], 3, 32, SPEC)
    pred = recall_eval.model_predictions(model, p.tokens, batch=4)
    logits = np.asarray(model(p.tokens[:2]))
    assert np.array_equal(pred[:2, 1:], logits.argmax(-1)[:, :-1])
    acc = recall_eval.accuracy(model, p)
    assert set(acc) == {8, 24} and all(0 <= a <= 1 for a in acc.values())


MQAR = "recall:format=mqar,min_dist=2,max_dist=62,block=64,pairs=8,keys=16,values=16,length=6400"


def test_mqar_blocks_keys_distances_and_weights():
    spec = datasource.parse(MQAR).recall
    tokens, answer, facts, queries = recall.mqar_block(spec, np.random.default_rng(0))
    assert len(tokens) == 64 and len(facts) == 8
    d = queries - facts
    assert d.min() >= 2 and d.max() <= 62 and (d % 2 == 0).all()
    keys = tokens[facts]
    assert len(set(keys.tolist())) == 8  # keys unique within a block
    assert ((keys >= recall.MQAR_KEY0) & (keys < recall.MQAR_KEY0 + 16)).all()
    assert np.array_equal(tokens[queries], keys) and np.array_equal(tokens[queries + 1],
                                                                    tokens[facts + 1])
    assert np.flatnonzero(answer).tolist() == sorted((queries + 1).tolist())
    c = data.load_corpus(DataConfig(source=MQAR), 256)
    assert c.block == 64 and len(c.train) == 6400 and c.train_weights.shape == c.train.shape
    b = c.batch(3, 4, 64, 0)
    assert (b["inputs"][:, 0] < 256).all() and b["weights"].shape == (4, 64)
    # windows are whole blocks, and weights mark exactly the answers (the target's weight)
    for row, tgt, w in zip(b["inputs"], b["targets"], b["weights"]):
        for t in np.flatnonzero(w):
            assert row[t] >= recall.MQAR_KEY0 and tgt[t] >= recall.MQAR_VALUE0
            f = np.flatnonzero(row[:t] == row[t])
            assert len(f) == 1 and row[f[0] + 1] == tgt[t]
    with pytest.raises(ConfigError, match="max_dist"):
        datasource.parse("recall:format=mqar,max_dist=200")
    with pytest.raises(ConfigError, match="format"):
        datasource.parse("recall:format=other")


def test_mqar_probes_and_weighted_loss():
    spec = datasource.parse(MQAR).recall
    p = recall.probes([2, 16, 62], 4, 64, spec)
    for row, d, ans in zip(p.tokens, p.distance, p.answer_pos):
        assert list(ans) == [63] and row[62] == row[62 - d] and row[63] == row[63 - d]
        assert (row == row[62]).sum() == 2  # the probe's key occurs only in its pair
    # Past the training length: the same probes after 128 tokens of two earlier blocks.
    stream = recall.mqar_stream(8, spec, np.random.default_rng(3))[0]
    far = recall.probes([2, 16, 62], 4, 64, spec, stream, prefix=128)
    for row, d, ans in zip(far.tokens, far.distance, far.answer_pos):
        assert len(row) == 192 and list(ans) == [191]
        assert row[190] == row[190 - d] and row[191] == row[191 - d]
        assert (row == row[190]).sum() == 2  # not in the earlier blocks either
        # the prefix is the two blocks before a block of the stream, the probe's key
        # scrubbed (a few tokens)
        assert min((stream[s - 128:s] != row[:128]).sum()
                   for s in range(128, len(stream) - 63, 64)) <= 8
    from dsattn.train import loss_fn
    cfg = preset("mha", "model.n_layers=1", "model.d_model=32", "model.ffn_hidden=64",
                 "attention.head_dim=8", "model.dtype=float32")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    c = data.load_corpus(DataConfig(source=MQAR), 256)
    b = c.batch(0, 2, 64, 0)
    nll = -np.log(np.take_along_axis(np.asarray(
        __import__("jax").nn.softmax(model(b["inputs"]), -1)), b["targets"][..., None], -1))[..., 0]
    w = b["weights"]
    assert np.isclose(float(loss_fn(model, b)[1]["ce"]), (nll * w).sum() / w.sum(), rtol=1e-4)
    from dsattn.evaluate import mean_loss  # held-out loss: the same weighted mean
    assert np.isclose(mean_loss(model, [b]), (nll * w).sum() / w.sum(), rtol=1e-4)


def test_mqar_joint_and_repeat():
    # joint=1: a fact is one token J = JOINT0 + key * values + value; the query `key value`
    spec = datasource.parse("recall:format=mqar,joint=1,block=64,pairs=8,keys=8,values=16,"
                             "min_dist=2,max_dist=62,length=6400").recall
    tokens, answer, facts, queries = recall.mqar_block(spec, np.random.default_rng(1))
    j = tokens[facts] - recall.MQAR_JOINT0
    assert np.array_equal(tokens[queries], recall.MQAR_JKEY0 + j // 16)
    assert np.array_equal(tokens[queries + 1], recall.MQAR_JVALUE0 + j % 16)
    assert np.flatnonzero(answer).tolist() == sorted((queries + 1).tolist())
    # repeat=W: noise units come as `a b a b`, the repeat's b (the token before its predicting
    # position) weighs W; answers still weigh 1
    spec = datasource.parse(MQAR + ",repeat=0.5").recall
    tokens, answer, facts, queries = recall.mqar_block(spec, np.random.default_rng(2))
    rep = np.flatnonzero(answer == 0.5)
    assert len(rep) and (rep % 2 == 1).all()
    assert (tokens[rep] == tokens[rep - 2]).all() and (tokens[rep - 1] == tokens[rep - 3]).all()
    assert np.flatnonzero(answer == 1).tolist() == sorted((queries + 1).tolist())


def test_mqar_warm_steps_draw_only_near_facts_first():
    """warm_steps=N,warm_dist=D: training batches of steps < N hold answers at most D tokens
    after their facts; later steps draw the source's full range; validation never warms."""
    c = data.load_corpus(DataConfig(source=MQAR + ",warm_steps=5,warm_dist=8"), 256)

    def distances(b):
        out = []
        for row, w in zip(b["inputs"], b["weights"]):
            for t in np.flatnonzero(w):  # the query key at t, its fact the same key before it
                out.append(t - np.flatnonzero(row[:t] == row[t])[0])
        return np.array(out)

    warm = np.concatenate([distances(c.batch(s, 8, 64, 0)) for s in range(5)])
    late = np.concatenate([distances(c.batch(s, 8, 64, 0)) for s in range(5, 10)])
    assert warm.min() >= 2 and warm.max() <= 8
    assert late.max() > 8 and late.max() <= 62
    assert distances(c.eval_batches(1, 8, 64)[0]).max() > 8
    with pytest.raises(ConfigError, match="warm_dist"):
        datasource.parse(MQAR + ",warm_steps=5,warm_dist=100")


def test_recall_through_the_cache_equals_the_forward_in_float64():
    """Prefill up to the answer and teacher-forced decode read the probes as the forward does
    (decode == forward), so per-token predictions agree; both recall kinds and formats."""
    for source, dists in ((MQAR, [2, 30, 62]), ("recall:min_dist=8,max_dist=40", [8, 40])):
        spec = datasource.parse(source).recall
        p = recall.probes(dists, 2, 64, spec)
        model = tiny_model("v4", "model.n_layers=2", "attention.layers=swa, csa")
        via_cache = recall_eval.cache_predictions(model, p, batch=4)
        forward = recall_eval.model_predictions(model, p.tokens)
        rows = np.arange(len(p.tokens))[:, None]
        np.testing.assert_array_equal(via_cache[rows, p.answer_pos], forward[rows, p.answer_pos])
        assert recall_eval.cache_accuracy(model, p) == recall_eval.accuracy(model, p)
