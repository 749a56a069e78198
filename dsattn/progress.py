"""Progress of a long loop (training steps, eval batches, a sweep's runs): tqdm's bar on a
terminal; elsewhere one plain line every N units.

A bar redraws its line with carriage returns: in a log file, CI or a pipe that piles up as
one endless line. Off a terminal (the stream is not a tty) a loop prints instead a line every
`every` units (default: a tenth of the loop, at most 50 units apart) and at its end, with
the loop's own figures, the time elapsed and an ETA from the pace so far:

    train v41: step 60/600 (10%) loss 3.412 val - tok/s 1,234 TFLOP/s 0.0173; 1m12s elapsed,
    ETA 10m48s

(training adds MFU after TFLOP/s where the device's peak is known: dsattn.flops).
"""

from __future__ import annotations

import math
import sys
import time

from tqdm import tqdm

MAX_EVERY = 50  # the default line interval's cap, in units


def default_every(n: int) -> int:
    """A line per tenth of `n` units, at most MAX_EVERY apart."""
    return max(1, min(MAX_EVERY, math.ceil(n / 10)))


def duration(seconds: float) -> str:
    """45s, 12m05s, 3h04m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def say(text: str, stream=None) -> None:
    """A line of its own on `stream` (default sys.stderr), above any bar drawn there (what a
    loop does before its own bar starts, e.g. a compile)."""
    tqdm.write(text, file=stream or sys.stderr)


class Progress:
    """`total` units from `initial`; `update(n, fields=...)` after each. `quiet`: nothing at
    all. The stream defaults to sys.stderr as it is when the Progress is made."""

    def __init__(self, total: int, *, initial: int = 0, desc: str = "", unit: str = "step",
                 every: int | None = None, quiet: bool = False, stream=None):
        self.total, self.n, self.start = total, initial, initial
        self.desc, self.unit = desc, unit
        self.every = every or default_every(total)  # the same steps after a resume
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()
        tty = getattr(self.stream, "isatty", lambda: False)()
        self.bar = None if quiet or not tty else tqdm(
            total=total, initial=initial, desc=desc, unit=unit, file=self.stream,
            dynamic_ncols=True)
        self.plain = not quiet and not tty

    def update(self, n: int = 1, fields: dict | None = None) -> None:
        """`n` more units done; `fields` ({name: text}): the loop's figures to show."""
        self.n += n
        if self.bar is not None:
            if fields:
                self.bar.set_postfix(fields, refresh=False)
            self.bar.update(n)
        elif self.plain and (self.n % self.every == 0 or self.n >= self.total):
            print(self.line(fields or {}), file=self.stream, flush=True)

    def write(self, text: str) -> None:
        """A line of its own: above the bar on a terminal, among the plain lines elsewhere;
        nothing when quiet."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        elif self.plain:
            print(text, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """What the bar is at (e.g. the sweep's run in progress); not part of plain lines."""
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def line(self, fields: dict) -> str:
        elapsed = time.monotonic() - self.t0
        done = self.n - self.start
        eta = elapsed / done * (self.total - self.n) if done else math.nan
        return (f"{self.desc}: {self.unit} {self.n}/{self.total} "
                f"({100 * self.n / max(self.total, 1):.0f}%)"
                + "".join(f" {k} {v}" for k, v in fields.items())
                + f"; {duration(elapsed)} elapsed, ETA "
                + (duration(eta) if math.isfinite(eta) else "-"))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
