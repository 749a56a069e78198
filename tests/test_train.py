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
