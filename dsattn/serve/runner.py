"""The scheduler's own thread: the only code that touches the scheduler and the device.

Clients (the HTTP handlers, any thread) `submit` a request with a callback and get a ticket;
the thread admits what arrived, runs steps while anything is queued or running (sleeping
otherwise), and calls each ticket's callback with its events, in order. A request is checked
(`Scheduler.check`) on the caller's thread, so a bad one fails there and never reaches the
batch. `metrics()` is a snapshot the thread refreshes after every step (the prefix cache's
counters included: `Scheduler.prefix_metrics`).

At most rows + `max_queue` requests are open at once (a fuller queue refuses with Busy,
so a client can retry elsewhere or later). If the thread dies (a bug), every open request
gets its last callback at once, `error` says why in one line, and `submit` refuses with
Down from then on: nothing waits on a thread that is gone.
"""

from __future__ import annotations

import collections
import itertools
import queue
import re
import sys
import threading
import time
import traceback
from functools import partial

from dsattn.serve.request import Event, Request
from dsattn.serve.scheduler import Scheduler

RATE_WINDOW_S = 10.0  # tokens/s over this much recent time


def _one_line(e: Exception) -> str:
    """The exception's type and first line, files named without their paths (what a client
    may be told)."""
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return re.sub(r"[^\s'\"()]*[/\\]([^\s'\"()/\\]*[A-Za-z_][^\s'\"()/\\]*)", r"\1",
                  text)[:300]


class Busy(Exception):
    """Rows and queue are full: the request was not taken."""


class Down(Exception):
    """The runner's thread has stopped: nothing would ever serve the request."""


class Runner:
    def __init__(self, scheduler: Scheduler, max_queue: int | None = None):
        self.scheduler = scheduler
        self.max_queue = max_queue  # requests waiting beyond the rows (None: no bound)
        self._lock = threading.Lock()  # submit vs the thread's death: none is left waiting
        self._open = 0  # requests submitted whose last event is not delivered yet
        self._inbox: queue.Queue = queue.Queue()
        self._tickets = itertools.count()
        self._by_rid: dict[int, tuple[int, object]] = {}  # rid -> (ticket, callback)
        self._rid_of: dict[int, int] = {}  # ticket -> rid
        self._recent: collections.deque = collections.deque()  # (time, tokens) per step
        self._stop = threading.Event()
        self.error: str | None = None  # one line, set when the thread stops
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
        runner's thread for each of its events, the last with `finish` set (or once with
        None if the thread dies). Returns a ticket for `cancel`. Busy if rows and queue are
        full, Down if the thread has stopped."""
        return self.submit_all([req], lambda i, ev: on_event(ev))[0]

    def submit_all(self, reqs: list, on_event) -> list[int]:
        """`submit` for several requests at once, all queued or none (Busy when the rows and
        queue lack room for all); `on_event(i, Event)` for request i's events."""
        for req in reqs:
            self.scheduler.check(req)
        with self._lock:
            if self.error is not None:
                raise Down(self.error)
            if (self.max_queue is not None
                    and self._open + len(reqs) > self.scheduler.rows + self.max_queue):
                raise Busy(f"{self._open} requests are open, the most it takes "
                           f"({self.scheduler.rows} rows and {self.max_queue} waiting)"
                           + (f", and these are {len(reqs)}" if len(reqs) > 1 else ""))
            self._open += len(reqs)
            tickets = [next(self._tickets) for _ in reqs]
            for i, (ticket, req) in enumerate(zip(tickets, reqs)):
                self._inbox.put(("submit", ticket, req, partial(on_event, i)))
        return tickets

    def cancel(self, ticket: int) -> None:
        self._inbox.put(("cancel", ticket))

    def metrics(self) -> dict:
        return dict(self._snapshot, open_requests=self._open, max_queue=self.max_queue)

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
        try:
            self._serve()
            why = "the server is shutting down"
        except Exception as e:  # a bug: fail every open request loudly, stop serving
            traceback.print_exc(file=sys.stderr)  # the operator's copy, with the paths
            why = f"the scheduler stopped: {_one_line(e)}"
        self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        """Refuse new requests; give every open one (running or still in the inbox) its
        last callback."""
        with self._lock:
            self.error = why
            self._open = 0
        waiting = [cb for _, cb in self._by_rid.values()]
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[0] == "submit":
                waiting.append(item[3])
        self._by_rid.clear()
        for on_event in waiting:
            on_event(None)

    def _serve(self) -> None:
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
            before = s.generated
            events = s.step()
            self._recent.append((time.monotonic(), s.generated - before))
            for ev in events:
                self._deliver(ev)
            self._snapshot = self._measure()

    def _deliver(self, ev: Event) -> None:
        ticket, on_event = self._by_rid[ev.request_id]
        if ev.finish is not None:
            del self._by_rid[ev.request_id]
            self._rid_of.pop(ticket, None)
            with self._lock:
                self._open -= 1
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
                "tokens_per_s": tokens / span if span > 0 else 0.0, **s.prefix_metrics()}
