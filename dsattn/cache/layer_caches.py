"""What one layer keeps between cached calls, by attention family: typed values of cache
containers (dsattn/cache/protocol.py) and, for the V4 family, its compressors' streaming
state. A decode state holds one per layer (dsattn.scan lays out a scanned group's)."""

from __future__ import annotations

from typing import Union

from flax import struct

from dsattn.cache.compressor_state import PoolState
from dsattn.cache.contiguous import Contiguous
from dsattn.cache.paged import PagedCache
from dsattn.cache.ring import Ring


@struct.dataclass
class MHACache:
    """MHA/GQA/MQA: every token's keys and values, head-major."""

    k: Contiguous
    v: Contiguous


@struct.dataclass
class MLACache:
    """MLA: every token's compressed latent (with its RoPE part)."""

    latent: Contiguous


@struct.dataclass
class DSACache:
    """DSA: every token's latent and indexer key, in pages."""

    pages: PagedCache


@struct.dataclass
class V4Cache:
    """A V4-family layer: its window (a ring); a layer that owns entries also its paged
    global cache (entries, and search keys if its kind scans them) and its compressors'
    open spans (the key compressor's too for CSA)."""

    ring: Ring
    pages: PagedCache | None = None
    compressor: PoolState | None = None
    key_compressor: PoolState | None = None


LayerCache = Union[MHACache, MLACache, DSACache, V4Cache]
