"""A serving load (scripts/bench.py --serve): requests with random prompt and output
lengths arriving over time (a Poisson stream), served by the continuous-batching scheduler
(dsattn.serve) of each preset, every preset in the same cache memory. Reports requests/s,
output tokens/s, time to first token and inter-token latency (median and p99), the rows
each preset's memory holds and the most requests it ran at once.

The memory is MHA's cache for `mha_rows` rows of `max_len` positions; every other preset
gets `rows` rows (its window rings and such are per row) and the largest page pool that
still fits (pool.with_pool). The load runs twice per preset and the second pass is
reported: the first compiles the programs."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx

from dsattn import generate
from dsattn.bench import measures
from dsattn.bench.compiles import compilations
from dsattn.cache.protocol import is_container
from dsattn.model import Transformer
from dsattn.serve.pool import with_pool
from dsattn.serve.request import Request
from dsattn.serve.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class Load:
    requests: int = 32
    rate: float = 4.0  # arrivals per second (Poisson)
    prompt: tuple[int, int] = (64, 256)  # prompt lengths, uniform in [lo, hi]
    output: tuple[int, int] = (16, 64)  # max_new_tokens, uniform in [lo, hi]
    max_len: int = 512
    mha_rows: int = 4  # the memory: MHA's cache at this many rows of max_len
    rows: int = 16  # rows of the other presets
    seed: int = 0


def cache_bytes(state) -> int:
    """Stored bytes of a decode state's containers (shapes suffice)."""
    return sum(c.stored_bytes() for c in jax.tree.leaves(state.layers, is_leaf=is_container)
               if is_container(c))


def fit(eng: generate.Engine, rows: int, max_len: int, budget: int) -> tuple[int, int | None]:
    """(rows, pool_tokens) of the most memory a preset can use within `budget` bytes: its
    rows (fewer while even a one-page pool does not fit) and the largest pool."""
    shape = lambda r, p: cache_bytes(jax.eval_shape(  # noqa: E731
        lambda: with_pool(eng.cfg, eng.init_cache(r, max_len), p)))
    while rows > 1 and shape(rows, 1) > budget:
        rows -= 1
    if shape(rows, rows * max_len) <= budget:
        return rows, None  # no pools, or pools for every row's whole max_len fit
    lo, hi = 1, rows * max_len  # largest pool_tokens within the budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if shape(rows, mid) <= budget else (lo, mid - 1)
    return rows, lo


def stream(load: Load, vocab: int):
    """(arrival seconds, Request) of the load, in arrival order; greedy requests."""
    rng = np.random.RandomState(load.seed)
    t = np.cumsum(rng.exponential(1 / load.rate, load.requests))
    return [(float(t[i]), Request(rng.randint(0, vocab, rng.randint(load.prompt[0],
                                                                     load.prompt[1] + 1)),
                                  int(rng.randint(load.output[0], load.output[1] + 1))))
            for i in range(load.requests)]


def serve(sched: Scheduler, arrivals) -> dict:
    """Run the load in real time on this thread; per-request timings summarised."""
    t0, pending = time.perf_counter(), list(arrivals)
    submitted, times, peak = {}, {}, 0
    while pending or not sched.idle:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, req = pending.pop(0)
            submitted[sched.submit(req)] = at
        if sched.idle:
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        events = sched.step()
        stamp = time.perf_counter() - t0
        peak = max(peak, sched.active)
        for ev in events:
            if ev.token is not None:
                times.setdefault(ev.request_id, []).append(stamp)
    wall = time.perf_counter() - t0
    ttft = [times[r][0] - submitted[r] for r in times]
    itl = np.concatenate([np.diff(t) for t in times.values()] + [np.zeros(0)])
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")  # noqa: E731
    return {"requests_per_s": len(submitted) / wall,
            "output_tokens_per_s": sum(map(len, times.values())) / wall,
            "ttft_median_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_median_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
            "peak_active": peak, "preemptions": sched.preemptions, "wall_s": wall}


def run(config_dir, presets=("mha", "v4"), load: Load = Load(), *overrides, log=print):
    """One row per preset: its rows and pool in MHA's memory, and the load's measures."""
    engines = {}
    for name in presets:
        cfg = measures.bench_config(name, None, *overrides, config_dir=config_dir)
        engines[name] = generate.Engine(Transformer(cfg, rngs=nnx.Rngs(0)))
    mha = engines.get("mha") or generate.Engine(Transformer(
        measures.bench_config("mha", None, *overrides, config_dir=config_dir),
        rngs=nnx.Rngs(0)))
    budget = cache_bytes(jax.eval_shape(lambda: mha.init_cache(load.mha_rows, load.max_len)))
    out = []
    for name, eng in engines.items():
        rows, pool = fit(eng, load.mha_rows if name == "mha" else load.rows, load.max_len,
                         budget)
        arrivals = stream(load, eng.cfg.model.vocab_size)
        Scheduler(eng, rows, load.max_len, pool_tokens=pool).warm_up()
        for _ in range(2):  # the first pass warms what warm_up does not
            sched = Scheduler(eng, rows, load.max_len, pool_tokens=pool)
            with compilations() as compiled:
                measured = serve(sched, arrivals)
        measured["compiles"] = compiled.n  # in the measured pass (shapes the first missed)
        bytes_ = cache_bytes(sched.cache)
        out.append({"preset": name, "rows": rows, "pool_tokens": pool, "cache_bytes": bytes_,
                    "budget_bytes": budget, **measured})
        log(f"serve {name}: {out[-1]}")
    return out


def table(rows) -> str:
    lines = [f"{'preset':<7} {'rows':>4} {'cache MB':>8} {'peak':>4} {'req/s':>6} "
             f"{'tok/s':>7} {'TTFT p50':>8} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'preempt':>7}"]
    for r in rows:
        lines.append(f"{r['preset']:<7} {r['rows']:>4} {r['cache_bytes'] / 2**20:>8.2f} "
                     f"{r['peak_active']:>4} {r['requests_per_s']:>6.2f} "
                     f"{r['output_tokens_per_s']:>7.1f} {r['ttft_median_s']:>8.3f} "
                     f"{r['ttft_p99_s']:>7.3f} {r['itl_median_s']:>8.4f} {r['itl_p99_s']:>7.4f} "
                     f"{r['preemptions']:>7}")
    return "\n".join(lines)
