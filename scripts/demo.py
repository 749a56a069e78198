#!/usr/bin/env python
"""The newcomer's demo (`make demo`): train the tiny V4.1 preset, at 6 layers, on the embedded
corpus (the Python standard library's source, byte-level), show its KV cache beside MHA and
MLA of the same width and depth, and decode a sample from the checkpoint.

    python scripts/demo.py [CONFIG] [KEY=VALUE ...] [--run-dir DIR] [--max-new N]

The demo trains for a CPU budget (DEMO_BUDGET: about 3.5 minutes on 2 cores); KEY=VALUE
overrides come after it, e.g. train.steps=1800 to train on, model.n_layers=10 for the
preset's full depth. Rerunning
resumes from the run directory (default runs/demo-<config name>).
"""

import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsattn import cli, config  # noqa: E402

DEFAULT = ROOT / "configs" / "tiny" / "v41.yaml"
# The preset's V4.1 design at 6 layers (model.n_layers=6 keeps every mechanism: SWA, an
# m = 2 encoder [full, reuse], an m = 1 decoder [full] + [reindex, reuse] with the pool, the
# CED split), 900 steps of 8 x 128 bytes at lr 1e-2: validation 1.83 nats/byte in 205 s on
# a quiet 2-core CPU. A step matters more than its tokens here: the 10-layer preset at the
# same rate reached 2.29 in 300 steps (125 s), 2.01 in 650 (230 s), 1.98 at lr 1.5e-2; 330
# steps of 8 x 256 only 2.44. Six layers step 1.5x faster (5,000 vs 3,500 tokens/s).
DEMO_BUDGET = ("model.n_layers=6", "train.steps=900", "train.batch_size=8", "train.lr=1e-2",
               "train.eval_every=450", "train.ckpt_every=450")
BASELINES = ("mha", "mla")
CONTEXTS = (1024, 65536)
PROMPT = "def __init__(self"


def cache_rows(cfg, contexts=CONTEXTS) -> list[dict]:
    """kvbytes of MHA and MLA (the tiny presets at cfg's width, depth and dtype) and of cfg:
    global bytes stored per token, the fixed local window, bytes read per decode step."""
    from dsattn import kvbytes

    same = [f"model.d_model={cfg.model.d_model}", f"model.n_layers={cfg.model.n_layers}",
            f"model.dtype={cfg.model.dtype}"]
    cfgs = [config.load(ROOT / "configs" / "tiny" / f"{name}.yaml", same) for name in BASELINES]
    rows = []
    for c in cfgs + [cfg]:
        reps = [kvbytes.report(c, n) for n in contexts]
        rows.append({"name": c.name, "bytes_per_token": reps[0]["storage_bytes_per_token"],
                     "local_bytes": reps[0]["local_bytes"],
                     "read_bytes": {n: r["read_bytes"] for n, r in zip(contexts, reps)}})
    return rows


def _size(n) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:g} B"


def print_cache_table(cfg, rows):
    c = cfg.cache
    print(f"\nKV cache (dsattn.kvbytes) at d_model {cfg.model.d_model}, {cfg.model.n_layers} "
          f"layers; formats local/main/key {c.local_format}/{c.main_format}/{c.key_format} "
          f"(native: {cfg.model.dtype})")
    print(f"{'model':8}{'B/token':>10}{'window':>10}"
          + "".join(f"{'read/step @' + format(n, ','):>19}" for n in CONTEXTS))
    for r in rows:
        print(f"{r['name']:8}{r['bytes_per_token']:>10,.0f}"
              f"{_size(r['local_bytes']) if r['local_bytes'] else '-':>10}"
              + "".join(f"{_size(r['read_bytes'][n]):>19}" for n in CONTEXTS))
    mha, mine, n = rows[0], rows[-1], CONTEXTS[-1]
    if mine["bytes_per_token"] and mine["read_bytes"][n]:
        print(f"{mine['name']} stores 1/{mha['bytes_per_token'] / mine['bytes_per_token']:.1f} "
              f"of MHA's bytes per token and reads 1/"
              f"{mha['read_bytes'][n] / mine['read_bytes'][n]:.0f} of its bytes per step at "
              f"{n:,} tokens")


def main(argv=None):
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("config", nargs="?", default=str(DEFAULT),
                    help="YAML preset (default: configs/tiny/v41.yaml)")
    ap.add_argument("--run-dir", type=Path, default=None,
                    help="run directory (default: runs/demo-<config name>)")
    ap.add_argument("--max-new", type=cli.positive_int, default=160,
                    help="sample length in tokens (default 160)")
    cli.progress_option(ap)
    args = cli.parse(ap, argv)
    cfg = config.load(args.config, list(DEMO_BUDGET) + args.overrides)
    run_dir = args.run_dir or Path(f"runs/demo-{cfg.name}")
    # Imported once the config is known good: a typo fails without JAX's start-up.
    from dsattn import checkpoint, data, generate, train

    start = checkpoint.manager(run_dir, cfg.train.keep_checkpoints).latest_step() \
        if (run_dir / "checkpoints").exists() else None
    t = cfg.train
    print(f"dsattn demo: {cfg.name} ({cfg.model.n_layers} layers: "
          f"{', '.join(cfg.attention.layers)}), {t.steps} steps of {t.batch_size}x{t.seq_len} "
          f"tokens in {run_dir}" + (f", resuming from step {start}" if start else ""))
    t0 = time.perf_counter()
    out = train.train(cfg, run_dir, progress_every=args.progress_every)
    wall = time.perf_counter() - t0
    corpus = data.load_corpus(cfg.data, cfg.model.vocab_size)
    h = data.unigram_entropy(corpus.val, cfg.model.vocab_size)
    print(f"\ncorpus: {corpus.description}")
    print(f"training: {wall:.0f} s in this run; checkpoint in {run_dir}/checkpoints")
    print(f"validation loss {out['val_loss']:.3f} nats/byte ({out['val_loss'] / math.log(2):.2f} "
          f"bits/byte) vs unigram entropy {h:.3f} nats/byte (a model that ignores context)")

    print_cache_table(cfg, cache_rows(cfg))

    model, cfg, step = checkpoint.load_params(run_dir)
    prompt = data.encode(PROMPT).tolist()
    # 0.9: a model this young loops on indentation at lower temperatures
    sampling = dict(temperature=0.9, top_p=0.95, seed=1)
    generate.generate(model, [prompt], args.max_new, **sampling)  # compile prefill and decode
    t1 = time.perf_counter()
    toks = generate.generate(model, [prompt], args.max_new, **sampling)[0]
    dt = time.perf_counter() - t1
    print(f"\nsample (temperature 0.9, top-p 0.95) from checkpoint step {step}:\n")
    print(PROMPT + data.decode(toks))
    print(f"\ndecode: {len(toks)} tokens in {dt:.2f} s = {len(toks) / dt:.1f} tokens/s "
          f"(batch 1, after compile)")
    return 0


if __name__ == "__main__":
    cli.run(main)
