"""Decode throughput against batch and context: for each preset and cached context, the
largest batch whose weights, caches and step temporaries fit a given device memory, and
decode steps timed at batch 1, 8, 32, 128, ... up to it, each against its bytes roofline
(scripts/bench.py --decode-sweep on this CPU, scripts/device_check.py on a device).

What fits comes from the compiled decode program's own memory analysis (shapes only, nothing
allocated; dsattn.bench.lower) at batch 1 and 2: its arguments (the weights as the engine
holds them, the caches at their capacity), outputs not aliased to them and temporaries, of
which one row adds `per_row`; kvbytes' cache bytes per row beside it. The roofline of a row
is the bytes one step must read, the weights once plus every row's cache (kvbytes, stored
formats), over the measured bandwidth; its share is the roofline time over the step time.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from dsattn import kvbytes
from dsattn.bench import lower, measures
from dsattn.model import Transformer

LADDER = (1, 8, 32, 128)  # then x4 (512, 2048, ...) up to the largest that fits


def batches(largest: int) -> list[int]:
    """The batches a sweep times: 1, 8, 32, 128, 512, ... below `largest`, and `largest`."""
    out = [b for b in LADDER if b < largest]
    b = LADDER[-1] * 4
    while b < largest:
        out.append(b)
        b *= 4
    return out + [largest] if largest >= 1 else []


def largest_batch(fixed_bytes: int, per_row_bytes: int, device_bytes: int) -> int:
    """The largest batch with fixed + batch * per_row <= device bytes (0: not even one)."""
    if per_row_bytes <= 0:
        raise ValueError(f"sweep: a row must cost bytes, got {per_row_bytes}")
    return max(int((device_bytes - fixed_bytes) // per_row_bytes), 0)


def roofline(cache_read_bytes: int, weight_bytes: int, bandwidth: float, step_ms: float) -> dict:
    """The bytes roofline of one decode step (all rows' cache reads plus the weights once)
    and the share of it a step of `step_ms` reached."""
    ms = (cache_read_bytes + weight_bytes) / bandwidth * 1e3
    return {"read_bytes": cache_read_bytes + weight_bytes, "roofline_ms": ms,
            "of_roofline": ms / step_ms}


def step_bytes(cfg, batch: int, max_len: int) -> int:
    """Device bytes the compiled decode step holds at `batch`: arguments, outputs not aliased
    to them, temporaries (memory analysis)."""
    a = lower.analyse(cfg, batch, max_len)
    return a["argument_bytes"] + a["output_bytes"] - a["alias_bytes"] + a["temp_bytes"]


def fit(cfg, max_len: int, device_bytes: int) -> dict:
    """The largest batch of `max_len`-position caches whose decode step fits `device_bytes`,
    from the memory analysis at batch 1 and 2 (a row adds its cache and its activations)."""
    one, two = step_bytes(cfg, 1, max_len), step_bytes(cfg, 2, max_len)
    per_row = two - one
    fixed = one - per_row
    return {"max_len": max_len, "device_bytes": device_bytes, "step_bytes_batch1": one,
            "bytes_per_row": per_row, "fixed_bytes": fixed,
            "kvbytes_cache_per_row": int(kvbytes.global_bytes(cfg, max_len)
                                         + kvbytes.local_bytes(cfg, context=max_len)),
            "largest_batch": largest_batch(fixed, per_row, device_bytes)}


@dataclasses.dataclass(frozen=True)
class Sweep:
    contexts: tuple[int, ...]
    device_bytes: int
    steps: int = 5
    warmup: int = 2
    max_batch: int | None = None  # cap on the batches timed (None: the largest that fits)


def run_preset(name: str, cfg, sweep: Sweep, bandwidth: float, log=print,
               profile=None) -> list[dict]:
    """One row per (context, batch) of a preset. `profile(context, batch, largest)`, if
    given, returns a directory to trace one more step into (None: no trace); the row then
    carries the trace's per-kernel breakdown (dsattn.bench.trace)."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    weights = measures.param_bytes(model)
    rows = []
    for context in sweep.contexts:
        max_len = context + sweep.warmup + sweep.steps + 2
        room = fit(cfg, max_len, sweep.device_bytes)
        largest = room["largest_batch"]
        timed = batches(min(largest, sweep.max_batch or largest))
        log(f"{name} at {context}: batch {largest} fits "
            f"{sweep.device_bytes / 2**30:.2f} GiB; timing {timed}")
        for b in timed:
            where = profile(context, b, largest) if profile else None
            got = measures.time_decode(model, context, b, sweep.steps, sweep.warmup,
                                       max_len=max_len, trace_dir=where)
            cache = measures.decode_bytes(cfg, context, b)
            rows.append({"preset": name, "context": context, "batch": b,
                         "largest_batch": largest, **got, "cache_read_bytes": cache,
                         "weight_bytes": weights,
                         **roofline(cache, weights, bandwidth, got["step_ms"]), "fit": room})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'preset':<7}{'context':>9}{'batch':>7}{'fits':>7}{'ms/step':>10}"
            f"{'tokens/s':>11}{'roof ms':>10}{'share':>8}{'kernels':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        k = r.get("kernels")
        lines.append(f"{r['preset']:<7}{r['context']:>9}{r['batch']:>7}{r['largest_batch']:>7}"
                     f"{r['step_ms']:>10.3f}{r['tokens_per_s']:>11.0f}{r['roofline_ms']:>10.4f}"
                     f"{r['of_roofline']:>8.1%}"
                     + (f"{k['kernels_per_step']:>9}" if k else f"{'-':>9}"))
    return "\n".join(lines)
