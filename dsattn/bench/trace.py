"""Per-kernel breakdown of one step from a `jax.profiler` trace: the kernels a compiled
program ran, how long each took, and how many a layer costs.

    with trace.capture(directory) as where:
        step()                       # one step, already compiled
    breakdown = trace.kernels(where.file, n_layers=12)

`capture` asks the profiler for its Chrome-trace JSON (``perfetto_trace.json.gz``), which
needs nothing beyond jax to read. What counts as a kernel in it:
- on a GPU, every complete event ("ph": "X") on a device process ("/device:GPU:N") thread
  named "Stream #..." (the CUDA streams the kernels ran on; the derived "XLA Ops" /
  "XLA Modules" lines are summaries of the same time and are left out);
- on a CPU, which has no device process, every complete event carrying an ``hlo_op``
  argument: one XLA thunk (a fusion, a library call, a copy) run on the host's threads,
  except those that enclose others on their thread (a while or conditional thunk, whose
  body's thunks are events of their own: counting both would count that time twice).
Events of other programs in the window (the host work around the step) are left out by
`program`: a substring of the event's ``hlo_module`` argument where the trace carries one.
The trace files stay where the profiler wrote them (runs/, outside git).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
from pathlib import Path

import jax


@dataclasses.dataclass
class Capture:
    file: Path | None = None  # the trace JSON, once the profiler has written it


@contextlib.contextmanager
def capture(directory):
    """Profile the block into `directory`; `.file` is the trace JSON afterwards."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.rglob("*.json.gz"))
    where = Capture()
    with jax.profiler.trace(str(directory), create_perfetto_trace=True):
        yield where
    new = sorted(set(directory.rglob("*.json.gz")) - before)
    if not new:
        raise RuntimeError(f"trace: the profiler wrote no trace JSON under {directory}")
    perfetto = [p for p in new if p.name == "perfetto_trace.json.gz"]
    where.file = (perfetto or new)[0]


def events(path) -> list[dict]:
    """The trace's events (a Chrome trace: a list, or {"traceEvents": [...]})."""
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kernel_events(evs: list[dict], program: str | None = None) -> list[dict]:
    """The complete events that are kernels (see the module's note), of `program` where the
    events name their module."""
    procs = {e["pid"]: e["args"]["name"] for e in evs
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in evs
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    devices = {pid for pid, name in procs.items() if name.startswith("/device:")}
    out = []
    for e in evs:
        if e.get("ph") != "X":
            continue
        args = e.get("args") or {}
        if devices:
            if e.get("pid") not in devices or not threads.get(
                    (e["pid"], e.get("tid")), "").startswith("Stream"):
                continue
        elif "hlo_op" not in args:
            continue
        module = args.get("hlo_module")
        if program and module is not None and program not in module:
            continue
        out.append(e)
    return out if devices else _innermost(out)


def _innermost(evs: list[dict]) -> list[dict]:
    """The events that enclose no other event of their thread."""
    by_thread: dict = {}
    for e in evs:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out = []
    for line in by_thread.values():
        line.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        for e, nxt in zip(line, line[1:] + [None]):
            end = float(e["ts"]) + float(e.get("dur", 0.0))
            if nxt is None or float(nxt["ts"]) >= end:
                out.append(e)
    return out


def breakdown(kernels: list[dict], n_layers: int, top: int = 12) -> dict:
    """Kernels per step (the events given are one step's), their total time, kernels per
    layer, and the `top` kernels by time: name, launches, microseconds, share of the total."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"], []).append(float(e.get("dur", 0.0)))
    total = sum(sum(d) for d in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {"kernels_per_step": len(kernels), "kernel_us": total,
            "kernels_per_layer": len(kernels) / max(n_layers, 1),
            "distinct_kernels": len(by_name),
            "top": [{"name": name, "launches": len(d), "us": sum(d),
                     "share": sum(d) / total if total else 0.0} for name, d in ranked[:top]]}


def kernels(path, n_layers: int, program: str | None = None, top: int = 12) -> dict:
    """`breakdown` of the kernels in the trace file at `path` (one step traced)."""
    return {"trace": str(path),
            **breakdown(kernel_events(events(path), program), n_layers, top)}


def table(b: dict) -> str:
    """A breakdown as a few readable lines."""
    lines = [f"{b['kernels_per_step']} kernels per step ({b['kernels_per_layer']:.1f} per "
             f"layer, {b['distinct_kernels']} distinct), {b['kernel_us']:.0f} us in kernels"]
    lines += [f"  {k['us']:>10.1f} us {k['share']:>6.1%} x{k['launches']:<4} {k['name'][:60]}"
              for k in b["top"]]
    return "\n".join(lines)
