"""Helpers shared by the test modules: import them from here (``from tests.helpers import
...``), never from conftest or another test module.

tests/conftest.py sets the environment these rely on before jax is imported (XLA_FLAGS,
jax_enable_x64: ``tiny_model`` builds float64 models).
"""

import os
import subprocess
import sys
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import config, generate, train
from dsattn.model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONFIGS = os.path.join(ROOT, "configs", "tiny")


def run_script(name: str, *args, cwd=ROOT, timeout: float = 300):
    """scripts/<name>.py as a user runs it: a subprocess (inheriting conftest's XLA_FLAGS),
    output captured."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", f"{name}.py"),
                           *map(str, args)], capture_output=True, cwd=cwd, timeout=timeout)


def preset(name: str, *overrides: str):
    return config.load(os.path.join(TINY_CONFIGS, f"{name}.yaml"), list(overrides))


@lru_cache(maxsize=None)
def tiny_model(name: str, *overrides: str, seed: int = 0):
    """A float64 model of a tiny preset (cached: building one costs seconds on CPU)."""
    cfg = preset(name, "model.dtype=float64", *overrides)
    return Transformer(cfg, rngs=nnx.Rngs(seed))


_forward_jit = jax.jit(lambda graphdef, state, tokens: nnx.merge(graphdef, state)(tokens),
                       static_argnums=0)


def forward(model, tokens):
    """The teacher-forced forward, jitted (eager dispatch is ~6x slower for these models)."""
    graphdef, state = nnx.split(model)
    return _forward_jit(graphdef, state, jnp.asarray(tokens))


@partial(jax.jit, static_argnums=0)
def _loss_and_grads_jit(graphdef, params, batch, step):
    def f(p):
        return train.loss_fn(nnx.merge(graphdef, p), batch, step)

    return jax.value_and_grad(f, has_aux=True)(params)


def loss_and_grads(model, batch: dict, step=None):
    """(train.loss_fn's metrics, gradients w.r.t. the model's state) of one batch, jitted
    once per model structure, batch shape and kind of step (None or an integer: a traced
    one, so two steps share the program), across tests."""
    graphdef, params = nnx.split(model)
    step = None if step is None else jnp.asarray(step, jnp.int32)
    (_, metrics), grads = _loss_and_grads_jit(graphdef, params, batch, step)
    return metrics, grads


def check_decode_matches_forward(model, lengths, n_decode, max_len, seed=0, atol=1e-9):
    """Prefill rows of different lengths, then decode the true next tokens one by one."""
    b = len(lengths)
    total = max(lengths) + n_decode
    vocab = model.cfg.model.vocab_size
    toks = np.random.RandomState(seed).randint(0, vocab, (b, total))
    full = np.asarray(forward(model, toks))
    lengths = np.asarray(lengths)
    cache = generate.init_cache(model, b, max_len)
    logits, cache = generate.prefill(model, toks[:, : lengths.max()], lengths, cache)
    got = [np.asarray(logits)]
    want = [full[np.arange(b), lengths - 1]]
    for s in range(n_decode):
        logits, cache = generate.decode_step(model, toks[np.arange(b), lengths + s], cache)
        got.append(np.asarray(logits))
        want.append(full[np.arange(b), lengths + s])
    np.testing.assert_allclose(np.stack(got), np.stack(want), atol=atol, rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(cache.pos), lengths + n_decode)
    return cache


def check_two_chunk_prefill(model, first, second: int, max_len: int, seed: int = 1):
    """Prefill rows of lengths `first`, then `second` more tokens per row in one chunk (each
    row continuing at its own position); the last logits must equal the forward's."""
    first = np.asarray(first)
    toks = np.random.RandomState(seed).randint(0, 256, (len(first), first.max() + second))
    full = np.asarray(forward(model, toks))
    cache = generate.init_cache(model, len(first), max_len)
    _, cache = generate.prefill(model, toks[:, : first.max()], first, cache)
    chunk = np.stack([row[n: n + second] for row, n in zip(toks, first)])
    logits, cache = generate.prefill(model, chunk, [second] * len(first), cache)
    want = full[np.arange(len(first)), first + second - 1]
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-9)


def once_per_session(tmp_path_factory, name: str, make) -> dict:
    """make()'s JSON-able result, made once per test session: pytest-xdist workers share the
    session's base temp directory, and a lock lets the first worker make it while the others
    wait for its file."""
    import fcntl
    import json

    shared = tmp_path_factory.getbasetemp()  # this session's; under xdist, this worker's
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's, shared by its workers
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / f"{name}.json"
        if not done.exists():
            done.write_text(json.dumps(make(shared)))
    return json.loads(done.read_text())

