"""The real cache pytrees hold exactly the bytes kvbytes counts: per stored token for the
global cache, per window for the local one. Measured on abstract shapes (jax.eval_shape),
so nothing is allocated, for the tiny presets and the full-size DeepSeek presets."""

import glob
import os

import jax
import numpy as np
import pytest

from dsattn import config, generate, kvbytes
from dsattn.cache import contiguous, paged, ring
from dsattn.model import layer_caches
from tests.helpers import ROOT

FORMATTED = ["cache.local_format=fp8_ue8m0", "cache.main_format=fp4_e4m3",
             "cache.key_format=fp4_ue8m0"]


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def measured(cfg, max_len: int):
    """(global bytes per token per layer, local bytes in all) from the cache's value arrays.

    Bookkeeping (positions, page tables, lengths, free lists) is not cache content and is
    left out, as in dsattn.kvbytes (docs/design.md, "Byte accounting").
    """
    cache = jax.eval_shape(lambda: generate.init_cache(cfg, 1, max_len))
    typed = (contiguous.Contiguous, paged.PagedCache, ring.Ring)
    per_layer, local = [], 0
    for layer in layer_caches(cfg, cache):
        stored = 0
        for part in jax.tree.leaves(layer, is_leaf=lambda x: isinstance(x, typed)):
            if isinstance(part, contiguous.Contiguous):  # MHA K/V, MLA latents: [1, max_len]
                stored += _nbytes(part.stored)
            elif isinstance(part, paged.PagedCache):  # every slot of every page: one entry
                stored += _nbytes(part.pages)
            elif isinstance(part, ring.Ring):
                local += _nbytes(part.kv)
        per_layer.append(stored / max_len)
    return per_layer, local


TINY = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(ROOT, "configs/tiny/*.yaml")))


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("formats", ["native", "deployed"])
def test_tiny_cache_bytes_equal_formula(name, formats):
    overrides = FORMATTED if formats == "deployed" and name in ("v4",) else []
    cfg = config.load(os.path.join(ROOT, "configs/tiny", f"{name}.yaml"), overrides)
    max_len = 4096  # a multiple of every ratio x page size, so pages fill exactly
    per_layer, local = measured(cfg, max_len)
    assert per_layer == pytest.approx(kvbytes.storage_per_layer(cfg), rel=0, abs=1e-12)
    assert local == kvbytes.local_bytes(cfg)


@pytest.mark.parametrize("name", ["mha_v2dims", "v2", "v3", "v3_2", "v4_flash", "v4_1_flash"])
def test_full_size_cache_bytes_equal_formula_abstractly(name):
    cfg = config.load(os.path.join(ROOT, "configs/deepseek", f"{name}.yaml"))
    per_layer, local = measured(cfg, 8192)
    assert sum(per_layer) == pytest.approx(kvbytes.storage_per_token(cfg), abs=1e-9)
    assert local == kvbytes.local_bytes(cfg)
