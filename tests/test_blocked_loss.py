"""The training loss unembeds a block of positions at a time (trainstep.blocked_token_nll):
its loss and gradients equal the whole-sequence cross-entropy's, and its compiled training
step holds about [B, T, V] float32 logits fewer in its temporaries."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dsattn import trainstep
from dsattn.model import Transformer
from tests.helpers import preset, tiny_model


def _reference_loss(model, batch):
    """The cross-entropy of the whole [B, T, V] logits, written out here (optax on the
    forward's logits), plus the layers' auxiliary losses as loss_fn adds them."""
    logits, auxes = model.forward(batch["inputs"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    w = batch["weights"]
    total = (nll * w).sum() / w.sum()
    for aux in auxes:
        total = total + sum(v for k, v in aux.items() if k.endswith("_loss"))
    return total


def test_blocked_loss_and_gradients_equal_the_whole_sequence_cross_entropy():
    # T = 40 is 2.5 blocks of 16, so the last block is padded; weights make padding or a
    # lost position visible.
    model = tiny_model("mha", "model.n_layers=1")
    rng = np.random.RandomState(0)
    batch = {"inputs": jnp.asarray(rng.randint(0, 256, (2, 40))),
             "targets": jnp.asarray(rng.randint(0, 256, (2, 40))),
             "weights": jnp.asarray(rng.rand(2, 40))}
    graphdef, params = nnx.split(model)

    def blocked(p):
        return trainstep.loss_fn(nnx.merge(graphdef, p), batch, loss_block=16)[0]

    def reference(p):
        return _reference_loss(nnx.merge(graphdef, p), batch)

    got, got_g = jax.jit(jax.value_and_grad(blocked))(params)
    want, want_g = jax.jit(jax.value_and_grad(reference))(params)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, want, rtol=1e-12)
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_g)) > 1e-3  # not all 0


def _step_temp_bytes(cfg, loss, batch: int, seq: int) -> int:
    """Temporaries of the compiled loss-and-gradient step (shapes only)."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    weights = jax.ShapeDtypeStruct((batch, seq), jnp.float32)
    step = jax.jit(jax.grad(lambda p, b: loss(nnx.merge(graphdef, p), b)))
    mem = step.lower(params, {"inputs": tokens, "targets": tokens, "weights": weights}
                     ).compile().memory_analysis()
    return int(mem.temp_size_in_bytes)


def test_blocked_loss_step_holds_no_whole_logits():
    # A size where the logits dominate: one small layer, a 16K vocabulary, 2 x 512 tokens:
    # [2, 512, 16384] float32 logits are 64 MiB.
    b, t, v = 2, 512, 16384
    cfg = preset("mha", "model.n_layers=1", f"model.vocab_size={v}", "model.d_model=64",
                 "model.ffn_hidden=128", "attention.head_dim=16")
    whole = _step_temp_bytes(cfg, _reference_loss, b, t)
    blocked = _step_temp_bytes(
        cfg, lambda m, bt: trainstep.loss_fn(m, bt, loss_block=64)[0], b, t)
    logits = b * t * v * 4
    assert whole - blocked >= 0.75 * logits, (whole, blocked, logits)
