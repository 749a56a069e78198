"""Config loading: presets, overrides, short forms, ratio resolution, sharing checks."""

import pytest

from dsattn import config, plan


def test_short_form_patterns():
    assert config.expand_pattern("swa*2, (csa, hca)*2, csa") == [
        "swa", "swa", "csa", "hca", "csa", "hca", "csa"]
    assert config.expand_pattern("((a, b*2)*2, c)") == ["a", "b", "b", "a", "b", "b", "c"]
    with pytest.raises(config.ConfigError, match="unbalanced"):
        config.expand_pattern("(a, b")


def test_overrides_are_typed_and_dotted():
    cfg = config.load("configs/tiny/mla.yaml", ["attention.n_heads=8", "train.lr=1e-3",
                                                "model.tie_embeddings=false"])
    assert cfg.attention.n_heads == 8 and cfg.train.lr == 1e-3
    assert cfg.model.tie_embeddings is False
    assert hash(cfg) == hash(config.load("configs/tiny/mla.yaml", [
        "attention.n_heads=8", "train.lr=1e-3", "model.tie_embeddings=false"]))


V4ISH = """
model: {n_layers: 7}
attention: {layers: "swa*2, (csa, hca)*2, csa", q_lora_rank: 32}
"""


def test_ratio_is_one_override():
    cfg = config.loads(V4ISH)
    assert cfg.attention.ratios == (0, 0, 4, 128, 4, 128, 4)
    cfg = config.loads(V4ISH, ["attention.ratio=8"])
    assert cfg.attention.ratios == (0, 0, 8, 8, 8, 8, 8)
    cfg = config.loads(V4ISH, ["attention.hca_ratio=64"])
    assert cfg.attention.ratios == (0, 0, 4, 64, 4, 64, 4)
    with pytest.raises(config.ConfigError, match="layer 2 \\(csa\\) needs a compression ratio"):
        config.loads(V4ISH, ["attention.csa_ratio=0"])


def test_sharing_plan_is_checked_and_resolved():
    layers = "model: {n_layers: 6}\nattention: {layers: 'swa, full, reuse, reindex, reuse, reuse', q_lora_rank: 8}"
    cfg = config.loads(layers)
    assert [(s.kv_source, s.select_source) for s in plan.resolve(cfg)] == [
        (None, None), (1, None), (1, 1), (1, None), (1, 3), (1, 3)]
    off = config.loads(layers, ["attention.sharing=false"])
    assert off.attention.layers == ("swa", "full", "full", "full", "full", "full")
    with pytest.raises(config.ConfigError, match="layer 1 is 'reuse' but no earlier 'full'"):
        config.loads("model: {n_layers: 2}\nattention: {layers: 'swa, reuse', q_lora_rank: 8}")
    # under CED the decoder cannot borrow from the encoder
    with pytest.raises(config.ConfigError, match="layer 2 is 'reindex'"):
        config.loads("model: {n_layers: 4}\nattention: {layers: 'full, reuse, reindex, reuse',"
                     " q_lora_rank: 8, ced_split: 2}")


def test_yaml_round_trip():
    cfg = config.load("configs/tiny/mla.yaml")
    again = config.loads(cfg.to_yaml())
    assert again == cfg
