"""scripts/kv_report.py rows with their own overrides and names, unambiguous names for run
directories that share a last component, and dsattn.kvbytes.report's printed table."""

import importlib.util
import os
import shutil
from pathlib import Path

from dsattn import config, kvbytes
from tests.helpers import ROOT

FLASH = os.path.join(ROOT, "configs", "deepseek", "v4_flash.yaml")


def _kv_report():
    spec = importlib.util.spec_from_file_location(
        "kv_report", Path(ROOT) / "scripts" / "kv_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_take_their_own_overrides_and_labels():
    kv_report = _kv_report()
    rows = kv_report.build_rows([f"{FLASH}:attention.csa_ratio=2=csa2", f"{FLASH}=csa4",
                                 f"{FLASH}:attention.top_k=256"], 131072)
    assert [r["name"] for r in rows] == ["csa2", "csa4", "v4_flash attention.top_k=256"]
    m2 = config.load(FLASH, ["attention.csa_ratio=2"])
    assert rows[0]["storage_bytes_per_token"] == kvbytes.storage_per_token(m2)
    assert rows[1]["storage_bytes_per_token"] == 3514.25  # V4-Flash as shipped
    # halving m doubles each CSA layer's entries: more bytes per token than m=4
    assert rows[0]["storage_bytes_per_token"] > rows[1]["storage_bytes_per_token"]


def test_run_directories_sharing_a_name_are_told_apart(tmp_path):
    kv_report = _kv_report()
    dirs = [tmp_path / "sweep" / "runs" / row / "seed0" for row in ("csa_m2", "csa_m4")]
    for d in dirs:
        d.mkdir(parents=True)
        shutil.copy(FLASH, d / "config.yaml")
    cfgs = [config.load(FLASH)] * 2
    assert kv_report.labels([str(d) for d in dirs], cfgs) == ["csa_m2/seed0", "csa_m4/seed0"]
    assert kv_report.labels([FLASH, FLASH], cfgs) == ["v4_flash #1", "v4_flash #2"]


def test_report_prints_a_table_when_asked(capsys):
    cfg = config.load(os.path.join(ROOT, "configs", "tiny", "v4.yaml"))
    rep = kvbytes.report(cfg, 131072, show=True)
    text = capsys.readouterr().out
    assert rep == kvbytes.report(cfg, 131072) and text.strip() == kvbytes.format_report(rep)
    lines = text.splitlines()
    # tiny V4: CSA layers at m=4 store (64 + 32)-dim float32 entry + key / 4 = 96 B a token
    assert "224.00 B as deployed" in lines[1] and len(lines) == 6 + len(cfg.attention.layers)
    assert lines[-4].split()[:4] == ["2", "csa", "4", "96.00"]
    assert kvbytes.report(cfg, 131072) is not None and not capsys.readouterr().out


def test_kv_report_refuses_to_overwrite_its_folder_without_force(tmp_path, capsys):
    import pytest

    from dsattn import cli
    kv_report = _kv_report()
    out = tmp_path / "report"
    argv = [os.path.join(ROOT, "configs", "tiny", "mha.yaml"), "--out", str(out), "--no-plots"]
    for extra, status in (([], 0), ([], 1), (["--force"], 0)):
        with pytest.raises(SystemExit) as e:
            cli.run(kv_report.main, argv + extra)
        assert e.value.code == status
        err = capsys.readouterr().err
        if status:
            assert "--force" in err and len(err.strip().splitlines()) == 1
    assert (out / "kv_report.json").exists()


def test_kv_report_help_explains_every_column(capsys):
    import pytest
    kv_report = _kv_report()
    rows = kv_report.build_rows([os.path.join(ROOT, "configs", "tiny", n) for n in
                                 ("mha.yaml", "v4.yaml")], 4096)
    head = kv_report.format_table(rows).splitlines()[0]
    columns = [c.split("@")[0] for c in head.split("  ") if c.strip()][1:]  # after "config"
    with pytest.raises(SystemExit):
        kv_report.main(["--help"])
    help_text = capsys.readouterr().out
    columns = ["vs" if c.startswith("vs ") else c.strip().removesuffix(" (attn)")
               for c in columns]
    assert len(columns) == 11
    explained = [line.split("   ")[0].strip().split("@")[0] for line in help_text.splitlines()
                 if line.startswith("  ") and not line.startswith("   ")]
    for column in columns:
        assert column in explained, column  # each begins a line of its own explanation


def test_a_run_is_reported_at_its_own_context_alone_and_nothing_written_unasked(
        tmp_path, capsys, monkeypatch):
    """A run directory's row is read at its model.max_seq_len (it was 131,072: 16 times a
    tiny run's), a single row has no `vs` column (itself against itself), and without --out
    nothing is written (every call once shared runs/kv_report)."""
    import pytest

    from dsattn import cli
    kv_report = _kv_report()
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    cfg = config.load(os.path.join(ROOT, "configs", "tiny", "v4.yaml"),
                      ["model.max_seq_len=2048"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.run(kv_report.main, [str(run)])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    head = next(line for line in out.splitlines() if line.startswith("config"))
    assert "read/step@2,048" in head and " vs " not in f" {head} ", head
    assert "2,048 tokens: the run's model.max_seq_len" in out and "--out" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # no runs/kv_report
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tiny"]
    rows = kv_report.build_rows([os.path.join(ROOT, "configs", "tiny", "v4.yaml")], 4096)
    assert "vs" not in kv_report.format_table(rows).splitlines()[0].split()
    preset = kv_report.default_context([os.path.join(ROOT, "configs", "tiny", "v4.yaml")])
    assert preset == (131072, "")  # presets: 128K, the full-size designs' comparison
