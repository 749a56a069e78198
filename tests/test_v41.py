"""V4.1: CSA2 with Full/Reindex/Reuse sharing, the hierarchical indexer, CED, and exact vs
bounded-replay prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from dsattn import generate, train
from dsattn.attention import indexer
from dsattn.attention.context import StackContext
from dsattn.cache import paged
from dsattn.model import layer_caches
from tests.helpers import check_decode_matches_forward, forward, preset, tiny_model

# The preset itself is covered by tests/test_properties.py (with more lengths and steps).
VARIANTS = [("attention.sharing=false",), ("attention.pool_blocks=0",),
            ("attention.ced_split=0",)]


@pytest.mark.parametrize("overrides", VARIANTS, ids=["no-sharing", "no-pool", "no-ced"])
def test_prefill_decode_equals_forward(overrides):
    # top_k 8 < visible entries; pool 3 blocks x 4 < visible decoder entries; W = 16 wraps
    model = tiny_model("v41", *overrides)
    check_decode_matches_forward(model, lengths=[5, 33, 19], n_decode=14, max_len=48)


def _param_paths(module):
    return {p for p, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def test_borrowing_layers_own_only_what_they_compute():
    model = tiny_model("v41")
    kinds = model.cfg.attention.layers
    params = [_param_paths(b.attn) for b in model.blocks]
    window_only = params[kinds.index("swa")]  # query, local window KV, output
    for i, kind in enumerate(kinds):
        if kind == "reuse":  # borrows entries and selection: nothing of its own
            assert params[i] == window_only
        if kind == "reindex":  # borrows entries, runs its own indexer query
            extra = params[i] - window_only
            assert extra and all(p[0] == "selector" for p in extra)
        if kind == "full":  # compresses and selects
            assert {p[0] for p in params[i] - window_only} == {"source", "selector"}


def _contexts(model, tokens):
    """The context each block of the training forward returns (jitted: eager dispatch of
    the ten blocks costs several times their compile)."""
    @nnx.jit
    def run(model, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x, ctx, out = model.embedding(tokens), StackContext(), []
        for i, block in enumerate(model.blocks):
            if i == model.cfg.attention.ced_split:
                ctx = StackContext(encoder_out=x)
            x, _, ctx = block(x, positions, None, ctx)
            out.append(ctx)
        return out

    return run(model, tokens)


def _mask(sel, ctx):
    """A selection (entry ids per query) as a [B, T, n] mask over the context's entries."""
    n = ctx.entries.fields["entry"].shape[1]
    return np.asarray(indexer.selection_mask(sel.idx, sel.ok, n))


def test_reuse_passes_the_selection_on_and_reindex_reselects():
    model = tiny_model("v41")
    kinds = model.cfg.attention.layers
    ctxs = _contexts(model, jnp.asarray(np.random.RandomState(0).randint(0, 256, (2, 40))))
    for i, kind in enumerate(kinds):
        if kind in ("reuse", "reindex"):  # the full layer's entries, unchanged
            jax.tree.map(np.testing.assert_array_equal, ctxs[i].entries, ctxs[i - 1].entries)
        if kind == "reuse":
            np.testing.assert_array_equal(_mask(ctxs[i].selection, ctxs[i]),
                                          _mask(ctxs[i - 1].selection, ctxs[i - 1]))
        if kind == "reindex":  # its own selection inside the full layer's pool
            own = _mask(ctxs[i].selection, ctxs[i])
            assert not np.all(own == _mask(ctxs[i - 1].selection, ctxs[i - 1]))
            assert not np.any(own & ~_mask(ctxs[i].pool, ctxs[i]))
    split = model.cfg.attention.ced_split
    assert ctxs[split - 1].pool is None and ctxs[split].pool is not None  # the decoder's pool


@pytest.mark.parametrize("overrides, owners", [((), 2), (("attention.sharing=false",), 8)])
def test_only_full_layers_own_pages(overrides, owners):
    cfg = preset("v41", *overrides)
    cache = jax.eval_shape(lambda: generate.init_cache(cfg, 2, 64))
    owning = [i for i, c in enumerate(layer_caches(cfg, cache))  # layers holding pages
              if isinstance(c.pages, paged.PagedCache)]
    assert owning == [i for i, k in enumerate(cfg.attention.layers) if k == "full"]
    assert len(owning) == owners


def test_pool_covering_all_blocks_equals_flat_indexer():
    toks = jnp.asarray(np.random.RandomState(1).randint(0, 256, (2, 40)))
    flat = tiny_model("v41", "attention.pool_blocks=0")
    covering = tiny_model("v41", "attention.pool_blocks=64")  # 64 blocks x 4 >= 40 entries
    narrow = tiny_model("v41", "attention.pool_blocks=1")
    np.testing.assert_allclose(forward(covering, toks), forward(flat, toks), atol=1e-12)
    assert float(jnp.max(jnp.abs(forward(narrow, toks) - forward(flat, toks)))) > 1e-6  # the pool matters


def test_newest_block_is_always_in_the_pool():
    rng = np.random.RandomState(0)
    n_vis = jnp.asarray([[5, 13, 20]])  # per query: visible entries
    score = jnp.asarray(rng.rand(1, 3, 24))
    score = score.at[0, :, 12:].set(-1.0)  # make the newest blocks score worst
    visible = jnp.arange(24) < n_vis[..., None]
    idx, ok = indexer.candidate_pool(indexer.block_scores(score, visible, 4), n_vis,
                                     block=4, n_blocks=2)
    for t, n in enumerate([5, 13, 20]):
        picked = set(np.asarray(idx[0, t])[np.asarray(ok[0, t])].tolist())
        newest = (n - 1) // 4
        assert set(range(newest * 4, n)) <= picked  # the newest block's visible entries
        assert all(i < n for i in picked)


def test_pool_selection_breaks_ties_like_the_dense_mask():
    """Cached execution ranks the pooled candidates in pool order, the forward masks entries
    in index order: tied scores (ReLU makes exact zeros common) must pick the same entries,
    the lowest entry ids, both ways."""
    score = jnp.zeros((1, 1, 16)).at[0, 0, 10].set(9.0)  # blocks of 4: block 2 holds the 9
    n_vis = jnp.asarray([[16]])
    visible = jnp.ones((1, 1, 16), bool)
    pidx, pok = indexer.candidate_pool(indexer.block_scores(score, visible, 4), n_vis,
                                       block=4, n_blocks=2)  # block 3 pinned, block 2 best
    # the forward: top-k over every entry, restricted to the pool by a mask
    in_pool = indexer.selection_mask(pidx, pok, 16)
    sel, ok = indexer.select(score, visible & in_pool, 2)
    dense = set(np.asarray(sel[0, 0])[np.asarray(ok[0, 0])].tolist())
    # cached execution: top-k over the gathered pool scores, mapped back to entry ids
    pick, ok = indexer.select(jnp.take_along_axis(score, pidx, -1), pok, 2)
    gathered = set(np.asarray(jnp.take_along_axis(pidx, pick, -1)[0, 0])[np.asarray(ok[0, 0])])
    assert dense == {10, 8}  # the 9, then the lowest-index zero inside the pool
    assert gathered == dense


def test_replay_covering_the_prompt_equals_exact_prefill():
    model = tiny_model("v41")
    toks = np.random.RandomState(2).randint(0, 256, (2, 40))
    lengths = [40, 27]
    exact, c1 = generate.prefill(model, toks, lengths, generate.init_cache(model, 2, 64))
    replay, c2 = generate.prefill(model, toks, lengths, generate.init_cache(model, 2, 64),
                                  replay=40)
    np.testing.assert_allclose(replay, exact, atol=1e-10)
    # and decoding continues identically
    nxt = np.array([3, 4])
    a, _ = generate.decode_step(model, nxt, c1)
    b, _ = generate.decode_step(model, nxt, c2)
    np.testing.assert_allclose(a, b, atol=1e-10)


def test_replay_evaluation_count():
    model = tiny_model("v41")
    cfg = model.cfg
    enc, dec = cfg.attention.ced_split, cfg.model.n_layers - cfg.attention.ced_split
    w = cfg.attention.window
    toks = np.random.RandomState(3).randint(0, 256, (2, 48))
    lengths = [48, 35]
    _, cache = generate.prefill(model, toks, lengths, generate.init_cache(model, 2, 64),
                                replay=True)
    assert generate.evaluations(cache) == enc * sum(lengths) + dec * 2 * w
    _, cache = generate.prefill(model, toks, lengths, generate.init_cache(model, 2, 64))
    assert generate.evaluations(cache) == (enc + dec) * sum(lengths)


def test_replay_is_refused_without_ced():
    model = tiny_model("v41", "attention.ced_split=0")
    with pytest.raises(ValueError, match="ced_split"):
        generate.prefill(model, np.ones((1, 4), int), [4], generate.init_cache(model, 1, 16),
                         replay=2)


def test_v41_training_lowers_loss(tmp_path):
    cfg = preset("v41", "train.batch_size=4", "train.seq_len=64", "train.steps=30",
                 "train.eval_every=30", "train.ckpt_every=30", "train.eval_batches=2",
                 "train.log_every=1", "indexer.dense_warmup_steps=5")
    tr = train.Trainer(cfg, tmp_path, quiet=True)
    before = tr.validation_loss()
    out = tr.run()
    assert out["val_loss"] < before - 0.5


def test_replay_report_script_runs(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("replay_report", "scripts/replay_report.py")
    replay_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay_report)
    rows = replay_report.main(["configs/tiny/v41.yaml", "model.n_layers=4",
                               "attention.layers=swa, full, full, reuse",
                               "attention.ratios=0, 2, 1, 1", "attention.ced_split=2",
                               "--prompt-len", "24", "--prompts", "2", "--replays", "4,24",
                               "--timing-len", "0", "--out", str(tmp_path / "r.json")])
    assert rows[-1]["max_abs_logit"] < 1e-4  # R covering the prompt reproduces exact
    assert rows[0]["evaluations_per_prompt"] == rows[0]["formula"] == 2 * 24 + 2 * 4
    assert (tmp_path / "r.json").exists()
