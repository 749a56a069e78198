"""A serving load (scripts/bench.py --serve): requests with random prompt and output
lengths arriving over time (a Poisson stream), served by the continuous-batching scheduler
(dsattn.serve) of each preset, every preset in the same cache memory. Reports requests/s,
output tokens/s, time to first token and inter-token latency (median and p99), the rows
each preset's memory holds and the most requests it ran at once.

With `Load.shared_prefix` every prompt begins with the same tokens (a system prompt, say),
and each preset runs once per `Load.prefix_cache` setting (the scheduler's prefix cache on
and off, docs/prefix_caching.md): the rows also report the prefix hit rate, the snapshot
store's bytes, evictions, the most pool pages in use at once and the pages an ideal cache
would need (`ideal_pages`), and whether the outputs equal the first setting's, and the
load's floor under first-come-first-served scheduling (`fcfs_floor`): the least TTFT median
and wall any such scheduler with those rows could reach if prefill took no time, which
bounds what any prefix cache could gain on the load.

The memory is MHA's cache for `mha_rows` rows of `max_len` positions; every other preset
gets `rows` rows (its window rings and such are per row) and the largest page pool that
still fits (pool.with_pool); with `Load.charge_snapshots` a prefix cache's snapshot store
is charged to that memory too (fewer rows or a smaller pool). The load runs twice per
preset and setting and the second pass is reported: the first compiles the programs."""

from __future__ import annotations

import dataclasses
import heapq
import time

import jax
import numpy as np
from flax import nnx

from dsattn import generate
from dsattn.bench import measures
from dsattn.bench.compiles import compilations
from dsattn.cache.protocol import is_container
from dsattn.model import Transformer
from dsattn.serve import programs
from dsattn.serve.pool import with_pool
from dsattn.serve.request import Request
from dsattn.serve.scheduler import Scheduler, default_prefix_nodes


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
    shared_prefix: int = 0  # tokens every prompt begins with (the same), before its own
    # prefix caching settings to run, each preset once per setting in this order (a bool:
    # that one setting)
    prefix_cache: tuple[bool, ...] = (True,)
    prefix_nodes: int | None = None  # the scheduler's snapshot slots (None: its default)
    prefix_stride: int | None = None  # tokens between published prefixes (None: default)
    charge_snapshots: bool = False  # the snapshot store counts against the memory

    def __post_init__(self):
        if isinstance(self.prefix_cache, bool):
            object.__setattr__(self, "prefix_cache", (self.prefix_cache,))
        object.__setattr__(self, "prefix_cache", tuple(map(bool, self.prefix_cache)))
        if self.shared_prefix < 0:
            raise ValueError(f"Load.shared_prefix must be >= 0, got {self.shared_prefix}")
        if not self.prefix_cache:
            raise ValueError("Load.prefix_cache needs at least one setting")


def cache_bytes(state) -> int:
    """Stored bytes of a decode state's containers (shapes suffice)."""
    return sum(c.stored_bytes() for c in jax.tree.leaves(state.layers, is_leaf=is_container)
               if is_container(c))


def snapshot_slot_bytes(eng: generate.Engine, max_len: int, layers_only: bool = False) -> int:
    """Bytes of one slot of a prefix cache's snapshot store (serve.snapshots.Snapshots): one
    row of every decode-state leaf with a row axis (page tables, rings, compressor state,
    contiguous K/V: a whole row for MHA and MLA), the page pools excluded. `layers_only`:
    the layers' caches alone, as `cache_bytes` counts a decode state (not the row's
    position and flags, 9 bytes)."""
    shaped = lambda b: with_pool(eng.cfg, eng.init_cache(b, max_len), 1)  # noqa: E731
    if layers_only:
        shaped = lambda b, full=shaped: full(b).layers  # noqa: E731
    axes = programs.row_axes(shaped)
    leaves = jax.tree.leaves(jax.eval_shape(lambda: shaped(1)))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize
               for x, a in zip(leaves, axes) if a is not None)


def fit(eng: generate.Engine, rows: int, max_len: int, budget: int,
        store=None) -> tuple[int, int | None]:
    """(rows, pool_tokens) of the most memory a preset can use within `budget` bytes: its
    rows (fewer while even a one-page pool does not fit) and the largest pool. `store(rows)`:
    bytes charged beside the cache at that many rows (a snapshot store), default none.
    ValueError if one row and one page do not fit."""
    extra = store or (lambda r: 0)
    shape = lambda r, p: cache_bytes(jax.eval_shape(  # noqa: E731
        lambda: with_pool(eng.cfg, eng.init_cache(r, max_len), p))) + extra(r)
    while rows > 1 and shape(rows, 1) > budget:
        rows -= 1
    if shape(rows, 1) > budget:
        raise ValueError(f"fit: one row and one page take {shape(rows, 1)} bytes, more than "
                         f"the budget's {budget}")
    if shape(rows, rows * max_len) <= budget:
        return rows, None  # no pools, or pools for every row's whole max_len fit
    lo, hi = 1, rows * max_len  # largest pool_tokens within the budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if shape(rows, mid) <= budget else (lo, mid - 1)
    return rows, lo


def stream(load: Load, vocab: int):
    """(arrival seconds, Request) of the load, in arrival order; greedy requests. Each prompt
    is the load's shared prefix (`shared_prefix` tokens, drawn once from a generator of its
    own, so a load without one draws what it always drew) and then its own random tokens."""
    rng = np.random.RandomState(load.seed)
    stem = np.random.default_rng((load.seed, 1)).integers(0, vocab, load.shared_prefix)
    t = np.cumsum(rng.exponential(1 / load.rate, load.requests))
    return [(float(t[i]), Request(np.concatenate([stem, rng.randint(
                0, vocab, rng.randint(load.prompt[0], load.prompt[1] + 1))]),
                                  int(rng.randint(load.output[0], load.output[1] + 1))))
            for i in range(load.requests)]


def ideal_pages_now(sched: Scheduler, shared_prefix: int) -> int:
    """Pages the running rows would hold if the shared prefix were stored once, the target
    of docs/prefix_caching.md's benchmark (peak pages within 10% of it). Per pool layer,
    from the entries each row holds now (the scheduler's page ledgers): the whole pages of
    the deepest part of the prefix any row holds, once, plus every other page of each row.
    A page holding the prefix's end and entries past it counts once per row: a sharer
    copies it before it writes there (the single-owner rule), so no cache holds it once."""
    total = 0
    for led in sched.ledgers:
        entries = np.asarray(led.length, np.int64)
        whole = np.minimum(entries, shared_prefix // led.layer.stride) // led.page_size
        pages = -(-entries // led.page_size)
        total += int(whole.max(initial=0) + (pages - whole).sum())
    return total


def row_pages(sched: Scheduler) -> int:
    """Pages the running rows hold now, a page two rows share once: pages in use less those
    only cached prefixes hold (the cache's, given back by eviction when room is needed)."""
    if not sched.prefix_cache:  # no cached prefixes, nothing shared: every page is a row's
        return sched.pages_total - sched.pages_free()
    return sum(len(set().union(*led.tables)) for led in sched.ledgers)


def ideal_pages_load(pools, arrivals, shared_prefix: int) -> int:
    """Pages the whole load would hold at once with the shared prefix stored once: per pool
    layer (`pools`: the scheduler's PoolLayers), the prefix's whole pages once plus, for
    every request, the pages of its prompt + output - 1 positions (the last token drawn is
    never written) less those. `ideal_pages_now`'s peak when every request runs at once to
    its end; a load with more requests than rows never holds it all at once."""
    total = 0
    for p in pools:
        whole = shared_prefix // p.stride // p.page_size
        total += whole + sum(int(p.pages(len(r.prompt) + r.max_new_tokens - 1)) - whole
                             for _, r in arrivals)
    return total


def serve(sched: Scheduler, arrivals, shared_prefix: int = 0) -> dict:
    """Run the load in real time on this thread; per-request timings summarised, the prefix
    cache's counters, pool pages and each request's output tokens (`outputs`, by request
    id). Pages are sampled after every step (a row finishing in a step has given its pages
    back by then), each a maximum over the steps: `peak_pages` in use (shared pages once,
    those only cached prefixes hold included), `peak_row_pages` held by running rows,
    `ideal_pages` (`ideal_pages_now`: the running rows with the shared prefix stored once).
    TTFT splits into the wait for a row (`queue_*`: submission to the step that first gave
    the request a row) and the rest (`prefill_*`: that step's start to the first token: the
    prompt's prefill, a restored prefix's copy, waiting for a prefix another row computes)."""
    t0, pending = time.perf_counter(), list(arrivals)
    submitted, times, peak, outputs, admitted = {}, {}, 0, {}, {}
    peak_pages = held = ideal = 0
    while pending or not sched.idle:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, req = pending.pop(0)
            submitted[sched.submit(req)] = at
        if sched.idle:
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        began = time.perf_counter() - t0
        events = sched.step()
        stamp = time.perf_counter() - t0
        for rid in sched.running_ids() + [ev.request_id for ev in events]:
            admitted.setdefault(rid, began)  # admitted by this step (some also finished)
        peak = max(peak, sched.active)
        peak_pages = max(peak_pages, sched.pages_total - sched.pages_free())
        held = max(held, row_pages(sched))
        ideal = max(ideal, ideal_pages_now(sched, shared_prefix))
        for ev in events:
            outputs.setdefault(ev.request_id, [])
            if ev.token is not None:
                times.setdefault(ev.request_id, []).append(stamp)
                outputs[ev.request_id].append(ev.token)
    wall = time.perf_counter() - t0
    ttft = [times[r][0] - submitted[r] for r in times]
    queue = [admitted[r] - submitted[r] for r in times]
    prefill = [times[r][0] - admitted[r] for r in times]
    itl = np.concatenate([np.diff(t) for t in times.values()] + [np.zeros(0)])
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else float("nan")  # noqa: E731
    return {"requests_per_s": len(submitted) / wall,
            "output_tokens_per_s": sum(map(len, times.values())) / wall,
            "ttft_median_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "queue_median_s": pct(queue, 50), "prefill_median_s": pct(prefill, 50),
            "itl_median_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
            "peak_active": peak, "preemptions": sched.preemptions, "wall_s": wall,
            **prefix_measures(sched.prefix_metrics()), "pages_total": sched.pages_total,
            "peak_pages": peak_pages, "peak_row_pages": held, "ideal_pages": ideal,
            "ideal_pages_load": ideal_pages_load(sched.pools, arrivals, shared_prefix),
            "outputs": outputs}


def fcfs_floor(arrivals, rows: int, step_s: float) -> dict:
    """The least TTFT median and wall (seconds) that any first-come-first-served scheduler
    with `rows` rows could reach on `arrivals` if prefill took no time and every decode step
    took `step_s`: a request takes the first row free once it has arrived, its first token
    comes at once (from the prefill), and its row then decodes the other max_new_tokens - 1
    (the load's requests have no eos or stop, so each runs to max_new_tokens). A prefix
    cache saves prefill only, so what it can gain is at most (cache off) / floor."""
    free, waits = [0.0] * rows, []
    for at, req in arrivals:
        start = max(at, heapq.heappop(free))
        heapq.heappush(free, start + max(req.max_new_tokens - 1, 0) * step_s)
        waits.append(start - at)
    return {"floor_ttft_median_s": float(np.percentile(waits, 50)),
            "floor_wall_s": max(max(free), arrivals[-1][0])}


def decode_step_times(sched: Scheduler, prompt_len: int, vocab: int,
                      steps: int = 32) -> np.ndarray:
    """Seconds of each of `steps` decode steps of one request decoding alone in `sched` (a
    fresh scheduler, warmed up) at `prompt_len` positions. The scheduler's decode program
    runs every row whichever hold requests, so a step running more rows does this work
    too: the fastest is the floor's step time; the median, what a step takes typically on
    this machine (its spread is the machine's, paid by any scheduler)."""
    prompt = np.random.RandomState(1).randint(0, vocab, prompt_len)
    sched.submit(Request(prompt, steps + 2))
    while not any(ev.token is not None for ev in sched.step()):
        pass  # prefill until the first token
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t)
    while not sched.idle:
        sched.step()
    return np.array(times)


def prefix_measures(m: dict) -> dict:
    """The scheduler's prefix_metrics for a bench row, with the hit rate: prompt tokens
    reused at first admission out of all prompt tokens (0 with the cache off)."""
    hit, prompt = m["prefix_hit_tokens"], m["prefix_prompt_tokens"]
    return {"prefix_cache": m["prefix_cache"], "prefix_hit_rate": hit / prompt if prompt else 0.0,
            "prefix_hit_tokens": hit, "prefix_prompt_tokens": prompt,
            "prefix_nodes": m["prefix_nodes"], "prefix_cached_pages": m["prefix_cached_pages"],
            "snapshot_bytes": m["prefix_snapshot_bytes"], "prefix_evictions": m["prefix_evictions"],
            "prefix_copies": m["prefix_copies"], "prefix_refused": m["prefix_refused"]}


def run(config_dir, presets=("mha", "v4"), load: Load = Load(), *overrides, log=print):
    """One row per preset and prefix caching setting (`load.prefix_cache`): its rows and pool
    in MHA's memory, and the load's measures. A row after a preset's first setting says
    whether every request's output equals the first setting's (`same_outputs`)."""
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
        arrivals = stream(load, eng.cfg.model.vocab_size)
        slot = snapshot_slot_bytes(eng, load.max_len)
        charged = snapshot_slot_bytes(eng, load.max_len, layers_only=True)
        first = None
        for caching in load.prefix_cache:
            nodes = lambda r: load.prefix_nodes or default_prefix_nodes(r)  # noqa: E731
            store = ((lambda r: nodes(r) * charged) if caching and load.charge_snapshots
                     else None)
            try:
                rows, pool = fit(eng, load.mha_rows if name == "mha" else load.rows,
                                 load.max_len, budget, store)
            except ValueError as e:
                raise ValueError(f"serve {name}, prefix cache {'on' if caching else 'off'}: "
                                 f"{e} (fewer snapshot slots, Load.prefix_nodes, may fit)"
                                 if store else f"serve {name}: {e}") from e
            make = lambda: Scheduler(  # noqa: E731
                eng, rows, load.max_len, pool_tokens=pool, prefix_cache=caching,
                prefix_nodes=load.prefix_nodes, prefix_stride=load.prefix_stride)
            make().warm_up()
            for _ in range(2):  # the first pass warms what warm_up does not
                sched = make()
                with compilations() as compiled:
                    measured = serve(sched, arrivals, load.shared_prefix)
            outputs = measured.pop("outputs")
            if load.shared_prefix:
                times = decode_step_times(make(), load.shared_prefix + load.prompt[0],
                                          eng.cfg.model.vocab_size)
                fastest, median = float(times.min()), float(np.median(times))
                typical = fcfs_floor(arrivals, rows, median)  # the floor at a typical step
                measured.update(decode_step_s=fastest, decode_step_median_s=median,
                                **fcfs_floor(arrivals, rows, fastest),
                                **{f"typical_{k}": v for k, v in typical.items()})
            if store and measured["snapshot_bytes"] != nodes(rows) * slot:
                raise AssertionError(  # what fit charged is not what the scheduler made
                    f"serve {name}: snapshot store {measured['snapshot_bytes']} bytes, "
                    f"expected {nodes(rows)} slots of {slot}")
            row = {"preset": name, "shared_prefix": load.shared_prefix, "rows": rows,
                   "pool_tokens": pool, "cache_bytes": cache_bytes(sched.cache),
                   "budget_bytes": budget, "charge_snapshots": load.charge_snapshots,
                   **measured, "compiles": compiled.n}  # compiles: in the measured pass
            if first is None:
                first = outputs
            else:
                row["same_outputs"] = outputs == first
            out.append(row)
            log(f"serve {name}: {row}")
    return out


def table(rows) -> str:
    """Columns: preset, prefix cache on/off, rows, decode-state MB, snapshot store MB, the
    most requests running at once, req/s, output tok/s, TTFT (p50, p99, and the p50s of its
    two parts: `serve`'s queue and prefill), ITL (p50, p99; seconds),
    preemptions, prefix hit rate (%), evictions, and the most pool pages: in use (`pages`,
    cached prefixes' included), held by running rows (`held`), ideal (`ideal_pages_now`:
    the shared prefix once plus each running row's own), pages / ideal and held / ideal
    (- for a preset without page pools), and the load's FCFS floor: TTFT p50 and wall at
    the fastest decode step, then both at the median step (`typ`; seconds; - where not
    measured)."""
    lines = [f"{'preset':<7} {'cache':>5} {'rows':>4} {'cache MB':>8} {'snap MB':>7} "
             f"{'peak':>4} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>8} {'p99':>7} {'queue':>6} "
             f"{'prefill':>7} "
             f"{'ITL p50':>8} {'p99':>7} {'preempt':>7} {'hit %':>5} {'evict':>5} "
             f"{'pages':>6} {'held':>6} {'ideal':>6} {'x':>5} {'x held':>6} "
             f"{'wall':>6} {'floor p50':>9} {'wall':>6} {'typ p50':>7} {'wall':>6}"]
    for r in rows:
        if r.get("pages_total", 0) > 0:
            ideal = r["ideal_pages"] or float("nan")
            pages = (f"{r['peak_pages']:>6} {r['peak_row_pages']:>6} {r['ideal_pages']:>6} "
                     f"{r['peak_pages'] / ideal:>5.2f} {r['peak_row_pages'] / ideal:>6.2f}")
        else:
            pages = f"{'-':>6} {'-':>6} {'-':>6} {'-':>5} {'-':>6}"
        lines.append(f"{r['preset']:<7} {'on' if r.get('prefix_cache') else 'off':>5} "
                     f"{r['rows']:>4} {r['cache_bytes'] / 2**20:>8.2f} "
                     f"{r.get('snapshot_bytes', 0) / 2**20:>7.2f} "
                     f"{r['peak_active']:>4} {r['requests_per_s']:>6.2f} "
                     f"{r['output_tokens_per_s']:>7.1f} {r['ttft_median_s']:>8.3f} "
                     f"{r['ttft_p99_s']:>7.3f} {r['queue_median_s']:>6.3f} "
                     f"{r['prefill_median_s']:>7.3f} "
                     f"{r['itl_median_s']:>8.4f} {r['itl_p99_s']:>7.4f} "
                     f"{r['preemptions']:>7} {100 * r.get('prefix_hit_rate', 0.0):>5.1f} "
                     f"{r.get('prefix_evictions', 0):>5} {pages} {r['wall_s']:>6.2f} "
                     + (f"{r['floor_ttft_median_s']:>9.3f} {r['floor_wall_s']:>6.2f} "
                        f"{r['typical_floor_ttft_median_s']:>7.3f} "
                        f"{r['typical_floor_wall_s']:>6.2f}"
                        if "floor_wall_s" in r else f"{'-':>9} {'-':>6} {'-':>7} {'-':>6}"))
    return "\n".join(lines)
