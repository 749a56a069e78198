"""Held-out loss of a model at chosen context lengths (scripts/eval.py).

The loss at sequence length T is the mean next-token cross-entropy over fixed validation
batches: `corpus.eval_batches(n_batches, batch_size, T, seed)` (weighted where the corpus has
loss weights), the same windows for every checkpoint, so losses are comparable over a run and
across runs. At the run's own
train.seq_len, eval_batches and batch_size (and seed = train.seed) this is exactly the
validation loss training logs. With `max_tokens` instead, the split itself: consecutive
windows that score each of its tokens once, up to max_tokens of them (data.split_windows).
Every loss comes with its standard error over the windows scored (each row of a batch one
sample). Lengths beyond the training length measure extrapolation.

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


def loss_and_se(model, batches, done=None) -> tuple[float, float]:
    """(mean next-token cross-entropy in nats per token, its standard error) of `model` over
    `batches` ({"inputs", "targets"} [B, T] each), one compiled forward per batch shape.
    Batches with "weights" (a corpus with loss weights, e.g. recall format=mqar) give the
    weighted mean, as the training loss does. The standard error is over the rows (windows),
    a ratio estimator's: sqrt(n/(n-1) sum (s_i - mean w_i)^2) / sum w_i, with s_i and w_i a
    row's summed loss and weight (std / sqrt(n) of the rows' means when every w_i is equal);
    NaN with one row. `done()`, if given, is called after each batch."""
    fwd, state = forward(model), nnx.state(model)
    sums, weights = [], []
    for b in batches:
        nll = np.asarray(fwd(state, jnp.asarray(b["inputs"]), jnp.asarray(b["targets"]))["nll"],
                         np.float64)
        w = b.get("weights")
        w = np.ones_like(nll) if w is None else np.asarray(w, np.float64)
        sums.append((nll * w).sum(-1))
        weights.append(w.sum(-1))
        if done is not None:
            done()
    s, w = np.concatenate(sums), np.concatenate(weights)
    mean = float(s.sum() / w.sum())
    n = len(s)
    se = math.sqrt(n / (n - 1) * ((s - mean * w) ** 2).sum()) / w.sum() if n > 1 else math.nan
    return mean, float(se)


def mean_loss(model, batches, done=None) -> float:
    """The mean of `loss_and_se`."""
    return loss_and_se(model, batches, done)[0]


def check_lengths(corpus, seq_lens) -> None:
    """Raise InputError unless every length fits the validation split (seq_len + 1 tokens)."""
    for n in seq_lens:
        if n < 1 or len(corpus.val) < n + 1:
            raise InputError(f"sequence length {n}: the validation split has "
                             f"{len(corpus.val)} tokens, need at least seq_len + 1")


def evaluate(model, cfg, seq_lens, *, n_batches: int | None = None,
             batch_size: int | None = None, corpus=None, quiet: bool = True,
             progress_every: int | None = None, max_tokens: int | None = None) -> list[dict]:
    """One row per sequence length: nats and bits per token of the validation split of
    cfg.data.source (or the given corpus), each with its standard error over the windows
    scored (`loss_and_se`). Batches default to the run's validation setting
    (train.eval_batches of train.batch_size); `max_tokens` (without `n_batches`) scores the
    split itself instead, in consecutive windows, at most that many tokens (0: all of it).
    Unless `quiet`, shows progress over all the batches (dsattn.progress)."""
    t = cfg.train
    batch_size = batch_size or t.batch_size
    corpus = corpus or data.load_corpus(cfg.data, cfg.model.vocab_size)
    per_token = baseline.bytes_per_token(cfg.data.source)
    check_lengths(corpus, seq_lens)
    if n_batches is None and max_tokens is not None:
        plans = [corpus.val_windows(n, batch_size, max_tokens) for n in seq_lens]
    else:
        n_batches = n_batches or t.eval_batches
        plans = [(n_batches * batch_size, corpus.eval_batches(n_batches, batch_size, n,
                                                              seed=t.seed)) for n in seq_lens]
    total = sum(-(-k // min(batch_size, k)) for k, _ in plans)
    bar = progress.Progress(total, desc=f"eval {cfg.name}", unit="batch",
                            every=progress_every, quiet=quiet)
    rows = []
    for n, (k, batches) in zip(seq_lens, plans):
        nats, se = loss_and_se(model, batches, lambda: bar.update(fields={"seq_len": n}))
        bpb = baseline.bits_per_byte(nats, per_token)
        rows.append({"seq_len": n, "tokens": k * n, "windows": k,
                     "nats_per_token": nats, "nats_per_token_se": se,
                     "bits_per_token": nats / math.log(2),
                     "bits_per_byte": bpb,
                     "bits_per_byte_se": baseline.bits_per_byte(se, per_token),
                     "trained_seq_len": t.seq_len})
    bar.close()
    return rows


__all__ = ["evaluate", "check_lengths", "mean_loss", "loss_and_se", "outputs", "forward",
           "token_nll", "weighted_mean"]
