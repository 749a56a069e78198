"""model.n_layers=N alone shrinks a preset to a valid stack of its family (dsattn.depth)."""

import glob
import os
import re
import shlex
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import config, plan
from dsattn.model import Transformer
from tests.helpers import ROOT, forward

TINY = sorted(glob.glob(os.path.join(ROOT, "configs", "tiny", "*.yaml")))
SMALL = sorted(glob.glob(os.path.join(ROOT, "configs", "small", "*.yaml")))
DEPTHS = (1, 2, 3, 4, 5)  # 5: odd, and below every preset's own V4-family depth


def shrunk(path, n, *extra):
    """The preset at n layers, and the warnings loading it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config.load(path, [f"model.n_layers={n}", *extra])
    return cfg, [str(w.message) for w in caught]


def kinds_of(path):
    return set(config.load(path).attention.layers)


@pytest.mark.parametrize("path", TINY + SMALL, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_preset_shrinks_to_a_valid_stack_of_its_family(path):
    preset = config.load(path)
    for n in DEPTHS:
        cfg, _ = shrunk(path, n)
        assert cfg.model.n_layers == n == len(cfg.attention.layers) == len(cfg.attention.ratios)
        assert set(cfg.attention.layers) <= kinds_of(path)  # the same family's kinds
        # each kept kind keeps a ratio it had in the preset
        for name, ratio in zip(cfg.attention.layers, cfg.attention.ratios):
            assert ratio in {r for k, r in zip(preset.attention.layers,
                                               preset.attention.ratios) if k == name}


def test_v41_keeps_its_parts_from_four_layers_and_names_what_fewer_drop():
    path = os.path.join(ROOT, "configs", "small", "v41.yaml")
    for n in (4, 5, 7):
        cfg, msgs = shrunk(path, n)
        assert set(cfg.attention.layers) == {"swa", "full", "reuse", "reindex"}
        assert 0 < cfg.attention.ced_split < n  # both halves of the CED split are there
        assert any(s.builds_pool for s in plan.resolve(cfg))  # the hierarchical indexer
        assert msgs == []
    cfg, msgs = shrunk(path, 2)
    assert len(msgs) == 1
    dropped = {"swa", "full", "reuse", "reindex", "ced", "pool"} - set(cfg.attention.layers)
    dropped -= {"pool"} if any(s.builds_pool for s in plan.resolve(cfg)) else set()
    dropped -= {"ced"} if cfg.attention.ced_split else set()
    assert dropped  # two layers cannot hold six mechanisms
    for name in dropped:
        assert name in msgs[0]
    assert "model.n_layers >= 4" in msgs[0]


def test_v4_keeps_window_csa_and_hca_from_three_layers():
    path = os.path.join(ROOT, "configs", "tiny", "v4.yaml")
    cfg, msgs = shrunk(path, 3)
    assert cfg.attention.layers == ("swa", "csa", "hca") and msgs == []
    cfg, msgs = shrunk(path, 1)
    assert len(cfg.attention.layers) == 1 and "swa" in msgs[0]


def test_coupled_keys_are_checked_together_and_the_error_names_a_valid_value():
    path = os.path.join(ROOT, "configs", "small", "v41.yaml")
    with pytest.raises(config.ConfigError) as e:  # the user's layers beside the preset's
        config.load(path, ["model.n_layers=2", "attention.ced_split=0"])
    msg = str(e.value)
    assert "attention.layers has 12 kinds" in msg and "attention.ratios has 12" in msg
    assert "model.n_layers=12" in msg
    suggestion = re.search(r"use (.*) \(the plan", msg).group(1)  # typed as shown: it loads
    cfg = config.load(path, ["model.n_layers=2", *shlex.split(suggestion)])
    assert len(cfg.attention.layers) == 2


def test_a_preset_shrunk_with_its_own_plan_names_the_keys_left_unfit():
    path = os.path.join(ROOT, "configs", "small", "v41.yaml")
    with pytest.raises(config.ConfigError) as e:
        config.load(path, ["model.n_layers=2", "attention.layers=swa, full"])
    assert "attention.ratios has 12 ratios" in str(e.value)
    assert "attention.ced_split=6" in str(e.value)
    cfg = config.load(path, ["model.n_layers=2", "attention.layers=swa, full",
                             "attention.ratios=[]", "attention.ced_split=0"])  # its fixes
    assert cfg.attention.layers == ("swa", "full")


def test_a_deeper_stack_than_the_plan_is_refused_naming_its_depth():
    with pytest.raises(config.ConfigError, match="model.n_layers=6"):
        config.load(os.path.join(ROOT, "configs", "tiny", "v4.yaml"), ["model.n_layers=7"])


def run_forward(path, n):
    cfg, _ = shrunk(path, n, "model.d_model=32", "model.ffn_hidden=32")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.arange(24).reshape(1, 24) % cfg.model.vocab_size)
    logits = forward(model, tokens)
    assert logits.shape == (1, 24, cfg.model.vocab_size)
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_a_shrunk_v41_runs_a_forward():
    run_forward(os.path.join(ROOT, "configs", "tiny", "v41.yaml"), 4)


@pytest.mark.full  # ~3 min of compiles; the fast tier runs v41 at 4 layers (above)
@pytest.mark.parametrize("path", TINY, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_shrunk_tiny_preset_runs_a_forward(path):
    for n in (1, 2, 4):
        run_forward(path, n)
