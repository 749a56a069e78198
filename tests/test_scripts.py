"""The scripts as a user runs them: subprocesses on one tiny trained run (a 1-layer MHA model,
2 steps of 2 x 16 tokens), shared by the whole module to keep it quick."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsattn import checkpoint, cli, config, data, kvbytes
from dsattn.errors import ConfigError
from tests.helpers import forward

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.n_layers=1", "model.d_model=32", "model.ffn_hidden=64", "attention.n_heads=2",
        "attention.n_kv_heads=2", "attention.head_dim=16", "train.batch_size=2",
        "train.seq_len=16", "train.steps=2", "train.ckpt_every=1", "train.eval_batches=1",
        "data.max_bytes=200000"]


def script(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"),
                           *map(str, args)], capture_output=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("scripts") / "tiny"
    # The overrides follow the options: they are accepted anywhere on the command line.
    p = script("train", "configs/tiny/mha.yaml", "--run-dir", run, "--quiet", *TINY)
    assert p.returncode == 0, p.stderr.decode()
    assert config.load(run / "config.yaml").model.n_layers == 1
    return run


# ----------------------------------------------------------------- 1. errors and arguments
USER_ERRORS = [  # (script and arguments, exit status, text the one line must hold)
    (["train", "configs/tiny/mha.yaml", "attention.n_heads=3"], 1, "attention.n_kv_heads"),
    (["train", "configs/tiny/nope.yaml"], 1, "nope.yaml"),
    (["train", "configs/tiny/mla.yaml", "--run-dir", "{run}"], 1, "checkpoint was trained"),
    (["generate", "{run}/missing", "--max-new", "4"], 1, "no config.yaml"),
    (["eval", "{run}", "--seq-len", "1000000"], 1, "validation split has"),
    (["kv_report", "nope.yaml", "--no-plots"], 1, "nope.yaml"),
    (["replay_report", "{run}", "--timing-len", "0"], 1, "ced_split"),
    (["bench_indexer", "--formats", "nope"], 2, "nope"),
    (["demo", "model.d_model=-1"], 1, "model.d_model"),
]


@pytest.mark.parametrize("argv, status, needle", USER_ERRORS,
                         ids=[" ".join(a[:2]) for a, _, _ in USER_ERRORS])
def test_user_errors_are_one_line(run_dir, argv, status, needle):
    p = script(*[a.format(run=run_dir) for a in argv])
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == status, p.stderr.decode()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0], err


def test_debug_shows_the_traceback():
    p = script("train", "configs/tiny/mha.yaml", "attention.n_heads=3", "--debug")
    assert p.returncode == 1 and b"Traceback" in p.stderr and b"ConfigError" in p.stderr


def test_run_keeps_tracebacks_for_bugs(capsys):
    def user_error(argv):
        raise ConfigError("attention.top_k: must be >= 1")

    with pytest.raises(SystemExit) as e:
        cli.run(user_error, [])
    assert e.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{Path(sys.argv[0]).name}: error: attention.top_k: must be >= 1"]
    with pytest.raises(ZeroDivisionError):  # a bug: the exception (and traceback) goes through
        cli.run(lambda argv: 1 / 0, [])
    with pytest.raises(ConfigError):
        cli.run(user_error, ["--debug"])


def flip_params(run, step):
    """Invert 64 bytes in the middle of the step's largest params file; its path in the step."""
    d = run / "checkpoints" / str(step)
    f = max((p for p in (d / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    b = bytearray(f.read_bytes())
    b[len(b) // 2:len(b) // 2 + 64] = bytes(x ^ 0xFF for x in b[len(b) // 2:len(b) // 2 + 64])
    f.write_bytes(bytes(b))
    return f.relative_to(d).as_posix()


def test_warnings_are_one_line_without_source(run_dir, tmp_path):
    """A warning for the user (here: a resume that rebuilds the schedule) is a message, not the
    line of code that raised it."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    p = script("train", "configs/tiny/mha.yaml", "--run-dir", run, "--quiet", *TINY,
               "train.steps=3")
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 0, p.stderr.decode()
    # each warning one line (here also the run's steps shorter than its warm-up)
    assert all(line.startswith("train.py: warning: ") for line in err), err
    assert [line for line in err if "train.steps 2 -> 3" in line], err
    assert not [line for line in err if ".py:" in line.split("warning: ", 1)[1]], err


def test_damaged_checkpoint_warns_in_one_line_and_the_one_before_is_used(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    name = flip_params(run, 2)
    p = script("generate", run, "--max-new", "4")
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 0, p.stderr.decode()
    assert len(err) == 2 and err[1].endswith("checkpoint step 1]"), err
    assert err[0].startswith("generate.py: warning: ") and "skipping checkpoint step 2" in err[0]
    assert f"({name}: content differs" in err[0] and "using step 1" in err[0], err
    p = script("generate", run, "--max-new", "4", "--debug")  # the full detail: where, what
    err = p.stderr.decode()
    assert p.returncode == 0 and "UserWarning" in err and ".py:" in err, err
    p = script("generate", run, "--max-new", "4", "--step", "2")  # asked for: refused
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 1 and len(err) == 1 and "checkpoint step 2 does not load" in err[0]
    p = script("eval", run, "--seq-len", "16", "--quiet")
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == 0 and b"(step 1)" in p.stdout, p.stderr.decode()
    assert len(err) == 1 and "skipping checkpoint step 2" in err[0], err


def test_overrides_anywhere_on_the_line():
    ap = cli.parser("x", overrides=True)
    ap.add_argument("config")
    ap.add_argument("--run-dir")
    ap.add_argument("--quiet", action="store_true")
    args = cli.parse(ap, ["a.b=1", "--run-dir", "x=y", "c.yaml", "--quiet", "d.e=2"])
    assert (args.config, args.run_dir, args.quiet) == ("c.yaml", "x=y", True)
    assert args.overrides == ["a.b=1", "d.e=2"]


def test_demo_help():
    p = script("demo", "--help")
    assert p.returncode == 0 and b"usage:" in p.stdout and b"--run-dir" in p.stdout, p.stderr


# ----------------------------------------------------------------- 2. generate.py
def test_every_generate_and_eval_option_has_help():
    from scripts import eval as eval_script
    from scripts import generate as generate_script

    for ap in (generate_script.parser(), eval_script.parser()):
        missing = [a.dest for a in ap._actions if not a.help]
        assert not missing, missing


def test_generate_prompt_file_step_max_len(run_dir, tmp_path):
    prompt = b"\xff\xfe\x00def f(\x80"  # not UTF-8
    (tmp_path / "p.bin").write_bytes(prompt)
    p = script("generate", run_dir, "--prompt-file", tmp_path / "p.bin", "--step", 1,
               "--max-len", 32, "--max-new", 5, "--temperature", 0)
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.startswith(prompt) and len(p.stdout) == len(prompt) + 5 + 1
    assert b"checkpoint step 1" in p.stderr


def test_generate_takes_layout_and_execution_overrides(run_dir):
    """A run decodes under another layout or block size with the same greedy text; a change
    to the model itself is refused."""
    args = ("--prompt", "abc", "--max-new", 6, "--temperature", 0)
    base = script("generate", run_dir, *args)
    other = script("generate", run_dir, *args, "model.scan_layers=false",
                   "attention.query_block=2")
    assert base.returncode == other.returncode == 0, other.stderr.decode()
    assert other.stdout == base.stdout
    bad = script("generate", run_dir, *args, "attention.head_dim=8")
    assert bad.returncode == 1 and b"checkpoint was trained" in bad.stderr


@pytest.mark.parametrize("args, status, needle", [
    (["--max-new", "-1"], 2, "--max-new"),
    (["--step", "7"], 1, "saved steps: 1, 2"),
    (["--prompt", "0123456789", "--max-new", "5", "--max-len", "8"], 2, "--max-len 8"),
])
def test_generate_bad_arguments(run_dir, args, status, needle):
    p = script("generate", run_dir, *args)
    err = p.stderr.decode().strip().splitlines()
    assert p.returncode == status and len(err) == 1 and needle in err[0], err


# ----------------------------------------------------------------- 3. eval.py
def _nll(model, inputs, targets) -> np.ndarray:
    """Each position's cross-entropy, in float64 from the model's logits."""
    logits = np.asarray(forward(model, inputs), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1)[..., 0]


def test_eval_measures_the_split_by_default_with_a_standard_error(run_dir, tmp_path):
    """By default eval.py scores the validation split in consecutive windows (every token
    once, up to --max-tokens; it scored 1 batch of random windows, 32 tokens here) and gives
    each loss a standard error over the windows."""
    out = tmp_path / "eval.json"
    p = script("eval", run_dir, "--seq-len", "16", "--json", out, "--quiet")
    assert p.returncode == 0, p.stderr.decode()
    (row,) = json.loads(out.read_text())["rows"]
    model, cfg, _ = checkpoint.load_params(run_dir)
    val = data.load_corpus(cfg.data, cfg.model.vocab_size).val.astype(np.int64)
    k = (len(val) - 1) // 16 // 2 * 2  # whole windows, in whole batches of the run's 2 rows
    assert 100 < k and row["tokens"] == 16 * k and row["windows"] == k
    windows = np.stack([val[16 * i: 16 * i + 17] for i in range(k)])
    per = np.concatenate([_nll(model, windows[i:i + 2, :-1], windows[i:i + 2, 1:])
                          for i in range(0, k, 2)]).mean(-1)
    assert row["nats_per_token"] == pytest.approx(per.mean(), rel=1e-5)
    assert row["nats_per_token_se"] == pytest.approx(per.std(ddof=1) / math.sqrt(k), rel=1e-4)
    line = next(x for x in p.stdout.decode().splitlines() if x.split()[:1] == ["16"])
    assert f"{row['nats_per_token']:.4f} ± {row['nats_per_token_se']:.4f}" in line, line
    # a cap: its windows spread evenly over the split, in whole batches
    k, batches = data.split_windows(np.arange(1000), 16, 2, max_tokens=64)
    starts = [int(w[0]) for b in batches for w in b["inputs"]]
    assert k == 4 and starts == [0, 320, 656, 976]  # of 0, 16, ..., 976: 1st, 21st, 42nd, 62nd


def test_eval_matches_hand_computed_cross_entropy(run_dir, tmp_path):
    out = tmp_path / "eval.json"
    p = script("eval", run_dir, "--seq-len", "16,48", "--json", out, "--batches", "1")
    assert p.returncode == 0, p.stderr.decode()
    rows = {r["seq_len"]: r for r in json.loads(out.read_text())["rows"]}
    model, cfg, step = checkpoint.load_params(run_dir)
    val = data.load_corpus(cfg.data, cfg.model.vocab_size).val
    for n in (16, 48):  # 48: three times the training length
        (batch,) = data.eval_batches(val, 1, 2, n, seed=cfg.train.seed)
        logits = np.asarray(forward(model, batch["inputs"]), np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, batch["targets"][..., None], -1).mean()
        assert rows[n]["nats_per_token"] == pytest.approx(nll, rel=1e-5)
        assert rows[n]["bits_per_byte"] == pytest.approx(nll / math.log(2), rel=1e-5)
    # At the training length with the run's own batches: the val_loss training logged.
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[16]["nats_per_token"] == pytest.approx(logged[-1]["val_loss"], rel=1e-5)


def test_eval_progress_off_a_terminal_is_plain_lines(run_dir, capsys):
    from scripts import eval as eval_script

    eval_script.main([str(run_dir), "--seq-len", "16,32", "--progress-every", "1",
                      "--batches", "1"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("eval ")]
    assert "\r" not in err and [line.split(";")[0].split(": ")[1] for line in lines] == [
        "batch 1/2 (50%) seq_len 16", "batch 2/2 (100%) seq_len 32"], err


# ----------------------------------------------------------------- 4. kv_report.py
def test_kv_report_run_dirs_and_ratio_precision(run_dir, tmp_path):
    # MHA stores 2 * kv heads * head_dim * 4 B (float32) per layer: 224 and 160 B per token.
    for name, head_dim in (("mha_a", 14), ("b", 10)):
        (tmp_path / f"{name}.yaml").write_text(
            "model: {n_layers: 2}\nattention: {layers: mha, n_heads: 1, n_kv_heads: 1, "
            f"head_dim: {head_dim}}}\n")
    p = script("kv_report", tmp_path / "mha_a.yaml", tmp_path / "b.yaml", run_dir,
               "--no-plots", "--out", tmp_path / "out")
    assert p.returncode == 0, p.stderr.decode()
    lines = {line.split()[0]: line.split() for line in p.stdout.decode().splitlines()[2:-1]}
    assert lines["mha_a"][1] == "224" and lines["b"][1] == "160"
    assert "1/1.4" in lines["b"]  # 224 / 160, not rounded to 1
    # The run is named by its directory; its bytes are its config's.
    run_cfg = config.load(run_dir / "config.yaml")
    assert lines[run_dir.name][1] == f"{kvbytes.storage_per_token(run_cfg):,.0f}"


def test_lower_reports_each_program_with_its_cache(tmp_path):
    """scripts/lower.py on a small preset: a decode row and a prefill-chunk row, each from a
    compiled program whose cache holds the stored bytes kvbytes counts."""
    out = tmp_path / "rows.json"
    p = script("lower", "configs/tiny/v41.yaml", "--max-len", "1K", "--chunk", "64", "--json",
               out, "model.dtype=bfloat16")
    assert p.returncode == 0, p.stderr.decode()
    rows = json.loads(out.read_text())
    assert [r["program"] for r in rows] == ["decode", "prefill 64"]
    cfg = config.load(ROOT / "configs/tiny/v41.yaml", ["model.dtype=bfloat16"])
    want = kvbytes.global_bytes(cfg, 1024) + kvbytes.local_bytes(cfg, context=1024)
    for r in rows:
        assert r["max_len"] == 1024 and r["cache_value_bytes"] == want
        assert r["temp_bytes"] > 0 and r["hlo_ops"] > 0
        assert r["argument_bytes"] >= r["param_bytes"] + r["cache_value_bytes"]


def test_kv_report_equal_curves_stay_visible(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from scripts import kv_report

    lines = []
    plot = Axes.plot

    def record(self, *args, **kwargs):
        out = plot(self, *args, **kwargs)
        lines.extend(out)
        return out

    monkeypatch.setattr(Axes, "plot", record)
    kv_report.write_plots([ROOT / "configs/deepseek/v2.yaml", ROOT / "configs/deepseek/v3.yaml"],
                          tmp_path, 80.0)
    for fig in ("B/token", "total"):  # the cache-size and the reads plot
        v2, v3 = [ln for ln in lines if fig in ln.get_label()]
        assert np.allclose(np.asarray(v2.get_ydata()), np.asarray(v3.get_ydata()), rtol=0.03)
        assert "None" not in (v2.get_marker(), v3.get_marker())  # markers show through
        assert (v2.get_marker(), v2.get_markevery()) != (v3.get_marker(), v3.get_markevery())


# ----------------------------------------------------------------- 5. demo
def test_demo_compares_v41_with_mha_and_mla_at_its_width():
    from scripts import demo

    assert Path(demo.DEFAULT).name == "v41.yaml"
    cfg = config.load(demo.DEFAULT)
    rows = {r["name"]: r for r in demo.cache_rows(cfg)}
    assert list(rows) == ["mha", "mla", "v41"]
    for name in ("mha", "mla"):
        ref = config.load(ROOT / f"configs/tiny/{name}.yaml", ["model.n_layers=10"])
        assert ref.model.d_model == cfg.model.d_model
        assert rows[name]["bytes_per_token"] == kvbytes.storage_per_token(ref)
        assert rows[name]["read_bytes"][65536] == kvbytes.report(ref, 65536)["read_bytes"]
    assert rows["v41"]["bytes_per_token"] == kvbytes.storage_per_token(cfg)


# ----------------------------------------------------------------- 6. docs
def test_recall_curve_trains_a_sweep_row(tmp_path):
    """recall_curve --row: a shipped sweep's row, scored on its probes every --every steps."""
    out = tmp_path / "curve.json"
    r = script("recall_curve", ROOT / "configs/ablations/ratios.yaml", "--row", "window",
               "train.steps=2", "--every", "1", "--distances", "2,16", "--per-distance", "2",
               "--out", out)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    got = json.loads(out.read_text())
    assert got["config"]["attention"]["window"] == 8
    assert [p["step"] for p in got["curve"]] == [1, 2]
    assert all(set(p["acc"]) == {"2", "16"} and 0 <= p["mean_acc"] <= 1 for p in got["curve"])
    r = script("recall_curve", ROOT / "configs/ablations/ratios.yaml", "--row", "nope")
    assert r.returncode != 0 and b"not a row" in r.stderr


def test_docs_stand_alone():
    readme = (ROOT / "README.md").read_text()
    assert "docs/design.md" in readme and (ROOT / "docs/design.md").exists()
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        assert "../shared" not in path.read_text(), path
    for needle in ("scripts/eval.py", "--prompt-file", "data.source", "load_params"):
        assert needle in readme, needle
