"""The benchmark script runs end to end at toy sizes (so it cannot rot), and its synthetic
decode contexts hold what a real prefill leaves. Timings are never asserted."""

import json
import os

import jax
import numpy as np
from flax import nnx

from dsattn import bench, generate
from dsattn.model import Transformer
from scripts import bench as bench_script


# A 4-layer V4.1 stack (encoder swa, full m=2 | decoder full m=1, reuse): compiles fast.
SMALL_V41 = ["--set", "model.n_layers=4", "--set", "attention.layers=swa, full, full, reuse",
             "--set", "attention.ratios=0, 2, 1, 1", "--set", "attention.ced_split=2"]


def test_synthetic_context_matches_real_prefill_structure():
    """Lengths, positions, ring slots, page tables and free stacks equal a real prefill's."""
    cfg = bench.bench_config("v41", None, *SMALL_V41[1::2])
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    n, rows = 48, 2
    toks = np.random.RandomState(0).randint(0, 256, (rows, n))
    real = generate.prefill(model, toks, [n] * rows, generate.init_cache(model, rows, 80))[1]
    syn = bench.synthetic_context(model, generate.init_cache(model, rows, 80), n)
    checked = 0
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(real)[0], jax.tree.leaves(syn)):
        name = jax.tree_util.keystr(path)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.dtype.kind in "iub" and a.size and "evaluations" not in name:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
            checked += 1
    assert checked >= 10  # pos, ring slots of 4 layers, the paged bookkeeping of 2 layers


def test_bench_script_smoke(tmp_path):
    out = tmp_path / "bench"
    result = bench_script.main([
        "--presets", "v41", *SMALL_V41, "--contexts", "64", "--batches", "1", "--steps", "2",
        "--warmup", "1", "--prefill", "64", "--chunk", "32", "--train-seq", "32",
        "--train-batch", "1", "--train-steps", "1", "--copy-mb", "8", "--out", str(out)])
    saved = json.loads((out / "bench.json").read_text())
    (d,) = saved["presets"]["v41"]["decode"]
    assert d["step_ms"] > 0 and d["compilations"] == 1
    cfg = bench.bench_config("v41", None, *SMALL_V41[1::2])
    assert d["read_bytes"] == bench.decode_bytes(cfg, 64, 1)
    exact, replay = saved["presets"]["v41"]["prefill"]
    assert replay["replay"] == 16 and exact["replay"] is None
    # Replay ran the decoder over R = 16 of the 64 positions: 2 * 64 + 2 * 16 evaluations.
    assert (exact["evaluations"], replay["evaluations"]) == (256, 160)
    assert saved["presets"]["v41"]["train"]["tokens_per_s"] > 0
    assert len(result["targets"]) >= 6
    for png in ("decode.png", "prefill.png", "roofline.png"):
        assert os.path.getsize(out / png) > 1000
