"""What layers hand down the stack, as typed immutable values: each layer takes a context
and returns the next one (`ctx.replace(...)`), never an attention result.

Both carry selections as per-query entry ids (`Selection`); training (`StackContext`) holds
the latest full layer's entries as computed over the whole sequence (`reads.Entries`), cached
execution (`CachedContext`) its paged cache. Under CED the decoder starts from a context
holding only the encoder's output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import struct

from dsattn.cache.paged import PagedCache

if TYPE_CHECKING:  # reads imports this module
    from dsattn.attention.reads import Entries


@struct.dataclass
class Selection:
    """Per-query entry ids [B, T, k] and which of them are real picks; `dense` (a scalar
    bool, training only) true while the dense warm-up reads every complete entry instead."""

    idx: jax.Array
    ok: jax.Array
    dense: jax.Array | None = None


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
