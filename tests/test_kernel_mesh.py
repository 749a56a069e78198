"""Kernels on a mesh (dsattn/kernels/mesh.py): XLA's partitioner cannot split a Pallas call,
so on a mesh of several devices every kernel call of a program must run under `shard_map`.
Checked here on programs traced under an abstract mesh (no devices needed): every Pallas call
of a decode step and of a training step sits inside a shard_map, whether the mesh splits the
rows (data, fsdp) or not (tensor). Without a mesh nothing changes: no shard_map at all. That
the sharded programs compute what one device does is the 8-device check's
(tests/sharding_checks.py, the full tier), and that they compile for 8 GPUs and 4 TPU chips
the compile check's (tests/test_aot.py)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src import core
from jax.sharding import AbstractMesh, AxisType

from dsattn import generate, sharding
from dsattn.bench import lower
from dsattn.model import Transformer
from dsattn.trainstep import loss_fn
from tests.helpers import preset

KERNELS = ("attention.impl=pallas_gpu", "indexer.impl=pallas_gpu", "model.scan_layers=true")


def _calls(jaxpr, under=False):
    """[whether it sits inside a shard_map] for every Pallas call of `jaxpr`, nested ones
    included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(under)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(sub, (core.Jaxpr, core.ClosedJaxpr)):
                    inner = sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub
                    out += _calls(inner, under or eqn.primitive.name == "shard_map")
    return out


def _mesh(shape):
    return AbstractMesh(shape, sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def decode_step(name, shape=None, batch=4):
    cfg = preset(name, *KERNELS)
    eng = lower.abstract_engine(cfg)
    model = nnx.merge(eng.graph.graphdef, nnx.State(eng.state))
    groups = 1 if shape is None else sharding.row_shards(_mesh(shape), batch)
    cache = jax.eval_shape(lambda: generate.split_pools(model.init_cache(batch, 64), groups))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def trace():
        return generate.decode_program.trace(eng.graph, eng.state, tokens, cache).jaxpr

    if shape is None:
        return trace()
    with jax.sharding.use_abstract_mesh(_mesh(shape)):
        return trace()


def train_step(name, shape, batch=4):
    cfg = preset(name, *KERNELS)
    graph, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((batch, 16), jnp.int32)

    def loss(params, tokens):
        return loss_fn(nnx.merge(graph, params), {"inputs": tokens, "targets": tokens}, 5)[0]

    with jax.sharding.use_abstract_mesh(_mesh(shape)):
        return jax.jit(jax.grad(loss)).trace(params, tokens).jaxpr


FULL = pytest.mark.full  # the fast tier keeps V4 (window, picks, indexer) on both meshes


@pytest.mark.parametrize("name, shape", [
    ("v4", (2, 1, 1)), ("v4", (1, 1, 2)),
    *(pytest.param(n, m, marks=FULL) for n in ("mla", "dsa", "v41")
      for m in ((2, 1, 1), (1, 1, 2)))])
def test_every_kernel_of_a_decode_step_runs_under_shard_map(name, shape):
    calls = _calls(decode_step(name, shape).jaxpr)
    assert calls and all(calls), f"{calls.count(False)} of {len(calls)} kernel calls unsplit"


@pytest.mark.parametrize("name", ["v4", pytest.param("mha", marks=FULL),
                                  pytest.param("dsa", marks=FULL)])
def test_every_kernel_of_a_training_step_runs_under_shard_map(name):
    calls = _calls(train_step(name, (1, 2, 1)).jaxpr)
    assert calls and all(calls), f"{calls.count(False)} of {len(calls)} kernel calls unsplit"


def test_one_device_programs_have_no_shard_map():
    jaxpr = decode_step("v4").jaxpr
    calls = _calls(jaxpr)
    assert calls and not any(calls)
    assert "shard_map" not in str(jaxpr)
