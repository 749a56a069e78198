"""A run directory's metrics.jsonl, read and cut back in one place, and the atomic write
every file of a run or a sweep that is rewritten whole goes through.

metrics.jsonl holds one JSON record per line, appended as training goes; a kill can leave a
half line at the end, which readers skip and a resume drops.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

METRICS = "metrics.jsonl"


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file: a kill leaves the old file or the
    new one, never half of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _step(line: str) -> float:
    """A line's step; inf if it is not a record (a killed run's half line)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def records(run_dir) -> list[dict]:
    """The run's metrics records in order (none if it has no metrics.jsonl)."""
    path = Path(run_dir) / METRICS
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def cut(run_dir, step: int) -> None:
    """Drop the records past `step` (and any half line): a resumed run logs them again."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    keep = [line for line in lines if _step(line) <= step]
    if len(keep) < len(lines):
        atomic_write(path, "".join(line + "\n" for line in keep))
