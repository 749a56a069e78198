"""scripts/device_check.py on a CPU, at tiny sizes: the report holds every section with
numbers consistent with their definitions, the decode contexts share one compiled step, and a
spent budget or a broken section is recorded, not fatal."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsattn import flops
from dsattn.bench import device
from tests.helpers import preset

ROOT = Path(__file__).resolve().parents[1]
QUICK_TEST = "tests/test_kernels.py::test_block_max_must_divide_the_page"


def device_check(tmp_path, *args):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "scripts/device_check.py", "--out", str(out),
                          "--tests", QUICK_TEST, *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    return run, json.loads(out.read_text())


@pytest.mark.slow
def test_device_check_reports_every_section(tmp_path):
    run, report = device_check(tmp_path, "--train-presets", "mha", "--decode-presets", "v4",
                               "--contexts", "64,256", "--sweep-presets", "mha",
                               "--sweep-max-batch", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    assert report["environment"]["backend"] == "cpu"
    assert report["tests"]["passed"] == 3 and report["tests"].get("failed", 0) == 0
    (train,) = report["train"]
    cfg = preset("mha", "train.seq_len=128", "model.max_seq_len=128")
    assert train["train_flops_per_token"] == flops.train_flops_per_token(cfg, 128)
    assert train["model_tflops_per_s"] == pytest.approx(
        train["tokens_per_s"] * train["train_flops_per_token"] / 1e12)
    assert train["tokens_per_s"] > 0 and train["mfu"] is None  # no known peak for a CPU
    short, long = report["decode"]
    assert (short["context"], long["context"]) == (64, 256)
    assert short["compilations"] == 1 and long["compilations"] == 0  # one program for both
    assert long["cache_read_bytes"] > short["cache_read_bytes"] > 0
    bw = report["bandwidth_bytes_per_s"]
    for row in (short, long):
        assert row["roofline_ms"] == pytest.approx(
            (row["cache_read_bytes"] + row["weight_bytes"]) / bw * 1e3)
    assert "tokens/s" in run.stdout and "roofline" in run.stdout
    # the floor on its sequential kernels: at least the two tiny layers' attention and FFN
    assert short["kernel_chain"] == long["kernel_chain"] >= 2 * 3
    # The sweep: one row per context at batch 1 (capped), its roofline by definition and a
    # kernel breakdown of its traced step; the training step's breakdown too.
    assert [(r["context"], r["batch"]) for r in report["sweep"]] == [(64, 1), (256, 1)]
    for row in report["sweep"]:
        assert row["largest_batch"] >= 1
        assert row["roofline_ms"] == pytest.approx(
            (row["cache_read_bytes"] + row["weight_bytes"]) / bw * 1e3)
        assert row["kernels"]["kernels_per_step"] > 0
    assert train["kernels"]["kernels_per_step"] > 0
    assert report["skipped"] == [] and report["errors"] == []


def test_device_check_records_a_spent_budget_and_a_broken_section(tmp_path):
    run, report = device_check(tmp_path, "--budget-s", "0", "--train-presets", "mha")
    assert run.returncode == 0
    assert report["skipped"] == ["tests", "bandwidth", "train mha"]
    run, report = device_check(tmp_path, "--tests", "", "--train-presets", "nosuch",
                               "--decode-presets", "", "--sweep-presets", "")
    assert run.returncode == 1  # an error makes the check fail, after writing its report
    (error,) = report["errors"]
    assert error["section"] == "train nosuch" and "nosuch" in error["error"]


def test_tests_that_time_out_say_how_far_they_got(tmp_path):
    (tmp_path / "test_slow.py").write_text(
        "import time\n"
        "def test_a(): pass\n"
        "def test_b(): assert False\n"
        "def test_c(): time.sleep(60)\n")
    got = device.run_tests(["test_slow.py"], tmp_path, timeout_s=15)
    assert got["timed_out"] and got["returncode"] is None
    assert got["finished"] == 2 and got["failed_so_far"] == 1
    assert got.get("passed", 0) == 0  # no totals printed: none are claimed
    done = device.run_tests(["test_slow.py::test_a"], tmp_path, timeout_s=60)
    assert not done["timed_out"] and done["passed"] == 1 and done["finished"] == 1


def test_a_section_needs_as_long_as_the_last_of_its_kind_took(monkeypatch, tmp_path):
    """A lease must not end inside a section: with 100 s budget and training sections taking
    40 s each, the third (which would end at 120 s) is skipped, not started."""
    clock = [0.0]

    def train(settings, name, peak, impl="xla"):
        clock[0] += 40.0
        return {"preset": name}

    monkeypatch.setattr(device, "train_preset", train)
    settings = device.Settings(configs=str(tmp_path), train_presets=("a", "b", "c"),
                               decode_presets=(), tests=(), budget_s=100.0)
    report = device.check(settings, tmp_path, log=lambda line: None, clock=lambda: clock[0])
    assert [r["preset"] for r in report["train"]] == ["a", "b"]
    assert report["skipped"] == ["train c"]


def test_each_preset_trains_under_each_implementation_reference_first(monkeypatch, tmp_path):
    """The training A/B: every preset once per attention.impl, the reference first, and each
    kernel row carries its tokens/s as a ratio to its preset's reference row."""
    speed = {"xla": 100.0, "pallas_gpu": 250.0}

    def train(settings, name, peak, impl="xla"):
        return {"preset": name, "impl": impl, "dtype": "bfloat16", "batch": 1, "seq_len": 8,
                "tokens_per_s": speed[impl], "model_tflops_per_s": 1.0, "mfu": None,
                "first_call_s": 1.0}

    monkeypatch.setattr(device, "train_preset", train)
    settings = device.Settings(configs=str(tmp_path), train_presets=("a", "b"),
                               train_impls=("xla", "pallas_gpu"), decode_presets=(), tests=(),
                               sweep_presets=())
    report = device.check(settings, tmp_path, log=lambda line: None)
    assert [(r["preset"], r["impl"]) for r in report["train"]] == [
        ("a", "xla"), ("a", "pallas_gpu"), ("b", "xla"), ("b", "pallas_gpu")]
    assert [r.get("x_reference") for r in report["train"]] == [None, 2.5, None, 2.5]
    device.summary(report)  # every row readable
    assert device.Settings.for_backend("gpu", tmp_path).train_impls == ("xla", "pallas_gpu")
    assert device.Settings.for_backend("tpu", tmp_path).train_impls == ("xla",)


def test_each_preset_decodes_under_each_implementation_reference_first(monkeypatch, tmp_path):
    """The decode A/B: every decode preset once per attention.impl at each context, the
    reference first; each kernel row carries its speed-up over its preset's reference row at
    the same context."""
    ms = {("xla", 8): 2.0, ("xla", 16): 3.0, ("pallas_gpu", 8): 0.5, ("pallas_gpu", 16): 1.0}

    def decode(settings, name, bw, impl="xla"):
        return [{"preset": name, "impl": impl, "context": c, "batch": 1, "step_ms": ms[impl, c],
                 "roofline_ms": 0.1, "of_roofline": 0.1 / ms[impl, c],
                 "cache_read_bytes": 1, "weight_bytes": 1} for c in settings.contexts]

    monkeypatch.setattr(device, "decode_preset", decode)
    monkeypatch.setattr(device, "device_bandwidth", lambda n: 1e9)
    settings = device.Settings(configs=str(tmp_path), train_presets=(), tests=(),
                               decode_presets=("a", "b"), decode_impls=("xla", "pallas_gpu"),
                               contexts=(8, 16), sweep_presets=(), command_buffers=())
    report = device.check(settings, tmp_path, log=lambda line: None)
    assert [(r["preset"], r["impl"], r["context"]) for r in report["decode"]] == [
        (p, i, c) for p in "ab" for i in ("xla", "pallas_gpu") for c in (8, 16)]
    assert [r.get("x_reference") for r in report["decode"]] == [None, None, 4.0, 3.0] * 2
    device.summary(report)  # every row readable
    assert device.Settings.for_backend("gpu", tmp_path).decode_impls == ("xla", "pallas_gpu")
    assert device.Settings.for_backend("cpu", tmp_path).decode_impls == ("xla",)


def test_measured_rows_carry_what_the_compile_ahead_predicted(monkeypatch, tmp_path):
    """On a device scripts/aot_check.py compiled for, each measured row carries that
    program's compiled row (peak memory, kernels a step, roofline) beside its timings: the
    one-chip row of the same preset, implementation (pallas_gpu's is `kernels`), batch and
    length, and nothing where the compile has no such row."""
    from dsattn.bench import aot

    def row(impl, program, batch, length, per_step):
        return {"preset": "a", "impl": impl, "program": program, "batch": batch,
                "length": length, "mesh": "1 chip", "compiled": True, "peak_bytes": 2**30,
                "temp_bytes": 1, "argument_bytes": 1, "compile_s": 1.0,
                "roofline": {"roofline_s": 1e-4},
                "kernels": {"per_step": per_step, "per_layer": per_step / 2}}

    rows = [row("xla", "train", 1, 8, 40), row("kernels", "train", 1, 8, 30),
            row("kernels", "decode", 1, 16, 20), {**row("xla", "decode", 1, 8, 9),
                                                   "mesh": "1x1x8"}]
    monkeypatch.setattr(aot, "compiled_rows", lambda kind, where: rows)

    def train(settings, name, peak, impl="xla"):
        return {"preset": name, "impl": impl, "dtype": "bfloat16", "batch": 1, "seq_len": 8,
                "tokens_per_s": 1.0, "model_tflops_per_s": 1.0, "mfu": None,
                "first_call_s": 1.0}

    def decode(settings, name, bw, impl="xla"):
        return [{"preset": name, "impl": impl, "context": c, "batch": 1, "step_ms": 1.0,
                 "roofline_ms": 0.1, "of_roofline": 0.1, "cache_read_bytes": 1,
                 "weight_bytes": 1} for c in settings.contexts]

    monkeypatch.setattr(device, "train_preset", train)
    monkeypatch.setattr(device, "decode_preset", decode)
    monkeypatch.setattr(device, "device_bandwidth", lambda n: 1e9)
    settings = device.Settings(configs=str(tmp_path), train_presets=("a",), tests=(),
                               train_impls=("xla", "pallas_gpu"), decode_presets=("a",),
                               decode_impls=("pallas_gpu", "xla"), contexts=(8, 16),
                               sweep_presets=(), command_buffers=())
    report = device.check(settings, tmp_path, log=lambda line: None)
    assert [r["compiled"]["kernels_per_step"] for r in report["train"]] == [40, 30]
    assert [(r["impl"], r["context"], (r["compiled"] or {}).get("kernels_per_step"))
            for r in report["decode"]] == [("pallas_gpu", 8, None), ("pallas_gpu", 16, 20),
                                           ("xla", 8, None), ("xla", 16, None)]
    assert "compiled ahead: peak 1.00 GiB, 30 kernels a step" in device.summary(report)


def test_compiled_rows_are_found_by_the_devices_kind(tmp_path):
    from dsattn.bench import aot

    row = {"target": "h200", "mesh": "1 chip", "preset": "a", "impl": "xla",
           "program": "decode", "batch": 1, "length": 8, "compiled": False, "error": "x"}
    aot.Report({"h200/a/xla/decode/1x8/chip": [row]}).save(tmp_path / "aot_h200")
    assert aot.compiled_rows("NVIDIA H200", tmp_path) == [row]
    assert aot.compiled_rows("NVIDIA H100 80GB HBM3", tmp_path) == []  # no h100 report here
