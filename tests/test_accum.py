"""Gradient accumulation (train.grad_accum): a step over N micro-batches is the step over the
whole batch (loss, metrics, gradients, updated parameters), in less memory; it trains under
a SeedGroup and may change on resume."""

import dataclasses
import json
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import config, train
from tests.helpers import loss_and_grads, preset

# Exact float64 (parameters too, where the config has a separate parameter dtype).
F64 = ("model.dtype=float64",) + (
    ("model.param_dtype=float64",)
    if "param_dtype" in {f.name for f in dataclasses.fields(config.ModelConfig)} else ())
SMALL = ("train.batch_size=8", "train.seq_len=32", "train.eval_batches=1",
         "train.warmup_steps=0", "train.log_every=1", "data.max_bytes=200000")
MHA = ("mha", "model.n_layers=2")
# CSA reads its indexer's top-2 of 8 entries (no dense warm-up): the KL loss is in aux.
V4 = ("v4", "model.n_layers=2", "attention.layers=swa, csa", "attention.top_k=2",
      "indexer.dense_warmup_steps=0")


def trainer(tmp_path, name, *overrides):
    return train.Trainer(preset(*name, *F64, *SMALL, *overrides),
                         tmp_path / "-".join(("run",) + overrides), quiet=True)


def uneven_weights(batch) -> dict:
    """The batch with loss weights that differ by row (a row's share of the weight is not
    1/B), so a plain mean of micro-batch means would be wrong."""
    b, t = batch["targets"].shape
    keep = np.random.RandomState(0).rand(b, t) < np.linspace(0.1, 0.9, b)[:, None]
    return {**batch, "weights": keep * np.linspace(0.5, 2.0, t)}


@pytest.mark.parametrize("name, weighted, n", [(MHA, True, 2), (MHA, True, 4), (V4, False, 2)],
                         ids=["mha-weights-2", "mha-weights-4", "v4-indexer-2"])
def test_accumulated_step_equals_the_whole_batch_step(tmp_path, name, weighted, n):
    """Loss, metrics and gradients of grad_accum=n equal train.loss_fn's on the whole batch
    (weighted cross-entropy: micro-batch means combined by their weights; the indexer's KL
    loss as on the whole batch), and one optimizer step the same parameters as grad_accum=1."""
    whole = trainer(tmp_path, name)
    accum = trainer(tmp_path, name, f"train.grad_accum={n}")
    batch = whole.batch_at(0)
    if weighted:
        batch = uneven_weights(batch)
    want, g_want = loss_and_grads(whole.model(), batch, jnp.int32(0))
    got, g_got = jax.jit(accum.trainstep.loss_and_grads)(accum.params, batch, jnp.int32(0))
    assert sorted(got) == sorted(want)
    if name is V4:
        assert float(want["indexer_loss"]) > 0
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12, err_msg=k)
    chex.assert_trees_all_close(g_got, nnx.to_pure_dict(g_want), rtol=1e-12, atol=1e-12)

    m_whole = whole.train_step(batch, 0)
    m_accum = accum.train_step(batch, 0)
    for k in m_whole:
        np.testing.assert_allclose(m_accum[k], m_whole[k], rtol=1e-12, atol=1e-12, err_msg=k)
    chex.assert_trees_all_close(accum.params, whole.params, rtol=1e-12, atol=1e-12)


def test_accumulation_holds_a_micro_batchs_temporaries(tmp_path):
    """The compiled step's temporaries (XLA's memory analysis) with batch B in 4 micro-batches
    are close to those of batch B/4 alone (plus the gradient sum, small here) and well below
    those of batch B in one piece (measured: 20.6, 23.3 and 89.1 MiB)."""
    t = 256
    args = ("model.n_layers=1", f"train.seq_len={t}", "data.max_bytes=200000")

    def temp(batch, n):
        tr = train.Trainer(preset("mha", *args, f"train.batch_size={batch}",
                                  f"train.grad_accum={n}"), tmp_path / f"{batch}x{n}",
                           quiet=True)
        tokens = jax.ShapeDtypeStruct((batch, t), jnp.int32)
        return tr.trainstep.train.lower(tr.params, tr.opt_state, {"inputs": tokens,
                                                                  "targets": tokens},
                                        jnp.int32(0)).compile().memory_analysis().temp_size_in_bytes

    whole, accum, micro = temp(16, 1), temp(16, 4), temp(4, 1)
    assert 0.75 * micro <= accum <= 1.25 * micro, (accum, micro, whole)
    assert accum <= 0.5 * whole, (accum, micro, whole)


def test_seed_group_accumulates(tmp_path):
    """A SeedGroup of two seeds with grad_accum=2 equals each seed trained alone with
    grad_accum=1 (float64): the vmapped step splits each seed's own batch."""
    cfg = lambda seed, n: preset(*MHA, *F64, *SMALL, "train.steps=2",  # noqa: E731
                                 "train.eval_every=100", f"train.seed={seed}",
                                 f"train.grad_accum={n}")
    alone = [train.Trainer(cfg(s, 1), tmp_path / f"alone{s}", quiet=True) for s in (0, 1)]
    for tr in alone:
        tr.run(2)
    members = [train.Trainer(cfg(s, 2), tmp_path / f"group{s}", quiet=True) for s in (0, 1)]
    train.SeedGroup(members).run(2)
    for s, (tr, ref) in enumerate(zip(members, alone)):
        chex.assert_trees_all_close(tr.params, ref.params, atol=1e-10, rtol=1e-10)
        losses = [[json.loads(line)["loss"] for line in
                   (d / "metrics.jsonl").read_text().splitlines()]
                  for d in (tmp_path / f"group{s}", tmp_path / f"alone{s}")]
        assert np.all(np.isfinite(losses[0])) and len(losses[0]) == 2
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-10)


def test_resume_with_another_grad_accum_continues_exactly(tmp_path):
    """grad_accum changes how a step runs, not what it computes: a run resumed under
    another value restores without a warning or an exact_resume: false record, and ends
    where an uninterrupted run does."""
    cfg = lambda n: preset(*MHA, *F64, *SMALL, "train.steps=2", "train.ckpt_every=1",  # noqa
                           "train.eval_every=100", f"train.grad_accum={n}")
    straight = train.Trainer(cfg(1), tmp_path / "straight", quiet=True)
    straight.run(2)
    train.Trainer(cfg(1), tmp_path / "resumed", quiet=True).run(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # dsattn's resume warnings are these
        resumed = train.Trainer(cfg(4), tmp_path / "resumed", quiet=True)
        assert resumed.step == 1
        resumed.run(2)
    chex.assert_trees_all_close(resumed.params, straight.params, atol=1e-12, rtol=1e-12)
    records = [json.loads(line) for line in
               (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert not any("exact_resume" in r for r in records)


def test_grad_accum_is_validated():
    assert preset("mha", "train.batch_size=8").train.grad_accum == 1
    with pytest.raises(config.ConfigError, match=r"train.grad_accum: must be >= 1"):
        preset("mha", "train.grad_accum=0")
    with pytest.raises(config.ConfigError,
                       match=r"train.grad_accum: 3 must divide train.batch_size=8"):
        preset("mha", "train.batch_size=8", "train.grad_accum=3")
