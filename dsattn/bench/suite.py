"""One benchmark run of scripts/bench.py: every preset's decode, prefill and training
measures, the copy bandwidth they are read against, and (``peer="hf"``) the Hugging Face
DeepseekV4 peer, gathered into one JSON-able result dict.

    result = suite.run(suite.Settings(presets=("v4", "v41")), "configs/tiny")
    report.check_targets(result)   # already in result["targets"]
    print(report.fmt_table(result))

The result: ``machine``, ``args`` (the Settings), ``copy_bandwidth_bytes_per_s``,
``presets`` (name -> {n_layers, layers, param_bytes, decode: [...], prefill: [...], train}),
``peer`` (None, {"unavailable": why} or its records), ``targets`` and ``wall_s``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time

from dsattn.bench import measures, report


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run measures (scripts/bench.py's options, same names)."""

    presets: tuple[str, ...] = measures.PRESETS
    depth: int | None = 10  # layers of mha/mla/dsa/v4 (v41 keeps its 10-layer stack)
    overrides: tuple[str, ...] = ()  # KEY=VALUE config overrides for every preset
    contexts: tuple[int, ...] = (1024, 4096, 16384, 32768, 65536)
    batches: tuple[int, ...] = (1, 8)
    steps: int = 10  # timed decode steps (median)
    warmup: int = 2
    prefill: tuple[int, ...] = (1024, 4096, 8192, 16384)  # batch 1; v41 also replays
    chunk: int = 1024  # prefill chunk
    train_seq: int = 1024  # 0: no training measure
    train_batch: int = 2
    train_steps: int = 3
    peer: str | None = None  # "hf": the transformers DeepseekV4 peer
    peer_threads: int | None = None  # torch threads; None: every core, as XLA uses
    peer_contexts: tuple[int, ...] = (1024, 4096, 16384)
    peer_forward: tuple[int, ...] = (1024, 4096)
    copy_mb: int = 256


def _quiet(msg: str):
    pass


def run(settings: Settings, config_dir, log=_quiet) -> dict:
    """Measure everything `settings` asks for; presets are read from ``config_dir``
    (``<name>.yaml``). ``log`` gets a line before each measure."""
    import jax
    from flax import nnx

    from dsattn.model import Transformer

    s = settings
    t0 = time.time()
    if s.peer not in (None, "hf"):
        raise ValueError(f"bench: unknown peer {s.peer!r} (known: hf)")
    # Every config first: a typo fails before minutes of measuring.
    cfgs = {name: measures.bench_config(name, s.depth, *s.overrides, config_dir=config_dir)
            for name in s.presets}
    result = {"machine": {"backend": jax.default_backend(), "devices": str(jax.devices()),
                          "cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "jax": jax.__version__},
              "args": dataclasses.asdict(s), "presets": {}, "peer": None}
    log(f"copy bandwidth: numpy copy of {s.copy_mb} MB ...")
    bw = measures.copy_bandwidth(s.copy_mb << 20)
    result["copy_bandwidth_bytes_per_s"] = bw
    for name in s.presets:
        cfg = cfgs[name]
        model = Transformer(cfg, rngs=nnx.Rngs(0))
        rec = {"n_layers": len(cfg.attention.layers), "layers": list(cfg.attention.layers),
               "param_bytes": measures.param_bytes(model), "decode": [], "prefill": [],
               "train": None}
        result["presets"][name] = rec
        for batch in s.batches:
            for ctx in s.contexts:
                log(f"{name}: decode batch {batch} context {ctx} ...")
                d = measures.time_decode(model, ctx, batch, s.steps, s.warmup)
                d.update(context=ctx, batch=batch,
                         read_bytes=measures.decode_bytes(cfg, ctx, batch))
                d["read_bytes_per_s"] = d["read_bytes"] / (d["step_ms"] / 1e3)
                d["roofline_fraction"] = d["read_bytes_per_s"] / bw
                # Weights are read every step too: the fraction on cache + weight bytes.
                d["roofline_fraction_with_weights"] = (
                    (d["read_bytes"] + rec["param_bytes"]) / (d["step_ms"] / 1e3) / bw)
                rec["decode"].append(d)
        for n in s.prefill:
            modes = [None, True] if cfg.attention.ced_split else [None]
            for replay in modes:
                log(f"{name}: prefill {n} tokens{' (replay)' if replay else ''} ...")
                p = measures.time_prefill(model, n, replay=replay, chunk=s.chunk)
                p.update(tokens=n, replay=cfg.attention.window if replay else None)
                rec["prefill"].append(p)
        if s.train_seq:
            log(f"{name}: training at sequence {s.train_seq} ...")
            rec["train"] = measures.time_training(cfg, s.train_seq, s.train_batch,
                                                  s.train_steps)
        del model
    if s.peer == "hf":
        result["peer"] = run_peer(s, config_dir, log)
    result["targets"] = report.check_targets(result)
    result["wall_s"] = time.time() - t0
    return result


def run_peer(settings: Settings, config_dir, log=_quiet) -> dict:
    """The HF peer shaped like the v4 preset: decode steps (first batch size only) and
    teacher-forced forwards; {"name": "hf", "unavailable": why} without the peer extra."""
    from dsattn.bench import peer_hf

    s = settings
    why = peer_hf.available()
    if why:
        log(f"peer hf unavailable: {why}")
        return {"name": "hf", "unavailable": why}
    import torch

    torch.set_num_threads(s.peer_threads or os.cpu_count() or 1)
    cfg = measures.bench_config("v4", s.depth, *s.overrides, config_dir=config_dir)
    model, notes = peer_hf.build(cfg)
    rec = {"name": "hf", "preset": "v4", "notes": notes, "decode": [], "forward": []}
    for batch in s.batches[:1]:
        for ctx in s.peer_contexts:
            log(f"peer hf: decode batch {batch} context {ctx} ...")
            d = peer_hf.time_decode(model, ctx, batch, s.steps, s.warmup)
            rec["decode"].append({**d, "context": ctx, "batch": batch})
    for n in s.peer_forward:
        log(f"peer hf: forward {n} tokens ...")
        try:
            rec["forward"].append({"tokens": n, "seconds": peer_hf.time_forward(model, n)})
        except MemoryError as e:  # its dense masks are quadratic: refused, not run
            rec["forward"].append({"tokens": n, "seconds": None, "refused": str(e)})
    return rec
