"""Measures behind scripts/bench.py: decode step time against context, prefill time and
peak memory, training throughput, and each decode step's bytes (kvbytes) against a copy
bandwidth measured in the same run (a roofline).

Every figure is measured on this process's backend with ``block_until_ready`` and reported as
a median after warm-up; ratios are only meaningful within one run (shared, noisy machines).
Decode contexts are built by ``synthetic_context``: the cache holds exactly what a real
prefill of n tokens would leave in its lengths, positions and page tables, with random
values, because a step's cost does not depend on the values and a real dense prefill of
64K tokens would take hours on a CPU.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import config as config_lib
from dsattn import data, flops, generate, kvbytes, plan
from dsattn.bench import trace
from dsattn.bench.compiles import compilations
from dsattn.cache.protocol import is_container
from dsattn.model import Transformer, layer_caches, with_layer_caches

PRESETS = ("mha", "mla", "dsa", "v4", "v41")
# The compiled programs' names in a profiler trace (their events' hlo_module)
DECODE_PROGRAM = "_decode_impl"
TRAIN_PROGRAM = "update"


def bench_config(name: str, depth: int | None, *overrides: str, config_dir):
    """A tiny preset in float32 at a common depth (single-kind presets repeat their layer;
    v4 keeps its two SWA layers and alternates CSA/HCA; v41 keeps its preset stack).

    ``config_dir`` is the directory holding ``<name>.yaml`` (the caller's ``configs/tiny``:
    the presets are not part of the installed package)."""
    extra = ["model.dtype=float32", "model.max_seq_len=1048576"]
    if depth is not None and name in ("mha", "mla", "dsa", "gqa", "mqa"):
        extra.append(f"model.n_layers={depth}")
    elif depth is not None and name == "v4":
        if depth < 4 or depth % 2:
            raise ValueError(f"bench: v4 depth must be even and >= 4, got {depth}")
        extra += [f"model.n_layers={depth}", f"attention.layers=swa*2, (csa, hca)*{(depth - 2) // 2}"]
    cfg = config_lib.load(os.path.join(os.fspath(config_dir), f"{name}.yaml"),
                          [*extra, *overrides])
    return cfg


# ------------------------------------------------------------------------------ contexts
def synthetic_context(model: Transformer, cache, n: int, seed: int = 0):
    """The decode state after n tokens per row, with random values: ``pos`` = n, ring slots
    hold positions n-W..n-1, each paged global cache holds n // ratio complete entries
    (appended through ``paged.append``, so page tables and free stacks are real), contiguous
    caches are filled: each cache container's own ``filled`` (cache.protocol). Streaming
    compressor state stays empty (n is expected to be a multiple of every ratio)."""
    key = jax.random.PRNGKey(seed)
    b = cache.pos.shape[0]
    if n > cache.max_len:
        raise ValueError(f"synthetic_context: {n} tokens exceed the cache's {cache.max_len} "
                         f"positions")

    def rand(shape, dtype):
        nonlocal key
        key, sub = jax.random.split(key)
        if jnp.issubdtype(dtype, jnp.floating):
            if jnp.dtype(dtype).itemsize == 1:  # FP8 values / E8M0 scales: a safe 1.0
                return jnp.ones(shape, dtype)
            return (0.5 * jax.random.normal(sub, shape, jnp.float32)).astype(dtype)
        return jax.random.randint(sub, shape, 0, 256).astype(dtype)  # packed FP4 bytes

    fill = lambda c, stride: c.filled(n, stride, rand) if is_container(c) else c  # noqa: E731
    layers = [jax.tree.map(lambda c, s=spec: fill(c, s.stride), lc, is_leaf=is_container)
              for spec, lc in zip(plan.resolve(model.cfg), layer_caches(model.cfg, cache))]
    # Positions and evaluation counts as an exact prefill of n tokens leaves them.
    done = cache.replace(pos=jnp.full((b,), n, jnp.int32), host_pos=np.full((b,), n),
                         evaluations=jnp.full((b,), n * model.cfg.model.n_layers, jnp.int32))
    out = with_layer_caches(model.cfg, done, layers)
    generate.check_cache(out)
    return out


# ------------------------------------------------------------------------------ measures
def _median_ms(times) -> float:
    return float(np.median(times) * 1e3)


def time_decode(model: Transformer, context: int, batch: int, steps: int = 10,
                warmup: int = 2, max_len: int | None = None, trace_dir=None) -> dict:
    """Median decode step (ms) with `context` tokens cached per row; first-call time and the
    number of decode programs compiled for it. `max_len`: the cache's capacity (default just
    enough), so several contexts can share one compiled step. `trace_dir`: one more step
    traced by jax.profiler into it, its per-kernel breakdown under "kernels"
    (dsattn.bench.trace)."""
    eng = generate.engine(model)
    need = context + warmup + steps + 1 + (trace_dir is not None)
    if max_len is not None and max_len < need:
        raise ValueError(f"time_decode: max_len={max_len} holds fewer than the {need} "
                         f"positions {context} cached tokens and the timed steps need")
    cache = generate.init_cache(model, batch, max_len or need)
    cache = synthetic_context(model, cache, context)
    jax.block_until_ready(cache)
    tok = jnp.zeros((batch,), jnp.int32)
    compiled = 0

    def step(tok, cache):  # counting what the decode step compiles, nothing around it
        nonlocal compiled
        with compilations() as c:
            out = generate.decode_step(eng, tok, cache)
        compiled += c.n
        return out

    t0 = time.perf_counter()
    logits, cache = step(tok, cache)
    logits.block_until_ready()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        logits, cache = step(jnp.argmax(logits, -1), cache)
    logits.block_until_ready()
    times = []
    for _ in range(steps):
        tok = jnp.argmax(logits, -1).astype(jnp.int32).block_until_ready()
        t0 = time.perf_counter()
        logits, cache = step(tok, cache)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    extra = {}
    if trace_dir is not None:
        tok = jnp.argmax(logits, -1).astype(jnp.int32).block_until_ready()
        with trace.capture(trace_dir) as where:
            logits, cache = step(tok, cache)
            logits.block_until_ready()
        extra["kernels"] = trace.kernels(where.file, model.cfg.model.n_layers,
                                         program=DECODE_PROGRAM)
    generate.check_cache(cache)
    ms = _median_ms(times)
    return {"step_ms": ms, "tokens_per_s": batch * 1e3 / ms,
            "first_call_s": first, "compile_s": max(first - ms / 1e3, 0.0),
            "compilations": compiled, **extra}


def time_generate(model: Transformer, batch: int, new_tokens: int = 64, prompt: int = 16,
                  repeats: int = 5) -> dict:
    """generate()'s tokens/s (new tokens of all rows over the call's seconds, prefill
    included, median of `repeats` after a compiling call), with its token loop on the
    device and on the host (the on_token path: one sync per token), alternating calls so
    both see the same machine. Sampling at temperature 1 with no eos, so every row makes
    `new_tokens`."""
    eng = generate.engine(model)
    prompts = [[(7 * i + j) % model.cfg.model.vocab_size for j in range(prompt)]
               for i in range(batch)]
    kw = dict(temperature=1.0, max_len=prompt + new_tokens)
    loops = {"device": {}, "host": {"on_token": lambda *_: None}}
    times: dict = {name: [] for name in loops}
    for r in range(repeats + 1):
        for name, extra in loops.items():
            t0 = time.perf_counter()
            outs = eng.generate(prompts, new_tokens, seed=r, **kw, **extra)
            if r:  # the first call compiles
                times[name].append(time.perf_counter() - t0)
            assert sum(map(len, outs)) == batch * new_tokens
    return {f"{name}_tokens_per_s": batch * new_tokens / float(np.median(t))
            for name, t in times.items()}


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def time_prefill(model: Transformer, n: int, replay=None,
                 chunk: int = generate.PREFILL_CHUNK, seed: int = 0) -> dict:
    """Seconds for one n-token prompt (batch 1) after a compile run of one chunk, and the
    process's peak RSS above its level before the prompt (the empty cache included), read
    from /proc (None where it cannot be reset)."""
    eng = generate.engine(model)
    toks = np.random.RandomState(seed).randint(0, model.cfg.model.vocab_size, (1, n))
    # Compile on the same shapes: the first chunk into a cache of the same capacity.
    warm = generate.init_cache(model, 1, n)
    width = min(n, chunk)
    generate.prefill(eng, toks[:, :width], [width], warm, replay=replay,
                     chunk=chunk)[0].block_until_ready()
    if n % chunk and n > chunk:  # the tail bucket compiles too
        tail = n % chunk
        warm = generate.init_cache(model, 1, n)
        generate.prefill(eng, toks[:, :tail], [tail], warm, replay=replay,
                         chunk=chunk)[0].block_until_ready()
    del warm
    cache = generate.init_cache(model, 1, n)
    jax.block_until_ready(cache)
    base = _rss_bytes("VmRSS")
    ok = _reset_peak_rss()
    t0 = time.perf_counter()
    logits, cache = generate.prefill(eng, toks, [n], cache, replay=replay, chunk=chunk)
    logits.block_until_ready()
    seconds = time.perf_counter() - t0
    peak = _rss_bytes("VmHWM") - base if ok else None
    return {"seconds": seconds, "tokens_per_s": n / seconds, "peak_rss_bytes": peak,
            "evaluations": generate.evaluations(cache)}


def time_training(cfg, seq_len: int, batch: int, steps: int = 3, trace_dir=None) -> dict:
    """Training tokens/s (forward, backward, AdamW update) at `seq_len` after one step, and
    what that is in model FLOPs (dsattn.flops): per token, TFLOP/s, and MFU where the
    device's peak is known. `trace_dir`: one more step traced by jax.profiler into it, its
    per-kernel breakdown under "kernels" (dsattn.bench.trace)."""
    from dsattn.train import Trainer

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=seq_len,
                                                             batch_size=batch))
    with tempfile.TemporaryDirectory() as run_dir:
        tr = Trainer(cfg, run_dir, quiet=True)
        batches = [{k: jnp.asarray(v) for k, v in
                    data.batch_at(tr.corpus.train, s, batch, seq_len, cfg.train.seed).items()}
                   for s in range(steps + 1 + (trace_dir is not None))]
        t0 = time.perf_counter()
        m = tr.train_step(batches[0], 0)
        jax.block_until_ready(m)
        first = time.perf_counter() - t0
        times = []
        for s in range(1, steps + 1):
            t0 = time.perf_counter()
            m = tr.train_step(batches[s], s)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
        extra = {}
        if trace_dir is not None:
            with trace.capture(trace_dir) as where:
                jax.block_until_ready(tr.train_step(batches[-1], steps + 1))
            extra["kernels"] = trace.kernels(where.file, cfg.model.n_layers,
                                             program=TRAIN_PROGRAM)
        rate = flops.TrainingRate(cfg, 1 if tr.mesh is None else tr.mesh.size)
    step = float(np.median(times))
    tokens_per_s = batch * seq_len / step
    return {"step_s": step, "tokens_per_s": tokens_per_s, "first_call_s": first,
            "train_flops_per_token": rate.per_token, **rate.record(tokens_per_s), **extra}


def copy_bandwidth(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes moved per second (read + write, as STREAM's Copy counts) by numpy copying an
    n_bytes array: the machine's practical memory bandwidth for the roofline."""
    a = np.ones(n_bytes // 8)
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return 2 * a.nbytes / float(np.median(times))


def decode_bytes(cfg, context: int, batch: int) -> int:
    """Cache bytes one decode step must read (kvbytes, stored formats), all rows."""
    return int(kvbytes.report(cfg, context)["read_bytes"]) * batch


def param_bytes(model: Transformer) -> int:
    """Bytes a decode step reads of the model's weights: as its engine holds them (matrices
    in the compute dtype, generate.held_weights), not as training stores them."""
    state = generate.held_weights(nnx.state(model, nnx.Param), jnp.dtype(model.cfg.model.dtype))
    return int(sum(x.nbytes for x in jax.tree.leaves(state)))
