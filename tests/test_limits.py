"""Limits are errors, never silent wrong results (issue 16): caches refuse to pass max_len,
configs refuse values that would train or run wrongly, sampling refuses bad parameters and
gives every row its own random stream."""

import jax
import numpy as np
import pytest

from dsattn import generate
from dsattn.errors import CacheExhausted
from tests.conftest import forward, tiny_model

MAX_LEN = 16

# Every tiny preset, cut down to the fewest layers that keep each of its cache kinds
# (contiguous K/V or latents, paged entries and keys, rings (every V4-family layer has one),
# compressor state, the v41 pool and a CED decoder) so the compiles stay small. The refusal
# itself sits above the layers (generate), so it covers every layer kind alike.
SMALL = {
    "mha": ("model.n_layers=1",),
    "gqa": ("model.n_layers=1",),
    "mqa": ("model.n_layers=1",),
    "mla": ("model.n_layers=1",),
    "dsa": ("model.n_layers=1",),
    "v4": ("model.n_layers=2", "attention.layers=csa, hca", "attention.hca_ratio=8"),
    "v41": ("model.n_layers=2", "attention.layers=full, full", "attention.ratios=2, 1",
            "attention.ced_split=1"),
}


def small(name):
    return tiny_model(name, *SMALL[name])


def snapshot(cache):
    return jax.tree.map(np.array, cache)


def assert_same(cache, snap):
    jax.tree.map(np.testing.assert_array_equal, snapshot(cache), snap)


@pytest.mark.parametrize("name", list(SMALL))
def test_cache_refuses_positions_past_max_len(name):
    """Decode fills every slot, then the next step (and any prefill past max_len) is refused
    before anything runs, leaving the cache as it was. (Decode only: one compile each.)"""
    model = small(name)
    toks = np.random.RandomState(0).randint(0, 256, (2, MAX_LEN))
    cache = generate.init_cache(model, 2, MAX_LEN)
    with pytest.raises(CacheExhausted, match="row 1 would need 17 positions, max_len=16"):
        generate.prefill(model, np.ones((2, 17), int), [5, 17], cache)
    for p in range(MAX_LEN):
        logits, cache = generate.decode_step(model, toks[:, p], cache)
    assert np.isfinite(np.asarray(logits)).all()  # the step writing the last slot is fine
    generate.check_cache(cache)
    before = snapshot(cache)
    with pytest.raises(CacheExhausted, match=r"row 0 reached max_len=16.*init_cache\(\.\.\., "
                                             r"max_len=\.\.\.\)"):
        generate.decode_step(model, toks[:, 0], cache)
    with pytest.raises(CacheExhausted, match="row 1 reached max_len=16"):
        generate.prefill(model, toks[:, :2], [0, 2], cache)
    assert_same(cache, before)


def test_ragged_rows_and_the_compiled_check():
    """A full row blocks decode_step for the batch (the cache stays usable: the other row
    goes on through prefill). Callers that bypass decode_step's host check (the Bound's own
    program) meet the check inside the compiled step: a full row writes nothing, keeps its
    position, gets NaN logits and is flagged; the other rows step normally; check_cache
    raises."""
    model = small("mla")
    toks = np.random.RandomState(1).randint(0, 256, (2, MAX_LEN))
    cache = generate.init_cache(model, 2, MAX_LEN)
    _, cache = generate.prefill(model, toks, [MAX_LEN, 4], cache)
    before = snapshot(cache)
    with pytest.raises(CacheExhausted, match="decode_step: row 0 reached max_len=16"):
        generate.decode_step(model, toks[:, 4], cache)
    assert_same(cache, before)
    _, cache = generate.prefill(model, toks[:, 4:6], [0, 2], cache)
    layers = snapshot(cache["layers"])
    bound = generate.bind(model)
    logits, cache = bound.decode_fn(bound.state, np.array([7, toks[1, 6]], np.int32), cache)
    logits = np.asarray(logits)
    assert np.isnan(logits[0]).all()
    np.testing.assert_allclose(logits[1], np.asarray(forward(model, toks[1:2, :7]))[0, 6],
                               atol=1e-9)
    np.testing.assert_array_equal(np.asarray(cache["pos"]), [MAX_LEN, 7])
    for now, then in zip(jax.tree.leaves(cache["layers"]), jax.tree.leaves(layers)):
        np.testing.assert_array_equal(np.asarray(now)[0], then[0])  # row 0 wrote nothing
    with pytest.raises(CacheExhausted, match="row 0 reached max_len=16"):
        generate.check_cache(cache)


def test_exhausted_page_pool_message_speaks_of_max_len():
    from dsattn.cache import paged

    model = small("dsa")
    cache = generate.init_cache(model, 2, MAX_LEN)
    layer = model.blocks[0].attn
    # one page for two rows that need one each
    cache["layers"][0]["global"] = paged.empty(layer.fields, 2, MAX_LEN, 16, layer.dtype,
                                               n_pages=1)
    with pytest.raises(CacheExhausted, match=r"init_cache\(\.\.\., max_len=\.\.\.\)") as e:
        generate.prefill(model, np.ones((2, 4), int), [4, 4], cache)
    assert "pool size" not in str(e.value)
