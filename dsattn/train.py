"""Training: AdamW with warm-up + cosine decay, clipping, a jitted functional step, periodic
validation, metrics.jsonl, orbax checkpoints and exact resume.

Three parts, one concept each: dsattn.trainstep builds the training state and the jitted
step from a config (no file I/O: precision and gradient accumulation live there);
dsattn.rundir is a run directory (lock, config check, metrics.jsonl and TensorBoard,
checkpoints); `Loop` here trains one step over one or several run directories. `Trainer` is
the loop over one run directory, built from a config; `SeedGroup` the loop over several
Trainers' run directories with the step vmapped over their seeds.

Batches are a pure function of (seed, step) (dsattn.data.batch_at), so a rerun of the same
command resumes from the latest checkpoint and continues exactly as if never stopped. The run
directory survives SIGINT/SIGTERM (the step reached is saved), kill -9 (orbax commits a step by
renaming its finished directory; metrics.jsonl is cut back to the restored step), a damaged
latest checkpoint (the one before is used) and a second writer (refused by a lock).

With a mesh of more than one device (config `mesh`, dsattn.sharding) the step is jitted with
shardings: parameters and optimizer moments split by sharding.RULES, batch rows over data
and fsdp; checkpoints are saved sharded and restore onto any mesh. On one device (the
default) none of this runs. In a multi-process job only process 0 writes the run
directory's files besides the checkpoints (lock, config.yaml, metrics.jsonl).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dsattn import config, data, flops, plan, progress, rundir, sharding, trainstep
from dsattn.config import Config
from dsattn.errors import ConfigError, NonFiniteLoss, RunDirLocked  # noqa: F401  (re-exported)
from dsattn.model import Transformer
from dsattn.trainstep import loss_fn, make_optimizer, make_schedule  # noqa: F401  (public)


FIRST_STEPS = 3  # a run says its compile time and pace after this many steps


class Loop:
    """Training with one step (`trainstep`, a dsattn.trainstep.TrainStep) over the run
    directories `rundirs` (dsattn.rundir.RunDir): one, or several whose states are stacked
    on a leading axis and stepped by a vmapped step. Holds the functional state (`params`,
    `opt_state`, `step`); `batch_at` and `_save` are the subclass's (Trainer, SeedGroup).

    metrics.jsonl gets a record every train.log_every steps and at each validation: the step's
    metrics, its learning rate `lr`, `time` (Unix seconds) and `tokens_per_s`, the rate of the
    steps since the previous record timed alone (the step is compiled ahead, so no compile
    time; no validation or checkpoint time either), with `model_tflops_per_s` (that rate x
    the plan's training FLOPs per token, dsattn.flops) and `mfu` (over train.peak_tflops or
    the device's known peak; absent when neither is known). Each record's numbers also go to
    TensorBoard event files beside it (dsattn.tblog).
    """

    def __init__(self, cfg: Config, step_fn: trainstep.TrainStep, rundirs: list,
                 params, opt_state, step: int, val_batches: list, *, quiet: bool,
                 progress_every: int | None):
        self.cfg, self.trainstep, self.rundirs = cfg, step_fn, rundirs
        self.params, self.opt_state, self.step = params, opt_state, step
        self.val_batches = val_batches
        self.quiet = quiet
        self.progress_every = progress_every  # off a terminal: a line every N steps

    @property
    def mesh(self):
        """The device mesh, or None: one device, nothing sharded."""
        return self.trainstep.mesh

    @property
    def graphdef(self):
        return self.trainstep.graphdef

    def batch_at(self, step: int) -> dict:
        """The batch step `step` trains on (in a SeedGroup: each seed's, stacked)."""
        raise NotImplementedError

    def _save(self):
        """Save a checkpoint of `self.step` in each run directory."""
        raise NotImplementedError

    def train_step(self, batch: dict, step: int) -> dict:
        """One optimizer step on `batch` ({"inputs", "targets"}) at schedule step `step`:
        updates `params` and `opt_state` (the old arrays are donated) and returns the step's
        metrics, not waited on. No logging, checkpoint or `self.step` change: `run` is the
        training loop; this is for callers that time or drive single steps (dsattn.bench)."""
        with self.trainstep.on_mesh():
            self.params, self.opt_state, metrics = self.trainstep.train(
                self.params, self.opt_state, self.trainstep.batch(batch), jnp.int32(step))
        return metrics

    def validation_losses(self) -> np.ndarray:
        """Held-out cross-entropy of each run trained (one in a Trainer; one per seed in a
        SeedGroup), the mean over the validation batches."""
        with self.trainstep.on_mesh():
            losses = [np.atleast_1d(jax.device_get(self.trainstep.evaluate(self.params, b)["ce"]))
                      for b in self.val_batches]
        return np.mean(losses, axis=0)

    def _finish_saves(self):
        for rd in self.rundirs:
            rd.finish_saves()

    def _catch_signals(self, caught: list) -> dict:
        """SIGINT/SIGTERM append to `caught`; the loop stops after the step in flight. The
        first one restores the default action, so a second exits at once (like kill -9, which
        the run directory survives). Returns the previous handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may set handlers

        def handler(signum, _frame):
            caught.append(signum)
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_DFL)
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step to save a "
                        f"checkpoint; send it again to stop at once\n".encode())

        return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def _loop(self, steps: int | None) -> list[dict]:
        """Train until `steps` total steps (default cfg.train.steps); a summary per run.

        On SIGINT or SIGTERM the step in flight finishes, a checkpoint is saved at it, and
        this raises KeyboardInterrupt (SIGINT) or SystemExit(128 + 15) (SIGTERM)."""
        with rundir.held(self.rundirs):
            caught: list = []
            previous = {}
            try:
                for rd in self.rundirs:
                    rd.check_not_overtaken()
                previous = self._catch_signals(caught)
                for rd in self.rundirs:
                    rd.open_events(purge_from=self.step + 1)
                return self._run(self.cfg.train.steps if steps is None else steps, caught)
            finally:
                for rd in self.rundirs:
                    rd.close_events()
                for s, h in previous.items():
                    signal.signal(s, h)
                self._finish_saves()

    def _run(self, target: int, caught: list) -> list[dict]:
        n = len(self.rundirs)
        desc = f"train {self.cfg.name}" + (f" x{n} seeds" if n > 1 else "")
        if not self.quiet:  # minutes for a big model, before any step's line
            progress.say(f"{desc} compiling its training step (the first step waits for it)")
        # compiled ahead, so compile time is not step time
        t0 = time.perf_counter()
        step_fn = self.trainstep.compiled(self.params, self.opt_state, self.batch_at(self.step),
                                          self.step)
        compile_s = time.perf_counter() - t0
        bar = progress.Progress(target, initial=self.step, desc=desc,
                                every=self.progress_every, quiet=self.quiet)
        try:
            return self._steps(step_fn, target, caught, bar, compile_s)
        finally:
            bar.close()  # before any error's line: not on the bar's line

    def _steps(self, step_fn, target: int, caught: list, bar: progress.Progress,
               compile_s: float) -> list[dict]:
        t, runs = self.cfg.train, self.rundirs
        tokens_per_step = t.batch_size * t.seq_len  # of each run
        rate = flops.TrainingRate(self.cfg, 1 if self.mesh is None else self.mesh.size)
        vals = None
        start = self.step
        step_s, steps_timed = 0.0, 0  # steps since the last record: no compile, eval or saves
        first = min(FIRST_STEPS, target - start)  # the pace said once these are done
        first_s = 0.0
        while self.step < target and not caught:
            t0 = time.perf_counter()
            self.params, self.opt_state, metrics = step_fn(
                self.params, self.opt_state, self.batch_at(self.step), jnp.int32(self.step))
            metrics = {k: np.atleast_1d(v) for k, v in jax.device_get(metrics).items()}  # waits
            step_s += time.perf_counter() - t0
            steps_timed += 1
            if self.step - start < first:
                first_s += time.perf_counter() - t0
                if self.step - start + 1 == first:  # the cost, before waiting for the ETA
                    pace = first_s / first
                    bar.write(f"{bar.desc} compiled in {compile_s:.1f} s; {pace:.3g} s/step "
                              f"over its first {first} steps, about "
                              f"{progress.duration(pace * (target - start))} for the "
                              f"{target - start} steps")
            for rd, loss in zip(runs, metrics["loss"]):
                if not math.isfinite(loss):
                    self._finish_saves()
                    raise rd.non_finite(loss, self.step + 1, named=self.trainstep.vmapped)
            self.step += 1
            tok_s = steps_timed * tokens_per_step / max(step_s, 1e-9)  # each run's own rate
            # a NaN metric measured nothing this step (indexer_recall past the dense warm-up)
            records = [{"step": self.step, **{k: float(v[i]) for k, v in metrics.items()
                                              if not math.isnan(v[i])},
                        "tokens_per_s": tok_s, **rate.record(tok_s), "time": time.time()}
                       for i in range(len(runs))]
            if self.step % t.eval_every == 0 or self.step == target:
                vals = self.validation_losses()
                for record, val in zip(records, vals):
                    record["val_loss"] = float(val)
            if self.step % t.log_every == 0 or "val_loss" in records[0]:
                for rd, record in zip(runs, records):
                    rd.log(record)
                step_s, steps_timed = 0.0, 0
            if self.step % t.ckpt_every == 0 or self.step == target:
                self._save()
            bar.update(fields={"loss": "/".join(f"{x:.3f}" for x in metrics["loss"]),
                               "val": "-" if vals is None else "/".join(f"{x:.3f}" for x in vals),
                               "tok/s": f"{tok_s:,.0f}", **rate.shown(tok_s)})
        bar.close()  # before the line below
        if caught:
            if self.step > start and any(rd.saved != self.step for rd in runs):
                self._save()
            self._finish_saves()
            name = signal.Signals(caught[0]).name
            where = ", ".join(str(rd.checkpoints) for rd in runs)
            print(f"{name}: saved a checkpoint at step {self.step} in {where}; rerun the same "
                  f"command to resume", file=sys.stderr, flush=True)
            raise KeyboardInterrupt if caught[0] == signal.SIGINT else SystemExit(128 + caught[0])
        self._finish_saves()
        if vals is None:
            vals = self.validation_losses()
        return [{"step": self.step, "val_loss": float(v), "run_dir": str(rd.path)}
                for rd, v in zip(runs, vals)]


class Trainer(Loop):
    """The loop over one run directory, `run_dir`, training `cfg`.

    The run directory is locked while the Trainer writes to it, during construction and
    `run`: a second writer gets RunDirLocked, and so does `run` if another process saved a
    checkpoint since this Trainer last did (make a new Trainer to resume). Resuming restores
    the newest checkpoint that verifies against its manifest and loads (`strict=True`:
    refuses to fall back past a damaged one) and cuts metrics.jsonl back to its step. Each
    save's manifest is hashed in the background (checkpoint.Commit).

    Resuming with other schedule values (train.steps, warmup_steps, lr, min_lr_ratio) than the
    run directory's config.yaml, e.g. extending a finished run, warns naming old and new values
    and the learning rate's jump at the resume step: the schedule is rebuilt for the new
    values, not kept (`schedule`: how --scale-schedule scaled it, rundir.load_config's
    record, kept in the run directory). Resuming with other Kind.DATA_ORDER values (batch size, sequence length,
    seed, data source or split) warns naming them and appends a record to metrics.jsonl,
    {"step", "time", "exact_resume": false, "changed": {key: [old, new]}}: the run no longer
    continues as an uninterrupted one would (config.yaml keeps only the new values). With
    `strict=True` such a resume raises ConfigError instead, before anything is written.
    """

    def __init__(self, cfg: Config, run_dir, *, quiet: bool = False, strict: bool = False,
                 progress_every: int | None = None, explicit_vocab: bool = False,
                 schedule: dict | None = None, init_from: str | None = None):
        # a token directory's vocab, before any model, unless the user set model.vocab_size
        cfg = data.with_source_vocab(cfg, explicit_vocab)
        mesh = sharding.make_mesh(cfg)
        mesh = mesh if mesh.size > 1 else None  # None: one device, nothing sharded
        # locked before anything is read or written; process 0 writes the run's files
        self.rundir = rundir.RunDir(run_dir, cfg, primary=jax.process_index() == 0,
                                    schedule=schedule)
        try:
            self.corpus = data.load_corpus(cfg.data, cfg.model.vocab_size)
            step_fn, params, opt_state = trainstep.init(cfg, mesh)
            step, restored = self.rundir.restore(strict=strict, params=params,
                                                 opt_state=opt_state)
            changed = {}
            self.conversion = None  # how --init-from made the starting weights
            if step is None:  # a fresh run: said once, not again at every resume
                warn_short_schedule(cfg)
                source = init_from or self.rundir.recorded_init()
                if source:
                    params, opt_state = self._init_from(cfg, step_fn, params, source)
            else:
                params, opt_state = step_fn.place(restored["params"], restored["opt_state"])
                changed = self.rundir.resume_changes(step, strict)
            self.rundir.start(step or 0, changed)
        finally:
            self.rundir.release()  # until run(): an idle Trainer does not block the directory
        t = cfg.train
        val = [step_fn.batch(b) for b in self.corpus.eval_batches(
            t.eval_batches, t.batch_size, t.seq_len, seed=t.seed)]
        super().__init__(cfg, step_fn, [self.rundir], params, opt_state, step or 0, val,
                         quiet=quiet, progress_every=progress_every)

    def _init_from(self, cfg: Config, step_fn, fresh, source: str):
        """The starting state converted from the run `source` (RUN_DIR[:STEP],
        dsattn.convert): its rules fit on the first training batch's activations, and the
        KL to the source is measured on the validation batches. Recorded in the run
        directory with the source's step pinned."""
        from dsattn import convert

        t = cfg.train
        run, step = convert.parse_source(source)
        held_out = self.corpus.eval_batches(t.eval_batches, t.batch_size, t.seq_len,
                                            seed=t.seed)
        conv = convert.convert(cfg, fresh, run, step,
                               calibration=self.corpus.batch(0, t.batch_size, t.seq_len,
                                                             t.seed)["inputs"],
                               held_out=held_out, graphdef=step_fn.graphdef)
        self.conversion = conv
        self.rundir.record_init(f"{run}:{conv.step}", conv.table())
        opt_state = step_fn.init_opt_state(conv.params)
        return step_fn.place(conv.params, opt_state)

    @property
    def run_dir(self):
        return self.rundir.path

    def summary(self) -> str:
        """The run at its start: parameters, vocabulary, tokens per step and the schedule."""
        cfg, t = self.cfg, self.cfg.train
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))
        dense = (f", the indexer dense for {cfg.indexer.dense_warmup_steps}"
                 if any(s.kind.scans_keys for s in plan.resolve(cfg)) else "")
        return (f"{cfg.name}: {n_params:,} parameters, vocabulary {cfg.model.vocab_size:,}, "
                f"{t.batch_size * t.seq_len:,} tokens per step ({t.batch_size} x {t.seq_len}); "
                f"{t.steps} steps from step {self.step}: lr {t.lr:g} after a {t.warmup_steps}-"
                f"step warm-up, cosine to {t.lr * t.min_lr_ratio:g}{dense}; validation every "
                f"{t.eval_every}, checkpoints every {t.ckpt_every}")

    def batch_at(self, step: int) -> dict:
        t = self.cfg.train
        return self.trainstep.batch(self.corpus.batch(step, t.batch_size, t.seq_len, t.seed))

    def model(self) -> Transformer:
        return self.trainstep.model(self.params)

    def validation_loss(self) -> float:
        return float(self.validation_losses()[0])

    def save(self):
        """Save a checkpoint of `self.step`; orbax commits it in the background. A storage
        failure, now or in the background, ends training with CheckpointWriteError."""
        self.rundir.save(self.step, self.params, self.opt_state)

    _save = save

    def hold(self, params, opt_state, step: int):
        """Take `params` and `opt_state` at `step` as this run's state (a SeedGroup hands
        each member its seed's slice when it saves it)."""
        self.params, self.opt_state, self.step = params, opt_state, step

    def run(self, steps: int | None = None) -> dict:
        """Train until `steps` total steps (default cfg.train.steps); return a summary.

        On SIGINT or SIGTERM the step in flight finishes, a checkpoint is saved at it, and
        `run` raises KeyboardInterrupt (SIGINT) or SystemExit(128 + 15) (SIGTERM).
        """
        return self._loop(steps)[0]


class SeedGroup(Loop):
    """Runs of one config that differ only in train.seed, trained together as one model
    under jax.vmap: the loop over the members' run directories, their parameters and
    optimizer states stacked on a leading axis, one compiled step on each seed's own batches
    (data.batch_at with its seed).

    Each seed stays a Trainer of its own run directory (lock, config.yaml, metrics.jsonl with
    its own metrics, TensorBoard events, checkpoints): the group saves each seed's slice in
    the format of a run trained alone, so any seed resumes alone or in another group, and a
    Trainer's `params` are its seed's as last saved (after `run`: its final ones). The
    members must be at the same step, on one device (no mesh). A non-finite loss in any seed
    stops the group (NonFiniteLoss names the seed's run directory); each seed then resumes
    alone from its checkpoint. It has one model and one validation loss per seed: its
    members' `model()`, its `validation_losses()`.

    `run` returns one summary per seed, in the members' order.
    """

    def __init__(self, trainers: list[Trainer]):
        if not trainers:
            raise ConfigError("a SeedGroup needs at least one Trainer")
        first = trainers[0]
        unseeded = lambda c: dataclasses.replace(  # noqa: E731
            c, train=dataclasses.replace(c.train, seed=0))
        for tr in trainers:
            if unseeded(tr.cfg) != unseeded(first.cfg):
                raise ConfigError(f"{tr.run_dir}: a SeedGroup's runs differ only in train.seed")
            if tr.step != first.step:
                raise ConfigError(f"{tr.run_dir} is at step {tr.step}, {first.run_dir} at "
                                  f"{first.step}: a SeedGroup's runs start at one step")
            if tr.mesh is not None:
                raise ConfigError(f"{tr.run_dir}: a SeedGroup trains on one device (no mesh)")
        self.members = list(trainers)
        stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)  # noqa: E731
        super().__init__(
            first.cfg, first.trainstep.over_seeds(), [tr.rundir for tr in trainers],
            stack([tr.params for tr in trainers]), stack([tr.opt_state for tr in trainers]),
            first.step, [stack(bs) for bs in zip(*(tr.val_batches for tr in trainers))],
            quiet=first.quiet, progress_every=first.progress_every)

    def batch_at(self, step: int) -> dict:
        return jax.tree.map(lambda *xs: np.stack(xs),
                            *(tr.batch_at(step) for tr in self.members))

    def _save(self):
        """Each seed's slice saved as its own run's checkpoint (orbax, in the background)
        and handed to its Trainer."""
        for i, tr in enumerate(self.members):
            tr.hold(jax.tree.map(lambda x: x[i], self.params),
                    jax.tree.map(lambda x: x[i], self.opt_state), self.step)
            tr.save()

    def run(self, steps: int | None = None) -> list[dict]:
        return self._loop(steps)


def warn_short_schedule(cfg: Config) -> None:
    """A run shorter than its warm-ups or validation interval (config.short_schedule) says so
    at its start: a preset shrunk with train.steps=N keeps them otherwise silently."""
    short = config.short_schedule(cfg)
    if short:
        warnings.warn(
            f"train.steps={cfg.train.steps} is shorter than "
            + ", ".join(f"{k}={v}" for k, v in short)
            + ": the run ends inside its warm-up or before its first validation; "
              "scripts/train.py --scale-schedule scales them to the run's length (or set "
              "them)")


def estimate(cfg: Config, run_dir=None, *, timed_steps: int = 3,
             explicit_vocab: bool = False) -> dict:
    """What training `cfg` costs, before it starts: a Trainer in a scratch directory compiles
    its step, times `timed_steps` steps (compiled ahead, as a run's are) and a validation
    (once to compile it, once timed). `run_dir` is only read, for the step a rerun would
    resume from (its newest checkpoint's; nothing is taken, written or restored there).
    Returns {compile_s (step and validation), step_s, tokens_per_s, eval_s, start, steps,
    evals, seconds}: seconds = (steps - start) x step_s + evals x eval_s + compile_s;
    checkpoint writes are not in it."""
    import tempfile

    t = cfg.train
    saved = Path(run_dir or "-") / "checkpoints"
    done = [int(p.name) for p in saved.iterdir() if p.name.isdigit()] if saved.is_dir() else []
    start = min(max(done, default=0), t.steps)
    with tempfile.TemporaryDirectory() as tmp:
        tr = Trainer(cfg, Path(tmp) / "run", quiet=True, explicit_vocab=explicit_vocab)
        t0 = time.perf_counter()
        step_fn = tr.trainstep.compiled(tr.params, tr.opt_state, tr.batch_at(0), 0)
        compile_s = time.perf_counter() - t0
        params, opt_state = tr.params, tr.opt_state
        t0 = time.perf_counter()
        for i in range(timed_steps):
            params, opt_state, metrics = step_fn(params, opt_state, tr.batch_at(i), jnp.int32(i))
            jax.device_get(metrics)  # waits, as the loop does
        step_s = (time.perf_counter() - t0) / timed_steps
        tr.params, tr.opt_state = params, opt_state  # the donated ones are gone
        t0 = time.perf_counter()
        tr.validation_losses()  # compiles the evaluation step
        first_eval_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tr.validation_losses()
        eval_s = time.perf_counter() - t0
    # validations: every eval_every steps and at the last one (Loop._steps)
    evals = t.steps // t.eval_every - start // t.eval_every + bool(t.steps % t.eval_every)
    evals = evals if start < t.steps else 0
    compile_s += max(first_eval_s - eval_s, 0.0)
    return {"compile_s": compile_s, "step_s": step_s,
            "tokens_per_s": t.batch_size * t.seq_len / step_s, "eval_s": eval_s,
            "start": start, "steps": t.steps, "evals": evals,
            "seconds": (t.steps - start) * step_s + evals * eval_s + compile_s}


def estimate_line(cfg: Config, e: dict) -> str:
    """`estimate`'s figures as one line."""
    left = e["steps"] - e["start"]
    where = (f"from step {e['start']} of {e['steps']}: " if e["start"] else "")
    return (f"estimate for {cfg.name}: compiled in {e['compile_s']:.1f} s; {e['step_s']:.3g} "
            f"s/step, {e['tokens_per_s']:,.0f} tokens/s; a validation {e['eval_s']:.3g} s; "
            f"{where}{left} steps x {e['step_s']:.3g} s + {e['evals']} validations x "
            f"{e['eval_s']:.3g} s + compiles: about {progress.duration(e['seconds'])} "
            f"{'left' if e['start'] else 'for the run'} (checkpoint writes extra)")


def train(cfg: Config, run_dir, *, steps: int | None = None, quiet: bool = False,
          strict: bool = False, progress_every: int | None = None,
          explicit_vocab: bool = False, init_from: str | None = None) -> dict:
    return Trainer(cfg, run_dir, quiet=quiet, strict=strict, progress_every=progress_every,
                   explicit_vocab=explicit_vocab, init_from=init_from).run(steps)
