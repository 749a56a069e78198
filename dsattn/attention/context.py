"""What layers hand down the stack, as typed immutable values: each layer takes a context
and returns the next one (`ctx.replace(...)`), never an attention result.

Both carry selections as per-query entry ids (`reads.Selection`, also importable from
here); training (`StackContext`) holds the latest full layer's entries as computed over the
whole sequence (`reads.Entries`), cached execution (`CachedContext`) its paged cache. Under
CED the decoder starts from a context holding only the encoder's output. The types come from
dsattn.attention.reads, which imports nothing of this module.
"""

from __future__ import annotations

import jax
from flax import struct

from dsattn.attention.reads import Entries, Selection  # noqa: F401  (Selection re-exported)
from dsattn.cache.paged import PagedCache


@struct.dataclass
class Stream:
    """A sequence chunk at its positions: what CED decoder layers compress (cached)."""

    x: jax.Array  # [B, T, D]
    positions: jax.Array  # [B, T]
    valid: jax.Array  # [B, T]


@struct.dataclass
class StackContext:
    """Training forward: the latest full layer's entries and search keys (`reads.Entries`),
    the latest selection over them and the hierarchical indexer's candidate pool (entry ids
    per query), and (CED decoder) the encoder's output [B, T, D]."""

    encoder_out: jax.Array | None = None
    entries: Entries | None = None
    selection: Selection | None = None
    pool: Selection | None = None


@struct.dataclass
class CachedContext:
    """Cached prefill/decode: the latest full layer's paged cache, the latest selection and
    candidate pool as entry ids, and (CED decoder) the encoder's output chunk."""

    encoder_out: Stream | None = None
    global_cache: PagedCache | None = None
    selection: Selection | None = None
    pool: Selection | None = None
