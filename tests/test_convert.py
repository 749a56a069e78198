"""Starting a run from another design's run (dsattn.convert, scripts/train.py --init-from) and
freezing parameters (train.freeze): the conversion rules against cases whose answer is known
(float64), the refusals, the run directory's record, and a frozen parameter that must not
move."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsattn import ablate, config, convert, train, trainstep  # noqa: F401  (ablate.measure)
from dsattn.errors import ConfigError
from tests.helpers import check_decode_matches_forward, forward, tiny_model

SMALL = ["model.dtype=float64", "model.param_dtype=float64", "model.n_layers=2",
         "model.d_model=64", "model.ffn_hidden=96", "train.seq_len=32", "train.batch_size=2",
         "train.steps=2", "train.warmup_steps=1", "train.eval_batches=1"]
MLA_OF_MHA = ["attention.q_lora_rank=0", "attention.qk_nope_dim=16",
              "attention.qk_rope_dim=16", "attention.v_head_dim=32",
              "attention.kv_lora_rank=24"]


def saved_run(path, preset, overrides, edit=None):
    """A run directory holding one checkpoint (step 0) of `preset`'s fresh model, its
    parameters passed through `edit` first."""
    cfg = config.load(preset, SMALL + overrides)
    tr = train.Trainer(cfg, path, quiet=True)
    if edit is not None:
        tr.params = edit(cfg, tr.params)
    tr.save()
    tr.rundir.finish_saves()
    return cfg, tr


def converted(path, preset, overrides, source):
    """(the new config, the conversion, the converted model) of `preset` from `source`."""
    cfg = config.load(preset, SMALL + overrides)
    tr = train.Trainer(cfg, path, quiet=True, init_from=str(source))
    return cfg, tr.conversion, tr.model()


def logits(model, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 256, (2, 32))
    return np.asarray(forward(model, tokens))  # jitted: eagerly each op compiles alone


def representable(cfg, params, rank=8):
    """MHA weights that MLA (kv_lora_rank >= rank, qk_rope_dim = mha_rope_dim) holds exactly:
    each layer's non-rotary keys and values jointly of rank `rank`, its KV heads' rotary keys
    one key turned and scaled per frequency pair (a head's own rotation and scale of each
    pair, which its queries can absorb since rotations commute)."""
    a = cfg.attention
    g, hd, r = a.n_kv_heads or a.n_heads, a.head_dim, a.mha_rope_dim
    rng = np.random.default_rng(1)
    layers = convert.per_layer(cfg, params)
    for layer in layers:
        attn = layer["attn"]
        d = attn["wk"]["kernel"].shape[0]
        low = (rng.normal(size=(d, rank)) @ rng.normal(size=(rank, g * (hd - r + hd)))) * 0.05
        low = low.reshape(d, g, hd - r + hd)
        base = rng.normal(size=(d, r // 2)) + 1j * rng.normal(size=(d, r // 2))
        turn = rng.uniform(0.5, 2, (g, r // 2)) * np.exp(1j * rng.uniform(0, 6.3, (g, r // 2)))
        z = 0.2 * base[:, None] * turn  # [d, G, r/2]: pair p of head g is turn[g, p] x base
        rot = np.stack([z.real, z.imag], -1).reshape(d, g, r)
        attn["wk"]["kernel"] = jnp.asarray(np.concatenate([low[..., : hd - r], rot], -1)
                                           .reshape(d, g * hd))
        attn["wv"]["kernel"] = jnp.asarray(low[..., hd - r:].reshape(d, g * hd))
    return convert.with_layers(cfg, params, layers)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_mha_to_mla_is_exact_where_mla_can_hold_the_source(tmp_path, kv_heads):
    src_cfg, src = saved_run(tmp_path / "src", "configs/tiny/mha.yaml",
                             [f"attention.n_kv_heads={kv_heads}", "attention.mha_rope_dim=16"],
                             representable)
    cfg, conv, model = converted(tmp_path / "new", "configs/tiny/mla.yaml",
                                 MLA_OF_MHA + ["attention.latent_norm=false"], tmp_path / "src")
    np.testing.assert_allclose(logits(model), logits(src.model()), atol=1e-9, rtol=0)
    assert conv.kl < 1e-12
    counts = conv.counts()
    assert counts[convert.How.DERIVED] == 2 * 3 and counts[convert.How.NEW] == 0
    assert "non-rotary keys" in conv.table() and "KL(source || converted)" in conv.table()


def test_mha_to_mla_of_a_full_rope_source_drops_rotations_and_says_so(tmp_path):
    # a source rotating all 32 dims keeps one pair in 2 (MLA's 16 rotary dims' frequencies)
    saved_run(tmp_path / "src", "configs/tiny/mha.yaml", [])
    _, conv, _ = converted(tmp_path / "new", "configs/tiny/mla.yaml", MLA_OF_MHA,
                           tmp_path / "src")
    assert "8 of 16 rotary pairs lost their rotation" in conv.table()
    assert 0 < conv.kl < 1.0


def test_mla_to_dsa_equals_mla_while_top_k_covers_the_sequence(tmp_path):
    _, src = saved_run(tmp_path / "src", "configs/tiny/mla.yaml", [])
    _, conv, model = converted(tmp_path / "new", "configs/tiny/dsa.yaml",
                               ["attention.top_k=32"], tmp_path / "src")
    np.testing.assert_allclose(logits(model), logits(src.model()), atol=1e-9, rtol=0)
    new = {r.path for r in conv.rows if r.how is convert.How.NEW}
    assert {"attn/selector/index_q/wq/kernel", "attn/wk/kernel"} <= new
    assert not any(r.how is convert.How.DERIVED for r in conv.rows)


def test_dense_to_v4_starts_closer_to_the_source_than_a_fresh_v4(tmp_path):
    # a random source with wide weights has sharp, input-dependent logits to compare
    # against; its keys and values fit V4's entry, so what differs is V4's own design (the
    # per-head query norm, the sink, the CSA layer's compressed entries)
    src_overrides = ["model.init_std=0.2", "attention.mha_rope_dim=16"]
    _, src = saved_run(tmp_path / "src", "configs/tiny/mha.yaml", src_overrides,
                       representable)
    v4 = ["attention.layers=[swa,csa]", "attention.entry_dim=48", "attention.rope_dim=16",
          "attention.window=32", "model.init_std=0.2"]
    cfg = config.load("configs/tiny/v4.yaml", SMALL + v4)
    tr = train.Trainer(cfg, tmp_path / "new", quiet=True, init_from=str(tmp_path / "src"))
    conv, step_fn = tr.conversion, tr.trainstep
    fresh = step_fn.model(trainstep.init(cfg)[1])
    kl_fresh = convert.mean_kl(src.model(), fresh, tr.val_batches)
    assert conv.kl < 0.5 * kl_fresh  # measured: 0.76 against 2.5
    rows = {(r.where, r.path): r.how for r in conv.rows}
    assert rows["layer 1", "attn/source/compressor/wkv/kernel"] is convert.How.NEW
    assert rows["layer 0", "attn/local/wkv/kernel"] is convert.How.DERIVED
    assert rows["layer 0", "ffn/w_up/kernel"] is convert.How.COPIED


def test_what_no_rule_covers_is_refused_naming_it(tmp_path):
    saved_run(tmp_path / "src", "configs/tiny/mla.yaml", [])
    with pytest.raises(ConfigError, match=r"layer 0: no conversion rule from mla to mha"):
        converted(tmp_path / "a", "configs/tiny/mha.yaml", [], tmp_path / "src")
    with pytest.raises(ConfigError, match=r"ffn/w_down/kernel: shape \(128, 64\) here, "
                                          r"\(96, 64\) in the source"):
        converted(tmp_path / "b", "configs/tiny/mla.yaml", ["model.ffn_hidden=128"],
                  tmp_path / "src")
    with pytest.raises(ConfigError, match="it has 2 layers, this config 3"):
        converted(tmp_path / "c", "configs/tiny/mla.yaml", ["model.n_layers=3"],
                  tmp_path / "src")


def test_a_rerun_before_the_first_checkpoint_starts_from_the_pinned_source(tmp_path):
    _, src = saved_run(tmp_path / "src", "configs/tiny/mla.yaml", [])
    cfg = config.load("configs/tiny/dsa.yaml", SMALL + ["attention.top_k=32"])
    first = train.Trainer(cfg, tmp_path / "new", quiet=True, init_from=str(tmp_path / "src"))
    record = json.loads((tmp_path / "new" / "init_from.json").read_text())
    assert record["source"] == f"{tmp_path / 'src'}:0"
    again = train.Trainer(cfg, tmp_path / "new", quiet=True)  # no flag, no checkpoint yet
    assert again.conversion is not None
    np.testing.assert_array_equal(logits(again.model()), logits(first.model()))
    again.save()  # a checkpoint (step 0): from now on the run resumes from its own
    again.rundir.finish_saves()
    resumed = train.Trainer(cfg, tmp_path / "new", quiet=True, init_from=str(tmp_path / "src"))
    assert resumed.conversion is None and resumed.step == 0
    np.testing.assert_array_equal(logits(resumed.model()), logits(first.model()))


FREEZE_ALL_BUT_THE_INDEXER = ("train.freeze=['*', '!*/selector/*', '!*/attn/wk/*', "
                              "'!*/attn/k_norm/*']")


def test_a_frozen_parameter_stays_where_it_was_and_has_no_moments(tmp_path):
    cfg = config.load("configs/tiny/dsa.yaml", SMALL + [FREEZE_ALL_BUT_THE_INDEXER,
                                                        "indexer.dense_warmup_steps=2"])
    tr = train.Trainer(cfg, tmp_path / "run", quiet=True)
    before = jax.tree.map(np.array, tr.params)
    tr.run()
    frozen = jax.tree.leaves(trainstep.frozen(cfg.train.freeze, tr.params))
    paths = trainstep.parameter_paths(tr.params)
    moved = {p: not np.array_equal(a, b) for p, a, b in
             zip(paths, jax.tree.leaves(before), jax.tree.leaves(tr.params))}
    assert not any(moved[p] for p, f in zip(paths, frozen) if f)
    trained = [p for p, f in zip(paths, frozen) if not f]
    assert set(trained) == {p for p in paths if "selector" in p or "/attn/wk/" in p
                            or "/attn/k_norm/" in p}
    assert all(moved[p] for p in trained if "bias" not in p)
    moments = sum(x.size for x in jax.tree.leaves(tr.opt_state))
    sizes = sum(np.size(x) for x, f in zip(jax.tree.leaves(tr.params), frozen) if not f)
    assert moments < 2 * sizes + 16  # mu and nu of the trained ones, and counters


def test_freeze_patterns_are_checked_and_later_ones_win():
    cfg = config.load("configs/tiny/mha.yaml", SMALL)
    _, params, _ = trainstep.init(cfg)
    got = dict(zip(trainstep.parameter_paths(params),
                   jax.tree.leaves(trainstep.frozen(["*/ffn/*", "!*/ffn/w_up/*"], params))))
    assert got == {p: ("/ffn/" in p and "/ffn/w_up/" not in p) for p in got}
    with pytest.raises(ConfigError, match="'\\*/fnn/\\*' matches no parameter"):
        trainstep.frozen(["*/fnn/*"], params)
    with pytest.raises(ConfigError, match="freezes every parameter"):
        trainstep.frozen(["*"], params)


def test_a_resume_under_another_freeze_is_refused(tmp_path):
    cfg = config.load("configs/tiny/mha.yaml", SMALL)
    train.train(cfg, tmp_path / "run", quiet=True)
    other = config.load("configs/tiny/mha.yaml", SMALL + ["train.freeze=['*/ffn/*']"])
    with pytest.raises(Exception, match="train.freeze"):
        train.Trainer(other, tmp_path / "run", quiet=True)


@pytest.mark.parametrize("name,overrides", [("mha", "attention.mha_rope_dim=8"),
                                            ("mla", "attention.latent_norm=false")])
def test_the_conversion_targets_and_sources_decode_as_they_train(name, overrides):
    # the two model options conversion relies on keep the core promise
    model = tiny_model(name, "model.n_layers=2", overrides)
    check_decode_matches_forward(model, lengths=[3, 11], n_decode=4, max_len=24)


def test_a_sweep_row_starts_from_an_earlier_rows_run(tmp_path):
    from dsattn import ablate
    from dsattn.ablate import spec

    raw = {"base": "configs/tiny/mha.yaml", "overrides": SMALL, "seeds": [0, 1],
           "rows": [{"name": "src", "overrides": []},
                    {"name": "conv", "init": "src", "overrides": ["attention.layers=mla"]}]}
    sweep = spec.from_dict(raw, out=tmp_path)
    src, conv = sweep.rows
    assert ablate.init_source(sweep, conv, 1) == f"{spec.run_dir(sweep, src, 1)}:2"
    assert ablate.init_source(sweep, src, 1) is None
    # the converted run's fingerprint follows its source's config
    longer = spec.from_dict({**raw, "rows": [{"name": "src", "overrides": ["train.steps=3"]},
                                             raw["rows"][1]]}, out=tmp_path)
    assert ablate.fingerprint(sweep, conv, 0) != ablate.fingerprint(longer, longer.rows[1], 0)
    with pytest.raises(ConfigError, match="init: 'later' is not a row before it"):
        spec.from_dict({**raw, "rows": [{"name": "a", "init": "later", "overrides": []},
                                        {"name": "later", "overrides": []}]}, out=tmp_path)


def test_the_v3_2_recipe_runs_its_two_stages_from_a_dense_mla_run(tmp_path):
    # the recipe's configs at SMALL's size (the MLA source shrunk alike)
    short = SMALL + ["train.steps=3", "train.eval_every=3", "train.log_every=1"]
    mla = train.Trainer(config.load("configs/tiny/mla.yaml", short), tmp_path / "mla",
                        quiet=True)
    mla.run()
    warm_cfg = config.load("configs/recipes/v3_2_warmup.yaml",
                           short + ["indexer.dense_warmup_steps=3"])
    warm = train.Trainer(warm_cfg, tmp_path / "warm", quiet=True, init_from=str(tmp_path / "mla"))
    warm.run()
    # only the indexer trained, and every read was dense: the model is still the MLA run's
    # (top-k 32 of 32 tokens reads them all)
    np.testing.assert_allclose(logits(warm.model()), logits(mla.model()), atol=1e-9, rtol=0)
    records = [json.loads(line) for line in (tmp_path / "warm" / "metrics.jsonl").open()]
    assert all(0 < r["indexer_recall"] <= 1 for r in records if "loss" in r)
    sparse_cfg = config.load("configs/recipes/v3_2_sparse.yaml", short + ["attention.top_k=8"])
    sparse = train.Trainer(sparse_cfg, tmp_path / "sparse", quiet=True,
                           init_from=str(tmp_path / "warm"))
    assert sparse.conversion.counts()[convert.How.COPIED] == len(sparse.conversion.rows)
    sparse.run()
    records = [json.loads(line) for line in (tmp_path / "sparse" / "metrics.jsonl").open()]
    assert not any("indexer_recall" in r for r in records)  # sparse from its first step


def test_a_chained_runs_curve_counts_every_earlier_stage(tmp_path):
    # source (600 steps) -> warm-up (100) -> this run: its curve starts after step 700
    import sys

    from dsattn.rundir import INIT_FILE
    measure = sys.modules["dsattn.ablate.measure"]
    for name, source in (("warm", f"{tmp_path / 'src'}:600"),
                         ("conv", f"{tmp_path / 'warm'}:100")):
        (tmp_path / name).mkdir()
        (tmp_path / name / INIT_FILE).write_text(json.dumps({"source": source, "table": ""}))
    (tmp_path / "conv" / "metrics.jsonl").write_text(json.dumps({"step": 100, "val_loss": 1.0})
                                                     + "\n")
    assert measure._start_step(tmp_path / "src") == 0
    assert measure._start_step(tmp_path / "conv") == 700
    assert measure._curve(tmp_path / "conv", 700) == [[800, 1.0]]
