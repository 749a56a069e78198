"""A run shorter than its schedule warns at its start, and train.scale_schedule scales it."""

import os
import warnings

from dsattn import config, train
from tests.helpers import ROOT, preset

SMALL_V41 = os.path.join(ROOT, "configs", "small", "v41.yaml")


def test_a_short_run_names_each_schedule_key_it_cannot_reach():
    cfg = config.load(SMALL_V41, ["train.steps=200"])  # the preset: 1000, 500, 1000 of 20000
    assert config.short_schedule(cfg) == [("train.warmup_steps", 1000),
                                          ("indexer.dense_warmup_steps", 500),
                                          ("train.eval_every", 1000)]
    assert config.short_schedule(config.load(SMALL_V41)) == []
    # no indexer, no indexer warm-up to miss
    mha = config.load(os.path.join(ROOT, "configs", "small", "mha.yaml"),
                      ["train.steps=200", "indexer.dense_warmup_steps=500"])
    assert [k for k, _ in config.short_schedule(mha)] == ["train.warmup_steps",
                                                           "train.eval_every"]


def test_scale_schedule_scales_the_keys_left_to_the_preset_by_the_runs_share():
    cfg = config.load(SMALL_V41, ["train.steps=200"], scale_schedule=True)
    # 200 of the preset's 20000 steps: a hundredth of each
    assert (cfg.train.warmup_steps, cfg.indexer.dense_warmup_steps, cfg.train.eval_every) == \
        (10, 5, 10)
    assert config.short_schedule(cfg) == []
    cfg = config.load(SMALL_V41, ["train.steps=200", "train.warmup_steps=50"],
                      scale_schedule=True)
    assert cfg.train.warmup_steps == 50 and cfg.train.eval_every == 10  # the user's kept
    # its saved config reloads as it ran (the run is its own preset then)
    assert config.loads(cfg.to_yaml()) == cfg


def test_a_trainer_warns_once_at_start_naming_the_keys(tmp_path):
    cfg = preset("mha", "model.n_layers=1", "model.d_model=32", "model.ffn_hidden=32",
                 "train.batch_size=2", "train.seq_len=16", "train.steps=5",
                 "train.eval_batches=1", "data.max_bytes=20000")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.Trainer(cfg, tmp_path / "run", quiet=True)
    short = [str(w.message) for w in caught if "train.steps=5" in str(w.message)]
    assert len(short) == 1
    assert "train.warmup_steps=30" in short[0] and "train.eval_every=100" in short[0]
    assert "--scale-schedule" in short[0]


def test_a_scaled_run_resumes_with_more_steps_and_its_warmups_as_trained(tmp_path):
    """--scale-schedule at 200 of the preset's 20000 steps, rerun at 300: the run directory
    records the scaling, and the rerun keeps the warm-ups it trained with (it once refused:
    indexer.dense_warmup_steps 5 -> 8 is a model key)."""
    import json

    import pytest

    from dsattn import rundir
    from dsattn.errors import ConfigError

    run = tmp_path / "run"
    cfg, where, record = rundir.load_config(SMALL_V41, ["train.steps=200"], run,
                                            scale_schedule=True)
    assert where == run and record == {
        "preset_steps": 20000, "steps": 200,
        "scaled": {"train.warmup_steps": [1000, 10], "indexer.dense_warmup_steps": [500, 5],
                   "train.eval_every": [1000, 10]}}
    rd = rundir.RunDir(run, cfg, schedule=record)
    rd.start(0, {})
    rd.release()
    assert json.loads((run / rundir.SCHEDULE_FILE).read_text()) == record
    more, _, again = rundir.load_config(SMALL_V41, ["train.steps=300"], run,
                                        scale_schedule=True)
    assert more.train.steps == 300 and again == record  # the record stays the first scaling
    assert (more.train.warmup_steps, more.indexer.dense_warmup_steps,
            more.train.eval_every) == (10, 5, 10)
    rundir.RunDir(run, more).release()  # no CheckpointMismatch
    # a key set on the command line is the user's (here a validation interval)
    other, _, _ = rundir.load_config(SMALL_V41, ["train.steps=300", "train.eval_every=30"],
                                     run, scale_schedule=True)
    assert other.train.eval_every == 30 and other.indexer.dense_warmup_steps == 5
    # without the flag, the rerun is told what the run was trained with
    with pytest.raises(ConfigError, match=r"--scale-schedule.*dense_warmup_steps 5 -> 500"):
        rundir.load_config(SMALL_V41, ["train.steps=300"], run)
    # the default run directory is runs/<name>
    assert rundir.load_config(SMALL_V41, ["train.steps=200"])[1].as_posix() == "runs/v41"


def test_a_mismatched_resume_names_every_difference(tmp_path):
    """Every model key that differs, in one error (it once named only the first)."""
    import pytest

    from dsattn import checkpoint
    from dsattn.errors import CheckpointMismatch

    checkpoint.save_config(tmp_path, config.load(SMALL_V41, ["train.steps=200"],
                                                 scale_schedule=True))
    other = config.load(SMALL_V41, ["train.steps=300", "model.d_model=512"],
                        scale_schedule=True)
    with pytest.raises(CheckpointMismatch) as e:
        checkpoint.check_compatible(tmp_path, other)
    text = str(e.value)
    assert "model.d_model=768" in text and "model.d_model=512" in text
    assert "indexer.dense_warmup_steps=5" in text and "indexer.dense_warmup_steps=8" in text
    assert "2 keys differ" in text
