"""Bad input gets a clear error, raised before any state is damaged."""

import re

import numpy as np
import pytest

from dsattn import config, data, generate
from dsattn.errors import CacheExhausted
from tests.helpers import preset, tiny_model


def test_prompt_longer_than_cache():
    model = tiny_model("mha", "model.n_layers=1")
    cache = generate.init_cache(model, 2, 16)
    with pytest.raises(CacheExhausted, match="row 1 would need 20 positions, max_len=16"):
        generate.prefill(model, np.ones((2, 20), int), [3, 20], cache)
    # the cache is untouched and still usable
    assert np.asarray(cache.pos).tolist() == [0, 0]
    generate.prefill(model, np.ones((2, 4), int), [4, 4], cache)


def test_token_outside_vocabulary():
    model = tiny_model("mha", "model.n_layers=1")
    cache = generate.init_cache(model, 1, 16)
    with pytest.raises(ValueError, match="token id 256 is outside the vocabulary"):
        generate.prefill(model, np.array([[1, 256]]), [2], cache)
    with pytest.raises(ValueError, match="token id -1"):
        generate.decode_step(model, np.array([-1]), cache)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(np.array([[300]]))
    # padding beyond a row's length is not checked: it is never read
    generate.prefill(model, np.array([[1, 999]]), [1], cache)


@pytest.mark.parametrize("override, needle", [
    ("attention.nheads=4", "attention.nheads: unknown key"),
    ("atention.n_heads=4", "unknown key (did you mean attention.n_heads?); use section.key"),
    ("attention.n_heads=four", "attention.n_heads: expected an integer"),
    ("attention.n_kv_heads=3", "attention.n_kv_heads: 3 must divide"),
    ("model.dtype=float8", "model.dtype: 'float8' is not one of"),
    ("cache.main_format=fp9", "cache.main_format: 'fp9' is not one of"),
    ("attention.layers=mha*3", "attention.layers has 3 kinds for model.n_layers=4: use "
                               "model.n_layers=3"),
])
def test_bad_config_keys_name_the_key(override, needle):
    with pytest.raises(config.ConfigError, match=re.escape(needle)):
        preset("mha", override)


def test_data_path_matching_nothing():
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        data.load_corpus(config.DataConfig(source="/no_such_dir/*.txt"), 256)


def test_replay_without_ced_is_refused():
    model = tiny_model("mha", "model.n_layers=1")
    cache = generate.init_cache(model, 1, 16)
    with pytest.raises(ValueError, match="ced_split"):
        generate.prefill(model, np.ones((1, 4), int), [4], cache, replay=2)


def test_exhausted_page_pool_is_an_error():
    from dsattn.cache import paged

    model = tiny_model("dsa", "model.n_layers=1")
    cache = generate.init_cache(model, 2, 64)
    layer = model.blocks[0].attn
    # a pool of 3 pages of 16 tokens shared by two rows that need 2 pages each
    small = paged.empty(layer.fields, 2, 64, 16, layer.dtype, n_pages=3)
    cache = cache.replace(layers=(cache.layers[0].replace(pages=small),))
    with pytest.raises(paged.CacheExhausted, match="pool exhausted"):
        generate.prefill(model, np.ones((2, 20), int), [20, 20], cache)
