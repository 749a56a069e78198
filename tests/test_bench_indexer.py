"""The indexer score-pass benchmark (dsattn.bench.indexer, behind scripts/bench_indexer.py)
runs end to end on small sizes and marks interpreted timings. The checks read its records,
not the printed table (the script's argument errors: tests/test_scripts.py)."""

from dsattn.bench import indexer


def test_bench_indexer_records():
    result = indexer.run(indexer.Settings(contexts=(100,), formats=("bf16", "fp4_ue8m0"),
                                          heads=4, dim=32, page_size=16, iters=1))
    # On CPU the GPU kernel runs in the Pallas interpreter, and the result says so.
    assert result["backend"] == "cpu" and result["impl"] == "pallas_gpu"
    assert result["interpreted"] is True and result["peak_gbs"] is None
    rows = result["rows"]
    assert [(r["format"], r["entries"], r["bytes_per_key"]) for r in rows] == [
        ("bf16", 100, 64), ("fp4_ue8m0", 100, 17)]
    for r in rows:
        assert r["read_bytes"] == 100 * r["bytes_per_key"]  # batch 1
        assert r["ref_ms"] > 0 and r["kernel_ms"] > 0 and r["fraction_of_peak"] is None
        assert r["rel_err"] < 1e-5  # the kernel equals the reference
