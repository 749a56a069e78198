"""The lightning indexer's recall (issue 60): in the dense warm-up, the share of the dense
attention's top-k mass that the indexer's picks hold, reported as metrics["indexer_recall"]
(the mean over queries, per layer, then over layers); NaN when nothing was measured."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import train
from dsattn.attention import indexer
from dsattn.model import Transformer
from dsattn.trainstep import TrainStep, loss_fn
from tests.helpers import preset

SHORT = ("model.dtype=float64", "train.seq_len=32", "train.batch_size=2", "model.n_layers=2",
         "indexer.dense_warmup_steps=5")
V4 = ("model.n_layers=3", "attention.layers=swa, csa, hca", "attention.hca_ratio=4",
      "attention.top_k=3")


def test_recall_of_hand_computed_picks():
    mass = jnp.asarray([[[0.4, 0.3, 0.2, 0.1, 0.0]]])
    visible = jnp.ones(mass.shape, bool)
    idx, ok = jnp.asarray([[[0, 2]]]), jnp.asarray([[[True, True]]])
    total, count = indexer.recall_terms(mass, visible, idx, ok)
    assert float(count) == 1
    np.testing.assert_allclose(total, (0.4 + 0.2) / (0.4 + 0.3), rtol=1e-12)


def test_recall_counts_valid_picks_ties_and_queries_with_mass():
    """k is each query's number of valid picks (fewer visible entries than top-k); tied
    mass leaves the top-k mass defined (either tied pick is recall 1); a query that sees
    nothing is not counted; unnormalised mass gives the same ratio."""
    mass = 3 * jnp.asarray([[[0.5, 0.25, 0.25, 0.0],    # tie: {0, 2} is a top-2
                             [0.6, 0.4, 0.0, 0.0],      # two visible, three picks asked
                             [0.0, 0.0, 0.0, 0.0]]])    # sees nothing
    visible = jnp.asarray([[[True] * 4, [True, True, False, False], [False] * 4]])
    idx = jnp.asarray([[[2, 0, 3], [1, 0, 0], [0, 0, 0]]])
    ok = jnp.asarray([[[True, True, False], [True, True, False], [False] * 3]])
    total, count = indexer.recall_terms(mass, visible, idx, ok)
    assert float(count) == 2 and float(total) == 2.0
    # one valid pick of the lesser entry: 0.4 of the top-1's 0.6
    total, count = indexer.recall_terms(mass[:, 1:2], visible[:, 1:2], idx[:, 1:2],
                                        jnp.asarray([[[True, False, False]]]))
    np.testing.assert_allclose(total, 0.4 / 0.6, rtol=1e-12)


def metrics_at(name, steps, *overrides):
    """metrics of loss_fn for the preset `name` at each training step of `steps`."""
    cfg = preset(name, *SHORT, *overrides)
    graph, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    f = jax.jit(lambda p, step: loss_fn(nnx.merge(graph, p), batch, step)[1])
    return [f(params, jnp.int32(s)) for s in steps]


# DSA's three equal layers run as one scanned unit (its aux stacked per layer), V4's unrolled
@pytest.mark.parametrize("name, extra", [("dsa", ("attention.top_k=4", "model.n_layers=3")),
                                         ("v4", V4)])
def test_recall_is_measured_in_the_dense_warmup_only(name, extra):
    warm, sparse = metrics_at(name, (0, 5), *extra)
    assert 0 < float(warm["indexer_recall"]) <= 1
    assert np.isnan(sparse["indexer_recall"])
    # a metric, not a loss
    np.testing.assert_allclose(warm["loss"], warm["ce"] + warm["indexer_loss"], rtol=1e-12)


def test_recall_does_not_depend_on_query_blocks():
    """By blocks of 8 queries in causal segments (the first segment holds 16 tokens, fewer
    than the 20 picks) as in one block."""
    (one,), (blk,) = (metrics_at("dsa", (0,), "attention.top_k=20", *more)
                      for more in ((), ("attention.query_block=8", "indexer.key_block=3")))
    np.testing.assert_allclose(blk["indexer_recall"], one["indexer_recall"], rtol=1e-12)


def test_picking_every_entry_is_recall_one():
    """top_k >= seq_len: the picks are every visible token, the attention's own top-k."""
    (warm,) = metrics_at("dsa", (0,), "attention.top_k=32")
    assert float(warm["indexer_recall"]) == 1.0


def test_accumulated_recall_is_the_whole_batch_recall():
    """Every micro-batch counts the same queries (which see entries depends on position),
    so the mean of micro-batch means is the whole batch's mean."""
    cfg = preset("dsa", *SHORT, "attention.top_k=4", "train.batch_size=4")
    graph, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    want = jax.jit(lambda p: loss_fn(nnx.merge(graph, p), batch, jnp.int32(0))[1])(params)
    accum = TrainStep(preset("dsa", *SHORT, "attention.top_k=4", "train.batch_size=4",
                             "train.grad_accum=2"), graph, params)
    got = jax.jit(accum.loss_and_grads)(nnx.to_pure_dict(params), batch, jnp.int32(0))[0]
    np.testing.assert_allclose(got["indexer_recall"], want["indexer_recall"], rtol=1e-12)


def test_metrics_jsonl_has_recall_in_the_dense_warmup_only(tmp_path):
    cfg = preset("dsa", *SHORT, "model.n_layers=1", "attention.top_k=4",
                 "indexer.dense_warmup_steps=2", "train.steps=3", "train.log_every=1",
                 "train.warmup_steps=0", "train.eval_every=3", "train.eval_batches=1",
                 "data.max_bytes=200000")
    train.Trainer(cfg, tmp_path / "run", quiet=True).run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [("indexer_recall" in r) for r in rows if "ce" in r] == [True, True, False]
