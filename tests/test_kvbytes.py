"""Byte accounting (dsattn.kvbytes): the figures of the full-size presets (configs/deepseek/,
worked out in their header comments), exactly, plus small configs whose bytes are worked out
by hand, and a smoke test of kv_report."""

from __future__ import annotations

import importlib.util
import json
from fractions import Fraction
from pathlib import Path

import pytest

from dsattn import kvbytes
from dsattn.config import load, loads

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "configs" / "deepseek"
N = 131072  # a 128K context


def preset(name: str, overrides=()):
    return load(PRESETS / f"{name}.yaml", overrides)


# ------------------------------------------------------------ full-size presets, storage per token
@pytest.mark.parametrize(
    "name, deployed, bf16",
    [
        ("mha_v2dims", 3_932_160, 3_932_160),  # 60 x 128 x (128 + 128) x 2 B
        ("v2", 69_120, 69_120),  # 60 x 576 x 2 B
        ("v3", 70_272, 70_272),  # 61 x 576 x 2 B
        ("v3_2", 48_068, 85_888),  # 61 x (656 + 132); 61 x 704 x 2
        ("v4_flash", 3_514.25, 6_880),  # 21 x 652 / 4 + 20 x 584 / 128
        ("v4_1_flash", 890, 3_200),  # (3/2 + 1) x (288 + 68)
    ],
)
def test_full_size_storage_per_token(name, deployed, bf16):
    cfg = preset(name)
    assert kvbytes.storage_per_token(cfg) == deployed
    assert kvbytes.storage_per_token(cfg, bf16=True) == bf16
    assert sum(kvbytes.storage_per_layer(cfg)) == deployed
    rep = kvbytes.report(cfg, N)
    assert rep["storage_bytes_per_token"] == deployed
    assert rep["storage_bf16_bytes_per_token"] == bf16


def test_full_size_storage_exact_fraction():
    cfg = preset("v4_flash")
    exact = sum(kvbytes.storage_per_layer_exact(cfg), Fraction(0))
    assert exact == Fraction(14057, 4)  # 3,514.25 exactly
    assert kvbytes.report(cfg, N)["storage_layers"] == 41  # 21 CSA + 20 HCA
    assert kvbytes.report(preset("v4_1_flash"), N)["storage_layers"] == 4  # the Full layers


def test_full_size_item_sizes():
    # Bytes of one cache item in one layer, in the presets' deployed formats.
    v32, v4, v41 = preset("v3_2"), preset("v4_flash"), preset("v4_1_flash")
    assert kvbytes.item_bytes(v32, 0) == {"local": 0, "main": 656, "key": 132}  # dsa
    assert kvbytes.item_bytes(v4, 2) == {"local": 584, "main": 584, "key": 68}  # csa
    assert kvbytes.item_bytes(v4, 3) == {"local": 584, "main": 584, "key": 0}  # hca
    assert kvbytes.item_bytes(v41, 2) == {"local": 528, "main": 288, "key": 68}  # full
    assert kvbytes.item_bytes(v41, 3) == {"local": 528, "main": 288, "key": 0}  # reuse


# ------------------------------------------------------------ full-size presets, local window
def test_full_size_local_bytes_and_crossover():
    v4, v41 = kvbytes.report(preset("v4_flash"), N), kvbytes.report(preset("v4_1_flash"), N)
    assert v4["local_bytes"] == 43 * 128 * 584
    assert v41["local_bytes"] == 40 * 128 * 528
    # local bytes equal the global bytes at about 900 tokens (V4-Flash), 3,038 (V4.1-Flash)
    assert v4["crossover_context"] == pytest.approx(43 * 128 * 584 / 3514.25)
    assert round(v4["crossover_context"], -2) == 900
    assert v41["crossover_context"] == 40 * 128 * 528 / 890
    assert round(v41["crossover_context"]) in (3037, 3038)
    for name in ("mha_v2dims", "v2", "v3", "v3_2"):
        rep = kvbytes.report(preset(name), N)
        assert rep["local_bytes"] == 0 and rep["crossover_context"] is None


# ------------------------------------------------------------ full-size presets, reads at 128K
@pytest.mark.parametrize(
    "name, kv, keys",
    [
        ("mha_v2dims", 515_396_075_520, 0),
        ("v2", 9_059_696_640, 0),  # 60 x 131,072 x 1,152
        ("v3_2", 81_952_768, 1_055_391_744),  # 61 x 2,048 x 656; 61 x N x 132
        ("v4_flash", 21_453_824, 46_792_704),
        ("v4_1_flash", 8_306_688, 26_738_688),
    ],
)
def test_full_size_reads(name, kv, keys):
    rep = kvbytes.report(preset(name), N)
    assert rep["read_kv_bytes"] == kv
    assert rep["read_key_bytes"] == keys
    assert rep["read_bytes"] == kv + keys
    assert isinstance(rep["read_bytes"], int)


def test_full_size_read_breakdowns():
    v4 = kvbytes.report(preset("v4_flash"), N)
    # (21 x (512 + 128) + 20 x (N/128 + 128) + 2 x 128) items at 584 B
    assert v4["window_read"] == 43 * 128
    assert v4["entries_read"] == 21 * 512 + 20 * N // 128
    assert v4["keys_scanned"] == 21 * N // 4
    v41 = kvbytes.report(preset("v4_1_flash"), N)
    assert v41["read_main_bytes"] == 38 * 512 * 288  # about 5.6 MB at 288 B per entry
    assert v41["read_local_bytes"] == 40 * 128 * 528  # about 2.7 MB at 528 B
    assert v41["keys_scanned"] == 3 * N // 2 + N + 4 * 16384
    v32 = kvbytes.report(preset("v3_2"), N)
    assert round(100 * v32["read_key_share"]) == 93  # search keys are about 93% of the reads


def test_full_size_bf16_reads():
    # All-BF16 reads: the same item counts at BF16 sizes.
    v32 = kvbytes.report(preset("v3_2"), N)
    assert v32["read_bf16_kv_bytes"] == 61 * 2048 * 1152
    assert v32["read_bf16_key_bytes"] == 61 * N * 256
    v4 = kvbytes.report(preset("v4_flash"), N)
    assert v4["read_bf16_kv_bytes"] == (21 * 512 + 20 * N // 128 + 43 * 128) * 1024
    assert v4["read_bf16_key_bytes"] == 21 * N // 4 * 256
    v41 = kvbytes.report(preset("v4_1_flash"), N)
    assert v41["read_bf16_kv_bytes"] == (38 * 512 + 40 * 128) * 1024
    assert v41["read_bf16_key_bytes"] == (3 * N // 2 + N + 4 * 16384) * 256
    assert v41["read_bf16_bytes"] == v41["read_bf16_kv_bytes"] + v41["read_bf16_key_bytes"]


def test_v41_sharing_sources_in_breakdown():
    layers = kvbytes.report(preset("v4_1_flash"), N)["layers"]
    assert [x["layer"] for x in layers if x["kind"] == "full"] == [2, 8, 14, 20]
    assert [x["layer"] for x in layers if x["kind"] == "reindex"] == [24, 28, 32, 36]
    assert (layers[21]["kv_source"], layers[21]["select_source"]) == (20, 20)
    assert (layers[25]["kv_source"], layers[25]["select_source"]) == (20, 24)
    assert layers[9]["kv_source"] == 8 and layers[9]["keys_scanned"] == 0
    assert layers[24]["keys_scanned"] == 2048 * 8  # pooled candidates only
    assert layers[20]["keys_scanned"] == N  # the candidate source still scans everything
    assert layers[2]["keys_scanned"] == N // 2


def test_sharing_off_stores_in_every_csa2_layer():
    cfg = preset("v4_1_flash", ["attention.sharing=false"])
    # 18 encoder layers at m=2 and 20 decoder layers at m=1, each storing 288 + 68 B
    assert kvbytes.storage_per_token(cfg) == 18 * 356 / 2 + 20 * 356


# ------------------------------------------------------------------ hand-computed small cases
V4_TINY = """
name: v4_tiny
model: {n_layers: 6}
attention:
  layers: "swa, csa, hca, full, reindex, reuse"
  ratios: "0, 4, 8, 2, 2, 2"
  entry_dim: 64
  rope_dim: 16
  q_lora_rank: 32
  window: 16
  top_k: 8
indexer: {head_dim: 32, rope_dim: 8}
cache: {local_format: fp8_ue8m0, main_format: fp4_e4m3, key_format: fp4_ue8m0}
"""
# local 64 + 64/32 = 66 B; main 32 + 64/16 = 36 B; key 16 + 32/32 = 17 B


def test_tiny_v4_storage_and_local():
    cfg = loads(V4_TINY)
    assert kvbytes.storage_per_layer(cfg) == [0, 53 / 4, 36 / 8, 53 / 2, 0, 0]
    assert kvbytes.storage_per_token(cfg) == 44.25
    # BF16: main 128 B, key 64 B
    assert kvbytes.storage_per_layer(cfg, bf16=True) == [0, 48, 16, 96, 0, 0]
    rep = kvbytes.report(cfg, 100)
    assert rep["local_bytes"] == 6 * 16 * 66
    assert rep["local_bf16_bytes"] == 6 * 16 * 128
    assert rep["crossover_context"] == pytest.approx(6336 / 44.25)


def test_tiny_v4_reads_long_context():
    rep = kvbytes.report(loads(V4_TINY), 100)
    counts = [(x["window_read"], x["entries_read"], x["keys_scanned"]) for x in rep["layers"]]
    # swa: window only; csa: 25 visible, top 8, scans 25; hca: all 100//8 = 12;
    # full: 50 visible, top 8, scans 50; reindex: top 8 of 50, scans 50; reuse: 8, scans 0
    assert counts == [(16, 0, 0), (16, 8, 25), (16, 12, 0), (16, 8, 50), (16, 8, 50), (16, 8, 0)]
    assert rep["read_local_bytes"] == 6 * 16 * 66
    assert rep["read_main_bytes"] == (8 + 12 + 8 + 8 + 8) * 36
    assert rep["read_kv_bytes"] == 6336 + 1584
    assert rep["read_key_bytes"] == (25 + 50 + 50) * 17
    assert rep["read_bytes"] == 7920 + 2125
    assert rep["read_bf16_kv_bytes"] == 6 * 16 * 128 + 44 * 128
    assert rep["read_bf16_key_bytes"] == 125 * 64
    # exact global cache after 100 tokens: csa 25 x 53 + hca 12 x 36 + full 50 x 53
    assert rep["global_bytes"] == 25 * 53 + 12 * 36 + 50 * 53
    assert rep["cache_bytes"] == rep["global_bytes"] + 6336


def test_tiny_v4_reads_short_context():
    # 10 tokens: the window is not full and top_k exceeds the visible entries.
    rep = kvbytes.report(loads(V4_TINY), 10)
    counts = [(x["window_read"], x["entries_read"], x["keys_scanned"]) for x in rep["layers"]]
    # csa 10//4 = 2 visible; hca 10//8 = 1; full/reindex/reuse 10//2 = 5 visible (< top_k 8)
    assert counts == [(10, 0, 0), (10, 2, 2), (10, 1, 0), (10, 5, 5), (10, 5, 5), (10, 5, 0)]
    assert rep["read_kv_bytes"] == 6 * 10 * 66 + (2 + 1 + 5 + 5 + 5) * 36
    assert rep["read_key_bytes"] == (2 + 5 + 5) * 17
    assert rep["cache_bytes"] == (2 * 53 + 1 * 36 + 5 * 53) + 6 * 10 * 66
    # nothing cached yet: only zeros
    empty = kvbytes.report(loads(V4_TINY), 0)
    assert empty["read_bytes"] == 0 and empty["read_key_share"] == 0.0


def test_tiny_v4_hierarchical_pool():
    cfg = loads(V4_TINY, ["attention.pool_blocks=2", "attention.pool_block_size=4"])
    rep = kvbytes.report(cfg, 100)
    keys = [x["keys_scanned"] for x in rep["layers"]]
    assert keys == [0, 25, 0, 50, 8, 0]  # reindex scores only 2 x 4 pooled candidates
    assert rep["read_key_bytes"] == 83 * 17
    short = kvbytes.report(cfg, 10)  # pool larger than the 5 visible entries
    assert [x["keys_scanned"] for x in short["layers"]] == [0, 2, 0, 5, 5, 0]


BASE_TINY = """
name: base_tiny
model: {n_layers: 3, dtype: float32}
attention:
  layers: "mha, mla, dsa"
  n_heads: 4
  n_kv_heads: 2
  head_dim: 16
  kv_lora_rank: 32
  qk_rope_dim: 8
  top_k: 5
indexer: {head_dim: 16, rope_dim: 8}
"""
# native float32: mha 2 x 2 heads x 16 x 4 B = 256; mla (32 + 8) x 4 = 160; dsa 160 + 16 x 4


def test_tiny_baselines_native_dtype():
    cfg = loads(BASE_TINY)
    assert kvbytes.storage_per_layer(cfg) == [256, 160, 224]
    assert kvbytes.storage_per_layer(cfg, bf16=True) == [128, 80, 112]
    assert kvbytes.storage_per_token(loads(BASE_TINY, ["model.dtype=float64"])) == 2 * 640
    rep = kvbytes.report(cfg, 20)
    assert [x["entries_read"] for x in rep["layers"]] == [20, 20, 5]
    assert rep["read_kv_bytes"] == 20 * 256 + 20 * 160 + 5 * 160
    assert rep["read_key_bytes"] == 20 * 64
    assert rep["local_bytes"] == 0 and rep["crossover_context"] is None
    short = kvbytes.report(cfg, 3)  # top_k 5 > 3 visible tokens
    assert [x["entries_read"] for x in short["layers"]] == [3, 3, 3]
    assert short["read_kv_bytes"] == 3 * (256 + 160 + 160)
    assert short["read_key_bytes"] == 3 * 64
    assert short["global_bytes"] == 3 * 640


def test_breakdown_sums_to_totals():
    for cfg in (preset("v4_1_flash"), loads(V4_TINY), loads(BASE_TINY)):
        rep = kvbytes.report(cfg, 4099)
        for key in ("read_kv_bytes", "read_key_bytes", "read_bytes", "read_bf16_kv_bytes",
                    "read_bf16_key_bytes"):
            assert sum(x[key] for x in rep["layers"]) == rep[key], key
        assert sum(x["storage_bytes_per_token"] for x in rep["layers"]) == pytest.approx(
            rep["storage_bytes_per_token"])


def test_bad_context():
    with pytest.raises(ValueError, match="context"):
        kvbytes.report(loads(BASE_TINY), -1)
    with pytest.raises(ValueError, match="context"):
        kvbytes.report(loads(BASE_TINY), 1.5)


# ------------------------------------------------------------------ scripts/kv_report.py
def _script():
    spec = importlib.util.spec_from_file_location("kv_report", ROOT / "scripts" / "kv_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kv_report_main_smoke(tmp_path, capsys):
    mod = _script()
    assert mod.parse_tokens("128K") == N and mod.parse_tokens("1M") == 2**20
    paths = [str(PRESETS / f"{n}.yaml") for n in ("v4_1_flash", "mha_v2dims", "v4_flash")]
    assert mod.main(paths + ["--context", "128K", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "1/4,418" in table and "1/1,119" in table and "3,514.25" in table
    for png in ("cache_size.png", "reads_per_step.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    rows = json.loads((tmp_path / "kv_report.json").read_text())
    by = {r["name"]: r for r in rows}
    assert by["v4_1_flash"]["reference"] == "mha_v2dims"  # first mha*, not the first argument
    assert by["v4_1_flash"]["ratio_to_reference"] == pytest.approx(3_932_160 / 890)
    assert by["v4_1_flash"]["read_kv_bytes"] == 8_306_688
    assert by["v4_flash"]["read_key_bytes"] == 46_792_704
    assert by["v4_flash"]["storage_bytes_per_token"] == 3514.25


def test_kv_report_reference_without_mha():
    mod = _script()
    rows = mod.build_rows([PRESETS / "v4_flash.yaml", PRESETS / "v3_2.yaml"], 1024)
    assert all(r["reference"] == "v3_2" for r in rows)  # the largest storage per token
