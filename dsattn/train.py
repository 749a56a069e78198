"""Training: AdamW with warm-up + cosine decay, clipping, a jitted functional step, periodic
validation, metrics.jsonl, orbax checkpoints and exact resume.

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

import contextlib
import dataclasses
import json
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
import optax
from flax import nnx

from dsattn import checkpoint, data, flops, progress, runlog, sharding, tblog
from dsattn.config import Config, Kind, keys_of, with_values
from dsattn.errors import ConfigError, NonFiniteLoss, RunDirLocked  # noqa: F401  (re-exported)
from dsattn.evaluate import outputs, token_nll, weighted_mean
from dsattn.model import Transformer


def make_schedule(cfg: Config) -> optax.Schedule:
    t = cfg.train
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=min(t.warmup_steps, t.steps),
        decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.lr * t.min_lr_ratio)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    t = cfg.train
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norms
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(make_schedule(cfg), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                    mask=decay_mask))


def loss_fn(model: Transformer, batch: dict, step=None):
    """Mean next-token cross-entropy plus any auxiliary losses the layers report. With
    batch["weights"] (a corpus with loss weights, e.g. recall format=mqar: answers only) the
    cross-entropy is the weighted mean over targets."""
    logits, auxes = model.forward(batch["inputs"], step)
    ce = weighted_mean(token_nll(logits, batch["targets"]), batch.get("weights"))
    metrics = {"ce": ce}
    total = ce
    for name in sorted({k for aux in auxes for k in aux}):
        value = sum(aux[name] for aux in auxes if name in aux)
        metrics[name] = value
        if name.endswith("_loss"):
            total = total + value
    metrics["loss"] = total
    return total, metrics


class Trainer:
    """Holds the functional state (params, optimizer state) and the jitted step.

    The run directory is locked (checkpoint.RunDirLock) while the Trainer writes to it, during
    construction and `run`: a second writer gets RunDirLocked, and so does `run` if another
    process saved a checkpoint since this Trainer last did (make a new Trainer to resume).
    Resuming restores the newest checkpoint that verifies against its manifest and loads
    (`strict=True`: refuses to fall back past a damaged one) and cuts metrics.jsonl back to
    its step. Each save's manifest is hashed in the background (checkpoint.Commit).

    Resuming with other schedule values (train.steps, warmup_steps, lr, min_lr_ratio) than the
    run directory's config.yaml, e.g. extending a finished run, warns naming old and new values
    and the learning rate's jump at the resume step: the schedule is rebuilt for the new
    values, not kept. Resuming with other Kind.DATA_ORDER values (batch size, sequence length,
    seed, data source or split) warns naming them and appends a record to metrics.jsonl,
    {"step", "time", "exact_resume": false, "changed": {key: [old, new]}}: the run no longer
    continues as an uninterrupted one would (config.yaml keeps only the new values). With
    `strict=True` such a resume raises ConfigError instead, before anything is written.

    metrics.jsonl gets a record every train.log_every steps and at each validation: the step's
    metrics, its learning rate `lr`, `time` (Unix seconds) and `tokens_per_s`, the rate of the
    steps since the previous record timed alone (the step is compiled ahead, so no compile
    time; no validation or checkpoint time either), with `model_tflops_per_s` (that rate x
    the plan's training FLOPs per token, dsattn.flops) and `mfu` (over train.peak_tflops or
    the device's known peak; absent when neither is known). Each record's numbers also go to
    TensorBoard event files beside it (dsattn.tblog).
    """

    def __init__(self, cfg: Config, run_dir, *, quiet: bool = False, strict: bool = False,
                 progress_every: int | None = None):
        cfg = data.with_source_vocab(cfg)  # a token directory's vocab, before any model
        self.cfg, self.run_dir, self.quiet = cfg, Path(run_dir), quiet
        self.progress_every = progress_every  # off a terminal: a line every N steps
        self._events = None  # TensorBoard events of the records, while `run` runs
        mesh = sharding.make_mesh(cfg)
        self.mesh = mesh if mesh.size > 1 else None  # None: one device, nothing sharded
        self.primary = jax.process_index() == 0  # the process that writes the run's files
        # before anything is read or written
        self.lock = checkpoint.RunDirLock(self.run_dir) if self.primary else _NoLock()
        try:
            checkpoint.check_compatible(self.run_dir, cfg)
            saved = checkpoint.saved_config(self.run_dir)
            self.corpus = data.load_corpus(cfg.data, cfg.model.vocab_size)
            # Born sharded on a mesh: no parameter or moment is ever whole on one device.
            self.graphdef, self.params = sharding.init_params(
                lambda: Transformer(cfg, rngs=nnx.Rngs(cfg.train.seed)), self.mesh)
            self.schedule = make_schedule(cfg)
            self.tx = make_optimizer(cfg)
            self._init_opt_state()
            self.step = 0
            self.mngr = checkpoint.manager(self.run_dir, cfg.train.keep_checkpoints,
                                           writer=self.primary)
            step, restored = checkpoint.restore_latest(  # the newest step that verifies
                self.mngr, set_aside=self.primary, strict=strict,
                layouts=checkpoint.layouts(cfg), params=self.params, opt_state=self.opt_state)
            if step is not None:
                self.params, self.opt_state = restored["params"], restored["opt_state"]
                if self.mesh is not None:  # a relaid-out restore may come back in any layout
                    self.params = jax.device_put(self.params, self.param_shardings)
                    self.opt_state = jax.device_put(self.opt_state, self.opt_shardings)
                self.step = step
                self._warn_if_schedule_changed(saved)
            changed = self._data_order_changes(saved, strict) if step is not None else {}
            self._saved = self.mngr.latest_step()  # == self.step, or None: nothing saved yet
            self._in_flight = None  # checkpoint.Commit of the step being committed
            if self.primary:
                self._cut_metrics()
                if changed:
                    self._log({"step": self.step, "time": time.time(), "exact_resume": False,
                               "changed": changed})
                checkpoint.save_config(self.run_dir, cfg)
                data.keep_tokenizer(self.run_dir, cfg.data.source)  # generate/eval decode by it
        finally:
            self.lock.release()  # until run(): an idle Trainer does not block the directory
        t = cfg.train
        if self.mesh is None:
            self._train_step = jax.jit(self._step_impl, donate_argnums=(0, 1))
            self._eval_step = jax.jit(self._eval_impl)
        else:
            rep = sharding.replicated(self.mesh)
            self.batch_shardings = sharding.batch_sharding(self.mesh, (t.batch_size, t.seq_len))
            self._train_step = jax.jit(
                self._step_impl, donate_argnums=(0, 1),
                in_shardings=(self.param_shardings, self.opt_shardings, self.batch_shardings,
                              rep),
                out_shardings=(self.param_shardings, self.opt_shardings, rep))
            self._eval_step = jax.jit(self._eval_impl,
                                      in_shardings=(self.param_shardings, self.batch_shardings),
                                      out_shardings=rep)
        self._compiled_step = None
        self.val_batches = [self._batch(b) for b in self.corpus.eval_batches(
            t.eval_batches, t.batch_size, t.seq_len, seed=t.seed)]

    def _init_opt_state(self):
        """The optimizer state for the (already laid out) params, made in their layout on
        the mesh (sharding.RULES); on one device, where they are."""
        if self.mesh is None:
            self.opt_state = self.tx.init(self.params)
            return
        self.param_shardings = sharding.tree_shardings(self.params, self.mesh)
        self.opt_shardings = sharding.tree_shardings(
            jax.eval_shape(self.tx.init, self.params), self.mesh)
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self.params)

    def _batch(self, batch: dict) -> dict:
        """A host batch (the same on every process) as the step's input: split by rows over
        the mesh, or left to jit on one device."""
        return batch if self.mesh is None else sharding.put(batch, self.batch_shardings)

    def _on_mesh(self):
        """Trace under the mesh, so sharding.constrain in the model sees it."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def _warn_if_schedule_changed(self, saved: dict | None):
        old, now = saved or {}, self.cfg.to_dict()
        changed = [(sec, key) for sec, key in keys_of(Kind.SCHEDULE)
                   if key in old.get(sec, {}) and old[sec][key] != now[sec][key]]
        if not changed:
            return
        before = make_schedule(with_values(self.cfg, {(sec, key): old[sec][key]
                                                    for sec, key in changed}))
        warnings.warn(
            f"{self.run_dir}: resuming at step {self.step} with "
            + ", ".join(f"{sec}.{key} {old[sec][key]} -> {now[sec][key]}"
                        for sec, key in changed)
            + f": the learning-rate schedule is rebuilt for the new values, so the rate at step "
            f"{self.step} jumps from {float(before(self.step)):.3g} to "
            f"{float(self.schedule(self.step)):.3g}", stacklevel=3)

    def _data_order_changes(self, saved: dict | None, strict: bool) -> dict:
        """{key: [old, new]} of the Kind.DATA_ORDER keys this resume changes, after a
        warning; ConfigError instead if `strict`."""
        old, now = saved or {}, self.cfg.to_dict()
        changed = {f"{sec}.{key}": [old[sec][key], now[sec][key]]
                   for sec, key in keys_of(Kind.DATA_ORDER)
                   if key in old.get(sec, {}) and old[sec][key] != now[sec][key]}
        if not changed:
            return {}
        what = (f"resuming at step {self.step} with "
                + ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
        if strict:
            raise ConfigError(f"{self.run_dir}: --strict refuses {what}: the steps from here "
                              f"would train on other batches than the run's; resume with its "
                              f"values (config.yaml) or without --strict")
        warnings.warn(f"{self.run_dir}: {what}: the steps from here train on other batches, "
                      f"not the batches an uninterrupted run would have seen (recorded in "
                      f"metrics.jsonl as exact_resume: false)", stacklevel=3)
        return changed

    def _cut_metrics(self):
        """Drop records past the restored step: the rerun logs those steps again."""
        runlog.cut(self.run_dir, self.step)

    # -- pure functions ------------------------------------------------------------------
    def _model(self, params) -> Transformer:
        state = nnx.State(params)
        return nnx.merge(self.graphdef, state)

    def _step_impl(self, params, opt_state, batch, step):
        metrics, grads = self._loss_and_grads(params, batch, step)
        if self.mesh is not None:  # gradients split like their parameters (FSDP: reduce-scatter)
            grads = jax.lax.with_sharding_constraint(grads, self.param_shardings)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["lr"] = self.schedule(step)  # the rate this update used (count == step)
        return optax.apply_updates(params, updates), opt_state, metrics

    def _loss_and_grads(self, params, batch, step):
        """(metrics, gradients) of loss_fn on the whole batch. With train.grad_accum = N > 1
        a lax.scan runs N micro-batches of B/N rows, summing their gradients (only one
        micro-batch's activations live at a time; one compiled body): each micro-batch's
        cross-entropy counts by its share of the batch's loss weight (1/N without weights),
        its auxiliary losses and other metrics by 1/N, so the sums are the whole batch's
        values. (The indexer's KL loss is a mean over queries with target mass; which
        queries have it depends on position, the same in every row unless an attention
        probability underflows to 0.)"""
        n = self.cfg.train.grad_accum
        if n == 1:
            f = lambda p: loss_fn(self._model(p), batch, step)  # noqa: E731
            (_, metrics), grads = jax.value_and_grad(f, has_aux=True)(params)
            return metrics, grads
        # Micro-batch i = rows i::N ([B, ...] -> [N, B/N, ...]): the rows a data/fsdp shard
        # holds split evenly over the micro-batches, so each stays spread over the mesh.
        micro = jax.tree.map(lambda x: jnp.swapaxes(
            x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1), batch)
        if self.mesh is not None:
            micro = {k: jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(
                self.mesh, jax.sharding.PartitionSpec(
                    None, *sharding.batch_sharding(self.mesh, x.shape[1:]).spec)))
                for k, x in micro.items()}
        if "weights" in micro:  # weighted_mean: S_i / W_i, counted by W_i / W
            w = micro["weights"].astype(jnp.result_type(float)).reshape(n, -1).sum(1)
            shares = w / jnp.maximum(w.sum(), 1e-6)
        else:
            shares = jnp.full((n,), 1 / n, jnp.result_type(float))

        def one(grad_sum, xs):
            mb, share = xs

            def f(p):
                _, m = loss_fn(self._model(p), mb, step)
                out = {k: v / n for k, v in m.items()}
                out["ce"] = m["ce"] * share.astype(m["ce"].dtype)
                out["loss"] = out["ce"] + (m["loss"] - m["ce"]) / n  # + auxiliary losses
                return out["loss"], out

            (_, m), g = jax.value_and_grad(f, has_aux=True)(params)
            if self.mesh is not None:  # the sum split like the parameters (FSDP)
                g = jax.lax.with_sharding_constraint(g, self.param_shardings)
            return jax.tree.map(jnp.add, grad_sum, g), m

        grads, metrics = jax.lax.scan(one, jax.tree.map(jnp.zeros_like, params),
                                      (micro, shares))
        return jax.tree.map(lambda x: x.sum(0), metrics), grads

    def _eval_impl(self, params, batch):  # the held-out cross-entropy (dsattn.evaluate)
        nll = outputs(self._model(params), batch["inputs"], batch["targets"])["nll"]
        return {"ce": weighted_mean(nll, batch.get("weights"))}

    # -- host loop -------------------------------------------------------------------------
    def model(self) -> Transformer:
        return self._model(self.params)

    def validation_loss(self) -> float:
        return float(self.validation_losses()[0])

    def validation_losses(self) -> np.ndarray:
        """Held-out cross-entropy of each run trained (one here; one per seed in a
        SeedGroup), the mean over the validation batches."""
        with self._on_mesh():
            losses = [np.atleast_1d(jax.device_get(self._eval_step(self.params, b)["ce"]))
                      for b in self.val_batches]
        return np.mean(losses, axis=0)

    def train_step(self, batch: dict, step: int) -> dict:
        """One optimizer step on `batch` ({"inputs", "targets"}) at schedule step `step`:
        updates `params` and `opt_state` (the old arrays are donated) and returns the step's
        metrics, not waited on. No logging, checkpoint or `self.step` change: `run` is the
        training loop; this is for callers that time or drive single steps (dsattn.bench)."""
        with self._on_mesh():
            self.params, self.opt_state, metrics = self._train_step(
                self.params, self.opt_state, self._batch(batch), jnp.int32(step))
        return metrics

    def save(self):
        """Save a checkpoint of `self.step`; orbax commits it in the background. A storage
        failure, now or in the background, ends training with CheckpointWriteError."""
        self._finish_saves()  # a failure of the save before is reported as that save's
        with self._writing(f"the checkpoint of step {self.step} to {self.mngr.directory}",
                           self.step):
            self._in_flight = checkpoint.save(self.mngr, self.step, with_manifest=True,
                                              params=self.params, opt_state=self.opt_state)
        self._saved = self.step

    def _finish_saves(self):
        """Wait for the checkpoint in flight to be committed and its manifest written (in
        the background since `save`: training waits only if it is not done yet)."""
        commit, self._in_flight = self._in_flight, None
        step = commit.step if commit is not None else None
        with self._writing(f"the checkpoint of step {step} to {self.mngr.directory}", step):
            commit.wait() if commit is not None else self.mngr.wait_until_finished()

    @contextlib.contextmanager
    def _writing(self, what: str, step: int | None = None):
        """A storage failure (no space, permission, I/O) inside becomes one
        CheckpointWriteError naming `what`, the cause and the last complete checkpoint;
        anything else is a bug and goes through as it is."""
        try:
            yield
        except Exception as e:
            error = checkpoint.write_error(self.mngr, e, what, step)
            if error is None:
                raise
            self.mngr = checkpoint.manager(self.run_dir, self.cfg.train.keep_checkpoints)
            self._saved = self.mngr.latest_step()
            raise error from e

    def _log(self, record: dict):
        if not self.primary:
            return
        path = self.run_dir / runlog.METRICS
        try:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            self._finish_saves()  # a failed checkpoint first: it names its own step
            with self._writing(f"step {record['step']}'s record to {path}"):
                raise e
        if self._events is not None:
            self._events.write(record)  # the same record: metrics.jsonl is the source

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

    def run(self, steps: int | None = None) -> dict:
        """Train until `steps` total steps (default cfg.train.steps); return a summary.

        On SIGINT or SIGTERM the step in flight finishes, a checkpoint is saved at it, and
        `run` raises KeyboardInterrupt (SIGINT) or SystemExit(128 + 15) (SIGTERM).
        """
        return self._loop(steps)[0]

    # -- the loop, over the runs this object trains (one; a SeedGroup's seeds) --------------
    def _runs(self) -> list[Trainer]:
        return [self]

    def batch_at(self, step: int) -> dict:
        """The batch step `step` trains on (in a SeedGroup: each seed's, stacked)."""
        t = self.cfg.train
        return self._batch(self.corpus.batch(step, t.batch_size, t.seq_len, t.seed))

    def _check_not_overtaken(self):
        self.mngr.reload()
        if self.mngr.latest_step() != self._saved:
            raise RunDirLocked(
                f"{self.run_dir} has a checkpoint at step {self.mngr.latest_step()} that "
                f"another process saved after this Trainer's step {self._saved}; make a new "
                f"Trainer to resume from it")

    def _loop(self, steps: int | None) -> list[dict]:
        runs = self._runs()
        self.lock.acquire()
        caught: list = []
        previous = {}
        try:
            for r in runs:
                r._check_not_overtaken()
            previous = self._catch_signals(caught)
            for r in runs:
                r._events = tblog.EventLog(r.run_dir, purge_from=self.step + 1)
            return self._run(self.cfg.train.steps if steps is None else steps, caught)
        finally:
            for r in runs:
                if r._events is not None:
                    r._events.close()
                    r._events = None
            for s, h in previous.items():
                signal.signal(s, h)
            try:
                self._finish_saves()
            finally:
                self.lock.release()

    def _run(self, target: int, caught: list) -> list[dict]:
        if self._compiled_step is None:  # compiled ahead, so compile time is not step time
            with self._on_mesh():
                self._compiled_step = self._train_step.lower(
                    self.params, self.opt_state, self.batch_at(self.step),
                    jnp.int32(self.step)).compile()
        runs = self._runs()
        desc = f"train {self.cfg.name}" + (f" x{len(runs)} seeds" if len(runs) > 1 else "")
        bar = progress.Progress(target, initial=self.step, desc=desc,
                                every=self.progress_every, quiet=self.quiet)
        try:
            return self._steps(target, caught, bar)
        finally:
            bar.close()  # before any error's line: not on the bar's line

    def _steps(self, target: int, caught: list, bar: progress.Progress) -> list[dict]:
        t, runs = self.cfg.train, self._runs()
        tokens_per_step = t.batch_size * t.seq_len  # of each run
        rate = flops.TrainingRate(self.cfg, 1 if self.mesh is None else self.mesh.size)
        vals = None
        start = self.step
        step_s, steps_timed = 0.0, 0  # steps since the last record: no compile, eval or saves
        while self.step < target and not caught:
            t0 = time.perf_counter()
            self.params, self.opt_state, metrics = self._compiled_step(
                self.params, self.opt_state, self.batch_at(self.step), jnp.int32(self.step))
            metrics = {k: np.atleast_1d(v) for k, v in jax.device_get(metrics).items()}  # waits
            step_s += time.perf_counter() - t0
            steps_timed += 1
            for r, loss in zip(runs, metrics["loss"]):
                if not math.isfinite(loss):
                    self._finish_saves()
                    good, bad = checkpoint.last_good(r.mngr)  # what a rerun resumes from
                    where = (f"the last good checkpoint is step {good} in "
                             f"{r.run_dir / 'checkpoints'}" if good is not None
                             else "no good checkpoint" if bad else "no checkpoint was saved yet")
                    where += "".join(f" (step {s} does not verify: {why})" for s, why in bad)
                    raise NonFiniteLoss(f"{'' if r is self else f'{r.run_dir}: '}training "
                                        f"loss became {loss} at step {self.step + 1}; {where}")
            self.step += 1
            tok_s = steps_timed * tokens_per_step / max(step_s, 1e-9)  # each run's own rate
            records = [{"step": self.step, **{k: float(v[i]) for k, v in metrics.items()},
                        "tokens_per_s": tok_s, **rate.record(tok_s), "time": time.time()}
                       for i in range(len(runs))]
            if self.step % t.eval_every == 0 or self.step == target:
                vals = self.validation_losses()
                for record, val in zip(records, vals):
                    record["val_loss"] = float(val)
            if self.step % t.log_every == 0 or "val_loss" in records[0]:
                for r, record in zip(runs, records):
                    r._log(record)
                step_s, steps_timed = 0.0, 0
            if self.step % t.ckpt_every == 0 or self.step == target:
                self.save()
            bar.update(fields={"loss": "/".join(f"{x:.3f}" for x in metrics["loss"]),
                               "val": "-" if vals is None else "/".join(f"{x:.3f}" for x in vals),
                               "tok/s": f"{tok_s:,.0f}", **rate.shown(tok_s)})
        bar.close()  # before the line below
        if caught:
            if self.step > start and self._saved != self.step:
                self.save()
            self._finish_saves()
            name = signal.Signals(caught[0]).name
            where = ", ".join(str(r.run_dir / "checkpoints") for r in runs)
            print(f"{name}: saved a checkpoint at step {self.step} in {where}; rerun the same "
                  f"command to resume", file=sys.stderr, flush=True)
            raise KeyboardInterrupt if caught[0] == signal.SIGINT else SystemExit(128 + caught[0])
        self._finish_saves()
        if vals is None:
            vals = self.validation_losses()
        return [{"step": self.step, "val_loss": float(v), "run_dir": str(r.run_dir)}
                for r, v in zip(runs, vals)]


class SeedGroup(Trainer):
    """Runs of one config that differ only in train.seed, trained together as one model
    under jax.vmap: their parameters and optimizer states stacked on a leading axis, one
    compiled step on each seed's own batches (data.batch_at with its seed).

    Each seed stays a Trainer of its own run directory (lock, config.yaml, metrics.jsonl with
    its own metrics, TensorBoard events, checkpoints): the group saves each seed's slice in
    the format of a run trained alone, so any seed resumes alone or in another group, and a
    Trainer's `params` are its seed's after `run`. The members must be at the same step, on
    one device (no mesh). A non-finite loss in any seed stops the group (NonFiniteLoss names
    the seed's run directory); each seed then resumes alone from its checkpoint.

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
        self.cfg, self.quiet, self.progress_every = first.cfg, first.quiet, first.progress_every
        self.graphdef, self.schedule, self.tx = first.graphdef, first.schedule, first.tx
        self.mesh, self.step = None, first.step
        stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
        self.params = stack([tr.params for tr in trainers])
        self.opt_state = stack([tr.opt_state for tr in trainers])
        self._saved = self.step if all(tr._saved == tr.step for tr in trainers) else None
        self.lock = _Locks([tr.lock for tr in trainers])
        self._train_step = jax.jit(jax.vmap(self._step_impl, in_axes=(0, 0, 0, None)),
                                   donate_argnums=(0, 1))
        self._eval_step = jax.jit(jax.vmap(self._eval_impl))
        self._compiled_step = None
        self.val_batches = [stack(bs) for bs in zip(*(tr.val_batches for tr in trainers))]

    def _runs(self) -> list[Trainer]:
        return self.members

    def batch_at(self, step: int) -> dict:
        return jax.tree.map(lambda *xs: np.stack(xs),
                            *(tr.batch_at(step) for tr in self.members))

    def run(self, steps: int | None = None) -> list[dict]:
        return self._loop(steps)

    def save(self):
        """Each seed's slice saved as its own run's checkpoint (orbax, in the background)."""
        for i, tr in enumerate(self.members):
            tr.params = jax.tree.map(lambda x: x[i], self.params)
            tr.opt_state = jax.tree.map(lambda x: x[i], self.opt_state)
            tr.step = self.step
            tr.save()
        self._saved = self.step

    def _finish_saves(self):
        for tr in self.members:
            tr._finish_saves()

    def model(self) -> Transformer:
        raise TypeError("a SeedGroup holds one model per seed: use its members' model()")

    def validation_loss(self) -> float:
        raise TypeError("a SeedGroup has one validation loss per seed: validation_losses()")


class _Locks:
    """The run directories' locks of a SeedGroup, taken together (all or none)."""

    def __init__(self, locks):
        self.locks = locks

    def acquire(self):
        held = []
        try:
            for lock in self.locks:
                lock.acquire()
                held.append(lock)
        except BaseException:
            for lock in held:
                lock.release()
            raise

    def release(self):
        for lock in self.locks:
            lock.release()


class _NoLock:
    """The run directory's lock on processes other than 0 (process 0 holds the real one)."""

    def acquire(self):
        pass

    def release(self):
        pass


def train(cfg: Config, run_dir, *, steps: int | None = None, quiet: bool = False,
          strict: bool = False, progress_every: int | None = None) -> dict:
    return Trainer(cfg, run_dir, quiet=quiet, strict=strict,
                   progress_every=progress_every).run(steps)
