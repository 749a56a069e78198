"""What the Hadamard rotation (indexer.hadamard) buys low-bit indexer keys, on keys a trained
model makes: train a preset with full-precision keys, capture the indexer's queries, head
weights and keys on held-out text, store the keys in each low-bit format with and without
the rotation, and count how much of the full-precision top-k each still finds."""

from __future__ import annotations

import contextlib
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import config, data
from dsattn.attention import indexer
from dsattn.cache import formats
from dsattn.nn import hadamard
from dsattn.train import Trainer

KEY_FORMATS = ("fp8_ue8m0", "fp4_ue8m0", "fp4_e4m3")
OUTLIER = 8.0  # the stress case: the keys' own largest channel made this many times larger


@contextlib.contextmanager
def captured_scoring():
    """Inside: every training-forward call of the indexer's running top-k records its
    queries [B,T,n,d], head weights [B,T,n], keys [B,S,d] and which keys each query may
    pick [B,T,S] (as numpy, via a host callback, so it works under jit and scan)."""
    seen, original = [], indexer.top_k

    def record(q, w, keys, stored, n_visible):
        vis = np.asarray(stored)[:, None, :] & (np.arange(keys.shape[1]) < np.asarray(
            n_visible)[..., None])
        seen.append(tuple(np.asarray(a, np.float32) for a in (q, w, keys)) + (vis,))

    def top_k(q, w, keys, stored, n_visible, *args, **kwargs):
        jax.debug.callback(record, q, w, keys, stored, n_visible)
        return original(q, w, keys, stored, n_visible, *args, **kwargs)

    indexer.top_k = top_k
    try:
        yield seen
    finally:
        indexer.top_k = original


def indexer_inputs(model, tokens) -> list[tuple]:
    """(q, w, keys, visible) of every indexed layer in one forward of `tokens`."""
    with captured_scoring() as seen:
        graphdef, state = nnx.split(model)
        jax.block_until_ready(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))
        jax.effects_barrier()
    return list(seen)


def topk_agreement(q, w, keys, visible, k: int, fmt: str | None, rotate: bool) -> float:
    """Mean share of the full-precision top-k (over queries with more than k visible keys)
    that the scores against keys stored in `fmt` (None: full precision) also pick, with the
    queries and keys rotated first when `rotate`."""
    full = np.asarray(indexer.scores(q, w, keys))
    if rotate:
        q, keys = hadamard.rotate(jnp.asarray(q)), hadamard.rotate(jnp.asarray(keys))
    stored = keys if fmt is None else formats.quantize_dequantize(fmt, jnp.asarray(keys))
    low = np.asarray(indexer.scores(q, w, stored))
    rows = visible.sum(-1) > k
    full, low, vis = full[rows], low[rows], visible[rows]
    pick = lambda s: np.argsort(-np.where(vis, s, -np.inf), -1, kind="stable")[:, :k]  # noqa
    a, b = pick(full), pick(low)
    return float(np.mean([len(set(x) & set(y)) / k for x, y in zip(a, b)]))


def channel_peak(keys) -> float:
    """How far the largest channel stands out: max over channels of RMS / median RMS."""
    rms = np.sqrt(np.mean(np.reshape(keys, (-1, keys.shape[-1])) ** 2, axis=0))
    return float(rms.max() / np.median(rms))


def with_outlier(q, w, keys, visible, factor: float = OUTLIER):
    """The same captured layer with its keys' largest-RMS channel scaled by `factor`."""
    keys = np.array(keys)
    keys[..., np.argmax(np.mean(keys.reshape(-1, keys.shape[-1]) ** 2, 0))] *= factor
    return q, w, keys, visible


def measure(config_dir, presets, steps: int, *overrides: str, log=print) -> list[dict]:
    """Per preset: train it `steps` steps (full-precision keys), capture its indexers on one
    held-out batch, and per key format the top-k agreement with and without rotation."""
    rows = []
    for name in presets:
        cfg = config.load(os.path.join(os.fspath(config_dir), f"{name}.yaml"),
                          [*overrides, f"train.steps={steps}", "cache.key_format=native",
                           "model.dtype=float32"])
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(cfg, run_dir, quiet=True)
            trainer.run()
            batch = data.batch_at(trainer.corpus.val, 0, cfg.train.batch_size,
                                  cfg.train.seq_len, cfg.train.seed)
            layers = indexer_inputs(trainer.model(), jnp.asarray(batch["inputs"]))
        k = cfg.attention.top_k
        row = {"preset": name, "steps": steps, "top_k": k, "layers": len(layers),
               "channel_peak": float(np.mean([channel_peak(c[2]) for c in layers])),
               "channel_peak_rotated": float(np.mean(
                   [channel_peak(np.asarray(hadamard.rotate(jnp.asarray(c[2]))))
                    for c in layers]))}
        for fmt in KEY_FORMATS:
            for rotate in (False, True):
                row[f"{fmt}{'_rotated' if rotate else ''}"] = float(np.mean(
                    [topk_agreement(*c, k, fmt, rotate) for c in layers]))
        for rotate in (False, True):
            row[f"fp4_ue8m0_x{OUTLIER:g}{'_rotated' if rotate else ''}"] = float(np.mean(
                [topk_agreement(*with_outlier(*c), k, "fp4_ue8m0", rotate) for c in layers]))
        rows.append(row)
        log(table([row]).splitlines()[-1])
    return rows


def table(rows: list[dict]) -> str:
    """Per preset: the keys' channel peak (max channel RMS / median) before and after the
    rotation, then per format the share of the full-precision top-k kept, unrotated and
    rotated (+H); the last pair with the keys' largest channel made OUTLIER times larger."""
    cols = [*KEY_FORMATS, f"fp4_ue8m0_x{OUTLIER:g}"]
    head = (f"{'preset':<7}{'steps':>6}{'top_k':>6}{'peak':>7}{'+H':>6}"
            + "".join(f"{f:>16}{'+H':>7}" for f in cols))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['preset']:<7}{r['steps']:>6}{r['top_k']:>6}{r['channel_peak']:>7.2f}"
                     f"{r['channel_peak_rotated']:>6.2f}"
                     + "".join(f"{r[f]:>16.3f}{r[f + '_rotated']:>7.3f}" for f in cols))
    return "\n".join(lines)
