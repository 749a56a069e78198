"""The layer plan (dsattn.plan): a golden test over every preset, and the table's rules.

tests/golden/plan.json holds, for every preset in configs/tiny and configs/deepseek (and
variants that change the plan), the kinds, ratios, sharing sources, cache role shapes and
kvbytes reports at 1,000 and 131,072 tokens computed by the code before the plan existed
(scripts-free: written by hand-checked kvbytes, whose seed figures tests/test_kvbytes.py
holds). One deliberate change: an MHA layer reads its own cache, so its kv_source is itself
(the old code reported None for MHA while reporting MLA's as itself).
"""

import json
import os

import pytest

from dsattn import config, kvbytes, plan, scan
from tests.helpers import ROOT

GOLDEN = json.load(open(os.path.join(ROOT, "tests", "golden", "plan.json")))
VARIANTS = {"": [], "nosharing": ["attention.sharing=false"],
            "pool": ["attention.pool_blocks=2"], "ratio8": ["attention.ratio=8"]}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_plan_reproduces_the_golden_figures(key):
    path, _, variant = key.partition("+")
    cfg = config.load(os.path.join(ROOT, "configs", path), VARIANTS[variant])
    want = GOLDEN[key]
    specs = plan.resolve(cfg)
    assert [s.name for s in specs] == want["layers"]
    assert [s.ratio for s in specs] == want["ratios"]
    assert [[s.kv_source, s.select_source] for s in specs] == want["sharing_sources"]
    shapes = {r.format_key: sorted(map(list, v)) for r, v in plan.role_shapes(cfg).items()}
    assert shapes == {k: sorted(v) for k, v in want["role_shapes"].items()}
    for context, report in want["reports"].items():
        assert kvbytes.report(cfg, int(context)) == report


def test_every_kind_is_consistent():
    for k in plan.KINDS.values():
        assert k.compressed == bool(k.default_ratio)  # a compressed kind has a default ratio
        assert (k.key is not plan.Key.NONE) <= k.scans_keys  # own keys are for an indexer
        assert k.reads_pool <= (k.source is plan.Source.BORROWED)
        assert k.shares <= k.owns_global
        assert k.window == (k.family is plan.Family.V4)
    for alias, name in plan.ALIASES.items():
        assert plan.kind(alias) is plan.KINDS[name]
    with pytest.raises(config.ConfigError, match="unknown layer kind 'nope'"):
        plan.kind("nope")


def test_borrowers_read_the_latest_full_layer_of_their_half():
    cfg = config.loads("model: {n_layers: 8}\nattention: {layers: 'full, reuse, reindex, "
                       "reuse, full, reuse, reindex, reuse', q_lora_rank: 8, ced_split: 4}")
    specs = plan.resolve(cfg)
    assert [(s.kv_source, s.select_source) for s in specs] == [
        (0, None), (0, 0), (0, None), (0, 2), (4, None), (4, 4), (4, None), (4, 6)]
    assert [s.from_encoder for s in specs] == [False] * 4 + [True] + [False] * 3
    # borrowers read their source's cache layout; only owners store
    assert specs[3].fields == specs[0].fields and specs[3].stored == ()
    assert [name for name, _ in specs[0].fields] == ["entry", "key"]


def test_every_repeated_group_scans_all_its_copies():
    """V4.1-Flash's stack as units: each repeated group is one scan over all its copies,
    including groups that write the context (the full layers' entries and selections, the
    reindex layers' selections); no unit crosses the CED split at 20."""
    cfg = config.load(os.path.join(ROOT, "configs", "deepseek", "v4_1_flash.yaml"))
    U = scan.Unit
    # swa*2 (too few copies to scan) | (full, reuse*5)*3 || full | (reuse*3, reindex)*4
    # | reuse*3: the greedy pass from layer 21 covers 16 layers with period 4; inside a
    # group, a run of reuse layers is one slot (a nested scan)
    units = scan.units(cfg)
    assert units == (U(0), U(1), U(2, 6, 3, (1, 5)), U(20), U(21, 4, 4, (3, 1)), U(37, 1, 3))
    assert sum(u.traced for u in units) == 8
    # copy 2's third reuse layer of the (full, reuse*5) group
    assert units[2].layer(1, 2, 2) == 2 + 2 * 6 + 1 + 2
