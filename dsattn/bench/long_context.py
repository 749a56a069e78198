"""Long-context training cost: the training step's temporary memory from the compiled
program's own memory analysis (shapes only, nothing allocated: exact and repeatable), and
measured tokens/s, against the sequence length."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsattn import config
from dsattn.model import Transformer
from dsattn.train import loss_fn, make_optimizer


def _step_fn(cfg):
    """A training step (loss, gradients, optimizer update) over (params, opt_state, batch)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    tx = make_optimizer(cfg)

    def step(params, opt_state, batch, i):
        def f(p):
            return loss_fn(nnx.merge(graphdef, p), batch, i)[0]

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, tx


def _abstract(cfg, seq_len: int, batch: int):
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(model)
    step, tx = _step_fn(cfg)
    opt = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    return step, params, opt, {"inputs": tokens, "targets": tokens}


def at_length(preset, seq_len: int, *overrides: str):
    """A preset's config trained at `seq_len` (max_seq_len raised to it)."""
    return config.load(preset, [*overrides, f"model.max_seq_len={seq_len}",
                                f"train.seq_len={seq_len}"])


def train_step_memory(cfg, seq_len: int, batch: int = 1) -> dict:
    """The compiled training step's memory analysis at `seq_len` (bytes)."""
    step, params, opt, data = _abstract(cfg, seq_len, batch)
    compiled = jax.jit(step).lower(params, opt, data,
                                   jax.ShapeDtypeStruct((), jnp.int32)).compile()
    mem = compiled.memory_analysis()
    return {"temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes)}
