"""Seeds trained as one vmapped model (dsattn.train.SeedGroup) against the same seeds trained
one after another: each seed's training tokens/s (the Trainer's own records: step time only,
no compile, validation or checkpoint time) and the wall time of the whole set, compile
included, for named rows of configs (a sweep's: dsattn.ablate's Sweep.seed_configs, with
SETTINGS among its overrides), in one run."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from dsattn import runlog
from dsattn.train import SeedGroup, Trainer

# A record every 10 steps (tokens/s is the median over records), validation only at the end.
SETTINGS = ("train.log_every=10", "train.eval_every=100000", "train.ckpt_every=100000")


def _rate(run_dir: Path) -> float:
    return float(np.median([r["tokens_per_s"] for r in runlog.records(run_dir)
                            if "tokens_per_s" in r]))


def measure(rows: dict[str, list], log=print) -> list[dict]:
    """One line per row of `rows` ({name: its configs, one per seed}): per-seed tokens/s and
    wall seconds, sequential vs vmapped."""
    out = []
    for name, cfgs in rows.items():
        seeds = len(cfgs)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            for i, cfg in enumerate(cfgs):
                Trainer(cfg, Path(tmp) / f"alone{i}", quiet=True).run()
            alone_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            SeedGroup([Trainer(cfg, Path(tmp) / f"group{i}", quiet=True)
                       for i, cfg in enumerate(cfgs)]).run()
            group_s = time.perf_counter() - t0
            alone = float(np.mean([_rate(Path(tmp) / f"alone{i}") for i in range(seeds)]))
            together = float(np.mean([_rate(Path(tmp) / f"group{i}") for i in range(seeds)]))
        out.append({"row": name, "seeds": seeds, "steps": cfgs[0].train.steps,
                    "tokens_per_step": cfgs[0].train.batch_size * cfgs[0].train.seq_len,
                    "alone_tokens_per_s": alone, "vmapped_tokens_per_s": together,
                    "alone_wall_s": alone_s, "vmapped_wall_s": group_s})
        log(table(out[-1:]).splitlines()[-1])
    return out


def table(rows: list[dict]) -> str:
    """Per row: each seed's tokens/s alone and vmapped; the seeds' throughput ratio (all
    seeds together vmapped over one at a time, which is one seed's rate) and the wall ratio
    of the whole set, compile included."""
    head = (f"{'row':<12} {'seeds':>5} {'steps':>5} {'tok/s alone':>11} {'tok/s vmapped':>13} "
            f"{'throughput x':>12} {'wall alone s':>12} {'wall vmapped s':>14} {'wall x':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['row']:<12} {r['seeds']:>5} {r['steps']:>5} {r['alone_tokens_per_s']:>11.0f} "
            f"{r['vmapped_tokens_per_s']:>13.0f} "
            f"{r['seeds'] * r['vmapped_tokens_per_s'] / r['alone_tokens_per_s']:>12.2f} "
            f"{r['alone_wall_s']:>12.1f} {r['vmapped_wall_s']:>14.1f} "
            f"{r['alone_wall_s'] / r['vmapped_wall_s']:>6.2f}")
    return "\n".join(lines)
