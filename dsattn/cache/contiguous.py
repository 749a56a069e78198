"""Contiguous per-row cache: slot = position, one vector per slot, stored in a cache format.

Used by the baseline families (MHA/GQA/MQA, MLA) whose cache grows with every token. Writes
scatter each row's new positions into its own slots; padded positions are dropped, so a
ragged batch never writes garbage where a later token will look.
"""

import jax.numpy as jnp

from dsattn.cache import formats


def empty(fmt: str, batch: int, max_len: int, inner: tuple, width: int, rope: int, dtype):
    """Zeroed storage for [batch, max_len, *inner] vectors of `width` dims."""
    return formats.empty(fmt, (batch, max_len) + tuple(inner), width, rope, dtype)


def write(stored: dict, fmt: str, values, positions, valid, rope: int = 0) -> dict:
    """Store values [B, T, *inner, w] at slots positions [B, T] where valid [B, T]."""
    max_len = next(iter(stored.values())).shape[1]
    slots = jnp.where(valid, positions, max_len)  # out of range -> dropped
    rows = jnp.arange(values.shape[0])[:, None]
    enc = formats.encode(fmt, values, rope)
    return {k: stored[k].at[rows, slots].set(enc[k].astype(stored[k].dtype), mode="drop")
            for k in stored}


def read(stored: dict, fmt: str, dtype):
    """All slots decoded to the compute dtype: [B, L, *inner, w]."""
    return formats.decode(fmt, stored, dtype)
