"""Dense projections, the SwiGLU feed-forward block and token embeddings.

`dtype` is the compute dtype, or a `Precision` (compute and parameter dtypes); parameters are
created in the parameter dtype (float32 by default, never narrower than the compute dtype)
and cast to the compute dtype where they are used (Flax's dtype / param_dtype)."""

import jax
from flax import nnx

from dsattn.nn.precision import Precision


def dense(din: int, dout: int, rngs: nnx.Rngs, dtype, std: float = 0.02, *,
          param_dtype=None):
    """A bias-free linear layer with a truncated-normal-free simple normal init."""
    p = Precision.make(dtype, param_dtype)
    return nnx.Linear(din, dout, use_bias=False, dtype=p.dtype, param_dtype=p.param_dtype,
                      kernel_init=nnx.initializers.normal(std), rngs=rngs)


class SwiGLU(nnx.Module):
    def __init__(self, d_model: int, hidden: int, rngs: nnx.Rngs, dtype, std: float = 0.02):
        self.w_gate = dense(d_model, hidden, rngs, dtype, std)
        self.w_up = dense(d_model, hidden, rngs, dtype, std)
        self.w_down = dense(hidden, d_model, rngs, dtype, std)

    def __call__(self, x):
        return self.w_down(jax.nn.silu(self.w_gate(x)) * self.w_up(x))


class Embedding(nnx.Module):
    """Token embedding; with `tied`, the output projection is its transpose."""

    def __init__(self, vocab: int, d_model: int, rngs: nnx.Rngs, dtype, tied: bool,
                 std: float = 0.02):
        p = Precision.make(dtype)
        self.embed = nnx.Embed(vocab, d_model, dtype=p.dtype, param_dtype=p.param_dtype,
                               embedding_init=nnx.initializers.normal(std), rngs=rngs)
        self.head = None if tied else dense(d_model, vocab, rngs, p, std)

    def __call__(self, tokens):
        return self.embed(tokens)

    def logits(self, h):
        if self.head is None:
            return self.embed.attend(h)
        return self.head(h)
