"""Checkpoints that cannot lie: each committed checkpoint gets a manifest (every file's size
and sha256), and every restore checks it first. A damaged step is named (step, file, what is
wrong) and the newest step that verifies is used instead, or refused under strict; nothing
damaged is restored. Runs saved before manifests load with one warning.

One tiny run (checkpoints at steps 3 and 6) is trained once; each test damages a copy."""

import hashlib
import json
import os
import shutil
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dsattn import checkpoint, errors, runlog, train
from tests.helpers import ROOT, preset

TINY = ("model.n_layers=1", "model.d_model=32", "model.ffn_hidden=64", "attention.n_heads=2",
        "attention.n_kv_heads=2", "attention.head_dim=16", "train.seq_len=32",
        "train.batch_size=2", "train.eval_every=1000", "train.eval_batches=1",
        "train.warmup_steps=2", "train.ckpt_every=3", "train.log_every=1")
MANIFEST = "dsattn-manifest.json"  # the name is part of the on-disk format


def cfg(*overrides, steps=6):
    return preset("mha", *TINY, f"train.steps={steps}", *overrides)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Finished 6-step runs of seeds 0 and 1, checkpoints at 3 and 6 (never modified)."""
    root = tmp_path_factory.mktemp("integrity")
    for seed in (0, 1):
        train.Trainer(cfg(f"train.seed={seed}"), root / f"seed{seed}", quiet=True).run()
    return root


@pytest.fixture
def run_dir(pristine, tmp_path):
    shutil.copytree(pristine / "seed0", tmp_path / "run")
    return tmp_path / "run"


def step_dir(run, step):
    return run / "checkpoints" / str(step)


def largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip(path, n=64):
    """Invert n bytes in the middle of the file: same size, other content."""
    b = bytearray(path.read_bytes())
    mid = len(b) // 2
    b[mid:mid + n] = bytes(x ^ 0xFF for x in b[mid:mid + n])
    path.write_bytes(bytes(b))


def saved_tree(run, step, item):
    """An item of a checkpoint as orbax alone reads it (no dsattn code): {path: array}."""
    tree = ocp.StandardCheckpointer().restore((step_dir(run, step) / item).absolute())
    return {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def as_flat(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def damage(run, kind):
    """Damage step 6 of `run` in one way; returns the file's path relative to the step."""
    d = step_dir(run, 6)
    if kind == "params_flipped":
        f = largest_file(d / "params")
        flip(f)
    elif kind == "opt_state_flipped":
        f = largest_file(d / "opt_state")
        flip(f)
    elif kind == "truncated":
        f = largest_file(d / "params")
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif kind == "deleted":
        f = largest_file(d / "params")
        f.unlink()
    elif kind == "manifest_deleted":
        f = d / MANIFEST
        f.unlink()
    elif kind == "manifest_garbled":
        f = d / MANIFEST
        text = f.read_text()
        i = text.index('"size": ') + len('"size": ')  # a recorded size, still valid JSON
        f.write_text(text[:i] + "9" + text[i:])
    else:
        raise ValueError(kind)
    return f.relative_to(d).as_posix()


KINDS = ["params_flipped", "opt_state_flipped", "truncated", "deleted", "manifest_deleted",
         "manifest_garbled"]
# What the one line says is wrong, by kind.
PROBLEM = {"params_flipped": "content differs", "opt_state_flipped": "content differs",
           "truncated": "truncated", "deleted": "missing", "manifest_deleted": "no manifest",
           "manifest_garbled": "manifest"}


# ----------------------------------------------------------------- the record
def test_each_checkpoint_has_a_manifest_of_every_file_with_size_and_sha256(pristine):
    run = pristine / "seed0"
    assert checkpoint.manager(run, 2).all_steps() == [3, 6]
    for step in (3, 6):
        d = step_dir(run, step)
        manifest = json.loads((d / MANIFEST).read_text())
        files = {p.relative_to(d).as_posix(): p for p in d.rglob("*")
                 if p.is_file() and p.name != MANIFEST}
        assert set(manifest["files"]) == set(files)  # every file, nothing else
        for name, path in files.items():
            assert manifest["files"][name] == {
                "size": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}, name
        assert not [p for p in d.iterdir() if p.name.startswith(MANIFEST + ".")]  # no temp left


# ----------------------------------------------------------------- damage, each kind
@pytest.mark.parametrize("kind", KINDS)
def test_resume_falls_back_past_damage_naming_step_file_and_problem(run_dir, pristine, kind):
    name = damage(run_dir, kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = train.Trainer(cfg(), run_dir, quiet=True)
    assert tr.step == 3
    assert_same(as_flat(tr.params), saved_tree(pristine / "seed0", 3, "params"))
    assert_same(as_flat(tr.opt_state), saved_tree(pristine / "seed0", 3, "opt_state"))
    skip = [str(w.message) for w in caught if "skipping checkpoint step 6" in str(w.message)]
    assert len(skip) == 1 and "\n" not in skip[0], [str(w.message) for w in caught]
    assert name in skip[0] and PROBLEM[kind] in skip[0] and "using step 3" in skip[0], skip
    # set aside, not deleted; the rerun saves step 6 afresh
    assert len(list((run_dir / "checkpoints").glob("6.corrupt-*"))) == 1
    assert [r["step"] for r in runlog.records(run_dir)][-1] == 3


@pytest.mark.parametrize("kind", ["params_flipped", "truncated", "deleted", "manifest_deleted",
                                  "manifest_garbled"])
def test_load_params_falls_back_past_damaged_params(run_dir, pristine, kind):
    name = damage(run_dir, kind)
    with pytest.warns(UserWarning, match=r"skipping checkpoint step 6: .*using step 3") as rec:
        model, _, step = checkpoint.load_params(run_dir)
    assert step == 3 and any(name in str(w.message) for w in rec)
    from flax import nnx
    assert_same(as_flat(nnx.to_pure_dict(nnx.state(model))),
                saved_tree(pristine / "seed0", 3, "params"))


def test_load_params_uses_a_step_whose_damage_is_only_in_the_optimizer_state(run_dir, pristine):
    damage(run_dir, "opt_state_flipped")  # generation reads no optimizer state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _, step = checkpoint.load_params(run_dir)
    from flax import nnx
    assert step == 6
    assert_same(as_flat(nnx.to_pure_dict(nnx.state(model))),
                saved_tree(pristine / "seed0", 6, "params"))


def test_a_damaged_step_asked_for_is_refused_not_replaced(run_dir):
    name = damage(run_dir, "params_flipped")
    with pytest.raises(errors.CheckpointCorrupt,
                       match=rf"checkpoint step 6 does not load \({name}: content differs"):
        checkpoint.load_params(run_dir, step=6)


# ----------------------------------------------------------------- strict
def test_strict_refuses_to_fall_back_and_touches_nothing(run_dir):
    name = damage(run_dir, "params_flipped")
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(errors.CheckpointCorrupt) as e:
        train.Trainer(cfg(), run_dir, quiet=True, strict=True)
    line = str(e.value)
    assert "\n" not in line and "step 6" in line and name in line and "step 3" in line, line
    assert "strict" in line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    with pytest.raises(errors.CheckpointCorrupt, match=r"step 6 does not verify .*strict"):
        checkpoint.load_params(run_dir, strict=True)


def test_no_checkpoint_that_verifies_is_an_error_naming_each_step(run_dir):
    damage(run_dir, "params_flipped")
    flip(largest_file(step_dir(run_dir, 3) / "opt_state"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(errors.CheckpointCorrupt,
                           match=r"step 6: params/\S+: content differs.*; step 3: opt_state/"):
            train.Trainer(cfg(), run_dir, quiet=True)


# ----------------------------------------------------------------- NaN message
def test_nan_message_names_the_last_checkpoint_that_verifies(run_dir):
    tr = train.Trainer(cfg(steps=9), run_dir, quiet=True)
    tr.run()  # saves step 9
    flip(largest_file(step_dir(run_dir, 9) / "params"))  # damaged on disk after its save
    tr.params = jax.tree.map(lambda p: p * np.nan, tr.params)
    with pytest.raises(errors.NonFiniteLoss,
                       match=r"loss became nan at step 10; the last good checkpoint is step 6 in "
                             r"\S+ \(step 9 does not verify: params/\S+: content differs"):
        tr.run(12)


# ----------------------------------------------------------------- earlier versions
def test_a_run_saved_before_manifests_loads_with_one_warning(tmp_path):
    run = tmp_path / "legacy"
    shutil.copytree(os.path.join(ROOT, "tests", "data", "legacy_run"), run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, step = checkpoint.load_params(run)
    assert step == 2
    assert [str(w.message) for w in caught if w.category is UserWarning] == [
        f"{run / 'checkpoints'}: checkpoint step 2 has no manifest (saved by an earlier "
        f"dsattn), so its content is not verified"]


# ----------------------------------------------------------------- vmapped seeds
def test_seed_group_with_one_seed_damaged_does_not_restore_the_damage(pristine, tmp_path):
    """Each seed restores alone (its own Trainer): the damaged seed falls back to step 3,
    the intact one stays at 6, and the group refuses to form, so each trains alone (as
    dsattn.ablate.train_row does) and nothing damaged is in either."""
    for seed in (0, 1):
        shutil.copytree(pristine / f"seed{seed}", tmp_path / f"seed{seed}")
    damage(tmp_path / "seed1", "params_flipped")
    with pytest.warns(UserWarning, match="skipping checkpoint step 6"):
        trainers = [train.Trainer(cfg(f"train.seed={s}", steps=9), tmp_path / f"seed{s}",
                                  quiet=True) for s in (0, 1)]
    assert [tr.step for tr in trainers] == [6, 3]
    assert_same(as_flat(trainers[0].params), saved_tree(pristine / "seed0", 6, "params"))
    assert_same(as_flat(trainers[1].params), saved_tree(pristine / "seed1", 3, "params"))
    with pytest.raises(errors.ConfigError, match="start at one step"):
        train.SeedGroup(trainers)


# ----------------------------------------------------------------- a manifest not written
def test_a_manifest_that_cannot_be_written_ends_training_naming_the_step_before(run_dir,
                                                                                monkeypatch):
    from dsattn import manifest

    def full(fd):
        raise OSError(28, "No space left on device")

    tr = train.Trainer(cfg(steps=9), run_dir, quiet=True)
    monkeypatch.setattr(manifest.os, "fsync", full)
    with pytest.raises(errors.CheckpointWriteError,
                       match=r"step 9 .*No space left on device.*last complete checkpoint is "
                             r"step 6"):
        tr.run()
    monkeypatch.undo()
    assert not [p for p in step_dir(run_dir, 9).iterdir() if p.name.startswith(MANIFEST)]
    with pytest.warns(UserWarning, match=r"skipping checkpoint step 9: .*no manifest.*using "
                                         r"step 6"):
        assert train.Trainer(cfg(steps=9), run_dir, quiet=True).step == 6
