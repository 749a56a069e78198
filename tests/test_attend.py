"""The attention-implementation seam: every family's reads go through `attend.attend` and the
registry, so an implementation registered from outside (here, the contract's adapter over
plain-jnp stand-ins for the fused kernels, written independently of the reference) runs
every read of training and of cached execution with the reference's loss, gradients and
logits; and the config names only registered implementations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import config, generate
from dsattn.attention import attend, fused, reads
from dsattn.attention.local import Window
from dsattn.kernels import registry
from dsattn.model import Transformer
from dsattn.trainstep import loss_fn
from tests.helpers import preset

OP = registry.Op.ATTENTION


# -- stand-ins for the contract's kernels: whole rows at once, plain softmax ------------------
def _softmax_lse(s, sink):
    """(probabilities, lse) of masked scores s [B, T, H, S] (-inf: masked), the sink [H] in
    the denominator; a row that sees nothing has p = 0 and lse = -inf."""
    m = jnp.max(s, -1, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, sink[:, None])
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0))
    total = jnp.sum(jnp.exp(s - m), -1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink[:, None] - m)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1)) + m, -jnp.inf)
    p = jnp.where(total > 0, jnp.exp(s - jnp.where(total > 0, lse, 0)), 0)
    return p, lse[..., 0]


def dense(q, k, v, *, scale, q_positions, k_positions, causal=True, window=None, sink=None,
          k_valid=None):
    g = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(a, g, axis=2) for a in (k, v))
    s = jnp.einsum("bthd,bshd->bths", q, k) * scale
    ok = jnp.ones(s.shape[:2] + s.shape[3:], bool) if k_valid is None else \
        jnp.broadcast_to(k_valid[:, None], s.shape[:2] + s.shape[3:])
    dist = q_positions[:, :, None] - k_positions[:, None, :]
    if causal:
        ok = ok & (dist >= 0)
    if window is not None:
        ok = ok & (dist < window)
    p, lse = _softmax_lse(jnp.where(ok[:, :, None], s, -jnp.inf), sink)
    return jnp.einsum("bths,bshd->bthd", p, v), lse


def _picked(store, idx):
    n = store.shape[1]
    ok = (idx >= 0) & (idx < n)
    rows = jnp.arange(store.shape[0])[:, None, None]
    return store[rows, jnp.clip(idx, 0, n - 1)], ok


def sparse(q, store, idx, *, scale, sink=None, value=None):
    keys, ok = _picked(store, idx)
    vals = keys if value is None else _picked(value, idx)[0]
    s = jnp.einsum("bthc,btkc->bthk", q, keys) * scale
    p, lse = _softmax_lse(jnp.where(ok[:, :, None], s, -jnp.inf), sink)
    return jnp.einsum("bthk,btkc->bthc", p, vals), lse


def entry_mass(q, store, idx, lse, *, scale):
    keys, ok = _picked(store, idx)
    s = jnp.einsum("bthc,btkc->bthk", q, keys) * scale
    p = jnp.where(ok[:, :, None] & jnp.isfinite(lse)[..., None],
                  jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
    return jax.lax.stop_gradient(p.sum(axis=2))


run_contract = fused.adapter(dense, sparse, entry_mass)


@pytest.fixture(scope="module")
def stand_in():
    """The adapter over the stand-ins, registered as an implementation for this module."""
    registry.register(registry.Implementation(OP, "contract_stand_in",
                                              f"{__name__}:run_contract"))
    yield "contract_stand_in"
    registry.unregister(OP, "contract_stand_in")


TWO = ("model.n_layers=2",)
CASES = {  # name: (preset, overrides); blocks of 8 queries over 24 tokens: causal segments
    "mha": ("mha", TWO), "gqa": ("gqa", TWO), "mla": ("mla", TWO),
    "dsa": ("dsa", (*TWO, "attention.top_k=4")),
    # a window, picks, the sink and the KL loss in one layer
    "csa": ("v4", (*TWO, "attention.layers=swa, csa", "attention.top_k=2",
                   "attention.window=4")),
    "v4": ("v4", ("model.n_layers=3", "attention.layers=swa, csa, hca",
                  "attention.hca_ratio=4", "attention.top_k=2", "attention.window=4")),
    # full (its pool) -> reindex (scores the pool) -> reuse
    "v41": ("v41", ("model.n_layers=4", "attention.ced_split=0", "attention.window=4",
                    "attention.layers=swa, full, reindex, reuse",
                    "attention.ratios=0, 2, 2, 2", "attention.top_k=3",
                    "attention.pool_blocks=2", "attention.pool_block_size=2")),
}
SHORT = ("model.dtype=float64", "attention.query_block=8")
# The model-level checks are the full tier's (each compiles a stack twice); the fast tier
# keeps their promise with one read through both implementations below.


def case(name, *overrides):
    base, own = CASES[name]
    return preset(base, *SHORT, *own, *overrides)


def _loss_and_grads(cfg, tokens, steps):
    """(metrics, gradients) of the loss at each training step of `steps` (one compile)."""
    graph, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    def loss(params, step):
        return loss_fn(nnx.merge(graph, params), {"inputs": tokens[:, :-1],
                                                  "targets": tokens[:, 1:]}, step)

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return [(metrics, grads) for (_, metrics), grads in
            (grad(params, jnp.int32(step)) for step in steps)]


def _families(fast):
    """The cases, those not in `fast` in the full tier."""
    return [n if n in fast else pytest.param(n, marks=pytest.mark.full) for n in CASES]


def sink_read_grads(impl, dense):
    """(gradients, (output, KL loss)) of one V4-style read through `impl` (a registered
    attention function): picked entries of a store (or, with `dense`, every complete one),
    a window of 3, the sink and the indexer's KL target, in blocks of 4 queries, jitted."""
    rng = np.random.RandomState(0)
    b, t, h, c, n = 2, 10, 2, 16, 5  # entries of stride 2
    q, kv, entries = (jnp.asarray(rng.randn(*s)) for s in ((b, t, h, c), (b, t, c), (b, n, c)))
    sink = jnp.asarray([0.3, -0.5])
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    idx = jnp.asarray(rng.randint(0, n, (b, t, 3)), jnp.int32)
    sel = reads.Selection(idx, idx < ((positions + 1) // 2)[..., None],
                          None if dense is None else jnp.asarray(dense))
    target = reads.KLTarget(jnp.asarray(rng.randn(b, t, 2, 4)), jnp.asarray(rng.rand(b, t, 2)))
    keys = jnp.asarray(rng.randn(b, n, 4))

    def loss(q, kv, entries, sink):
        store = reads.Entries({"entry": entries, "key": keys})
        read = attend.Read(q, positions, jnp.ones((b, t), bool),
                           (reads.Picked(store, sel, 2), Window.of_sequence(kv, positions, 3)),
                           sink, target, attend.Layout.SHARED, c ** -0.5, 4, q.dtype)
        out, (kl, _) = impl(read, lambda q: q, lambda o, pos: o)
        return jnp.sum(out * jnp.cos(out)) + kl, (out, kl)

    return jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))(q, kv, entries, sink)


@pytest.mark.parametrize("dense", [None, True])  # picks; the dense warm-up's full read
def test_a_sink_read_through_the_adapter_equals_the_reference(dense):
    """One V4-style read by the adapter over the stand-ins and by the reference: the same
    output, KL loss and gradients."""
    want, got = (sink_read_grads(impl, dense) for impl in (registry.load(OP, "xla"),
                                                           run_contract))
    assert float(want[1][1]) > 0  # a KL loss to compare
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12),
                 got, want)


def train_steps(name, *overrides):
    """[(metrics, gradients)] of case `name` at step 0 (the indexer's dense warm-up) and
    step 5 (its picks)."""
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 256, (2, 25)), jnp.int32)
    return _loss_and_grads(case(name, "indexer.dense_warmup_steps=3", *overrides), tokens,
                           (0, 5))


def decode_logits(name, *overrides):
    """Logits of a ragged prefill (rows of 11 and 20 tokens) and two decode steps."""
    toks = np.random.RandomState(2).randint(0, 256, (2, 24))
    cfg = case(name, *overrides)
    eng = generate.engine(Transformer(cfg, rngs=nnx.Rngs(0)))
    cache = generate.init_cache(cfg, 2, 32)
    out, cache = generate.prefill(eng, toks[:, :20], [11, 20], cache)
    outs = [out]
    for s in range(2):
        out, cache = generate.decode_step(eng, toks[:, 20 + s], cache)
        outs.append(out)
    return np.stack(outs)


@pytest.mark.parametrize("name", _families(set()))
def test_registered_implementation_trains_as_the_reference(stand_in, name):
    """Loss (with the indexer's KL loss), and every gradient, equal through either
    implementation; step 0 reads densely under the indexer's warm-up, step 5 its picks."""
    runs = [train_steps(name, *impl) for impl in ((), (f"attention.impl={stand_in}",))]
    for step, want, got in zip((0, 5), *runs):
        for key in want[0]:
            np.testing.assert_allclose(got[0][key], want[0][key], rtol=1e-10, atol=1e-12,
                                       err_msg=f"{name} step {step}: {key}")
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-11),
                     got[1], want[1])


@pytest.mark.parametrize("name", _families(set()))
def test_registered_implementation_decodes_as_the_reference(stand_in, name):
    """Prefill (ragged rows) and decode steps give the reference's logits."""
    np.testing.assert_allclose(decode_logits(name, f"attention.impl={stand_in}"),
                               decode_logits(name), rtol=1e-10, atol=1e-12)


def test_impl_names_come_from_the_registry(stand_in):
    assert preset("mha").attention.impl == registry.reference(OP)
    assert preset("mha", f"attention.impl={stand_in}").attention.impl == stand_in
    with pytest.raises(config.ConfigError, match="attention.impl: 'flash' is not one of"):
        preset("mha", "attention.impl=flash")
    # auto takes a kernel only where it runs compiled; the stand-in names no platform
    auto = registry.resolve(OP, preset("mha"), "auto")
    assert stand_in not in auto.names() and auto.on("cpu") == registry.reference(OP)
    assert registry.resolve(OP, preset("mha"), stand_in) == registry.Choice(stand_in)


def test_auto_skips_a_kernel_that_does_not_fit():
    """`auto` passes over a kernel for a platform whose fit check refuses the config; the
    same kernel named explicitly is a config error naming the reason."""
    why = "attention.window: the stand-in needs 8"
    registry.register(registry.Implementation(
        OP, "picky", f"{__name__}:run_contract", ("rocm",),
        misfit=lambda cfg: None if cfg.attention.window == 8 else why))
    try:
        assert preset("v4").attention.window != 8
        assert registry.resolve(OP, preset("v4"), "auto").on("rocm") == registry.reference(OP)
        fits = registry.resolve(OP, preset("v4", "attention.window=8"), "auto")
        assert fits.on("rocm") == "picky" and fits.on("cpu") == registry.reference(OP)
        with pytest.raises(config.ConfigError, match=why):
            preset("v4", "attention.impl=picky")
    finally:
        registry.unregister(OP, "picky")
