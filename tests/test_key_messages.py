"""A mistyped config key's error suggests the closest valid key, and an error about a value
derived from another key names the key the user typed."""

import os

import pytest

from dsattn import config
from dsattn.errors import ConfigError
from tests.helpers import ROOT

V4 = os.path.join(ROOT, "configs", "tiny", "v4.yaml")


@pytest.mark.parametrize("override, message", [
    ("attention.windw=8", r"^attention.windw: unknown key \(did you mean attention.window\?\)"),
    ("train.step=3", r"^train.step: unknown key \(did you mean train.steps\?\)"),
    ("atention.window=8", r"^atention.window: unknown key \(did you mean attention.window\?\)"),
])
def test_unknown_key_suggests_the_closest(override, message):
    with pytest.raises(ConfigError, match=message):
        config.load(V4, [override])


@pytest.mark.parametrize("override, key", [
    ("attention.csa_ratio=0", "attention.csa_ratio"),
    ("attention.hca_ratio=0", "attention.hca_ratio"),
    ("attention.ratios=0", "attention.ratios"),
])
def test_a_ratio_error_names_the_key_typed(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: layer \d \((csa|hca)\) needs a compression"):
        config.load(V4, [override])
