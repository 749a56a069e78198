"""Which cached prefixes exist and which one a prompt can reuse (docs/prefix_caching.md).

Host-side only (no jax programs). A prompt is cut into blocks of `block_size(cfg)` tokens,
B = lcm(cache.page_size, every layer's stride): whole pages of every stride-1 paged layer
and whole entries of every compressed one, so no compressor has an open span at a block
boundary (MHA and MLA, without pages, take a page's worth of tokens too). Nodes are
published at multiples of `stride(cfg, max_chunk)`, S = lcm(B, max_chunk) raised to a
multiple of itself >= attention.window for V4-family configs, so a node's ring snapshot
holds only positions of its own S tokens.

Block k's digest chains every block before it: h_0 = H(fingerprint), h_k = H(h_{k-1} ||
int32 little-endian tokens of block k), H = 16-byte blake2b. The fingerprint covers all
that changes cache contents (the config's model keys, plus what the caller adds: weights,
weights dtype, replay length R, B, S), so other weights or another R never share a digest.

`PrefixIndex` maps digests to `Node`s. A node keeps its prefix's tokens and a hit compares
them (a digest collision is a miss, never wrong entries), is self-sufficient (any node may
be evicted whatever its ancestors or descendants), PENDING while a row computes it and
READY once published. Only READY nodes are matched; a deeper PENDING one is reported, so a
scheduler may wait for it. Eviction takes unpinned READY nodes, least recently used first.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import json
import math
from typing import Any, Sequence

import numpy as np

from dsattn import config, plan

DIGEST_SIZE = 16  # bytes of every blake2b digest here


# ------------------------------------------------------------------------- blocks, stride
def block_size(cfg) -> int:
    """B = lcm(cache.page_size, every layer's stride): a page of every stride-1 layer and
    whole entries of every compressed layer end at each multiple of B."""
    return math.lcm(cfg.cache.page_size, *(s.stride for s in plan.resolve(cfg)))


def stride(cfg, max_chunk: int) -> int:
    """S = lcm(B, max_chunk), for V4-family configs raised to the least multiple of itself
    that is >= attention.window (a ring snapshot at a multiple of S then holds only
    positions after the previous multiple). Nodes are published at multiples of S."""
    if isinstance(max_chunk, bool) or not isinstance(max_chunk, int) or max_chunk < 1:
        raise ValueError(f"stride: max_chunk must be an int >= 1, got {max_chunk!r}")
    s = math.lcm(block_size(cfg), max_chunk)
    if any(spec.kind.window for spec in plan.resolve(cfg)):
        s *= -(-cfg.attention.window // s)
    return s


def reusable_limit(prompt_len: int, replay: int | None) -> int:
    """The deepest prefix end a request of `prompt_len` tokens may reuse: prompt_len - R
    under bounded replay R (the decoder's ring past the replay start depends on the prompt's
    length, not on the prefix), else prompt_len - 1 (one token is always prefilled, for the
    first draw's logits). 0 (nothing) for a prompt no longer than R."""
    if prompt_len < 1:
        raise ValueError(f"reusable_limit: prompt_len must be >= 1, got {prompt_len}")
    if replay is None:
        return prompt_len - 1
    if replay < 1:
        raise ValueError(f"reusable_limit: replay must be None or >= 1, got {replay}")
    return max(prompt_len - replay, 0)


# --------------------------------------------------------------------------------- hashes
def _json_default(value):
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, np.generic):
        return value.item()
    raise ValueError(f"fingerprint: {type(value).__name__} value {value!r} is not "
                     f"JSON-serialisable (use str, int, float, bool, None, bytes, lists, dicts)")


def fingerprint(cfg, extra: dict | None = None) -> bytes:
    """A 16-byte blake2b digest of the values of config.keys_of(Kind.MODEL) and `extra`
    (e.g. weights identity, weights dtype, replay R, B, S), as canonical JSON."""
    d = cfg.to_dict()
    model = {f"{sec}.{key}": d[sec][key] for sec, key in config.keys_of(config.Kind.MODEL)}
    text = json.dumps({"model": model, "extra": extra or {}}, sort_keys=True,
                      separators=(",", ":"), default=_json_default, allow_nan=True)
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).digest()


def _int32(tokens, what: str) -> np.ndarray:
    a = np.asarray(tokens)
    if a.ndim != 1:
        raise ValueError(f"{what}: tokens must be one-dimensional, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{what}: tokens must be integers, got dtype {a.dtype}")
    out = a.astype("<i4")
    if not np.array_equal(out, a):
        raise ValueError(f"{what}: tokens do not fit in int32")
    return out


def block_digests(fp: bytes, tokens, block: int) -> list[bytes]:
    """[h_1, ..., h_n]: one chained 16-byte digest per full block of `tokens` (h_k covers
    tokens [0, k * block)); h_0 = H(fp), h_k = H(h_{k-1} || int32 LE tokens of block k)."""
    if block < 1:
        raise ValueError(f"block_digests: block must be >= 1, got {block}")
    t = _int32(tokens, "block_digests")
    h = hashlib.blake2b(fp, digest_size=DIGEST_SIZE).digest()
    out = []
    for k in range(len(t) // block):
        h = hashlib.blake2b(h + t[k * block:(k + 1) * block].tobytes(),
                            digest_size=DIGEST_SIZE).digest()
        out.append(h)
    return out


# ---------------------------------------------------------------------------------- index
class State(enum.Enum):
    PENDING = "pending"  # a row is computing it: may be waited for, never restored from
    READY = "ready"  # published: may be restored from


@dataclasses.dataclass(eq=False)
class Node:
    """One cached prefix [0, end). `payload`: what later steps store (page handles,
    snapshot slot, contiguous blocks)."""

    digest: bytes
    parent: bytes | None  # the previous node's digest (None at the first); informational
    end: int
    tokens: np.ndarray  # int32 [end]: the prefix itself, compared on every hit
    holders: int = 0  # running rows pinning it
    state: State = State.PENDING
    last_used: int = 0  # the index's tick at its latest use
    payload: Any = None


@dataclasses.dataclass(frozen=True)
class Match:
    """`ready`: the deepest usable READY node (None: nothing to reuse); `pending`: a deeper
    usable PENDING node a scheduler may wait for (None: none)."""

    ready: Node | None
    pending: Node | None

    @property
    def end(self) -> int:
        """Positions the READY node covers (0 without one)."""
        return self.ready.end if self.ready is not None else 0


class PrefixIndex:
    """Digest -> Node, and the LRU order of evictable (unpinned READY) nodes."""

    def __init__(self):
        self._nodes: dict[bytes, Node] = {}
        self._lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._tick = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._nodes

    def get(self, digest: bytes) -> Node | None:
        return self._nodes.get(digest)

    def nodes(self) -> list[Node]:
        return list(self._nodes.values())

    @property
    def evictable(self) -> int:
        """Nodes `evict_lru` could take now."""
        return len(self._lru)

    def _node(self, digest: bytes, what: str) -> Node:
        node = self._nodes.get(digest)
        if node is None:
            raise ValueError(f"prefix index: {what} of unknown digest {digest.hex()}")
        return node

    def _use(self, node: Node) -> None:
        self._tick += 1
        node.last_used = self._tick
        if node.digest in self._lru:
            self._lru.move_to_end(node.digest)

    def insert(self, digest: bytes, parent: bytes | None, tokens, *, ready: bool = False,
               payload: Any = None) -> Node:
        """Add the node of prefix `tokens` (its end is their count), PENDING unless
        `ready`. ValueError if the digest is already in the index."""
        if digest in self._nodes:
            raise ValueError(f"prefix index: insert of digest {digest.hex()}, which is "
                             f"already in the index ({self._nodes[digest].state.value})")
        t = _int32(tokens, "prefix index: insert")
        if len(t) < 1:
            raise ValueError("prefix index: insert of an empty prefix")
        node = Node(digest, parent, len(t), t.copy(), payload=payload,
                    state=State.READY if ready else State.PENDING)
        self._nodes[digest] = node
        if ready:
            self._lru[digest] = None
        self._use(node)
        return node

    def publish(self, digest: bytes, payload: Any = None) -> Node:
        """PENDING -> READY (with `payload` if given); evictable once unpinned."""
        node = self._node(digest, "publish")
        if node.state is not State.PENDING:
            raise ValueError(f"prefix index: publish of digest {digest.hex()}, which is "
                             f"already ready")
        node.state = State.READY
        if payload is not None:
            node.payload = payload
        if node.holders == 0:
            self._lru[digest] = None
        self._use(node)
        return node

    def drop(self, digest: bytes) -> Node:
        """Remove a PENDING node nobody pins (its computing row was preempted or cancelled).
        READY nodes leave by `evict_lru`."""
        node = self._node(digest, "drop")
        if node.state is not State.PENDING:
            raise ValueError(f"prefix index: drop of digest {digest.hex()}, which is ready "
                             f"(ready nodes leave by eviction)")
        if node.holders:
            raise ValueError(f"prefix index: drop of digest {digest.hex()}, which "
                             f"{node.holders} row(s) still pin")
        del self._nodes[digest]
        return node

    def match(self, tokens, digests: Sequence[bytes], limit: int) -> Match:
        """The deepest READY node among `digests` (a prompt's `block_digests`) whose end is
        <= `limit` and whose tokens equal the prompt's first `end` tokens, and a deeper
        PENDING node meeting the same conditions, if any. Reads only (see `touch`)."""
        t = _int32(tokens, "prefix index: match")
        pending = None
        for digest in reversed(digests):
            node = self._nodes.get(digest)
            if node is None or node.end > limit or node.end > len(t):
                continue
            if not np.array_equal(node.tokens, t[:node.end]):
                continue  # a digest collision: never serve another prefix's entries
            if node.state is State.READY:
                return Match(node, pending)
            if pending is None:
                pending = node
        return Match(None, pending)

    def touch(self, digest: bytes) -> Node:
        """Mark a node used now (most recently used in the eviction order)."""
        node = self._node(digest, "touch")
        self._use(node)
        return node

    def pin(self, digest: bytes) -> Node:
        """One more running row holds the node: it cannot be evicted until unpinned."""
        node = self._node(digest, "pin")
        node.holders += 1
        self._lru.pop(digest, None)
        self._use(node)
        return node

    def unpin(self, digest: bytes) -> Node:
        """One row fewer holds the node; at 0 a READY node becomes the most recently used
        evictable one."""
        node = self._node(digest, "unpin")
        if node.holders < 1:
            raise ValueError(f"prefix index: unpin of digest {digest.hex()}, which no row "
                             f"pins")
        node.holders -= 1
        if node.holders == 0 and node.state is State.READY:
            self._lru[digest] = None
        self._use(node)
        return node

    def evict_lru(self, n: int) -> list[Node]:
        """Remove up to `n` unpinned READY nodes, least recently used first, and return
        them (fewer when fewer are evictable). Pinned and PENDING nodes are never taken."""
        if n < 0:
            raise ValueError(f"prefix index: evict_lru needs n >= 0, got {n}")
        out = []
        while self._lru and len(out) < n:
            digest, _ = self._lru.popitem(last=False)
            out.append(self._nodes.pop(digest))
        return out
