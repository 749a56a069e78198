"""Multi-device layout (dsattn.sharding): the rules and their fallbacks here, on the one
device the suite sees; sharded programs (training, prefill and decode) in a subprocess with
CPU host devices (tests/sharding_checks.py), whose JSON report the tests below read.

The fast tier (`make test`) runs the 2-device subprocess (--small: every family's forward,
two decode engines, a train step); the full tier (`full` marker) the 8-device one, which
compiles a forward, a prefill and a decode program for each preset and mesh and a train
step for each mesh. Each runs once per test session, whichever worker asks first.
"""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsattn import config, sharding
from dsattn.model import Transformer
from tests.helpers import ROOT, once_per_session, preset

MESHES = ("(8, 1, 1)", "(2, 2, 2)", "(1, 1, 8)")


def _shared_report(tmp_path_factory, name: str, devices: int, *args) -> dict:
    """The subprocess's JSON report, made once per test session (helpers.once_per_session)."""
    out = once_per_session(tmp_path_factory, name,
                           lambda shared: _run_checks(shared / f"{name}-runs", devices, *args))
    assert out["devices"] == devices and out["x64"]
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The 8-device report (the full tier)."""
    return _shared_report(tmp_path_factory, "sharding", 8)


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    """The 2-device report (the fast tier): sharding_checks.py --small."""
    return _shared_report(tmp_path_factory, "sharding-small", 2, "--small")


def _run_checks(run_root, devices: int, *args) -> dict:
    env = dict(os.environ, JAX_ENABLE_X64="1", JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharding_checks.py"),
                          str(run_root), *args], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


# -- 2 devices, in the subprocess (the fast tier) ----------------------------------------------
@pytest.mark.parametrize("name", ["mha", "gqa", "mla", "dsa", "v4", "v41"])
def test_small_mesh_forward_matches_one_device(small_report, name):
    """Every family's forward with its heads split over a 2-way tensor mesh."""
    assert small_report[f"forward/{name}/(1, 1, 2)"] <= 1e-12


def test_small_mesh_train_step_matches_one_device(small_report):
    assert small_report["train/(1, 2, 1)/sharded"]  # the Trainer built the sharded step
    assert small_report["train/(1, 2, 1)"] <= 1e-11  # parameters after one AdamW step


@pytest.mark.parametrize("name, mesh", [("mla", "(1, 1, 2)"), ("v4", "(2, 1, 1)")])
def test_small_mesh_prefill_and_decode_match_one_device(small_report, name, mesh):
    """Prefill and two decode steps on the mesh give one device's logits, the decode program
    compiled once; V4's paged cache is one pool group per device."""
    assert small_report[f"decode/{name}/{mesh}"] <= 1e-12
    assert small_report[f"decode/{name}/{mesh}/compiled"] == 1
    if name == "v4":
        assert small_report["paged/groups"] == 2 and small_report["paged/rows_with_pages"] == 8


# -- 8 devices, in the subprocess (the full tier) ----------------------------------------------
@pytest.mark.full
@pytest.mark.parametrize("name", ["mla", "v4", "v41"])
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_forward_matches_one_device(report, name, mesh):
    assert report[f"forward/{name}/{mesh}"] <= 1e-12


@pytest.mark.full
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_train_step_matches_one_device(report, mesh):
    assert report[f"train/{mesh}/sharded"]  # the Trainer built the sharded step
    assert report[f"train/{mesh}"] <= 1e-11  # parameters after one AdamW step, float64


@pytest.mark.full
def test_accumulated_train_step_on_a_mesh(report):
    """train.grad_accum=2 on (2, 2, 2): the same parameters as one device's whole-batch step,
    and micro-batch i = rows i::2 keeps each micro-batch's rows where the batch's are (one
    per device): no collective on token rows beyond the whole-batch step's."""
    assert report["train/accum"] <= 1e-11
    assert report["train/accum/int_collectives"] == report["train/int_collectives"]


@pytest.mark.full
def test_parameters_and_moments_are_split(report):
    """On (data, fsdp, tensor) = (2, 2, 2): FFN and head weights over fsdp and tensor, the
    embedding's vocabulary rows over both; Adam's moments split like their
    parameters; norm scales replicated."""
    split = {k.split("/", 1)[1]: v for k, v in report.items() if k.startswith("split/")}
    # the scanned group's 4 copies stacked in front, unsplit
    assert split["ffn.w_gate"]["spec"] == [None, "fsdp", "tensor"]
    assert split["ffn.w_gate"]["shards"] == [[4, 64, 192]]  # [4, 128, 384] / (-, 2, 2)
    assert split["ffn.w_down"]["spec"] == [None, "tensor", "fsdp"]
    assert split["ffn.w_down"]["shards"] == [[4, 192, 64]]
    assert split["attn.wq_b"]["shards"] == [[4, 48, 96]]  # [4, q_lora 96, heads 4 x 48]
    assert split["embedding"]["spec"] == [["tensor", "fsdp"]]  # rows whole: a lookup reads one
    assert split["embedding"]["shards"] == [[64, 128]]
    assert split["norm"]["shards"] == [[128]]
    for v in split.values():
        assert v["mu_shards"] == v["shards"] and v["n_shards"] == 8


@pytest.mark.full
def test_parameters_are_born_split(report):
    """The Trainer's init on a mesh is one program whose outputs are already split: each
    device makes its shards (under half of the parameters' bytes on (2, 2, 2), where most
    weights split 4 ways) and no temporary as large as the largest parameter. The values
    equal the one-device init's: test_sharded_train_step_matches_one_device starts from it."""
    assert report["init/output_bytes"] < report["init/total_bytes"] / 2
    assert report["init/temp_bytes"] < report["init/largest_bytes"]


@pytest.mark.full
@pytest.mark.parametrize("name, mesh", [("mla", "(1, 1, 8)"), ("v4", "(8, 1, 1)"),
                                        ("v41", "(2, 2, 2)")])
def test_sharded_prefill_and_decode_match_one_device(report, name, mesh):
    """A prompt prefilled and two tokens decoded on the mesh give one device's logits, and
    the engine's decode program compiled once (its output cache keeps the input's layout)."""
    assert report[f"decode/{name}/{mesh}"] <= 1e-12
    assert report[f"decode/{name}/{mesh}/compiled"] == 1


@pytest.mark.full
@pytest.mark.parametrize("name, mesh", [("v4", "(8, 1, 1)"), ("dsa", "(2, 2, 2)"),
                                        ("mla", "(1, 1, 8)")])
def test_sharded_decode_through_the_kernels_matches_one_device(report, name, mesh):
    """The decode kernel and the indexer's score kernel per row shard (shard_map), each
    device over its own pool group; on (1, 1, 8) no row split, every device all rows."""
    assert report[f"kernels/decode/{name}/{mesh}"] <= 1e-12
    assert report[f"kernels/decode/{name}/{mesh}/compiled"] == 1


@pytest.mark.full
def test_sharded_train_step_through_the_kernels_matches_one_device(report):
    """FSDP over 8 devices with the dense, selected-entries and entry-mass kernels per row
    shard: the gradients (the sink's summed over every shard's rows) and so the step equal
    one device's."""
    assert report["kernels/train/v4/(1, 8, 1)"] <= 1e-11  # parameters after one AdamW step


@pytest.mark.full
def test_paged_cache_rows_and_pages_split_together(report):
    """On (8, 1, 1) a paged cache is one pool group per device: each holds one row's page
    table and its own block of pages, and the ids in its table are local to that block."""
    (n_pages, *page), shards = report["paged/pages"]
    assert report["paged/groups"] == 8 and shards == [[n_pages // 8, *page]]
    (rows, per_row), table_shards = report["paged/table"]
    assert rows == 8 and table_shards == [[1, per_row]]
    assert report["paged/rows_with_pages"] == 8
    assert 0 <= report["paged/max_local_id"] < n_pages // 8


def test_cache_layout_rules():
    """Every cache leaf splits along its row axis over the batch's mesh axes (a scanned
    group's copies stay whole: a leading axis, or one array per copy); MHA's key/value heads
    also over tensor; V4's shared entries stay whole on tensor."""
    mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.MESH_AXES)
    v4 = ("model.n_layers=6", "attention.layers=(csa, hca)*3", "attention.ratios=(4, 8)*3")
    for name, heads, overrides in (("mha", True, ()), ("v4", False, v4)):
        cfg = preset(name, "model.scan_layers=true", *overrides)
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        state = jax.eval_shape(lambda: model.init_cache(8, 32))
        specs = sharding.cache_specs(model.units, state, mesh)
        assert specs.pos == P(("data", "fsdp"))
        assert any(u.scanned for u in model.units)
        for unit, layer, spec_layer in zip(model.units, state.layers, specs.layers):
            leaves = jax.tree.leaves(layer)
            leaf_specs = jax.tree.leaves(spec_layer, is_leaf=lambda s: isinstance(s, P))
            assert len(leaves) == len(leaf_specs)
            for leaf, spec in zip(leaves, leaf_specs):
                lead = (None,) if unit.scanned and leaf.shape[0] == unit.copies else ()
                rows = (P(*lead, ("data", "fsdp"), "tensor") if heads
                        else P(*lead, ("data", "fsdp")))
                assert spec == rows, (name, leaf.shape)
    # 2 rows on (2, 2, 2): data divides them, fsdp is left out
    state = jax.eval_shape(lambda: model.init_cache(2, 32))
    assert sharding.cache_specs(model.units, state, mesh).pos == P("data")


@pytest.mark.full
def test_checkpoint_restores_onto_another_mesh(report):
    """Saved on (4, 1, 2), restored on (1, 1, 8): the same parameters, laid out for the new
    mesh, and the same logits."""
    assert report["ckpt/step"] == 1
    assert report["ckpt/saved_shards"] == [[4, 128, 192]]  # d_model whole, ffn 384 / tensor 2
    assert report["ckpt/params"] == 0.0 and report["ckpt/opt_state"] == 0.0
    assert report["ckpt/w_gate_shards"] == [[4, 128, 48]]  # ffn hidden 384 / tensor 8
    assert report["ckpt/logits"] <= 1e-12


# -- the rules, on one device ------------------------------------------------------------------
def test_spec_falls_back_when_the_mesh_does_not_divide():
    sizes = {"data": 2, "fsdp": 4, "tensor": 8}
    assert sharding.spec(("embed", "ffn"), (128, 384), sizes) == P("fsdp", "tensor")
    assert sharding.spec(("embed", "ffn"), (6, 12), sizes) == P()  # neither divides
    assert sharding.spec(("batch", None), (8, 5), sizes) == P(("data", "fsdp"))
    assert sharding.spec(("batch", None), (2, 5), sizes) == P("data")  # fsdp left out
    assert sharding.spec(("batch", None), (4, 5), {"data": 3, "fsdp": 4}) == P("fsdp")
    # one mesh axis per array: a later dimension with the same axis stays replicated
    assert sharding.spec(("embed", "latent"), (128, 64), sizes) == P("fsdp")
    assert sharding.spec(("embed", "ffn"), (128, 384), {"fsdp": 1, "tensor": 1}) == P()


def test_rules_name_every_weight_matrix():
    """Every parameter with two or more dimensions in the tiny presets gets a split
    dimension by some rule (a new parameter needs a row in sharding.RULES); a scanned
    group's stacked copies stay unsplit."""
    for name in ("mha", "gqa", "mla", "dsa", "v4", "v41"):
        cfg = preset(name, "model.scan_layers=false")  # unstacked: ndim is the rule's
        params = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(
            Transformer(cfg, rngs=nnx.Rngs(0)))))
        for path, x in jax.tree_util.tree_leaves_with_path(params):
            axes = sharding.param_axes(sharding.path_name(path), x.ndim)
            if x.ndim >= 2:
                assert any(a for a in axes), (name, sharding.path_name(path))
    cfg = preset("mla", "model.scan_layers=true")
    params = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.state(
        Transformer(cfg, rngs=nnx.Rngs(0)))))
    stacked = params["blocks"][0]["layers"][0]["ffn"]["w_down"]["kernel"]
    assert stacked.shape == (4, 384, 128)
    path = "blocks.0.layers.0.ffn.w_down.kernel"
    assert sharding.param_axes(path, 3) == (None, "ffn", "embed")
    assert sharding.spec(sharding.param_axes(path, 3), stacked.shape,
                         {"fsdp": 2, "tensor": 4}) == P(None, "tensor", "fsdp")
    # an optimizer moment matches its parameter's rule
    assert sharding.param_axes("1.0.mu.blocks.0.ffn.w_gate.kernel", 2) == ("embed", "ffn")


def test_mesh_config():
    cfg = preset("mla", "mesh.data=4", "mesh.tensor=2")
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (4, 1, 2)
    assert sharding.mesh_shape(preset("mla", "mesh.data=-1", "mesh.tensor=2").mesh, 8) == \
        (4, 1, 2)
    assert sharding.mesh_shape(cfg.mesh, 16) == (4, 1, 2)  # the first 8 of 16 devices
    with pytest.raises(config.ConfigError, match="needs at least 8 devices, jax sees 1"):
        sharding.make_mesh(cfg)
    with pytest.raises(config.ConfigError, match="multiple of 3"):
        sharding.mesh_shape(preset("mla", "mesh.data=3", "mesh.fsdp=-1").mesh, 8)
    with pytest.raises(config.ConfigError, match="mesh.tensor: must be >= 1 or -1"):
        preset("mla", "mesh.tensor=0")
    with pytest.raises(config.ConfigError, match="at most one size may be -1"):
        preset("mla", "mesh.data=-1", "mesh.fsdp=-1")
    assert sharding.make_mesh(preset("mla")).size == 1  # the default: one device


def test_constrain_is_a_no_op_without_a_mesh():
    x = jnp.ones((4, 8, 16))
    assert sharding.constrain(x, ("batch", "seq", "embed")) is x
    f = jax.jit(lambda x: sharding.constrain(x, ("batch", "seq", "embed")) * 2)
    with jax.set_mesh(sharding.make_mesh(preset("mla"))):  # one device: nothing to split
        np.testing.assert_array_equal(f(x), 2 * np.ones((4, 8, 16)))


def test_no_distributed_init_without_a_cluster(monkeypatch):
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "SLURM_JOB_ID",
                "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    assert sharding.initialize_distributed() is False
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task job is not multi-process
    assert sharding.initialize_distributed() is False
