#!/usr/bin/env python
"""Bounded-replay prefill vs exact prefill for a CED model (docs/design.md, replay).

    python scripts/replay_report.py RUN_DIR|CONFIG [KEY=VALUE ...] [--prompt-len 256]
        [--replays 1,2,4,8,16,32] [--timing-len 2048 (0: skip)] [--out runs/replay_report.json]

For each R: the next-token logit deviation from exact prefill (max |Δlogit|, KL(exact ||
replay) in nats, argmax agreement) over validation prompts, and the (position, layer)
evaluation count against enc·T + dec·R. Then the wall time of one exact and one replay
(R = window) prefill of a long prompt, medians after a warm-up, in the same run.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dsattn import checkpoint, cli, config, data, generate  # noqa: E402
from dsattn.errors import ConfigError  # noqa: E402
from dsattn.model import Transformer  # noqa: E402


def load(source: str, overrides):
    path = Path(source)
    cfg = (checkpoint.load_run_config(path, overrides) if path.is_dir()
           else config.load(path, overrides))
    if not cfg.attention.ced_split:  # before restoring any weights
        raise ConfigError(f"{source}: replay needs a CED config (attention.ced_split > 0)")
    if path.is_dir():
        model, cfg, step = cli.load_run(path, None, overrides)
        return model, cfg, f"{path} (step {step})"
    return Transformer(cfg, rngs=nnx.Rngs(0)), cfg, f"{path} (untrained)"


def prefill_logits(engine, tokens, replay):
    """Next-token logits of a prefill and its (position, layer) evaluation count."""
    b, t = tokens.shape
    cache = engine.init_cache(b, t)
    logits, cache = engine.prefill(tokens, [t] * b, cache, replay=replay)
    return np.asarray(logits, np.float64), generate.evaluations(cache)


def deviation(exact, other):
    lp = jax.nn.log_softmax(exact, -1)
    lq = jax.nn.log_softmax(other, -1)
    kl = np.asarray(jnp.sum(jnp.exp(lp) * (lp - lq), -1))
    return {"max_abs_logit": float(np.max(np.abs(exact - other))),
            "mean_kl_nats": float(np.mean(kl)),
            "argmax_agree": float(np.mean(exact.argmax(-1) == other.argmax(-1)))}


def timed(fn, repeats: int = 3) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv=None):
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("source", help="a run directory (trained) or a CED config (random weights)")
    ap.add_argument("--prompt-len", type=cli.positive_int, default=256,
                    help="tokens per validation prompt (default 256)")
    ap.add_argument("--prompts", type=cli.positive_int, default=8,
                    help="validation prompts (default 8)")
    ap.add_argument("--replays", type=cli.int_list, default=cli.int_list("1,2,4,8,16,32,64"),
                    help="replay lengths R to compare (default 1,2,4,8,16,32,64)")
    ap.add_argument("--timing-len", type=cli.nonnegative_int, default=2048,
                    help="prompt length of the exact vs replay timing (0: skip; default 2048)")
    ap.add_argument("--out", default="runs/replay_report.json", help="JSON output file")
    args = cli.parse(ap, argv)
    model, cfg, what = load(args.source, args.overrides)
    enc = cfg.attention.ced_split
    dec = cfg.model.n_layers - enc
    corpus = data.load_corpus(cfg.data, cfg.model.vocab_size)
    t = args.prompt_len
    starts = np.linspace(0, len(corpus.val) - t - 1, args.prompts).astype(int)
    tokens = np.stack([corpus.val[s: s + t] for s in starts]).astype(np.int32)
    engine = generate.engine(model)
    exact, ev_exact = prefill_logits(engine, tokens, None)
    rows = []
    print(f"{what}: {args.prompts} validation prompts of {t} tokens; encoder {enc} layers, "
          f"decoder {dec}; window {cfg.attention.window}")
    print(f"{'R':>6} {'max|dlogit|':>12} {'mean KL':>10} {'argmax=':>8} {'evals':>8} "
          f"{'enc*T+dec*R':>12}")
    for r in args.replays:
        logits, ev = prefill_logits(engine, tokens, r)
        row = {"R": r, **deviation(exact, logits), "evaluations_per_prompt": ev // args.prompts,
               "formula": enc * t + dec * min(r, t)}
        rows.append(row)
        print(f"{r:>6} {row['max_abs_logit']:>12.4g} {row['mean_kl_nats']:>10.3g} "
              f"{row['argmax_agree']:>8.2f} {row['evaluations_per_prompt']:>8} "
              f"{row['formula']:>12}")
    print(f"{'exact':>6} {'':>12} {'':>10} {'':>8} {ev_exact // args.prompts:>8} "
          f"{(enc + dec) * t:>12}")

    n = args.timing_len
    timing = None
    if n:
        timing = time_prefill(engine, cfg, corpus, n, enc, dec)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": what, "prompt_len": t, "rows": rows,
                               "timing": timing}, indent=2))
    print(f"wrote {out}")
    return rows


def time_prefill(engine, cfg, corpus, n, enc, dec):
    """Wall time of one exact and one replay (R = window) prefill of an n-token prompt."""
    long = np.asarray(corpus.val[: n], np.int32)[None]
    w = cfg.attention.window

    def run(replay):
        cache = engine.init_cache(1, n)
        return engine.prefill(long, [n], cache, replay=replay)[0]

    t_exact = timed(lambda: run(None))
    t_replay = timed(lambda: run(w))
    print(f"prefill of {n} tokens (batch 1, median of 3 after compile): exact {t_exact:.2f} s, "
          f"replay R={w} {t_replay:.2f} s, ratio {t_replay / t_exact:.2f}; evaluation ratio "
          f"{(enc * n + dec * w) / ((enc + dec) * n):.2f}")
    return {"tokens": n, "exact_s": t_exact, "replay_s": t_replay, "replay_R": w}


if __name__ == "__main__":
    cli.run(main)
