"""TensorBoard event files beside metrics.jsonl, written from the same records.

metrics.jsonl stays the source of truth: each record it gets also goes to the run
directory's `events.out.tfevents.*` as scalars under the record's own names (loss, ce, the
aux losses, lr, grad_norm, tokens_per_s, val_loss), at its step and time. `tensorboard
--logdir runs/` then overlays runs, and a sweep's (one per `runs/<row>/seed<k>`).

Written with tensorboardX's EventsWriter, synchronously: its SummaryWriter hands events to a
thread that dies on a failed write and then blocks training once its queue fills. The
events are extra: without tensorboardX, or after a failed write, a warning says so once and
training goes on. A file opened by a resumed run starts with the marker tensorboardX's
`purge_step` writes: TensorBoard drops what earlier files logged from that step on, as the
resume cut metrics.jsonl back.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path


class EventLog:
    """Scalars of metrics.jsonl records as TensorBoard events in `run_dir`; the file is
    opened at the first record, purging earlier files' events from step `purge_from`."""

    def __init__(self, run_dir, purge_from: int):
        self.run_dir, self.purge_from = Path(run_dir), purge_from
        self._writer = None
        self._off = False

    def write(self, record: dict) -> None:
        scalars = {k: float(v) for k, v in record.items() if k not in ("step", "time")
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._off or not scalars:
            return
        try:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary

            if self._writer is None:
                self._writer = self._open()
            self._writer.write_event(Event(
                step=record["step"], wall_time=record.get("time", time.time()),
                summary=Summary(value=[Summary.Value(tag=k, simple_value=v)
                                       for k, v in scalars.items()])))
            self._writer.flush()
        except ImportError:
            self._stop("no TensorBoard events: tensorboardX is not installed (pip install "
                       "tensorboardX)")
        except Exception as e:  # noqa: BLE001 (events are extra: nothing may stop training)
            self._stop(f"TensorBoard events stopped at step {record['step']}: "
                       f"{type(e).__name__}: {e}")

    def _open(self):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        # tensorboardX names files by the second: the suffix keeps a resume within the same
        # second from overwriting (and sorting before) the file it follows
        writer = EventsWriter(str(self.run_dir / "events"), f".{time.time_ns()}")
        writer.write_event(Event(step=self.purge_from, wall_time=time.time(),
                                 session_log=SessionLog(status=SessionLog.START)))
        return writer

    def _stop(self, why: str) -> None:
        self._off = True
        self.close()
        warnings.warn(f"{self.run_dir}: {why}; training goes on, metrics.jsonl has every "
                      f"record", stacklevel=4)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 (see write)
                pass
