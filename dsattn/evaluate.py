"""Held-out loss of a model at chosen context lengths (scripts/eval.py).

The loss at sequence length T is the mean next-token cross-entropy over fixed validation
batches: `corpus.eval_batches(n_batches, batch_size, T, seed)` (weighted where the corpus has
loss weights), the same windows for every checkpoint, so losses are comparable over a run and
across runs. At the run's own
train.seq_len, eval_batches and batch_size (and seed = train.seed) this is exactly the
validation loss training logs. Lengths beyond the training length measure extrapolation.

Losses are in nats per token, bits per token (nats / ln 2) and bits per byte (dsattn.baseline:
a byte-level token is a byte; a token directory records its text bytes per token).

`outputs` is the one evaluation forward: the training loop's validation (dsattn.train),
`mean_loss` here and recall's predictions (dsattn.recall_eval) all read it, `forward`
compiles it once per network config.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsattn import baseline, data, progress
from dsattn.errors import InputError


def token_nll(logits, targets):
    """Next-token cross-entropy per position (nats), computed in at least float32."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), targets)


def weighted_mean(nll, weights=None):
    """The mean of nll [B, T], or its weighted mean (a corpus with loss weights)."""
    if weights is None:
        return nll.mean()
    w = weights.astype(nll.dtype)
    return (nll * w).sum() / jnp.maximum(w.sum(), 1e-6)


def outputs(model, inputs, targets=None) -> dict:
    """What held-out measures read from one teacher-forced forward of inputs [B, T]: each
    position's prediction ("argmax") and, given targets, its cross-entropy ("nll", nats)."""
    logits = model(inputs)
    out = {"argmax": jnp.argmax(logits, -1)}
    if targets is not None:
        out["nll"] = token_nll(logits, targets)
    return out


def forward(model):
    """`outputs` jitted for models of `model`'s network config: f(state, inputs, targets=None)
    with state = nnx.state(model). Models of one config (a sweep's seeds) share the compiled
    program."""
    graphdef = nnx.graphdef(model)
    c = model.cfg  # the sections that define the network (train.seed etc. do not)
    key = (c.model, c.attention, c.indexer, c.cache)
    if key not in _FORWARDS:
        _FORWARDS[key] = jax.jit(lambda s, x, y=None: outputs(nnx.merge(graphdef, s), x, y))
    return _FORWARDS[key]


_FORWARDS: dict = {}


def mean_loss(model, batches, done=None) -> float:
    """Mean next-token cross-entropy (nats per token) of `model` over `batches`
    ({"inputs", "targets"} [B, T] each), one compiled forward per batch shape. Batches with
    "weights" (a corpus with loss weights, e.g. recall format=mqar) give the weighted mean,
    as the training loss does. `done()`, if given, is called after each batch."""
    fwd, state = forward(model), nnx.state(model)
    total, count = 0.0, 0.0
    for b in batches:
        nll = np.asarray(fwd(state, jnp.asarray(b["inputs"]), jnp.asarray(b["targets"]))["nll"],
                         np.float64)
        w = b.get("weights")
        total += float(nll.sum() if w is None else (nll * w).sum())
        count += b["targets"].size if w is None else float(w.sum())
        if done is not None:
            done()
    return total / count


def check_lengths(corpus, seq_lens) -> None:
    """Raise InputError unless every length fits the validation split (seq_len + 1 tokens)."""
    for n in seq_lens:
        if n < 1 or len(corpus.val) < n + 1:
            raise InputError(f"sequence length {n}: the validation split has "
                             f"{len(corpus.val)} tokens, need at least seq_len + 1")


def evaluate(model, cfg, seq_lens, *, n_batches: int | None = None,
             batch_size: int | None = None, corpus=None, quiet: bool = True,
             progress_every: int | None = None) -> list[dict]:
    """One row per sequence length: nats and bits per token of the validation split of
    cfg.data.source (or the given corpus). Batches default to the run's validation setting
    (train.eval_batches of train.batch_size). Unless `quiet`, shows progress over all the
    batches (dsattn.progress)."""
    t = cfg.train
    n_batches = n_batches or t.eval_batches
    batch_size = batch_size or t.batch_size
    corpus = corpus or data.load_corpus(cfg.data, cfg.model.vocab_size)
    per_token = baseline.bytes_per_token(cfg.data.source)
    check_lengths(corpus, seq_lens)
    bar = progress.Progress(len(seq_lens) * n_batches, desc=f"eval {cfg.name}", unit="batch",
                            every=progress_every, quiet=quiet)
    rows = []
    for n in seq_lens:
        batches = corpus.eval_batches(n_batches, batch_size, n, seed=t.seed)
        nats = mean_loss(model, batches, lambda: bar.update(fields={"seq_len": n}))
        bits = nats / math.log(2)
        rows.append({"seq_len": n, "tokens": n_batches * batch_size * n,
                     "nats_per_token": nats, "bits_per_token": bits,
                     "bits_per_byte": baseline.bits_per_byte(nats, per_token),
                     "trained_seq_len": t.seq_len})
    bar.close()
    return rows


__all__ = ["evaluate", "check_lengths", "mean_loss", "outputs", "forward",
           "token_nll", "weighted_mean"]
