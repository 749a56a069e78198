"""scripts/bench_indexer.py runs end to end on small sizes and labels interpreted timings."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_indexer.py"
_spec = importlib.util.spec_from_file_location("bench_indexer", _PATH)
bench_indexer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_indexer)


def test_bench_indexer_prints_a_table(capsys):
    bench_indexer.main(["--contexts", "100", "--formats", "bf16,fp4_ue8m0", "--heads", "4",
                        "--dim", "32", "--page-size", "16", "--iters", "1"])
    out = capsys.readouterr().out.splitlines()
    assert "INTERPRETED" in out[0] and "pallas_gpu" in out[0]
    assert out[1].split()[:3] == ["format", "entries", "B/key"]
    rows = [line.split() for line in out[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("bf16", "100", "64"), ("fp4_ue8m0", "100", "17")]
    assert all(float(r[-1]) < 1e-5 for r in rows)  # rel err: the kernel equals the reference
