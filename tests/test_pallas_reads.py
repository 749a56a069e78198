"""attention.impl=pallas_gpu: every read through the fused Pallas kernels (the dense / window
kernel, the selected-entries kernel and its entry-mass pass, behind the contract's adapter).
Here the Pallas interpreter runs them (Triton compiles them on a GPU): a model trains
(loss, the indexer's KL loss, every gradient; the dense warm-up and the picks) and decodes
(ragged prefill, decode steps) as the XLA reference does, in float64."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import config, generate, targets
from dsattn.bench import lower
from dsattn.kernels import registry
from dsattn.model import Transformer
from dsattn.trainstep import loss_fn
from tests.helpers import preset
from tests.test_attend import _families, case, decode_logits, sink_read_grads, train_steps

OP = registry.Op.ATTENTION
FUSED = "attention.impl=pallas_gpu"


def test_a_v4_read_through_the_kernels_equals_the_reference():
    """One V4 layer's read (picks, window, sink, KL target) and its gradients, jitted: the
    fast tier's check of the model-level tests below."""
    want, got = (sink_read_grads(registry.load(OP, name), dense=None)
                 for name in ("xla", "pallas_gpu"))
    assert float(want[1][1]) > 0
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12),
                 got, want)


@pytest.mark.full
@pytest.mark.parametrize("name", _families(set()))
def test_every_family_trains_through_the_kernels_as_the_reference(name):
    want, got = (train_steps(name, *impl) for impl in ((), (FUSED,)))
    for step, w, g in zip((0, 5), want, got):
        for key in w[0]:
            np.testing.assert_allclose(g[0][key], w[0][key], rtol=1e-10, atol=1e-12,
                                       err_msg=f"{name} step {step}: {key}")
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-11),
                     g[1], w[1])


@pytest.mark.full
@pytest.mark.parametrize("name", _families(set()))
def test_every_family_decodes_through_the_kernels_as_the_reference(name):
    np.testing.assert_allclose(decode_logits(name, FUSED), decode_logits(name), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.full
@pytest.mark.parametrize("name, scanned", [
    ("csa", ("model.n_layers=4", "attention.layers=swa, csa*3")),
    ("mla", ("model.n_layers=3",))])
def test_a_scanned_stack_decodes_through_the_kernels_as_the_reference(name, scanned):
    """Three copies scanned: the decode kernel reads a copy's rows of the stacked ring and
    pages (CSA), or the copy's own contiguous cache, its write held until the scan ends
    (MLA)."""
    scanned += ("model.scan_layers=true",)
    np.testing.assert_allclose(decode_logits(name, FUSED, *scanned),
                               decode_logits(name, *scanned), rtol=1e-10, atol=1e-12)


def test_auto_takes_the_kernels_for_a_gpu_only_where_they_fit():
    auto = registry.resolve(OP, preset("v4"), "auto")
    assert (auto.on("cuda"), auto.on("gpu"), auto.on("cpu"), auto.on("tpu")) == (
        "pallas_gpu", "pallas_gpu", "xla", "xla")
    odd = preset("v4", "attention.entry_dim=40")
    assert registry.resolve(OP, odd, "auto") == registry.Choice("xla")


def _queries_by_entries(jaxpr, t: int, n: int) -> int:
    """How many arrays of a traced program (nested ones included) have a dim of size t and
    another of size n."""
    count = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            dims = list(getattr(v.aval, "shape", ()))
            if t in dims and (dims.remove(t) or n in dims):
                count += 1
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _queries_by_entries(inner, t, n)
    return count


@pytest.mark.parametrize("name", ["dsa", "v4"])
def test_the_dense_warm_up_holds_no_array_of_queries_by_entries(name):
    """DSA's indexer warm-up reads every visible token with its KL target: through the
    kernels its ids, mass and scores exist one block of queries at a time, never as a
    [B, T, N] array (at 32K tokens each would be 4 GiB; the compile for an H100 held 21.7
    GiB). T = 160 tokens of a DSA stack (N = T entries) or 320 of a CSA one at ratio 2
    (N = 160), in blocks of 8 queries."""
    t = 160 if name == "dsa" else 320
    cfg = case("dsa" if name == "dsa" else "csa", FUSED, "model.dtype=bfloat16",
               "indexer.dense_warmup_steps=10", *(() if name == "dsa" else
                                                  ("attention.csa_ratio=2",)))
    graph, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.ShapeDtypeStruct((1, t + 1), jnp.int32)

    def loss(params, tokens):
        return loss_fn(nnx.merge(graph, params), {"inputs": tokens[:, :-1],
                                                  "targets": tokens[:, 1:]}, 0)[0]

    jaxpr = jax.jit(jax.grad(loss)).trace(params, tokens).jaxpr.jaxpr
    assert _queries_by_entries(jaxpr, t, 160) == 0


def test_heads_past_the_gpus_shared_memory_take_the_xla_reads():
    """The selected-entries kernel holds every head of a query in one program: 128 heads
    over 576-wide latents (V3.2's shape) need more shared memory than an H100 block has, so
    `auto` keeps the XLA reads on a GPU and naming the kernels is a config error saying so;
    a GPU with room for them (a target built for) takes the kernels."""
    wide = ("attention.n_heads=128", "attention.kv_lora_rank=512", "attention.qk_rope_dim=64")
    cfg = preset("dsa", *wide)
    assert registry.resolve(OP, cfg, "auto").on("cuda") == "xla"
    with pytest.raises(config.ConfigError, match=r"n_heads=128 over 576-wide.*shared memory"):
        preset("dsa", *wide, FUSED)
    roomy = dataclasses.replace(targets.load("h100"), gpu={
        **targets.load("h100").gpu, "shared_memory_per_block_optin": 2 << 20})
    with targets.building_for(roomy):
        assert registry.resolve(OP, cfg, "auto").on("cuda") == "pallas_gpu"


@pytest.mark.parametrize("name, overrides, key", [
    ("mha", ("attention.head_dim=24",), "attention.head_dim: 24"),
    ("mla", ("attention.v_head_dim=40",), "attention.v_head_dim: 40"),
    ("dsa", ("attention.kv_lora_rank=72",), "kv_lora_rank + attention.qk_rope_dim: 88, 72"),
    ("v41", ("attention.entry_dim=72",), "attention.entry_dim: 72"),
])
def test_a_head_dim_the_kernels_cannot_tile_is_a_config_error(name, overrides, key):
    with pytest.raises(config.ConfigError, match=re.escape(key) + ".*multiples of 16.*pallas_gpu"):
        preset(name, *overrides, FUSED)
    assert preset(name, *overrides).attention.impl == "xla"


def test_a_v4_training_step_through_the_kernels_lowers_for_cuda():
    """The whole loss-and-gradient program of a window + CSA stack, bfloat16, lowers for
    CUDA on this CPU with the reads as Triton kernels (forward, backward, entry mass) and
    no gather of picked entries around them: the kernels compile for the platform the
    program is lowered for, though the process's backend is the CPU."""
    cfg = case("csa", FUSED, "model.dtype=bfloat16")
    graph, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((1, 17), jnp.int32)

    def loss(params):
        return loss_fn(nnx.merge(graph, params), {"inputs": tokens[:, :-1],
                                                  "targets": tokens[:, 1:]}, 5)[0]

    text = jax.jit(jax.grad(loss)).trace(params).lower(
        lowering_platforms=("cuda",)).as_text()
    for kernel in ("dense_attention_fwd", "dense_attention_dq", "dense_attention_dkv"):
        assert kernel in text, kernel  # the window's read (SWA and CSA layers)
    # and the picks' forward, backward and entry mass (the CSA layer)
    assert text.count("xla.gpu.triton") >= 2 * 3 + 3


def _decode_step(name, *overrides, platform="cuda"):
    """(the config, the text of its bfloat16 decode step lowered for `platform`)."""
    cfg = case(name, *overrides, "model.dtype=bfloat16", "model.scan_layers=false")
    eng = lower.abstract_engine(cfg)
    cache = jax.eval_shape(lambda: eng.init_cache(2, 64))
    return cfg, generate.decode_program.trace(
        eng.graph, eng.state, jax.ShapeDtypeStruct((2,), jnp.int32), cache).lower(
        lowering_platforms=(platform,)).as_text()


def test_auto_lowers_kernels_for_a_gpu_and_the_reference_for_a_cpu():
    """`auto` and the kernels' compile mode follow the platform a program is lowered for,
    not the process's backend (the CPU here): one decode step has its attention and indexer
    kernels as Triton calls lowered for CUDA, and neither a kernel nor an interpreted one
    lowered for the CPU."""
    cfg, text = _decode_step("csa", "attention.impl=auto", platform="cuda")
    kernels = re.findall(r'\bname = "([^"]*)", num_stages', text)
    assert kernels.count("decode_attention") == cfg.model.n_layers
    assert "indexer_score" in kernels
    cpu = _decode_step("csa", "attention.impl=auto", platform="cpu")[1]
    assert "triton" not in cpu and "decode_attention" not in cpu


@pytest.mark.parametrize("name", ["csa", "mla", "dsa", pytest.param("v4", marks=pytest.mark.full),
                                  pytest.param("v41", marks=pytest.mark.full)])
def test_a_decode_step_reads_each_layer_in_one_decode_kernel(name):
    """A decode step, bfloat16, lowered for CUDA: every layer (a window with its ring, picks
    or every complete entry of a paged cache, MLA's contiguous latents, DSA's picked tokens)
    reads what it attends to in one decode kernel, and no other attention kernel runs."""
    cfg, text = _decode_step(name, FUSED)
    kernels = re.findall(r'\bname = "([^"]*)", num_stages', text)
    assert len(kernels) == text.count("xla.gpu.triton")  # every kernel named
    assert kernels.count("decode_attention") == cfg.model.n_layers
    assert set(kernels) <= {"decode_attention", "indexer_score"}  # and the indexer's scores


def test_an_mha_decode_step_reads_its_head_major_cache_by_dots():
    """MHA's decode step stays with XLA's dots over its head-major cache: no kernel, and no
    transposed copy of the cache [B, G, L, d] as the dense kernel's [B, L, G, d] keys."""
    cfg, text = _decode_step("mha", FUSED)
    assert "xla.gpu.triton" not in text
    a = cfg.attention
    kv_heads = a.n_kv_heads or a.n_heads
    assert f"tensor<2x64x{kv_heads}x{a.head_dim}xbf16>" not in text
