"""Each config key declares its Kind once (config.py); the resume checks, the full-size mapping
and a sweep run's fingerprint read it. The expected sets below are the tables the checks kept
before (checkpoint.MODEL_SECTIONS / LAYOUT_KEYS / EXECUTION_KEYS, train.SCHEDULE_KEYS /
DATA_ORDER_KEYS, ablate.full_size.FULL_SIZE_SECTIONS), written out by hand."""

import dataclasses
import hashlib
import json

import pytest
import yaml

from dsattn import ablate, checkpoint
from dsattn import config as config_lib
from dsattn.config import Kind, keys_of
from dsattn.errors import ConfigError
from tests.test_ablate import MHA, TOY

OLD_MODEL_SECTIONS = ("model", "attention", "indexer", "cache")
OLD_LAYOUT = {("model", "scan_layers")}
OLD_EXECUTION = {("attention", "query_block"), ("attention", "entry_block"),
                 ("indexer", "key_block"), ("model", "remat"), ("model", "remat_block_from"),
                 ("train", "grad_accum")}
# Keys added since, with their kind: which implementation runs the attention reads.
ADDED_EXECUTION = {("attention", "impl")}
# A train key the optimizer state's shape depends on: a run restores only under its value.
ADDED_MODEL = {("train", "freeze")}
OLD_SCHEDULE = {("train", "steps"), ("train", "warmup_steps"), ("train", "lr"),
                ("train", "min_lr_ratio")}
OLD_DATA_ORDER = {("train", "batch_size"), ("train", "seq_len"), ("train", "seed"),
                  ("data", "source"), ("data", "val_fraction"), ("data", "max_bytes")}
OLD_FULL_SIZE_SECTIONS = ("attention", "indexer", "cache")
# Keys no table named: the mesh (how the step is placed: execution), the optimizer's other
# settings and what a run records.
MESH = {("mesh", "data"), ("mesh", "fsdp"), ("mesh", "tensor")}
OPTIMIZER = {("train", "weight_decay"), ("train", "b1"), ("train", "b2"),
             ("train", "grad_clip")}
RECORDING = {("train", "eval_every"), ("train", "eval_batches"), ("train", "ckpt_every"),
             ("train", "keep_checkpoints"), ("train", "log_every"), ("train", "peak_tflops")}


def every_key() -> set:
    return {(sec.name, f.name) for sec in dataclasses.fields(config_lib.Config)
            if sec.name != "name" for f in dataclasses.fields(sec.default_factory)}


def test_every_key_of_every_section_declares_a_kind():
    sections = [f for f in dataclasses.fields(config_lib.Config) if f.name != "name"]
    assert [f.name for f in sections] == ["model", "attention", "indexer", "cache", "train",
                                          "data", "mesh"]
    lacking = [f"{sec.name}.{f.name}" for sec in sections
               for f in dataclasses.fields(sec.default_factory)
               if not isinstance(f.metadata.get("kind"), Kind)]
    assert not lacking
    assert set(keys_of(*Kind)) == every_key()
    assert len(keys_of(*Kind)) == len(every_key())  # each key once


def test_kinds_are_the_old_tables():
    old_model_keys = {k for k in every_key() if k[0] in OLD_MODEL_SECTIONS}
    assert set(keys_of(Kind.MODEL)) == (old_model_keys - OLD_LAYOUT - OLD_EXECUTION
                                        - ADDED_EXECUTION) | ADDED_MODEL
    assert config_lib.sections_of(Kind.MODEL) == OLD_MODEL_SECTIONS + ("train",)
    assert set(keys_of(Kind.LAYOUT)) == OLD_LAYOUT
    assert set(keys_of(Kind.EXECUTION)) == OLD_EXECUTION | ADDED_EXECUTION | MESH
    assert set(keys_of(Kind.SCHEDULE)) == OLD_SCHEDULE
    assert keys_of(Kind.DATA_ORDER) == (  # in this order in the resume's warning and record
        ("train", "batch_size"), ("train", "seq_len"), ("train", "seed"), ("data", "source"),
        ("data", "val_fraction"), ("data", "max_bytes"))
    assert set(keys_of(Kind.DATA_ORDER)) == OLD_DATA_ORDER
    assert set(keys_of(Kind.OPTIMIZER)) == OPTIMIZER
    assert set(keys_of(Kind.RECORDING)) == RECORDING
    assert config_lib.full_size_sections() == OLD_FULL_SIZE_SECTIONS
    assert config_lib.kind_of("model", "remat") is Kind.EXECUTION
    assert config_lib.kind_of("model", "gone") is None


def test_resume_checks_follow_the_kinds(tmp_path):
    cfg = config_lib.load(MHA, ["model.n_layers=1"])
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    for sec, key in keys_of(Kind.LAYOUT, Kind.EXECUTION, Kind.SCHEDULE, Kind.DATA_ORDER):
        if sec in OLD_MODEL_SECTIONS:  # the others are in no section it compares
            value = getattr(getattr(cfg, sec), key)
            other = not value if isinstance(value, bool) else (
                {"remat": "block", "impl": "auto"}.get(key) or value * 2)
            checkpoint.check_compatible(tmp_path, config_lib.load(
                MHA, ["model.n_layers=1", f"{sec}.{key}={other}"]))
    with pytest.raises(checkpoint.CheckpointMismatch, match="attention.n_heads"):
        checkpoint.check_compatible(tmp_path, config_lib.load(
            MHA, ["model.n_layers=1", "attention.n_heads=8"]))
    saved = yaml.safe_load(cfg.to_yaml())
    saved["model"]["removed_key"] = 3  # a key of a model section since removed: compared
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(checkpoint.CheckpointMismatch, match="model.removed_key=3"):
        checkpoint.check_compatible(tmp_path, cfg)


def _sweep(tmp_path, *overrides):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "toy", "base": MHA, "overrides": [*TOY, *overrides], "seeds": [0],
        "rows": [{"name": "mha", "overrides": []}],
        "recall": {"distances": [8], "per_distance": 1}}))
    sweep = ablate.load(path, out=tmp_path / "out")
    return sweep, sweep.rows[0]


EXECUTION_OVERRIDES = ["attention.query_block=16", "attention.entry_block=32",
                       "indexer.key_block=64", "model.remat=block",
                       "model.remat_block_from=64", "train.grad_accum=2",
                       "attention.impl=auto"]


def test_execution_keys_leave_a_sweep_runs_fingerprint_and_model_keys_change_it(tmp_path):
    sweep, row = _sweep(tmp_path)
    base = ablate.fingerprint(sweep, row, 0)
    for ov in EXECUTION_OVERRIDES:
        assert ablate.fingerprint(*_sweep(tmp_path, ov), 0) == base, ov
    assert ablate.fingerprint(*_sweep(tmp_path, *EXECUTION_OVERRIDES), 0) == base
    for ov in ("attention.n_heads=8", "model.scan_layers=false", "train.steps=5",
               "data.val_fraction=0.1", "train.b2=0.9", "train.eval_batches=2"):
        assert ablate.fingerprint(*_sweep(tmp_path, ov), 0) != base, ov


def _finish(sweep, row, fingerprint: str, trained_cfg) -> None:
    """A finished run as a sweep leaves it: result.json and the run's config.yaml."""
    run = sweep.out / "runs" / row.name / "seed0"
    run.mkdir(parents=True, exist_ok=True)
    (run / "result.json").write_text(json.dumps({"row": row.name, "seed": 0,
                                                 "fingerprint": fingerprint}))
    (run / "config.yaml").write_text(trained_cfg.to_yaml())


def test_a_finished_run_is_kept_under_other_execution_keys(tmp_path):
    sweep, row = _sweep(tmp_path)
    _finish(sweep, row, ablate.fingerprint(sweep, row, 0), sweep.config(row, 0))
    ablate._check_finished(_sweep(tmp_path, *EXECUTION_OVERRIDES)[0])
    with pytest.raises(ConfigError, match=r"row 'mha' seed 0: .* finished with other"):
        ablate._check_finished(_sweep(tmp_path, "attention.n_heads=8")[0])


def test_a_run_finished_before_execution_keys_were_left_out_is_kept(tmp_path):
    """A result.json written by the previous fingerprint (the whole config) is still
    recognised, under the execution values it trained with and under others."""
    sweep, row = _sweep(tmp_path, "model.remat=none")
    cfg = sweep.config(row, 0)
    what = {"config": cfg.to_dict(), "distances": sweep.distances,
            "per_distance": sweep.per_distance, "probe_len": sweep.probe_len,
            "decode_context": sweep.decode_context, "lengths": sweep.lengths,
            "full_size": None}
    old = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    _finish(sweep, row, old, cfg)
    ablate._check_finished(sweep)
    ablate._check_finished(_sweep(tmp_path, "model.remat=block", "attention.query_block=16")[0])
    for ov in ("attention.n_heads=8", "train.steps=5"):
        with pytest.raises(ConfigError, match=r"row 'mha' seed 0: .* finished with other"):
            ablate._check_finished(_sweep(tmp_path, ov)[0])
