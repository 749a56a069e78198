"""Indexer score-pass benchmark: Pallas kernel vs the jnp reference over context lengths and
search-key formats, with the bytes per second the kernel reaches.

    python scripts/bench_indexer.py [--impl auto|pallas_gpu|pallas_tpu] [--contexts 1K,4K]
        [--formats fp8_fp32,fp4_ue8m0] [--heads 64] [--dim 128] [--iters 5] [--peak-gbs 4300]
        [--json PATH]

One decode step's score pass (queries at --queries positions per row, every stored entry
visible) over a paged pool whose pages are handed out in scrambled order. Times are the median
of --iters jitted calls after a warm-up call, each waited on with block_until_ready. "read" is
the bytes of stored keys and scales the pass must read (entries x formats.bytes_per_vector),
and GB/s is read / kernel time (1 GB = 1e9 B); "rel err" is the kernel's largest deviation
from the reference over visible scores, relative to the largest |score|. On a GPU or TPU it also prints the fraction of
--peak-gbs (default 4300 on GPU: an H200's HBM3e). On CPU the kernels run in the Pallas
interpreter: their times measure the interpreter, not a kernel, and the table says so; keep
CPU contexts small (the defaults finish in about a minute). The measuring is
dsattn.bench.indexer; --json writes its records.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import dsattn  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import cli
from dsattn.bench import indexer
from dsattn.kernels.indexer_score import KERNEL_FORMATS


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def parse_counts(text: str) -> tuple[int, ...]:
    """A --contexts list, checked at parse time (a bad one is a usage error)."""
    try:
        out = tuple(indexer.parse_count(c) for c in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected counts like 1K,4096, got {text!r}")
    return out


def parse_formats(text: str) -> tuple[str, ...]:
    bad = [f for f in text.split(",") if f not in KERNEL_FORMATS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown key format {bad[0]!r}; the kernels read "
                                         f"{', '.join(KERNEL_FORMATS)}")
    return tuple(text.split(","))


def main(argv=None):
    d = indexer.Settings()
    p = cli.parser(__doc__)
    p.add_argument("--impl", default=d.impl, choices=["auto", *indexer.KERNELS],
                   help="kernel to time (auto: the backend's own; pallas_gpu on CPU)")
    p.add_argument("--contexts", type=parse_counts, default=None,
                   help="entries per row, comma-separated (default "
                        f"{','.join(map(_k, indexer.CPU_CONTEXTS))} on CPU, "
                        f"{','.join(map(_k, indexer.DEVICE_CONTEXTS))} on GPU/TPU)")
    p.add_argument("--formats", type=parse_formats, default=d.formats,
                   help="search-key formats, comma-separated (default: all the kernels read)")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--queries", type=int, default=d.queries, help="query positions per row")
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--block-k", type=int, default=None, help="pallas_gpu entries per program")
    p.add_argument("--precision", default=d.precision, choices=["highest", "default"],
                   help="pallas_gpu dot precision (default: TF32 tensor cores on GPU)")
    p.add_argument("--iters", type=int, default=d.iters)
    p.add_argument("--peak-gbs", type=float, default=None,
                   help="memory bandwidth in GB/s for the fraction column (GPU default 4300)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON")
    args = cli.parse(p, argv)

    settings = indexer.Settings(
        impl=args.impl, contexts=args.contexts, formats=args.formats, batch=args.batch,
        queries=args.queries, heads=args.heads, dim=args.dim, page_size=args.page_size,
        block_k=args.block_k, precision=args.precision, iters=args.iters,
        peak_gbs=args.peak_gbs, seed=args.seed)
    facts = indexer.plan(settings)
    print(indexer.fmt_header(facts), flush=True)
    rows = []
    for r in indexer.rows(settings, facts):
        rows.append(r)
        print(indexer.fmt_row(facts, r), flush=True)
    result = {**facts, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    cli.run(main)
