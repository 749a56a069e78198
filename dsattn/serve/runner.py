"""The scheduler's own thread: the only code that touches the scheduler and the device.

Clients (the HTTP handlers, any thread) `submit` a request with a callback and get a ticket;
the thread admits what arrived, runs steps while anything is queued or running (sleeping
otherwise), and calls each ticket's callback with its events, in order. A request is checked
(`Scheduler.check`) on the caller's thread, so a bad one fails there and never reaches the
batch. `metrics()` is a snapshot the thread refreshes after every step.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
import traceback

from dsattn.serve.request import Event, Request
from dsattn.serve.scheduler import Scheduler

RATE_WINDOW_S = 10.0  # tokens/s over this much recent time


class Runner:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._inbox: queue.Queue = queue.Queue()
        self._tickets = itertools.count()
        self._by_rid: dict[int, tuple[int, object]] = {}  # rid -> (ticket, callback)
        self._rid_of: dict[int, int] = {}  # ticket -> rid
        self._recent: collections.deque = collections.deque()  # (time, tokens) per step
        self._stop = threading.Event()
        self.error: str | None = None  # set if a step raised: the runner stops
        self._snapshot = self._measure()
        self._thread = threading.Thread(target=self._loop, name="dsattn-serve", daemon=True)

    def start(self) -> "Runner":
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- clients (any thread) ------------------------------------------------------------
    def submit(self, req: Request, on_event) -> int:
        """Check `req` (InputError if bad) and queue it; `on_event(Event)` is called from the
        runner's thread for each of its events, the last with `finish` set. Returns a
        ticket for `cancel`."""
        self.scheduler.check(req)
        ticket = next(self._tickets)
        self._inbox.put(("submit", ticket, req, on_event))
        return ticket

    def cancel(self, ticket: int) -> None:
        self._inbox.put(("cancel", ticket))

    def metrics(self) -> dict:
        return dict(self._snapshot)

    # -- the thread ----------------------------------------------------------------------
    def _take(self, item) -> None:
        if item is None:
            return
        if item[0] == "submit":
            _, ticket, req, on_event = item
            rid = self.scheduler.submit(req)
            self._by_rid[rid] = (ticket, on_event)
            self._rid_of[ticket] = rid
        elif item[1] in self._rid_of:
            self.scheduler.cancel(self._rid_of[item[1]])

    def _loop(self) -> None:
        s = self.scheduler
        while not self._stop.is_set():
            try:  # block only when there is nothing to run
                self._take(self._inbox.get(timeout=0.5) if s.idle else self._inbox.get_nowait())
                while True:
                    self._take(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if s.idle:
                self._snapshot = self._measure()
                continue
            try:
                before = s.generated
                events = s.step()
            except Exception:  # a bug: fail every open request loudly, stop serving
                self.error = traceback.format_exc()
                for ticket, on_event in self._by_rid.values():
                    on_event(None)
                return
            self._recent.append((time.monotonic(), s.generated - before))
            for ev in events:
                self._deliver(ev)
            self._snapshot = self._measure()

    def _deliver(self, ev: Event) -> None:
        ticket, on_event = self._by_rid[ev.request_id]
        if ev.finish is not None:
            del self._by_rid[ev.request_id]
            self._rid_of.pop(ticket, None)
        on_event(ev)

    def _measure(self) -> dict:
        s, now = self.scheduler, time.monotonic()
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()
        span = now - self._recent[0][0] if self._recent else 0.0
        tokens = sum(n for _, n in self._recent)
        return {"queued": s.queued, "active_rows": s.active, "rows": s.rows,
                "pages_free": s.pages_free(), "pages_total": s.pages_total,
                "generated_tokens": s.generated, "preemptions": s.preemptions,
                "tokens_per_s": tokens / span if span > 0 else 0.0}
