"""A run's cost before it starts (scripts/train.py --estimate: compile, s/step, tokens/s and
the whole run's time, nothing written to the run directory) and, in every run, a line with
its compile time and first steps' pace as soon as they are known."""

import io
import re

import pytest

from dsattn import cli, progress, train
from tests.helpers import preset

TINY = ["model.n_layers=1", "model.d_model=32", "model.ffn_hidden=64", "train.seq_len=16",
        "train.batch_size=2", "train.eval_every=2", "train.eval_batches=1",
        "data.max_bytes=200000"]


def _tree(root):
    """{relative path: (size, mtime)} of every file under root."""
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_says_its_compile_time_and_pace_after_its_first_steps(tmp_path, capsys):
    cfg = preset("mha", *TINY, "train.steps=4", "train.ckpt_every=4")
    train.Trainer(cfg, tmp_path / "run", progress_every=2).run()
    err = capsys.readouterr().err.splitlines()
    said = [i for i, line in enumerate(err) if "compiled in" in line]
    assert len(said) == 1, err
    assert re.fullmatch(r"train mha compiled in \d+\.\d s; \d[\d.]* s/step over its first 3 "
                        r"steps, about \S+ for the 4 steps", err[said[0]]), err[said[0]]
    steps = [i for i, line in enumerate(err) if line.startswith("train mha: step")]
    assert steps[0] < said[0] < steps[1], err  # after step 3, before the last step's line
    compiling = [i for i, line in enumerate(err) if "compiling its training step" in line]
    assert compiling == [0], err  # said while it compiles, before anything else
    quiet = io.StringIO()  # a quiet run (--quiet, a sweep's runs off a terminal): nothing
    progress.Progress(4, quiet=True, stream=quiet).write("compiled in 1.0 s")
    assert quiet.getvalue() == ""


def test_estimate_times_the_run_and_leaves_its_directory_alone(tmp_path, capsys):
    """An estimate against a run directory at step 2 (its checkpoints' names are all it
    reads): the steps left, their time and the validations', and nothing there touched."""
    from scripts import train as train_script

    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "checkpoints" / "1.orbax-checkpoint-tmp-9").mkdir()  # not a step
    before = _tree(run), sorted(p.name for p in run.rglob("*"))
    with pytest.raises(SystemExit) as e:
        cli.run(train_script.main, ["configs/tiny/mha.yaml", "--run-dir", str(run), *TINY,
                                    "train.steps=6", "--estimate"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    m = re.search(r"compiled in (\d+\.\d) s; ([\d.]+) s/step, ([\d,]+) tokens/s; a validation "
                  r"[\d.]+ s; from step 2 of 6: 4 steps x [\d.]+ s \+ 2 validations x [\d.]+ s "
                  r"\+ compiles: about \S+ left", out)
    assert m and float(m[2]) > 0, out
    assert (_tree(run), sorted(p.name for p in run.rglob("*"))) == before  # nothing written
