"""Limits are errors, never silent wrong results (docs/design.md, "Contracts the tests hold"):
caches refuse to pass max_len, configs refuse values that would train or run wrongly, sampling
refuses bad parameters and gives every row its own random stream."""

import glob
import os

import chex
import jax
import numpy as np
import pytest

from dsattn import config, generate
from dsattn.errors import CacheExhausted
from tests.helpers import ROOT, forward, preset, tiny_model

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
    chex.assert_trees_all_equal(snapshot(cache), snap)


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
    goes on through prefill). Callers that bypass decode_step's host check (the engine's
    decode_unchecked) meet the check inside the compiled step: a full row writes nothing,
    keeps its position, gets NaN logits and is flagged; the other rows step normally;
    check_cache raises."""
    model = small("mla")
    toks = np.random.RandomState(1).randint(0, 256, (2, MAX_LEN))
    cache = generate.init_cache(model, 2, MAX_LEN)
    _, cache = generate.prefill(model, toks, [MAX_LEN, 4], cache)
    before = snapshot(cache)
    with pytest.raises(CacheExhausted, match="decode_step: row 0 reached max_len=16"):
        generate.decode_step(model, toks[:, 4], cache)
    assert_same(cache, before)
    _, cache = generate.prefill(model, toks[:, 4:6], [0, 2], cache)
    layers = snapshot(cache.layers)
    step = generate.engine(model).decode_unchecked
    logits, cache = step(np.array([7, toks[1, 6]], np.int32), cache)
    logits = np.asarray(logits)
    assert np.isnan(logits[0]).all()
    np.testing.assert_allclose(logits[1], np.asarray(forward(model, toks[1:2, :7]))[0, 6],
                               atol=1e-9)
    np.testing.assert_array_equal(np.asarray(cache.pos), [MAX_LEN, 7])
    for now, then in zip(jax.tree.leaves(cache.layers), jax.tree.leaves(layers)):
        np.testing.assert_array_equal(np.asarray(now)[0], then[0])  # row 0 wrote nothing
    with pytest.raises(CacheExhausted, match="row 0 reached max_len=16"):
        generate.check_cache(cache)


def test_exhausted_page_pool_message_speaks_of_max_len():
    from dsattn.cache import paged

    fields = {"entry": paged.Field("native", 8)}
    cache = paged.empty(fields, 2, 8, 4, n_pages=1)  # one page for two rows
    cache = paged.append(cache, {"entry": np.ones((2, 3, 8), np.float32)}, [3, 3])
    with pytest.raises(CacheExhausted, match=r"init_cache\(\.\.\., max_len=\.\.\.\)") as e:
        paged.check(cache)
    assert "pool size" not in str(e.value)


# ------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("override, needle", [
    # would train uphill (a negative clip flips the update) or not at all (0 zeroes it)
    ("train.grad_clip=-1", "train.grad_clip: must be a finite number > 0, got -1"),
    ("train.grad_clip=0", "train.grad_clip: must be a finite number > 0"),
    ("train.lr=0", "train.lr: must be a finite number > 0"),
    ("train.lr=.nan", "train.lr: must be a finite number > 0, got nan"),
    ("train.warmup_steps=-5", "train.warmup_steps: must be >= 0, got -5"),
    ("train.weight_decay=-0.1", "train.weight_decay: must be a finite number >= 0"),
    ("train.min_lr_ratio=1.5", r"train.min_lr_ratio: must be in \[0, 1\]"),
    ("train.b1=1.5", r"train.b1: must be in \[0, 1\)"),
    ("train.b2=-0.1", r"train.b2: must be in \[0, 1\)"),
    ("train.seed=-1", "train.seed: must be >= 0"),
    ("train.steps=0", "train.steps: must be >= 1"),
    ("train.batch_size=0", "train.batch_size: must be >= 1"),
    ("train.eval_every=0", "train.eval_every: must be >= 1"),
    ("train.ckpt_every=-1", "train.ckpt_every: must be >= 1"),
    # the training batch would be [batch, 100000] activations: refused, not allocated
    ("train.seq_len=100000", "train.seq_len: 100000 exceeds model.max_seq_len=512"),
    ("model.norm_eps=-1e-6", "model.norm_eps: must be a finite number > 0"),
    ("model.init_std=-0.02", "model.init_std: must be a finite number > 0"),
    ("attention.rope_theta=0", "attention.rope_theta: must be a finite number > 0"),
    ("attention.n_kv_heads=-1", "attention.n_kv_heads: must be >= 0"),
    ("indexer.loss_weight=-1", "indexer.loss_weight: must be a finite number >= 0"),
])
def test_config_values_are_validated_at_load(override, needle):
    with pytest.raises(config.ConfigError, match=needle):
        preset("mha", override)


@pytest.mark.parametrize("name, overrides, needle", [
    ("v4", ["attention.ratio=-4"], "attention.ratio: must be >= 0"),
    ("v4", ["attention.window=0"], "attention.window: must be >= 1"),
    ("v4", ["attention.top_k=0"], "attention.top_k: must be >= 1"),
    ("v4", ["attention.entry_block=0"], "attention.entry_block: must be >= 1"),
    ("v4", ["attention.compress_rope_theta=-1"], "attention.compress_rope_theta: must be a "),
    # the kernels' block maxima tile pages exactly (and Triton tiles are powers of two)
    ("v41", ["indexer.impl=pallas_tpu", "attention.pool_block_size=3"],
     "attention.pool_block_size: 3 must divide cache.page_size=16 for indexer.impl=pallas_tpu"),
    ("v41", ["indexer.impl=pallas_gpu", "attention.pool_block_size=12", "cache.page_size=24"],
     "attention.pool_block_size: 12 must be a power of two for indexer.impl=pallas_gpu"),
    ("v41", ["indexer.impl=pallas_gpu", "indexer.head_dim=24"],
     "indexer.head_dim: 24 must be a power of two >= 16 for indexer.impl=pallas_gpu"),
])
def test_config_values_the_model_cannot_use_name_the_key(name, overrides, needle):
    with pytest.raises(config.ConfigError, match=needle):
        preset(name, *overrides)


def test_valid_limits_still_load():
    # the XLA score pass takes any block size (only the kernels need it to tile pages)
    assert preset("v41", "attention.pool_block_size=3", "cache.page_size=7").attention
    assert preset("v41", "indexer.impl=pallas_tpu", "attention.pool_block_size=8")
    assert preset("mha", "train.seq_len=512", "train.warmup_steps=0", "train.weight_decay=0")
    for kind in ("tiny", "deepseek"):  # every shipped preset
        for path in sorted(glob.glob(os.path.join(ROOT, "configs", kind, "*.yaml"))):
            config.load(path)


# ------------------------------------------------------------------------------ sampling
def gen_model():
    return tiny_model("mha", "model.n_layers=1")  # the model test_decode/test_errors use


@pytest.mark.parametrize("kwargs, needle", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(eos_id=256), "eos_id"),
    (dict(stop=[[3, -1]]), "stop"),
])
def test_generate_rejects_bad_sampling_parameters(kwargs, needle):
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=needle):
        generate.generate(gen_model(), [[1, 2, 3]], **kwargs)
    with pytest.raises(ValueError, match=needle):  # checked before the prompt is even read
        generate.generate(gen_model(), [[999]], **kwargs)


def test_a_rows_samples_depend_on_its_own_prompt_only():
    """Each row draws from its own stream, (seed, row, step): the same prompt samples the same
    tokens alone and as row 0 of a batch of 3, a row keeps its tokens when the other rows
    change, and two rows holding one prompt still draw differently. Checked with JAX's
    non-partitionable threefry, where one [batch, vocab] draw from a shared key depends on
    the batch size: the guarantee must not rest on that global setting."""
    kw = dict(temperature=1.0, top_p=0.95, seed=3)
    p, q, r = [1, 2, 3], [4, 5], [9, 9, 9, 9, 9]
    with jax.threefry_partitionable(False):
        alone = generate.generate(gen_model(), [p], 8, **kw)[0]
        a = generate.generate(gen_model(), [p, q, r], 8, **kw)
        b = generate.generate(gen_model(), [[7], q, p], 8, **kw)
    assert a[0] == alone
    assert b[1] == a[1]
    assert b[2] != a[0]  # same prompt, another row: another stream
    assert len(alone) == 8 and len(set(alone)) > 1


def test_cache_length_defaults_to_the_models_max_seq_len():
    cfg = preset("v41", "model.max_seq_len=96", "train.seq_len=64")
    assert generate.cache_capacity(jax.eval_shape(lambda: generate.init_cache(cfg, 2))) == 96
