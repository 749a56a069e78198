"""KV-cache byte accounting: storage per token, local (window) bytes, and reads per decode step.

Counting rules: docs/design.md, "Byte accounting"; tests/test_kvbytes.py pins the figures of
the full-size presets (configs/deepseek/), worked out by hand in their header comments.

Storage per token is the *global* cache a layer adds per token of context, in the deployed
cache formats (``cfg.cache``) or, with ``bf16=True``, with every vector stored in BF16:

    mha      2 * n_kv_heads * bpv(main, head_dim)              (K and V of every KV head)
    mla      bpv(main, kv_lora_rank + qk_rope_dim, rope=qk_rope_dim)
    dsa      mla + bpv(key, indexer.head_dim, rope=indexer.rope_dim)
    csa/full (bpv(main, entry_dim, rope_dim) + bpv(key, ix.head_dim, ix.rope_dim)) / ratio
    hca      bpv(main, entry_dim, rope_dim) / ratio
    swa/reindex/reuse  0   (no global cache of their own: window only, or borrowed)

Every V4-family layer (swa/hca/csa/full/reindex/reuse) also keeps a local window of W
positions in ``cache.local_format``; that is ``local_bytes``, fixed once W positions are filled.

Reads for one decode step with ``context`` tokens already in the cache:
each cache item a layer references is counted once per layer; a cache shared by several layers
is counted again for every layer that reads it; heads and the K/V roles do not multiply it.

    window (V4 family)   min(W, context) items at local-format bytes
    mha / mla            every token (context) at main-format bytes
    dsa                  min(top_k, context) tokens; scans all context search keys
    hca                  all context // m complete entries; no search keys
    csa / full           min(top_k, context // m) entries; scan context // m keys
    reindex              min(top_k, context // m) entries; scans context // m keys, or with the
                         hierarchical indexer (attention.pool_blocks > 0) only the pooled
                         candidates, min(pool_blocks * pool_block_size, context // m)
    reuse                min(top_k, context // m) entries (the borrowed selection); no keys

The arithmetic is exact (ints and Fractions); storage comes back as float (V4-Flash's
3,514.25 B is fractional), byte counts of reads as int whenever they are whole.
"""

from __future__ import annotations

from fractions import Fraction

from dsattn import plan
from dsattn.cache.formats import bytes_per_vector
from dsattn.config import Config
from dsattn.plan import Selector

__all__ = [
    "item_bytes",
    "storage_per_layer",
    "storage_per_layer_exact",
    "storage_per_token",
    "local_bytes",
    "global_bytes",
    "read_counts",
    "report",
    "format_report",
]


def _num(x: Fraction | int) -> int | float:
    """An exact count as int when whole, else float."""
    x = Fraction(x)
    return int(x) if x.denominator == 1 else float(x)


def _bytes(cfg: Config, v: plan.Vector | None, bf16: bool) -> Fraction:
    """Bytes of one cache item made of `v` (0 for None), deployed format or BF16."""
    if v is None:
        return Fraction(0)
    fmt = "bf16" if bf16 else getattr(cfg.cache, v.role.format_key)
    return v.count * Fraction(bytes_per_vector(fmt, v.width, v.rope, cfg.model.dtype))


def item_bytes(cfg: Config, layer: int, bf16: bool = False) -> dict[str, Fraction]:
    """Bytes of one cache item of each role layer `layer` reads (0 where none).

    ``main``: one token's K+V of all KV heads (mha), one latent (mla/dsa), or one compressed
    entry (V4 family); ``key``: one search key; ``local``: one window position.
    """
    s = plan.resolve(cfg)[layer]
    return {"local": _bytes(cfg, s.local, bf16), "main": _bytes(cfg, s.entry, bf16),
            "key": _bytes(cfg, s.key, bf16)}


def _stored_bytes(cfg: Config, s: plan.LayerSpec, bf16: bool) -> Fraction:
    """Bytes of one global item a layer writes itself (0 for layers that store none)."""
    return sum((_bytes(cfg, v, bf16) for v in s.stored), Fraction(0))


def storage_per_layer_exact(cfg: Config, bf16: bool = False) -> list[Fraction]:
    """Exact global bytes each layer adds per token (see the module docstring)."""
    return [_stored_bytes(cfg, s, bf16) / s.stride for s in plan.resolve(cfg)]


def storage_per_layer(cfg: Config, bf16: bool = False) -> list[float]:
    """Global bytes added per token by each layer (deployed formats, or all-BF16)."""
    return [float(x) for x in storage_per_layer_exact(cfg, bf16)]


def storage_per_token(cfg: Config, bf16: bool = False) -> float:
    """Global bytes added per token by the whole stack."""
    return float(sum(storage_per_layer_exact(cfg, bf16), Fraction(0)))


def local_bytes(cfg: Config, bf16: bool = False, context: int | None = None) -> int | float:
    """Bytes of every V4-family layer's local window (W positions; min(W, context) if given)."""
    w = cfg.attention.window if context is None else min(cfg.attention.window, context)
    return _num(sum((_bytes(cfg, s.local, bf16) * w for s in plan.resolve(cfg)), Fraction(0)))


def global_bytes(cfg: Config, context: int, bf16: bool = False) -> int | float:
    """Exact global cache after ``context`` tokens: complete entries only (floor per layer)."""
    _check_context(context)
    return _num(sum(((context // s.stride) * _stored_bytes(cfg, s, bf16)
                     for s in plan.resolve(cfg)), Fraction(0)))


def _check_context(context) -> None:
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context: expected an integer >= 0 tokens, got {context!r}")


def read_counts(cfg: Config, context: int) -> list[dict]:
    """Per layer: cache items one decode step reads with ``context`` tokens cached.

    ``window_read``: local window positions; ``entries_read``: main items (compressed entries,
    or tokens for mha/mla/dsa); ``keys_scanned``: search keys the layer's indexer scores.
    """
    _check_context(context)
    a = cfg.attention
    out = []
    for s in plan.resolve(cfg):
        k = s.kind
        visible = context // s.stride if s.entry is not None else 0
        entries = {Selector.NONE: 0, Selector.ALL: visible}.get(k.selector,
                                                                  min(a.top_k, visible))
        keys = visible if k.scans_keys else 0
        if k.reads_pool and a.pool_blocks > 0:  # only the hierarchical indexer's pool
            keys = min(a.pool_blocks * a.pool_block_size, visible)
        out.append({"window_read": min(a.window, context) if k.window else 0,
                    "entries_read": entries, "keys_scanned": keys})
    return out


def _layer_reads(it: dict, counts: dict) -> tuple[Fraction, Fraction, Fraction]:
    local = counts["window_read"] * it["local"]
    main = counts["entries_read"] * it["main"]
    key = counts["keys_scanned"] * it["key"]
    return local, main, key


def report(cfg: Config, context: int, show: bool = False) -> dict:
    """Storage, local bytes and one decode step's reads at ``context`` cached tokens.

    Returns a JSON-ready dict; ``layers`` holds the per-layer breakdown (kind, ratio, sharing
    sources, item sizes, storage, items read and bytes read). ``show=True`` also prints it as
    a table (``format_report``).
    """
    if show:
        out = report(cfg, context)
        print(format_report(out))
        return out
    _check_context(context)
    a = cfg.attention
    store = storage_per_layer_exact(cfg)
    store16 = storage_per_layer_exact(cfg, bf16=True)
    counts = read_counts(cfg, context)

    layers = []
    tot = {k: Fraction(0) for k in ("local", "main", "key", "local16", "main16", "key16")}
    for spec in plan.resolve(cfg):
        i = spec.index
        it, it16 = item_bytes(cfg, i), item_bytes(cfg, i, bf16=True)
        loc, main, key = _layer_reads(it, counts[i])
        loc16, main16, key16 = _layer_reads(it16, counts[i])
        for name, v in (("local", loc), ("main", main), ("key", key), ("local16", loc16),
                        ("main16", main16), ("key16", key16)):
            tot[name] += v
        layers.append({
            "layer": i,
            "kind": spec.name,
            "ratio": spec.ratio,
            "kv_source": spec.kv_source,  # layer whose global cache it reads (None: none)
            "select_source": spec.select_source,  # layer whose selection it reuses (reuse)
            "local_item_bytes": _num(it["local"]),
            "main_item_bytes": _num(it["main"]),
            "key_item_bytes": _num(it["key"]),
            "storage_bytes_per_token": float(store[i]),
            "storage_bf16_bytes_per_token": float(store16[i]),
            **counts[i],
            "read_local_bytes": _num(loc),
            "read_main_bytes": _num(main),
            "read_kv_bytes": _num(loc + main),
            "read_key_bytes": _num(key),
            "read_bytes": _num(loc + main + key),
            "read_bf16_kv_bytes": _num(loc16 + main16),
            "read_bf16_key_bytes": _num(key16),
        })

    storage = sum(store, Fraction(0))
    storage16 = sum(store16, Fraction(0))
    local = Fraction(local_bytes(cfg))
    kv = tot["local"] + tot["main"]
    kv16 = tot["local16"] + tot["main16"]
    total = kv + tot["key"]
    glob = Fraction(global_bytes(cfg, context))
    return {
        "name": cfg.name,
        "context": context,
        "n_layers": len(a.layers),
        "storage_bytes_per_token": float(storage),
        "storage_bf16_bytes_per_token": float(storage16),
        "storage_layers": sum(1 for s in store if s),  # layers that store global KV
        "local_bytes": _num(local),
        "local_bf16_bytes": local_bytes(cfg, bf16=True),
        # context where storage_per_token * context equals the local window bytes
        "crossover_context": float(local / storage) if local and storage else None,
        "global_bytes": _num(glob),  # exact, complete entries only, at `context`
        "cache_bytes": _num(glob + Fraction(local_bytes(cfg, context=context))),
        "read_local_bytes": _num(tot["local"]),
        "read_main_bytes": _num(tot["main"]),
        "read_kv_bytes": _num(kv),
        "read_key_bytes": _num(tot["key"]),
        "read_bytes": _num(total),
        "read_key_share": float(tot["key"] / total) if total else 0.0,
        "read_bf16_kv_bytes": _num(kv16),
        "read_bf16_key_bytes": _num(tot["key16"]),
        "read_bf16_bytes": _num(kv16 + tot["key16"]),
        "window_read": sum(c["window_read"] for c in counts),
        "entries_read": sum(c["entries_read"] for c in counts),
        "keys_scanned": sum(c["keys_scanned"] for c in counts),
        "layers": layers,
    }


def _si(n) -> str:
    """Bytes with a decimal prefix: 3.21 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:g} B"


def format_report(rep: dict) -> str:
    """A `report` as a readable table: the totals, then one line per layer."""
    ctx = rep["context"]
    lines = [
        f"{rep['name']}: {rep['n_layers']} layers, KV cache at {ctx:,} cached tokens",
        f"  stored per token   {rep['storage_bytes_per_token']:,.2f} B as deployed, "
        f"{rep['storage_bf16_bytes_per_token']:,.2f} B all BF16 "
        f"({rep['storage_layers']} layers store global KV)",
        f"  local windows      {_si(rep['local_bytes'])} (fixed once full)",
        f"  cache of one seq.  {_si(rep['cache_bytes'])} (global {_si(rep['global_bytes'])})",
        f"  read per step      {_si(rep['read_bytes'])}: KV {_si(rep['read_kv_bytes'])}, "
        f"search keys {_si(rep['read_key_bytes'])} ({100 * rep['read_key_share']:.1f}%); "
        f"all BF16 {_si(rep['read_bf16_bytes'])}",
        f"  {'layer':>5} {'kind':<8} {'ratio':>5} {'B/token':>10} {'window':>7} "
        f"{'entries':>8} {'keys':>8} {'read/step':>10}",
    ]
    for r in rep["layers"]:
        lines.append(f"  {r['layer']:>5} {r['kind']:<8} {r['ratio'] or '-':>5} "
                     f"{r['storage_bytes_per_token']:>10,.2f} {r['window_read']:>7} "
                     f"{r['entries_read']:>8} {r['keys_scanned']:>8} "
                     f"{_si(r['read_bytes']):>10}")
    return "\n".join(lines)
