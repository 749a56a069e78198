"""The decode sweep's arithmetic (dsattn.bench.sweep) and the per-kernel breakdown of a
profiler trace (dsattn.bench.trace), against hand-computed values."""

import gzip
import json

import pytest

from dsattn.bench import sweep, trace


def test_batches_climb_the_ladder_and_end_at_the_largest_that_fits():
    assert sweep.batches(1) == [1]
    assert sweep.batches(8) == [1, 8]
    assert sweep.batches(100) == [1, 8, 32, 100]
    assert sweep.batches(3000) == [1, 8, 32, 128, 512, 2048, 3000]
    assert sweep.batches(0) == []


def test_largest_batch_is_what_the_memory_holds():
    # 1 GiB, 100 MiB fixed, 30 MiB a row: floor(924 / 30) = 30 rows.
    mib = 2 ** 20
    assert sweep.largest_batch(100 * mib, 30 * mib, 1024 * mib) == 30
    assert sweep.largest_batch(100 * mib, 31 * mib, 131 * mib) == 1  # exactly one
    assert sweep.largest_batch(100 * mib, 32 * mib, 131 * mib) == 0
    with pytest.raises(ValueError):
        sweep.largest_batch(0, 0, mib)


def test_roofline_counts_the_weights_once_and_every_row_s_cache():
    # 8 rows of 2 MB cache reads plus 200 MB of weights at 1 TB/s: 0.216 ms; a 0.5 ms step
    # reaches 43.2% of it.
    r = sweep.roofline(8 * 2_000_000, 200_000_000, 1e12, 0.5)
    assert r["read_bytes"] == 216_000_000
    assert r["roofline_ms"] == pytest.approx(0.216)
    assert r["of_roofline"] == pytest.approx(0.432)


def _write_trace(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def _meta(pid, tid, kind, name):
    return {"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}}


def test_breakdown_of_a_gpu_trace_counts_stream_kernels_only(tmp_path):
    # A device process with a stream and a derived "XLA Ops" line (the same time again), a
    # host process: only the stream's kernels of the decode program count.
    ev = [_meta(1, None, "process_name", "/device:GPU:0"),
          _meta(1, 7, "thread_name", "Stream #7(Compute)"),
          _meta(1, 9, "thread_name", "XLA Ops"),
          _meta(2, None, "process_name", "/host:CPU"),
          _meta(2, 3, "thread_name", "python")]
    kern = lambda name, dur, tid=7, module="jit__decode_impl": {  # noqa: E731
        "ph": "X", "pid": 1, "tid": tid, "name": name, "dur": dur,
        "args": {"hlo_op": name, "hlo_module": module}}
    ev += [kern("fusion.1", 30.0), kern("fusion.1", 10.0), kern("gemm", 60.0),
           kern("fusion.1", 40.0, tid=9), kern("other", 99.0, module="jit_argmax"),
           {"ph": "X", "pid": 2, "tid": 3, "name": "PjitFunction", "dur": 500.0}]
    path = tmp_path / "t.json.gz"
    _write_trace(path, ev)
    b = trace.kernels(path, n_layers=2, program="_decode_impl")
    assert b["kernels_per_step"] == 3 and b["kernels_per_layer"] == 1.5
    assert b["kernel_us"] == 100.0 and b["distinct_kernels"] == 2
    assert [(k["name"], k["launches"], k["us"], k["share"]) for k in b["top"]] == [
        ("gemm", 1, 60.0, 0.6), ("fusion.1", 2, 40.0, 0.4)]


def test_breakdown_of_a_cpu_trace_counts_the_innermost_thunks(tmp_path):
    # No device process: the events carrying an hlo_op are the kernels (XLA:CPU thunks); a
    # while thunk enclosing its body's thunks on its thread is not counted again.
    op = lambda name, ts, dur, tid=1: {  # noqa: E731
        "ph": "X", "pid": 5, "tid": tid, "name": name, "ts": ts, "dur": dur,
        "args": {"hlo_op": name, "hlo_module": "jit_update"}}
    ev = [_meta(5, None, "process_name", "/host:CPU"),
          op("ynn_fusion", 0.0, 3.0),
          {"ph": "X", "pid": 5, "tid": 1, "name": "end: ynn_fusion", "ts": 3.0, "dur": 0.5,
           "args": {}},
          op("while.1", 10.0, 20.0), op("dot.1", 11.0, 4.0), op("dot.1", 16.0, 4.0),
          op("dot.3", 10.0, 1.0, tid=2)]
    path = tmp_path / "t.json.gz"
    _write_trace(path, ev)
    b = trace.kernels(path, n_layers=4)
    assert b["kernels_per_step"] == 4 and b["kernels_per_layer"] == 1.0
    assert b["kernel_us"] == 12.0
    assert {k["name"]: k["launches"] for k in b["top"]} == {"ynn_fusion": 1, "dot.1": 2,
                                                            "dot.3": 1}


def test_a_real_cpu_trace_parses(tmp_path):
    # What the profiler writes on this CPU: one jitted program's thunks, of that program.
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((32, 32))
    f(x).block_until_ready()
    with trace.capture(tmp_path) as where:
        f(x).block_until_ready()
    b = trace.kernels(where.file, n_layers=1, program="lambda")
    assert b["kernels_per_step"] >= 1 and b["kernel_us"] > 0
    assert sum(k["share"] for k in b["top"]) == pytest.approx(1.0)


def test_fit_charges_a_row_at_least_its_cache():
    # The memory analysis's bytes per row hold kvbytes' cache bytes of a row (plus a row's
    # activations: a little more), for a 1-layer tiny MHA at 64 positions.
    from tests.helpers import preset

    cfg = preset("mha", "model.n_layers=1", "model.dtype=float32")
    room = sweep.fit(cfg, 64, 1 << 30)
    assert room["kvbytes_cache_per_row"] <= room["bytes_per_row"]
    assert room["bytes_per_row"] <= 1.5 * room["kvbytes_cache_per_row"]
    assert room["largest_batch"] == sweep.largest_batch(room["fixed_bytes"],
                                                        room["bytes_per_row"], 1 << 30)
