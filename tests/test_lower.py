"""Full-size programs from shapes alone (dsattn.bench.lower): a decode step of each V4
preset at its real widths is traced from ShapeDtypeStructs, and the cache it takes as an
argument holds exactly the bytes kvbytes counts. Depth is cut to one group of each preset's
pattern (tracing all 40+ layers takes tens of seconds); scripts/lower.py runs the whole
stacks."""

import jax
import numpy as np
import pytest

from dsattn import config, kvbytes
from dsattn.bench import lower
from tests.helpers import ROOT

SHORT = {  # the preset's own pattern, one repetition of each group
    "v4_flash": ["model.n_layers=5", "attention.layers=swa*2, csa, hca, csa",
                 "attention.ratios=0*2, 4, 128, 4"],
    "v4_1_flash": ["model.n_layers=8", "attention.layers=swa*2, full, reuse, full, reuse, "
                   "reindex, reuse", "attention.ratios=0*2, 2*2, 1*4", "attention.ced_split=4"],
}


@pytest.mark.parametrize("name", sorted(SHORT))
def test_full_width_decode_lowers_with_the_cache_kvbytes_counts(name):
    cfg = config.load(f"{ROOT}/configs/deepseek/{name}.yaml", SHORT[name])
    max_len = 8192  # a multiple of every ratio x page size: pages fill exactly
    low, cache = lower.lowered(cfg, 1, max_len)
    # The program's donated argument is the cache, whose stored vectors are what kvbytes
    # counts (the rest is bookkeeping: positions, page tables, compressor accumulators).
    donated = [a for a in jax.tree.leaves(low.args_info) if a.donated]
    assert sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in donated) == lower.nbytes(cache)
    want = kvbytes.global_bytes(cfg, max_len) + kvbytes.local_bytes(cfg, context=max_len)
    assert lower.cache_value_bytes(cache) == want
