"""TensorBoard event files beside metrics.jsonl hold the same scalars, read back from the
files' records; a resume marks where TensorBoard drops the steps a killed run logged past its
checkpoint; without tensorboardX, or when a write fails, training goes on and says so once."""

import json
import shutil
import struct
import sys
import warnings

import pytest

from dsattn import train
from tests.helpers import preset

RUN = ("model.n_layers=1", "model.d_model=32", "train.seq_len=16", "train.batch_size=2",
       "train.steps=4", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
       "train.ckpt_every=2")


def events(run_dir) -> list:
    """Every event of the run's event files (TFRecord framing checked), in file order."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    out = []
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            header, (crc,) = data[i:i + 8], struct.unpack("<I", data[i + 8:i + 12])
            (n,) = struct.unpack("<Q", header)
            body = data[i + 12:i + 12 + n]
            assert crc == masked_crc32c(header)
            assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == masked_crc32c(body)
            out.append(Event.FromString(body))
            i += 16 + n
    return out


def scalars(run_dir) -> dict:
    return {(v.tag, e.step): v.simple_value for e in events(run_dir) for v in e.summary.value}


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_events_hold_every_scalar_of_metrics_jsonl_and_a_resume_purges(tmp_path):
    tr = train.Trainer(preset("mha", *RUN), tmp_path, quiet=True)
    tr.run()
    got = scalars(tmp_path)
    want = {(k, r["step"]): v for r in records(tmp_path) for k, v in r.items()
            if k not in ("step", "time")}
    assert {k for k, _ in want} >= {"loss", "ce", "lr", "grad_norm", "tokens_per_s",
                                    "val_loss"}
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key  # float32 in the events
    # A kill after step 4's checkpoint was lost: the rerun logs steps 3-4 again, and its
    # file starts by telling TensorBoard to drop the old ones from step 3 on.
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    train.Trainer(preset("mha", *RUN), tmp_path, quiet=True).run()
    starts = [e.step for e in events(tmp_path) if e.HasField("session_log")]
    assert starts[-1] == 3 and len(list(tmp_path.glob("events.out.tfevents.*"))) == 2


def test_without_tensorboardx_training_goes_on_and_says_so_once(tmp_path, monkeypatch):
    for name in ["tensorboardX", *[m for m in sys.modules if m.startswith("tensorboardX.")]]:
        monkeypatch.setitem(sys.modules, name, None)  # imports fail as if it were absent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train.Trainer(preset("mha", *RUN), tmp_path, quiet=True).run()
    said = [w for w in caught if "TensorBoard" in str(w.message)]
    assert len(said) == 1 and "tensorboardX is not installed" in str(said[0].message)
    assert out["step"] == 4 and [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4]
    assert not list(tmp_path.glob("events.out.tfevents.*"))


def test_a_failing_event_write_stops_events_not_training(tmp_path, monkeypatch):
    from tensorboardX.event_file_writer import EventsWriter

    calls = []

    def full(self, event):
        calls.append(event.step)
        if event.step >= 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(EventsWriter, "write_event", full)
    with pytest.warns(UserWarning, match=r"TensorBoard events stopped at step 2: .*No space") \
            as caught:
        out = train.Trainer(preset("mha", *RUN), tmp_path, quiet=True).run()
    assert len([w for w in caught if "TensorBoard" in str(w.message)]) == 1
    assert out["step"] == 4 and [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4]
    assert max(calls) == 2  # not tried again after the failure
