"""Training lowers validation loss; a resumed run equals one that never stopped; a NaN
loss stops training with the step named and the last good checkpoint intact."""

import json

import chex
import jax
import numpy as np
import pytest

from dsattn import checkpoint, train
from tests.helpers import preset

SMALL = ("model.n_layers=1", "train.batch_size=4", "train.seq_len=32", "train.eval_batches=2",
         "train.log_every=1")


def test_training_lowers_validation_loss(tmp_path):
    cfg = preset("mha", *SMALL, "model.n_layers=2", "train.batch_size=8", "train.seq_len=64",
                 "train.steps=50", "train.eval_every=25", "train.ckpt_every=50")
    tr = train.Trainer(cfg, tmp_path, quiet=True)
    before = tr.validation_loss()
    out = tr.run()
    assert out["step"] == 50
    assert out["val_loss"] < before - 1.0, (before, out["val_loss"])
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "val_loss" in l] == [25, 50]
    assert all(np.isfinite(l["loss"]) and l["tokens_per_s"] > 0 for l in lines)
    assert checkpoint.manager(tmp_path, 2).latest_step() == 50


# Every family at a shallower depth (each layer kind kept): quick to compile.
SHALLOW = {"mha": ("model.n_layers=2",), "gqa": ("model.n_layers=2",),
           "mla": ("model.n_layers=2",), "dsa": ("model.n_layers=2",),
           "v4": ("model.n_layers=3", "attention.layers=swa, csa, hca"),
           "v41": ("model.n_layers=4", "attention.layers=swa, full, full, reuse",
                   "attention.ratios=0, 2, 1, 1", "attention.ced_split=2")}


@pytest.mark.parametrize("name", list(SHALLOW))
def test_every_family_lowers_the_training_loss(tmp_path, name):
    """The fast tier's training check, every family: 24 short steps lower the cross-entropy
    (the full tier also trains V4 and V4.1 at full depth and longer, indexer loss included:
    tests/test_v4.py, tests/test_v41.py)."""
    cfg = preset(name, *SHALLOW[name], "train.batch_size=4", "train.seq_len=32",
                 "train.steps=24", "train.warmup_steps=2", "train.eval_every=1000",
                 "train.ckpt_every=1000", "train.eval_batches=1", "train.log_every=1")
    train.Trainer(cfg, tmp_path, quiet=True).run()
    ce = [json.loads(l)["ce"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(ce) == 24 and np.all(np.isfinite(ce))
    assert np.mean(ce[-4:]) < np.mean(ce[:4]) - 0.5, ce


def test_resume_equals_never_stopping(tmp_path):
    cfg = preset("mla", *SMALL, "train.steps=3", "train.ckpt_every=2", "train.eval_every=100")
    straight = train.Trainer(cfg, tmp_path / "a", quiet=True)
    straight.run(3)
    first = train.Trainer(cfg, tmp_path / "b", quiet=True)
    first.run(2)
    del first
    resumed = train.Trainer(cfg, tmp_path / "b", quiet=True)
    assert resumed.step == 2
    resumed.run(3)
    chex.assert_trees_all_equal(straight.params, resumed.params)
    last = lambda d: json.loads((d / "metrics.jsonl").read_text().splitlines()[-1])
    assert last(tmp_path / "a")["loss"] == last(tmp_path / "b")["loss"]


def test_nan_loss_stops_with_step_and_keeps_checkpoint(tmp_path):
    cfg = preset("mha", *SMALL, "train.steps=4", "train.ckpt_every=1", "train.eval_every=100")
    tr = train.Trainer(cfg, tmp_path, quiet=True)
    tr.run(2)
    good = jax.tree.map(np.asarray, tr.params)
    tr.params = jax.tree.map(lambda p: p * np.nan, tr.params)  # poison the weights
    with pytest.raises(train.NonFiniteLoss, match=r"at step 3; the last good checkpoint is step 2"):
        tr.run(4)
    model, _, step = checkpoint.load_params(tmp_path)
    assert step == 2
    from flax import nnx
    restored = nnx.to_pure_dict(nnx.state(model))
    chex.assert_trees_all_equal(good, restored)


def test_checkpoint_from_another_config_is_refused(tmp_path):
    cfg = preset("mha", *SMALL, "train.steps=1")
    train.Trainer(cfg, tmp_path, quiet=True).run(1)
    other = preset("mha", *SMALL, "attention.n_kv_heads=2")
    with pytest.raises(checkpoint.CheckpointMismatch, match="attention.n_kv_heads"):
        train.Trainer(other, tmp_path, quiet=True)
    with pytest.raises(checkpoint.CheckpointMismatch, match="attention.n_kv_heads"):
        checkpoint.load_params(tmp_path, other)


def test_seeds_trained_as_one_vmapped_model_equal_runs_trained_alone(tmp_path):
    """A SeedGroup of two seeds equals each seed trained alone (float64), keeps each seed's
    metrics and checkpoints in its own run directory, and a seed resumes alone from them."""
    cfg = lambda seed: preset("mha", *SMALL, "model.dtype=float64", "train.steps=3",
                              "train.ckpt_every=2", "train.eval_every=3", f"train.seed={seed}")
    alone = {}
    for seed in (0, 1):
        tr = train.Trainer(cfg(seed), tmp_path / f"alone{seed}", quiet=True)
        alone[seed] = (tr.run(3), tr)
    group = train.SeedGroup([train.Trainer(cfg(s), tmp_path / f"group{s}", quiet=True)
                             for s in (0, 1)])
    out = group.run(2)
    assert [o["step"] for o in out] == [2, 2]
    resumed = [train.Trainer(cfg(s), tmp_path / f"group{s}", quiet=True) for s in (0, 1)]
    assert [tr.step for tr in resumed] == [2, 2]  # each seed's own checkpoint
    resumed[0].run(3)  # seed 0 alone, seed 1 in a group of one
    out1 = train.SeedGroup(resumed[1:]).run(3)
    for seed, tr in enumerate(resumed):
        summary, ref = alone[seed]
        chex.assert_trees_all_close(tr.params, ref.params, atol=1e-10, rtol=1e-10)
        log = [json.loads(l) for l in (tmp_path / f"group{seed}" / "metrics.jsonl")
               .read_text().splitlines()]
        ref_log = [json.loads(l) for l in (tmp_path / f"alone{seed}" / "metrics.jsonl")
                   .read_text().splitlines()]
        assert [l["step"] for l in log] == [1, 2, 3]
        np.testing.assert_allclose([l["loss"] for l in log], [l["loss"] for l in ref_log],
                                   rtol=1e-10)
    assert out1[0]["val_loss"] == pytest.approx(alone[1][0]["val_loss"], rel=1e-10)
    assert alone[0][0]["val_loss"] != alone[1][0]["val_loss"]  # the seeds differ


def test_seed_group_refuses_runs_that_differ_beyond_the_seed(tmp_path):
    a = train.Trainer(preset("mha", *SMALL, "train.steps=1"), tmp_path / "a", quiet=True)
    b = train.Trainer(preset("mha", *SMALL, "train.steps=1", "train.lr=1e-3", "train.seed=1"),
                      tmp_path / "b", quiet=True)
    with pytest.raises(train.ConfigError, match="differ only in train.seed"):
        train.SeedGroup([a, b])


def test_a_nan_in_one_seed_stops_the_group_naming_that_seed(tmp_path):
    trainers = [train.Trainer(preset("mha", *SMALL, "train.steps=2", "train.ckpt_every=1",
                                     f"train.seed={s}"), tmp_path / f"s{s}", quiet=True)
                for s in (0, 1)]
    group = train.SeedGroup(trainers)
    group.run(1)
    group.params = jax.tree.map(lambda p: p.at[1].multiply(np.nan), group.params)
    with pytest.raises(train.NonFiniteLoss,
                       match=r"s1: training loss became nan at step 2; the last good "
                             r"checkpoint is step 1"):
        group.run(2)
    assert [checkpoint.load_params(tmp_path / f"s{s}")[2] for s in (0, 1)] == [1, 1]
