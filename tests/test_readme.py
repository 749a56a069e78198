"""Every Python block of README.md and docs/ runs as written: each is extracted and run in a
fresh interpreter from a folder holding the repository's configs/ and, for blocks that read
runs/demo-v41, a run trained there for a few steps."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_script

DOCS = [Path(ROOT) / "README.md", *sorted((Path(ROOT) / "docs").rglob("*.md"))]
BLOCKS = [(doc, i, code) for doc in DOCS
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    where = tmp_path_factory.mktemp("readme")
    os.symlink(os.path.join(ROOT, "configs"), where / "configs")
    return where


def _demo_run(folder: Path) -> None:
    run = folder / "runs" / "demo-v41"
    if not run.exists():  # the demo's preset, a few steps: what the block reads exists
        p = run_script("train", "configs/tiny/v41.yaml", "train.steps=2", "train.batch_size=2",
                       "train.eval_every=2", "train.ckpt_every=2", "train.eval_batches=1",
                       "--run-dir", run, "--quiet", cwd=folder)
        assert p.returncode == 0, p.stderr.decode()[-3000:]


@pytest.mark.parametrize("doc, i, code", BLOCKS,
                         ids=[f"{d.relative_to(ROOT)}#{i}" for d, i, _ in BLOCKS])
def test_python_block_runs_as_written(folder, doc, i, code):
    if "runs/demo-v41" in code:
        _demo_run(folder)
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, env=env,
                       timeout=600)
    assert p.returncode == 0, f"{doc.name} block {i}:\n{code}\n{p.stderr.decode()[-3000:]}"


def test_the_blocks_are_found():
    """README.md's blocks (a trained run, the library's API) and those of the pages under docs/
    (the sharded engine's, on docs/multi_device.md) are found."""
    found = [d.relative_to(ROOT).as_posix() for d, _, _ in BLOCKS]
    assert found.count("README.md") >= 2 and "docs/multi_device.md" in found
