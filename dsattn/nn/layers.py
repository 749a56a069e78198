"""Dense projections, the SwiGLU feed-forward block and token embeddings."""

import jax
from flax import nnx


def dense(din: int, dout: int, rngs: nnx.Rngs, dtype, std: float = 0.02):
    """A bias-free linear layer with a truncated-normal-free simple normal init."""
    return nnx.Linear(din, dout, use_bias=False, dtype=dtype, param_dtype=dtype,
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
        self.embed = nnx.Embed(vocab, d_model, dtype=dtype, param_dtype=dtype,
                               embedding_init=nnx.initializers.normal(std), rngs=rngs)
        self.head = None if tied else dense(d_model, vocab, rngs, dtype, std)

    def __call__(self, tokens):
        return self.embed(tokens)

    def logits(self, h):
        if self.head is None:
            return self.embed.attend(h)
        return self.head(h)
