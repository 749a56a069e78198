"""The layer plan: what every attention kind does, as data, and each layer of a config
resolved against it.

`KINDS` is the one behaviour table. Everything that depends on a layer's kind (config
validation, the cache formats' role shapes, byte accounting, which module a block builds,
what a layer shares, which decoders may replay) reads a `LayerKind`'s fields or a `LayerSpec`
from `resolve(cfg)`; no other module compares kind names.

| kind    | family | window | global source     | key              | selector | pool  |
|---------|--------|--------|-------------------|------------------|----------|-------|
| mha     | mha    |        | own (per token)   |                  | all      |       |
| mla     | mla    |        | own (per token)   |                  | all      |       |
| dsa     | dsa    |        | own (per token)   | token projection | indexer  |       |
| swa     | v4     | yes    | none              |                  | none     |       |
| hca     | v4     | yes    | own compressor    |                  | all      |       |
| csa     | v4     | yes    | own, overlapping  | key compressor   | indexer  |       |
| full    | v4     | yes    | own (CSA2)        | entry projection | indexer  | build |
| reindex | v4     | yes    | borrowed          | (borrowed)       | indexer  | read  |
| reuse   | v4     | yes    | borrowed          |                  | reuse    |       |

V4's HCA and CSA add a learned position bias inside each compressed span (CSA2 does not);
CSA's spans overlap their neighbours. Full, reindex and reuse are V4.1's CSA2 layer in its
three sharing modes: a reindex or reuse layer reads the entries of the latest full layer
in its half of the stack (CED: encoder or decoder), a reuse layer also that half's latest
selection.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from functools import lru_cache

from dsattn.errors import ConfigError


class Family(enum.Enum):
    """Which attention module a kind is built from."""

    MHA = "mha"  # grouped-query multi-head attention (MHA, GQA, MQA)
    MLA = "mla"  # multi-head latent attention
    DSA = "dsa"  # MLA reading the tokens a lightning indexer selects
    V4 = "v4"  # query + local window + global source + selector + sink-attention core


class Source(enum.Enum):
    """Where a layer's global (beyond the window) keys and values come from."""

    NONE = "none"  # window only
    TOKENS = "tokens"  # its own cache, one item per token
    COMPRESSOR = "compressor"  # its own compressor, one entry per `ratio` tokens
    BORROWED = "borrowed"  # the entries of the latest full layer


class Key(enum.Enum):
    """How a layer's own search keys (one per global item) are made."""

    NONE = "none"
    TOKEN = "token"  # DSA: norm(W^K x) per token
    COMPRESSOR = "compressor"  # CSA: a second compressor over the input
    ENTRY = "entry"  # CSA2: norm(W^IK entry), a projection of the pre-RoPE entry


class Selector(enum.Enum):
    """Which global items each query attends to."""

    NONE = "none"  # no global items
    ALL = "all"  # every visible item
    INDEXER = "indexer"  # the top-k of its own indexer query
    REUSE = "reuse"  # the latest selection made in its half of the stack


class Role(enum.Enum):
    """A cache role: each is stored in its own `cache.<role>_format`."""

    LOCAL = "local"
    MAIN = "main"
    KEY = "key"

    @property
    def format_key(self) -> str:
        return f"{self.value}_format"


@dataclass(frozen=True)
class LayerKind:
    name: str
    family: Family
    source: Source
    selector: Selector
    key: Key = Key.NONE
    window: bool = False  # keeps a local sliding window (ring buffer)
    overlap: bool = False  # compressed spans overlap their neighbours (CSA)
    pos_bias: bool = False  # learned position bias inside a compressed span (V4 HCA/CSA)
    builds_pool: bool = False  # hierarchical indexer: may build a candidate pool
    reads_pool: bool = False  # scores only inside the pool when there is one
    shares: bool = False  # its entries and selection are what later layers borrow
    replayable: bool = False  # may run as a CED decoder over only the last R positions
    default_ratio: str = ""  # AttentionConfig field with its default compression ratio

    @property
    def compressed(self) -> bool:
        """Its global items are compressed entries (it needs a ratio)."""
        return self.source in (Source.COMPRESSOR, Source.BORROWED)

    @property
    def owns_global(self) -> bool:
        """It writes a global cache of its own."""
        return self.source in (Source.TOKENS, Source.COMPRESSOR)

    @property
    def scans_keys(self) -> bool:
        return self.selector is Selector.INDEXER

    @property
    def publishes_selection(self) -> bool:
        """Its selection is over the shared entries, so later reuse layers take it."""
        return self.scans_keys and (self.shares or self.source is Source.BORROWED)


KINDS: dict[str, LayerKind] = {k.name: k for k in (
    LayerKind("mha", Family.MHA, Source.TOKENS, Selector.ALL),
    LayerKind("mla", Family.MLA, Source.TOKENS, Selector.ALL),
    LayerKind("dsa", Family.DSA, Source.TOKENS, Selector.INDEXER, Key.TOKEN),
    LayerKind("swa", Family.V4, Source.NONE, Selector.NONE, window=True, replayable=True),
    LayerKind("hca", Family.V4, Source.COMPRESSOR, Selector.ALL, window=True, pos_bias=True,
              default_ratio="hca_ratio"),
    LayerKind("csa", Family.V4, Source.COMPRESSOR, Selector.INDEXER, Key.COMPRESSOR, window=True,
              overlap=True, pos_bias=True, default_ratio="csa_ratio"),
    LayerKind("full", Family.V4, Source.COMPRESSOR, Selector.INDEXER, Key.ENTRY, window=True,
              builds_pool=True, shares=True, replayable=True, default_ratio="csa2_ratio"),
    LayerKind("reindex", Family.V4, Source.BORROWED, Selector.INDEXER, window=True,
              reads_pool=True, replayable=True, default_ratio="csa2_ratio"),
    LayerKind("reuse", Family.V4, Source.BORROWED, Selector.REUSE, window=True, replayable=True,
              default_ratio="csa2_ratio"),
)}
ALIASES = {"gqa": "mha", "mqa": "mha", "csa2": "full"}
# With attention.sharing=false every borrowing layer computes its own entries.
UNSHARED = {name: "full" for name, k in KINDS.items() if k.source is Source.BORROWED}


def kind(name: str) -> LayerKind:
    """The LayerKind called `name` (or an alias of it); ConfigError naming the allowed ones."""
    k = KINDS.get(ALIASES.get(name, name))
    if k is None:
        raise ConfigError(f"attention.layers: unknown layer kind {name!r}; allowed: "
                          f"{', '.join(list(KINDS) + list(ALIASES))}")
    return k


# ------------------------------------------------------------------------------- layers
@dataclass(frozen=True)
class Vector:
    """One stored vector: its cache role, width, trailing rotary dims, and how many of them
    make one cache item (MHA: K and V of every KV head)."""

    role: Role
    width: int
    rope: int = 0
    count: int = 1


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: LayerKind
    ratio: int  # tokens per compressed entry (0: not compressed)
    kv_source: int | None  # layer whose global cache it reads (None: none)
    select_source: int | None  # layer whose selection it reuses (reuse only)
    decoder: bool  # in the decoder half of a CED stack
    from_encoder: bool  # compresses the encoder's output, not its own input (CED decoder)
    local: Vector | None  # one window position
    entry: Vector | None  # one global item it reads (token K/V, latent or entry)
    key: Vector | None  # one search key it scans
    fields: tuple[tuple[str, Vector], ...]  # layout of the global cache it reads (by name)
    builds_pool: bool = False  # a later reindex layer reads its candidate pool

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def stride(self) -> int:
        """Tokens per global item: the ratio for compressed entries, 1 per token."""
        return self.ratio or 1

    @property
    def writes_context(self) -> bool:
        """It hands later layers something through the context: entries, a selection, a pool."""
        return self.kind.shares or self.kind.publishes_selection or self.builds_pool

    @property
    def stored(self) -> tuple[Vector, ...]:
        """Vectors of one global item this layer writes itself (empty for borrowers)."""
        return tuple(v for _, v in self.fields) if self.kind.owns_global else ()


def expand(cfg) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Per-layer kind names and ratios of a config whose `attention.layers` and `ratios`
    are as written: aliases and one-kind-for-all expanded, sharing=false applied, ratios
    resolved (explicit list, else each kind's default; `attention.ratio` > 0 overrides every
    compressed layer). Raises ConfigError naming the key."""
    a, n = cfg.attention, cfg.model.n_layers
    if n < 1:
        raise ConfigError(f"model.n_layers: must be >= 1, got {n}")
    names = [kind(k).name for k in a.layers]
    if len(names) == 1:
        names = names * n
    if len(names) != n:
        raise ConfigError(f"attention.layers: {len(names)} layer kinds for model.n_layers={n}")
    if not a.sharing:
        names = [UNSHARED.get(k, k) for k in names]
    if a.ratio < 0:
        raise ConfigError(f"attention.ratio: must be >= 0 (0: per-kind ratios), got {a.ratio}")
    if a.ratios:
        ratios = list(a.ratios) * (n if len(a.ratios) == 1 else 1)
        if len(ratios) != n:
            raise ConfigError(f"attention.ratios: {len(ratios)} ratios for {n} layers")
    else:
        ratios = [getattr(a, KINDS[k].default_ratio) if KINDS[k].compressed else 0
                  for k in names]
    for i, k in enumerate(names):
        if not KINDS[k].compressed:
            ratios[i] = 0
            continue
        ratios[i] = a.ratio or ratios[i]
        if ratios[i] < 1:  # named by the key the ratio came from, as the user typed it
            key = ("attention.ratios" if a.ratios else
                   f"attention.{KINDS[k].default_ratio}")
            raise ConfigError(f"{key}: layer {i} ({k}) needs a compression ratio >= 1, "
                              f"got {ratios[i]}")
    return tuple(names), tuple(ratios)


def _vectors(cfg, k: LayerKind):
    """(local, entry, own key) vectors of a layer of kind `k`."""
    a, ix = cfg.attention, cfg.indexer
    local = Vector(Role.LOCAL, a.entry_dim, a.rope_dim) if k.window else None
    if k.family is Family.MHA:
        entry = Vector(Role.MAIN, a.head_dim, 0, 2 * (a.n_kv_heads or a.n_heads))
    elif k.family in (Family.MLA, Family.DSA):
        entry = Vector(Role.MAIN, a.kv_lora_rank + a.qk_rope_dim, a.qk_rope_dim)
    elif k.source is Source.NONE:
        entry = None
    else:
        entry = Vector(Role.MAIN, a.entry_dim, a.rope_dim)
    key = Vector(Role.KEY, ix.head_dim, ix.rope_dim) if k.scans_keys else None
    return local, entry, key


@lru_cache(maxsize=256)
def resolve(cfg) -> tuple[LayerSpec, ...]:
    """One LayerSpec per layer of a loaded config (cached: configs are frozen, hashable).

    Borrowing layers get the latest earlier full layer of their half of the stack as their
    KV source (None if there is none: `check` reports it), reuse layers also the latest
    full or reindex layer as their selection source.
    """
    a = cfg.attention
    specs, last_shared, last_select = [], None, None
    for i, (name, ratio) in enumerate(zip(a.layers, a.ratios)):
        k = KINDS[name]
        decoder = bool(a.ced_split) and i >= a.ced_split
        if a.ced_split and i == a.ced_split:  # the decoder never borrows from the encoder
            last_shared = last_select = None
        if k.shares:
            last_shared = i
        if k.publishes_selection:
            last_select = i
        kv = i if k.owns_global else (last_shared if k.source is Source.BORROWED else None)
        sel = last_select if k.selector is Selector.REUSE else None
        local, entry, key = _vectors(cfg, k)
        if k.owns_global:
            fields = (("entry", entry),) + ((("key", key),) if k.key is not Key.NONE else ())
        elif kv is not None:
            fields = specs[kv].fields
        else:
            fields = ()
        specs.append(LayerSpec(i, k, ratio, kv, sel, decoder, decoder and k.shares,
                               local, entry, key, fields))
    # Only a pool some later layer reads is built (V4.1: the decoder's full layer).
    readers = {s.kv_source for s in specs if s.kind.reads_pool and a.pool_blocks}
    return tuple(dataclasses.replace(s, builds_pool=s.index in readers and s.kind.builds_pool)
                 for s in specs)


def check(cfg) -> None:
    """A borrowing layer needs an earlier full layer in its half of the stack, with the same
    ratio (it reads that layer's entries)."""
    for s in resolve(cfg):
        if s.kind.source is not Source.BORROWED:
            continue
        if s.kv_source is None:
            raise ConfigError(
                f"attention.layers: layer {s.index} is '{s.name}' but no earlier 'full' layer "
                f"(in its half of the stack) provides entries to borrow")
        src = cfg.attention.ratios[s.kv_source]
        if s.ratio != src:
            raise ConfigError(f"attention.ratios: layer {s.index} borrows from layer "
                              f"{s.kv_source} and must share its ratio ({src}), got {s.ratio}")


def families(cfg) -> set[Family]:
    return {s.kind.family for s in resolve(cfg)}


def role_shapes(cfg) -> dict[Role, list[tuple[int, int]]]:
    """(width, rope dims) of every vector each cache role stores or reads, in plan order."""
    out: dict[Role, list[tuple[int, int]]] = {r: [] for r in Role}
    for s in resolve(cfg):
        for v in (s.local, s.entry, s.key):
            if v is not None and (v.width, v.rope) not in out[v.role]:
                out[v.role].append((v.width, v.rope))
    return out
