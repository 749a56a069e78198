#!/usr/bin/env python
"""Lower a full-size preset's decode step and a prefill chunk from shapes alone, and print
what each compiled program holds: XLA's memory analysis (argument, output, temporary bytes)
beside kvbytes' cache bytes, the program's op count, and the decode step's longest chain of
dependent kernels (matmuls, Pallas calls, sorts, top-k, scatters: a floor on the kernels a
GPU launches one after another, dsattn.bench.kernel_chain). Nothing is allocated.

    python scripts/lower.py configs/deepseek/v4_flash.yaml [--max-len 1M] [--chunk 4096]
        [--batch 1] [--json FILE] [--path N] [KEY=VALUE ...]

The cache has --max-len positions per row (the argument a decode step holds); the prefill
chunk runs --chunk new tokens into that cache. On a CPU, XLA runs bfloat16 matmuls in float32
and keeps float32 copies of the weights among a program's temporaries, which a TPU or GPU
program does not (V4.1-Flash's decode step: 29.30 GiB of temporaries with its bfloat16
weights, 3.75 GiB with model.dtype=float32; its 4096-token prefill chunk 31.23 / 6.82 GiB).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dsattn import cli, config, scan  # noqa: E402
from dsattn.bench import lower  # noqa: E402

GIB = 2 ** 30


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main(argv=None):
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("preset", help="a config file, e.g. configs/deepseek/v4_flash.yaml")
    ap.add_argument("--max-len", default="1M", help="cache positions per row (K/M suffixes)")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk tokens (0: none)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--path", type=int, default=0,
                    help="print the last N steps of the decode step's chain of kernels")
    args = cli.parse(ap, argv)
    cfg = config.load(args.preset, args.overrides)
    max_len = _size(args.max_len)
    rows = [lower.analyse(cfg, args.batch, max_len)]
    if args.chunk:
        rows.append(lower.analyse(cfg, args.batch, max_len, chunk=args.chunk))
    traced = sum(u.traced for u in scan.units(cfg))  # layers compiled (model.scan_layers)
    print(f"{cfg.name}: {cfg.model.n_layers} layers ({traced} traced), batch {args.batch}, "
          f"cache of {max_len:,} "
          f"positions per row, parameters {rows[0]['param_bytes'] / GIB:.2f} GiB")
    print(f"{'program':<14}{'arguments':>12}{'output':>12}{'temp':>12}{'cache values':>14}"
          f"{'kvbytes':>12}{'HLO ops':>10}")
    for r in rows:
        print(f"{r['program']:<14}{r['argument_bytes'] / GIB:>10.2f}Gi"
              f"{r['output_bytes'] / GIB:>10.2f}Gi{r['temp_bytes'] / GIB:>10.2f}Gi"
              f"{r['cache_value_bytes'] / GIB:>12.3f}Gi{r['kvbytes_cache_bytes'] / GIB:>10.3f}Gi"
              f"{r['hlo_ops']:>10,}")
    d = rows[0]
    print(f"decode step: {d['kernel_chain']} dependent kernels at least "
          f"({d['kernel_chain'] / cfg.model.n_layers:.1f} per layer; matmuls, Pallas calls, "
          f"sorts, top-k and scatters: {d['kernel_counts']})")
    if args.path:
        width = max(len(op) for op, _ in d["kernel_chain_path"][-args.path:])
        for op, where in d["kernel_chain_path"][-args.path:]:
            print(f"  {op:<{width}}  {where}")
    if jax.default_backend() == "cpu" and jnp.dtype(cfg.model.dtype).itemsize < 4:
        # XLA:CPU computes 16-bit matmuls in float32 from float32 copies of the weights
        print(f"CPU: temp includes float32 copies of the weights (up to "
              f"{2 * rows[0]['param_bytes'] / GIB:.2f} GiB), which a TPU or GPU program does "
              f"not hold;\nmodel.dtype=float32 lowers the programs without them")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    cli.run(main)
