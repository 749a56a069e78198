"""The benchmark runs end to end at toy sizes (so it cannot rot), and its synthetic decode
contexts hold what a real prefill leaves. Timings are never asserted; the checks read the
result records (bench.json), not the printed tables."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from dsattn import generate
from dsattn.bench import measures, report
from dsattn.model import Transformer
from tests.helpers import TINY_CONFIGS, preset, run_script

# A 4-layer V4.1 stack (encoder swa, full m=2 | decoder full m=1, reuse): compiles fast.
SMALL_V41 = ("model.n_layers=4", "attention.layers=swa, full, full, reuse",
             "attention.ratios=0, 2, 1, 1", "attention.ced_split=2")


def test_synthetic_context_matches_real_prefill_structure():
    """Lengths, positions, ring slots, page tables and free stacks equal a real prefill's."""
    cfg = measures.bench_config("v41", None, *SMALL_V41, config_dir=TINY_CONFIGS)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    n, rows = 48, 2
    toks = np.random.RandomState(0).randint(0, 256, (rows, n))
    real = generate.prefill(model, toks, [n] * rows, generate.init_cache(model, rows, 80))[1]
    syn = measures.synthetic_context(model, generate.init_cache(model, rows, 80), n)
    checked = 0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(real)[0], jax.tree.leaves(syn)):
        name = jax.tree_util.keystr(path)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.dtype.kind in "iub" and a.size:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
            checked += 1
    assert checked >= 10  # pos, ring slots of 4 layers, the paged bookkeeping of 2 layers


@pytest.mark.full  # a benchmark run: the full tier
def test_bench_script_smoke(tmp_path):
    """scripts/bench.py as a user runs it, from another directory (the presets are found
    beside the script): bench.json holds every measure, and the plots are drawn."""
    out = tmp_path / "bench"
    p = run_script("bench", "--presets", "v41", *[a for o in SMALL_V41 for a in ("--set", o)],
                   "--contexts", "64", "--batches", "1", "--steps", "2", "--warmup", "1",
                   "--prefill", "64", "--chunk", "32", "--train-seq", "32", "--train-batch", "1",
                   "--train-steps", "1", "--copy-mb", "8", "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr.decode()
    result = json.loads((out / "bench.json").read_text())
    assert result["args"]["presets"] == ["v41"] and result["args"]["contexts"] == [64]
    rec = result["presets"]["v41"]
    assert rec["n_layers"] == 4 and rec["param_bytes"] > 0
    (d,) = rec["decode"]
    assert (d["context"], d["batch"]) == (64, 1)
    assert d["step_ms"] > 0 and d["compilations"] == 1
    cfg = measures.bench_config("v41", None, *SMALL_V41, config_dir=TINY_CONFIGS)
    assert d["read_bytes"] == measures.decode_bytes(cfg, 64, 1)
    assert d["roofline_fraction"] == d["read_bytes_per_s"] / result["copy_bandwidth_bytes_per_s"]
    exact, replay = rec["prefill"]
    assert replay["replay"] == 16 and exact["replay"] is None
    # Replay ran the decoder over R = 16 of the 64 positions: 2 * 64 + 2 * 16 evaluations.
    assert (exact["evaluations"], replay["evaluations"]) == (256, 160)
    assert rec["train"]["tokens_per_s"] > 0 and result["peer"] is None
    # The targets are checked from the records; the ones this run measured are decided.
    assert result["targets"] == report.check_targets(result)
    assert len(result["targets"]) >= 6
    assert all((t["met"] is None) == (t["value"] is None) for t in result["targets"])
    for png in ("decode.png", "prefill.png", "roofline.png"):
        assert os.path.getsize(out / png) > 1000


@pytest.mark.full  # a benchmark run: the full tier
def test_long_context_memory_only(tmp_path):
    """scripts/bench.py --long-context --max-step-s 0 (temporaries only, nothing timed):
    one record per length with the compiled step's temporaries, growing with T, and the
    plot drawn without a tokens/s curve."""
    out = tmp_path / "lc"
    p = run_script("bench", "--long-context", "--presets", "mha", "--lengths", "64,128",
                   "--max-step-s", "0", "--set", "model.n_layers=1", "--out", out,
                   cwd=tmp_path)
    assert p.returncode == 0, p.stderr.decode()
    rows = json.loads((out / "long_context.json").read_text())
    assert [(r["preset"], r["seq_len"]) for r in rows] == [("mha", 64), ("mha", 128)]
    assert 0 < rows[0]["temp_bytes"] < rows[1]["temp_bytes"]
    assert not any("tokens_per_s" in r for r in rows)
    assert os.path.getsize(out / "long_context.png") > 1000


def test_per_device_cache_bytes_on_meshes():
    """scripts/bench.py --mesh: a decode state laid out on a mesh (abstract shapes) holds
    kvbytes' bytes in all; rows split over data leave each device its rows' share, a tensor
    split leaves every device the whole cache (V4 entries are read by every head)."""
    from dsattn import kvbytes
    from dsattn.bench import mesh

    cfg = preset("v4", "model.dtype=float32")
    total = 8 * (kvbytes.global_bytes(cfg, 1024) + kvbytes.local_bytes(cfg, context=1024))
    rows = mesh.cache_bytes_per_device(cfg, 8, 1024, (8, 1, 1))
    assert rows["stored_bytes"] == total and rows["stored_bytes_per_device"] == total // 8
    heads = mesh.cache_bytes_per_device(cfg, 8, 1024, (1, 1, 8))
    assert heads["stored_bytes_per_device"] == total
    both = mesh.cache_bytes_per_device(cfg, 8, 1024, (2, 2, 2))
    assert both["stored_bytes_per_device"] == total // 4
    assert both["cache_bytes_per_device"] > both["stored_bytes_per_device"]


@pytest.mark.full  # a benchmark run: the full tier
def test_seed_benchmark_trains_each_row_vmapped_and_alone(tmp_path):
    """bench --seeds: each named row of a sweep trained as N seeds vmapped and one after
    another, with each seed's tokens/s from its run's records; an unknown row is named."""
    import yaml

    from dsattn import ablate
    from dsattn.bench import seeds
    from tests.test_ablate import MHA, TOY

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": MHA, "overrides": TOY, "decode_context": 0,
                                    "rows": [{"name": "a", "overrides": []},
                                             {"name": "b", "overrides": []}]}))
    sweep = ablate.load(path, ["train.steps=2", *seeds.SETTINGS])
    (row,) = seeds.measure(sweep.seed_configs(["b"], 2), log=lambda _: None)
    assert (row["row"], row["seeds"], row["steps"], row["tokens_per_step"]) == ("b", 2, 2, 96)
    assert row["alone_tokens_per_s"] > 0 and row["vmapped_tokens_per_s"] > 0
    assert row["alone_wall_s"] > 0 and row["vmapped_wall_s"] > 0
    with pytest.raises(ValueError, match=r"no rows \['c'\]"):
        sweep.seed_configs(["c"], 2)


@pytest.mark.full  # a benchmark run: the full tier
def test_generate_benchmark_times_both_token_loops():
    cfg = measures.bench_config("mha", 1, config_dir=TINY_CONFIGS)
    t = measures.time_generate(Transformer(cfg, rngs=nnx.Rngs(0)), 2, new_tokens=4, prompt=3,
                               repeats=1)
    assert t["device_tokens_per_s"] > 0 and t["host_tokens_per_s"] > 0
