#!/usr/bin/env python
"""Serve a trained run over HTTP with OpenAI's completions API (continuous batching).

    python scripts/serve.py RUN_DIR [--host 127.0.0.1] [--port 8000] [--rows 8]
        [--max-len L] [--pool-tokens N] [--token-budget N] [--max-chunk 64] [--replay R]
        [--no-prefix-cache] [--prefix-cache-nodes N] [--prefix-stride N] [--api-key KEY]
        [--max-queue 64] [--max-body-bytes N] [--step S] [KEY=VALUE ...]

Needs the `serve` extra (pip install -e ".[serve]"). Endpoints: POST /v1/completions
(prompt, max_tokens, temperature, top_p, stop, stream, seed), GET /v1/models, GET /health,
GET /metrics (queue length, active rows, open requests, free pages, tokens/s, prefix cache
counters). Prompt prefixes are cached and reused across requests (docs/prefix_caching.md;
--no-prefix-cache turns that off). Any OpenAI client works, e.g.
``openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")``. With --api-key (or
DSATTN_API_KEY) every endpoint but /health needs that key. The server prints
`serving on http://HOST:PORT` on stderr once it accepts requests.
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import cli  # noqa: E402


def parser():
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("run_dir", help="a run directory written by scripts/train.py")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=cli.positive_int, default=8000, help="port (default 8000)")
    ap.add_argument("--rows", type=cli.positive_int, default=8,
                    help="requests decoded at once: the batch's rows (default 8)")
    ap.add_argument("--max-len", type=cli.positive_int, default=None,
                    help="positions per request, prompt included (default: the model's "
                         "max_seq_len)")
    ap.add_argument("--pool-tokens", type=cli.positive_int, default=None,
                    help="positions each paged layer's pool holds over all rows (default: "
                         "rows x max-len, never short); smaller pools admit by pages and "
                         "preempt the youngest row when they run out")
    ap.add_argument("--token-budget", type=cli.positive_int, default=None,
                    help="tokens one step runs at most, decoding rows included (default: "
                         "rows + max-chunk)")
    ap.add_argument("--max-chunk", type=cli.positive_int, default=64,
                    help="longest prefill chunk of one request per step, a power of two "
                         "(default 64)")
    ap.add_argument("--replay", type=cli.positive_int, default=None,
                    help="bounded-replay prefill over the last R prompt positions (CED "
                         "configs; default: exact prefill)")
    ap.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="prefill every prompt whole: reuse no cached prompt prefix across "
                         "requests (always off on a mesh)")
    ap.add_argument("--prefix-cache-nodes", type=cli.positive_int, default=None,
                    help="cached prefixes kept at once: snapshot slots, each a row of the "
                         "decode state (default: 4 x rows, at least 8)")
    ap.add_argument("--prefix-stride", type=cli.positive_int, default=None,
                    help="tokens between cached prefixes, a multiple of the block size "
                         "(default: lcm(block size, max-chunk), raised to a multiple that "
                         "covers a V4 config's attention window)")
    ap.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                    help="start serving before compiling every program a step can run (the "
                         "first requests then wait for the compiles)")
    ap.add_argument("--api-key", default=os.environ.get("DSATTN_API_KEY") or None,
                    help="the key clients send (Authorization: Bearer KEY) to every endpoint "
                         "but /health (default: $DSATTN_API_KEY; none: no key is asked)")
    ap.add_argument("--max-queue", type=cli.nonnegative_int, default=64,
                    help="requests waiting for a row beyond the --rows running; more get 429 "
                         "with Retry-After (default 64)")
    ap.add_argument("--max-body-bytes", type=cli.positive_int, default=None,
                    help="largest request body; a larger one gets 413 (default 4 MiB)")
    ap.add_argument("--step", type=cli.nonnegative_int, default=None,
                    help="checkpoint step to load (default: the latest)")
    return ap


def main(argv=None):
    args = cli.parse(parser(), argv)
    try:
        import uvicorn

        from dsattn.serve.app import make_app
    except ImportError as e:
        raise SystemExit(f"serve.py: error: {e.name} is missing: pip install -e '.[serve]'")
    from dsattn import generate, progress, tokenizer
    from dsattn.serve.runner import Runner
    from dsattn.serve.scheduler import Scheduler

    model, cfg, step = cli.load_run(args.run_dir, args.step, args.overrides)
    max_len = args.max_len or cfg.model.max_seq_len
    sched = Scheduler(generate.Engine(model), args.rows, max_len, pool_tokens=args.pool_tokens,
                      token_budget=args.token_budget, max_chunk=args.max_chunk,
                      replay=args.replay, prefix_cache=args.prefix_cache,
                      prefix_nodes=args.prefix_cache_nodes, prefix_stride=args.prefix_stride)
    if args.warm_up:  # minutes for a big model: a line (or a bar) per program
        t0, shapes = time.perf_counter(), sched.warm_up_shapes()
        print(f"warming up: compiling the {len(shapes)} step programs a request can run (chunk "
              f"widths {', '.join(str(w) for w in sorted({w for w, _ in shapes}))} over the "
              f"{args.rows} rows and sub-batches of them), so that none waits for a compile "
              f"(--no-warm-up skips it)", file=sys.stderr, flush=True)
        bar = progress.Progress(len(shapes), desc="warm-up", unit="program", every=1)
        shapes = sched.warm_up(lambda width, rows, s: bar.update(
            fields={"width": width, "rows": rows, "took": f"{s:.1f}s"}))
        bar.close()
        print(f"compiled {shapes} step shapes in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    runner = Runner(sched, max_queue=args.max_queue).start()
    announce = lambda: print(f"serving on http://{args.host}:{args.port} (checkpoint step "  # noqa: E731
                             f"{step}, {args.rows} rows of {max_len} positions"
                             f"{', API key required' if args.api_key else ''})",
                             file=sys.stderr, flush=True)
    app = make_app(runner, tokenizer.for_run(args.run_dir), Path(args.run_dir).name, announce,
                   api_key=args.api_key, max_body_bytes=args.max_body_bytes)

    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    cli.run(main)
