"""YaRN rope scaling (attention.rope_scaling): the frequencies against the formula written
out here in numpy, the per-role application (MLA/DSA every layer plus the softmax mscale^2;
V4 only the compressed layers), presets as DeepSeek ships them, HF's rotary modules, and
decode == forward with YaRN on."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import config, plan
from dsattn.attention.layer import V4Attention
from dsattn.nn import rope
from tests.helpers import check_decode_matches_forward, preset, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A tiny context extension: original 32 positions, so max_seq_len 512 turns it on.
TINY_YARN = ("attention.rope_scaling=yarn", "attention.yarn_factor=8",
             "attention.yarn_original_max_position=32", "attention.yarn_beta_fast=8",
             "attention.yarn_beta_slow=1")


def expected_inv_freq(theta, dim, factor, original, beta_fast, beta_slow):
    """YaRN from the paper's description: pair i (wavelength 2*pi*theta^(2i/dim)) turns
    original/wavelength times over the original context. Pairs turning more than beta_fast
    times keep their frequency, fewer than beta_slow are divided by factor, a linear ramp
    between; the band edges are the (fractional) pair indices where the turn count hits
    beta_fast and beta_slow, rounded outwards and clipped to [0, dim - 1]."""
    def pair_turning(rot):  # solve original / (2*pi*theta^(2i/dim)) = rot for i
        return (dim / 2) * math.log(original / (2 * math.pi * rot), theta)

    low = max(math.floor(pair_turning(beta_fast)), 0)
    high = min(math.ceil(pair_turning(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        base = 1.0 / theta ** (2 * i / dim)
        r = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append((1 - r) * base + r * base / factor)
    return np.array(out), low, high


@pytest.mark.parametrize("theta, dim, factor, original", [
    (10000.0, 64, 40.0, 4096),  # V2/V3/V3.2's MLA rope
    (160000.0, 64, 16.0, 65536),  # V4's compress rope
    (10000.0, 16, 8.0, 32),  # the tiny override used below
])
def test_frequencies_equal_the_formula_in_float64(theta, dim, factor, original):
    want, low, high = expected_inv_freq(theta, dim, factor, original, 32.0, 1.0)
    y = rope.Yarn(theta, factor, original, 32.0, 1.0)
    pos = jnp.arange(0, 200_000, 997, dtype=jnp.int32)
    got = np.asarray(rope.rope_angles(pos, dim, y, jnp.float64))
    np.testing.assert_allclose(got, np.asarray(pos)[:, None] * want, rtol=1e-13, atol=0)
    # the band edges: pairs up to low keep the plain frequency, from high on divided by factor
    plain = theta ** (-np.arange(0, dim, 2) / dim)
    f = rope.yarn_inv_freq(y, dim)
    assert 0 <= low < high < dim // 2
    np.testing.assert_allclose(f[: low + 1], plain[: low + 1], rtol=1e-15)
    np.testing.assert_allclose(f[high:], plain[high:] / factor, rtol=1e-15)
    assert np.all((f[low + 1: high] < plain[low + 1: high])
                  & (f[low + 1: high] > plain[low + 1: high] / factor))


def test_rope_scaling_none_leaves_every_frequency_unchanged():
    for name in ("mla", "dsa", "v4", "v41", "mha"):
        cfg = preset(name)
        assert cfg.attention.rope_scaling == "none"
        assert rope.scaled(cfg, 123.0) == 123.0 and rope.softmax_mscale(cfg) == 1.0
    # yarn with a context inside the original one is off, as in DeepSeek's reference
    cfg = preset("mla", *TINY_YARN, "attention.yarn_original_max_position=512")
    assert rope.scaled(cfg, 10000.0) == 10000.0 and rope.softmax_mscale(cfg) == 1.0
    pos = jnp.arange(100)
    np.testing.assert_array_equal(
        np.asarray(rope.rope_angles(pos, 16, rope.scaled(cfg, 10000.0), jnp.float64)),
        np.arange(100)[:, None] * 10000.0 ** (-np.arange(0, 16, 2) / 16))


@pytest.mark.parametrize("name, mscale, all_dim", [("v2", 0.707, 0.707), ("v3", 1.0, 1.0),
                                                   ("v3_2", 1.0, 1.0)])
def test_mla_presets_scale_every_layer_and_the_softmax(name, mscale, all_dim):
    cfg = config.load(os.path.join(ROOT, "configs", "deepseek", f"{name}.yaml"))
    a = cfg.attention
    assert (a.rope_scaling, a.yarn_factor, a.yarn_original_max_position, a.yarn_beta_fast,
            a.yarn_beta_slow, a.yarn_mscale, a.yarn_mscale_all_dim) == (
        "yarn", 40.0, 4096, 32.0, 1.0, mscale, all_dim)
    assert rope.scaled(cfg, a.rope_theta) == rope.Yarn(10000.0, 40.0, 4096, 32.0, 1.0, 1.0)
    assert rope.softmax_mscale(cfg) == pytest.approx((0.1 * all_dim * math.log(40) + 1) ** 2,
                                                     rel=1e-15)


@pytest.mark.parametrize("name", ["v4_flash", "v4_1_flash"])
def test_v4_presets_scale_the_compress_rope_only(name):
    cfg = config.load(os.path.join(ROOT, "configs", "deepseek", f"{name}.yaml"))
    a = cfg.attention
    assert rope.scaled(cfg, a.compress_rope_theta) == rope.Yarn(160000.0, 16.0, 65536, 32.0,
                                                                1.0, 1.0)
    assert rope.softmax_mscale(cfg) == 1.0  # V4 leaves the softmax scale alone


def test_tiny_mla_softmax_scale_carries_mscale_squared():
    from dsattn.attention.mla import MLA
    base = preset("mla")
    yarn = preset("mla", *TINY_YARN, "attention.yarn_mscale=1", "attention.yarn_mscale_all_dim=0.5")
    sb = MLA(base, plan.resolve(base)[0], nnx.Rngs(0)).scale
    sy = MLA(yarn, plan.resolve(yarn)[0], nnx.Rngs(0)).scale
    assert sb == (base.attention.qk_nope_dim + base.attention.qk_rope_dim) ** -0.5
    assert sy == pytest.approx(sb * (0.05 * math.log(8) + 1) ** 2, rel=1e-14)


def _v4_layer_outputs(*overrides):
    cfg = preset("v4", "model.dtype=float64", *overrides)
    x = jax.random.normal(jax.random.key(1), (2, 48, cfg.model.d_model), jnp.float64)
    pos = jnp.broadcast_to(jnp.arange(48), (2, 48))
    outs, layers = [], []
    for spec in plan.resolve(cfg):
        layer = V4Attention(cfg, spec, nnx.Rngs(0))
        outs.append(np.asarray(layer(x, pos)[0]))
        layers.append(layer)
    return outs, layers


def test_v4_yarn_changes_only_the_compressed_layers():
    plain, _ = _v4_layer_outputs()
    yarn, layers = _v4_layer_outputs(*TINY_YARN)
    for layer, p, y in zip(layers, plain, yarn):
        if layer.ratio:  # CSA/HCA: query, window, compressor (and indexer) on the yarn rope
            assert isinstance(layer.theta, rope.Yarn) and layer.theta.theta == 160000.0
            assert layer.source.theta is layer.theta
            assert np.abs(p - y).max() > 1e-6
        else:  # SWA: the plain rope, bit for bit
            assert layer.theta == 10000.0
            np.testing.assert_array_equal(p, y)


@pytest.mark.parametrize("name", ["mla", "dsa", "v4"])
def test_decode_equals_forward_with_yarn(name):
    model = tiny_model(name, *TINY_YARN, "attention.yarn_mscale=0.707",
                       "attention.yarn_mscale_all_dim=0.5")
    # positions past the original 32, where the interpolated pairs matter
    check_decode_matches_forward(model, lengths=[5, 37, 22], n_decode=12, max_len=64)


def test_equals_hf_deepseek_v3_yarn_rotary():
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.modeling_rope_utils import yarn_apply_mscale
    import torch

    scaling = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
               "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
               "rope_theta": 10000.0}
    hcfg = DeepseekV3Config(qk_rope_head_dim=64, qk_nope_head_dim=128, rope_parameters=scaling,
                            max_position_embeddings=163840)
    emb = hf.DeepseekV3RotaryEmbedding(hcfg)
    cfg = config.load(os.path.join(ROOT, "configs", "deepseek", "v2.yaml"))
    y = rope.scaled(cfg, cfg.attention.rope_theta)
    # HF builds inv_freq in float32: 1e-6 relative
    np.testing.assert_allclose(emb.inv_freq.double().numpy(), rope.yarn_inv_freq(y, 64),
                               rtol=1e-6)
    assert emb.attention_scaling == pytest.approx(y.attn_factor, rel=1e-12)
    qk = 192 ** -0.5
    assert yarn_apply_mscale(hcfg.rope_parameters, qk) == pytest.approx(
        qk * rope.softmax_mscale(cfg), rel=1e-12)
    # cos over 8K positions, both in float32: angles up to 8192 rad round to ~5e-4
    pos = torch.arange(0, 8192, 7)[None]
    cos, _ = emb(torch.zeros(1, dtype=torch.float32), pos)
    ang = np.asarray(rope.rope_angles(jnp.asarray(pos.numpy()[0]), 64, y, jnp.float32))
    np.testing.assert_allclose(cos[0, :, :32].numpy(), np.cos(ang), atol=2e-3)


def test_equals_hf_deepseek_v4_compress_rotary():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    hcfg = DeepseekV4Config(rope_theta=10000.0, compress_rope_theta=160000.0,
                            rope_parameters={"rope_type": "yarn", "factor": 16.0,
                                             "original_max_position_embeddings": 65536,
                                             "beta_fast": 32, "beta_slow": 1})
    emb = hf.DeepseekV4RotaryEmbedding(hcfg)
    cfg = config.load(os.path.join(ROOT, "configs", "deepseek", "v4_flash.yaml"))
    dim = cfg.attention.rope_dim
    assert dim == hcfg.qk_rope_head_dim
    y = rope.scaled(cfg, cfg.attention.compress_rope_theta)
    np.testing.assert_allclose(emb.compress_inv_freq.double().numpy(), rope.yarn_inv_freq(y, dim),
                               rtol=1e-6)
    assert emb.compress_attention_scaling == y.attn_factor == 1.0
    # the SWA ("main") rope stays plain
    np.testing.assert_allclose(emb.main_inv_freq.double().numpy(),
                               10000.0 ** (-np.arange(0, dim, 2) / dim), rtol=1e-6)


@pytest.mark.parametrize("override, message", [
    ("attention.rope_scaling=ntk", "attention.rope_scaling"),
    ("attention.yarn_factor=0.5", "attention.yarn_factor: must be >= 1"),
    ("attention.yarn_beta_fast=1", "attention.yarn_beta_fast: must exceed"),
    ("attention.yarn_original_max_position=0", "attention.yarn_original_max_position"),
])
def test_bad_yarn_settings_are_refused(override, message):
    with pytest.raises(config.ConfigError, match=message):
        preset("mla", *TINY_YARN, override)


def test_runs_saved_before_rope_scaling_read_as_the_plain_rope():
    """A saved config without the rope-scaling keys (every run before them) upgrades to the
    config's defaults, which are the plain rope: it loads and resumes as it was trained."""
    from dsattn import migrations
    from dsattn.config import AttentionConfig

    defaults = AttentionConfig()
    assert migrations.PLAIN_ROPE == {k: getattr(defaults, k) for k in migrations.PLAIN_ROPE}
    assert defaults.rope_scaling == "none"
    saved = {"attention": {"layers": ["mha"], "rope_theta": 10000.0}}
    assert migrations.upgrade_saved(saved)["attention"]["yarn_factor"] == 1.0
