"""Run directories: the config a run was trained with, orbax checkpoints of its state, and the
lock that keeps one writer per directory.

A run directory holds `config.yaml` (rewritten on resume; its model keys, config.Kind.MODEL,
never change), `metrics.jsonl`, `checkpoints/` and `.lock`. Restoring checks the saved config
first, so a checkpoint is never loaded into a model of another shape: the error names
every differing key; the checkpoint's own tree is checked too (parameter path and both
shapes). Each step a Trainer saves gets a manifest of its files' sizes and hashes once
committed (dsattn.manifest); every restore goes through `restore_latest`, which checks it
first. A damaged step (changed, truncated or missing file, lost or garbled manifest, or a step
orbax cannot read) is skipped with a warning naming the step, the file and the problem, for
the newest step that verifies; `strict` refuses instead. Nothing damaged is restored; steps
saved before manifests load unverified, with a warning.

Sharded arrays (a Trainer on a mesh, dsattn.sharding) are saved as the shards each process's
devices hold; `restore` reads into the shardings of the arrays it is given, so a checkpoint
restores onto another mesh shape or onto one device.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml

from dsattn import config as config_lib
from dsattn import manifest, migrations, scan
from dsattn.errors import (CheckpointCorrupt, CheckpointMismatch,  # noqa: F401 (re-exported)
                           CheckpointWriteError, RunDirLocked)


def relayout(tree, units_from, units_to):
    """A params (or optimizer-state) tree laid out for `units_from` (scan.units) re-laid out
    for `units_to` (scan.relayout, wherever the tree holds blocks)."""
    return scan.relayout(tree, units_from, units_to, migrations.rewrite)


def layouts(cfg) -> list:
    """(to_saved, to_current) tree maps for the layouts a run of `cfg`'s model may have
    been saved in besides `cfg`'s own: one pair per entry of migrations.SAVED_LAYOUTS, in its
    order (its blocks re-laid out between `cfg`'s units and the saved ones, then the entry's
    own rewrite)."""
    now = scan.units(cfg)

    def maps(layout: migrations.Layout):
        saved = layout.units(cfg)
        return (lambda t: layout.to_saved(relayout(t, now, saved)),
                lambda t: relayout(layout.to_current(t), saved, now))

    return [maps(layout) for layout in migrations.SAVED_LAYOUTS]


class RunDirLock:
    """One writer per run directory: an exclusive flock on `run_dir/.lock`, which holds the
    writer's pid for messages. The kernel drops a flock when its process dies (kill -9 too), so
    staleness needs no pid checks: a lock we can take that still names a pid was left by a dead
    process, and is taken over with a warning. The file is never deleted (an unlink races with
    a process that has opened it and is about to lock it); release empties it. `doing` and
    `instead` word the refusal for other directories (a sweep's)."""

    def __init__(self, run_dir, doing: str = "being trained",
                 instead: str = "another run directory"):
        self.path = Path(run_dir) / ".lock"
        self.doing, self.instead = doing, instead
        self._file = None
        self.acquire()

    def acquire(self) -> None:
        if self._file is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip()
            f.close()
            raise RunDirLocked(
                f"{self.path.parent} is {self.doing} by another process"
                f"{f' (pid {owner})' if owner else ''}; wait for it to finish, stop it, or use "
                f"{self.instead}") from None
        f.seek(0)
        previous = f.read().strip()
        if previous and previous != str(os.getpid()):
            warnings.warn(f"{self.path.parent}: taking over the lock left by pid {previous}, "
                          f"which is no longer running", stacklevel=3)
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.truncate(0)  # empty: the next writer sees a clean release
            self._file.close()  # closing drops the flock
            self._file = None


def save_config(run_dir: Path, cfg) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())


def saved_config(run_dir) -> dict | None:
    """The run directory's config.yaml as a plain dict (None if there is none)."""
    path = Path(run_dir) / "config.yaml"
    return migrations.upgrade_saved(yaml.safe_load(path.read_text())) if path.exists() else None


def load_run_config(run_dir, overrides=()):
    """The Config a run directory was trained with (keys renamed since then read as today's),
    plus `overrides`."""
    raw = saved_config(run_dir)
    if raw is None:
        raise FileNotFoundError(f"{run_dir}: no config.yaml; is this a dsattn run directory?")
    raw.setdefault("name", Path(run_dir).name)
    return config_lib.from_dict(raw, overrides)


def check_compatible(run_dir: Path, cfg) -> None:
    """Raise CheckpointMismatch if run_dir was trained with a different model config: a key
    of Kind.MODEL differs (config.keys_of), or a key of those sections that config.yaml has
    and today's sections don't. Any other key (a LAYOUT or EXECUTION one, the train, data
    and mesh sections) may change on resume."""
    saved = saved_config(run_dir)
    if saved is None:
        return
    now = yaml.safe_load(cfg.to_yaml())
    compared = (config_lib.Kind.MODEL, None)  # None: a key no section has now
    differ = []  # every one at once: a fix per rerun is a rerun per key
    for sec in config_lib.sections_of(config_lib.Kind.MODEL):
        a, b = saved.get(sec, {}), now.get(sec, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key) and config_lib.kind_of(sec, key) in compared:
                differ.append((f"{sec}.{key}", a.get(key), b.get(key)))
    if differ:
        raise CheckpointMismatch(
            f"{run_dir}: checkpoint was trained with "
            + ", ".join(f"{k}={a!r}" for k, a, _ in differ) + ", this config has "
            + ", ".join(f"{k}={b!r}" for k, _, b in differ)
            + (f" ({len(differ)} keys differ)" if len(differ) > 1 else "")
            + "; use another run directory or the run's own config")


def manager(run_dir: Path, keep: int, *, writer: bool = False) -> ocp.CheckpointManager:
    """The run's CheckpointManager. The writer (holding the run's lock) first removes, with a
    warning, the unfinished `<step>.orbax-checkpoint-tmp*` directories of killed or failed
    saves (orbax never lists them, so they are never restored); for a reader they may be a
    save in progress."""
    directory = (Path(run_dir) / "checkpoints").absolute()
    if writer:
        for name in remove_unfinished(directory):
            warnings.warn(f"{directory}: removed the unfinished checkpoint {name} of a killed "
                          f"or failed save (never restored)", stacklevel=2)
    # Directories made in the save call, not by a thread that could remake a failed save's
    # after write_error removed them; the writes still run in the background.
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, async_options=(
        ocp.AsyncOptions(create_directories_asynchronously=False)))
    return ocp.CheckpointManager(directory, options=opts)


def remove_unfinished(directory, step: int | None = None) -> list[str]:
    """Remove the `<step>.orbax-checkpoint-tmp*` directories in `directory` (of `step`, or
    all): orbax writes a step there and renames it when complete. Returns the names of those
    removed; one that cannot be removed is left (still never restored)."""
    gone = []
    for tmp in Path(directory).glob(f"{'*' if step is None else step}.orbax-checkpoint-tmp*"):
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            gone.append(tmp.name)
    return gone


def save(mngr: ocp.CheckpointManager, step: int, *, with_manifest: bool = False,
         **items) -> Commit | None:
    """Save named pytrees (e.g. params=..., opt_state=...) as one checkpoint step; orbax
    writes it in the background. `with_manifest`: the step records that a manifest follows, and
    the returned Commit writes it once orbax has committed the step (wait for it)."""
    mngr.save(step, args=ocp.args.Composite(
        **{k: ocp.args.StandardSave(v) for k, v in items.items()}), force=True,
        custom_metadata={manifest.PROMISE: manifest.MANIFEST} if with_manifest else None)
    return Commit(mngr, step) if with_manifest else None


class Commit:
    """A step orbax is committing, then its manifest: a thread waits for the commit and
    hashes the files (hashlib runs without the GIL, so training goes on meanwhile). `wait`
    joins it and raises what it raised (a storage failure). Only process 0 writes the
    manifest; the step's files are all on disk once orbax has committed it."""

    def __init__(self, mngr: ocp.CheckpointManager, step: int):
        self.step, self._error = step, None
        # not a daemon: an interpreter exiting on an error still writes the manifest
        self._thread = threading.Thread(target=self._commit, args=(mngr,),
                                        name=f"dsattn-commit-{step}")
        self._thread.start()

    def _commit(self, mngr):
        try:
            mngr.wait_until_finished()
            if jax.process_index() == 0:
                manifest.write(_step_dir(mngr, self.step))
        except BaseException as e:  # noqa: BLE001 (raised again in the waiting thread)
            self._error = e

    def wait(self) -> None:
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


# tensorstore's status codes for a storage failure (orbax's writes raise them as ValueError).
_STORAGE_STATUS = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "DATA_LOSS", "UNAVAILABLE")


def storage_failure(e: BaseException) -> str | None:
    """What went wrong if `e` is the storage's failure (no space, no permission, an I/O
    error): an OSError, or tensorstore's status error naming one, anywhere in its chain.
    None for anything else: a bug, which keeps its traceback."""
    while e is not None:
        code = re.search(r"os_error_code='?(\d+)", str(e))
        n = e.errno if isinstance(e, OSError) and e.errno else int(code[1]) if code else None
        if n is not None:
            return f"{os.strerror(n)} [{errno.errorcode.get(n, n)}]"
        if isinstance(e, OSError) or str(e).startswith(_STORAGE_STATUS):
            return _reason(e)
        e = e.__cause__ or e.__context__
    return None


def write_error(mngr: ocp.CheckpointManager, e: BaseException, what: str,
                step: int | None = None) -> CheckpointWriteError | None:
    """The error that ends training when writing `what` failed with `e` (in orbax's
    foreground or background), naming the last complete checkpoint; None if `e` is not the
    storage's failure. `step`: the checkpoint step that failed, whose unfinished files go.
    `mngr` is closed: make a new one to save again."""
    cause = storage_failure(e)
    if cause is None:
        return None
    parts = [f"could not write {what}: {cause}"]
    try:
        mngr.close()  # orbax's threads of the failed save stop writing first
    except Exception:  # noqa: BLE001 (the failure at hand is the one to report)
        pass
    if step is not None:
        removed = remove_unfinished(mngr.directory, step)
        left = [p.name for p in Path(mngr.directory).glob(f"{step}.orbax-checkpoint-tmp*")]
        if left:
            parts.append(f"its unfinished {left[0]} is never restored (a rerun removes it)")
        elif removed:
            parts.append("removed its unfinished files")
    mngr.reload()  # what is on disk: orbax drops a failed step from its own list
    last = last_good(mngr)[0]  # a step committed without its manifest is not resumed from
    parts.append(f"the last complete checkpoint is step {last}; rerun the same command to "
                 f"resume from it" if last is not None else
                 "no checkpoint is complete yet (a rerun starts over)")
    return CheckpointWriteError("; ".join(parts))


def _step_dir(mngr, step: int) -> Path:
    return Path(mngr.directory) / str(step)  # orbax's default step name: the bare number


def _tree_differences(mngr, step: int, like: dict) -> list[str]:
    """Where the saved trees differ from `like` (paths and shapes), from the step's metadata."""
    name = lambda path: jax.tree_util.keystr(path, simple=True, separator=".")
    out = []
    for item, tree in like.items():
        meta = ocp.StandardCheckpointHandler().metadata(_step_dir(mngr, step) / item).tree
        saved = {name(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(meta)}
        model = {name(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(tree)}
        for key in sorted(set(saved) | set(model)):
            if key not in model:
                out.append(f"{item}.{key} {saved[key]} is in the checkpoint, not in the model")
            elif key not in saved:
                out.append(f"{item}.{key} {model[key]} is in the model, not in the checkpoint")
            elif saved[key] != model[key]:
                out.append(f"{item}.{key} has shape {saved[key]} in the checkpoint and "
                           f"{model[key]} in the model")
    return out


def _reason(e: BaseException) -> str:
    while e.__cause__ is not None:  # orbax wraps what is wrong with the file (raise ... from)
        e = e.__cause__
    text = " ".join(str(e).split("\n", 1)[0].split())  # orbax errors run to pages
    return f"{type(e).__name__}: {text[:300]}"


def restore(mngr: ocp.CheckpointManager, step: int, **like) -> dict:
    """Restore the named items, shaped like the given pytrees."""
    args = {k: ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, v))
            for k, v in like.items()}
    return mngr.restore(step, args=ocp.args.Composite(**args))


def _mapped(fn, tree):
    """fn(tree), or its shapes when `tree` holds shapes only (jax.ShapeDtypeStruct)."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
        return jax.eval_shape(fn, tree)
    return fn(tree)


def verify(mngr: ocp.CheckpointManager, step: int, items=None) -> bool:
    """True if the step's files (its own and those of `items`, default all) match its
    manifest, False if it was saved without one; manifest.Damaged naming the file if not."""
    return manifest.verify(_step_dir(mngr, step), items)


def last_good(mngr: ocp.CheckpointManager, items=None) -> tuple[int | None, list]:
    """(the newest step that verifies or was saved without a manifest, [(newer step, what is
    wrong)]): what a resume would restore, without restoring it."""
    bad = []
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            verify(mngr, step, items)
        except manifest.Damaged as e:
            bad.append((step, str(e)))
            continue
        return step, bad
    return None, bad


def restore_latest(mngr: ocp.CheckpointManager, *, steps=None, set_aside: bool = False,
                   strict: bool = False, layouts=(), **like) -> tuple[int | None, dict | None]:
    """(step, items) of the newest checkpoint (among `steps`, default all) that verifies and
    loads, shaped like the given pytrees; (None, None) if there is no checkpoint.

    Each step is checked against its manifest first, for the items restored (the step's own
    files and theirs): a step that does not verify, or that orbax cannot read, is skipped with
    one warning naming it, the file, what is wrong and the step used instead. `strict`
    refuses the fallback (CheckpointCorrupt, nothing restored or renamed). A step saved
    without a manifest (an earlier dsattn) loads with a warning that it is unverified.
    `set_aside=True` (the run's writer) renames the skipped ones to `<step>.corrupt-<time>`
    once an older one loads, so the run saves those steps afresh and nothing is deleted. If
    none loads: CheckpointCorrupt, nothing renamed. A tree that differs from `like` is
    CheckpointMismatch, not damage: every step of a run has the same tree. `layouts`
    ((to_saved, to_current) pairs, see `layouts`) are other layouts a step may have been
    saved in: such a step is restored in its own layout and mapped to `like`'s.
    """
    skipped = []
    alternatives = [(alt, back) for alt, back in (
        ({k: _mapped(to_saved, v) for k, v in like.items()}, to_current)
        for to_saved, to_current in layouts) if jax.tree.structure(alt) != jax.tree.structure(like)]
    for step in sorted(mngr.all_steps() if steps is None else steps, reverse=True):
        try:
            verified = verify(mngr, step, set(like))
        except manifest.Damaged as e:
            skipped.append((step, str(e)))
            continue
        if strict and skipped:  # before anything is read or renamed
            raise CheckpointCorrupt(
                f"{mngr.directory}: "
                + "; ".join(f"checkpoint step {s} does not verify ({why})" for s, why in skipped)
                + f"; strict refuses to fall back to step {step}, the newest that "
                  f"{'verifies' if verified else 'loads (saved without a manifest)'} "
                  f"(resume without --strict to use it)")
        try:
            differences = _tree_differences(mngr, step, like)
            for alt, back in alternatives if differences else ():
                if not _tree_differences(mngr, step, alt):  # saved in another layout
                    differences = []
                    items = {k: back(v) for k, v in restore(mngr, step, **alt).items()}
                    break
            else:
                if not differences:
                    items = restore(mngr, step, **like)
        except Exception as e:  # noqa: BLE001 (any failure to read is a damaged checkpoint)
            skipped.append((step, _reason(e)))
            continue
        if differences:
            more = f"; and {len(differences) - 3} more" if len(differences) > 3 else ""
            raise CheckpointMismatch(
                f"{_step_dir(mngr, step)} does not fit this config: "
                f"{'; '.join(differences[:3])}{more}")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for bad, why in skipped:  # one line each: step, file, problem, what happens instead
            moved = ""
            if set_aside:
                dest = _step_dir(mngr, bad).with_name(f"{bad}.corrupt-{stamp}")
                _step_dir(mngr, bad).rename(dest)
                moved = f" (moved the damaged step {bad} to {dest.name})"
            warnings.warn(f"{mngr.directory}: skipping checkpoint step {bad}: it does not load "
                          f"({why}); using step {step}, the newest that "
                          f"{'verifies' if verified else 'loads'}{moved}", stacklevel=2)
        if set_aside and skipped:
            mngr.reload()
        if not verified:
            warnings.warn(f"{mngr.directory}: checkpoint step {step} has no manifest (saved by "
                          f"an earlier dsattn), so its content is not verified", stacklevel=2)
        return step, items
    if steps is not None and len(skipped) == 1:  # the step asked for
        raise CheckpointCorrupt(f"{mngr.directory}: checkpoint step {skipped[0][0]} does not "
                                f"load ({skipped[0][1]})")
    for bad, why in skipped:
        warnings.warn(f"{mngr.directory}: skipping checkpoint step {bad}: it does not load "
                      f"({why})", stacklevel=2)
    if skipped:
        raise CheckpointCorrupt(f"{mngr.directory}: no checkpoint loads: "
                                + "; ".join(f"step {s}: {why}" for s, why in skipped))
    return None, None


def load_params(run_dir, cfg=None, step: int | None = None, *, strict: bool = False):
    """A Transformer with the latest (or given) checkpoint's parameters, and its config. The
    latest is the newest whose parameters verify and load: damaged ones are skipped with a
    warning (`strict`: refused, CheckpointCorrupt); a given step that is damaged is refused."""
    from flax import nnx

    from dsattn.model import Transformer

    run_dir = Path(run_dir)
    cfg = cfg or load_run_config(run_dir)
    check_compatible(run_dir, cfg)
    mngr = manager(run_dir, keep=1_000_000)
    if step is not None and step not in mngr.all_steps():
        raise FileNotFoundError(f"{run_dir}: no checkpoint at step {step}; saved steps: "
                                f"{', '.join(map(str, mngr.all_steps())) or 'none'}")
    # Shapes only: the weights come from the checkpoint, so none are initialised.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    step, restored = restore_latest(mngr, steps=None if step is None else [step],
                                    strict=strict, layouts=layouts(cfg),
                                    params=nnx.to_pure_dict(state))
    if step is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to load")
    nnx.replace_by_pure_dict(state, restored["params"])
    return nnx.merge(graphdef, state), cfg, step
