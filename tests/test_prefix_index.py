"""Prefix caching's host-side index (dsattn.serve.prefix; docs/prefix_caching.md, build
plan step 2): block size B and stride S per preset, chained block digests and the
fingerprint, the index's match / pin / eviction rules, and the CED replay limit."""

import hashlib
import os

import numpy as np
import pytest

from dsattn import config
from dsattn.serve import prefix
from dsattn.serve.prefix import PrefixIndex, State
from tests.helpers import ROOT

# (preset, B, S at max_chunk 64), worked by hand from the configs: page_size 16 everywhere;
# tiny v4 ratios 4, 16, window 16; small v4 ratios 4, 128, window 128 (B = 128); v41 ratios
# 2 and 1, window 16 (tiny) or 128 (small: S = 64 raised to 128). MHA/MLA/DSA have no
# window layers, so their window (default 16) does not raise S. docs/prefix_caching.md's
# table agrees with every row.
TABLE = [
    ("tiny/mha", 16, 64), ("tiny/gqa", 16, 64), ("tiny/mqa", 16, 64), ("tiny/mla", 16, 64),
    ("tiny/dsa", 16, 64), ("tiny/v4", 16, 64), ("tiny/v41", 16, 64),
    ("small/mha", 16, 64), ("small/mla", 16, 64), ("small/dsa", 16, 64),
    ("small/v4", 128, 128), ("small/v41", 16, 128),
    ("deepseek/v3_2", 64, 64),  # the doc: "v3_2.yaml's page 64 gives B = 64"
]


def _cfg(name, overrides=()):
    return config.load(os.path.join(ROOT, "configs", f"{name}.yaml"), list(overrides))


@pytest.mark.parametrize("name,b,s", TABLE)
def test_block_size_and_stride_per_preset(name, b, s):
    cfg = _cfg(name)
    assert prefix.block_size(cfg) == b
    assert prefix.stride(cfg, 64) == s
    assert s % b == 0 and s % 64 == 0


def test_stride_rises_to_the_window_only_for_window_layers():
    v4 = _cfg("tiny/v4")
    assert prefix.stride(v4, 16) == 16  # lcm(16, 16) = 16 >= window 16
    v4w = _cfg("tiny/v4", ["attention.window=40"])
    assert prefix.stride(v4w, 16) == 48  # 16 raised to its least multiple >= 40
    assert prefix.stride(v4w, 64) == 64
    mha = _cfg("tiny/mha", ["attention.window=1000"])
    assert prefix.stride(mha, 64) == 64  # no window layers: window plays no part
    assert prefix.block_size(_cfg("tiny/v4", ["attention.ratio=8"])) == 16
    assert prefix.block_size(_cfg("tiny/v4", ["attention.ratio=32"])) == 32
    with pytest.raises(ValueError, match="max_chunk"):
        prefix.stride(v4, 0)


def test_digests_chain_and_are_prefixes_of_a_longer_prompts():
    fp = prefix.fingerprint(_cfg("tiny/mha"))
    rng = np.random.default_rng(0)
    long = rng.integers(0, 256, 100)
    short = long[:37]
    d_long = prefix.block_digests(fp, long, 8)
    d_short = prefix.block_digests(fp, list(short), 8)  # any int sequence
    assert len(d_long) == 12 and len(d_short) == 4  # full blocks only
    assert d_long[:4] == d_short
    assert all(isinstance(d, bytes) and len(d) == 16 for d in d_long)
    assert len(set(d_long)) == 12
    other = long.copy()
    other[3] += 1  # a change in block 0 changes every later digest
    assert not set(prefix.block_digests(fp, other, 8)) & set(d_long)
    other = long.copy()
    other[50] += 1  # a change in block 6 keeps blocks 0..5
    d_other = prefix.block_digests(fp, other, 8)
    assert d_other[:6] == d_long[:6] and not set(d_other[6:]) & set(d_long)
    # the documented recipe: int32 little-endian tokens, 16-byte blake2b
    h0 = hashlib.blake2b(fp, digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + np.asarray(long[:8], "<i4").tobytes(), digest_size=16).digest()
    assert d_long[0] == h1
    with pytest.raises(ValueError, match="int32"):
        prefix.block_digests(fp, [2 ** 40], 1)


def test_a_changed_fingerprint_gives_other_digests():
    tokens = np.arange(64)
    base = _cfg("tiny/v4")
    fp = prefix.fingerprint(base, {"replay": None, "B": 16, "S": 64})
    assert fp == prefix.fingerprint(_cfg("tiny/v4"), {"S": 64, "B": 16, "replay": None})
    changed = [
        prefix.fingerprint(_cfg("tiny/v4", ["cache.page_size=32"]),
                           {"replay": None, "B": 16, "S": 64}),
        prefix.fingerprint(_cfg("tiny/v4", ["attention.window=32"]),
                           {"replay": None, "B": 16, "S": 64}),
        prefix.fingerprint(base, {"replay": 8, "B": 16, "S": 64}),
        prefix.fingerprint(base, {"replay": None, "B": 16, "S": 128}),
        prefix.fingerprint(base, {"replay": None, "B": 16, "S": 64, "weights": b"\x01"}),
    ]
    assert len({fp, *changed}) == 6
    digests = set(prefix.block_digests(fp, tokens, 16))
    for other in changed:
        assert not digests & set(prefix.block_digests(other, tokens, 16))
    # keys that do not change cache contents (training, data) leave it alone
    assert fp == prefix.fingerprint(_cfg("tiny/v4", ["train.lr=0.1", "train.steps=3"]),
                                    {"replay": None, "B": 16, "S": 64})
    with pytest.raises(ValueError, match="JSON"):
        prefix.fingerprint(base, {"weights": object()})


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)


def _index_with(tokens, digests, ends, block, state=State.READY):
    """An index with a node at each end in `ends` (multiples of block)."""
    index = PrefixIndex()
    for e in ends:
        k = e // block
        index.insert(digests[k - 1], digests[k - 2] if k > 1 else None, tokens[:e],
                     ready=state is State.READY)
    return index


def test_match_returns_the_deepest_usable_ready_node():
    fp, block = b"fp", 8
    tokens = _prompt(50)
    digests = prefix.block_digests(fp, tokens, block)  # 6 blocks: ends 8 .. 48
    index = _index_with(tokens, digests, [16, 32], block)
    m = index.match(tokens, digests, limit=49)
    assert m.ready is index.get(digests[3]) and m.ready.end == 32 and m.end == 32
    assert m.pending is None
    assert index.match(tokens, digests, limit=31).ready.end == 16  # limit cuts 32 off
    assert index.match(tokens, digests, limit=32).ready.end == 32  # end <= limit
    assert index.match(tokens, digests, limit=15).ready is None
    assert index.match(tokens, digests, limit=15).end == 0
    # a prompt sharing only the first 20 tokens reuses the node at 16
    other = tokens.copy()
    other[20:] = (other[20:] + 1) % 256
    m = index.match(other, prefix.block_digests(fp, other, block), limit=49)
    assert m.ready.end == 16
    # a node is self-sufficient: the one at 32 serves after the one at 16 is gone
    index.evict_lru(1)
    assert digests[1] not in index and index.match(tokens, digests, 49).ready.end == 32


def test_a_digest_hit_with_other_tokens_is_a_miss():
    fp, block = b"fp", 8
    tokens = _prompt(40)
    digests = prefix.block_digests(fp, tokens, block)
    index = _index_with(tokens, digests, [8], block)
    wrong = tokens[:24].copy()
    wrong[17] += 1
    index.insert(digests[2], digests[1], wrong, ready=True)  # as if its digest collided
    m = index.match(tokens, digests, limit=39)
    assert m.ready.end == 8  # the colliding node at 24 is skipped, the next one serves
    # a node longer than the prompt never matches either
    assert index.match(tokens[:20], digests, limit=100).ready.end == 8


def test_pending_nodes_are_reported_not_matched_nor_evicted():
    fp, block = b"fp", 8
    tokens = _prompt(40)
    digests = prefix.block_digests(fp, tokens, block)
    index = _index_with(tokens, digests, [8], block)
    index.insert(digests[2], digests[1], tokens[:24])  # pending
    index.insert(digests[3], digests[2], tokens[:32])  # pending, deeper
    m = index.match(tokens, digests, limit=39)
    assert m.ready.end == 8 and m.pending.end == 32  # the deepest pending one
    assert index.match(tokens, digests, limit=31).pending.end == 24  # limit holds here too
    assert index.match(tokens[:8], digests[:1], limit=7) == prefix.Match(None, None)
    assert [n.end for n in index.evict_lru(10)] == [8]  # only the ready node goes
    assert len(index) == 2 and index.evictable == 0
    m = index.match(tokens, digests, limit=39)
    assert m.ready is None and m.pending.end == 32
    node = index.publish(digests[2], payload="slot 3")
    assert node.state is State.READY and node.payload == "slot 3"
    m = index.match(tokens, digests, limit=39)
    assert m.ready.end == 24 and m.pending.end == 32
    dropped = index.drop(digests[3])  # its computing row went away
    assert dropped.end == 32 and digests[3] not in index
    with pytest.raises(ValueError, match="already ready"):
        index.publish(digests[2])
    with pytest.raises(ValueError, match="ready"):
        index.drop(digests[2])
    with pytest.raises(ValueError, match="unknown digest"):
        index.publish(b"nope")
    with pytest.raises(ValueError, match="already in the index"):
        index.insert(digests[2], digests[1], tokens[:24])


def ends(nodes):
    return [n.end for n in nodes]


def test_a_pinned_node_is_never_evicted_and_lru_order_holds():
    fp, block = b"fp", 4
    tokens = _prompt(30)
    digests = prefix.block_digests(fp, tokens, block)
    index = _index_with(tokens, digests, [4, 8, 12, 16, 20], block)  # inserted in this order
    index.touch(digests[0])  # 4 is now the most recent
    index.pin(digests[1])  # 8 is held by a row
    index.pin(digests[1])
    assert index.evictable == 4
    evicted = index.evict_lru(2)
    assert ends(evicted) == [12, 16]
    assert all(n.holders == 0 for n in evicted)
    index.unpin(digests[1])
    assert ends(index.evict_lru(10)) == [20, 4]  # 8 still held once
    assert len(index) == 1 and index.get(digests[1]).holders == 1
    index.unpin(digests[1])  # released: evictable, the most recently used one
    assert index.evictable == 1
    with pytest.raises(ValueError, match="no row pins"):
        index.unpin(digests[1])
    assert ends(index.evict_lru(1)) == [8]
    assert index.evict_lru(3) == [] and len(index) == 0
    with pytest.raises(ValueError, match="n >= 0"):
        index.evict_lru(-1)
    with pytest.raises(ValueError, match="unknown digest"):
        index.pin(digests[0])


def test_last_used_follows_use():
    fp, block = b"fp", 4
    tokens = _prompt(12)
    digests = prefix.block_digests(fp, tokens, block)
    index = _index_with(tokens, digests, [4, 8], block)
    a, b = index.get(digests[0]), index.get(digests[1])
    assert a.last_used < b.last_used
    index.touch(digests[0])
    assert a.last_used > b.last_used
    assert index.evict_lru(1) == [b]
    assert a.tokens.dtype == np.int32 and a.parent is None and b.parent == digests[0]


def test_reusable_limit_follows_the_replay_contract():
    assert prefix.reusable_limit(100, None) == 99  # one token always prefilled
    assert prefix.reusable_limit(1, None) == 0
    assert prefix.reusable_limit(100, 16) == 84  # up to _replay_from only
    assert prefix.reusable_limit(10, 16) == 0  # shorter than R: nothing reusable
    with pytest.raises(ValueError, match="replay"):
        prefix.reusable_limit(10, 0)
    with pytest.raises(ValueError, match="prompt_len"):
        prefix.reusable_limit(0, None)
