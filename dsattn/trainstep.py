"""What a config trains with, built without reading or writing a file: the initial training
state (parameters and AdamW moments, laid out on the mesh), the schedule, the loss, and the
jitted training and evaluation steps. Mixed precision (model.param_dtype: the parameters and
moments in their dtype, the model computing in model.dtype) and gradient accumulation
(train.grad_accum) live in the step; `over_seeds()` is the same step over stacked seeds
(dsattn.train.SeedGroup). The loop that drives it, and the run directory it saves to, are
dsattn.train and dsattn.rundir.
"""

from __future__ import annotations

import contextlib
import fnmatch

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsattn import sharding
from dsattn.attention import blocks
from dsattn.config import Config
from dsattn.errors import ConfigError
from dsattn.evaluate import outputs, token_nll, weighted_mean
from dsattn.model import Transformer


def make_schedule(cfg: Config) -> optax.Schedule:
    t = cfg.train
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=min(t.warmup_steps, t.steps),
        decay_steps=max(t.steps, t.warmup_steps + 1), end_value=t.lr * t.min_lr_ratio)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """Clipping and AdamW; with train.freeze, over the trained parameters only (the frozen
    ones get optax.set_to_zero: no update, no decay, no moments, and the clip's norm is the
    trained parameters')."""
    t = cfg.train
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # no decay on norms
    tx = optax.chain(
        optax.clip_by_global_norm(t.grad_clip),
        optax.adamw(make_schedule(cfg), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                    mask=decay_mask))
    if not t.freeze:
        return tx
    labels = lambda params: jax.tree.map(  # noqa: E731
        lambda f: FROZEN if f else TRAINED, frozen(t.freeze, params))
    return optax.multi_transform({TRAINED: tx, FROZEN: optax.set_to_zero()}, labels)


TRAINED, FROZEN = "trained", "frozen"  # optax.multi_transform's labels


def parameter_paths(params) -> list[str]:
    """Each parameter's path as train.freeze's patterns match it ("blocks/0/layers/0/attn/
    wq/kernel"), in jax.tree order."""
    return [_path(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _path(keypath) -> str:
    names = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in keypath)
    return "/".join(str(n) for n in names)


def frozen(patterns, params):
    """A tree of bools like `params`: True where the last of `patterns` matching the
    parameter's path freezes it (a `!pattern` trains it again). Raises ConfigError for a
    pattern that matches no parameter (a typo would freeze nothing, silently) and for
    patterns that leave nothing to train."""
    paths = parameter_paths(params)
    is_frozen = [False] * len(paths)
    for pattern in patterns:
        trains = pattern.startswith("!")
        hits = fnmatch.filter(paths, pattern[1:] if trains else pattern)
        if not hits:
            raise ConfigError(f"train.freeze: {pattern!r} matches no parameter; paths look "
                              f"like {paths[0]!r} (dsattn.trainstep.parameter_paths)")
        hit = set(hits)
        is_frozen = [(not trains) if p in hit else f for p, f in zip(paths, is_frozen)]
    if all(is_frozen):
        raise ConfigError(f"train.freeze: {list(patterns)} freezes every parameter: nothing "
                          f"would train")
    return jax.tree.unflatten(jax.tree.structure(params), is_frozen)


# Positions per block of the training loss's unembedding and cross-entropy: at most
# [B, LOSS_BLOCK, V] float32 logits live at once (configs/small, batch 4: 256 MiB, not the
# 4 GiB of [4, 8192, 32768]).
LOSS_BLOCK = 512


def blocked_token_nll(model: Transformer, h, targets, block: int | None = LOSS_BLOCK):
    """Next-token cross-entropy per position [B, T] of final hidden states h [B, T, D]: the
    unembedding and the cross-entropy of `block` positions at a time, each block rematerialised
    in the backward pass (blocks.map_queries saves only its inputs), so neither pass holds
    [B, T, V] logits; the same values and gradients as unembedding all of T at once.
    `block` None: all of T at once."""
    def body(start, blk):
        return token_nll(model.sequence_logits(blk["h"]), blk["targets"]), ()

    if block is None:
        return body(0, {"h": h, "targets": targets})[0]
    return blocks.map_queries(body, block, {"h": h, "targets": targets})[0]


def loss_fn(model: Transformer, batch: dict, step=None, *, loss_block: int | None = LOSS_BLOCK):
    """Mean next-token cross-entropy plus any auxiliary losses the layers report. With
    batch["weights"] (a corpus with loss weights, e.g. recall format=mqar: answers only) the
    cross-entropy is the weighted mean over targets. The logits are made `loss_block`
    positions at a time (`blocked_token_nll`; None: all at once)."""
    h, auxes = model.hidden(batch["inputs"], step)
    nll = blocked_token_nll(model, h, batch["targets"], loss_block)
    ce = weighted_mean(nll, batch.get("weights"))
    metrics = {"ce": ce}
    total = ce
    for name in sorted({k for aux in auxes for k in aux}):
        values = [aux[name] for aux in auxes if name in aux]
        if isinstance(values[0], tuple):  # (Σ, count) per layer (indexer_recall): the mean
            # of the layers' means over those that counted any; NaN when none did
            counted = [c > 0 for _, c in values]
            n = sum(counted)
            value = jnp.where(n > 0, sum(jnp.where(k, s / jnp.maximum(c, 1), 0)
                                         for (s, c), k in zip(values, counted))
                              / jnp.maximum(n, 1), jnp.nan)
        else:
            value = sum(values)
        metrics[name] = value
        if name.endswith("_loss"):
            total = total + value
    metrics["loss"] = total
    return total, metrics


def init(cfg: Config, mesh=None) -> tuple[TrainStep, dict, object]:
    """(the step, the initial parameters, their optimizer state) of `cfg`, seeded by
    train.seed. On a mesh both are born sharded: no parameter or moment is ever whole on one
    device."""
    graphdef, params = sharding.init_params(
        lambda: Transformer(cfg, rngs=nnx.Rngs(cfg.train.seed)), mesh)
    step = TrainStep(cfg, graphdef, params, mesh)
    return step, params, step.init_opt_state(params)


class TrainStep:
    """The jitted training and evaluation steps of one config, with the optimizer and
    schedule they use. `mesh` None: one device, nothing sharded; else parameters and moments
    split by sharding.RULES (their layouts read off `like`, the parameters or their shapes),
    batch rows over data and fsdp. `vmapped`: parameters, optimizer states and batches
    stacked on a leading axis (one device), one step for all.

    `train(params, opt_state, batch, step)` -> (params, opt_state, metrics), donating the old
    arrays; `evaluate(params, batch)` -> {"ce"}. `compiled` is `train` compiled ahead once, so
    a loop times steps without the compile."""

    def __init__(self, cfg: Config, graphdef, like, mesh=None, *, vmapped: bool = False):
        self.cfg, self.graphdef, self.mesh, self.vmapped = cfg, graphdef, mesh, vmapped
        self.schedule = make_schedule(cfg)
        self.tx = make_optimizer(cfg)
        self._compiled = None
        t = cfg.train
        if vmapped:
            self.train = jax.jit(jax.vmap(self.update, in_axes=(0, 0, 0, None)),
                                 donate_argnums=(0, 1))
            self.evaluate = jax.jit(jax.vmap(self.eval_loss))
        elif mesh is None:
            self.train = jax.jit(self.update, donate_argnums=(0, 1))
            self.evaluate = jax.jit(self.eval_loss)
        else:
            rep = sharding.replicated(mesh)
            self.param_shardings = sharding.tree_shardings(like, mesh)
            self.opt_shardings = sharding.tree_shardings(jax.eval_shape(self.tx.init, like),
                                                         mesh)
            self.batch_shardings = sharding.batch_sharding(mesh, (t.batch_size, t.seq_len))
            self.train = jax.jit(
                self.update, donate_argnums=(0, 1),
                in_shardings=(self.param_shardings, self.opt_shardings, self.batch_shardings,
                              rep),
                out_shardings=(self.param_shardings, self.opt_shardings, rep))
            self.evaluate = jax.jit(self.eval_loss,
                                    in_shardings=(self.param_shardings, self.batch_shardings),
                                    out_shardings=rep)

    def over_seeds(self) -> TrainStep:
        """This step over seeds stacked on a leading axis (one device)."""
        if self.mesh is not None:
            raise ValueError("a vmapped step runs on one device (no mesh)")
        return TrainStep(self.cfg, self.graphdef, None, vmapped=True)

    # -- state --------------------------------------------------------------------------
    def init_opt_state(self, params):
        """The optimizer state of `params`, made in their layout on the mesh; on one
        device, where they are."""
        if self.mesh is None:
            return self.tx.init(params)
        return jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)

    def place(self, params, opt_state):
        """A restored state laid out as the step takes it (a relaid-out restore may come
        back in any layout); unchanged on one device."""
        if self.mesh is None:
            return params, opt_state
        return (jax.device_put(params, self.param_shardings),
                jax.device_put(opt_state, self.opt_shardings))

    def batch(self, batch: dict) -> dict:
        """A host batch (the same on every process) as the step's input: split by rows over
        the mesh, or left to jit on one device."""
        return batch if self.mesh is None else sharding.put(batch, self.batch_shardings)

    def on_mesh(self):
        """Trace under the mesh, so sharding.constrain in the model sees it."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def compiled(self, params, opt_state, batch, step):
        """`train` compiled ahead for these arguments' shapes, once."""
        if self._compiled is None:
            with self.on_mesh():
                self._compiled = self.train.lower(params, opt_state, batch,
                                                  jnp.int32(step)).compile()
        return self._compiled

    # -- pure functions -----------------------------------------------------------------
    def model(self, params) -> Transformer:
        return nnx.merge(self.graphdef, nnx.State(params))

    def update(self, params, opt_state, batch, step):
        """One optimizer step: (params, opt_state, metrics) with the gradient norm and the
        learning rate this update used (count == step)."""
        metrics, grads = self.loss_and_grads(params, batch, step)
        if self.mesh is not None:  # gradients split like their parameters (FSDP: reduce-scatter)
            grads = jax.lax.with_sharding_constraint(grads, self.param_shardings)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        metrics["grad_norm"] = optax.global_norm(self._trained(grads))
        metrics["lr"] = self.schedule(step)
        return optax.apply_updates(params, updates), opt_state, metrics

    def _trained(self, tree):
        """`tree` (like the parameters) without its frozen leaves (train.freeze)."""
        if not self.cfg.train.freeze:
            return tree
        keep = jax.tree.leaves(frozen(self.cfg.train.freeze, tree))
        return [x for x, f in zip(jax.tree.leaves(tree), keep) if not f]

    def loss_and_grads(self, params, batch, step):
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
            f = lambda p: loss_fn(self.model(p), batch, step)  # noqa: E731
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
                _, m = loss_fn(self.model(p), mb, step)
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

    def eval_loss(self, params, batch):
        """The held-out cross-entropy of a batch (dsattn.evaluate's forward)."""
        nll = outputs(self.model(params), batch["inputs"], batch["targets"])["nll"]
        return {"ce": weighted_mean(nll, batch.get("weights"))}
