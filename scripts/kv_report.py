"""KV-cache report: storage per token, local window, crossover and reads per decode step,
beside model FLOPs per token.

    python scripts/kv_report.py CONFIG_OR_RUN_DIR ... [--context 128K] [--out DIR] [--force]
        [KEY=VALUE ...]

Prints one row per config (the byte accounting of dsattn.kvbytes; docs/design.md, "Byte
accounting"): a YAML preset (row named by its config name) or a run directory (its
config.yaml; row named by the shortest tail of its path no other row shares, e.g.
csa_m2/seed0). A row may carry its own overrides and name:

    python scripts/kv_report.py configs/deepseek/v4_flash.yaml:attention.csa_ratio=2=csa2 \
        configs/deepseek/v4_flash.yaml=csa4     # V4-Flash at m=2 against its own m=4

Columns (N = --context; default 128K for presets, and with a run directory among the rows
the longest model.max_seq_len of the rows, a run's own context):
  B/token             global cache bytes one token adds, in the configured cache formats
  B/token BF16        the same with every native value stored in bf16
  vs                  the reference's B/token over the row's (the reference: the first row
                      named mha*, else the largest; not shown for a single row)
  local               the sliding-window cache of one sequence (V4 family; "-": none)
  crossover           the context at which the global cache (B/token x context) is as large
                      as the window's: below it the window holds most of the memory
  read/step@N         bytes one decode step reads with N tokens cached, of which
  KV                  the window and global entries read, and
  keys                the indexer's search keys read
  keys %              their share of the step's bytes
  train FLOP/tok@N    model FLOPs per token of a training step on N-token sequences
  decode FLOP/tok@N   model FLOPs of one decode step at N cached tokens
                      (both from dsattn.flops: matmuls only, MoE out of scope, the presets'
                      FFN as configured; in brackets their attention and indexer part)

With --out, writes into that folder (an existing non-empty one only with --force; nothing
is written without it):
  cache_size.png      global + local cache of one sequence vs context (1K..1M, log-log), with a
                      horizontal memory-budget line (--budget-gb, in GiB = 2^30 B; MHA with
                      V2's dimensions, configs/deepseek/mha_v2dims.yaml, needs 480 at 128K)
  reads_per_step.png  bytes one decode step reads vs context (solid: total, dotted: search keys)
  kv_report.json      the rows (every field of dsattn.kvbytes.report plus the ratio to MHA,
                      train_flops / decode_flops: dsattn.flops's breakdowns by term)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

try:
    import dsattn  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsattn import checkpoint, cli, flops, kvbytes
from dsattn.config import load as load_preset
from dsattn.errors import InputError

GIB = 2**30
PLOT_MIN, PLOT_MAX = 2**10, 2**20  # 1K .. 1M tokens


def parse_tokens(text: str) -> int:
    """'131072', '128K', '1M' (binary K/M, as the seed's 128K = 131,072) -> tokens."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"expected a token count like 131072, 128K or 1M, "
                                         f"got {text!r}")
    n = int(m.group(1))
    return n * {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()]


def _si(n) -> str:
    """Decimal SI bytes, as the seed writes them (515 GB, 68 MB)."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale < 100 else f"{n / scale:.0f} {unit}"
    return f"{n:g} B"


def _flop(n: float) -> str:
    """FLOPs with a decimal SI prefix: 9.15 M, 1.23 T."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def _attn_flops(f: dict) -> float:
    """The part of a FLOPs breakdown that reads grow: attention and the indexer."""
    return f["attention"] + f["indexer"]


def _bytes(x: float) -> str:
    return f"{x:,.2f}".rstrip("0").rstrip(".") if x != int(x) else f"{int(x):,}"


def parse_row(arg: str) -> tuple[str, list[str], str | None]:
    """PATH[:KEY=VALUE[:KEY=VALUE...]][=LABEL] -> (path, the row's overrides, its label).
    A label follows the last override's value after one more '=' (or the path's, with no
    override): configs/deepseek/v4_flash.yaml:attention.csa_ratio=2=csa2."""
    if Path(arg).exists():
        return arg, [], None
    path, _, rest = arg.partition(":")
    label = None
    if not rest:
        path, eq, label = arg.rpartition("=")
        return (path, [], label) if eq and Path(path).exists() else (arg, [], None)
    overrides = rest.split(":")
    key, eq, value = overrides[-1].partition("=")
    if eq and "=" in value:
        value, _, label = value.rpartition("=")
        overrides[-1] = f"{key}={value}"
    return path, overrides, label or None


def load(path, overrides=()):
    """A preset file, or a run directory's config.yaml."""
    path = Path(path)
    if path.is_dir():
        return checkpoint.load_run_config(path, overrides)
    return load_preset(path, overrides)


def label(path, cfg) -> str:
    """A run directory's rows carry the run's name; a preset's its config name."""
    return Path(path).resolve().name if Path(path).is_dir() else cfg.name


def labels(args, cfgs) -> list[str]:
    """Each row's name: its LABEL, else the config's (a preset's name, or a run directory's
    shortest path tail that no other run directory shares: runs/x/csa_m2/seed0, not seed0)
    with its own overrides appended; names still shared get #2, #3..."""
    parsed = [parse_row(a) for a in args]
    names = []
    for (path, ovs, given), cfg in zip(parsed, cfgs):
        if given:
            names.append(given)
            continue
        if Path(path).is_dir():
            parts = Path(path).resolve().parts
            others = [Path(p).resolve().parts for p, _, _ in parsed
                      if Path(p).is_dir() and Path(p).resolve().parts != parts]
            n = 1
            while n < len(parts) and any(o[-n:] == parts[-n:] for o in others):
                n += 1
            base = "/".join(parts[-n:])
        else:
            base = cfg.name
        names.append(base + "".join(f" {o}" for o in ovs))
    return [f"{n} #{names[:i + 1].count(n)}" if names.count(n) > 1 else n
            for i, n in enumerate(names)]


def load_rows(args, overrides=()):
    """(configs, names) of CONFIG_OR_RUN_DIR arguments, each with its own overrides after
    the shared ones."""
    cfgs = []
    for a in args:
        path, ovs, _ = parse_row(a)
        cfgs.append(load(path, [*overrides, *ovs]))
    return cfgs, labels(args, cfgs)


def default_context(paths, overrides=()) -> tuple[int, str]:
    """(--context's default, why when it is not 128K): with a run directory among the rows,
    the longest model.max_seq_len of their configs (a run is read at its own context; 128K
    was 16 times a tiny run's); presets alone, 128K, where the full-size designs compare."""
    if not any(Path(parse_row(a)[0]).is_dir() for a in paths):
        return 131072, ""
    cfgs, _ = load_rows(paths, overrides)
    runs = sum(Path(parse_row(a)[0]).is_dir() for a in paths)
    return (max(c.model.max_seq_len for c in cfgs),
            "the run's model.max_seq_len" if len(cfgs) == 1 else
            "the longest model.max_seq_len of the rows" + (" (the runs')" if runs == len(cfgs)
                                                          else ""))


def reference_row(rows: list[dict]) -> dict:
    """The first config named mha*, else the one with the largest storage per token."""
    for r in rows:
        if r["name"].lower().startswith("mha") or r["preset"].lower().startswith("mha"):
            return r
    return max(rows, key=lambda r: r["storage_bytes_per_token"])


def build_rows(paths, context: int, overrides=()) -> list[dict]:
    rows = []
    cfgs, names = load_rows(paths, overrides)
    for p, cfg, name in zip(paths, cfgs, names):
        row = kvbytes.report(cfg, context)
        row.update(name=name, preset=cfg.name, config=str(p),
                   train_flops=flops.train_breakdown(cfg, context),
                   decode_flops=flops.decode_breakdown(cfg, context))
        row["train_flops_per_token"] = row["train_flops"]["total"]
        row["decode_flops_per_token"] = row["decode_flops"]["total"]
        rows.append(row)
    if rows:
        ref = reference_row(rows)
        for r in rows:
            s = r["storage_bytes_per_token"]
            r["reference"] = ref["name"]
            r["ratio_to_reference"] = ref["storage_bytes_per_token"] / s if s else None
    return rows


def _ratio(r) -> str:
    """Reference bytes / row bytes as 1/N: two significant digits below 10 (224 vs 160 B is
    1/1.4, not 1), whole numbers above; a row storing more than the reference shows Nx."""
    if r is None:
        return "-"
    if abs(r - 1) < 0.005:
        return "1"
    if r < 1:
        return f"{1 / r:.2g}x"
    return f"1/{r:,.0f}" if r >= 10 else f"1/{r:.2g}"


def format_table(rows: list[dict]) -> str:
    ctx = rows[0]["context"] if rows else 0
    compared = len(rows) > 1  # one row's reference is itself: no column
    head = ("config", "B/token", "B/token BF16",
            *(["vs " + (rows[0]["reference"] if rows else "ref")] if compared else []),
            "local", "crossover", f"read/step@{ctx:,}", "KV", "keys", "keys %",
            f"train FLOP/tok@{ctx:,} (attn)", f"decode FLOP/tok@{ctx:,} (attn)")
    body = []
    for r in rows:
        ratio = r["ratio_to_reference"]
        cross = r["crossover_context"]
        body.append((
            r["name"],
            _bytes(r["storage_bytes_per_token"]),
            _bytes(r["storage_bf16_bytes_per_token"]),
            *([_ratio(ratio)] if compared else []),
            _si(r["local_bytes"]) if r["local_bytes"] else "-",
            f"{cross:,.0f} tok" if cross is not None else "-",
            _si(r["read_bytes"]),
            _si(r["read_kv_bytes"]),
            _si(r["read_key_bytes"]) if r["read_key_bytes"] else "-",
            f"{100 * r['read_key_share']:.1f}",
            f"{_flop(r['train_flops_per_token'])} ({_flop(_attn_flops(r['train_flops']))})",
            f"{_flop(r['decode_flops_per_token'])} ({_flop(_attn_flops(r['decode_flops']))})",
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def _contexts(points_per_octave: int = 4) -> list[int]:
    out, n = [], PLOT_MIN
    while n <= PLOT_MAX:
        out.append(int(round(n)))
        n *= 2 ** (1 / points_per_octave)
    if out[-1] != PLOT_MAX:
        out.append(PLOT_MAX)
    return sorted(set(out))


MARKERS = "osD^v<>ph*"


def line_style(j: int) -> dict:
    """Equal curves (V2 and V3 store the same bytes) must stay visible: alternate the line
    style and give each config its own marker shape at staggered points."""
    return dict(ls=("-", "-.")[j % 2], marker=MARKERS[j % len(MARKERS)],
                markevery=(j % 4, 4), markersize=5)


def write_plots(paths, out: Path, budget_gb: float, overrides=()) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs, names = load_rows(paths, overrides)
    xs = _contexts()
    files = []

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for j, cfg in enumerate(cfgs):
        ys = [(kvbytes.global_bytes(cfg, n) + kvbytes.local_bytes(cfg, context=n)) / GIB
              for n in xs]
        per_token = _bytes(kvbytes.storage_per_token(cfg))
        ax.plot(xs, ys, label=f"{names[j]} ({per_token} B/token)", **line_style(j))
    ax.axhline(budget_gb, color="k", ls="--", lw=1)
    ax.text(xs[0], budget_gb * 1.15, f"memory budget {budget_gb:g} GiB", fontsize=9)
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
           ylabel="KV cache of one sequence (GiB): global + local",
           title="KV cache size vs context (deployed cache formats)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "cache_size.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for j, cfg in enumerate(cfgs):
        reps = [kvbytes.report(cfg, n) for n in xs]
        (line,) = ax.plot(xs, [r["read_bytes"] for r in reps], label=f"{names[j]} total",
                          **line_style(j))
        keys = [r["read_key_bytes"] for r in reps]
        if any(keys):
            ax.plot(xs, keys, ls=":", color=line.get_color(),
                    label=f"{names[j]} search keys")
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
           ylabel="bytes read per decode step (all layers)",
           title="Reads per generated token (deployed cache formats)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    files.append(out / "reads_per_step.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
    return files


def main(argv=None) -> int:
    ap = cli.parser(__doc__, overrides=True)
    ap.add_argument("configs", nargs="+", metavar="CONFIG_OR_RUN_DIR",
                    help="YAML presets (e.g. configs/deepseek/*.yaml) or run directories, "
                         "each optionally PATH:KEY=VALUE[:KEY=VALUE...][=LABEL]: overrides "
                         "of that row alone and its name, e.g. "
                         "configs/deepseek/v4_flash.yaml:attention.csa_ratio=2=csa2")
    ap.add_argument("--context", type=parse_tokens, default=None,
                    help="tokens already cached for the read columns (default 131072 = 128K; "
                         "with a run directory among the rows, the rows' longest "
                         "model.max_seq_len)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the PNGs and JSON (default: none, nothing written)")
    ap.add_argument("--budget-gb", type=float, default=80.0,
                    help="memory budget line in the cache-size plot, GiB (default 80)")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="config override applied to every config, e.g. attention.top_k=1024 "
                         "(a bare KEY=VALUE does the same)")
    ap.add_argument("--no-plots", action="store_true", help="print and write JSON only")
    ap.add_argument("--force", action="store_true",
                    help="overwrite the files of an existing --out folder")
    args = cli.parse(ap, argv)
    overrides = args.override + args.overrides

    if args.out and args.out.is_dir() and any(args.out.iterdir()) and not args.force:
        raise InputError(f"--out {args.out} already holds files (an earlier report?): pass "
                         f"--force to overwrite them, or another --out")
    context, why = ((args.context, "") if args.context
                    else default_context(args.configs, overrides))
    rows = build_rows(args.configs, context, overrides)
    if why:
        print(f"context {context:,} tokens: {why} (--context N for another)")
    print(format_table(rows))
    if args.out is None:  # a shared default folder made each call overwrite the last's
        print(f"(--out DIR also writes kv_report.json{'' if args.no_plots else ' and plots'})")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kv_report.json").write_text(json.dumps(rows, indent=1))
    written = [args.out / "kv_report.json"]
    if not args.no_plots:
        written += write_plots(args.configs, args.out, args.budget_gb, overrides)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    cli.run(main)
