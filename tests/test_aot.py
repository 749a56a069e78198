"""Programs compiled for chips that are not here (the full tier): one training step and one
decode step of each kernel family for an H100 and a TPU v5e, on one chip and on a mesh,
compiled from this CPU by the .venv-aot interpreter (tests/aot_checks.py; `make test-full`
makes the venv). A kernel whose tiles pass the GPU's shared memory fails its compile
(RESOURCE_EXHAUSTED), and so does a kernel call on a mesh outside shard_map (Mosaic: "cannot
be automatically partitioned"); either fails its check here."""

import json
import os
import subprocess

import pytest

from tests.helpers import ROOT, once_per_session

AOT_PYTHON = os.path.join(ROOT, ".venv-aot", "bin", "python")
pytestmark = pytest.mark.full


def _run(*names) -> dict:
    assert os.path.exists(AOT_PYTHON), (
        "the compile checks need .venv-aot (jax's CUDA plugin, ptxas and libtpu): make aot-venv")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_ENABLE_X64")}
    run = subprocess.run([AOT_PYTHON, os.path.join(ROOT, "tests", "aot_checks.py"), *names],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=3000)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Every check's row, compiled once per session (the workers share it)."""
    return once_per_session(tmp_path_factory, "aot", lambda shared: _run())


CALLS = {  # the kernels each check's program must launch
    "h100/train/mla": {"dense_attention_fwd", "dense_attention_dq", "dense_attention_dkv"},
    "h100/train/v4": {"dense_attention_fwd", "dense_attention_dkv", "sparse_attention_fwd",
                      "sparse_attention_bwd", "sparse_attention_mass"},
    # the dense warm-up (a conditional's branch) and the picks
    "h100/train/dsa": {"dense_attention_fwd", "dense_attention_dq", "dense_attention_dkv",
                       "sparse_attention_fwd", "sparse_attention_bwd", "sparse_attention_mass"},
    "h100/decode/mla": {"decode_attention"},
    "h100/decode/v4": {"decode_attention", "indexer_score"},
    "h100-mesh/train/v4": {"sparse_attention_fwd", "sparse_attention_bwd"},
    "h100-mesh/decode/v41": {"decode_attention", "indexer_score"},
    "v5e/decode/v4": {"indexer_score"},
    "v5e/prefill/dsa": {"indexer_score"},  # a chunk of queries: tiled to fit VMEM
    "v5e/decode/v41-many-rows": {"indexer_score"},  # calls over groups of rows: SMEM
    "v5e-mesh/decode/dsa": {"indexer_score"},
    "v5e-mesh/train/v4": set(),  # no TPU attention kernel: the reads are XLA's
}


@pytest.mark.parametrize("name", list(CALLS))
def test_compiles_with_its_kernels(report, name):
    row = report[name]
    assert row["compiled"], row.get("error")
    assert CALLS[name] <= set(row["kernels"]["custom_call_names"]), row["kernels"]
    if name.startswith("h100"):  # auto took the GPU kernels for attention and the indexer
        assert {e["runs"] for e in row["implementations"].values()} == {"pallas_gpu"}
    if name.startswith("v5e") and "train" not in name:
        assert row["implementations"]["indexer.impl"]["runs"] == "pallas_tpu"


def test_a_tile_past_the_gpus_shared_memory_fails_its_compile():
    """The check catches a kernel whose tiles do not fit: DSA's training step compiled with
    the kernels sized for twice the H100's shared memory."""
    row = _run("h100/train/dsa:oversized")["h100/train/dsa:oversized"]
    assert not row["compiled"] and "Shared memory size limit exceeded" in row["error"]


def test_a_kernel_outside_shard_map_fails_on_a_tpu_mesh():
    """The check catches a kernel call that lost its shard_map: the Mosaic indexer kernel of
    a decode step on 4 v5e chips, with kernels/mesh.py's shard_map turned off."""
    row = _run("v5e-mesh/decode/dsa:unsplit")["v5e-mesh/decode/dsa:unsplit"]
    assert not row["compiled"] and "shard_map" in row["error"]
