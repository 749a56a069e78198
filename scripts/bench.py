"""Decode, prefill and training benchmarks of the tiny presets side by side, with a roofline
and (``--peer hf``) the Hugging Face transformers DeepseekV4 model, in one run.

    python scripts/bench.py [--presets mha,mla,dsa,v4,v41] [--depth 10]
        [--contexts 1024,4096,16384,32768,65536] [--batches 1,8] [--prefill 1024,4096,8192,16384]
        [--train-seq 1024] [--peer hf] [--out runs/bench]
    python scripts/bench.py --depth-sweep [--presets mha,mla,dsa,v4,v41] [--out runs/bench]
    python scripts/bench.py --mesh [--out runs/bench]
    python scripts/bench.py --long-context [--presets ...] [--lengths 2048,...,65536]
        [--max-step-s 60] [--out runs/bench]
    python scripts/bench.py --decode-sweep GIB [--presets ...] [--contexts 256,1024]
        [--max-batch N] [--trace] [--out runs/bench]
    python scripts/bench.py --generate [--presets v4,v41] [--batches 1,8] [--out runs/bench]
    python scripts/bench.py --seeds 4 [--sweep configs/ablations/ratios.yaml]
        [--rows full,csa_m2,hca_m8] [--seed-steps 100] [--out runs/bench]

--depth-sweep instead times compilation and steps against depth: MHA, MLA and DSA stacks at
4/12/24 layers, the V4 pattern at 6/12/24/43 and the V4.1 pattern at 10/20/40, scanned and
unrolled (first call and steady step of the forward, a prefill chunk and a decode step; the
decode step again at 16K cached tokens, with scanned over unrolled), into ``depth.json`` and
``depth.txt``.

--mesh instead lays caches out on device meshes (dsattn.sharding): the per-device cache bytes
of the full-size V4-Flash and V4.1-Flash presets at 128K tokens on meshes (1,1,8), (8,1,1)
and (2,2,2) (abstract shapes), and the tiny v4/v41 decode and train steps on 8 host CPU
devices (times not meaningful on a CPU; compile counts are), into ``mesh.json``.

--long-context instead measures the training step against the sequence length: its
temporary bytes (the compiled program's memory analysis) and tokens/s (batch 1) for each
preset, into ``long_context.{json,txt,png}``.

--fit-gib GIB instead finds, for each preset and length, the largest batch whose training step
fits GIB of device memory (compiled memory analysis at batch 1 and 2), into ``fit.json``.

--precision STEPS instead trains each preset STEPS steps under float32 and bfloat16 compute
(float32 weights both): final validation losses side by side and the backward pass's saved
residual bytes at 8K tokens, into ``precision.{json,txt}``.

--rotation STEPS instead trains each preset with an indexer (dsa, v4, v41 of the list) STEPS
steps with full-precision keys, captures its indexers' queries and keys on held-out text,
and counts how much of the full-precision top-k FP8/FP4 keys keep with and without the
Hadamard rotation (indexer.hadamard), into ``rotation.{json,txt}``.

--decode-sweep GIB instead times decode steps against batch and context: for each preset and
--contexts, the largest batch whose decode step fits GIB of memory (compiled memory analysis
at batch 1 and 2), then batch 1, 8, 32, 128, ... up to it (at most --max-batch), each row's
tokens/s, ms/step and bytes roofline with its share, and (--trace) a jax.profiler breakdown of
one step at batch 1 and at the largest batch timed, into ``sweep.{json,txt}``.

--generate instead times generate() (64 new tokens after a 16-token prompt, prefill
included) with its token loop on the device and on the host, alternating, into
``generate.{json,txt}``.

--serve instead runs a serving load (dsattn.bench.serving): --serve-requests requests with
random prompt (--serve-prompt LO,HI) and output (--serve-output LO,HI) lengths arriving at
--serve-rate per second, served by continuous batching for mha and v4 (--presets) in the
same cache memory (MHA's at --serve-mha-rows rows of --serve-max-len; the others get
--serve-rows rows and the largest page pool that fits): requests/s, output tokens/s, time to
first token and inter-token latency (median, p99), into ``serve.{json,txt}``. With
--serve-shared-prefix N every prompt begins with the same N tokens (then its own
--serve-prompt tokens), and the results go to ``prefix.{json,txt}`` instead. --prefix-cache
on,off runs each preset with the scheduler's prefix cache on and then off (default: on),
one row each, reporting the hit rate, the snapshot store, evictions, the most pool pages in
use and the pages one copy of the shared prefix plus each running request's own would
take, and the load's floor (the least TTFT p50 and wall a first-come-first-served scheduler
could reach with free prefill, which bounds what any prefix cache can gain);
--serve-prefix-nodes and --serve-prefix-stride set the cache's snapshot slots and
stride, and --serve-charge-snapshots fits the snapshot store into the same memory.

--seeds N instead trains N seeds of each named row of a sweep file as one vmapped model
(dsattn.train.SeedGroup) and one after another: each seed's tokens/s and the whole set's
wall time, into ``seeds.{json,txt}``.

Prints tables, writes ``bench.json`` and ``decode.png``, ``prefill.png``, ``roofline.png``
under ``--out``, and checks the benchmark's targets (listed in docs/scripts.md) against the
measured numbers. The measuring and reporting are dsattn.bench (suite, measures, report,
peer_hf).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if "--mesh" in sys.argv and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 8 host CPU devices for the mesh measures; set before jax is imported.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

from dsattn import cli  # noqa: E402
import jax  # noqa: E402

from dsattn import config as config_lib  # noqa: E402
from dsattn.bench import depth, report, suite  # noqa: E402

CONFIGS = ROOT / "configs" / "tiny"  # the presets, beside this script in the checkout


def _ints(values) -> str:
    return ",".join(map(str, values))


def parse_args(argv=None):
    d, ints = suite.Settings(), cli.int_list
    ap = cli.parser(__doc__)
    ap.add_argument("--presets", default=",".join(d.presets))
    ap.add_argument("--configs", default=str(CONFIGS),
                    help="directory of the presets' <name>.yaml (default: configs/tiny)")
    ap.add_argument("--depth", type=int, default=d.depth,
                    help="layers of mha/mla/dsa/v4 (v41 keeps its 10-layer stack)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every preset (repeatable), e.g. attention.ratio=8")
    ap.add_argument("--contexts", type=ints, default=_ints(d.contexts))
    ap.add_argument("--batches", type=ints, default=_ints(d.batches))
    ap.add_argument("--steps", type=int, default=d.steps, help="timed decode steps (median)")
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--prefill", type=ints, default=_ints(d.prefill),
                    help="prompt lengths (batch 1); v41 also runs bounded replay")
    ap.add_argument("--chunk", type=int, default=d.chunk, help="prefill chunk")
    ap.add_argument("--train-seq", type=int, default=d.train_seq, help="0: skip training")
    ap.add_argument("--train-batch", type=int, default=d.train_batch)
    ap.add_argument("--train-steps", type=int, default=d.train_steps)
    ap.add_argument("--peer", choices=["hf"], default=None)
    ap.add_argument("--peer-threads", type=int, default=os.cpu_count() or 1,
                    help="torch threads for the peer (default: every core, as XLA uses)")
    ap.add_argument("--peer-contexts", type=ints, default=_ints(d.peer_contexts))
    ap.add_argument("--peer-forward", type=ints, default=_ints(d.peer_forward))
    ap.add_argument("--copy-mb", type=int, default=d.copy_mb)
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--depth-sweep", action="store_true",
                    help="time compilation against depth, scanned vs unrolled, and stop")
    ap.add_argument("--mesh", action="store_true",
                    help="per-device cache bytes and steps on device meshes, and stop")
    ap.add_argument("--long-context", action="store_true",
                    help="training-step temporaries and tokens/s against T, and stop")
    ap.add_argument("--lengths", type=ints, default="2048,4096,8192,16384,32768,65536",
                    help="--long-context sequence lengths")
    ap.add_argument("--max-step-s", type=float, default=60.0,
                    help="--long-context: stop timing a preset after a step this long "
                         "(0: memory only)")
    ap.add_argument("--precision", type=int, default=0, metavar="STEPS",
                    help="train each preset STEPS steps in float32 and in bfloat16 compute: "
                         "final validation loss and saved residuals side by side, and stop")
    ap.add_argument("--rotation", type=int, default=0, metavar="STEPS",
                    help="top-k agreement of low-bit indexer keys with and without the "
                         "Hadamard rotation, on presets trained STEPS steps, and stop")
    ap.add_argument("--fit-gib", type=float, default=0, metavar="GIB",
                    help="the largest batch at --lengths whose training step fits GIB of "
                         "device memory, by compiled memory analysis, and stop")
    ap.add_argument("--decode-sweep", type=float, default=0, metavar="GIB",
                    help="decode tokens/s against batch (up to what fits GIB) and --contexts, "
                         "and stop")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="--decode-sweep: the largest batch timed (default: what fits)")
    ap.add_argument("--trace", action="store_true",
                    help="--decode-sweep: per-kernel breakdown of one step at batch 1 and at "
                         "the largest batch timed (traces under --out/traces)")
    ap.add_argument("--generate", action="store_true",
                    help="generate() tokens/s, device vs host token loop, and stop")
    ap.add_argument("--serve", action="store_true",
                    help="a serving load, mha vs v4 in the same cache memory, and stop")
    ap.add_argument("--serve-requests", type=int, default=32)
    ap.add_argument("--serve-rate", type=float, default=4.0, help="arrivals per second")
    ap.add_argument("--serve-prompt", type=ints, default="64,256", help="LO,HI prompt tokens")
    ap.add_argument("--serve-output", type=ints, default="16,64", help="LO,HI new tokens")
    ap.add_argument("--serve-max-len", type=int, default=512)
    ap.add_argument("--serve-mha-rows", type=int, default=4,
                    help="the memory: MHA's cache at this many rows")
    ap.add_argument("--serve-rows", type=int, default=16, help="rows of the other presets")
    ap.add_argument("--serve-shared-prefix", type=cli.nonnegative_int, default=0, metavar="N",
                    help="tokens every prompt begins with (the same), before its own")
    ap.add_argument("--prefix-cache", type=on_off, default="on",
                    help="prefix caching settings to run, each preset once per setting: "
                         "on, off or on,off")
    ap.add_argument("--serve-prefix-nodes", type=cli.positive_int, default=None,
                    help="snapshot slots of the prefix cache (default: the scheduler's)")
    ap.add_argument("--serve-prefix-stride", type=cli.positive_int, default=None,
                    help="tokens between published prefixes (default: the scheduler's)")
    ap.add_argument("--serve-charge-snapshots", action="store_true",
                    help="the prefix cache's snapshot store counts against the memory")
    ap.add_argument("--seeds", type=int, default=0,
                    help="seeds vmapped vs one after another (with --sweep, --rows), and stop")
    ap.add_argument("--sweep", default=str(ROOT / "configs" / "ablations" / "ratios.yaml"),
                    help="--seeds: the sweep file whose rows train")
    ap.add_argument("--rows", default="full,csa_m2,hca_m8", help="--seeds: its rows")
    ap.add_argument("--seed-steps", type=int, default=100, help="--seeds: steps of each run")
    return cli.parse(ap, argv)


def on_off(text: str) -> tuple[bool, ...]:
    """'on', 'off', 'on,off' ... as (True,), (False,), (True, False) ..."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words or any(w not in ("on", "off") for w in words) or len(set(words)) < len(words):
        raise argparse.ArgumentTypeError(f"expected on, off or on,off; got {text!r}")
    return tuple(w == "on" for w in words)


def settings(args) -> suite.Settings:
    return suite.Settings(
        presets=tuple(p for p in args.presets.split(",") if p), depth=args.depth,
        overrides=tuple(args.set), contexts=tuple(args.contexts), batches=tuple(args.batches),
        steps=args.steps, warmup=args.warmup, prefill=tuple(args.prefill), chunk=args.chunk,
        train_seq=args.train_seq, train_batch=args.train_batch, train_steps=args.train_steps,
        peer=args.peer, peer_threads=args.peer_threads, peer_contexts=tuple(args.peer_contexts),
        peer_forward=tuple(args.peer_forward), copy_mb=args.copy_mb)


def log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def mesh_measures(args) -> dict:
    from dsattn.bench import mesh

    rows = [{"preset": name, **mesh.cache_bytes_per_device(
                config_lib.load(ROOT / "configs" / "deepseek" / f"{name}.yaml"), 8, 131072,
                shape)}
            for name in ("v4_flash", "v4_1_flash") for shape in mesh.MESHES]
    print(mesh.table(rows))
    steps = []
    if jax.device_count() >= 8:
        for name in ("v4", "v41"):
            cfg = config_lib.load(Path(args.configs) / f"{name}.yaml", ["model.dtype=float32"])
            for shape in mesh.MESHES:
                steps.append({"preset": name, **mesh.time_on_mesh(cfg, shape)})
                log(f"{name} on {shape}: {steps[-1]}")
    result = {"cache_bytes": rows, "steps": steps}
    (Path(args.out) / "mesh.json").write_text(json.dumps(result, indent=1))
    return result


def generate_measures(args) -> dict:
    from flax import nnx

    from dsattn.bench import measures
    from dsattn.model import Transformer

    rows = []
    for name in (p for p in args.presets.split(",") if p):
        cfg = measures.bench_config(name, args.depth, *args.set, config_dir=args.configs)
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        for b in args.batches:
            rows.append({"preset": name, "batch": b, **measures.time_generate(model, b)})
            log(f"{name} batch {b}: {rows[-1]}")
    lines = [f"{'preset':<8} {'batch':>5} {'host tok/s':>10} {'device tok/s':>12} {'x':>5}"]
    lines += [f"{r['preset']:<8} {r['batch']:>5} {r['host_tokens_per_s']:>10.0f} "
              f"{r['device_tokens_per_s']:>12.0f} "
              f"{r['device_tokens_per_s'] / r['host_tokens_per_s']:>5.2f}" for r in rows]
    (Path(args.out) / "generate.json").write_text(json.dumps(rows, indent=1))
    (Path(args.out) / "generate.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {"generate": rows}


def serve_measures(args) -> dict:
    from dsattn.bench import serving

    load = serving.Load(requests=args.serve_requests, rate=args.serve_rate,
                        prompt=tuple(args.serve_prompt), output=tuple(args.serve_output),
                        max_len=args.serve_max_len, mha_rows=args.serve_mha_rows,
                        rows=args.serve_rows, shared_prefix=args.serve_shared_prefix,
                        prefix_cache=args.prefix_cache, prefix_nodes=args.serve_prefix_nodes,
                        prefix_stride=args.serve_prefix_stride,
                        charge_snapshots=args.serve_charge_snapshots)
    presets = tuple(p for p in args.presets.split(",") if p)
    rows = serving.run(args.configs, presets, load, *args.set, log=log)
    stem = "prefix" if load.shared_prefix else "serve"  # docs/bench/serve.* stay as they are
    (Path(args.out) / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (Path(args.out) / f"{stem}.txt").write_text(serving.table(rows) + "\n")
    print(serving.table(rows))
    return {"serve": rows}


def sweep_measures(args) -> dict:
    from dsattn.bench import measures, sweep

    plan = sweep.Sweep(contexts=tuple(args.contexts), device_bytes=int(args.decode_sweep * 2**30),
                       steps=args.steps, warmup=args.warmup, max_batch=args.max_batch)
    traces = Path(args.out) / "traces"
    rows = []
    bw = measures.copy_bandwidth(args.copy_mb << 20)
    for name in (p for p in args.presets.split(",") if p):
        cfg = measures.bench_config(name, args.depth, *args.set, config_dir=args.configs)

        def profile(context, batch, largest, name=name):
            last = min(largest, args.max_batch or largest)
            wanted = args.trace and batch in (1, last)
            return traces / f"{name}_{context}_{batch}" if wanted else None

        rows += sweep.run_preset(name, cfg, plan, bw, log=log, profile=profile)
    text = sweep.table(rows)
    (Path(args.out) / "sweep.json").write_text(json.dumps(
        {"copy_bandwidth_bytes_per_s": bw, "rows": rows}, indent=1, default=str))
    (Path(args.out) / "sweep.txt").write_text(text + "\n")
    print(text)
    return {"sweep": rows}


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.mesh:
        return mesh_measures(args)
    if args.fit_gib:
        from dsattn.bench import long_context

        rows = []
        for name in (p for p in args.presets.split(",") if p):
            for t in args.lengths:
                cfg = long_context.at_length(f"{args.configs}/{name}.yaml", t, *args.set)
                row = {"preset": name, **long_context.largest_batch(
                    cfg, t, int(args.fit_gib * long_context.GIB))}
                rows.append(row)
                print(f"{name} T={t}: {row['temp_bytes_per_row'] / long_context.GIB:.2f} GiB "
                      f"a row, {row['argument_bytes'] / long_context.GIB:.2f} GiB weights and "
                      f"optimizer state: batch {row['largest_batch']} fits {args.fit_gib:g} GiB")
        (Path(args.out) / "fit.json").write_text(json.dumps(rows, indent=1))
        return {"fit": rows}
    if args.precision:
        from dsattn.bench import precision

        presets = tuple(p for p in args.presets.split(",") if p)
        rows = precision.parity(args.configs, presets, args.precision, *args.set)
        (Path(args.out) / "precision.json").write_text(json.dumps(rows, indent=1))
        (Path(args.out) / "precision.txt").write_text(precision.table(rows) + "\n")
        print(precision.table(rows))
        return {"precision": rows}
    if args.rotation:
        from dsattn.bench import rotation

        presets = tuple(p for p in args.presets.split(",") if p in ("dsa", "v4", "v41"))
        rows = rotation.measure(args.configs, presets, args.rotation, *args.set, log=log)
        (Path(args.out) / "rotation.json").write_text(json.dumps(rows, indent=1))
        (Path(args.out) / "rotation.txt").write_text(rotation.table(rows) + "\n")
        print(rotation.table(rows))
        return {"rotation": rows}
    if args.long_context:
        from dsattn.bench import long_context

        presets = tuple(p for p in args.presets.split(",") if p)
        rows = long_context.run(args.configs, presets, tuple(args.lengths), *args.set,
                                max_step_s=args.max_step_s, log=log)
        (Path(args.out) / "long_context.json").write_text(json.dumps(rows, indent=1))
        (Path(args.out) / "long_context.txt").write_text(long_context.table(rows) + "\n")
        print(long_context.table(rows))
        if not args.no_plots:
            long_context.plot(rows, Path(args.out) / "long_context.png")
        return {"long_context": rows}
    if args.generate:
        return generate_measures(args)
    if args.serve:
        return serve_measures(args)
    if args.decode_sweep:
        return sweep_measures(args)
    if args.seeds:
        from dsattn import ablate
        from dsattn.bench import seeds

        sweep = ablate.load(args.sweep, [f"train.steps={args.seed_steps}", *seeds.SETTINGS])
        rows = seeds.measure(sweep.seed_configs([r for r in args.rows.split(",") if r],
                                                args.seeds), log=log)
        (Path(args.out) / "seeds.json").write_text(json.dumps(rows, indent=1))
        (Path(args.out) / "seeds.txt").write_text(seeds.table(rows) + "\n")
        print(seeds.table(rows))
        return {"seeds": rows}
    if args.depth_sweep:
        rows = depth.run(args.configs, tuple(p for p in args.presets.split(",") if p), log=log)
        (Path(args.out) / "depth.json").write_text(json.dumps(rows, indent=1))
        (Path(args.out) / "depth.txt").write_text(depth.table(rows) + "\n")
        print(depth.table(rows))
        return {"depth": rows}
    result = suite.run(settings(args), args.configs, log=log)
    path = report.save_json(result, args.out)
    print(report.fmt_table(result))
    print(f"\nwrote {path}")
    if not args.no_plots:
        for p in report.plot(result, args.out):
            print(f"wrote {p}")
    return result


if __name__ == "__main__":
    cli.run(main)
