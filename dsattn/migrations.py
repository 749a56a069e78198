"""What changed in saved run directories since they were first written, and how today's
code reads the old ones: config keys renamed or added (`upgrade_saved`, `RENAMED`; e.g.
`model.param_dtype`, which a run saved before it had equal to `model.dtype`), and
parameters that moved in the module tree (`MOVED_IN_ATTN`, `legacy_layout` /
`current_layout`, for params and optimizer moments alike), and the layer layouts earlier
versions saved (`SAVED_LAYOUTS`, their units from dsattn.scan). One place for every migration,
so a new one is one entry here: a config key in `upgrade_saved`, a layout a checkpoint may
have been saved in in `SAVED_LAYOUTS` (dsattn.checkpoint.layouts derives its restore maps
from that list alone); dsattn.config and dsattn.checkpoint apply them."""

from __future__ import annotations

import dataclasses
from typing import Callable

from dsattn import plan, scan


# Keys renamed since run directories were first written: (section, old) -> new.
RENAMED = {("indexer", "topk"): "topk_method"}


# The attention keys of rope scaling as a run saved before them trained: no scaling (the
# config's defaults; tests/test_yarn.py holds them equal).
PLAIN_ROPE = {"rope_scaling": "none", "yarn_factor": 1.0, "yarn_original_max_position": 4096,
              "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 0.0,
              "yarn_mscale_all_dim": 0.0}


def upgrade_saved(raw: dict) -> dict:
    """A config dict a run directory saved (`Config.to_yaml`) in today's keys. A dump lists
    every key, so one without `attention.entry_dim` predates it: the V4 family's entry width
    was then `attention.head_dim`; one without `model.param_dtype` stored its parameters
    (and optimizer moments) in `model.dtype`; one without `attention.rope_scaling` trained
    with the plain rope; one without `indexer.hadamard` never rotated its indexer keys; one without
    `attention.latent_norm` normalised MLA's latent, one without `attention.mha_rope_dim`
    rotated all of each MHA head; one without `train.freeze` froze
    nothing."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    att = raw.get("attention")
    if isinstance(att, dict) and "entry_dim" not in att and "head_dim" in att:
        att["entry_dim"] = att["head_dim"]
    model = raw.get("model")
    if isinstance(model, dict) and "scan_layers" not in model:
        model["scan_layers"] = False  # trained before scanning existed: its layout unrolled
    if isinstance(att, dict) and "rope_scaling" not in att:
        att.update(PLAIN_ROPE)  # trained before rope scaling existed: the plain rope
    if isinstance(model, dict) and "param_dtype" not in model:
        model["param_dtype"] = model.get("dtype", "float32")  # its checkpoint's dtype
    ix = raw.get("indexer")
    if isinstance(ix, dict) and "hadamard" not in ix:
        ix["hadamard"] = False  # trained before the rotation existed: unrotated keys
    if isinstance(att, dict) and "latent_norm" not in att:
        att["latent_norm"] = True  # MLA's latent was always normalised before the key
    if isinstance(att, dict) and "mha_rope_dim" not in att:
        att["mha_rope_dim"] = 0  # MHA rotated all of each head before the key
    train = raw.get("train")
    if isinstance(train, dict) and "freeze" not in train:
        train["freeze"] = []  # nothing was frozen before the key
    for (section, old), new in RENAMED.items():
        sec = raw.get(section)
        if isinstance(sec, dict) and old in sec:
            sec[new] = sec.pop(old)
    return raw


# Parameters that moved when attention layers were composed from a source and a selector
# (dsattn.plan): old name inside a block's `attn` -> new path. Checkpoints saved before
# restore into today's layout (params and the optimizer's moments alike).
MOVED_IN_ATTN = {
    "compressor": ("source", "compressor"),
    "key_compressor": ("source", "keys", "compressor"),
    "key_proj": ("source", "keys", "key_proj"),
    "key_norm": ("source", "keys", "key_norm"),
    "source_norm": ("source", "source_norm"),
    "index_q": ("selector", "index_q"),
}


def rewrite(tree, key: str, fn):
    """`tree` with every dict found under `key` replaced by fn(dict), at any nesting of
    dicts, lists and (named) tuples, as params and optax states (their moments) are."""
    if isinstance(tree, dict):
        return {k: fn(v) if k == key and isinstance(v, dict) else rewrite(v, key, fn)
                for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(rewrite(v, key, fn) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(rewrite(v, key, fn) for v in tree)
    return tree


def _upgrade_attn(attn: dict) -> dict:
    out: dict = {}
    for key, value in attn.items():
        *parents, leaf = MOVED_IN_ATTN.get(key, (key,))
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def _downgrade_attn(attn: dict) -> dict:
    out = dict(attn)
    for old, path in MOVED_IN_ATTN.items():
        node = out
        for p in path[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            out[old] = node[path[-1]]
    for group in {path[0] for path in MOVED_IN_ATTN.values()}:
        out.pop(group, None)
    return out


def legacy_layout(tree):
    """A params or optimizer-state tree in the layout saved before the layer plan."""
    return rewrite(tree, "attn", _downgrade_attn)


def current_layout(tree):
    """A tree saved before the layer plan, in today's layout (inverse of legacy_layout)."""
    return rewrite(tree, "attn", _upgrade_attn)


def _unchanged(tree):
    return tree


@dataclasses.dataclass(frozen=True)
class Layout:
    """A layout a run of a config's model may have been saved in besides the config's own:
    the units (scan.Unit) its blocks were stored by, `units(cfg)`, and a rewrite of a tree
    laid out by those units into the saved form (`to_saved`) with its inverse
    (`to_current`). dsattn.checkpoint re-lays out scanned and unrolled blocks around them."""

    what: str
    units: Callable
    to_saved: Callable = _unchanged
    to_current: Callable = _unchanged


def _units(cfg, scanned: bool) -> tuple:
    """scan.units of `cfg` with model.scan_layers=scanned."""
    return scan.units(dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, scan_layers=scanned)))


# Every layout a checkpoint may hold besides its config's own, tried in this order on
# restore (dsattn.checkpoint.layouts): a new layout migration is one entry here.
SAVED_LAYOUTS = (
    Layout("the other model.scan_layers (scanned or unrolled)",
           lambda cfg: _units(cfg, not cfg.model.scan_layers)),
    Layout("scanned without nested runs", lambda cfg: scan.without_runs(_units(cfg, True))),
    Layout("scanned with context-writing first groups unrolled",
           lambda cfg: scan.context_writers_unrolled(scan.without_runs(_units(cfg, True)),
                                                  plan.resolve(cfg))),
    Layout("unrolled, saved before the layer plan (MOVED_IN_ATTN)",
           lambda cfg: _units(cfg, False), legacy_layout, current_layout),
)
