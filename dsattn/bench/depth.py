"""Compile cost and step time against depth: every family's layer pattern at several depths
(MHA, MLA and DSA stacks of one kind; the V4 and V4.1 patterns), with the repeated groups
scanned (`model.scan_layers=true`) and unrolled, timing each program's first call (trace +
compile + one run) and its steady step: the teacher-forced forward, a prefill chunk and a
decode step, the decode step again with 16K tokens cached. Tiny widths (the presets'),
float32."""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from dsattn import config as config_lib
from dsattn import generate, scan
from dsattn.bench.measures import time_decode
from dsattn.model import Transformer

V4_DEPTHS = (6, 12, 24, 43)
V41_DEPTHS = (10, 20, 40)
UNIFORM_DEPTHS = (4, 12, 24)


def uniform_pattern(depth: int) -> list[str]:
    """A stack of one layer kind (the preset's own: mha, mla, dsa) at `depth` layers."""
    return [f"model.n_layers={depth}"]


def v4_pattern(depth: int) -> list[str]:
    """V4-Flash's pattern at `depth` layers: two SWA layers, then CSA/HCA alternating."""
    pairs, odd = divmod(depth - 2, 2)
    return [f"model.n_layers={depth}",
            f"attention.layers=swa*2, (csa, hca)*{pairs}" + (", csa" if odd else "")]


def v41_pattern(depth: int) -> list[str]:
    """V4.1-Flash's pattern at `depth` layers (even; at 40 exactly V4.1-Flash's), split in
    the middle (CED): encoder = two SWA layers, then a full layer every 6th (m=2) and reuse
    layers between; decoder = a full layer, then a reindex layer every 4th (m=1) and reuse
    layers between."""
    half = depth // 2
    enc = ["full" if k % 6 == 0 else "reuse" for k in range(half - 2)]
    dec = ["full"] + ["reindex" if k % 4 == 0 else "reuse" for k in range(1, half)]
    return [f"model.n_layers={2 * half}", f"attention.layers={', '.join(['swa'] * 2 + enc + dec)}",
            f"attention.ratios=0*2, 2*{half - 2}, 1*{half}", f"attention.ced_split={half}"]


PATTERNS = {"mha": (uniform_pattern, UNIFORM_DEPTHS), "mla": (uniform_pattern, UNIFORM_DEPTHS),
            "dsa": (uniform_pattern, UNIFORM_DEPTHS), "v4": (v4_pattern, V4_DEPTHS),
            "v41": (v41_pattern, V41_DEPTHS)}


def _first_and_step(fn, *args) -> tuple[float, float]:
    """(first call seconds, median of three later calls in seconds)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return first, float(np.median(times))


LONG_CONTEXT = 16384  # where a decode step's cache traffic, not its layer count, dominates


def measure(cfg, prompt: int = 64, context: int = 64, long_context: int = LONG_CONTEXT) -> dict:
    """First-call and steady times of forward [1, prompt], prefill of `prompt` tokens and a
    decode step with `context` tokens cached; the decode step again at `long_context`."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    tokens = np.zeros((1, prompt), np.int32)
    fwd_first, fwd_step = _first_and_step(forward, state, tokens)
    eng = generate.Engine(model)
    t0 = time.perf_counter()
    logits, _ = eng.prefill(tokens, [prompt], eng.init_cache(1, prompt + context + 16))
    logits.block_until_ready()
    prefill_first = time.perf_counter() - t0
    dec = time_decode(model, context, batch=1, steps=10, warmup=2)
    return {"forward_first_s": fwd_first, "forward_ms": fwd_step * 1e3,
            "prefill_first_s": prefill_first, "decode_first_s": dec["first_call_s"],
            "decode_ms": dec["step_ms"],
            "decode_long_ms": time_decode(model, long_context, batch=1, steps=10,
                                          warmup=2)["step_ms"],
            "scanned_units": sum(u.scanned for u in scan.units(cfg)),
            "traced_layers": sum(u.traced for u in scan.units(cfg))}


def run(configs_dir, patterns=tuple(PATTERNS), log=print) -> list[dict]:
    """One row per (pattern, depth, scanned or not)."""
    rows = []
    for name in patterns:
        if name not in PATTERNS:
            raise ValueError(f"depth sweep: no pattern {name!r}; known: {', '.join(PATTERNS)}")
        make, depths = PATTERNS[name]
        for depth in depths:
            for scanned in (True, False):
                cfg = config_lib.load(f"{configs_dir}/{name}.yaml", [
                    *make(depth), "model.dtype=float32",
                    f"model.scan_layers={str(scanned).lower()}"])
                row = {"pattern": name, "depth": depth, "scanned": scanned, **measure(cfg)}
                log(f"{name} depth {depth} {'scanned' if scanned else 'unrolled'}: "
                    f"decode first {row['decode_first_s']:.1f} s, step {row['decode_ms']:.2f} ms"
                    f" ({row['decode_long_ms']:.2f} ms at {LONG_CONTEXT} cached)")
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """One line per row; a scanned row's last column is its long-context decode step over the
    unrolled one's (same pattern and depth)."""
    unrolled = {(r["pattern"], r["depth"]): r["decode_long_ms"] for r in rows if not r["scanned"]}
    head = (f"{'pattern':<8}{'depth':>6}{'layout':>10}{'traced':>8}{'fwd 1st s':>11}"
            f"{'prefill 1st s':>15}{'decode 1st s':>14}{'decode ms':>11}"
            f"{f'@{LONG_CONTEXT // 1024}K ms':>10}{'scan/unroll':>13}")
    lines = [head, "-" * len(head)]
    for r in rows:
        base = unrolled.get((r["pattern"], r["depth"])) if r["scanned"] else None
        ratio = f"{r['decode_long_ms'] / base:>13.2f}" if base else f"{'':>13}"
        lines.append(f"{r['pattern']:<8}{r['depth']:>6}{'scanned' if r['scanned'] else 'unrolled':>10}"
                     f"{r['traced_layers']:>8}{r['forward_first_s']:>11.2f}"
                     f"{r['prefill_first_s']:>15.2f}{r['decode_first_s']:>14.2f}"
                     f"{r['decode_ms']:>11.2f}{r['decode_long_ms']:>10.2f}{ratio}")
    return "\n".join(lines)
