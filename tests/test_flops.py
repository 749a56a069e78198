"""Model FLOPs per token (dsattn.flops) against XLA's own count of the compiled training step,
against hand-worked figures, and as training logs them (model TFLOP/s, MFU)."""

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from dsattn import flops, kvbytes, plan, train
from dsattn.config import ConfigError
from dsattn.model import Transformer
from dsattn.plan import Selector
from tests.helpers import ROOT, preset

FAMILIES = ("mha", "gqa", "mla", "dsa", "v4", "v41")
SHORT, LONG = 16, 512  # DSA reads min(top_k = 32, T) tokens: fewer at SHORT, top_k at LONG
TOLERANCE = 0.10

# What makes XLA's count comparable: its cost analysis counts a while loop's body once
# (measured: the scanned 4-layer MHA step counted about one layer), so layers run unrolled
# and the sequence is one query block (T <= attention.query_block = 512: no lax.map over
# blocks; keys and entries within indexer.key_block and attention.entry_block); remat=none,
# since model FLOPs exclude the backward pass's recomputation; no dense warm-up (a lax.cond
# on the step).
STRAIGHT_LINE = ("model.scan_layers=false", "model.remat=none", "indexer.dense_warmup_steps=0",
                 "train.batch_size=1")


def config(family: str, seq_len: int):
    return preset(family, *STRAIGHT_LINE, f"train.seq_len={seq_len}")


def program_reads(cfg, seq_len: int) -> list[flops.Reads]:
    """What each query reads in that program, where it differs from the model's causal
    averages (flops.train_reads): one query block, so one causal segment, reads every key,
    entry and search key of the sequence, masked (attention/blocks.py, reads.py); its window
    is the block's keys and the W - 1 before them (local.Window.block); the indexer keeps
    min(top_k, candidates) picks per query, and a pool reader scores the pool's candidates."""
    a = cfg.attention
    out = []
    for s in plan.resolve(cfg):
        k = s.kind
        items = seq_len // s.stride if s.entry is not None else 0
        keys = items if k.scans_keys else 0
        if k.reads_pool and a.pool_blocks:
            keys = min(a.pool_blocks, -(-items // a.pool_block_size)) * a.pool_block_size
        picks = min(a.top_k, keys)
        if k.selector is Selector.REUSE:  # the source layer's picks
            picks = out[s.select_source].picks
        entries = {Selector.NONE: 0, Selector.ALL: items}.get(k.selector, picks)
        out.append(flops.Reads(window=seq_len + a.window - 1 if k.window else 0,
                               entries=entries, keys=keys, picks=picks if k.scans_keys else 0))
    return out


@functools.cache
def xla_per_token(family: str, seq_len: int) -> float:
    """FLOPs per token XLA counts in the compiled loss-and-gradients step (one sequence)."""
    cfg = config(family, seq_len)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

    def step(params, batch, i):
        return jax.value_and_grad(
            lambda p: train.loss_fn(nnx.merge(graphdef, p), batch, i)[0])(params)

    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    cost = jax.jit(step).lower(params, {"inputs": tokens, "targets": tokens},
                               jax.ShapeDtypeStruct((), jnp.int32)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older jax: one dict per program
    return cost["flops"] / seq_len


def counted(family: str, seq_len: int) -> float:
    cfg = config(family, seq_len)
    return flops.per_token(cfg, program_reads(cfg, seq_len), training=True)["total"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seq_len", [SHORT, LONG])
def test_training_flops_match_xla(family, seq_len):
    """Weights dominate at SHORT, attention (and DSA's indexer) is a third to a half at LONG."""
    got, xla = counted(family, seq_len), xla_per_token(family, seq_len)
    assert abs(got / xla - 1) < TOLERANCE, (family, seq_len, got, xla)


@pytest.mark.parametrize("family", FAMILIES)
def test_length_dependent_flops_match_xla(family):
    """The growth from SHORT to LONG is what reads cost (weights per token do not change
    with T): the attention and indexer terms alone, checked apart from the weights."""
    got = counted(family, LONG) - counted(family, SHORT)
    xla = xla_per_token(family, LONG) - xla_per_token(family, SHORT)
    assert abs(got / xla - 1) < TOLERANCE, (family, got, xla)


def test_mha_training_flops_by_hand():
    """Tiny MHA (D 128, 4 layers, 4 heads of 32, F 384, V 256, tied) at T = 1024: per layer
    4 D^2 + 3 D F = 212,992 matmul parameters; attention reads T/2 = 512 keys at 4 H d = 512
    FLOPs each; x3 for the backward."""
    cfg = preset("mha", "train.seq_len=512")
    weights = 6 * 4 * 212_992
    unembed = 6 * 128 * 256
    attention = 3 * 4 * 512 * 512
    got = flops.train_breakdown(cfg, 1024)
    assert (got["weights"], got["unembed"], got["attention"], got["indexer"]) == (
        weights, unembed, attention, 0)
    assert got["total"] == 8_454_144 == weights + unembed + attention


def test_v4_training_reads_by_hand():
    """Tiny V4 (swa*2, (csa m=4, hca m'=16)*2, W 16, top_k 8) at T = 128: a CSA query scans
    T/(2m) = 16 keys and reads 8 of them; HCA reads T/(2m') = 4 entries; all read W = 16."""
    reads = flops.train_reads(preset("v4"), 128)
    swa = flops.Reads(window=16)
    csa = flops.Reads(window=16, entries=8, keys=16, picks=8)
    hca = flops.Reads(window=16, entries=4)
    assert reads == [swa, swa, csa, hca, csa, hca]


def test_v41_pool_reader_scores_only_the_pool():
    """The decoder's reindex layer (m = 1) scores pool_blocks x pool_block_size = 12
    candidates, not the T/2 = 256 its full layer scans."""
    reads = flops.train_reads(preset("v41"), 512)
    kinds = [s.name for s in plan.resolve(preset("v41"))]
    assert reads[kinds.index("reindex")].keys == 12
    assert reads[kinds.index("reindex") - 2].keys == 256  # the decoder's full layer


def test_decode_reads_are_kvbytes_counts_and_mla_decodes_absorbed():
    """Tiny MLA at 1000 cached tokens: 4 x (73,728 attention + 147,456 FFN) parameters,
    and per cached token 2 H (kv_rank + d_rope) + 2 H kv_rank = 1,152 FLOPs (absorbed),
    where training reads a key at 2 H (d_nope + d_rope) + 2 H d_v = 640 (naive)."""
    cfg = preset("mla")
    counts = kvbytes.read_counts(cfg, 1000)
    assert [(r.window, r.entries, r.keys) for r in flops.decode_reads(cfg, 1000)] == [
        (c["window_read"], c["entries_read"], c["keys_scanned"]) for c in counts]
    got = flops.decode_breakdown(cfg, 1000)
    assert got["weights"] == 2 * 4 * (73_728 + 147_456)
    assert got["attention"] == 4 * 1000 * 1152
    assert got["total"] == 2 * 4 * 221_184 + 2 * 128 * 256 + 4 * 1000 * 1152
    assert flops.train_breakdown(cfg, 2000)["attention"] == 3 * 4 * 1000 * 640


def test_decode_flops_grow_with_context_only_where_reads_do():
    """A window-only stack costs the same at any context past W; dense MHA grows linearly."""
    swa = preset("v4", "attention.layers=swa")
    assert flops.decode_flops_per_token(swa, 1000) == flops.decode_flops_per_token(swa, 10_000)
    mha = preset("mha")
    one, two = (flops.decode_flops_per_token(mha, n) for n in (1000, 2000))
    assert two - one == 4 * 1000 * 4 * 4 * 32


def test_peak_lookup_and_mfu():
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert flops.peak_tflops("TPU v5 lite") == 197
    assert flops.peak_tflops("cpu") is None
    assert flops.peak_tflops("cpu", configured=2.5) == 2.5  # train.peak_tflops wins
    assert flops.mfu(1000.0, 1e9, 2.0) == pytest.approx(0.5)
    assert flops.mfu(1000.0, 1e9, None) is None


def test_peak_tflops_config_key_is_validated():
    assert preset("mha", "train.peak_tflops=312").train.peak_tflops == 312.0
    with pytest.raises(ConfigError, match="train.peak_tflops"):
        preset("mha", "train.peak_tflops=-1")


SHORT_RUN = ("model.n_layers=1", "train.batch_size=2", "train.seq_len=32", "train.steps=3",
             "train.log_every=1", "train.eval_every=100", "train.ckpt_every=100",
             "train.eval_batches=1")


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_logs_model_tflops_and_mfu(tmp_path, capsys):
    """Each record's model TFLOP/s is its tokens/s x the plan's training FLOPs per token; the
    MFU is that over train.peak_tflops, and the progress line shows both."""
    cfg = preset("mha", *SHORT_RUN, "train.peak_tflops=0.5")
    train.Trainer(cfg, tmp_path, progress_every=1).run()
    err = capsys.readouterr().err
    assert "TFLOP/s" in err and "MFU" in err
    per_token = flops.train_flops_per_token(cfg, 32)
    records = _records(tmp_path)
    assert len(records) == 3
    for r in records:
        assert r["model_tflops_per_s"] == pytest.approx(r["tokens_per_s"] * per_token / 1e12)
        assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / 0.5)


def test_unknown_device_logs_no_mfu_and_progress_shows_tflops(tmp_path, capsys):
    """On this CPU (not in the table) with train.peak_tflops=0: TFLOP/s but no MFU, in the
    records and in the plain progress line."""
    assert flops.peak_tflops(jax.devices()[0].device_kind) is None
    cfg = preset("mha", *SHORT_RUN)
    train.Trainer(cfg, tmp_path, progress_every=1).run()
    records = _records(tmp_path)
    assert all(r["model_tflops_per_s"] > 0 and "mfu" not in r for r in records)
    err = capsys.readouterr().err
    assert "TFLOP/s" in err and "MFU" not in err
    assert math.isfinite(records[-1]["model_tflops_per_s"])


def test_kv_report_decode_flops_of_v3_2_and_v4_flash_at_1m_by_hand():
    """scripts/kv_report.py's rows at 1M cached tokens. V3.2 (61 DSA layers, 128 heads,
    absorbed: 2 x 128 x (512 + 64) + 2 x 128 x 512 = 278,528 per token read): top_k 2048
    tokens, and its indexer (64 heads of 128: 16,512 per key) scores all 1M keys per layer.
    V4-Flash (4 x 64 heads x 512 = 131,072 per item): 2 SWA layers read the 128-window, 21
    CSA layers 128 + 512 entries and score 1M/4 keys, 20 HCA layers 128 + 1M/128 entries."""
    import importlib.util

    path = Path(ROOT) / "scripts" / "kv_report.py"
    spec = importlib.util.spec_from_file_location("kv_report", path)
    kv_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kv_report)
    n = 2 ** 20
    rows = kv_report.build_rows([Path(ROOT) / "configs/deepseek/v3_2.yaml",
                                 Path(ROOT) / "configs/deepseek/v4_flash.yaml"], n)
    v32, v4 = (r["decode_flops"] for r in rows)
    assert v32["attention"] == 61 * 2048 * 278_528
    assert v32["indexer"] == 61 * n * 16_512
    assert v4["attention"] == (2 * 128 + 21 * (128 + 512) + 20 * (128 + n // 128)) * 131_072
    assert v4["indexer"] == 21 * (n // 4) * 16_512
    for r in rows:
        assert r["decode_flops_per_token"] == r["decode_flops"]["total"]
        assert r["train_flops_per_token"] == pytest.approx(
            flops.train_flops_per_token(kv_report.load(r["config"]), n))


def test_bench_training_measure_reports_model_tflops():
    from dsattn.bench import measures

    cfg = preset("mha", "model.n_layers=1")
    got = measures.time_training(cfg, 32, 1, steps=1)
    assert got["train_flops_per_token"] == flops.train_flops_per_token(
        preset("mha", "model.n_layers=1", "train.seq_len=32"), 32)
    assert got["model_tflops_per_s"] == pytest.approx(
        got["tokens_per_s"] * got["train_flops_per_token"] / 1e12)
    assert "mfu" not in got  # this CPU's peak is unknown
