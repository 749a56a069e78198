"""Attention by query blocks (attention/blocks.py, reads.py) against the dense formulation.

The training forward reads, per block of queries, a slice of the window and the gathered
picks, and the indexer's top-k runs over key blocks with a running merge. These tests hold it
to the dense path it replaced: [T, T] window masks, a [T, n] indexer score, a top-k over it
and one softmax over [entries | window] (assembled here from the layer's own parts and the
dense helpers), in float64 to 1e-12, with block sizes that do not divide T and blocks larger
than T; and a whole model's loss and gradients for any block sizes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsattn import train
from dsattn.attention import blocks, indexer
from dsattn.attention.context import StackContext
from dsattn.attention.reference import block_attention as attend
from dsattn.cache import ring
from dsattn.model import Transformer
from dsattn.nn.rope import apply_rope_last
from tests.helpers import ROOT, loss_and_grads, preset

T = 45


def _dense_v4_layer(attn, x, positions):
    """The V4 layer's training forward as dense masks: (output, indexer KL or None)."""
    q, qr = attn.query(x, positions, attn.theta)
    kv = attn.local(x, positions, attn.theta)
    parts = [(kv, ring.window_mask(positions, positions, attn.window))]
    n = x.shape[1] // attn.ratio
    visible = jnp.arange(n) < ((positions + 1) // attn.ratio)[..., None]
    store, _ = attn.source(x, StackContext(), n)
    entries = store.fields["entry"]
    score = None
    if "key" in store.fields:  # csa: top-k of the dense [T, n] indexer score
        iq, w = attn.selector.index_q(qr, x, positions, attn.theta)
        score = indexer.scores(iq, w, store.fields["key"])
        mask = indexer.selection_mask(*indexer.select(score, visible, attn.selector.top_k), n)
    else:  # hca: every complete entry
        mask = visible
    parts.insert(0, (entries, mask))
    o, probs = attend(q, parts, attn.core.sink[...])
    o = apply_rope_last(o.astype(q.dtype), positions, attn.theta, attn.rope_dim, inverse=True)
    kl = None if score is None else indexer.kl_loss(score, probs[0].sum(axis=2), mask)
    return attn.core.out(o), kl


@pytest.mark.parametrize("kind", ["csa", "hca"])
@pytest.mark.parametrize("blocks", [(7, 5), (64, 4096)])
def test_v4_layer_by_blocks_equals_the_dense_path(kind, blocks):
    qb, kb = blocks
    cfg = preset("v4", "model.dtype=float64", f"attention.layers={kind}", "model.n_layers=1",
                 "attention.top_k=3", "attention.window=6", "attention.hca_ratio=4",
                 f"attention.query_block={qb}", f"indexer.key_block={kb}",
                 "model.scan_layers=false")
    attn = Transformer(cfg, rngs=nnx.Rngs(3)).blocks[0].attn
    x = jax.random.normal(jax.random.key(0), (2, T, cfg.model.d_model), jnp.float64)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    y, aux, _ = attn(x, positions)
    want, kl = _dense_v4_layer(attn, x, positions)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
    if kl is not None:
        np.testing.assert_allclose(aux["indexer_loss"], cfg.indexer.loss_weight * kl,
                                   rtol=1e-12, atol=1e-12)


def _loss_and_grads(name, *overrides, step=None):
    cfg = preset(name, "model.dtype=float64", *overrides)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    toks = jax.random.randint(jax.random.key(2), (2, T + 1), 0, cfg.model.vocab_size)
    return loss_and_grads(model, {"inputs": toks[:, :-1], "targets": toks[:, 1:]}, step)


V4_SHORT = ("model.n_layers=3", "attention.layers=swa, csa, hca")  # one layer of each kind
# every V4.1 kind: an encoder (swa, full, reuse) and a decoder (full building the candidate
# pool from the encoder's output, reindex reading it)
V41_SHORT = ("model.n_layers=5", "attention.layers=swa, full, reuse, full, reindex",
             "attention.ratios=0, 2, 2, 1, 1", "attention.ced_split=3")


@pytest.mark.parametrize("name, extra", [
    ("v4", V4_SHORT), ("v41", V41_SHORT), ("dsa", ("attention.top_k=5", "model.n_layers=2")),
    ("mla", ("model.n_layers=2",)), ("mha", ("model.n_layers=2",))])
def test_loss_and_gradients_do_not_depend_on_block_sizes(name, extra):
    one, g_one = _loss_and_grads(name, *extra)  # T < 512: a single block
    blk, g_blk = _loss_and_grads(name, *extra, "attention.query_block=8",
                                 "indexer.key_block=3", "attention.entry_block=5")
    for key in one:
        np.testing.assert_allclose(blk[key], one[key], rtol=1e-12, atol=1e-12, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12),
                 g_blk, g_one)


def test_dense_warmup_reads_every_complete_entry_by_blocks():
    """While step < dense_warmup_steps the indexer layers attend to every visible entry; by
    blocks as in one block, and differently from the sparse steps."""
    warm, g_warm = _loss_and_grads("v4", *V4_SHORT, "attention.top_k=2", step=0)
    warm_blk, g_warm_blk = _loss_and_grads("v4", *V4_SHORT, "attention.top_k=2",
                                           "attention.query_block=8", "indexer.key_block=3",
                                           step=0)
    sparse, _ = _loss_and_grads("v4", *V4_SHORT, "attention.top_k=2", step=10_000)
    np.testing.assert_allclose(warm_blk["loss"], warm["loss"], rtol=1e-12)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12),
                 g_warm_blk, g_warm)
    assert abs(float(warm["ce"]) - float(sparse["ce"])) > 1e-6


def test_running_top_k_equals_one_top_k_with_ties():
    """Key blocks merged by a running top-k pick what one top-k over every score picks, ties
    to the lowest index (ReLU makes exact zeros common), with block maxima for the pool."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 9, 3, 8)))
    w = jnp.asarray(rng.normal(size=(2, 9, 3)))
    keys = jnp.asarray(rng.normal(size=(2, 50, 8)))
    keys = keys.at[:, 10:30].set(keys[:, 5:6])  # many equal keys: tied scores
    stored = jnp.arange(50) < jnp.asarray([[50], [41]])
    n_vis = jnp.asarray(rng.integers(0, 51, size=(2, 9)))
    visible = stored[:, None, :] & (jnp.arange(50) < n_vis[..., None])
    score = indexer.scores(q, w, keys)
    want_idx, want_ok = indexer.select(score, visible, 7)
    want_max = indexer.block_scores(jnp.where(visible, score, -jnp.inf), visible, 4)
    for key_block in (3, 8, 50, 64):
        idx, ok, maxima = indexer.top_k(q, w, keys, stored, n_vis, 7, key_block, block_max=4)
        np.testing.assert_array_equal(ok, want_ok)
        np.testing.assert_array_equal(jnp.where(ok, idx, -1), jnp.where(want_ok, want_idx, -1))
        np.testing.assert_array_equal(maxima, want_max)


@pytest.mark.parametrize("remat, layers", [
    ("model.remat=block", ("model.n_layers=3", "attention.layers=csa*3")),  # a scanned group
    ("model.remat=dots_with_no_batch_dims_saveable", V4_SHORT),  # unrolled blocks
    (f"model.remat_block_from={T}", V4_SHORT)])  # the default policy, block by length
def test_remat_changes_no_number(remat, layers):
    """model.remat recomputes blocks in the backward pass instead of keeping them: the same
    loss and gradients (a scanned group and unrolled blocks)."""
    base = ("attention.top_k=2", *layers, "attention.query_block=16")
    want, g_want = _loss_and_grads("v4", *base, "model.remat=none", step=0)
    got, g_got = _loss_and_grads("v4", *base, remat, step=0)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-12)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12),
                 g_got, g_want)


@pytest.mark.parametrize("name, extra", [("v4", V4_SHORT), ("mha", ("model.n_layers=2",))])
def test_training_step_memory_grows_linearly_with_the_sequence(name, extra):
    """The compiled training step's temporaries (XLA's memory analysis, from shapes alone) at
    4x the tokens are at most ~4x, not 16x: no [T, T] mask, [T, H, S] probabilities or
    per-head indexer scores."""
    from dsattn.bench import long_context

    blocks = ("attention.query_block=64", "indexer.key_block=128", *extra)
    temp = [long_context.train_step_memory(
        long_context.at_length(f"{ROOT}/configs/tiny/{name}.yaml", t, *blocks), t)["temp_bytes"]
        for t in (512, 2048)]
    assert temp[1] <= 4.6 * temp[0], temp


@pytest.mark.parametrize("scan", [True, False])
def test_long_sequences_rematerialise_whole_blocks(scan):
    """From model.remat_block_from tokens on, the training step rematerialises whole blocks
    whatever model.remat names (a scanned group and unrolled blocks): it needs what
    model.remat=block needs, less than the default policy by at least the FFN's gate or up
    activations ([T, F]) of every layer, which the default keeps."""
    from dsattn.bench import long_context

    t, layers, ffn = 1024, 3, 384

    def temp(*overrides):
        cfg = long_context.at_length(
            f"{ROOT}/configs/tiny/mha.yaml", t, f"model.n_layers={layers}",
            f"model.ffn_hidden={ffn}", f"model.scan_layers={str(scan).lower()}",
            "attention.query_block=64", *overrides)
        return long_context.train_step_memory(cfg, t)["temp_bytes"]

    default = temp(f"model.remat_block_from={t + 1}")
    by_length = temp(f"model.remat_block_from={t}")
    block = temp("model.remat=block", f"model.remat_block_from={t + 1}")
    assert by_length <= 1.01 * block, (by_length, block)
    assert default - by_length > layers * t * ffn * 4, (default, by_length)


def test_remat_frees_each_unrolled_blocks_internals():
    """With model.remat=block an unrolled block keeps only its input for the backward pass:
    each extra layer adds its [T, D] input and its weights' gradient and update buffers to
    the compiled step's temporaries, not the layer's internals (XLA:CPU merged a
    straight-line recomputation with the forward pass it repeats, so remat kept everything:
    24 [T, D] arrays per layer here, against 5 now)."""
    from dsattn.bench import long_context

    t, d, ffn = 1024, 128, 384
    temp = [long_context.train_step_memory(long_context.at_length(
        f"{ROOT}/configs/tiny/mha.yaml", t, "model.scan_layers=false", "model.remat=block",
        f"model.n_layers={n}", f"model.d_model={d}", f"model.ffn_hidden={ffn}",
        "attention.n_heads=4", "attention.n_kv_heads=4", "attention.head_dim=32"),
        t)["temp_bytes"] for n in (2, 4)]
    per_layer = (temp[1] - temp[0]) / 2
    layer_params = 4 * d * d + 3 * d * ffn  # wq, wk, wv, wo; the SwiGLU's three matrices
    assert per_layer <= 4 * (2 * t * d + 3 * layer_params), (temp, per_layer / (t * d * 4))


def test_remat_recomputes_the_ffn_a_block_of_tokens_at_a_time():
    """Under model.remat=block the FFN of a long sequence runs by blocks of tokens, so the
    backward pass that recomputes it holds one block's hidden activations: doubling the FFN
    width adds less than one whole-sequence [T, F] array to the training step's temporaries
    (the whole-sequence FFN held 7.8 of them: gate, up, their product and its gradients)."""
    from dsattn.bench import long_context

    t, d, f = 2048, 32, 1024
    temp = [long_context.train_step_memory(long_context.at_length(
        f"{ROOT}/configs/tiny/mha.yaml", t, "model.n_layers=1", "model.remat=block",
        f"model.d_model={d}", f"model.ffn_hidden={width}", "attention.n_heads=2",
        "attention.n_kv_heads=2", "attention.head_dim=16", "attention.query_block=256"),
        t)["temp_bytes"] for width in (f, 2 * f)]
    assert temp[1] - temp[0] < t * f * 4, (temp, (temp[1] - temp[0]) / (t * f * 4))


@pytest.mark.parametrize("block", [1, 4, 7, 64])
def test_online_softmax_over_entry_blocks_equals_one_softmax(block):
    """`attend` with an entry block reads a long shared part (and a window longer than the
    block) by an online softmax: output and gradients equal to the one softmax over every
    part, in float64, with a gathered part beside it, a learned sink, blocks that do not
    divide the part, and rows that see no entry at all (zeros, as the sink alone gives)."""
    b, t, h, c, s_len, k, w = 2, 5, 3, 8, 23, 4, 9
    keys = jax.random.split(jax.random.key(0), 8)
    q = jax.random.normal(keys[0], (b, t, h, c), jnp.float64)
    shared = jax.random.normal(keys[1], (b, s_len, c), jnp.float64)
    gathered = jax.random.normal(keys[2], (b, t, k, c), jnp.float64)
    window = jax.random.normal(keys[3], (b, w, c), jnp.float64)
    sink = jax.random.normal(keys[4], (h,), jnp.float64)
    masks = [jax.random.bernoulli(keys[5 + i], 0.6, (b, t, n)) for i, n in enumerate((s_len, k, w))]
    masks = [m.at[0, 1].set(False) for m in masks]  # a query that sees nothing

    def out(q, shared, gathered, window, sink, entry_block):
        parts = list(zip((shared, gathered, window), masks))
        return attend(q, parts, sink, entry_block)[0]

    args = (q, shared, gathered, window, sink)
    want = out(*args, None)
    got = out(*args, block)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(got[0, 1], 0)
    cot = jax.random.normal(jax.random.key(9), want.shape, jnp.float64)
    g_want = jax.grad(lambda *a: jnp.sum(out(*a, None) * cot), argnums=range(5))(*args)
    g_got = jax.grad(lambda *a: jnp.sum(out(*a, block) * cot), argnums=range(5))(*args)
    for a, e in zip(g_got, g_want):
        np.testing.assert_allclose(a, e, rtol=1e-10, atol=1e-12)


def test_signed_zero_scores_are_ties():
    """ReLU scores of exactly zero come out as +0.0 or -0.0 depending on how a dot sums them
    (one pass or by key blocks); top_k orders -0.0 below +0.0, which made the blocked and the
    one-pass selections differ (found by the broad property search). Zero is zero: the
    lowest ids win."""
    score = jnp.asarray([[[-0.0, 0.0, -0.0, 0.0, -1.0]]])
    idx, ok = indexer.select(score, jnp.ones(score.shape, bool), 2)
    np.testing.assert_array_equal(idx[0, 0], [0, 1])


SEGMENTED = {  # presets whose training forward reads by causal segments, small shapes
    "hca": ("v4", "attention.layers=hca", "model.n_layers=1", "attention.hca_ratio=2",
            "attention.window=2"),
    "csa": ("v4", "attention.layers=csa", "model.n_layers=1", "attention.csa_ratio=2",
            "attention.top_k=7", "attention.window=2", "indexer.dense_warmup_steps=0"),
    "csa_warmup": ("v4", "attention.layers=csa", "model.n_layers=1", "attention.csa_ratio=2",
                   "attention.top_k=7", "attention.window=2"),
    # V4.1's indexers: an encoder full layer, a decoder full layer building the candidate
    # pool (its block maxima padded past a segment) and a reindex layer reading it
    "v41": ("v41", "model.n_layers=3", "attention.layers=full, full, reindex",
            "attention.ratios=2, 1, 1", "attention.ced_split=1", "attention.top_k=7",
            "attention.window=2", "indexer.dense_warmup_steps=0"),
    "dsa": ("dsa", "model.n_layers=1", "attention.top_k=13", "indexer.dense_warmup_steps=0"),
    "mha": ("mha", "model.n_layers=1"),
    "gqa": ("gqa", "model.n_layers=1"),
    "mla": ("mla", "model.n_layers=1"),
}


@pytest.mark.parametrize("name", sorted(SEGMENTED))
def test_causal_segments_equal_one_segment(name, monkeypatch):
    """The training forward runs its query blocks in causal segments, each reading only what
    is complete before its end (dense reads of entries, the indexer's scoring, MHA/MLA's
    keys): the same loss and gradients as every block reading everything, in float64. 49
    tokens in blocks of 3: 4 segments, the first ending before top_k entries exist."""
    from dsattn.attention import blocks

    cfg = preset(SEGMENTED[name][0], "model.dtype=float64", "attention.query_block=3",
                 "model.scan_layers=false", *SEGMENTED[name][1:])
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(3)))
    tokens = jax.random.randint(jax.random.key(1), (2, 49), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1)}

    def f(state):
        return train.loss_fn(nnx.merge(graphdef, state), batch, jnp.int32(0))[0]

    assert blocks.segments(49, 3, blocks.CAUSAL_SEGMENTS)[0] == (0, 12)  # 4 of 17 blocks
    y, g = jax.jit(jax.value_and_grad(f))(state)
    monkeypatch.setattr(blocks, "CAUSAL_SEGMENTS", 1)  # traced anew by a new jit
    y_all, g_all = jax.jit(jax.value_and_grad(f))(state)
    np.testing.assert_allclose(y, y_all, rtol=1e-12)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12),
                 g, g_all)


def test_split_cuts_an_axis_into_padded_blocks():
    """blocks.split: the blocks' axis first, the last block padded (zeros; False in a mask)."""
    a = jnp.arange(10).reshape(2, 5)  # cut the second axis into blocks of 2
    got = blocks.split(a, 1, 2)
    want = np.array([[[0, 1], [5, 6]], [[2, 3], [7, 8]], [[4, 0], [9, 0]]])
    np.testing.assert_array_equal(got, want)
    mask = blocks.split(jnp.ones((1, 3, 4), bool), 2, 3)  # [2, 1, 3, 3]
    assert mask.shape == (2, 1, 3, 3)
    np.testing.assert_array_equal(mask[1, 0, :, 1:], False)
    assert bool(mask[0].all()) and bool(mask[1, 0, :, 0].all())
