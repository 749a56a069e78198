"""Mixed precision (docs/design.md, "Precision"): `model.dtype` is the compute dtype,
`model.param_dtype` (default float32) the parameters' and so the optimizer moments'. Under
bfloat16 compute the weights and AdamW moments stay float32, the layers compute in bfloat16,
the softmax (with its sink), norms, indexer scores and losses are float32 islands, decode
reproduces the forward to bfloat16's rounding, and runs saved before `param_dtype` existed
restore as they were saved."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from dsattn import checkpoint, config, data, generate, migrations, train
from dsattn.attention import core, reference
from dsattn.bench.long_context import at_length, saved_residuals
from dsattn.model import Transformer
from tests.helpers import TINY_CONFIGS, forward, preset

BF16 = "model.dtype=bfloat16"
U = 2.0 ** -8  # bfloat16's unit roundoff: one rounding moves a value by at most U relative
FAMILIES = ["mha", "mla", "dsa", "v4", "v41"]


def _float_dtypes(tree):
    return {jnp.dtype(x.dtype).name for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_compute_keeps_float32_parameters_and_adamw_moments(name):
    """Every parameter and every AdamW moment is float32 under bfloat16 compute (shapes
    only: nothing is initialised); the logits come out of bfloat16 matmuls."""
    cfg = preset(name, BF16)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    params = nnx.to_pure_dict(params)
    opt_state = jax.eval_shape(train.make_optimizer(cfg).init, params)
    assert _float_dtypes(params) == {"float32"}
    assert _float_dtypes(opt_state) == {"float32"}
    tokens = jax.ShapeDtypeStruct((1, 40), jnp.int32)
    logits = jax.eval_shape(lambda p, t: nnx.merge(graphdef, p)(t), params, tokens)
    assert logits.dtype == jnp.bfloat16


def test_trainer_under_bf16_compute_steps_float32_weights(tmp_path):
    """A Trainer's parameters and AdamW moments (mu, nu) stay float32 through a step under
    bfloat16 compute, and the step's loss is finite."""
    cfg = preset("dsa", BF16, "model.n_layers=2", "model.d_model=32", "train.seq_len=32",
                 "train.batch_size=2", "train.warmup_steps=1", "data.max_bytes=20000")
    tr = train.Trainer(cfg, tmp_path / "run", quiet=True)
    batch = data.batch_at(tr.corpus.train, 0, 2, 32, cfg.train.seed)
    metrics = tr.train_step({k: jnp.asarray(v) for k, v in batch.items()}, 1)
    assert math.isfinite(float(metrics["loss"]))
    assert _float_dtypes(tr.params) == {"float32"}
    moments = [s for s in jax.tree.leaves(tr.opt_state, is_leaf=lambda s: hasattr(s, "mu"))
               if hasattr(s, "mu")]
    assert moments and all(_float_dtypes((s.mu, s.nu)) == {"float32"} for s in moments)


def test_float64_compute_keeps_float64_parameters():
    """Parameters are never narrower than the compute dtype: model.dtype=float64 alone (the
    decode == forward tests' setting) keeps exact float64 weights."""
    cfg = preset("v41", "model.dtype=float64")
    params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    assert _float_dtypes(params) == {"float64"}


def test_param_dtype_is_validated_naming_the_key():
    with pytest.raises(config.ConfigError, match="model.param_dtype: 'int8' is not one of"):
        preset("mha", "model.param_dtype=int8")


# -- decode == forward under bfloat16 compute ------------------------------------------------
# Every visible entry is selected (top_k and the V4.1 pool at least the visible count): the two
# paths' indexer scores differ by rounding, so a near-tie at the k-th place could select a
# different entry in each, an O(1) change of what is read rather than a rounding error. Top-k
# below the visible count is held exactly in float64 (tests/test_properties.py).
EVERY_ENTRY = {"mha": (), "gqa": (), "mla": (), "dsa": ("attention.top_k=64",),
               "v4": ("attention.top_k=16",),
               "v41": ("attention.top_k=64", "attention.pool_blocks=16")}
LENGTHS, N_DECODE, MAX_LEN = np.array([5, 30, 17]), 6, 48  # up to 36 positions, 9 CSA entries


@pytest.mark.parametrize("name", list(EVERY_ENTRY))
def test_decode_equals_forward_under_bf16_compute(name):
    """Prefill + decode steps give the forward's logits within bfloat16 rounding, at the
    preset's depth L.

    Tolerance, from U = 2^-8 and L (not fitted): a rounding is a uniform error of at most
    half a spacing, so of standard deviation at most U/sqrt(3) relative. The two paths
    round the final logits once each, and the residual stream at each of its 2L additions
    once each: 2 + 4L independent roundings, whose effect on a position's logits has an RMS
    over the vocabulary of at most sqrt(2 + 4L) * U/sqrt(3) times that position's logit RMS.
    We allow twice that per position, as headroom for the roundings inside each sublayer
    that this count leaves out, and for any single logit the worst case of every rounding
    adding up in one direction: (2 + 4L) * U times the largest logit. Reading one wrong context token moves
    logits by O(0.5) here, far outside both."""
    model = Transformer(preset(name, BF16, *EVERY_ENTRY[name]), rngs=nnx.Rngs(0))
    b, depth = len(LENGTHS), model.cfg.model.n_layers
    toks = np.random.RandomState(0).randint(0, 256, (b, LENGTHS.max() + N_DECODE))
    full = np.asarray(forward(model, toks), np.float64)
    cache = generate.init_cache(model, b, MAX_LEN)
    logits, cache = generate.prefill(model, toks[:, : LENGTHS.max()], LENGTHS, cache)
    got, want = [logits], [full[np.arange(b), LENGTHS - 1]]
    for s in range(N_DECODE):
        logits, cache = generate.decode_step(model, toks[np.arange(b), LENGTHS + s], cache)
        got.append(logits)
        want.append(full[np.arange(b), LENGTHS + s])
    assert logits.dtype == jnp.bfloat16
    got, want = np.stack([np.asarray(g, np.float64) for g in got]), np.stack(want)
    rms = lambda a: np.sqrt(np.mean(a ** 2, axis=-1))  # noqa: E731  (per position)
    per_position = 2 * math.sqrt(2 + 4 * depth) * U / math.sqrt(3)
    assert np.all(rms(got - want) <= per_position * rms(want)), (
        np.max(rms(got - want) / rms(want)), per_position)
    assert np.max(np.abs(got - want)) <= (2 + 4 * depth) * U * np.max(np.abs(want))


# -- float32 islands ----------------------------------------------------------------------
def _sink_case():
    """q [1, 1, 2, 4] and entries [1, 3, 4] of bfloat16 values whose scores (scale 1/2) are
    256.5, 257.5 and 258.75: exact in float32, not representable in bfloat16 (spacing 2
    there), like the sink 257.25."""
    q = jnp.asarray([[[[2.0, 2.0, 0, 0], [2.0, 2.0, 0, 0]]]], jnp.bfloat16)
    entries = jnp.asarray([[[256.0, 0.5, 1, 0], [256.0, 1.5, 0, 1], [256.0, 2.75, 1, 1]]],
                          jnp.bfloat16)
    scores = np.array([256.5, 257.5, 258.75])
    return q, entries, scores, 257.25


@pytest.mark.parametrize("entry_block", [None, 1])  # one softmax; the online softmax
def test_sink_softmax_is_a_float32_island_under_bf16(entry_block):
    """The sink is a float32 parameter under bfloat16 compute and the softmax over [scores |
    sink] runs in float32: probabilities equal the float64 reference to float32's precision,
    where a bfloat16 softmax (scores and sink rounded to 256/258) would be off by factors of
    e^0.5. The online softmax's running max and sum (entry_block=1) as well; its output is
    the weighted sum of bfloat16 entries, to bfloat16's rounding."""
    cfg = preset("v4", BF16)
    out_mod = core.SinkAttentionOutput(cfg, nnx.Rngs(0))
    q, entries, scores, sink = _sink_case()
    out_mod.sink[...] = jnp.full(out_mod.sink.shape, sink)
    heads = out_mod.sink.shape[0]
    q = jnp.broadcast_to(q[:, :, :1], (1, 1, heads, 4))
    mask = jnp.ones((1, 1, 3), bool)
    out, probs = reference.block_attention(q, [(entries, mask)], out_mod.sink[...], entry_block)
    e = np.exp(np.append(scores, sink) - scores.max())
    p_ref = (e / e.sum())[:3]
    if entry_block is None:
        np.testing.assert_allclose(np.asarray(probs[0][0, 0], np.float64),
                                   np.broadcast_to(p_ref, (heads, 3)), rtol=1e-6)
    want = p_ref @ np.asarray(entries[0], np.float64)
    np.testing.assert_allclose(np.asarray(out[0, 0], np.float64),
                               np.broadcast_to(want, (heads, 4)), rtol=4 * U, atol=4 * U)


def _correctly_rounded(got, want):
    """|got - want| within half a bfloat16 spacing of got (plus float32 noise): `got` is
    `want` rounded once."""
    got = np.asarray(got, np.float64)
    up = np.asarray(jnp.nextafter(jnp.abs(jnp.asarray(got, jnp.bfloat16)),
                                  jnp.asarray(np.inf, jnp.bfloat16)), np.float64)
    half_spacing = (up - np.abs(got)) / 2
    return np.abs(got - want) <= half_spacing * (1 + 1e-4) + 1e-6 * np.abs(want)


def test_norms_are_float32_islands_rounded_once_under_bf16():
    """RMSNorm (the final norm) and LayerNorm (DSA's indexer key norm) of bfloat16 inputs
    with an outlier, float32 weights that bfloat16 cannot hold (1 + 3·2^-9): statistics,
    scaling and the weight's product in float32, one rounding to bfloat16 at the end. Every
    output is the float64 reference rounded once."""
    model = Transformer(preset("dsa", BF16, "model.n_layers=1", "model.scan_layers=false"),
                        rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 128))
    x[:, :, 3] = 300.0  # its square dominates the mean: the others need float32 sums
    xb = jnp.asarray(x, jnp.bfloat16)
    x = np.asarray(xb, np.float64)
    norm = model.norm
    w = 1 + 3 * 2.0 ** -9 + rng.uniform(0, 1e-3, 128)
    norm.weight[...] = jnp.asarray(w, jnp.float32)
    w = np.asarray(norm.weight[...], np.float64)
    eps = model.cfg.model.norm_eps
    want = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w
    got = norm(xb)
    assert got.dtype == jnp.bfloat16 and np.all(_correctly_rounded(got, want))

    ln = model.blocks[0].attn.k_norm
    d = ln.weight.shape[0]
    ln.weight[...] = jnp.asarray(w[:d], jnp.float32)
    ln.bias[...] = jnp.full((d,), 2.0 ** -10, jnp.float32)
    xs, xsb = x[..., :d], xb[..., :d]
    mu = xs.mean(-1, keepdims=True)
    want = (xs - mu) / np.sqrt(((xs - mu) ** 2).mean(-1, keepdims=True) + eps) * w[:d] + 2.0 ** -10
    got = ln(xsb)
    assert got.dtype == jnp.bfloat16 and np.all(_correctly_rounded(got, want))


# -- residuals ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_compute_halves_what_the_backward_pass_keeps(name):
    """The training step's saved residuals (the remat policy keeps the weight matmuls'
    outputs) are bfloat16 under bfloat16 compute with float32 weights: at most 0.6x float32's
    bytes, and the only float32 ones are the islands outside the rematerialised blocks: the
    cross-entropy's [T, V] exponentials, the final norm's float32 input and scaled output
    ([T, D] each) and a few per-position scalars. A weight used outside its layer and not
    cast (MLA's W^UK/W^UV were) promotes a layer's matmuls to float32 and breaks both."""
    t, path = 512, f"{TINY_CONFIGS}/{name}.yaml"
    f32 = saved_residuals(at_length(path, t, "model.dtype=float32"), t)
    bf16 = saved_residuals(at_length(path, t, BF16, "model.param_dtype=float32"), t)
    assert sum(bf16.values()) <= 0.6 * sum(f32.values()), (bf16, f32)
    m = preset(name).model
    assert bf16.get("float32", 0) <= 4 * (t * m.vocab_size + 2 * t * m.d_model + 4 * t), bf16


# -- runs saved before param_dtype ------------------------------------------------------------
def test_old_bf16_config_upgrades_to_bf16_parameters():
    raw = {"model": {"dtype": "bfloat16", "scan_layers": True}, "attention": {"entry_dim": 8}}
    assert migrations.upgrade_saved(raw)["model"]["param_dtype"] == "bfloat16"
    raw["model"]["param_dtype"] = "float32"  # said explicitly: kept
    assert migrations.upgrade_saved(raw)["model"]["param_dtype"] == "float32"


def test_run_saved_before_param_dtype_with_bf16_restores_as_saved(tmp_path):
    """A run directory written before `model.param_dtype` existed, with model.dtype=bfloat16,
    holds bfloat16 parameters; its config.yaml has no param_dtype. It loads with them as
    bfloat16, bit for bit, and computes the logits it computed then."""
    run = tmp_path / "old-bf16"
    cfg = preset("mha", BF16, "model.param_dtype=bfloat16", "model.n_layers=1",
                 "model.d_model=32", "train.seq_len=16", "train.batch_size=2", "train.steps=1",
                 "train.ckpt_every=1", "train.eval_every=1000", "data.max_bytes=20000")
    tr = train.Trainer(cfg, run, quiet=True)
    tr.run()
    saved_params = jax.tree.map(np.asarray, tr.params)
    raw = yaml.safe_load((run / "config.yaml").read_text())
    del raw["model"]["param_dtype"]  # as the earlier version wrote it
    (run / "config.yaml").write_text(yaml.safe_dump(raw))

    model, loaded_cfg, step = checkpoint.load_params(run)
    assert loaded_cfg.model.param_dtype == "bfloat16" and step == 1
    restored = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    assert _float_dtypes(restored) == {"bfloat16"}
    jax.tree.map(np.testing.assert_array_equal, restored, saved_params)
    toks = np.arange(16)[None] % 256
    before = nnx.merge(tr.graphdef, tr.params)
    np.testing.assert_array_equal(np.asarray(forward(model, toks), np.float32),
                                  np.asarray(forward(before, toks), np.float32))


# A dot_general in StableHLO text: its contracting dims, operand and result types.
_DOT = re.compile(r"stablehlo\.dot_general .*?contracting_dims = \[([\d, ]*)\] x .*?"
                  r":\s*\(tensor<([^>]*)>, tensor<([^>]*)>\)\s*->\s*tensor<([^>]*)>")


def _dot_flops_by_operand_dtype(text: str) -> dict:
    """FLOPs (2 x output size x contraction size) of every dot in a lowered program, summed
    by (lhs, rhs) element type."""
    out: dict = {}
    for line in text.splitlines():
        if "dot_general" not in line:
            continue
        m = _DOT.search(line)
        assert m, line
        lhs, res = m.group(2).split("x"), m.group(4).split("x")
        k = math.prod(int(lhs[int(i)]) for i in m.group(1).split(",") if i.strip())
        key = (lhs[-1], m.group(3).split("x")[-1])
        out[key] = out.get(key, 0) + 2 * math.prod(map(int, res[:-1])) * k
    return out


@pytest.mark.parametrize("name, platform", [(n, "cuda") for n in FAMILIES] + [("v41", "tpu")])
def test_accelerator_training_matmuls_run_in_bfloat16(name, platform):
    """The training step lowered for a GPU or TPU under bfloat16 compute does its matmuls on
    bfloat16 operands, the backward's dQ/dK too (attention scores accumulate in float32, and
    autodiff would run their transposes in float32). What stays float32 is the indexer's
    head-weighted sum of its ReLU scores (a decision: a float32 island), under 0.5% of the
    FLOPs."""
    cfg = preset(name, BF16, "indexer.dense_warmup_steps=0")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

    def grads(p, batch):
        return jax.grad(lambda p: train.loss_fn(nnx.merge(graphdef, p), batch, 0)[0])(p)

    tokens = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    text = jax.jit(grads).trace(params, {"inputs": tokens, "targets": tokens}).lower(
        lowering_platforms=(platform,)).as_text()
    flops = _dot_flops_by_operand_dtype(text)
    assert set(flops) <= {("bf16", "bf16"), ("f32", "f32")}, flops
    assert flops.get(("f32", "f32"), 0) <= 0.005 * sum(flops.values()), flops


def test_wide_product_backward_runs_in_the_inputs_dtype():
    """Scores accumulate in float32; their gradient takes dS in bfloat16 (as flash attention
    does), within bfloat16's rounding of the float32 gradient, and at float32 it is the plain
    product's gradient."""
    from functools import partial
    from dsattn.attention.common import wide_product

    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.float32) for _ in range(2))
    ct = jnp.asarray(rng.standard_normal((2, 8, 8)), jnp.float32)
    product = partial(jnp.einsum, "btd,bsd->bts")

    def vjp(f, *args):
        out, back = jax.vjp(f, *args)
        return out, back(ct.astype(out.dtype))

    out, (dq, dk) = vjp(lambda a, b: wide_product(product, a, b),
                        q.astype(jnp.bfloat16), k.astype(jnp.bfloat16))
    assert out.dtype == jnp.float32 and dq.dtype == dk.dtype == jnp.bfloat16
    ref_out, (ref_dq, ref_dk) = vjp(lambda a, b: product(a, b), q.astype(jnp.bfloat16)
                                    .astype(jnp.float32), k.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-6)  # float32 accumulation
    # Two roundings to bf16: dS (each term of the sum moves by at most U of its size) and
    # the result (U of its own): |error| <= U * (|dS|·|other operand|) + U * |result|.
    a_q, a_k, a_ct = (np.abs(np.asarray(x, np.float32)) for x in (q.astype(jnp.bfloat16),
                                                                    k.astype(jnp.bfloat16), ct))
    bounds = (np.einsum("bts,bsd->btd", a_ct, a_k), np.einsum("bts,btd->bsd", a_ct, a_q))
    for got, ref, bound in ((dq, ref_dq, bounds[0]), (dk, ref_dk, bounds[1])):
        err = np.abs(np.asarray(got, np.float32) - np.asarray(ref))
        assert np.all(err <= U * bound + U * np.abs(np.asarray(ref)) + 1e-6), err.max()
    out32, grads32 = vjp(lambda a, b: wide_product(product, a, b), q, k)
    plain32, plain_grads = vjp(lambda a, b: product(a, b, preferred_element_type=jnp.float32), q, k)
    np.testing.assert_array_equal(out32, plain32)
    for got, ref in zip(grads32, plain_grads):
        np.testing.assert_array_equal(got, ref)


def test_precision_parity_bench_trains_both_dtypes_on_the_same_batches():
    """scripts/bench.py --precision's rows: each dtype's validation loss after training, the
    relative difference between them, and the residual ratio, from the same data."""
    from dsattn.bench import precision

    (row,) = precision.parity(TINY_CONFIGS, ["mha"], 2, "model.n_layers=1",
                              "train.batch_size=2", "train.seq_len=32", "train.eval_batches=1",
                              residual_len=256, log=lambda line: None)
    assert row["val_loss_bfloat16"] != row["val_loss_float32"]  # two dtypes really ran
    assert row["val_loss_rel_diff"] == pytest.approx(
        row["val_loss_bfloat16"] / row["val_loss_float32"] - 1)
    assert abs(row["val_loss_rel_diff"]) < 0.02  # two steps from the same initial weights
    assert row["residual_ratio"] < 0.75  # one layer: the float32 loss is a larger share


def test_largest_batch_is_the_largest_that_fits():
    """bench --fit-gib: the batch it extrapolates from batch 1 and 2 fits the budget by the
    compiled step's own memory analysis, and one more row does not."""
    from dsattn.bench.long_context import largest_batch, train_step_memory

    cfg = at_length(f"{TINY_CONFIGS}/mha.yaml", 128, "model.n_layers=1")
    total = lambda b: sum(train_step_memory(cfg, 128, b).values())  # noqa: E731
    budget = total(3) + (total(4) - total(3)) // 2
    assert largest_batch(cfg, 128, budget)["largest_batch"] == 3
    assert total(3) <= budget < total(4)
