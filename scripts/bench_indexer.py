"""Indexer score-pass benchmark: Pallas kernel vs the jnp reference over context lengths and
search-key formats, with the bytes per second the kernel reaches.

    python scripts/bench_indexer.py [--impl auto|pallas_gpu|pallas_tpu] [--contexts 1K,4K]
        [--formats fp8_fp32,fp4_ue8m0] [--heads 64] [--dim 128] [--iters 5] [--peak-gbs 4300]

One decode step's score pass (queries at --queries positions per row, every stored entry
visible) over a paged pool whose pages are handed out in scrambled order. Times are the median
of --iters jitted calls after a warm-up call, each waited on with block_until_ready. "read" is
the bytes of stored keys and scales the pass must read (entries x formats.bytes_per_vector),
and GB/s is read / kernel time (1 GB = 1e9 B); "rel err" is the kernel's largest deviation
from the reference over visible scores, relative to the largest |score|. On a GPU or TPU it also prints the fraction of
--peak-gbs (default 4300 on GPU: an H200's HBM3e). On CPU the kernels run in the Pallas
interpreter: their times measure the interpreter, not a kernel, and the table says so; keep
CPU contexts small (the defaults finish in about a minute).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

try:
    import dsattn  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from dsattn import cli
from dsattn.cache import formats
from dsattn.kernels.indexer_score import KERNEL_FORMATS, paged_scores_tpu, reference_scores
from dsattn.kernels.indexer_score_gpu import paged_scores_gpu

KERNELS = {"pallas_gpu": paged_scores_gpu, "pallas_tpu": paged_scores_tpu}
CPU_CONTEXTS, DEVICE_CONTEXTS = "1K,4K,16K", "1K,4K,16K,64K,128K"


def parse_count(text: str) -> int:
    """'4096' or '4K' (K = 1024) -> int."""
    text = text.strip()
    return int(text[:-1]) * 1024 if text[-1:] in "kK" else int(text)


def parse_counts(text: str) -> str:
    """Checks a --contexts list at parse time (a bad one is a usage error)."""
    try:
        ok = all(parse_count(c) > 0 for c in text.split(","))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected counts like 1K,4096, got {text!r}")
    return text


def parse_formats(text: str) -> str:
    bad = [f for f in text.split(",") if f not in KERNEL_FORMATS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown key format {bad[0]!r}; the kernels read "
                                         f"{', '.join(KERNEL_FORMATS)}")
    return text


def make_inputs(fmt, context, args, rng):
    """Random queries and a paged pool holding ``context`` entries per row, pages scrambled."""
    B, T, H, d, ps = args.batch, args.queries, args.heads, args.dim, args.page_size
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


def main(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--impl", default="auto", choices=["auto", *KERNELS],
                   help="kernel to time (auto: the backend's own; pallas_gpu on CPU)")
    p.add_argument("--contexts", type=parse_counts, default=None,
                   help=f"entries per row, comma-separated (default {CPU_CONTEXTS} on CPU, "
                        f"{DEVICE_CONTEXTS} on GPU/TPU)")
    p.add_argument("--formats", type=parse_formats, default=",".join(KERNEL_FORMATS),
                   help="search-key formats, comma-separated (default: all the kernels read)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--queries", type=int, default=1, help="query positions per row")
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--block-k", type=int, default=None, help="pallas_gpu entries per program")
    p.add_argument("--precision", default="highest", choices=["highest", "default"],
                   help="pallas_gpu dot precision (default: TF32 tensor cores on GPU)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--peak-gbs", type=float, default=None,
                   help="memory bandwidth in GB/s for the fraction column (GPU default 4300)")
    p.add_argument("--seed", type=int, default=0)
    args = cli.parse(p, argv)

    backend = jax.default_backend()
    impl = args.impl if args.impl != "auto" else (
        "pallas_tpu" if backend == "tpu" else "pallas_gpu")
    interpret = backend != {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}[impl]
    peak = args.peak_gbs if args.peak_gbs is not None else (4300.0 if backend == "gpu" else None)
    contexts = [parse_count(c) for c in
                (args.contexts or (CPU_CONTEXTS if backend == "cpu" else DEVICE_CONTEXTS))
                .split(",")]
    kernel = KERNELS[impl]
    if impl == "pallas_gpu":
        prec = getattr(jax.lax.Precision, args.precision.upper())
        kernel = functools.partial(kernel, block_k=args.block_k, precision=prec)
    rng = np.random.default_rng(args.seed)

    mode = "INTERPRETED (Pallas interpreter on CPU: not kernel speed)" if interpret else "compiled"
    print(f"backend {backend} ({jax.devices()[0].device_kind}); kernel {impl}, {mode}; "
          f"batch {args.batch}, {args.queries} query position(s), {args.heads} heads, "
          f"d={args.dim}, page {args.page_size}; median of {args.iters}")
    head = (f"{'format':<10} {'entries':>8} {'B/key':>6} {'read MB':>8} {'ref ms':>9} "
            f"{'kernel ms':>10} {'speedup':>8} {'GB/s':>8} {'rel err':>8}")
    print(head + ("  of peak" if backend != "cpu" else ""))
    for fmt in args.formats.split(","):
        for context in contexts:
            inputs = make_inputs(fmt, context, args, rng)
            static = dict(fmt=fmt)
            ref = jax.jit(functools.partial(reference_scores, **static))
            ker = jax.jit(functools.partial(kernel, interpret=interpret, **static))
            got, want = np.asarray(ker(*inputs)), np.asarray(ref(*inputs))
            fin = np.isfinite(want)
            if not np.array_equal(fin, np.isfinite(got)):
                raise AssertionError(f"{impl} {fmt} {context}: visibility differs from reference")
            err = np.max(np.abs(got[fin] - want[fin])) / max(np.max(np.abs(want[fin])), 1e-30)
            t_ref = median_seconds(ref, inputs, args.iters)
            t_ker = median_seconds(ker, inputs, args.iters)
            per_key = formats.bytes_per_vector(fmt, args.dim, 0, "float32")
            read = args.batch * context * per_key
            gbs = read / t_ker / 1e9
            line = (f"{fmt:<10} {context:>8} {per_key:>6g} {read / 1e6:>8.2f} "
                    f"{t_ref * 1e3:>9.3f} {t_ker * 1e3:>10.3f} {t_ref / t_ker:>7.2f}x "
                    f"{gbs:>8.3f} {err:>8.1e}")
            if backend != "cpu":
                line += f"  {gbs / peak:7.1%}" if peak else "  (give --peak-gbs)"
            print(line, flush=True)


if __name__ == "__main__":
    cli.run(main)
