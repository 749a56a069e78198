"""A sweep as its runs see it: its rows (named override lists) and settings, each row's config
for a seed. dsattn.ablate.spec reads and validates a sweep file into a `Sweep`;
dsattn.ablate.full_size carries a row to the full-size preset."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dsattn import config as config_lib


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    overrides: tuple[str, ...]
    # A reference the other rows are read against (e.g. full attention, a window only): its
    # report row says so and pareto.png keeps it off the front.
    control: bool = False
    # --scale-schedule: the row's schedule scaled to the run's train.steps (spec._scaled),
    # applied after its own overrides
    schedule: tuple[str, ...] = ()
    # An earlier row: each seed's run starts from that row's run of the same seed
    # (scripts/train.py --init-from; dsattn.convert), its steps counted after the source's
    init: str | None = None


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    base: str
    full_size: str | None
    overrides: tuple[str, ...]
    rows: tuple[Row, ...]
    seeds: tuple[int, ...]
    distances: tuple[int, ...]
    per_distance: int
    probe_len: int
    decode_context: int
    out: Path
    # evaluated at these multiples too: loss at M x train.seq_len, recall at M x probe_len
    lengths: tuple[int, ...] = (2, 4)
    vmap_seeds: bool = True  # a row's seeds train as one vmapped model (train.SeedGroup)
    through_cache: bool = False  # also score recall through the decode cache (its formats)
    # --scale-schedule: the sweep file's train.steps the rows' schedules (Row.schedule) were
    # scaled from (0: none was)
    scaled_from_steps: int = 0

    def config(self, row: Row, seed: int):
        return config_lib.load(self.base, [*self.overrides, *row.overrides, *row.schedule,
                                           f"train.seed={seed}"])

    def seed_configs(self, names, seeds: int) -> dict[str, list]:
        """{row name: its configs for seeds 0..seeds-1} of the rows `names` (None: every row),
        in the sweep's order; ValueError naming the rows it does not have."""
        missing = set(names or ()) - {r.name for r in self.rows}
        if missing:
            raise ValueError(f"{self.name}: no rows {sorted(missing)}; rows: "
                             f"{[r.name for r in self.rows]}")
        return {r.name: [self.config(r, s) for s in range(seeds)] for r in self.rows
                if names is None or r.name in names}

