"""metrics.jsonl reading and cutting back (dsattn.runlog), with a half line left by a kill."""

import json

from dsattn import runlog


def _write(run_dir, steps, tail=""):
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in steps]
    (run_dir / runlog.METRICS).write_text("".join(line + "\n" for line in lines) + tail)


def test_records_skip_a_half_line(tmp_path):
    _write(tmp_path, [1, 2, 3], tail='{"step": 4, "lo')
    assert [r["step"] for r in runlog.records(tmp_path)] == [1, 2, 3]
    assert runlog.records(tmp_path / "nowhere") == []


def test_cut_drops_later_steps_and_the_half_line(tmp_path):
    _write(tmp_path, [1, 2, 3, 4], tail='{"step": 5, "lo')
    runlog.cut(tmp_path, 2)
    assert (tmp_path / runlog.METRICS).read_text().splitlines() == [
        json.dumps({"step": 1, "loss": 1.0}), json.dumps({"step": 2, "loss": 0.5})]
    assert not list(tmp_path.glob("*.tmp"))


def test_atomic_write_replaces_whole(tmp_path):
    path = tmp_path / "results.json"
    runlog.atomic_write(path, "old")
    runlog.atomic_write(path, "new")
    assert path.read_text() == "new" and not list(tmp_path.glob("*.tmp"))
