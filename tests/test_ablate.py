"""Ablation sweeps: bad files fail before any training naming the row and key; a two-row,
two-seed toy sweep writes results and plots, and a rerun after a killed run resumes that run
and skips the finished ones."""

import csv
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from dsattn import ablate
from dsattn import config as config_lib
from dsattn.errors import ConfigError
from tests.helpers import ROOT, run_script

MHA = os.path.join(ROOT, "configs", "tiny", "mha.yaml")
V4 = os.path.join(ROOT, "configs", "tiny", "v4.yaml")
V4_FLASH = os.path.join(ROOT, "configs", "deepseek", "v4_flash.yaml")
TOY = [  # a one-layer MHA model: compiles in seconds
    "model.n_layers=1", "model.d_model=32", "model.ffn_hidden=64", "attention.head_dim=8",
    "train.seq_len=48", "train.batch_size=2", "train.steps=4", "train.eval_every=2",
    "train.ckpt_every=2", "train.log_every=1", "train.eval_batches=1", "train.warmup_steps=1",
    "data.source=recall:min_dist=8,max_dist=32,length=8000"]
MQAR = "data.source=recall:format=mqar,block=48,pairs=4,keys=8,values=8,max_dist=46,length=4800"


def _write(tmp_path, **sweep):
    sweep = {"name": "toy", "base": MHA, "overrides": TOY, "seeds": [0], **sweep}
    sweep.setdefault("rows", [{"name": "mha", "overrides": []}])
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


@pytest.mark.parametrize("change, message", [
    ({"sedes": [0]}, r"sedes: unknown sweep key \(did you mean seeds\?\)"),
    ({"rows": [{"name": "a", "overrides": []}, {"name": "b", "overide": ["train.lr=1"]}]},
     r"row 'b': overide: unknown row key \(did you mean overrides\?\)"),
    ({"rows": [{"name": "a", "overrides": []}, {"overrides": []}]},
     r"row 2 of rows: no name"),
    ({"recall": {"per_distanse": 4}}, r"recall.per_distanse: unknown key \(did you mean "
                                      r"recall.per_distance\?\)"),
    ({"rows": [{"name": "a", "overrides": ["attention.n_kv_heads=3"]}]},
     r"row 'a': attention.n_kv_heads: 3 must divide"),
    ({"rows": [{"name": "b", "overrides": {"attention.windw": 8}}]},
     r"row 'b': attention.windw: unknown key"),
    ({"rows": [{"name": "c", "overrides": []}, {"name": "c", "overrides": ["train.lr=1"]}]},
     r"row 'c': duplicate row name"),
    ({"rows": [{"name": "d", "overrides": ["data.source=recall:max=9"]}]},
     r"row 'd': data.source: recall parameter 'max' unknown"),
    ({"recall": {"distances": [500]}}, r"recall.distances: 500"),
    ({"recall": {"per_distance": 0}}, r"recall.per_distance: expected an integer >= 1"),
    ({"base": "configs/tiny/nope.yaml"}, r"base: 'configs/tiny/nope.yaml' does not exist"),
    ({"seeds": [0, 0]}, r"seeds: expected a list of distinct"),
    ({"vmap_seeds": "yes"}, r"vmap_seeds: expected true or false"),
    ({"recall": {"through_cache": 1}}, r"recall.through_cache: expected true or false"),
    ({"lengths": [1, 2]}, r"lengths: expected a list of integers >= 2"),
    ({"rows": [{"name": "m", "overrides": [MQAR]}], "recall": {"distances": [7]}},
     r"recall.distances: 7 must be an integer in \[2, 46\] and a multiple of 2"),
    ({"rows": [{"name": "m", "overrides": [MQAR]}], "recall": {"seq_len": 64}},
     r"format=mqar: probe rows must fit a block of 48 tokens, got seq_len 64"),
    ({"lengths": [2, 64]}, r"row 'mha': lengths \[2, 64\] evaluate 3072 tokens, beyond "
                           r"model.max_seq_len="),
])
def test_bad_sweep_files_fail_before_training(tmp_path, change, message):
    path = _write(tmp_path, out=str(tmp_path / "out"), **change)
    with pytest.raises(ConfigError, match=message):
        ablate.run(path, quiet=True)
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written


def test_grid_rows_and_full_size_overrides(tmp_path):
    path = _write(tmp_path, base=V4, full_size=V4_FLASH, overrides=["train.steps=5"],
                  rows=[{"name": "w32", "overrides": ["attention.window=32",
                                                      "model.d_model=64",
                                                      "attention.layers=swa*6"]}],
                  grid={"attention.csa_ratio": [2, 8], "attention.hca_ratio": [16, 64]})
    sweep = ablate.load(path)
    names = [r.name for r in sweep.rows]
    assert names == ["w32", "csa_ratio=2,hca_ratio=16", "csa_ratio=2,hca_ratio=64",
                     "csa_ratio=8,hca_ratio=16", "csa_ratio=8,hca_ratio=64"]
    assert sweep.config(sweep.rows[4], 3).attention.ratios == (0, 0, 8, 64, 8, 64)
    full, applied, skipped = ablate.full_size_config(sweep, sweep.rows[0])
    # window has a meaning at full size; d_model is the tiny model's; six layers do not fit 43
    assert applied == ["attention.window=32"] and skipped == ["attention.layers=swa*6"]
    assert full.attention.window == 32 and full.model.d_model == 4096
    full, _, _ = ablate.full_size_config(sweep, sweep.rows[3])
    assert full.attention.ratios[2:4] == (8, 16)  # V4-Flash: csa at m=8, hca at m'=16


def test_per_layer_ratios_carry_to_full_size_by_role(tmp_path):
    v41 = os.path.join(ROOT, "configs", "tiny", "v41.yaml")
    flash = os.path.join(ROOT, "configs", "deepseek", "v4_1_flash.yaml")
    path = _write(tmp_path, base=v41, full_size=flash, overrides=["train.steps=5"],
                  rows=[{"name": "m", "overrides": ["attention.ratios=0*2, 4*3, 2*5"]}])
    full, applied, skipped = ablate.full_size_config(*_sweep_and_row(path))
    # tiny: encoder full/reuse at m=4, decoder at m=2; V4.1-Flash: 18 encoder, 20 decoder
    assert full.attention.ratios == (0, 0) + (4,) * 18 + (2,) * 20 and not skipped
    mixed = "attention.ratios=0*2, 4, 16, 8, 16"  # the two CSA layers differ: no one m
    path = _write(tmp_path, base=V4, full_size=V4_FLASH, overrides=["train.steps=5"],
                  rows=[{"name": "mixed", "overrides": [mixed]}])
    full, applied, skipped = ablate.full_size_config(*_sweep_and_row(path))
    assert skipped == [mixed] and full.attention.ratios == config_lib.load(
        V4_FLASH).attention.ratios


def _sweep_and_row(path):
    sweep = ablate.load(path)
    return sweep, sweep.rows[0]


def test_pareto_front():
    pts = [(10, 3.0), (20, 2.0), (15, 3.5), (40, 1.0), (40, 1.5), (5, 4.0)]
    assert ablate.pareto(pts) == [5, 0, 1, 3]


def progress_lines(capsys) -> list[str]:
    return sweep_lines(capsys.readouterr().err)


def sweep_lines(err: str) -> list[str]:
    assert "\r" not in err  # off a terminal: lines, no bars
    return [line for line in err.splitlines() if line.startswith("sweep toy:")]


def test_toy_sweep_runs_resumes_and_reports(tmp_path, capsys):
    out = tmp_path / "sweep"
    path = _write(tmp_path, rows=[{"name": "mha", "overrides": []},
                                  {"name": "mqa", "overrides": {"attention.n_kv_heads": 1}}],
                  seeds=[0, 1], full_size=V4_FLASH, recall={"distances": [8, 40],
                                                            "per_distance": 2},
                  decode_context=0)
    results = ablate.run(path, out=out)
    assert [(r["row"], r["seed"]) for r in results] == [
        ("mha", 0), ("mha", 1), ("mqa", 0), ("mqa", 1)]
    err = capsys.readouterr().err
    # before any training: what the estimate times (minutes for many shapes), then its answer
    assert err.splitlines()[0].startswith("estimate for sweep toy: timing 2 row shapes: ")
    assert "estimate for sweep toy: about " in err.splitlines()[1]
    lines = sweep_lines(err)  # one line per finished run, with the sweep's ETA
    assert [line.split(";")[0] for line in lines] == [
        f"sweep toy: run {i + 1}/4 ({25 * (i + 1)}%) row {r['row']} seed {r['seed']} "
        f"val_loss {r['val_loss']:.4f}" for i, r in enumerate(results)]
    assert all(" elapsed, ETA " in line for line in lines)
    saved = json.loads((out / "results.json").read_text())["runs"]
    assert saved == json.loads(json.dumps(results))
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {"val_loss", "recall_d8", "recall_d40", "read_bytes_128k",
                               "full_read_bytes_128k", "decode_ms", "params"} <= set(rows[0])
    with open(out / "summary.csv") as f:  # per row over its two seeds: t(0.975, 1 dof)
        summary = {r["row"]: r for r in csv.DictReader(f)}
    losses = [r["val_loss"] for r in results[:2]]
    half = 12.706204736174696 * abs(losses[0] - losses[1]) / 2
    assert summary["mha"]["seeds"] == "2"
    assert float(summary["mha"]["val_loss_mean"]) == pytest.approx(sum(losses) / 2)
    assert float(summary["mha"]["val_loss_hi"]) == pytest.approx(sum(losses) / 2 + half)
    assert {"recall_d8_lo", "recall_mean_hi", "train_tokens_per_s_std", "val_loss_x4_mean",
            "recall_x2_d80_hi", "recall_within_mean"} <= set(summary["mqa"])
    # per row: reach (a layer without a window: every distance within), bytes per token and
    # reads at 128K, own config in its formats (native float32) and BF16, and at full size
    # (V4-Flash's own formats); no decode timing asked for, so no decode_ms column
    assert summary["mha"]["reach"] == "" and summary["mha"]["loss_unit"] == "nats per answer token"
    assert float(summary["mqa"]["storage_bytes_per_token"]) == 2 * 1 * 8 * 4
    assert float(summary["mqa"]["storage_bf16_bytes_per_token"]) == 2 * 1 * 8 * 2
    assert float(summary["mqa"]["read_bytes_128k"]) == 131072 * 2 * 1 * 8 * 4
    assert float(summary["mha"]["full_storage_bytes_per_token"]) == 3514.25
    assert "full_read_bf16_bytes_128k" in summary["mha"]
    assert not [k for k in summary["mha"] if k.startswith("decode_ms")]
    text = ablate.table(results)
    assert "dec ms" not in text.splitlines()[0] and "not shown: dec ms: " in text
    assert "x2: recall on 96-token rows: new probes with the facts 2x farther back" in text
    assert "mha vs mqa: loss " in text and "recall all d " in text
    mha, mqa = results[0], results[2]
    # KV bytes per token from the run's config: K and V of 4 heads (or 1) x 8 dims x 4 bytes
    assert mha["kv"]["storage_bytes_per_token"] == 2 * 4 * 8 * 4
    assert mqa["kv"]["storage_bytes_per_token"] == 2 * 1 * 8 * 4
    # V4-Flash's storage per token (configs/deepseek/v4_flash.yaml, dsattn/kvbytes.py)
    assert mha["kv_full"]["storage_bytes_per_token"] == 3514.25
    for r in results:
        # one TensorBoard run per row and seed (dsattn.tblog), so TensorBoard overlays them
        assert list((out / "runs" / r["row"] / f"seed{r['seed']}").glob("events.out.tfevents.*"))
        assert r["steps"] == 4 and [s for s, _ in r["curve"]] == [2, 4]
        assert 0 < r["val_loss"] < 6 and r["val_loss"] == r["curve"][-1][1]
        assert r["params"] > 0 and r["train_tokens_per_s"] > 0 and r["decode_ms"] is None
        assert set(r["recall"]) == {"8", "40"}
        # beyond the training length (48): loss at 96 and 192 tokens, facts 2x / 4x back
        assert {m: set(b["recall"]) for m, b in r["beyond"].items()} == {
            "2": {"16", "80"}, "4": {"32", "160"}}
        assert all(0 < b["val_loss"] < 8 for b in r["beyond"].values())
    assert results[0]["val_loss"] != results[1]["val_loss"]  # seeds differ
    assert [r["seeds_together"] for r in results] == [2, 2, 2, 2]  # one vmapped model a row
    for png in ("pareto.png", "recall.png", "curves.png"):
        assert os.path.getsize(out / png) > 1000

    # Kill the last run after its step-2 checkpoint: no result, no final checkpoint.
    last = out / "runs" / "mqa" / "seed1"
    sweep = ablate.load(path, out=out)
    assert ablate.estimate(sweep)["seconds"] == 0  # every run finished
    (last / "result.json").unlink()
    left = ablate.estimate(sweep)  # trained to the end: only its measurements left
    assert left["units"] == 0 and left["seconds"] == left["measure_s"] > 0
    shutil.rmtree(last / "checkpoints" / "4")
    left = ablate.estimate(sweep)  # one seed of one row left, timed in a scratch directory
    t = left["rows"]["mqa"]  # its 2 steps after the step-2 save, one validation (every 2)
    assert left["units"] == 1 and t["step_s"] > 0 and list(left["rows"]) == ["mqa"]
    assert left["seconds"] == pytest.approx(t["compile_s"] + 2 * t["step_s"] + t["eval_s"]
                                            + t["measure_s"])
    finished = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/*/result.json")}
    again = ablate.run(path, out=out)
    assert [line.split()[3] for line in progress_lines(capsys)] == ["4/4"]  # 3 were done
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # skipped, not redone
    assert again[:3] == json.loads(json.dumps(results[:3]))
    resumed = [json.loads(x)["step"] for x in (last / "metrics.jsonl").read_text().splitlines()]
    assert resumed[-2:] == [3, 4]  # trained on from step 2, not from scratch
    assert again[3]["steps"] == 4 and (last / "result.json").exists()
    assert again[3]["seeds_together"] == 1  # the only seed left to train

    # Scaled up in the same directory: finished runs would be stale, so nothing starts.
    with pytest.raises(ConfigError, match=r"row 'mha' seed 0: .* finished with other"):
        ablate.run(path, ["train.steps=8"], out=out, quiet=True)
    assert json.loads((out / "runs/mha/seed0/result.json").read_text())["steps"] == 4

    os.remove(out / "pareto.png")
    p = run_script("ablate", "--report", out)  # the CLI: plots redrawn, no training
    assert p.returncode == 0, p.stderr.decode()
    assert (out / "pareto.png").exists() and "mqa" in ablate.report(out)


def test_a_second_sweep_on_the_same_directory_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "sweep"
    path = _write(tmp_path, overrides=[*TOY, "train.steps=100000"], decode_context=0,
                  recall={"distances": [8], "per_distance": 1})
    holder = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "ablate.py"),
                               str(path), "--out", str(out), "--quiet"], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    locks = [out / ".lock", out / "runs" / "mha" / "seed0" / ".lock"]  # the sweep's, the run's
    try:
        t0 = time.monotonic()
        while not any(p.exists() and p.read_text().strip() == str(holder.pid) for p in locks):
            assert holder.poll() is None, holder.communicate()[1].decode()[-3000:]
            assert time.monotonic() - t0 < 120, "the sweep did not start"
            time.sleep(0.05)
        p = run_script("ablate", path, "--out", out)
        err = p.stderr.decode().strip().splitlines()
        assert p.returncode == 1 and len(err) == 1 and f"(pid {holder.pid})" in err[0], err
        assert "ablate.py: error: " in err[0] and "another --out" in err[0], err
        assert holder.poll() is None and not (out / "results.json").exists()  # nothing written
    finally:
        holder.kill()
        holder.wait()


def test_shipped_ratios_sweep_has_its_controls():
    """The ratios sweep: >= 3 seeds, one recall source for every row, a full-attention row
    whose window covers the sequence and a window-only row whose two layers reach less than
    the farthest probe."""
    sweep = ablate.load(os.path.join(ROOT, "configs", "ablations", "ratios.yaml"))
    cfgs = {r.name: sweep.config(r, 0) for r in sweep.rows}
    assert len(sweep.seeds) >= 3 and len(cfgs) >= 5
    (source,) = {c.data.source for c in cfgs.values()}
    assert source.recall.format == "mqar"
    full, window = cfgs["full"], cfgs["window"]
    assert set(full.attention.layers) == set(window.attention.layers) == {"swa"}
    assert full.attention.window >= full.train.seq_len
    reach = window.model.n_layers * (window.attention.window - 1)
    assert reach < max(sweep.distances) and min(sweep.distances) <= reach


@pytest.mark.parametrize("name", ["topk_window", "v41_parts", "formats"])
def test_shipped_sweeps_share_the_recall_recipe(name):
    """Every shipped sweep trains on the ratios sweep's recall source, with >= 3 seeds and
    rows that differ (no two rows one config)."""
    ratios = ablate.load(os.path.join(ROOT, "configs", "ablations", "ratios.yaml"))
    sweep = ablate.load(os.path.join(ROOT, "configs", "ablations", f"{name}.yaml"))
    cfgs = [sweep.config(r, 0) for r in sweep.rows]
    assert len(sweep.seeds) >= 3 and len(cfgs) >= 4
    assert len({json.dumps(c.to_dict(), sort_keys=True) for c in cfgs}) == len(cfgs)
    assert {c.data.source for c in cfgs} == {ratios.config(ratios.rows[0], 0).data.source}


def test_unreadable_sweep_file(tmp_path):
    (tmp_path / "bad.yaml").write_text("rows: [oops\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        ablate.load(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        ablate.load(tmp_path / "missing.yaml")


def test_mqar_sweep_evaluates_past_its_training_length(tmp_path):
    """Multi-query recall keeps its facts within a block, so at 2x the training length the
    sweep probes the same distances after an earlier block: held-out loss and recall at
    positions the model never trained on."""
    path = _write(tmp_path, overrides=[*TOY, MQAR], lengths=[2], decode_context=0,
                  recall={"distances": [2, 46], "per_distance": 2, "through_cache": True})
    (r,) = ablate.run(path, out=tmp_path / "sweep", quiet=True)
    assert set(r["recall"]) == set(r["beyond"]["2"]["recall"]) == {"2", "46"}
    assert 0 < r["beyond"]["2"]["val_loss"] < 8
    assert r["beyond"]["2"]["recall_seq_len"] == r["beyond"]["2"]["loss_seq_len"] == 96
    assert ("x2: recall on 96-token rows: the 1x probe rows after 48 earlier tokens (the same "
            "facts and distances)") in ablate.table([r])
    # through the decode cache too (native float32 cache: the forward's predictions, but
    # float32 rounding may flip a near tie, so not asserted equal here)
    assert set(r["recall_cache"]) == {"2", "46"}
    with open(tmp_path / "sweep" / "summary.csv") as f:
        assert "recall_cache_mean_mean" in next(csv.DictReader(f))


def _beyond_means(rows: list[dict], row: str, reach: int) -> list[float]:
    """Per seed, a row's mean recall over the probed distances beyond `reach`, by hand
    from results.csv."""
    out = []
    for r in rows:
        if r["row"] == row:
            cols = [k for k in r if k.startswith("recall_d") and int(k[len("recall_d"):]) > reach]
            out.append(sum(float(r[k]) for k in cols) / len(cols))
    return out


def test_shipped_ratios_report_answers_beyond_the_window(tmp_path):
    """Re-reporting the shipped ratios sweep: the window control against every compressed
    row on recall beyond the window's reach (2 layers x (8 - 1) = 14), where the window is
    at chance, differs by more than the seed spread, and the line names that metric."""
    shutil.copytree(os.path.join(ROOT, "docs", "ablations", "ratios"), tmp_path / "ratios")
    text = ablate.report(tmp_path / "ratios")
    with open(tmp_path / "ratios" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    window = _beyond_means(rows, "window", 14)
    assert sum(window) / len(window) < 0.08  # chance is 1/16
    for row in ("csa_m2", "csa_m4", "hca_m8", "hca_m16"):
        other = _beyond_means(rows, row, 14)
        diff = sum(window) / len(window) - sum(other) / len(other)
        (line,) = [x for x in text.splitlines() if x.strip().startswith(f"window vs {row}:")]
        part = [p for p in line.split(";") if "recall d>14" in p]
        assert part, line
        assert f"recall d>14 {diff:+.3f} [" in part[0] and "(exceeds the seed spread)" in part[0]
    # the printed table splits each row's recall at its own reach
    head = text.splitlines()[0]
    assert "reach" in head and "recall<=reach" in head and "recall>reach" in head
    with open(tmp_path / "ratios" / "summary.csv") as f:
        summary = {r["row"]: r for r in csv.DictReader(f)}
    assert float(summary["window"]["recall_beyond_mean"]) == pytest.approx(
        sum(window) / len(window))
    assert summary["window"]["reach"] == "14" and summary["full"]["reach"] == "126"


def test_a_shrunk_recipe_warns_of_its_unscaled_warmups():
    """The ratios recipe at 400 steps keeps its 200 warm steps: half the run."""
    ratios = os.path.join(ROOT, "configs", "ablations", "ratios.yaml")
    with pytest.warns(UserWarning, match=r"recall_warmup.steps=200 is 50% of train.steps=400"):
        ablate.load(ratios, ["train.steps=400"])


def test_every_sweep_key_is_documented_with_an_example():
    """ablate.py --help, docs/ablations/README.md and the commented example name every key a
    sweep file takes; the example loads."""
    from dsattn.ablate import spec

    keys = [*spec.SWEEP_KEYS, *(f"recall.{k}" for k in spec.RECALL_KEYS)]
    p = run_script("ablate", "--help")
    docs = open(os.path.join(ROOT, "docs", "ablations", "README.md")).read()
    example = os.path.join(ROOT, "examples", "csa_ratio_sweep.yaml")
    written = yaml.safe_load(open(example))
    for key in keys:
        leaf = key.split(".")[-1]
        assert f"{leaf}:" in p.stdout.decode(), key
        assert f"`{key}`" in docs, key
        assert leaf in (written.get("recall", {}) if key.startswith("recall.") else written) \
            or f"# {leaf}:" in open(example).read(), key
    assert [r.name for r in ablate.load(example).rows] == ["window", "csa_m2", "csa_m4"]


# ------------------------------------------------------------------- the sweep's command line
SCHEDULED = [*TOY, "train.steps=1000", "train.warmup_steps=30", "train.eval_every=250"]


def _scheduled(tmp_path, **sweep):
    """A sweep file of 1000 steps: warm-up 30 (row b: 50), validation every 250 and a recall
    warm-up of 200 steps (facts within 8 tokens); row c sets its own train.steps."""
    return _write(tmp_path, overrides=SCHEDULED, recall_warmup={"steps": 200, "dist": 8},
                  rows=[{"name": "a", "overrides": []},
                        {"name": "b", "overrides": ["train.warmup_steps=50"]},
                        {"name": "c", "overrides": ["train.steps=1000"]}], **sweep)


def _schedule(sweep, name):
    row = next(r for r in sweep.rows if r.name == name)
    cfg = sweep.config(row, 0)
    warm = ablate.spec.recall_spec(cfg)
    return (cfg.train.steps, cfg.train.warmup_steps, cfg.train.eval_every, warm.warm_steps,
            warm.warm_dist)


def test_sweep_keys_set_on_the_command_line(tmp_path):
    path = _write(tmp_path, overrides=SCHEDULED, recall_warmup={"steps": 200, "dist": 8},
                  recall={"distances": [8, 32], "per_distance": 4})
    sweep = ablate.load(path, ["recall.per_distance=16", "recall_warmup.steps=40", "lengths=[2]",
                               "seeds=[0, 1, 2]", "decode_context=0", "train.lr=0.01"])
    assert sweep.per_distance == 16 and sweep.distances == (8, 32)  # the file's other keys kept
    assert sweep.lengths == (2,) and sweep.seeds == (0, 1, 2) and sweep.decode_context == 0
    assert _schedule(sweep, "mha")[3:] == (40, 8)  # recall_warmup.dist kept from the file
    assert sweep.config(sweep.rows[0], 0).train.lr == 0.01  # a config key, as before
    with pytest.raises(ConfigError, match=r"lengths: expected a list of integers >= 2"):
        ablate.load(path, ["lengths=[1, 2]"])  # validated as the file's own value is


@pytest.mark.parametrize("override, closest", [
    ("recall_warmup.step=40", "recall_warmup.steps"),
    ("recal.per_distance=16", "recall.per_distance"),
    ("recall.per_distanse=16", "recall.per_distance"),
    ("lenghts=[2]", "lengths"),
    ("seed=[0, 1]", "seeds"),
    ("train.warmup_step=3", "train.warmup_steps"),
])
def test_an_unknown_command_line_key_names_the_closest_sweep_or_config_key(tmp_path, override,
                                                                           closest):
    path = _write(tmp_path, overrides=SCHEDULED, recall_warmup={"steps": 200, "dist": 8})
    with pytest.raises(ConfigError) as e:
        ablate.load(path, [override])
    message = str(e.value)
    assert "\n" not in message and f"(did you mean {closest}?)" in message, message
    assert message.split(": ")[1] == override.split("=")[0], message  # after the file's name


def test_scale_schedule_fits_each_rows_schedule_to_a_shorter_run(tmp_path):
    path = _scheduled(tmp_path)
    with pytest.warns(UserWarning, match=r"recall_warmup.steps=200 is 50% of train.steps=400"):
        plain = ablate.load(path, ["train.steps=400"])
    assert _schedule(plain, "a") == (400, 30, 250, 200, 8)  # unscaled without the flag
    scaled = ablate.load(path, ["train.steps=400"], scale_schedule=True)
    factor = 400 / 1000
    assert _schedule(scaled, "a") == (400, round(30 * factor), round(250 * factor),
                                      round(200 * factor), 8)
    assert _schedule(scaled, "b")[1] == round(50 * factor)  # a row's own value scales too
    assert _schedule(scaled, "c") == (1000, 30, 250, 200, 8)  # its own train.steps: kept
    # one line per distinct change, naming the rows it applies to
    assert ablate.scaling(scaled) == [
        "--scale-schedule: train.warmup_steps 30 -> 12 (row a; train.steps 1000 -> 400)",
        "--scale-schedule: train.warmup_steps 50 -> 20 (row b; train.steps 1000 -> 400)",
        "--scale-schedule: train.eval_every 250 -> 100 (rows a, b; train.steps 1000 -> 400)",
        # the checkpoint cadence too, as scripts/train.py --scale-schedule fits it
        "--scale-schedule: train.ckpt_every 2 -> 1 (rows a, b; train.steps 1000 -> 400)",
        "--scale-schedule: recall_warmup.steps 200 -> 80 (rows a, b; train.steps 1000 -> 400)"]
    assert ablate.scaling(ablate.select(scaled, ["a", "b"]))[2] == (
        "--scale-schedule: train.eval_every 250 -> 100 (every row; train.steps 1000 -> 400)")
    # what the command line sets is kept, as scripts/train.py keeps it
    told = ablate.load(path, ["train.steps=400", "train.warmup_steps=7", "recall_warmup.steps=40"],
                       scale_schedule=True)
    assert _schedule(told, "a") == (400, 7, 100, 40, 8)
    assert [line.split(" (")[0] for line in ablate.scaling(told)] == [
        "--scale-schedule: train.eval_every 250 -> 100", "--scale-schedule: train.ckpt_every 2 -> 1"]
    longer = ablate.load(path, ["train.steps=2000"], scale_schedule=True)  # only shrinks
    assert _schedule(longer, "a") == (2000, 30, 250, 200, 8) and ablate.scaling(longer) == []


def _ablate_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ablate_script",
                                                  os.path.join(ROOT, "scripts", "ablate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_estimate_skips_the_timing_but_keeps_the_progress(tmp_path, monkeypatch, capsys):
    script = _ablate_script()
    path = _write(tmp_path, out=str(tmp_path / "out"))
    started, timed = [], []
    monkeypatch.setattr(ablate, "_run", lambda sweep, quiet, every: started.append(quiet) or [])
    monkeypatch.setattr(ablate, "_time_row", lambda *a: timed.append(a[1].name) or {
        "compile_s": 1.0, "step_s": 0.5, "eval_s": 0.25, "measure_s": 2.0})
    script.main([str(path), "--no-estimate"])
    assert started == [False] and timed == []  # progress on (not --quiet), nothing timed
    assert "estimate" not in capsys.readouterr().err
    script.main([str(path)])  # by default it times each row shape first, and says so
    err = capsys.readouterr().err.splitlines()
    assert started == [False, False] and timed == ["mha"]
    assert err[0] == ("estimate for sweep toy: timing 1 row shape: compile, steps, validation, "
                      "measurement (ablate.py --no-estimate skips this)")
    assert err[1].startswith("estimate for sweep toy: about ")
    with pytest.raises(SystemExit):
        script.main(["--help"])
    assert "--no-estimate" in capsys.readouterr().out


@pytest.mark.full  # trains; the fast tier keeps the scaling's own test above
def test_a_scaled_sweep_resumes_with_the_same_command(tmp_path, capsys):
    """--scale-schedule from the command line: the sweep says what it scaled before it trains,
    its sweep.yaml records the rows' scaled schedules (a report reads the same configs back),
    and the same command again skips the finished run; without the flag it is refused."""
    script = _ablate_script()
    out = tmp_path / "out"
    path = _write(tmp_path, recall_warmup={"steps": 2, "dist": 8}, lengths=[],
                  decode_context=0, recall={"distances": [8], "per_distance": 1})
    command = [str(path), "--scale-schedule", "train.steps=2", "--out", str(out),
               "--no-estimate"]
    (result,) = script.main(command)
    err = capsys.readouterr().err
    assert "--scale-schedule: train.eval_every 2 -> 1 (every row; train.steps 4 -> 2)" in err
    assert "--scale-schedule: recall_warmup.steps 2 -> 1 (every row; train.steps 4 -> 2)" in err
    assert result["steps"] == 2 and [s for s, _ in result["curve"]] == [1, 2]  # every step
    recorded = ablate.from_resolved(yaml.safe_load((out / "sweep.yaml").read_text()))
    assert ablate.spec.recall_spec(recorded.config(recorded.rows[0], 0)).warm_steps == 1
    assert ablate.fingerprint(recorded, recorded.rows[0], 0) == result["fingerprint"]
    done = out / "runs" / "mha" / "seed0" / "result.json"
    written = done.stat().st_mtime_ns
    (again,) = script.main(command)
    assert done.stat().st_mtime_ns == written and again["val_loss"] == result["val_loss"]
    with pytest.raises(ConfigError, match=r"row 'mha' seed 0: .* finished with other settings"):
        script.main([c for c in command if c != "--scale-schedule"])
