#!/usr/bin/env python
"""The newcomer's demo (`make demo`): train the default tiny preset on the embedded corpus
(the Python standard library's source, byte-level), save a checkpoint, compare validation
loss with the corpus's unigram entropy, and decode a sample from a prompt.

`python scripts/demo.py [CONFIG] [key=value ...]`; rerunning resumes from runs/demo-<name>.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from dsattn import checkpoint, config, data, generate, train  # noqa: E402

DEFAULT = "configs/tiny/mla.yaml"
PROMPT = "def __init__(self"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    path = argv.pop(0) if argv and not "=" in argv[0] else DEFAULT
    cfg = config.load(path, argv)
    run_dir = Path(f"runs/demo-{cfg.name}")
    print(f"dsattn demo: training {path} ({cfg.model.n_layers} layers, "
          f"{cfg.attention.layers[0]} attention, {cfg.train.steps} steps of "
          f"{cfg.train.batch_size}x{cfg.train.seq_len} tokens) on {jax.devices()[0].platform}")
    t0 = time.perf_counter()
    out = train.train(cfg, run_dir)
    wall = time.perf_counter() - t0
    corpus = data.load_corpus(cfg.data, cfg.model.vocab_size)
    h = data.unigram_entropy(corpus.val, cfg.model.vocab_size)
    print(f"\ncorpus: {corpus.description}")
    print(f"training wall time: {wall:.0f} s; checkpoint saved in {run_dir}/checkpoints")
    print(f"validation loss {out['val_loss']:.3f} nats/byte vs unigram entropy {h:.3f} "
          f"nats/byte (a model that ignores context)")

    model, cfg, step = checkpoint.load_params(run_dir)
    prompt = data.encode(PROMPT).tolist()
    n_new = 160
    sampling = dict(temperature=0.7, top_p=0.95, seed=1)
    generate.generate(model, [prompt], n_new, **sampling)  # compile prefill and decode once
    t1 = time.perf_counter()
    toks = generate.generate(model, [prompt], n_new, **sampling)[0]
    dt = time.perf_counter() - t1
    print(f"\nsample (temperature 0.7, top-p 0.95) from checkpoint step {step}:\n")
    print(PROMPT + data.decode(toks))
    print(f"\ndecode: {len(toks)} tokens in {dt:.2f} s = {len(toks) / dt:.1f} tokens/s "
          f"(batch 1, after compile)")


if __name__ == "__main__":
    main()
