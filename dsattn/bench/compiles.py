"""Counting the programs jax compiles while a block of code runs: jax reports each backend
compilation (a persistent-cache load included) as a monitoring event, in the thread that
compiles. The benchmarks and tests use it to check that a decode program compiles once."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_active = threading.local()  # .counters: the open `compilations()` blocks of this thread


@dataclass
class Count:
    n: int = 0


def _on_event_duration(event: str, duration: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
        for counter in getattr(_active, "counters", ()):
            counter.n += 1


jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


@contextlib.contextmanager
def compilations():
    """`with compilations() as c:` counts in `c.n` the programs this thread compiles inside
    the block (blocks may nest: each counts its own)."""
    counters = _active.__dict__.setdefault("counters", [])
    count = Count()
    counters.append(count)
    try:
        yield count
    finally:
        counters.remove(count)
