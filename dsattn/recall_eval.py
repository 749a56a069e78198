"""A model scored on recall probes (dsattn.recall): its teacher-forced predictions through the
training forward (`model_predictions`, `accuracy`) or through the decode cache as deployed
(`cache_predictions`, `cache_accuracy`). dsattn.recall makes the probes and scores predictions
(numpy); running a model is this module's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import generate
from dsattn.evaluate import forward
from dsattn.recall import Probes, score


def model_predictions(model, tokens: np.ndarray, batch: int = 32) -> np.ndarray:
    """Teacher-forced argmax of a dsattn Transformer, aligned so pred[:, t] predicts t."""
    fwd, state = forward(model), nnx.state(model)
    out, batch = np.zeros_like(tokens), min(batch, len(tokens))
    for i in range(0, len(tokens), batch):
        chunk = tokens[i:i + batch]
        pad = batch - len(chunk)  # one shape: one compile
        x = np.concatenate([chunk, np.zeros((pad, chunk.shape[1]), chunk.dtype)])
        out[i:i + len(chunk), 1:] = np.asarray(fwd(state, jnp.asarray(x))["argmax"])[
            :len(chunk), :-1]
    return out


def accuracy(model, p: Probes) -> dict[int, float]:
    """The model's recall accuracy per distance on probes `p` (its training forward)."""
    return score(model_predictions(model, p.tokens), p)


def cache_predictions(model, p: Probes, batch: int = 32) -> np.ndarray:
    """Predictions at the answer positions as deployed: each row prefilled into a decode cache
    (its stored vectors in the cache formats) up to its first answer, the rest decoded
    teacher-forced, one decode step a token. Other positions are left 0."""
    pos = p.answer_pos[0]
    if not (p.answer_pos == pos).all():
        raise ValueError("cache_predictions: every probe row must answer at the same positions")
    eng = generate.Engine(model)
    out, batch = np.zeros_like(p.tokens), min(batch, len(p.tokens))
    for i in range(0, len(p.tokens), batch):
        chunk = p.tokens[i:i + batch]
        rows = np.concatenate([chunk, np.zeros((batch - len(chunk),) + chunk.shape[1:],
                                               chunk.dtype)])  # one shape: one compile
        cache = eng.init_cache(batch, p.tokens.shape[1])
        logits, cache = eng.prefill(rows[:, :pos[0]], None, cache)
        out[i:i + len(chunk), pos[0]] = np.asarray(logits.argmax(-1))[:len(chunk)]
        for prev, at in zip(pos[:-1], pos[1:]):
            for t in range(prev, at):  # teacher forcing: the true tokens up to the answer
                logits, cache = eng.decode_step(rows[:, t], cache)
            out[i:i + len(chunk), at] = np.asarray(logits.argmax(-1))[:len(chunk)]
        generate.check_cache(cache)
    return out


def cache_accuracy(model, p: Probes) -> dict[int, float]:
    """Recall accuracy per distance read through the decode cache (cache_predictions): what
    a deployed model's cache formats keep, whether or not it trained with fake quant."""
    return score(cache_predictions(model, p), p)


__all__ = ["model_predictions", "accuracy", "cache_predictions", "cache_accuracy"]
