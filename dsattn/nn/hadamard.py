"""The orthonormal Hadamard rotation that goes before low-bit indexer keys.

DeepSeek's V3.2 and V4 indexers rotate queries and keys by a normalised Hadamard matrix
before quantizing them to FP8/FP4. The rotation is orthogonal, so q·k (the score) is unchanged,
while it spreads a channel's outlier over all channels: a block's scale then follows the
vector's RMS rather than its largest channel, and the other channels keep their bits.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsattn.errors import ConfigError


@functools.lru_cache(maxsize=None)
def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def matrix(n: int, dtype=jnp.float32) -> jax.Array:
    """H_n / sqrt(n) by Sylvester's construction (scipy.linalg.hadamard's order): symmetric,
    orthonormal, entries ±n^-1/2. `n` must be a power of two."""
    if n < 1 or n & (n - 1):
        raise ConfigError(f"a Hadamard rotation needs a power-of-two width, got {n}")
    return jnp.asarray(_sylvester(n), dtype)


def rotate(x: jax.Array) -> jax.Array:
    """x · H over the last axis (H is symmetric, so this is also H · x per vector)."""
    h = matrix(x.shape[-1], x.dtype)
    return jnp.einsum("...d,de->...e", x, h, precision=jax.lax.Precision.HIGHEST)
