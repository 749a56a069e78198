"""A sweep row carried to the full-size preset: the row's overrides that mean something
there, a per-layer ratio list translated by layer role."""

from __future__ import annotations

from dsattn import config as config_lib
from dsattn import plan
from dsattn.ablate.sweep import Row, Sweep
from dsattn.errors import ConfigError


def _ratios_by_role(cfg) -> dict | None:
    """{(kind, decoder half): ratio} of a config's compressed layers, or None when two layers
    of one role differ (then per-layer ratios have no depth-independent meaning)."""
    roles: dict = {}
    for spec in plan.resolve(cfg):
        if spec.ratio and roles.setdefault((spec.name, spec.decoder), spec.ratio) != spec.ratio:
            return None
    return roles


def _translated_ratios(sweep: Sweep, row: Row, applied: list) -> str | None:
    """A per-layer `attention.ratios` override of the row, carried to the full-size preset by
    role: each full-size layer takes the ratio the row gives layers of its kind in its half
    of the stack (e.g. V4.1's encoder and decoder m). None when that is not well defined."""
    roles = _ratios_by_role(sweep.config(row, sweep.seeds[0]))
    full = config_lib.load(sweep.full_size, applied)
    if roles is None:
        return None
    ratios = [roles.get((spec.name, spec.decoder), spec.ratio) for spec in plan.resolve(full)]
    return "attention.ratios=" + ", ".join(map(str, ratios))


def full_size_config(sweep: Sweep, row: Row):
    """The full-size preset with the row's attention/indexer/cache overrides that validate
    there (each tried on its own; the sections config.full_size_sections names); a
    per-layer `attention.ratios` list is carried over by layer role (kind and CED half).
    Returns (config, applied, skipped) or Nones."""
    if not sweep.full_size:
        return None, [], []
    applied, skipped = [], []
    carried = config_lib.full_size_sections()
    for ov in (*sweep.overrides, *row.overrides):
        if ov.split(".", 1)[0] not in carried:
            continue
        tries = [ov]
        if ov.split("=", 1)[0].strip() == "attention.ratios":
            tries.append(_translated_ratios(sweep, row, applied))
        for attempt in filter(None, tries):
            try:
                config_lib.load(sweep.full_size, [*applied, attempt])
                applied.append(attempt)
                break
            except ConfigError:
                continue
        else:
            skipped.append(ov)
    return config_lib.load(sweep.full_size, applied), applied, skipped
