"""Caches and programs on a device mesh (dsattn.sharding).

`cache_bytes_per_device` lays a preset's decode state out on a (data, fsdp, tensor) mesh from
abstract shapes only (nothing is allocated, any size works) and counts what one device
holds. `time_on_mesh` runs a tiny preset's decode step and train step on this process's
devices; on host CPU devices the times say nothing about accelerators, the bytes do.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

from dsattn import generate, sharding
from dsattn.bench.compiles import compilations
from dsattn.cache.protocol import is_container
from dsattn.model import Transformer
from dsattn.train import Trainer

MESHES = ((1, 1, 8), (8, 1, 1), (2, 2, 2))


def _shard_bytes(x, spec: P, sizes: dict) -> int:
    """Bytes of one device's shard of an array of x's shape laid out by `spec`."""
    shape = list(x.shape)
    for d, axes in enumerate(spec):
        for a in (axes,) if isinstance(axes, str) else axes or ():
            shape[d] //= sizes[a]
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def _stored(tree):
    """Same structure: True for the stored vectors (what kvbytes counts), else False."""
    def mark(c):
        flags = jax.tree.map(lambda _: False, c)
        if is_container(c):
            flags = flags.with_vectors(jax.tree.map(lambda _: True, c.vectors))
        return flags

    return jax.tree.map(mark, tree, is_leaf=is_container)


def cache_bytes_per_device(cfg, batch: int, context: int, shape) -> dict:
    """A decode state of `batch` rows x `context` positions on a mesh of `shape`: stored
    vector bytes in all and on one device, and every cache byte on one device."""
    mesh = AbstractMesh(tuple(shape), sharding.MESH_AXES)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    groups = sharding.row_shards(mesh, batch)
    state = jax.eval_shape(lambda: generate.split_pools(model.init_cache(batch, context),
                                                           groups))
    specs = sharding.cache_specs(model.units, state, mesh)
    leaves = jax.tree.leaves(state.layers)
    spec_leaves = jax.tree.leaves(specs.layers, is_leaf=lambda s: isinstance(s, P))
    stored = jax.tree.leaves(_stored(state.layers))
    sizes = dict(mesh.shape)
    per_device = [_shard_bytes(x, s, sizes) for x, s in zip(leaves, spec_leaves)]
    nbytes = [math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves]
    return {"mesh": list(shape), "batch": batch, "context": context,
            "stored_bytes": sum(b for b, v in zip(nbytes, stored) if v),
            "stored_bytes_per_device": sum(b for b, v in zip(per_device, stored) if v),
            "cache_bytes_per_device": sum(per_device)}


def time_on_mesh(cfg, shape, context: int = 256, steps: int = 5) -> dict:
    """Median decode step (ms, `context` tokens prefilled, 8 rows) and train step (ms) of a
    preset on this process's devices laid out as `shape`; decode programs compiled."""
    cfg = _with_mesh(cfg, shape)
    mesh = sharding.make_mesh(cfg)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    eng = generate.Engine(model, mesh)
    rows = 8
    tokens = np.random.RandomState(0).randint(0, cfg.model.vocab_size, (rows, context))
    logits, cache = eng.prefill(tokens, None, eng.init_cache(rows, context + steps + 2))
    times, compiled = [], 0
    for _ in range(steps + 1):
        tok = jnp.argmax(logits, -1).astype(jnp.int32).block_until_ready()
        t0 = time.perf_counter()
        with compilations() as c:
            logits, cache = eng.decode_step(tok, cache)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
        compiled += c.n
    with tempfile.TemporaryDirectory() as run_dir:
        tr = Trainer(cfg, run_dir, quiet=True)
        batch = {k: np.asarray(v) for k, v in tr.val_batches[0].items()}
        tr.train_step(batch, 0)
        t0 = time.perf_counter()
        jax.block_until_ready(tr.train_step(batch, 1))
        train_ms = (time.perf_counter() - t0) * 1e3
    return {"mesh": list(shape), "decode_ms": float(np.median(times[1:]) * 1e3),
            "decode_compiled": compiled, "train_step_ms": train_ms}


def _with_mesh(cfg, shape):
    return dataclasses.replace(cfg, mesh=dataclasses.replace(
        cfg.mesh, **dict(zip(sharding.MESH_AXES, shape))))


def table(rows: list[dict]) -> str:
    head = (f"{'preset':<12}{'mesh':>11}{'batch':>7}{'context':>9}{'cache MiB':>11}"
            f"{'MiB/device':>12}{'incl. bookkeeping':>19}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['preset']:<12}{str(tuple(r['mesh'])):>11}{r['batch']:>7}"
                     f"{r['context']:>9}{r['stored_bytes'] / 2**20:>11.1f}"
                     f"{r['stored_bytes_per_device'] / 2**20:>12.1f}"
                     f"{r['cache_bytes_per_device'] / 2**20:>19.1f}")
    return "\n".join(lines)
