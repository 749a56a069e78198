"""Why compressed rows lose recall past the training length: controlled variants of the probes
that put earlier blocks before a one-block recall probe, on the trained runs of a sweep (by
default configs/ablations/length_controls.yaml's, which trains csa_m4 and hca_m8 on one-block
rows and on two-block rows).

    python scripts/length_controls.py runs/ablations/length_controls [--times 1,2,4]

For each run and each length (the probe block after times - 1 earlier blocks):
  facts   the earlier blocks as in the validation stream (other facts about the same keys)
  noise   the same rows with every earlier token replaced by noise tokens: the same
          positions and the same number of compressed entries, no competing facts
  topk    (CSA rows) facts, with the indexer's top-k scaled by `times`: a constant share of
          the entries, rather than a constant count, is read
Recall is split at the windows' reach (dsattn.ablate.reach): inside it the fact is in a
window; beyond it only compressed entries carry it. Rows: mean over seeds ± Student-t 95%
half-width. Writes length_controls.{json,txt} into the sweep directory.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsattn import cli  # noqa: E402

VARIANTS = ("facts", "noise", "topk")


def probes_at(cfg, times: int, distances, per_distance: int, probe_len: int):
    """(facts probes, noise probes) of `probe_len` tokens after (times - 1) earlier blocks."""
    import numpy as np

    from dsattn import data, recall

    spec = cfg.data.source.recall
    background = data.recall_streams(spec, cfg.data.val_fraction, cfg.data.max_bytes)[1]
    prefix = (times - 1) * probe_len
    facts = recall.probes(distances, per_distance, probe_len, spec, background, prefix=prefix)
    tokens = facts.tokens.copy()
    rng = np.random.default_rng([times, 7])
    tokens[:, :prefix] = rng.choice(recall.NOISE_ALPHABET, (len(tokens), prefix))
    return facts, dataclasses.replace(facts, tokens=tokens)


def with_top_k(model, top_k: int):
    """The same parameters under a config reading `top_k` entries."""
    from flax import nnx

    from dsattn.model import Transformer

    cfg = model.cfg
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, top_k=top_k))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def measure(sweep_dir: Path, times_list, distances, per_distance: int, log=print) -> list:
    from dsattn import checkpoint, plan
    from dsattn.ablate.reach import split, window_reach
    from dsattn.recall_eval import accuracy

    records = []
    for seed_dir in sorted((sweep_dir / "runs").glob("*/seed*")):
        model, cfg, step = checkpoint.load_params(seed_dir)
        row, seed = seed_dir.parent.name, seed_dir.name
        a, reach = cfg.attention, window_reach(cfg)
        csa = any(s.kind.scans_keys for s in plan.resolve(cfg))
        for times in times_list:
            facts, noise = probes_at(cfg, times, distances, per_distance, 64)
            runs = {"facts": (model, facts), "noise": (model, noise)}
            if csa and times > 1:
                runs["topk"] = (with_top_k(model, a.top_k * times), facts)
            for variant, (m, p) in runs.items():
                sides = split(accuracy(m, p), reach)
                inside, beyond = sides["within"], sides["beyond"]
                records.append({"row": row, "seed": seed, "step": step, "times": times,
                                "variant": variant, "inside": inside, "beyond": beyond,
                                "reach": reach})
                log(f"{row} {seed} x{times} {variant}: inside {inside:.3f}, "
                    f"beyond {beyond:.3f}")
    return records


def summarize(records) -> list[dict]:
    from dsattn import seedstats

    keys = sorted({(r["row"], r["variant"], r["times"]) for r in records})
    out = []
    for row, variant, times in keys:
        rs = [r for r in records if (r["row"], r["variant"], r["times"]) == (row, variant,
                                                                            times)]
        out.append({"row": row, "variant": variant, "times": times,
                    **{f"{k}_{s}": v for k in ("inside", "beyond")
                       for s, v in seedstats.summary([r[k] for r in rs]).items()}})
    return out


def table(summary) -> str:
    def cell(r, k):
        half = (r[f"{k}_hi"] - r[f"{k}_lo"]) / 2
        return f"{r[f'{k}_mean']:.2f} ± {half:.2f}"

    lines = ["| row | probe after | variant | recall inside reach | beyond reach |",
             "|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['row']} | {r['times'] - 1} blocks | {r['variant']} | "
                     f"{cell(r, 'inside')} | {cell(r, 'beyond')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = cli.parser(__doc__)
    ap.add_argument("sweep_dir", help="a finished sweep directory (its runs/<row>/seed<k>)")
    ap.add_argument("--times", type=cli.int_list, default=[1, 2, 4])
    ap.add_argument("--distances", type=cli.int_list, default=[2, 4, 8, 12, 16, 24, 32, 48, 62])
    ap.add_argument("--per-distance", type=int, default=64)
    args = cli.parse(ap, argv)
    sweep_dir = Path(args.sweep_dir)
    records = measure(sweep_dir, args.times, args.distances, args.per_distance)
    summary = summarize(records)
    (sweep_dir / "length_controls.json").write_text(
        json.dumps({"records": records, "summary": summary}, indent=1))
    text = table(summary)
    (sweep_dir / "length_controls.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    cli.run(main)
