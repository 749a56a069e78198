"""A run shorter than its schedule warns at its start, and --scale-schedule scales it (and
says what else a short run may want)."""

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
                   "train.eval_every": [1000, 10], "train.ckpt_every": [1000, 10],
                   "train.log_every": [10, 1]}}
    rd = rundir.RunDir(run, cfg, schedule=record)
    rd.start(0, {})
    rd.release()
    assert json.loads((run / rundir.SCHEDULE_FILE).read_text()) == record
    more, _, again = rundir.load_config(SMALL_V41, ["train.steps=300"], run,
                                        scale_schedule=True)
    assert more.train.steps == 300 and again == record  # the record stays the first scaling
    assert (more.train.warmup_steps, more.indexer.dense_warmup_steps,
            more.train.eval_every, more.train.ckpt_every) == (10, 5, 10, 10)
    rundir.RunDir(run, more).release()  # no CheckpointMismatch
    # a key set on the command line is the user's (here a validation interval)
    other, _, _ = rundir.load_config(SMALL_V41, ["train.steps=300", "train.eval_every=30"],
                                     run, scale_schedule=True)
    assert other.train.eval_every == 30 and other.indexer.dense_warmup_steps == 5
    # without the flag, the rerun is told what the run was trained with
    with pytest.raises(ConfigError, match=r"--scale-schedule.*dense_warmup_steps 5 -> 500") as e:
        rundir.load_config(SMALL_V41, ["train.steps=300"], run)
    assert "ckpt_every" not in str(e.value)  # a resume takes another cadence
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


SMALL_V4 = os.path.join(ROOT, "configs", "small", "v4.yaml")


def test_scale_schedule_fits_the_checkpoint_and_log_cadence_and_never_past_the_end():
    cfg = config.load(SMALL_V41, ["train.steps=200"], scale_schedule=True)
    assert (cfg.train.ckpt_every, cfg.train.log_every) == (10, 1)  # 1000 and 10 of 20000
    # a cadence longer than the preset's own run never outlasts this one
    raw = {"train": {"steps": 1000, "ckpt_every": 5000, "log_every": 10}}
    cfg = config.from_dict(raw, ["train.steps=100"], scale_schedule=True)
    assert (cfg.train.ckpt_every, cfg.train.log_every) == (100, 1)
    # the command line's are kept, as the warm-ups are
    cfg = config.load(SMALL_V41, ["train.steps=200", "train.ckpt_every=50"], scale_schedule=True)
    assert cfg.train.ckpt_every == 50 and cfg.train.log_every == 1


def test_a_rerun_without_the_flag_is_not_refused_for_a_scaled_cadence(tmp_path):
    """The cadences are recorded with the scaling, but a resume takes new recording values:
    only the warm-ups and the validation interval refuse a rerun without the flag."""
    from dsattn import rundir

    run = tmp_path / "run"
    told = ["train.warmup_steps=1000", "indexer.dense_warmup_steps=500", "train.eval_every=1000"]
    cfg, _, record = rundir.load_config(SMALL_V41, ["train.steps=200", *told], run,
                                        scale_schedule=True)
    assert record["scaled"] == {"train.ckpt_every": [1000, 10], "train.log_every": [10, 1]}
    rd = rundir.RunDir(run, cfg, schedule=record)
    rd.start(0, {})
    rd.release()
    again, _, _ = rundir.load_config(SMALL_V41, ["train.steps=300", *told], run)
    assert (again.train.ckpt_every, again.train.log_every) == (1000, 10)  # the preset's
    rundir.RunDir(run, again).release()  # no CheckpointMismatch


def test_a_short_run_is_told_what_the_scaling_leaves_at_the_presets_scale():
    """Not step counts, so not scaled: the rate, the indexer's top-k and the window, each
    named with its value, a value to try and why."""
    cfg = config.load(SMALL_V4, ["train.steps=200", "train.seq_len=128"], scale_schedule=True)
    assert (cfg.train.lr, cfg.attention.top_k, cfg.attention.window) == (6e-4, 512, 128)
    advice = config.short_run_advice(cfg, 20000)
    assert [line.split("=")[0] for line in advice] == ["train.lr", "attention.top_k",
                                                        "attention.window"]
    lr, top_k, window = advice
    assert lr.startswith("train.lr=0.0006: ") and "20,000 steps" in lr
    assert lr.endswith("try train.lr=0.003")
    # csa at ratio 4 chooses from 128 / 4 = 32 entries: 512 reads them all
    assert top_k.startswith("attention.top_k=512: ") and "32 entries" in top_k
    assert "dense" in top_k and top_k.endswith("try attention.top_k=8")
    assert window.startswith("attention.window=128: ") and window.endswith(
        "try attention.window=16")
    # what the command line sets is the user's; a run as long as the preset's gets none
    told = ["train.lr=6e-4", "attention.top_k=512", "attention.window=128"]
    assert config.short_run_advice(cfg, 20000, config.overridden_keys(told)) == []
    assert config.short_run_advice(config.load(SMALL_V4), 20000) == []
    # nothing applies at the preset's own 8192 tokens but the rate; mha has no indexer
    assert [line.split("=")[0] for line in config.short_run_advice(
        config.load(SMALL_V4, ["train.steps=200"]), 20000)] == ["train.lr"]
    mha = config.load(os.path.join(ROOT, "configs", "small", "mha.yaml"),
                      ["train.steps=200", "train.seq_len=128"])
    assert [line.split("=")[0] for line in config.short_run_advice(mha, 20000)] == ["train.lr"]


def test_the_short_run_values_are_the_tiny_presets():
    """What the advice suggests is what configs/tiny trains with: its rate, a top-k of a
    quarter of the entries (dsa, v4) and a window of an eighth of train.seq_len."""
    for name in ("dsa", "v4", "mha"):
        cfg = preset(name, "train.steps=100")
        assert cfg.train.lr == config.SHORT_RUN_LR
        assert config.short_run_advice(cfg, 600) == []
    v4 = preset("v4")
    assert v4.attention.top_k == v4.train.seq_len // 4 // 4  # csa: ratio 4
    assert v4.attention.window == v4.train.seq_len // 8
    assert preset("dsa").attention.top_k == preset("dsa").train.seq_len // 4


def test_train_py_prints_the_advice_before_it_compiles(tmp_path, capsys, monkeypatch):
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("train_script",
                                                  os.path.join(ROOT, "scripts", "train.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(train, "estimate", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("compiled")))
    with pytest.raises(RuntimeError, match="compiled"):
        script.main([SMALL_V4, "train.steps=200", "train.seq_len=128", "--scale-schedule",
                     "--estimate", "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert out.startswith("for a short run consider:\n  train.lr=0.0006: ")
    assert out.count("\n  ") == 3
    with pytest.raises(RuntimeError, match="compiled"):  # without the flag: nothing
        script.main([SMALL_V4, "train.steps=200", "train.seq_len=128", "--estimate",
                     "--run-dir", str(tmp_path / "run")])
    assert "consider" not in capsys.readouterr().out
