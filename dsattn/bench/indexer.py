"""Indexer score-pass benchmark behind scripts/bench_indexer.py: a Pallas kernel against the
jnp reference over context lengths and search-key formats, with the bytes per second the
kernel reaches.

    result = indexer.run(indexer.Settings(contexts=(1024, 4096)))
    result["rows"]  # one record per (format, context): times, GB/s, rel_err, ...

One decode step's score pass (queries at ``queries`` positions per row, every stored entry
visible) over a paged pool whose pages are handed out in scrambled order. Times are the median
of ``iters`` jitted calls after a warm-up call, each waited on with block_until_ready.
``read_bytes`` is the bytes of stored keys and scales the pass must read (entries x
formats.bytes_per_vector), ``gb_per_s`` is read / kernel time (1 GB = 1e9 B); ``rel_err`` is
the kernel's largest deviation from the reference over visible scores, relative to the
largest |score|. ``fraction_of_peak`` is GB/s over ``peak_gbs`` (default 4300 on GPU: an
H200's HBM3e; None on CPU or without a peak). On CPU the kernels run in the Pallas
interpreter (``interpreted``): their times measure the interpreter, not a kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsattn.cache import formats
from dsattn.kernels import registry
from dsattn.kernels.indexer_score import KERNEL_FORMATS, reference_scores

OP = registry.Op.INDEXER_SCORE
KERNELS = registry.kernels(OP)  # the score kernels the registry holds
CPU_CONTEXTS = (1024, 4096, 16384)
DEVICE_CONTEXTS = (1024, 4096, 16384, 65536, 131072)
GPU_PEAK_GBS = 4300.0  # an H200's HBM3e


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures (scripts/bench_indexer.py's options, same names)."""

    impl: str = "auto"  # auto: the backend's own kernel; pallas_gpu on CPU
    contexts: tuple[int, ...] | None = None  # None: CPU_CONTEXTS on CPU, else DEVICE_CONTEXTS
    formats: tuple[str, ...] = KERNEL_FORMATS
    batch: int = 1
    queries: int = 1  # query positions per row
    heads: int = 64
    dim: int = 128
    page_size: int = 64
    block_k: int | None = None  # pallas_gpu entries per program
    precision: str = "highest"  # pallas_gpu dot precision: highest | default
    iters: int = 5
    peak_gbs: float | None = None  # None: GPU_PEAK_GBS on GPU
    seed: int = 0


def parse_count(text: str) -> int:
    """'4096' or '4K' (K = 1024) -> int."""
    text = text.strip()
    return int(text[:-1]) * 1024 if text[-1:] in "kK" else int(text)


def plan(s: Settings) -> dict:
    """The run's fixed facts: backend, kernel, whether it is interpreted, peak, contexts."""
    if s.impl != "auto" and s.impl not in KERNELS:
        raise ValueError(f"unknown kernel {s.impl!r}; known: auto, {', '.join(KERNELS)}")
    bad = [f for f in s.formats if f not in KERNEL_FORMATS]
    if bad:
        raise ValueError(f"unknown key format {bad[0]!r}; the kernels read "
                         f"{', '.join(KERNEL_FORMATS)}")
    backend = jax.default_backend()
    impl = s.impl if s.impl != "auto" else _kernel_for(backend)
    peak = s.peak_gbs if s.peak_gbs is not None else (GPU_PEAK_GBS if backend == "gpu" else None)
    contexts = s.contexts or (CPU_CONTEXTS if backend == "cpu" else DEVICE_CONTEXTS)
    return {"backend": backend, "device_kind": jax.devices()[0].device_kind, "impl": impl,
            "interpreted": not registry.get(OP, impl).runs_on(backend),
            "peak_gbs": peak, "contexts": list(contexts), "settings": dataclasses.asdict(s)}


def _kernel_for(backend: str) -> str:
    """The backend's own score kernel; where there is none (CPU), the GPU one, interpreted."""
    for wanted in (backend, "cuda"):
        found = [n for n in KERNELS if registry.get(OP, n).platforms
                 and registry.get(OP, n).runs_on(wanted)]
        if found:
            return found[0]
    raise ValueError(f"no indexer score kernel is registered for {backend} or gpu")


def make_inputs(fmt, context, s: Settings, rng):
    """Random queries and a paged pool holding ``context`` entries per row, pages scrambled."""
    B, T, H, d, ps = s.batch, s.queries, s.heads, s.dim, s.page_size
    per_row = -(-context // ps)
    keys = rng.standard_normal((B * per_row, ps, d)).astype(np.float32)
    pages = formats.encode(fmt, jnp.asarray(keys))
    table = jnp.asarray(rng.permutation(B * per_row).reshape(B, per_row), jnp.int32)
    length = jnp.full((B,), context, jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, T, H, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32)
    return q, w, pages, table, length, jnp.full((B, T), context, jnp.int32)


def median_seconds(fn, inputs, iters):
    jax.block_until_ready(fn(*inputs))  # warm-up: compile
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rows(s: Settings, facts: dict):
    """Yield one record per (format, context), in that order, as each is measured. Raises
    AssertionError if the kernel's visible scores differ from the reference's."""
    kernel = registry.load(OP, facts["impl"])
    if "gpu" in registry.get(OP, facts["impl"]).platforms:  # the Triton kernel's options
        prec = getattr(jax.lax.Precision, s.precision.upper())
        kernel = functools.partial(kernel, block_k=s.block_k, precision=prec)
    rng = np.random.default_rng(s.seed)
    peak = facts["peak_gbs"]
    for fmt in s.formats:
        for context in facts["contexts"]:
            inputs = make_inputs(fmt, context, s, rng)
            ref = jax.jit(functools.partial(reference_scores, fmt=fmt))
            ker = jax.jit(functools.partial(kernel, interpret=facts["interpreted"] or None,
                                            fmt=fmt))
            got, want = np.asarray(ker(*inputs)), np.asarray(ref(*inputs))
            fin = np.isfinite(want)
            if not np.array_equal(fin, np.isfinite(got)):
                raise AssertionError(f"{facts['impl']} {fmt} {context}: visibility differs "
                                     f"from reference")
            err = np.max(np.abs(got[fin] - want[fin])) / max(np.max(np.abs(want[fin])), 1e-30)
            t_ref = median_seconds(ref, inputs, s.iters)
            t_ker = median_seconds(ker, inputs, s.iters)
            per_key = formats.bytes_per_vector(fmt, s.dim, 0, "float32")
            read = s.batch * context * per_key
            gbs = read / t_ker / 1e9
            yield {"format": fmt, "entries": context, "bytes_per_key": float(per_key),
                   "read_bytes": float(read), "ref_ms": t_ref * 1e3, "kernel_ms": t_ker * 1e3,
                   "speedup": t_ref / t_ker, "gb_per_s": gbs, "rel_err": float(err),
                   "fraction_of_peak": gbs / peak if peak else None}


def run(s: Settings) -> dict:
    """``plan(s)`` with its measured ``rows``."""
    facts = plan(s)
    return {**facts, "rows": list(rows(s, facts))}


def fmt_header(facts: dict) -> str:
    """Two lines: what runs (INTERPRETED when the Pallas interpreter runs the kernel), and
    the column names."""
    s = facts["settings"]
    mode = ("INTERPRETED (Pallas interpreter on CPU: not kernel speed)" if facts["interpreted"]
            else "compiled")
    head = (f"{'format':<10} {'entries':>8} {'B/key':>6} {'read MB':>8} {'ref ms':>9} "
            f"{'kernel ms':>10} {'speedup':>8} {'GB/s':>8} {'rel err':>8}")
    return (f"backend {facts['backend']} ({facts['device_kind']}); kernel {facts['impl']}, "
            f"{mode}; batch {s['batch']}, {s['queries']} query position(s), {s['heads']} heads, "
            f"d={s['dim']}, page {s['page_size']}; median of {s['iters']}\n"
            + head + ("  of peak" if facts["backend"] != "cpu" else ""))


def fmt_row(facts: dict, r: dict) -> str:
    line = (f"{r['format']:<10} {r['entries']:>8} {r['bytes_per_key']:>6g} "
            f"{r['read_bytes'] / 1e6:>8.2f} {r['ref_ms']:>9.3f} {r['kernel_ms']:>10.3f} "
            f"{r['speedup']:>7.2f}x {r['gb_per_s']:>8.3f} {r['rel_err']:>8.1e}")
    if facts["backend"] != "cpu":
        frac = r["fraction_of_peak"]
        line += f"  {frac:7.1%}" if frac is not None else "  (give --peak-gbs)"
    return line
