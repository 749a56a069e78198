"""One prepared check of a machine with a GPU or TPU (scripts/device_check.py): the
accelerator-only tests (Pallas kernels compiled, not interpreted), a few bfloat16 training
steps of each preset with tokens/s, model TFLOP/s and MFU, and decode steps at long cached
contexts against the cache-bytes roofline, into one JSON report.

Each section runs under a time budget and records what it did, so a lease that runs out
still returns what was measured. On a CPU the same code runs at tiny sizes (the tiny presets,
short sequences and contexts), which is how the tests cover it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import config as config_lib
from dsattn import flops
from dsattn.bench import aot, lower, measures, sweep, trace
from dsattn.model import Transformer

# Tests that only a GPU or TPU runs in full (their compiled-kernel cases skip elsewhere).
DEVICE_TESTS = ("tests/test_kernels.py", "tests/test_indexer_impl.py",
                "tests/test_dense_attention.py", "tests/test_sparse_attention.py",
                "tests/test_decode_attention.py", "tests/test_pallas_reads.py")


# XLA:GPU command buffers (CUDA graphs): the kinds of ops a compiled program records into one
# graph launched at once, instead of one launch per kernel (the launch cost that bounds a
# small decode step). XLA reads XLA_FLAGS when its backend starts, so each variant of the A/B
# runs in its own process. "loops" also records while loops and conditionals (generate's
# on-device token loop, lax.cond) and graphs of any size. The profiler switches command
# buffers off while it traces (xla_enable_command_buffers_during_profiling), so a trace's
# kernel count is the op-by-op program's.
COMMAND_BUFFERS = {
    "off": "--xla_gpu_enable_command_buffer=",
    "default": "",
    "loops": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL "
             "--xla_gpu_graph_min_graph_size=1",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the check runs. `for_backend` picks sizes an accelerator or a CPU finishes in
    minutes."""
    configs: str  # directory of the presets' <name>.yaml
    train_presets: tuple[str, ...] = ("mha", "mla", "dsa", "v4", "v41")
    train_seq: int = 8192
    train_batch: int = 4
    train_steps: int = 3
    # attention.impl of each training row: every preset runs once per implementation, the
    # reference first, so a cut-off run still leaves pairs (for_backend: the fused kernels
    # beside the reference on a GPU)
    train_impls: tuple[str, ...] = ("xla",)
    decode_presets: tuple[str, ...] = ("v4", "v41")
    # attention.impl of each decode row, the same way (for_backend: the decode kernel beside
    # the reference on a GPU)
    decode_impls: tuple[str, ...] = ("xla",)
    contexts: tuple[int, ...] = (32768, 131072)
    decode_batch: int = 1
    decode_steps: int = 10
    tests: tuple[str, ...] = DEVICE_TESTS
    overrides: tuple[str, ...] = ()  # for every preset
    budget_s: float = 420.0  # the whole check; a section past it records what it skipped
    # The decode sweep (dsattn.bench.sweep): each preset at each of `contexts`, batch 1, 8,
    # 32, 128, ... up to the largest that fits `sweep_memory` bytes (None: 85% of the
    # device's own limit), at most `sweep_max_batch`; one step traced at batch 1 and at the
    # largest timed, and one training step per preset, into `traces` (outside git).
    sweep_presets: tuple[str, ...] = ()  # for_backend: all five
    sweep_memory: int | None = None
    sweep_max_batch: int | None = None
    sweep_steps: int = 5
    traces: str = ""  # directory of the profiler traces ("": no traces)
    # The decode step of the first decode preset at the first context under each
    # COMMAND_BUFFERS variant, each in its own process (a GPU only; () for none).
    command_buffers: tuple[str, ...] = tuple(COMMAND_BUFFERS)

    @classmethod
    def for_backend(cls, backend: str, root: Path, **changes) -> "Settings":
        common = dict(traces=str(root / "runs" / "device_traces"),
                      sweep_presets=("mha", "mla", "dsa", "v4", "v41"))
        if backend == "cpu":
            base = cls(configs=str(root / "configs" / "tiny"), train_seq=128, train_batch=2,
                       train_steps=2, contexts=(256, 1024), decode_steps=3, budget_s=600.0,
                       sweep_memory=64 << 20, sweep_max_batch=8, sweep_steps=2, **common)
        else:
            kernels = ("pallas_gpu",) if backend == "gpu" else ()
            base = cls(configs=str(root / "configs" / "small"), train_impls=("xla", *kernels),
                       decode_impls=("xla", *kernels), **common)
        return dataclasses.replace(base, **changes)


def environment() -> dict:
    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind,
            "device_count": jax.device_count(), "jax": jax.__version__,
            "peak_tflops": flops.peak_tflops(dev.device_kind)}


def run_tests(paths, root: Path, timeout_s: float) -> dict:
    """pytest on `paths` in a subprocess: its counts and the ids of what failed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *paths]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout_s)
        text, rc = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:  # its output may come back as bytes
        out = e.stdout or ""
        text, rc = out.decode() if isinstance(out, bytes) else out, None
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.M)
    # pytest -q prints one character per finished test (".", "F", "s", ...) before its totals:
    # after a timeout they are all there is to say how far it got.
    progress = "".join(re.findall(r"^([.FEsxX]+)\s*(?:\[\s*\d+%\])?$", text, flags=re.M))
    return {"paths": list(paths), "returncode": rc, "timed_out": rc is None,
            "seconds": time.perf_counter() - t0, "finished": len(progress),
            "failed_so_far": progress.count("F") + progress.count("E"),
            **counts, "failed_ids": failed,
            "tail": text[-400:] if rc == 0 else text[-3000:]}  # more of it when it failed


def preset(settings: Settings, name: str, *extra: str):
    return config_lib.load(os.path.join(settings.configs, f"{name}.yaml"),
                           [*settings.overrides, *extra])


def _trace_dir(settings: Settings, what: str):
    return Path(settings.traces) / what if settings.traces else None


def train_preset(settings: Settings, name: str, peak: float | None,
                 impl: str = "xla") -> dict:
    """A few training steps with attention.impl=`impl`: tokens/s after the compiling step,
    model TFLOP/s from the layer plan's FLOPs (dsattn.flops), MFU against `peak`, the
    device's peak memory, and one more step's per-kernel breakdown (dsattn.bench.trace)
    where `settings.traces` is set."""
    cfg = preset(settings, name, f"train.seq_len={settings.train_seq}",
                 f"train.batch_size={settings.train_batch}",
                 f"model.max_seq_len={max(settings.train_seq, 1)}", f"attention.impl={impl}")
    got = measures.time_training(cfg, settings.train_seq, settings.train_batch,
                                 steps=settings.train_steps,
                                 trace_dir=_trace_dir(settings, f"train_{name}_{impl}"))
    per_token = flops.train_flops_per_token(cfg, settings.train_seq)
    tflops = got["tokens_per_s"] * per_token / 1e12
    return {"preset": name, "impl": impl, "dtype": cfg.model.dtype,
            "param_dtype": cfg.model.param_dtype, "seq_len": settings.train_seq,
            "batch": settings.train_batch, **got, "train_flops_per_token": per_token,
            "model_tflops_per_s": tflops, "mfu": tflops / peak if peak else None,
            "peak_bytes_in_use": _peak_bytes()}


def _peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}  # None on a CPU
    return stats.get("peak_bytes_in_use")


def device_bandwidth(n_bytes: int, repeats: int = 5) -> float:
    """Bytes read plus written per second by a jitted elementwise pass over n_bytes on the
    device: the practical memory bandwidth the decode roofline divides by."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / float(np.median(times))


def decode_preset(settings: Settings, name: str, bandwidth: float,
                  impl: str = "xla") -> list[dict]:
    """Decode steps with attention.impl=`impl` at each context, all in one cache capacity
    (one compiled program), against the roofline: the cache bytes the step must read
    (kvbytes) plus the weights, over the measured bandwidth."""
    longest = max(settings.contexts)
    trained = preset(settings, name).train.seq_len  # max_seq_len must still hold it
    cfg = preset(settings, name, f"model.max_seq_len={max(longest + 64, trained)}",
                 f"attention.impl={impl}")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    weights = measures.param_bytes(model)
    # the floor on its sequential kernels, beside the trace's count of what ran
    chain = lower.decode_chain(cfg, settings.decode_batch, longest + 64)
    rows = []
    for context in settings.contexts:
        got = measures.time_decode(model, context, settings.decode_batch,
                                   steps=settings.decode_steps, max_len=longest + 64)
        cache_bytes = measures.decode_bytes(cfg, context, settings.decode_batch)
        roofline_ms = (cache_bytes + weights) / bandwidth * 1e3
        rows.append({"preset": name, "impl": impl, "context": context,
                     "batch": settings.decode_batch,
                     **got, "cache_read_bytes": cache_bytes, "weight_bytes": weights,
                     "roofline_ms": roofline_ms, "of_roofline": roofline_ms / got["step_ms"],
                     "decode_flops_per_token": flops.decode_flops_per_token(cfg, context),
                     "kernel_chain": chain.length, "kernel_counts": chain.counts,
                     "kernel_chain_per_layer": chain.length / cfg.model.n_layers})
    return rows


def sweep_memory(settings: Settings) -> int:
    """Bytes the decode sweep may fill: the setting, else 85% of the device's limit (the
    rest for the synthetic contexts' construction and the allocator)."""
    if settings.sweep_memory is not None:
        return settings.sweep_memory
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if not limit:
        raise RuntimeError("device check: the device reports no memory limit; set "
                           "sweep_memory")
    return int(0.85 * limit)


def sweep_preset(settings: Settings, name: str, context: int, bandwidth: float,
                 log=print) -> list[dict]:
    """The decode sweep of one preset at one context (dsattn.bench.sweep), one step traced at
    batch 1 and at the largest batch timed."""
    trained = preset(settings, name).train.seq_len
    cfg = preset(settings, name, f"model.max_seq_len={max(context + 64, trained)}")
    plan = sweep.Sweep(contexts=(context,), device_bytes=sweep_memory(settings),
                       steps=settings.sweep_steps, max_batch=settings.sweep_max_batch)

    def profile(context, batch, largest):
        last = min(largest, settings.sweep_max_batch or largest)
        return (_trace_dir(settings, f"decode_{name}_{context}_{batch}")
                if batch in (1, last) else None)

    return sweep.run_preset(name, cfg, plan, bandwidth, log=log, profile=profile)


def command_buffers_run(settings: Settings, root: Path, variant: str, timeout_s: float) -> dict:
    """The decode step of the first decode preset at the first context under the last decode
    implementation (the kernels on a GPU), in a fresh process whose XLA_FLAGS add
    COMMAND_BUFFERS[variant]: its row of the decode section."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                          + COMMAND_BUFFERS[variant]).strip())
        cmd = [sys.executable, str(root / "scripts" / "device_check.py"), "--tests", "",
               "--train-presets", "", "--sweep-presets", "", "--no-traces",
               "--decode-presets", settings.decode_presets[0],
               "--decode-impls", settings.decode_impls[-1],
               "--contexts", str(settings.contexts[0]), "--configs", settings.configs,
               "--out", str(out), *settings.overrides]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if not out.exists() or not json.loads(out.read_text())["decode"]:
            raise RuntimeError(f"command buffers {variant}: no decode row "
                               f"(rc {run.returncode}): {run.stderr[-1500:]}")
        row = json.loads(out.read_text())["decode"][0]
    return {"variant": variant, "xla_flags": COMMAND_BUFFERS[variant], **row}


def check(settings: Settings, root: Path, log=print, save=lambda report: None,
          clock=time.perf_counter) -> dict:
    """Every section in turn, each recorded as it finishes (and handed to `save`, so a run cut
    short leaves a report); errors are recorded, not raised, so one broken section leaves the
    others' numbers."""
    t_start = clock()
    left = lambda: settings.budget_s - (clock() - t_start)  # noqa: E731
    report = {"settings": dataclasses.asdict(settings), "environment": environment(),
              "tests": None, "train": [], "decode": [], "command_buffers": [], "sweep": [],
              "skipped": [], "errors": []}
    # the rows compiled for this chip ahead of time (scripts/aot_check.py): each measured
    # train and decode row carries its compiled prediction beside the timings
    compiled = aot.compiled_rows(report["environment"]["device_kind"], root / "docs" / "bench")
    peak = report["environment"]["peak_tflops"]
    took = {}  # seconds the last section of each kind ("train", "decode", ...) took

    def attempt(what, fn, needs=0.0):
        """Run section `what` if the budget holds `needs` seconds (what the last section of
        its kind took: a section started with seconds left would run past the lease)."""
        if left() <= max(needs, 0.0):
            report["skipped"].append(what)
            log(f"device check: {what} skipped (time budget spent)")
            return None
        t0 = clock()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001  (recorded: the report is the product)
            report["errors"].append({"section": what, "error": f"{type(e).__name__}: {e}"[:2000]})
            log(f"device check: {what} failed: {type(e).__name__}: {str(e)[:300]}")
            return None
        took[what.split()[0]] = clock() - t0
        log(f"device check: {what} done in {took[what.split()[0]]:.1f} s")
        return out

    def record():
        report["seconds"] = clock() - t_start
        save(report)

    if settings.tests:  # the whole budget when nothing else is asked for, else 40% of it
        share = 0.4 if settings.train_presets or settings.decode_presets else 1.0
        report["tests"] = attempt("tests", lambda: run_tests(
            settings.tests, root, timeout_s=max(left() * share, 30)))
        record()
    bw = None
    if settings.decode_presets or settings.sweep_presets:
        bw = attempt("bandwidth", lambda: device_bandwidth(
            1 << 30 if jax.default_backend() != "cpu" else 1 << 26))
        report["bandwidth_bytes_per_s"] = bw
    for name in settings.decode_presets if bw else ():
        for impl in settings.decode_impls:
            what = f"decode {name}" + (f" {impl}" if len(settings.decode_impls) > 1 else "")
            rows = attempt(what, lambda: decode_preset(settings, name, bw, impl),
                           needs=took.get("decode", 0.0))
            for row in rows or []:  # the A/B, measured in this run
                ref = next((r for r in report["decode"] if r["preset"] == name
                            and r["context"] == row["context"] and r["impl"] == "xla"), None)
                if ref and impl != "xla":
                    row["x_reference"] = ref["step_ms"] / row["step_ms"]
                row["compiled"] = aot.prediction(compiled, name, impl, "decode",
                                                 row.get("batch"), row.get("context"))
            report["decode"].extend(rows or [])
            record()
    on_gpu = jax.default_backend() == "gpu"
    for variant in settings.command_buffers if on_gpu and settings.decode_presets else ():
        row = attempt(f"command_buffers {variant}", lambda: command_buffers_run(
            settings, root, variant, timeout_s=max(left(), 30)),
            needs=took.get("command_buffers", 0.0))
        report["command_buffers"].extend([row] if row else [])
        record()
    for name in settings.train_presets:
        for impl in settings.train_impls:
            what = f"train {name}" + (f" {impl}" if len(settings.train_impls) > 1 else "")
            row = attempt(what, lambda: train_preset(settings, name, peak, impl),
                          needs=took.get("train", 0.0))
            ref = next((r for r in report["train"] if r["preset"] == name
                        and r.get("impl", "xla") == "xla"), None)
            if row and ref and impl != "xla":  # the A/B, measured in this run
                row["x_reference"] = row["tokens_per_s"] / ref["tokens_per_s"]
            if row:
                row["compiled"] = aot.prediction(compiled, name, impl, "train",
                                                 row.get("batch"), row.get("seq_len"))
            report["train"].extend([row] if row else [])
            record()
    for name in settings.sweep_presets if bw else ():
        for context in settings.contexts:
            rows = attempt(f"sweep {name} {context}",
                           lambda: sweep_preset(settings, name, context, bw, log),
                           needs=took.get("sweep", 0.0))
            report["sweep"].extend(rows or [])
            record()
    record()
    return report


def summary(report: dict) -> str:
    """The report as a few readable lines."""
    env = report["environment"]
    lines = [f"device: {env['device_kind']} ({env['backend']}, jax {env['jax']}), "
             f"peak {env['peak_tflops'] or 'unknown'} TFLOP/s bf16"]
    t = report["tests"]
    if t and t["timed_out"]:
        lines.append(f"tests: timed out after {t['seconds']:.0f} s with {t['finished']} "
                     f"finished ({t['failed_so_far']} failed so far)")
    elif t:
        lines.append(f"tests: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
                     f"{t.get('skipped', 0)} skipped ({t['seconds']:.0f} s)"
                     + (f"; failed: {', '.join(t['failed_ids'])}" if t["failed_ids"] else ""))
    def compiled(r):
        """The row's compiled prediction, beside its measurement."""
        c = r.get("compiled")
        if not c:
            return ""
        roof = c.get("roofline", {}).get("roofline_s")
        return (f" [compiled ahead: peak {c['peak_bytes'] / 2**30:.2f} GiB, "
                f"{c['kernels_per_step']} kernels a step"
                + (f", roofline {roof * 1e3:.3f} ms" if roof else "") + "]")

    for r in report["train"]:
        mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
        impl = r.get("impl", "xla")
        vs = f" ({r['x_reference']:.2f}x xla)" if "x_reference" in r else ""
        lines.append(f"train {r['preset']:>4} {impl} ({r['dtype']}, {r['batch']} x "
                     f"{r['seq_len']}): {r['tokens_per_s']:,.0f} tokens/s{vs}, "
                     f"{r['model_tflops_per_s']:.2f} TFLOP/s{mfu}, first step "
                     f"{r['first_call_s']:.1f} s" + compiled(r))
    if report.get("bandwidth_bytes_per_s"):
        lines.append(f"bandwidth: {report['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s")
    for r in report["decode"]:
        vs = f" ({r['x_reference']:.2f}x xla)" if "x_reference" in r else ""
        lines.append(f"decode {r['preset']:>4} {r.get('impl', 'xla')} at {r['context']:,}: "
                     f"{r['step_ms']:.3f} ms/step{vs}, "
                     f"roofline {r['roofline_ms']:.3f} ms ({r['of_roofline']:.1%} of it; "
                     f"{r['cache_read_bytes'] / 1e6:.2f} MB cache + "
                     f"{r['weight_bytes'] / 1e6:.1f} MB weights)"
                     + (f"; {r['kernel_chain_per_layer']:.1f} dependent kernels a layer at "
                        f"least" if "kernel_chain" in r else "") + compiled(r))
    for r in report.get("command_buffers", []):
        lines.append(f"command buffers {r['variant']:>7}: decode {r['preset']} at "
                     f"{r['context']:,}: {r['step_ms']:.3f} ms/step")
    if report.get("sweep"):
        lines.append(sweep.table(report["sweep"]))
    for r in report["train"] + report.get("sweep", []):
        if r.get("kernels"):
            where = (f"train {r['preset']}" if "seq_len" in r
                     else f"decode {r['preset']} at {r['context']:,}, batch {r['batch']}")
            lines.append(f"kernels, {where}: " + trace.table(r["kernels"]))
    for what in report["skipped"]:
        lines.append(f"skipped: {what} (time budget)")
    for e in report["errors"]:
        lines.append(f"error in {e['section']}: {e['error'][:200]}")
    return "\n".join(lines)


def write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)
