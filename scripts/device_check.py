"""Check a machine with a GPU or TPU in one command (a few minutes), into one JSON report:

    python scripts/device_check.py [--out runs/device_check.json] [--budget-s 420]
        [--train-presets mha,mla,dsa,v4,v41] [--train-impls xla,pallas_gpu]
        [--decode-presets v4,v41] [--decode-impls xla,pallas_gpu]
        [--contexts 32768,131072] [--sweep-presets mha,mla,dsa,v4,v41] [--sweep-gib G]
        [--sweep-max-batch N] [--no-traces] [--command-buffers off,default,loops]
        [KEY=VALUE ...]

1. the accelerator-only tests: the Pallas kernels compiled for the device (Triton on a GPU,
   Mosaic on a TPU) against their references;
2. a few bfloat16 training steps of each preset in configs/small (about 100M parameters,
   8K tokens): tokens/s, model TFLOP/s (dsattn.flops) and MFU against the device's peak,
   once per attention implementation (on a GPU: the XLA reference, then the fused Pallas
   kernels, attention.impl=pallas_gpu; the summary gives their ratio);
3. decode steps of v4 and v41 at 32K and 128K cached tokens against the roofline: the bytes a
   step must read (cache, by dsattn.kvbytes, plus the weights) over the device's measured
   bandwidth, once per attention implementation like section 2 (on a GPU the decode kernel,
   kernels/decode_attention.py, against the XLA reference);
4. the decode sweep (dsattn.bench.sweep): each sweep preset at each context, batch 1, 8, 32,
   128, ... up to the largest whose decode step fits the device's memory (compiled memory
   analysis; printed), tokens/s, ms/step, bytes roofline and share, with a jax.profiler
   breakdown of one step at batch 1 and at the largest batch (kernels per step, time per
   kernel, kernels per layer; dsattn.bench.trace), and the same breakdown of one training
   step per preset in section 2. Traces go to runs/device_traces/ (outside git);
5. on a GPU, an A/B of XLA command buffers (CUDA graphs) for the decode step: the first
   decode preset at the first context, once per variant of dsattn.bench.device's
   COMMAND_BUFFERS (off, XLA's default, with loops and conditionals), each in its own process.

Each section runs under the time budget and the report is rewritten after each, so a lease
that ends early still leaves what was measured. On a CPU the same check runs at tiny sizes
(configs/tiny, 128-token steps, 256/1024-token contexts): the kernels' compiled cases skip.
KEY=VALUE overrides apply to every preset (e.g. model.dtype=float32).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsattn import cli  # noqa: E402


def names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv=None):
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("--out", default=str(ROOT / "runs" / "device_check.json"))
    ap.add_argument("--budget-s", type=float, default=None,
                    help="time for the whole check (default 420 s; 600 s on a CPU)")
    ap.add_argument("--configs", default=None,
                    help="presets' directory (default configs/small; configs/tiny on a CPU)")
    ap.add_argument("--train-presets", type=names, default=None)
    ap.add_argument("--decode-presets", type=names, default=None)
    ap.add_argument("--contexts", type=cli.int_list, default=None)
    ap.add_argument("--sweep-presets", type=names, default=None,
                    help="decode sweep presets (default all five; '' for none)")
    ap.add_argument("--sweep-gib", type=float, default=None,
                    help="memory the sweep's batches may fill (default: 85%% of the device's)")
    ap.add_argument("--sweep-max-batch", type=int, default=None)
    ap.add_argument("--no-traces", action="store_true", help="no profiler traces")
    ap.add_argument("--command-buffers", type=names, default=None,
                    help="command-buffer variants of the decode A/B on a GPU ('' for none)")
    ap.add_argument("--train-impls", type=names, default=None,
                    help="attention.impl of the training rows (default: xla, and pallas_gpu "
                         "on a GPU)")
    ap.add_argument("--decode-impls", type=names, default=None,
                    help="attention.impl of the decode rows (default: xla, and pallas_gpu "
                         "on a GPU)")
    ap.add_argument("--train-seq", type=int, default=None)
    ap.add_argument("--train-batch", type=int, default=None)
    ap.add_argument("--tests", type=names, default=None,
                    help="pytest paths (default: the kernel tests); '' for none")
    args = cli.parse(ap, argv)

    import jax

    from dsattn.bench import device

    given = {"budget_s": args.budget_s, "configs": args.configs,
             "train_presets": args.train_presets, "train_impls": args.train_impls,
             "decode_presets": args.decode_presets, "decode_impls": args.decode_impls,
             "contexts": args.contexts, "train_seq": args.train_seq,
             "train_batch": args.train_batch, "tests": args.tests,
             "sweep_presets": args.sweep_presets, "sweep_max_batch": args.sweep_max_batch,
             "sweep_memory": None if args.sweep_gib is None else int(args.sweep_gib * 2**30),
             "traces": "" if args.no_traces else None,
             "command_buffers": args.command_buffers}
    changes = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()
               if v is not None}
    settings = device.Settings.for_backend(jax.default_backend(), ROOT,
                                           overrides=tuple(args.overrides), **changes)
    out = Path(args.out)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    report = device.check(settings, ROOT, log=log, save=lambda r: device.write(r, out))
    print(device.summary(report))
    print(f"report: {out}")
    return 1 if report["errors"] or (report["tests"] or {}).get("failed") else 0


if __name__ == "__main__":
    cli.run(main)
