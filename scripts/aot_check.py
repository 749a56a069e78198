#!/usr/bin/env python
"""Compile every preset's programs for a chip that is not here, from this CPU, and report
what each compiled program holds and launches (dsattn.bench.aot):

    python scripts/aot_check.py --target h100|h200|v5e|v6e|PATH.yaml [--mesh]
        [--presets mha,mla,dsa,v4,v41] [--impls xla,kernels]
        [--programs train,train_long,prefill,decode,decode_max,serve[,decode_flat,train_max]]
        [--configs configs/small] [--out docs/bench/aot_<target>] [--redo] [--tiles]

Needs the `aot` extra (pip install -e ".[aot]": the CUDA plugin with ptxas, and libtpu) in
its environment; `make aot-venv` makes one in .venv-aot. Rows go to OUT.json (every row,
kept across runs: a rerun compiles only the rows it lacks, --redo all of them), OUT.txt
(one line each) and OUT.md (a table: each program's peak memory, kernels a decode layer,
the largest decode batches). `--mesh` compiles on the target's mesh (8 GPUs in one host; 4 TPU chips)
instead of one chip: the training step FSDP over every chip, the decode step's rows split
over them. scripts/device_check.py reads the same rows on a real device and adds timings.
`--tiles` (a GPU target) measures instead the shared memory the training kernels' programs
ask for at each tile size, beside the model they choose tiles by (OUT.tiles.json).
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; start no device
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # libtpu: no cloud metadata to ask
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiles in parallel processes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from dsattn import cli, targets  # noqa: E402
from dsattn.bench import aot  # noqa: E402
from dsattn.errors import InputError  # noqa: E402


def names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("--target", required=True,
                    help=f"one of {', '.join(targets.names())}, or a target YAML file")
    ap.add_argument("--mesh", action="store_true", help="the target's mesh, not one chip")
    ap.add_argument("--presets", type=names, default=["mha", "mla", "dsa", "v4", "v41"])
    ap.add_argument("--impls", type=names, default=list(aot.IMPLS))
    ap.add_argument("--programs", type=names, default=list(aot.DEFAULT_PROGRAMS),
                    help=f"of {', '.join(aot.PROGRAMS)} (default: all but decode_flat, train_max)")
    ap.add_argument("--configs", default=str(ROOT / "configs" / "small"))
    ap.add_argument("--out", help="report path without suffix (default docs/bench/aot_<target>)")
    ap.add_argument("--redo", action="store_true", help="compile rows already in the report")
    ap.add_argument("--tiles", action="store_true",
                    help="instead: the shared memory the training kernels ask for at each "
                         "tile size on this GPU target, beside the kernels' model of it")
    args = cli.parse(ap, argv)
    try:
        target = targets.load(args.target)
    except ValueError as e:
        raise InputError(str(e)) from None
    out = Path(args.out or ROOT / "docs" / "bench" / f"aot_{target.name}")
    for impl in args.impls:
        if impl not in aot.IMPLS:
            raise InputError(f"--impls: {impl!r} is not one of {', '.join(aot.IMPLS)}")
    if args.tiles:
        rows = aot.tile_requests(target, log=lambda r: print(json.dumps(r), flush=True))
        out.with_suffix(".tiles.json").write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    devices = target.devices(mesh=args.mesh)
    specs = aot.specs(args.presets, args.impls, args.programs, args.mesh, len(devices))
    report = aot.Report.load(out.with_suffix(".json"))
    print(f"{target.name}: {target.device} x{len(devices)} ({target.platform}), "
          f"{len(specs)} programs", flush=True)
    for spec in specs:
        if not args.redo and report.has(target.name, spec):
            continue
        rows = aot.rows_for(spec, target, devices, args.configs,
                            log=lambda line: print(line, flush=True))
        report.put(target.name, spec, rows)
        report.save(out, target)
        jax.clear_caches()  # a compiled program per row adds up to GBs over a report
    print(f"report: {out}.json, .txt, .md")
    return 0


if __name__ == "__main__":
    cli.run(main)
