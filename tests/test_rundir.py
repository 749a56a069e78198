"""Run directories lose nothing that was saved: SIGINT/SIGTERM save the step reached, a damaged
latest checkpoint falls back to the one before, a second writer is refused (a dead one's lock
is taken over), metrics.jsonl holds each step once after a resume (with its learning rate,
time and compile-free throughput), and a changed schedule is reported. Signals and kills go to
real `scripts/train.py` processes."""

import errno
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from dsattn import checkpoint, cli, errors, migrations, scan, train
from dsattn.model import Transformer
from tests.helpers import ROOT, forward, preset

TINY = ("model.n_layers=1", "model.d_model=32", "train.seq_len=32", "train.batch_size=2",
        "train.log_every=1", "train.eval_every=1000", "train.eval_batches=1")
BASE = ("train.steps=6", "train.ckpt_every=3", "train.warmup_steps=2")  # the shared run
LONG = ("train.steps=100000", "train.ckpt_every=3")  # runs until stopped


def cfg(*overrides):
    return preset("gqa", *TINY, *overrides)


def start(run_dir, *overrides):
    """scripts/train.py on the tiny config, in its own process."""
    return subprocess.Popen(
        [sys.executable, "scripts/train.py", "configs/tiny/gqa.yaml", *TINY, *overrides,
         "--run-dir", str(run_dir), "--quiet"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})


def records(run_dir) -> list[dict]:
    """metrics.jsonl's complete records, in file order."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # last: partial or ''
    return [json.loads(line) for line in lines]


def logged(run_dir) -> list[int]:
    return [r["step"] for r in records(run_dir)]


def wait_for_step(run_dir, step, proc, timeout=240):
    t0 = time.monotonic()
    while not (logged(run_dir) and logged(run_dir)[-1] >= step):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < timeout, "training made no progress"
        time.sleep(0.05)


def saved_steps(run_dir) -> list[int]:
    return checkpoint.manager(run_dir, 2).all_steps()


def largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def params_of(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 6-step run: checkpoints at 3 and 6, metrics for steps 1-6."""
    run_dir = tmp_path_factory.mktemp("trained")
    train.Trainer(cfg(*BASE), run_dir, quiet=True).run()
    return run_dir


@pytest.fixture
def run_dir(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


# ----------------------------------------------------------------- signals, lock, kill -9
def test_sigint_saves_the_step_reached_and_a_rerun_resumes_there(tmp_path):
    p = start(tmp_path, "train.steps=100000", "train.ckpt_every=100000")  # no periodic saves
    wait_for_step(tmp_path, 4, p)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    reached = logged(tmp_path)[-1]
    assert p.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert f"checkpoint at step {reached}" in err, err
    assert saved_steps(tmp_path) == [reached]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = train.Trainer(cfg("train.steps=100000", "train.ckpt_every=100000"), tmp_path,
                           quiet=True)
    assert tr.step == reached and logged(tmp_path) == list(range(1, reached + 1))
    assert not [w for w in caught if "lock" in str(w.message)]  # released on the way out


def test_second_writer_refused_dead_writers_lock_taken_over_metrics_cut_to_checkpoint(tmp_path):
    p = start(tmp_path, *LONG)
    wait_for_step(tmp_path, 7, p)
    with pytest.raises(errors.RunDirLocked, match=f"pid {p.pid}"):
        train.Trainer(cfg(*LONG), tmp_path, quiet=True)
    assert p.poll() is None  # the writer runs on
    p.kill()
    p.wait()
    before = logged(tmp_path)
    assert before == list(range(1, before[-1] + 1))  # untouched by the refused Trainer
    with pytest.warns(UserWarning, match=f"pid {p.pid}, which is no longer running"):
        tr = train.Trainer(cfg(*LONG), tmp_path, quiet=True)
    assert tr.step == saved_steps(tmp_path)[-1] and tr.step % 3 == 0
    assert logged(tmp_path) == list(range(1, tr.step + 1))  # the steps the kill lost are cut
    assert not list((tmp_path / "checkpoints").glob("*tmp*"))  # nor half-written saves


# ----------------------------------------------------------------- damaged checkpoints
def test_damaged_latest_checkpoint_falls_back_to_the_one_before(run_dir):
    at_3 = params_of(checkpoint.load_params(run_dir, step=3)[0])
    data_file = largest_file(run_dir / "checkpoints" / "6" / "params")
    data_file.write_bytes(data_file.read_bytes()[:1000])  # truncated

    with pytest.warns(UserWarning, match=r"skipping checkpoint step 6: it does not load \(\w+"):
        model, _, step = checkpoint.load_params(run_dir)  # what scripts/generate.py calls
    assert step == 3
    for x, y in zip(at_3, params_of(model)):
        np.testing.assert_array_equal(x, y)

    with pytest.warns(UserWarning, match=r"moved the damaged step 6 to 6\.corrupt-"):
        tr = train.Trainer(cfg(*BASE), run_dir, quiet=True)
    assert tr.step == 3 and logged(run_dir) == [1, 2, 3]
    assert len(list((run_dir / "checkpoints").glob("6.corrupt-*/params"))) == 1  # kept
    tr.run()  # saves step 6 afresh and logs steps 4-6 once
    assert saved_steps(run_dir) == [3, 6] and logged(run_dir) == [1, 2, 3, 4, 5, 6]
    assert checkpoint.load_params(run_dir)[2] == 6


def test_no_checkpoint_that_loads_is_an_error_naming_each_step(run_dir):
    (run_dir / "checkpoints" / "3" / "params" / "_METADATA").unlink()
    f = largest_file(run_dir / "checkpoints" / "6" / "opt_state")
    f.write_bytes(f.read_bytes()[:100])
    with pytest.warns(UserWarning), \
            pytest.raises(errors.CheckpointCorrupt, match=r"step 6: \w+.*; step 3: \w+"):
        train.Trainer(cfg(*BASE), run_dir, quiet=True)
    assert saved_steps(run_dir) == [3, 6] and logged(run_dir) == list(range(1, 7))  # untouched
    assert checkpoint.load_params(run_dir)[2] == 6  # generation needs only step 6's params
    with pytest.raises(FileNotFoundError, match="no checkpoint at step 5; saved steps: 3, 6"):
        checkpoint.load_params(run_dir, step=5)  # absent, not damaged


def test_checkpoint_tree_that_does_not_fit_the_config_names_path_and_shapes(run_dir):
    (run_dir / "config.yaml").unlink()  # e.g. checkpoints copied without their config
    # gqa: 2 K/V heads of 32 -> wk is [d_model, 64]; with 4 K/V heads it is [32, 128]
    with pytest.raises(errors.CheckpointMismatch,
                       match=r"params\.blocks\.0\.attn\.wk\.kernel has shape \(32, 64\) in the "
                             r"checkpoint and \(32, 128\) in the model"):
        train.Trainer(cfg(*BASE, "attention.n_kv_heads=4"), run_dir, quiet=True)
    with pytest.raises(errors.CheckpointMismatch, match=r"params\.blocks\.0\.attn\.\w+"):
        checkpoint.load_params(run_dir, cfg(*BASE, "attention.layers=mla"))
    assert saved_steps(run_dir) == [3, 6]  # a mismatch is not damage: nothing set aside
    assert train.Trainer(cfg(*BASE), run_dir, quiet=True).step == 6  # and the lock is free


# ----------------------------------------------------------------- schedule and records
def test_extending_a_run_warns_that_the_schedule_is_reshaped(run_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train.Trainer(cfg(*BASE), run_dir, quiet=True)
    assert not [w for w in caught if "schedule" in str(w.message)]
    # lr 3e-3, min ratio 0.1: step 6 ends the old cosine at 3e-4; over 12 steps with 2 of
    # warm-up, step 6 is 0.4 of the way: 3e-4 + 2.7e-3 * (1 + cos(0.4 pi)) / 2 = 2.07e-3
    with pytest.warns(UserWarning, match=r"resuming at step 6 with train\.steps 6 -> 12: .*"
                                         r"schedule.* from 0\.0003 to 0\.00207"):
        train.Trainer(cfg(*BASE[1:], "train.steps=12"), run_dir, quiet=True)


def test_resume_with_another_data_order_warns_and_is_recorded_strict_refuses(run_dir, tmp_path,
                                                                             capsys):
    (tmp_path / "notes.txt").write_text("some other text to train on. " * 400)
    other = (*BASE, "train.seed=1", "train.batch_size=3", f"data.source={tmp_path}/notes.txt")
    before = (run_dir / "config.yaml").read_text(), records(run_dir)
    with pytest.raises(errors.ConfigError, match=r"--strict.* train\.batch_size 2 -> 3, "
                                                 r"train\.seed 0 -> 1, data\.source stdlib -> "):
        train.Trainer(cfg(*other), run_dir, quiet=True, strict=True)
    assert ((run_dir / "config.yaml").read_text(), records(run_dir)) == before  # untouched
    from scripts import train as train_script

    with pytest.raises(SystemExit) as e:  # the script's --strict: one line
        cli.run(train_script.main, ["configs/tiny/gqa.yaml", *TINY, *other, "--strict",
                                    "--run-dir", str(run_dir), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "train.seed 0 -> 1" in err[0], err

    with pytest.warns(UserWarning, match=r"resuming at step 6 with train\.batch_size 2 -> 3, "
                                         r"train\.seed 0 -> 1, data\.source stdlib -> .*notes"
                                         r"\.txt: .*not the batches"):
        train.Trainer(cfg(*other), run_dir, quiet=True)
    mark = records(run_dir)[-1]  # what the run records, since config.yaml now has the new ones
    assert mark["step"] == 6 and mark["exact_resume"] is False
    assert mark["changed"] == {"train.batch_size": [2, 3], "train.seed": [0, 1],
                               "data.source": ["stdlib", f"{tmp_path}/notes.txt"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same keys again: nothing new to say
        train.Trainer(cfg(*other), run_dir, quiet=True, strict=True)
    assert records(run_dir)[-1] == mark


def test_records_carry_lr_and_time_and_throughput_without_compile(trained):
    rows = records(trained)
    lr, warmup, steps, floor = 3e-3, 2, 6, 0.1  # gqa's lr and min_lr_ratio, BASE's schedule
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:  # the update of step s uses the rate at optimizer count s - 1
        s = r["step"] - 1
        cos = 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))
        want = lr * s / warmup if s < warmup else lr * (floor + (1 - floor) * cos)
        assert r["lr"] == pytest.approx(want, rel=1e-5, abs=1e-12)
    times = [r["time"] for r in rows]
    assert times == sorted(times) and times[-1] <= time.time()
    # log_every=1: each record's rate is its own step's. Steps 2-5 by the records' clock (no
    # compile, no eval) vs the rates they report; with compile the first would be ~1000x off.
    clock = 4 * 2 * 32 / (times[4] - times[0])
    assert np.median([r["tokens_per_s"] for r in rows[1:5]]) > 0.3 * clock
    assert rows[0]["tokens_per_s"] > 0.005 * clock, (rows[0]["tokens_per_s"], clock)


def _saved_run_loads_and_resumes(tmp_path, name: str):
    """The run under tests/data/`name` loads into today's model, which computes the logits
    the saving code computed, and a resuming Trainer's restore finds its parameters and
    optimizer moments: (config, restored items)."""
    run = tmp_path / name
    shutil.copytree(os.path.join(ROOT, "tests", "data", name), run)
    model, cfg, step = checkpoint.load_params(run)
    tokens = np.load(run / "legacy_tokens.npy")
    np.testing.assert_allclose(np.asarray(forward(model, tokens)),
                               np.load(run / "legacy_logits.npy"), rtol=0, atol=1e-5)
    params = nnx.to_pure_dict(nnx.state(model))
    like = {"params": params, "opt_state": train.make_optimizer(cfg).init(params)}
    got_step, items = checkpoint.restore_latest(checkpoint.manager(run, keep=2),
                                                layouts=checkpoint.layouts(cfg), **like)
    assert got_step == step == 2
    assert jax.tree.structure(items) == jax.tree.structure(like)
    return cfg, items


def _adam_moments(items):
    return [s for s in jax.tree.leaves(items["opt_state"], is_leaf=lambda s: hasattr(s, "mu"))
            if hasattr(s, "mu")][0].mu


def test_run_saved_before_the_layer_plan_loads_and_resumes(tmp_path):
    """tests/data/legacy_run was trained and saved by the code before the layer plan moved
    attention parameters under `source`/`selector` (its make.py, run at commit 46aea4e),
    with the logits that code computed; it has a layer of every kind that moved."""
    _, items = _saved_run_loads_and_resumes(tmp_path, "legacy_run")
    moved = _adam_moments(items)["blocks"][4]["attn"]["source"]["compressor"]  # a full layer
    assert any(float(np.abs(x).max()) > 0 for x in jax.tree.leaves(moved))  # trained moments


def test_scanned_run_saved_with_first_copies_unrolled_loads_and_resumes(tmp_path):
    """tests/data/scan_first_copy_run was saved by the code before scans carried a fixed
    context (its make.py, run at commit 49035c5): its V4.1 groups that write the context
    ran their first copy unrolled, so its scanned parameters hold one copy fewer. Today
    every copy is scanned: one stack of three."""
    cfg, items = _saved_run_loads_and_resumes(tmp_path, "scan_first_copy_run")
    assert scan.units(cfg)[0] == scan.Unit(0, 2, 3)
    full = _adam_moments(items)["blocks"][0]["layers"][0]["attn"]["source"]["compressor"]
    assert all(x.shape[0] == 3 and float(np.abs(x[0]).max()) > 0  # the once-unrolled copy
               for x in jax.tree.leaves(full))


def test_scanned_run_saved_before_nested_runs_loads_and_resumes(tmp_path):
    """tests/data/scan_flat_runs_run was saved by the code before runs of equal layers in a
    group were nested scans (its make.py, run at commit 46e758a): its (full, reuse*3) group
    stacked each of the four layers over the 3 copies. Today the reuse run is one slot
    stacked over 3 copies x 3 layers, copy c's layer j at 3c + j."""
    cfg, items = _saved_run_loads_and_resumes(tmp_path, "scan_flat_runs_run")
    assert scan.units(cfg) == (scan.Unit(0, 4, 3, (1, 3)),)
    reuse = _adam_moments(items)["blocks"][0]["layers"][1]["ffn"]
    assert all(x.shape[0] == 9 and float(np.abs(x).max()) > 0 for x in jax.tree.leaves(reuse))


def test_a_saved_layout_is_one_entry_of_migrations(monkeypatch):
    """checkpoint.layouts derives its restore maps from migrations.SAVED_LAYOUTS alone: an
    entry added there is a layout restore tries, its rewrite and inverse around the blocks'
    re-layout."""
    cfg = preset("mha", "model.n_layers=2")
    assert len(checkpoint.layouts(cfg)) == len(migrations.SAVED_LAYOUTS)
    extra = migrations.Layout("test: a tree one level down", scan.units,
                              lambda t: {"moved": t}, lambda t: t["moved"])
    monkeypatch.setattr(migrations, "SAVED_LAYOUTS", (*migrations.SAVED_LAYOUTS, extra))
    pairs = checkpoint.layouts(cfg)
    assert len(pairs) == len(migrations.SAVED_LAYOUTS)
    to_saved, to_current = pairs[-1]
    assert to_saved({"x": 1}) == {"moved": {"x": 1}}
    assert to_current({"moved": {"x": 1}}) == {"x": 1}


@pytest.mark.parametrize("saved, loaded", [(False, True), (True, False)])
def test_runs_restore_across_scanned_and_unrolled_layouts(tmp_path, saved, loaded):
    """model.scan_layers changes how weights are laid out (repeated layers stacked), not what
    they compute: a run saved in one layout loads into the other."""
    small = ["model.dtype=float64", "model.d_model=32", "model.ffn_hidden=64",
             "attention.head_dim=8"]
    cfg = preset("mha", *small, f"model.scan_layers={str(saved).lower()}")
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    checkpoint.save_config(tmp_path, cfg)
    mngr = checkpoint.manager(tmp_path, keep=1, writer=True)
    checkpoint.save(mngr, 1, params=nnx.to_pure_dict(nnx.state(model)))
    mngr.wait_until_finished()
    other = checkpoint.load_run_config(tmp_path, [f"model.scan_layers={str(loaded).lower()}"])
    restored, _, step = checkpoint.load_params(tmp_path, other)
    assert step == 1 and any(u.scanned for u in restored.units) == loaded
    tokens = np.random.RandomState(0).randint(0, 256, (2, 9))
    np.testing.assert_allclose(np.asarray(forward(restored, tokens)),
                               np.asarray(forward(model, tokens)), rtol=0, atol=1e-12)


# ----------------------------------------------------------------- checkpoint write failures
NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


def fail_commits(monkeypatch, threads=None):
    """orbax's background commit (the rename of a finished `<step>.orbax-checkpoint-tmp`)
    fails as on a full disk; the failing threads' names go to `threads`."""
    from orbax.checkpoint._src.path import atomicity

    async def full(tmp_dir, **kwargs):
        if threads is not None:
            threads.append(threading.current_thread().name)
        raise NO_SPACE

    monkeypatch.setattr(atomicity, "on_commit_callback", full)


def test_failed_async_commit_names_step_cause_and_last_checkpoint_and_a_rerun_resumes(
        run_dir, monkeypatch):
    tr = train.Trainer(cfg(*BASE[1:], "train.steps=12"), run_dir, quiet=True)
    threads = []
    fail_commits(monkeypatch, threads)
    with pytest.raises(errors.CheckpointWriteError,
                       match=r"checkpoint of step 9 .*No space left on device \[ENOSPC\].*"
                             r"removed its unfinished files.*last complete checkpoint is step 6"):
        tr.run()
    assert threads and threading.main_thread().name not in threads  # orbax's own thread
    assert saved_steps(run_dir) == [3, 6]
    assert not list((run_dir / "checkpoints").glob("*tmp*"))  # nothing half-written is left
    monkeypatch.undo()
    tr = train.Trainer(cfg(*BASE[1:], "train.steps=12"), run_dir, quiet=True)
    assert tr.step == 6 and logged(run_dir) == list(range(1, 7))
    tr.run()
    assert saved_steps(run_dir) == [9, 12] and logged(run_dir) == list(range(1, 13))


def test_failed_save_call_is_a_write_error_and_bugs_keep_theirs(run_dir, monkeypatch):
    import orbax.checkpoint as ocp

    async def no_permission(self, directory, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(directory))

    tr = train.Trainer(cfg(*BASE[1:], "train.steps=12"), run_dir, quiet=True)
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", no_permission)
    with pytest.raises(errors.CheckpointWriteError,
                       match=r"checkpoint of step 9 .*Permission denied \[EACCES\].*"
                             r"last complete checkpoint is step 6"):
        tr.run()
    assert saved_steps(run_dir) == [3, 6] and not list(run_dir.glob("checkpoints/*tmp*"))

    async def bug(self, directory, *args, **kwargs):
        raise TypeError("not an array")

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", bug)
    with pytest.raises(TypeError, match="not an array"):  # not the disk: not hidden
        train.Trainer(cfg(*BASE[1:], "train.steps=12"), run_dir, quiet=True).run()


def test_leftover_unfinished_checkpoint_is_never_restored_and_resume_says_so(run_dir):
    tmp = run_dir / "checkpoints" / "9.orbax-checkpoint-tmp-1234"
    shutil.copytree(run_dir / "checkpoints" / "6", tmp)  # a save killed before its rename
    shutil.copy(largest_file(tmp / "params"), tmp / "params" / "junk")
    assert checkpoint.load_params(run_dir)[2] == 6  # readers never list it
    assert tmp.exists()  # nor touch it: for a reader it may be a save in progress
    with pytest.warns(UserWarning, match=r"removed the unfinished checkpoint "
                                         r"9\.orbax-checkpoint-tmp-1234.*never restored"):
        tr = train.Trainer(cfg(*BASE[1:], "train.steps=12"), run_dir, quiet=True)
    assert tr.step == 6 and not tmp.exists()


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_failed_save_on_a_terminal_closes_the_bar_before_the_error(run_dir, monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    tr = train.Trainer(cfg(*BASE[1:], "train.steps=12"), run_dir)  # with its progress bar
    fail_commits(monkeypatch)
    with pytest.raises(errors.CheckpointWriteError):
        tr.run()
    shown = sys.stderr.getvalue()
    assert "\r" in shown and shown.endswith("\n")  # the error's line starts a line of its own


INJECT = """
import errno, runpy, sys
from orbax.checkpoint._src.path import atomicity

async def full(tmp_dir, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

atomicity.on_commit_callback = full
sys.argv = ["scripts/train.py", *sys.argv[1:]]
runpy.run_path("scripts/train.py", run_name="__main__")
"""


def extend_args(run_dir):
    return ["configs/tiny/gqa.yaml", *TINY, *BASE[1:], "train.steps=12", "--run-dir",
            str(run_dir), "--quiet"]


def test_train_script_ends_a_failed_save_with_one_line(run_dir):
    # -W: the extended schedule's warning aside, stderr is the error's one line
    p = subprocess.run([sys.executable, "-W", "ignore::UserWarning", "-c", INJECT,
                        *extend_args(run_dir)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1, p.stderr[-3000:]
    assert err[0].startswith("train.py: error: could not write the checkpoint of step 9"), err
    assert "No space left on device" in err[0] and "last complete checkpoint is step 6" in err[0]


def test_train_script_with_debug_shows_a_failed_saves_traceback(run_dir, monkeypatch):
    from scripts import train as train_script

    fail_commits(monkeypatch)
    with pytest.raises(errors.CheckpointWriteError) as e:  # through cli.run: its traceback
        cli.run(train_script.main, [*extend_args(run_dir), "--debug"])
    assert isinstance(e.value.__cause__, OSError)


def test_block_sizes_and_remat_may_change_on_resume(tmp_path):
    """attention.query_block and entry_block, indexer.key_block, model.remat and
    remat_block_from choose how the step runs, not what it computes: a run restores under
    other values (a model key still refuses)."""
    from dsattn import checkpoint
    from tests.helpers import preset

    cfg = preset("v4", "model.n_layers=2", "attention.layers=swa, csa")
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    checkpoint.check_compatible(tmp_path, preset(
        "v4", "model.n_layers=2", "attention.layers=swa, csa", "attention.query_block=64",
        "indexer.key_block=128", "attention.entry_block=64", "model.remat=block",
        "model.remat_block_from=4096"))
    with pytest.raises(checkpoint.CheckpointMismatch, match="attention.top_k"):
        checkpoint.check_compatible(tmp_path, preset(
            "v4", "model.n_layers=2", "attention.layers=swa, csa", "attention.top_k=3"))


def test_a_run_keeps_the_tokenizer_its_data_source_names(tmp_path):
    """The run directory copies the tokenizer file it is handed (a token directory's:
    DataSource.tokenizer) and drops a stale copy when the run is on bytes (None)."""
    from dsattn import rundir

    tok = tmp_path / "their_tokenizer.json"
    tok.write_text('{"model": "bpe"}')
    run = tmp_path / "run"
    run.mkdir()
    rundir.keep_tokenizer(run, tok)
    assert (run / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert sorted(p.name for p in run.iterdir()) == ["tokenizer.json"]  # no temporary left
    rundir.keep_tokenizer(run, None)
    assert not (run / "tokenizer.json").exists()
