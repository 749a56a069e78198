"""Benchmarks of the attention designs (behind scripts/bench.py and scripts/bench_indexer.py).

    measures   decode/prefill/training timers, copy bandwidth, decode and parameter bytes,
               synthetic decode contexts
    suite      one scripts/bench.py run: every measure of every preset -> a JSON-able dict
    report     the targets, tables, bench.json and plots of such a result
    indexer    the indexer score kernel against its jnp reference
    peer_hf    the Hugging Face transformers DeepseekV4 peer (needs the `peer` extra)
    long_context, depth, mesh, lower, seeds   scripts/bench.py's other sections

Not imported by ``import dsattn`` nor by the core (model, generate, train, ...): import the
submodule you need, e.g. ``from dsattn.bench import measures``. Application code may: a
sweep's measurements (dsattn.ablate.measure) time decode steps with it.
"""
