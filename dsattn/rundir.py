"""A run directory as training writes it: the one-writer lock, config.yaml (checked against
the config on resume and kept), schedule.json (how --scale-schedule scaled the run's
schedule, if it did), metrics.jsonl with TensorBoard events beside it, and the checkpoints
(restore, save in the background, wait for the saves). No model or step here:
dsattn.trainstep builds those, dsattn.train's loop drives both.

In a multi-process job only process 0 (`primary`) writes the files besides the checkpoints
(lock, config.yaml, metrics.jsonl).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import warnings
from pathlib import Path

from dsattn import checkpoint, config, runlog, tblog, tokenizer
from dsattn.config import Config, Kind, keys_of, with_values
from dsattn.errors import ConfigError, NonFiniteLoss, RunDirLocked
from dsattn.tokenizer import TOKENIZER_FILE
from dsattn.trainstep import make_schedule


SCHEDULE_FILE = "schedule.json"  # config.load_scaled's record of a scaled schedule
INIT_FILE = "init_from.json"  # the run another run's weights started (--init-from)


def load_config(path, overrides=(), run_dir=None, *, scale_schedule: bool = False
                ) -> tuple[Config, Path, dict]:
    """(cfg, run_dir, record) of scripts/train.py: the preset at `path` with `overrides`,
    trained in `run_dir` (default runs/<config name>); `scale_schedule`: its schedule scaled
    to train.steps (config.load_scaled), `record` what that scaled ({}: nothing).

    A run's scaled schedule is part of what it trained with: when `run_dir` records one
    (SCHEDULE_FILE), a rerun with --scale-schedule keeps the values the run trained with
    (its config.yaml) for the keys the record scaled and the command line does not set, so
    rerunning with more steps resumes with the same warm-ups instead of rescaling them (the
    indexer's is a model key: a resume refuses another value). `record` is then the run's
    own. A rerun without --scale-schedule whose values differ is refused, naming them; the
    cadences (config.CADENCE_STEPS) excepted: a resume takes new recording values."""
    cfg, record = (config.load_scaled(path, overrides) if scale_schedule
                   else (config.load(path, overrides), {}))
    run_dir = Path(run_dir or f"runs/{cfg.name}")
    trained = _read_schedule(run_dir)
    saved = checkpoint.saved_config(run_dir) if trained else None
    if not saved:
        return cfg, run_dir, record
    keys = [tuple(k.split(".", 1)) for k in trained["scaled"]]
    if not scale_schedule:
        value = lambda sec, key: getattr(getattr(cfg, sec), key)  # noqa: E731
        differ = [f"{sec}.{key} {saved[sec][key]} -> {value(sec, key)}" for sec, key in keys
                  if (sec, key) not in config.CADENCE_STEPS
                  and value(sec, key) != saved.get(sec, {}).get(key, value(sec, key))]
        if differ:
            raise ConfigError(
                f"{run_dir} was trained with --scale-schedule ({trained['steps']} of the "
                f"preset's {trained['preset_steps']} steps); without it this run would "
                f"change {', '.join(differ)}: rerun with --scale-schedule (it keeps the "
                f"values the run trained with)")
        return cfg, run_dir, {}
    given = config.overridden_keys(overrides)
    kept = {(sec, key): saved[sec][key] for sec, key in keys
            if (sec, key) not in given and key in saved.get(sec, {})}
    return with_values(cfg, kept), run_dir, trained


def _read_schedule(run_dir) -> dict:
    path = Path(run_dir) / SCHEDULE_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # none (the common case), or unreadable: no record
        return {}
    return record if isinstance(record, dict) and isinstance(record.get("scaled"), dict) else {}


def keep_tokenizer(run_dir, tokenizer: Path | None) -> None:
    """A run keeps the tokenizer file of its token directory (generate and eval read it
    there; data.source's `DataSource.tokenizer`); a run on bytes (None) keeps none, so a
    stale copy is removed."""
    dest = Path(run_dir) / TOKENIZER_FILE
    if tokenizer is None:
        dest.unlink(missing_ok=True)
        return
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.copyfile(tokenizer, tmp)
    os.replace(tmp, dest)  # never a half-copied tokenizer beside the checkpoints


class RunDir:
    """The run directory `path` of `cfg`, locked (checkpoint.RunDirLock) from construction
    until `release`, and again from `acquire` to `release` (a loop's run: `held`): a second
    writer gets RunDirLocked. Construction checks `cfg` against the saved config.yaml
    (CheckpointMismatch) and reads it (`saved_config`, None for a new run); it releases the
    lock if that fails. `schedule`: how the run's schedule was scaled (load_config's
    record), written beside config.yaml at `start`."""

    def __init__(self, path, cfg: Config, *, primary: bool = True, schedule: dict | None = None):
        self.path, self.cfg, self.primary = Path(path), cfg, primary
        self.schedule = schedule or {}
        self._lock = checkpoint.RunDirLock(self.path) if primary else _NoLock()
        try:
            checkpoint.check_compatible(self.path, cfg)
            self.saved_config = checkpoint.saved_config(self.path)
        except BaseException:
            self._lock.release()
            raise
        self._mngr = None
        self._saved = None  # the step this object last saved or restored (None: none yet)
        self._in_flight = None  # checkpoint.Commit of the step being committed
        self._events = None  # TensorBoard events of the records, while a loop runs

    def acquire(self):
        self._lock.acquire()

    def release(self):
        self._lock.release()

    # -- resume ---------------------------------------------------------------------------
    def restore(self, *, strict: bool, **like) -> tuple[int | None, dict | None]:
        """(step, items) of the newest checkpoint that verifies and loads, restored like
        `like` (e.g. params=..., opt_state=...) across the saved layouts; (None, None) when
        nothing is saved. `strict`: refuse to fall back past a damaged step."""
        self._mngr = checkpoint.manager(self.path, self.cfg.train.keep_checkpoints,
                                        writer=self.primary)
        step, restored = checkpoint.restore_latest(
            self._mngr, set_aside=self.primary, strict=strict,
            layouts=checkpoint.layouts(self.cfg), **like)
        self._saved = self._mngr.latest_step()  # == step, or None: nothing saved yet
        return step, restored

    def resume_changes(self, step: int, strict: bool) -> dict:
        """Resuming at `step` with values the saved config.yaml does not have: warns naming
        changed schedule values (the schedule is rebuilt for them) and changed
        Kind.DATA_ORDER values, and returns the latter as {key: [old, new]} (`strict`:
        ConfigError instead). A data source of another tokenizer than the one the run keeps
        is refused (InputError), strict or not."""
        # its ids mean other strings, and `start` would replace the run's copy of its tokenizer
        tokenizer.check_run_data(self.path, self.cfg.data.source, f"resumed at step {step}")
        old, now = self.saved_config or {}, self.cfg.to_dict()
        changes = lambda kind: {(sec, key): (old[sec][key], now[sec][key])  # noqa: E731
                                for sec, key in keys_of(kind)
                                if key in old.get(sec, {}) and old[sec][key] != now[sec][key]}
        schedule, order = changes(Kind.SCHEDULE), changes(Kind.DATA_ORDER)
        if schedule:
            before = make_schedule(with_values(self.cfg, {k: a for k, (a, _) in schedule.items()}))
            warnings.warn(
                f"{self.path}: resuming at step {step} with "
                + ", ".join(f"{sec}.{key} {a} -> {b}" for (sec, key), (a, b) in schedule.items())
                + f": the learning-rate schedule is rebuilt for the new values, so the rate at "
                f"step {step} jumps from {float(before(step)):.3g} to "
                f"{float(make_schedule(self.cfg)(step)):.3g}", stacklevel=3)
        if not order:
            return {}
        what = (f"resuming at step {step} with "
                + ", ".join(f"{sec}.{key} {a} -> {b}" for (sec, key), (a, b) in order.items()))
        if strict:
            raise ConfigError(f"{self.path}: --strict refuses {what}: the steps from here "
                              f"would train on other batches than the run's; resume with its "
                              f"values (config.yaml) or without --strict")
        warnings.warn(f"{self.path}: {what}: the steps from here train on other batches, "
                      f"not the batches an uninterrupted run would have seen (recorded in "
                      f"metrics.jsonl as exact_resume: false)", stacklevel=3)
        return {f"{sec}.{key}": [a, b] for (sec, key), (a, b) in order.items()}

    def start(self, step: int, changed: dict):
        """The files of a run (re)starting at `step`: metrics.jsonl cut back to it (the
        rerun logs the later steps again), an exact_resume: false record of `changed` data
        order, config.yaml and the token directory's tokenizer (generate/eval decode by it)."""
        if not self.primary:
            return
        runlog.cut(self.path, step)
        if changed:
            self.log({"step": step, "time": time.time(), "exact_resume": False,
                      "changed": changed})
        checkpoint.save_config(self.path, self.cfg)
        if self.schedule:
            runlog.atomic_write(self.path / SCHEDULE_FILE, json.dumps(self.schedule) + "\n")
        keep_tokenizer(self.path, self.cfg.data.source.tokenizer)

    def recorded_init(self) -> str | None:
        """RUN_DIR:STEP of the run this one started from (--init-from), None if none."""
        path = self.path / INIT_FILE
        return json.loads(path.read_text())["source"] if path.exists() else None

    def record_init(self, source: str, table: str):
        """Keep what this run started from, so a rerun before its first checkpoint starts
        from the same weights (the source's step pinned) and a reader sees how."""
        if self.primary:
            self.path.mkdir(parents=True, exist_ok=True)
            runlog.atomic_write(self.path / INIT_FILE,
                                json.dumps({"source": source, "table": table}) + "\n")

    # -- while a loop runs ----------------------------------------------------------------
    def check_not_overtaken(self):
        """RunDirLocked if another process saved a checkpoint since this object last did."""
        self._mngr.reload()
        if self._mngr.latest_step() != self._saved:
            raise RunDirLocked(
                f"{self.path} has a checkpoint at step {self._mngr.latest_step()} that "
                f"another process saved after this Trainer's step {self._saved}; make a new "
                f"Trainer to resume from it")

    def open_events(self, purge_from: int):
        self._events = tblog.EventLog(self.path, purge_from=purge_from)

    def close_events(self):
        if self._events is not None:
            self._events.close()
            self._events = None

    def log(self, record: dict):
        """Append `record` to metrics.jsonl (and its numbers to the TensorBoard events while
        they are open). A storage failure is a CheckpointWriteError."""
        if not self.primary:
            return
        path = self.path / runlog.METRICS
        try:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            self.finish_saves()  # a failed checkpoint first: it names its own step
            with self._writing(f"step {record['step']}'s record to {path}"):
                raise e
        if self._events is not None:
            self._events.write(record)  # the same record: metrics.jsonl is the source

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def saved(self) -> int | None:
        """The step this object last saved or restored."""
        return self._saved

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def save(self, step: int, params, opt_state):
        """Save a checkpoint of `step`; orbax commits it in the background and a thread
        writes its manifest. A storage failure, now or in the background, ends training
        with CheckpointWriteError."""
        self.finish_saves()  # a failure of the save before is reported as that save's
        with self._writing(f"the checkpoint of step {step} to {self._mngr.directory}", step):
            self._in_flight = checkpoint.save(self._mngr, step, with_manifest=True,
                                              params=params, opt_state=opt_state)
        self._saved = step

    def finish_saves(self):
        """Wait for the checkpoint in flight to be committed and its manifest written (in
        the background since `save`: training waits only if it is not done yet)."""
        commit, self._in_flight = self._in_flight, None
        step = commit.step if commit is not None else None
        with self._writing(f"the checkpoint of step {step} to {self._mngr.directory}", step):
            commit.wait() if commit is not None else self._mngr.wait_until_finished()

    def non_finite(self, loss: float, step: int, *, named: bool) -> NonFiniteLoss:
        """The error of a non-finite training loss at `step` (after the saves in flight),
        naming the newest checkpoint that verifies, what a rerun resumes from; `named`: the
        message starts with the run directory (one of several trained together)."""
        self.finish_saves()
        good, bad = checkpoint.last_good(self._mngr)
        where = (f"the last good checkpoint is step {good} in {self.checkpoints}"
                 if good is not None
                 else "no good checkpoint" if bad else "no checkpoint was saved yet")
        where += "".join(f" (step {s} does not verify: {why})" for s, why in bad)
        return NonFiniteLoss(f"{f'{self.path}: ' if named else ''}training loss became "
                             f"{loss} at step {step}; {where}")

    @contextlib.contextmanager
    def _writing(self, what: str, step: int | None = None):
        """A storage failure (no space, permission, I/O) inside becomes one
        CheckpointWriteError naming `what`, the cause and the last complete checkpoint;
        anything else is a bug and goes through as it is."""
        try:
            yield
        except Exception as e:
            error = checkpoint.write_error(self._mngr, e, what, step)
            if error is None:
                raise
            self._mngr = checkpoint.manager(self.path, self.cfg.train.keep_checkpoints)
            self._saved = self._mngr.latest_step()
            raise error from e


@contextlib.contextmanager
def held(rundirs: list[RunDir]):
    """The run directories' locks, taken together (all or none) for the block."""
    taken = []
    try:
        for rd in rundirs:
            rd.acquire()
            taken.append(rd)
        yield
    finally:
        for rd in taken:
            rd.release()


class _NoLock:
    """The run directory's lock on processes other than 0 (process 0 holds the real one)."""

    def acquire(self):
        pass

    def release(self):
        pass
