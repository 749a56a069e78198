"""The benchmark's report: its targets (listed in docs/scripts.md) checked against a
result of ``suite.run``, the printed tables, the JSON file and the plots (decode.png,
prefill.png, roofline.png).

Everything here reads the result dict only, so a saved ``bench.json`` can be re-reported.
"""

from __future__ import annotations

import json
import os


def save_json(result: dict, out_dir) -> str:
    """Write ``out_dir/bench.json``; return its path."""
    path = os.path.join(os.fspath(out_dir), "bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def _decode(result, name, ctx, batch=1):
    for d in result["presets"].get(name, {}).get("decode", []):
        if d["context"] == ctx and d["batch"] == batch:
            return d["step_ms"]
    return None


def _prefill(result, name, n, replay: bool):
    for p in result["presets"].get(name, {}).get("prefill", []):
        if p["tokens"] == n and bool(p["replay"]) == replay:
            return p
    return None


def check_targets(result) -> list[dict]:
    """The benchmark's targets, each met / missed / not measured, with its numbers."""
    out = []

    def add(what, value, limit, ok):
        out.append({"target": what, "value": value, "limit": limit,
                    "met": None if value is None else bool(ok)})

    for name in ("v4", "v41"):
        a, b = _decode(result, name, 1024), _decode(result, name, 16384)
        r = b / a if a and b else None
        add(f"{name} decode 16K / 1K (batch 1)", r, "<= 1.5", r is not None and r <= 1.5)
    peer = result.get("peer") or {}
    hf16 = next((d["step_ms"] for d in peer.get("decode", []) if d["context"] == 16384
                 and d["batch"] == 1), None)
    v4_16 = _decode(result, "v4", 16384)
    r = hf16 / v4_16 if hf16 and v4_16 else None
    add("HF peer / v4 decode at 16K (batch 1)", r, ">= 10", r is not None and r >= 10)
    a, b = _decode(result, "v41", 32768), _decode(result, "mha", 32768)
    r = a / b if a and b else None
    add("v41 / mha decode at 32K (batch 1)", r, "<= 0.1", r is not None and r <= 0.1)
    p = _prefill(result, "v41", 16384, False)
    peak = p["peak_rss_bytes"] / 1e9 if p and p["peak_rss_bytes"] is not None else None
    add("v41 16K prefill peak memory (GB)", peak, "<= 4", peak is not None and peak <= 4)
    e, rp = _prefill(result, "v41", 8192, False), _prefill(result, "v41", 8192, True)
    r = rp["seconds"] / e["seconds"] if e and rp else None
    add("v41 replay / exact prefill at 8K", r, "<= 0.6", r is not None and r <= 0.6)
    for name, rec in result["presets"].items():
        d64 = [d for d in rec["decode"] if d["context"] == 65536]
        for d in d64:
            f = d["roofline_fraction"]
            add(f"{name} decode at 64K batch {d['batch']}: fraction of copy bandwidth", f,
                ">= 0.5", f >= 0.5)
    return out


def fmt_table(result) -> str:
    """The result as plain-text tables (decode, bytes, prefill, training, peer, targets)."""
    lines = []
    bw = result["copy_bandwidth_bytes_per_s"]
    lines.append(f"backend {result['machine']['backend']}, {result['machine']['cpu_count']} "
                 f"CPUs; numpy copy bandwidth {bw / 1e9:.1f} GB/s (read + write)")
    ctxs = sorted({d["context"] for r in result["presets"].values() for d in r["decode"]})
    batches = sorted({d["batch"] for r in result["presets"].values() for d in r["decode"]})
    peer = result.get("peer") or {}
    for batch in batches:
        lines.append(f"\ndecode step, batch {batch}: ms (fraction of copy bandwidth on "
                     f"kvbytes' bytes)")
        lines.append(f"{'preset':8}" + "".join(f"{c:>18}" for c in ctxs))
        for name, rec in result["presets"].items():
            row = {d["context"]: d for d in rec["decode"] if d["batch"] == batch}
            lines.append(f"{name:8}" + "".join(
                f"{row[c]['step_ms']:10.2f} ({row[c]['roofline_fraction']:.2f})" if c in row
                else f"{'':>18}" for c in ctxs))
        prow = {d["context"]: d for d in peer.get("decode", []) if d["batch"] == batch}
        if prow:
            lines.append(f"{'hf peer':8}" + "".join(
                f"{prow[c]['step_ms']:10.2f}{'':8}" if c in prow else f"{'':>18}"
                for c in ctxs))
            v4 = {d["context"]: d for d in result["presets"].get("v4", {}).get("decode", [])
                  if d["batch"] == batch}
            lines.append(f"{'v4/peer':8}" + "".join(
                f"{v4[c]['step_ms'] / prow[c]['step_ms']:10.3f}{'':8}"
                if c in prow and c in v4 else f"{'':>18}" for c in ctxs))
    lines.append("\ndecode bytes per step (kvbytes, batch 1) and compile")
    lines.append(f"{'preset':8}{'layers':>7}{'params MB':>10}" + "".join(f"{c:>12}" for c in ctxs)
                 + f"{'compile s':>11}{'programs':>9}")
    for name, rec in result["presets"].items():
        row = {d["context"]: d for d in rec["decode"] if d["batch"] == 1}
        first = rec["decode"][0] if rec["decode"] else None
        lines.append(f"{name:8}{rec['n_layers']:>7}{rec['param_bytes'] / 1e6:>10.2f}" + "".join(
            f"{row[c]['read_bytes'] / 1e6:>10.2f}MB" if c in row else f"{'':>12}"
            for c in ctxs) + (f"{first['compile_s']:>11.2f}{first['compilations']:>9}"
                              if first else ""))
    lines.append("\nprefill (batch 1): seconds, peak RSS above the empty cache")
    lines.append(f"{'preset':8}{'tokens':>8}{'exact s':>10}{'peak MB':>10}{'replay s':>10}"
                 f"{'peak MB':>10}{'replay/exact':>13}")
    for name, rec in result["presets"].items():
        for n in sorted({p["tokens"] for p in rec["prefill"]}):
            e, r = _prefill(result, name, n, False), _prefill(result, name, n, True)
            mb = lambda p: f"{p['peak_rss_bytes'] / 1e6:>10.0f}" if p and p[
                "peak_rss_bytes"] is not None else f"{'':>10}"
            lines.append(f"{name:8}{n:>8}{e['seconds']:>10.2f}{mb(e)}" + (
                f"{r['seconds']:>10.2f}{mb(r)}{r['seconds'] / e['seconds']:>13.2f}" if r else ""))
    for f in peer.get("forward", []):
        secs = f"{f['seconds']:>10.2f}" if f["seconds"] is not None else f"{'refused':>10}"
        lines.append(f"{'hf peer':8}{f['tokens']:>8}{secs}  (teacher-forced forward"
                     f"{', ' + f['refused'] if f.get('refused') else ''})")
    trains = [(n, r["train"]) for n, r in result["presets"].items() if r["train"]]
    if trains:
        lines.append(f"\ntraining at sequence {result['args']['train_seq']}, batch "
                     f"{result['args']['train_batch']}: tokens/s, model TFLOP/s (dsattn.flops), "
                     f"MFU where the device's peak is known")
        for n, t in trains:
            tflops = t.get("model_tflops_per_s")  # absent from results saved before it
            lines.append(f"{n:8}{t['tokens_per_s']:>10.0f}"
                         + (f"{tflops:>10.4g}" if tflops is not None else "")
                         + (f"{100 * t['mfu']:>8.2f}%" if t.get("mfu") is not None else ""))
    if peer.get("notes"):
        lines.append("\nHF peer (transformers DeepseekV4, PyTorch CPU): what is not matched")
        lines += [f"  - {n}" for n in peer["notes"]]
    elif peer.get("unavailable"):
        lines.append(f"\nHF peer unavailable: {peer['unavailable']}")
    lines.append("\ntargets")
    for t in result["targets"]:
        v = "not measured" if t["value"] is None else f"{t['value']:.3g}"
        status = {None: "-", True: "met", False: "MISSED"}[t["met"]]
        lines.append(f"  {t['target']:58} {v:>12} {t['limit']:>7}  {status}")
    return "\n".join(lines)


def plot(result, out_dir) -> list[str]:
    """Draw decode.png, prefill.png and roofline.png into out_dir; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    peer = result.get("peer") or {}
    fig, ax = plt.subplots(figsize=(7, 5))
    for i, (name, rec) in enumerate(result["presets"].items()):  # one colour per preset
        for batch, style in ((1, "-"), (8, "--")):
            pts = sorted((d["context"], d["step_ms"]) for d in rec["decode"]
                         if d["batch"] == batch)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{name} b{batch}")
    pts = sorted((d["context"], d["step_ms"]) for d in peer.get("decode", []))
    if pts:
        ax.plot(*zip(*pts), ":", marker="s", color="k", label="HF V4 peer b1")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode step (ms)",
           title="Decode step time against context")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out_dir, "decode.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, (name, rec) in enumerate(result["presets"].items()):
        for replay, style in ((False, "-"), (True, "--")):
            pts = sorted((p["tokens"], p["seconds"], p["peak_rss_bytes"] or 0)
                         for p in rec["prefill"] if bool(p["replay"]) == replay)
            if pts:
                lab = f"{name}{' replay' if replay else ''}"
                a1.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                        color=f"C{i}", label=lab)
                a2.plot([p[0] for p in pts], [p[2] / 1e6 for p in pts], style, marker="o",
                        color=f"C{i}", label=lab)
    a1.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="seconds",
           title="Prefill time (exact vs bounded replay)")
    a2.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="peak RSS (MB)",
           title="Prefill peak memory")
    a1.legend(fontsize=7)
    paths.append(_save(fig, out_dir, "prefill.png"))

    fig, ax = plt.subplots(figsize=(7, 5))
    for i, (name, rec) in enumerate(result["presets"].items()):
        for batch, style in ((1, "-"), (8, "--")):
            pts = sorted((d["context"], d["roofline_fraction"]) for d in rec["decode"]
                         if d["batch"] == batch)
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{name} b{batch}")
    ax.axhline(0.5, color="gray", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)",
           ylabel="cache bytes read / step time / copy bandwidth",
           title="Roofline: fraction of measured copy bandwidth")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, out_dir, "roofline.png"))
    return paths


def _save(fig, out_dir, name):
    path = os.path.join(os.fspath(out_dir), name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
