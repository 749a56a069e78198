"""Continuous batching over one decode state of `rows` fixed rows.

Each `step()` the host decides and the device computes:

1. admit queued requests (first come, first served) into free rows while the page pools
   hold what every active row's context needs plus the newcomer's prompt (pool.py), and
   clear the rows they get (whatever a free row holds never reaches its next owner);
2. plan every row's tokens for this step: a decoding row 1 (its last sampled token), a
   prefilling row a chunk of its context, the chunks sharing what a per-step token budget
   leaves after the decoding rows (oldest first), so a long prompt does not stall the rest;
   the widest chunk sets the step's width, and every other prefilling row takes up to that
   width too (the chunk program computes every prefilling row at that width whatever it
   takes);
   if the pools cannot hold the step's pages, preempt the youngest row (its pages released,
   the request requeued first with its output so far, which is recomputed as prompt later);
3. run the step (generate.prefill_program): the rows taking one token over the whole batch
   at width 1, the prefilling rows as a sub-batch of their own (a power of two of rows taken
   out of the decode state, extended and put back in one program: programs.extend_rows) at
   the bucketed width of the longest chunk, so a chunk's width is paid by the rows that
   prefill, not by every row (one [rows, width] program when the sub-batch would be the
   whole batch, or on a mesh); then sample every row with its own temperature, top-p and
   key on the device (programs.sample_rows);
4. record each sampling row's token, retire the rows that hit their eos token, a stop
   sequence or max_new_tokens, and clear them at once (programs.clear_rows: pages released,
   window ring and compressor state reset), ready for the next request.

Every shape inside the programs is static (rows, bucketed widths); only the host's lists
change. A request that could never fit (its prompt and max_new_tokens past max_len, or past
what a whole pool holds) is refused by `check`/`submit` with an InputError.

A request's tokens equal its solo Engine.generate output (tests/test_serve_isolation.py):
rows never read one another, a released page is read only below its new owner's length,
and its sampling key depends on its seed and step alone.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import time

import jax
import numpy as np

from dsattn import generate
from dsattn.errors import InputError
from dsattn.serve import prefix, programs
from dsattn.serve.pool import PageLedger, pool_layers, with_pool
from dsattn.serve.request import Event, Finish, Request
from dsattn.serve.snapshots import Snapshots


SEEN = 1 << 16  # prefixes whose requests are counted (the least recently seen forgotten)


def default_prefix_nodes(rows: int) -> int:
    """Snapshot slots of a scheduler of `rows` rows when not given: room for the prefixes a
    few requests per row publish."""
    return max(8, 4 * rows)


@dataclasses.dataclass
class _Job:
    """A submitted request and its output so far (kept across preemption)."""

    rid: int
    req: Request
    output: list[int] = dataclasses.field(default_factory=list)
    digests: list[bytes] = dataclasses.field(default_factory=list)  # its prompt's blocks
    points: list[int] = dataclasses.field(default_factory=list)  # where it may publish
    cached: int | None = None  # prompt tokens reused at its first start (None: not started)
    reported: bool = False  # its first event went out (it carries `cached`)

    @property
    def context_len(self) -> int:
        """Tokens its row's cache must hold before its next token is drawn: its prompt and
        its output so far (counted, not built: asked for every row every step)."""
        return len(self.req.prompt) + len(self.output)

    def context_span(self, start: int, stop: int) -> list[int]:
        """Tokens start:stop of that context (prompt then output), without building it."""
        n = len(self.req.prompt)
        return (list(self.req.prompt[start:stop])
                + self.output[max(start - n, 0): max(stop - n, 0)])


@dataclasses.dataclass
class _Row:
    job: _Job
    seq: int  # admission order: the youngest row is preempted first
    written: int = 0  # positions of its context in the cache
    started: bool = False  # restored or begun from nothing (else waiting for a prefix)
    node: prefix.Node | None = None  # the prefix it restored (pinned while it runs)
    awaiting: prefix.Node | None = None  # the PENDING prefix it waits for (pinned)
    pending: dict = dataclasses.field(default_factory=dict)  # end -> its node to publish


class Scheduler:
    """Serve requests over `rows` rows of `max_len` positions of an engine's model.

    pool_tokens: size of each paged layer's pool in positions (default: rows * max_len,
    which never runs short); token_budget: tokens one step runs at most (decoding rows
    included), > rows; max_chunk: the longest prefill chunk of one row (a power of two);
    replay: bounded-replay prefill for CED configs, as Engine.prefill's (None: exact);
    prefix_cache: reuse cached prompt prefixes (docs/prefix_caching.md; off on a mesh);
    prefix_nodes: snapshot slots, the most prefixes kept at once (default 4 * rows, >= 8);
    prefix_stride: tokens between published prefixes (default prefix.stride's).
    """

    def __init__(self, engine: generate.Engine, rows: int, max_len: int, *,
                 pool_tokens: int | None = None, token_budget: int | None = None,
                 max_chunk: int = 64, replay=None, prefix_cache: bool = True,
                 prefix_nodes: int | None = None, prefix_stride: int | None = None):
        if rows < 1:
            raise InputError(f"scheduler: rows must be >= 1, got {rows}")
        if max_chunk < generate.MIN_BUCKET or max_chunk & (max_chunk - 1):
            raise InputError(f"scheduler: max_chunk must be a power of two >= "
                             f"{generate.MIN_BUCKET}, got {max_chunk}")
        token_budget = rows + max_chunk if token_budget is None else token_budget
        if token_budget <= rows:
            raise InputError(f"scheduler: token_budget ({token_budget}) must exceed rows "
                             f"({rows}), or a full batch of decoding rows starves prefill")
        self.engine, self.rows, self.max_len = engine, rows, max_len
        self.token_budget, self.max_chunk = token_budget, max_chunk
        self.replay = generate._check_replay(engine.cfg, replay)
        self._pool_tokens = pool_tokens
        self.cache = state = self._empty()
        self.pools = pool_layers(engine.cfg, state)
        # Where each decode-state leaf keeps its rows (None: shared, as a page pool is), to
        # run prefill chunks over a sub-batch; not on a mesh, whose rows are sharded.
        self._axes = None if engine.mesh is not None else programs.row_axes(
            lambda b: with_pool(engine.cfg, engine.init_cache(b, max_len), 1))
        self._blank = self._placed(engine.init_cache(1, max_len))
        self._queue: collections.deque[_Job] = collections.deque()
        self._slots: list[_Row | None] = [None] * rows
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._pending: list[Event] = []  # finished without a step (max_new_tokens 0, cancel)
        self.generated = 0  # output tokens produced so far
        self.preemptions = 0
        # The host's mirror of every pool's page references (admission, preemption and the
        # single-owner rule are decided on it before a step runs).
        self.ledgers = [PageLedger(p, rows) for p in self.pools]
        self.prefix_cache = bool(prefix_cache) and self._axes is not None
        self.prefix_stats = collections.Counter()  # hit/prompt tokens, evictions, refusals
        if self.prefix_cache:
            cfg = engine.cfg
            self.block = prefix.block_size(cfg)
            self.stride = prefix_stride or prefix.stride(cfg, max_chunk)
            if self.stride % self.block:
                raise InputError(f"scheduler: prefix_stride ({self.stride}) must be a "
                                 f"multiple of the block size {self.block}")
            self._fingerprint = prefix.fingerprint(cfg, {
                "engine": id(engine), "replay": self.replay, "block": self.block,
                "stride": self.stride})
            self.index = prefix.PrefixIndex()
            n_nodes = prefix_nodes or default_prefix_nodes(rows)
            self.snapshots = Snapshots(engine.units, self._axes, lambda b: self._placed(
                with_pool(cfg, engine.init_cache(b, max_len), 1)), n_nodes)
            self._free_slots = list(range(n_nodes))
            self._seen: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def _empty(self):
        """An empty decode state of the scheduler's rows, max_len and pools."""
        state = self.engine.init_cache(self.rows, self.max_len)
        if self._pool_tokens is not None:
            state = with_pool(self.engine.cfg, state, self._pool_tokens)
        return self._placed(state)

    def _placed(self, state):
        """`state` committed to the weights' device. A step's outputs are committed where the
        weights are (a checkpoint's are), a fresh state is not, and jit compiles a program
        once per commitment of its arguments: warm_up's programs would not be those of the
        first request (each recompiled then, minutes for a big model). A mesh's state is
        made on its devices already."""
        if self.engine.mesh is not None:
            return state
        return jax.device_put(state, jax.tree.leaves(self.engine.state)[0].sharding)

    # -- requests -------------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """Raise InputError if `req` is malformed or could never be served (needs nothing
        but the scheduler's sizes: safe to call from any thread)."""
        req.check(self.engine.cfg.model.vocab_size)
        need = len(req.prompt) + req.max_new_tokens
        if need > self.max_len:
            raise InputError(f"request: prompt ({len(req.prompt)} tokens) + max_new_tokens "
                             f"({req.max_new_tokens}) = {need} exceeds the cache's "
                             f"{self.max_len} positions per request")
        last = max(need - 1, 1)  # the last token drawn is never written
        for p in self.pools:
            if p.pages(last) > p.n_pages:
                raise InputError(f"request: {need} tokens need {int(p.pages(last))} pages in "
                                 f"layer {p.layer}, whose whole pool has {p.n_pages}")

    def submit(self, req: Request) -> int:
        """Queue `req` (checked first); return its id."""
        self.check(req)
        job = _Job(next(self._ids), req)
        if self.prefix_cache:
            job.digests = prefix.block_digests(self._fingerprint, req.prompt, self.block)
            job.points = self._points(job)
            for b in job.points:  # how many requests' prompts had each prefix
                digest = job.digests[b // self.block - 1]
                self._seen[digest] = self._seen.pop(digest, 0) + 1
            while len(self._seen) > SEEN:
                self._seen.popitem(last=False)
        if req.max_new_tokens == 0:
            self._pending.append(self._event(job, None, Finish.LENGTH))
        else:
            self._queue.append(job)
        return job.rid

    def cancel(self, rid: int) -> None:
        """End request `rid` now (queued or running); its Event comes with the next step.
        An unknown or finished id is ignored (it may have just finished)."""
        for job in self._queue:
            if job.rid == rid:
                self._queue.remove(job)
                self._pending.append(self._event(job, None, Finish.CANCELLED))
                return
        rows = [i for i, r in enumerate(self._slots) if r is not None and r.job.rid == rid]
        if rows:
            job = self._slots[rows[0]].job
            self._clear(rows)
            self._pending.append(self._event(job, None, Finish.CANCELLED))

    # -- state ----------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def idle(self) -> bool:
        return not self._queue and not self.active and not self._pending

    def running_ids(self) -> list[int]:
        """Ids of the requests holding rows now (running or waiting there for a prefix)."""
        return [r.job.rid for r in self._slots if r is not None]

    def free_rows(self) -> list[int]:
        """Rows holding no request (their cache rows are the next owners' to clear)."""
        return [i for i, r in enumerate(self._slots) if r is None]

    def _written(self) -> np.ndarray:
        return np.array([0 if r is None else r.written for r in self._slots], np.int64)

    def pages_free(self) -> int:
        """Free pages over every paged layer (0 for a model without pools)."""
        return sum(led.free for led in self.ledgers)

    @property
    def pages_total(self) -> int:
        return sum(p.n_pages for p in self.pools)

    def prefix_metrics(self) -> dict:
        """The prefix cache's counters (docs/prefix_caching.md): prompt tokens reused at
        first admission (`hit_tokens`) out of `prompt_tokens`, cached prefixes (`nodes`),
        the pages they hold (any page a node holds, shared with rows or not), snapshot
        bytes, evictions, pages copied on write and refused reuses by reason."""
        st = self.prefix_stats
        return {"prefix_cache": self.prefix_cache,
                "prefix_hit_tokens": st["hit_tokens"],
                "prefix_prompt_tokens": st["prompt_tokens"],
                "prefix_nodes": (self.snapshots.n - len(self._free_slots)
                                 if self.prefix_cache else 0),
                "prefix_cached_pages": sum(len(led.held) for led in self.ledgers),
                "prefix_snapshot_bytes": self.snapshots.bytes if self.prefix_cache else 0,
                "prefix_evictions": st["evictions"],
                "prefix_copies": sum(led.copies for led in self.ledgers),
                "prefix_refused": {"replay_window": st["refused_replay_window"]}}

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit, plan, run one compiled step and sample; return its events."""
        events, self._pending = self._pending, []
        self._admit()
        self._start()
        n_new = self._plan()
        if not n_new.any():
            return events
        logits = self._run(n_new)
        for led in self.ledgers:  # what the step's appends did on the device
            led.append(self._entries(led, n_new))
        for i, r in enumerate(self._slots):
            if r is not None:
                r.written += int(n_new[i])
        self._publish()
        drawing = [i for i, r in enumerate(self._slots)
                   if r is not None and n_new[i] and r.written == r.job.context_len]
        if drawing:
            events += self._draw(logits, drawing)
        return events

    def run(self) -> dict[int, list[int]]:
        """Step until nothing is queued or running; each finished request's output."""
        out: dict[int, list[int]] = {}
        while not self.idle:
            for ev in self.step():
                out.setdefault(ev.request_id, [])
                if ev.token is not None:
                    out[ev.request_id].append(ev.token)
        return out

    # -- pages ----------------------------------------------------------------------------
    def _entries(self, led: PageLedger, n_new) -> np.ndarray:
        """Entries each row appends to `led`'s layer when it writes n_new more positions."""
        s = led.layer.stride
        written = self._written()
        return (written + np.asarray(n_new, np.int64)) // s - written // s

    def _short(self, extra=None) -> bool:
        """Whether some pool cannot hold every row's whole context (and `extra`'s: (job,
        positions it would restore)), counting pages as the ledgers hold them: shared
        ones once, a copy for a row that will write a shared partly filled page."""
        for led in self.ledgers:
            ps, s = led.page_size, led.layer.stride
            need = 0
            rows = [(r.job, r.written if r.started else 0, i)
                    for i, r in enumerate(self._slots) if r is not None]
            rows += [(extra[0], extra[1], None)] if extra is not None else []
            for job, have, i in rows:
                e0, e1 = have // s, job.context_len // s
                held = len(led.tables[i]) if i is not None else -(-e0 // ps)
                copy = e1 > e0 and e0 % ps != 0 and (i is None or led.shared(i)[-1])
                need += max(-(-e1 // ps) - held, 0) + copy
            if need > led.free:
                return True
        return False

    def _admit(self) -> None:
        admitted = []
        while self._queue and None in self._slots:
            job = self._queue[0]
            hit = self._match(job).end if self.prefix_cache else 0
            if self._short((job, hit)):
                if self._evict(keep=job) or self._evict():
                    continue  # room made by dropping a cached prefix (its own last): again
                break  # first come, first served: wait for pages
            self._queue.popleft()
            admitted.append(self._slots.index(None))
            self._slots[admitted[-1]] = _Row(job, next(self._seq))
        if admitted:  # a fresh row, whatever a free row holds (retirement cleared it too)
            self._reset(admitted)

    # -- prefixes -------------------------------------------------------------------------
    def _limit(self, job: _Job) -> int:
        return prefix.reusable_limit(len(job.req.prompt), self.replay)

    def _match(self, job: _Job) -> prefix.Match:
        """The deepest cached prefix `job` may reuse (and a deeper one being computed)."""
        return self.index.match(job.req.prompt, job.digests, self._limit(job))

    def _points(self, job: _Job) -> list[int]:
        """Where `job`'s row publishes its prefix: every multiple of the stride and its last
        block boundary, up to what a request may reuse."""
        limit = self._limit(job)
        last = limit // self.block * self.block
        return sorted({b for b in range(self.stride, limit + 1, self.stride)} | {last} - {0})

    def _start(self) -> None:
        """Start the rows waiting to: each restores the deepest cached prefix of its prompt,
        or waits while a deeper one is being computed by another row, or begins from
        nothing; then registers the prefixes it will publish. The running rows register
        first what the prompts submitted since make worth keeping, so that a newcomer
        waits for a prefix a running row is computing instead of computing it beside it."""
        for r in self._slots:
            if self.prefix_cache and r is not None and r.started:
                self._register(r)
        restore = []
        for i, r in enumerate(self._slots):
            if r is None or r.started:
                continue
            if not self.prefix_cache:
                r.started = True
                r.job.cached = 0 if r.job.cached is None else r.job.cached
                continue
            m = self._match(r.job)
            if m.pending is not None:
                if r.awaiting is not m.pending:
                    self._unwait(r)
                    r.awaiting = self.index.pin(m.pending.digest)
                continue
            self._unwait(r)
            r.started = True
            if m.ready is not None:
                r.node = self.index.pin(m.ready.digest)
                r.written = m.ready.end
                restore.append(i)
            if r.job.cached is None:
                r.job.cached = r.written
                self.prefix_stats["hit_tokens"] += r.written
                self.prefix_stats["prompt_tokens"] += len(r.job.req.prompt)
                if self.replay is not None and self.index.match(
                        r.job.req.prompt, r.job.digests, len(r.job.req.prompt)).end > r.written:
                    # a longer cached prefix reaches into its replay window: not exact there
                    self.prefix_stats["refused_replay_window"] += 1
            self._register(r)  # before the next row looks: it may wait for these
        if restore:
            rows = [self._slots[i] for i in restore]
            self.cache = self.snapshots.give(self.cache, restore,
                                             [r.node.payload["slot"] for r in rows], self.rows)
            for i, r in zip(restore, rows):
                for led, handles in zip(self.ledgers, r.node.payload["pages"]):
                    led.share(i, handles, r.written // led.layer.stride)

    def _register(self, r: _Row) -> None:
        """Register the points ahead of row r that it will publish (PENDING nodes others may
        wait for): those no node covers yet where another request's prompt branches off
        (some prompt has the prefix but not the row's next point's: a deeper node serves
        every other). A prefix seen once is not kept, nor one every prompt that has it
        continues past (its snapshot would cost a copy, a slot and an eviction for
        nothing: a whole row for MHA); re-checked every step, so a row publishes the
        points still ahead of it once another request with its prefix arrives."""
        points = r.job.points  # ascending: a decoding row has none ahead
        ahead = points[bisect.bisect_right(points, r.written):]
        digests = [r.job.digests[b // self.block - 1] for b in ahead]
        seen = [self._seen.get(d, 0) for d in digests] + [0]
        for k, (b, digest) in enumerate(zip(ahead, digests)):
            if (b not in r.pending and digest not in self.index
                    and seen[k] > max(1, seen[k + 1])):
                r.pending[b] = self.index.insert(digest, None, r.job.req.prompt[:b])

    def _unwait(self, r: _Row) -> None:
        if r.awaiting is not None:
            self.index.unpin(r.awaiting.digest)
            r.awaiting = None

    def _publish(self) -> None:
        """Rows that just reached a point they publish keep a snapshot of themselves there
        (pages by reference); their PENDING nodes become READY."""
        rows, slots, nodes = [], [], []
        for i, r in enumerate(self._slots):
            node = self._published_by(r) if r is not None else None
            if node is None:
                continue
            if not self._free_slots and not self._evict():
                self._abandon(node)  # every slot pinned: this prefix is not kept
                continue
            slot = self._free_slots.pop()
            pages = [list(led.tables[i][:-(-(r.written // led.layer.stride) // led.page_size)])
                     for led in self.ledgers]
            for led, handles in zip(self.ledgers, pages):
                led.hold(handles, 1)
            node.payload = {"slot": slot, "pages": pages}
            rows.append(i)
            slots.append(slot)
            nodes.append(node)
        if rows:
            self.cache = self.snapshots.take(self.cache, rows, slots, self.rows)
            for node in nodes:
                self.index.publish(node.digest)

    def _abandon(self, node: prefix.Node) -> None:
        """Drop a PENDING node; rows waiting for it look again at their next start."""
        for r in self._slots:
            if r is not None and r.awaiting is node:
                self._unwait(r)
        self.index.drop(node.digest)

    def _evict(self, keep: _Job | None = None) -> bool:
        """Drop the least recently used cached prefix nobody pins (not one `keep` would
        restore); False if there is none."""
        if not self.prefix_cache:
            return False
        kept = self._match(keep).ready if keep is not None else None
        if kept is not None:
            self.index.pin(kept.digest)
        gone = self.index.evict_lru(1)
        if kept is not None:
            self.index.unpin(kept.digest)
        for node in gone:
            for led, handles in zip(self.ledgers, node.payload["pages"]):
                led.hold(handles, -1)
            self.cache = self.snapshots.drop(self.cache, [node.payload["slot"]])
            self._free_slots.append(node.payload["slot"])
            self.prefix_stats["evictions"] += 1
        return bool(gone)

    def _chunks(self) -> np.ndarray:
        """Tokens per row this step: 1 for decoding rows, prefill chunks (oldest first) from
        what the budget leaves; then, since the prefilling rows run as one program of the
        widest chunk's width whatever each takes, every prefilling row takes up to that
        width (no extra work)."""
        n = np.zeros(self.rows, np.int32)
        prefilling = []
        for i, r in enumerate(self._slots):
            if r is None or not r.started:
                continue
            left = r.job.context_len - r.written
            if left == 1:
                n[i] = 1
            else:
                prefilling.append((r.seq, i, left))
        budget = self.token_budget - int(n.sum())
        for _, i, left in sorted(prefilling):
            n[i] = self._take(i, min(left, self.max_chunk, budget))
            budget -= n[i]
        if n.max() > 1:  # a prefill step: its width is paid for every row
            width = generate.bucket_length(int(n.max()), self.max_len)
            for _, i, left in prefilling:
                n[i] = max(n[i], self._take(i, min(left, width)))
        return n

    def _take(self, i: int, take: int) -> int:
        """`take` tokens for row i, at most R decoder positions per chunk under replay."""
        r = self._slots[i]
        if self.replay is not None:
            start = max(self._replay_from(r), r.written)
            take = min(take, max(start - r.written, 0) + self.replay)
        if r.pending:  # end at the next prefix it publishes: its snapshot is taken there
            take = min(take, self._snapshot_at(r) - r.written)
        return take

    @staticmethod
    def _snapshot_at(r: _Row) -> int:
        """Where row r takes its next snapshot: exactly at the next prefix end it publishes
        (a ring or a compressor holds a row's state at b only between the step ending at b
        and the next)."""
        return min(r.pending)

    @staticmethod
    def _published_by(r: _Row) -> prefix.Node | None:
        """The node row r publishes now (its snapshot point is where it stands), if any."""
        return r.pending.pop(r.written, None)

    def _replay_from(self, r: _Row) -> int:
        """First position the decoder runs on: the last R of the original prompt (decoded
        positions after it too)."""
        return len(r.job.req.prompt) - self.replay

    def _plan(self) -> np.ndarray:
        """This step's tokens per row, after preempting the youngest rows while the pools
        cannot hold the step's pages."""
        while True:
            n = self._chunks()
            short = [led for led in self.ledgers
                     if led.needs(self._entries(led, n)).sum() > led.free]
            if not short:
                for led in self.ledgers:  # a row never writes a page it does not own alone
                    led.assert_single_owner(self._entries(led, n))
                return n
            if self._evict():
                continue
            live = [(r.seq, i) for i, r in enumerate(self._slots) if r is not None]
            _, victim = max(live)
            job = self._slots[victim].job
            self._clear([victim])
            self._queue.appendleft(job)  # recomputed from its prompt and output so far
            self.preemptions += 1

    def _run(self, n_new: np.ndarray):
        """Run this step's tokens; next-token logits [rows, V] (meaningless for rows that
        took none)."""
        # Every prefilling row goes to the sub-batch, even one taking a single token: its
        # chunk runs in the chunk program (under replay, too), as it would in one program.
        prefilling = np.array([r is not None and r.job.context_len - r.written > 1
                               for r in self._slots]) & (n_new > 0)
        wide = np.flatnonzero(prefilling) if n_new.max() > 1 else np.zeros(0, np.int64)
        size = 1 << (len(wide) - 1).bit_length() if len(wide) else 0
        if self._axes is None or not 0 < size < self.rows:
            logits, self.cache = self._extend(self.cache, np.arange(self.rows), n_new)
            return logits
        narrow = np.where(prefilling, 0, n_new)
        logits = None
        if narrow.any():
            logits, self.cache = self._extend(self.cache, np.arange(self.rows), narrow)
        # The sub-batch: the prefilling rows, then stand-ins (indices past the batch) that
        # take no token and are dropped when the rows go back.
        idx = np.concatenate([wide, np.full(size - len(wide), self.rows)])
        sub_logits, self.cache = self._extend(self.cache, idx, n_new, sub_batch=True)
        return self._merge(logits, idx, sub_logits)

    def _merge(self, logits, idx: np.ndarray, sub_logits):
        """The whole batch's logits with the sub-batch's rows `idx` in (None: no others)."""
        return programs.merge_rows(logits, np.asarray(idx, np.int32), sub_logits, self.rows)

    def _extend(self, cache, idx: np.ndarray, n_new: np.ndarray, width: int | None = None,
                sub_batch: bool = False):
        """(logits, cache): scheduler rows `idx` (an index past the batch: a stand-in), each
        extended by its n_new tokens of its context, in a program of `width` tokens per row
        (default: the bucketed longest); the rows of `cache` are rows `idx`, or with
        `sub_batch` the whole batch's, of which rows `idx` are taken out, extended and put
        back in one program (programs.extend_rows)."""
        count = np.array([n_new[i] if i < self.rows else 0 for i in idx], np.int32)
        if width is None:
            width = int(count.max())
            width = 1 if width == 1 else generate.bucket_length(width, self.max_len)
        tokens = np.zeros((len(idx), width), np.int32)
        for k, i in enumerate(idx):
            r = self._slots[i] if i < self.rows else None
            if r is not None and count[k]:
                tokens[k, : count[k]] = r.job.context_span(r.written, r.written + count[k])
        replay = self.replay if self.replay is not None and width > 1 else None
        replay_from = None
        if replay is not None:
            replay_from = np.array([self._replay_from(self._slots[i])
                                    if i < self.rows and self._slots[i] is not None else 0
                                    for i in idx], np.int32)
        eng = self.engine
        if sub_batch:
            return programs.extend_rows(eng.graph, self._axes, eng.state, tokens, count, cache,
                                        np.asarray(idx, np.int32), replay, replay_from)
        with eng._on_mesh():
            return generate.prefill_program(eng.graph, eng.state, tokens, count, cache,
                                            replay, replay_from)

    def warm_up_shapes(self) -> list[tuple[int, int]]:
        """(width, rows) of every step program a step can run, in warm_up's order: each chunk
        width over the whole batch, then each width > 1 over each sub-batch size."""
        widths = sorted({1} | {generate.bucket_length(w, self.max_len)
                               for w in range(2, self.max_chunk + 1)})
        sizes = [] if self._axes is None else [1 << k for k in range(self.rows.bit_length())
                                               if 1 << k < self.rows]
        return [(w, self.rows) for w in widths] + [(w, size) for size in sizes
                                                   for w in widths[1:]]

    def warm_up(self, done=None) -> int:
        """Compile every program a step can run (`warm_up_shapes`; sampling; clearing rows)
        on a throwaway state, so that no request waits for a compile later. `done(width,
        rows, seconds)` is called after each step program (they take minutes in all for a
        big model: a caller shows progress). Returns the number of (width, rows) shapes."""
        cache = self._empty()
        none, logits = np.zeros(self.rows, np.int32), None
        shapes = self.warm_up_shapes()
        for w, size in shapes:
            t0 = time.perf_counter()
            if size == self.rows:
                logits, cache = self._extend(cache, np.arange(self.rows), none, w)
            else:
                stand_ins = np.full(size, self.rows)  # no row: nothing changes
                sub_logits, cache = self._extend(cache, stand_ins, none, w, sub_batch=True)
                self._merge(None, stand_ins, sub_logits)  # a step with no decoding rows
                logits = self._merge(logits, stand_ins, sub_logits)
            if done is not None:
                done(w, size, time.perf_counter() - t0)
        self._sample(logits)
        generate.check_cache(cache)
        self._reset([])  # clears no row
        if self.prefix_cache:  # the snapshot programs, over no row and no slot
            self.cache = self.snapshots.take(self.cache, [], [], self.rows)
            self.cache = self.snapshots.give(self.cache, [], [], self.rows)
            self.cache = self.snapshots.drop(self.cache, [])
        return len(shapes)

    def _sample(self, logits) -> np.ndarray:
        """Every row's token [rows], each drawn with its request's sampling (idle: greedy)."""
        reqs = [None if r is None else r.job.req for r in self._slots]
        field = lambda f, d: np.array([d if q is None else f(q) for q in reqs])  # noqa: E731
        steps = np.array([0 if r is None else len(r.job.output) for r in self._slots],
                         np.int32)
        toks = programs.sample_rows(logits, field(lambda q: q.seed, 0).astype(np.int32), steps,
                                    field(lambda q: q.temperature, 0.0).astype(np.float32),
                                    field(lambda q: q.top_p, 1.0).astype(np.float32))
        return np.asarray(jax.device_get(toks))

    def _draw(self, logits, drawing: list[int]) -> list[Event]:
        toks = self._sample(logits)
        generate.check_cache(self.cache)  # a refused row or a dropped page would be a bug here
        events, done = [], []
        for i in drawing:
            job = self._slots[i].job
            tok, req = int(toks[i]), job.req
            if req.eos_id is not None and tok == req.eos_id:
                events.append(self._event(job, None, Finish.STOP))
                done.append(i)
                continue
            job.output.append(tok)
            self.generated += 1
            finish = (Finish.STOP if req.stops_after(job.output) else
                      Finish.LENGTH if len(job.output) >= req.max_new_tokens else None)
            events.append(self._event(job, tok, finish))
            if finish is not None:
                done.append(i)
        if done:
            self._clear(done)
        return events

    @staticmethod
    def _event(job: _Job, token: int | None, finish: Finish | None) -> Event:
        """An event of `job`; its first says how many prompt tokens it reused."""
        cached = None if job.reported else (job.cached or 0)
        job.reported = True
        return Event(job.rid, token, finish, cached)

    def _clear(self, rows: list[int]) -> None:
        """Free `rows` now: pages released and local state reset on the device; the prefix
        each restored is unpinned, the prefixes each had yet to publish abandoned."""
        for i in rows:
            r, self._slots[i] = self._slots[i], None
            if r.node is not None:
                self.index.unpin(r.node.digest)
            if r.awaiting is not None:
                self._unwait(r)
            for node in r.pending.values():
                self._abandon(node)
        self._reset(rows)

    def _reset(self, rows: list[int]) -> None:
        mask = np.zeros(self.rows, bool)
        mask[rows] = True
        for led in self.ledgers:
            led.release(mask)
        self.cache = programs.clear_rows(self.engine.units, self.cache, mask,
                                         self._blank)
