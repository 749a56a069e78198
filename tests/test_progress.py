"""Progress reads like a log off a terminal: a plain line every N steps (step, the loop's
figures, elapsed time, ETA), never a carriage-return bar; on a terminal, tqdm's bar. Checked
on the module and through training and eval as they run."""

import io

import pytest

from dsattn import progress, train
from tests.helpers import preset


class Terminal(io.StringIO):
    def isatty(self):
        return True


def lines(text: str) -> list[str]:
    return text.strip().splitlines()


def test_off_a_terminal_a_plain_line_every_n_steps_with_eta(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    bar = progress.Progress(100, desc="train tiny", every=25, stream=out)
    for step in range(1, 101):
        now[0] += 2  # a step takes 2 s
        bar.update(fields={"loss": f"{5 - step / 100:.2f}", "tok/s": "1,024"})
    bar.close()
    got = lines(out.getvalue())
    assert "\r" not in out.getvalue() and len(got) == 4
    assert got[0] == "train tiny: step 25/100 (25%) loss 4.75 tok/s 1,024; 50s elapsed, ETA 2m30s"
    assert got[-1].startswith("train tiny: step 100/100 (100%) loss 4.00") and "ETA 0s" in got[-1]


@pytest.mark.parametrize("total, start, want", [(40, 0, 10), (600, 0, 12), (600, 590, 1),
                                                (3, 0, 3)])
def test_default_every_is_a_tenth_of_the_loop_at_most_50_apart(total, start, want):
    out = io.StringIO()
    bar = progress.Progress(total, initial=start, desc="x", stream=out)
    for _ in range(start, total):
        bar.update()
    bar.close()
    assert len(lines(out.getvalue())) == want  # 40: every 4; 600: every 50; and the end


def test_on_a_terminal_a_bar_and_quiet_is_silent():
    tty = Terminal()
    bar = progress.Progress(10, desc="train tiny", stream=tty)
    for _ in range(10):
        bar.update(fields={"loss": "1.00"})
    bar.close()
    assert "\r" in tty.getvalue() and "10/10" in tty.getvalue()  # tqdm redraws its line
    quiet = Terminal()
    bar = progress.Progress(10, desc="x", stream=quiet, quiet=True)
    bar.update(10)
    bar.close()
    assert quiet.getvalue() == ""


def test_training_off_a_terminal_prints_lines(tmp_path, capsys):
    cfg = preset("mha", "model.n_layers=1", "model.d_model=32", "train.seq_len=16",
                 "train.batch_size=2", "train.steps=4", "train.eval_every=2",
                 "train.eval_batches=1", "train.ckpt_every=4")
    train.Trainer(cfg, tmp_path, progress_every=2).run()
    err = capsys.readouterr().err
    got = [line for line in lines(err) if line.startswith("train mha:")]
    assert "\r" not in err and [g.split()[3] for g in got] == ["2/4", "4/4"], err
    for g in got:
        assert " loss " in g and " val " in g and " tok/s " in g and " ETA " in g, g
