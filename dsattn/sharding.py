"""Multi-device layout: the device mesh, logical axis names on parameters and activations,
and the rules that map them to mesh axes for XLA's SPMD partitioner.

The mesh has three axes (config section `mesh`): `data` (batch only), `fsdp` (batch, and
every parameter and optimizer moment split along one dimension, gathered for use) and
`tensor` (attention heads, indexer heads, the FFN hidden width and the vocabulary split, so
the matmuls on them run split). A parameter's dimensions get logical names from `RULES`
(a table by parameter path); `LOGICAL` maps each name to mesh axes. A dimension the mesh
axis does not divide, or whose mesh axis an earlier dimension of the same array already
took, stays replicated on it: a rule falls back, it never errors. Everything here is
jax.sharding (Mesh, NamedSharding, PartitionSpec); XLA inserts the collectives.

A 1-device mesh (the default) shards nothing: callers skip all of this when
`mesh.size == 1`, so single-device runs compile the programs they always did.
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from dsattn import scan
from dsattn.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes it may be split over (in order; see `spec`).
LOGICAL = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),  # d_model: the FSDP dimension of most weights
    "latent": ("fsdp",),  # low-rank bottlenecks (q/o LoRA ranks, MLA's kv latent): FSDP too
    # The vocabulary: rows of the embedding table over tensor and fsdp both, so a token's row
    # is looked up whole (a table split along d_model too makes XLA's SPMD partitioner
    # replicate the gather's output: "involuntary full rematerialization").
    "vocab": ("tensor", "fsdp"),
    "heads": ("tensor",),  # query/output heads, fused with their head width (H * d)
    "kv_heads": ("tensor",),  # MHA/GQA key/value heads
    "index_heads": ("tensor",),  # the lightning indexer's heads
    "ffn": ("tensor",),  # the SwiGLU hidden width
    "entry": (),  # V4 entry width c: one K/V entry shared by every head, so not split
    "index_dim": (),  # indexer key width: one key shared by every indexer head
    "seq": (),
}

# Parameter path (dot-joined, matched at its end) -> logical names of its trailing
# dimensions. First match wins; an array with more dimensions than named (a scanned group's,
# dsattn.scan) keeps its leading ones replicated; an unmatched
# parameter (norm scales, the attention sink) is replicated whole.
RULES = (
    (r"embedding\.embed\.embedding", ("vocab", "embed")),
    (r"embedding\.head\.kernel", ("embed", "vocab")),
    (r"ffn\.w_(gate|up)\.kernel", ("embed", "ffn")),
    (r"ffn\.w_down\.kernel", ("ffn", "embed")),
    # MHA / GQA / MQA (DSA's indexer key is also `attn.wk`: split like a K head, harmless)
    (r"attn\.wq\.kernel", ("embed", "heads")),
    (r"attn\.w[kv]\.kernel", ("embed", "kv_heads")),
    (r"attn\.wo\.kernel", ("heads", "embed")),
    # MLA / DSA
    (r"attn\.wq_a\.kernel", ("embed", "latent")),
    (r"attn\.wq_b\.kernel", ("latent", "heads")),  # q_lora_rank=0: d_model, FSDP all the same
    (r"attn\.wkv_a\.kernel", ("embed", "latent")),
    (r"attn\.wkv_b\.kernel", ("latent", "heads")),
    # V4 family: query, window, compressors, output groups
    (r"query\.wq_a\.kernel", ("embed", "latent")),
    (r"query\.wq_b\.kernel", ("latent", "heads")),
    (r"local\.wkv\.kernel", ("embed", "entry")),
    (r"compressor\.(wkv|wgate)\.kernel", ("embed", "entry")),
    (r"compressor\.ape", (None, "entry")),  # [ratio, width]: a positional bias
    (r"key_proj\.kernel", ("entry", "index_dim")),
    (r"core\.out\.wo_a", ("heads", None, "latent")),  # [groups, group width, o_lora_rank]
    (r"core\.out\.wo_b\.kernel", ("heads", "embed")),  # [groups * o_lora_rank, d_model]
    # the lightning indexer (DSA, CSA, CSA2)
    (r"index_q\.wq\.kernel", ("latent", "index_heads")),
    (r"index_q\.w_heads\.kernel", ("embed", "index_heads")),
)
_RULES = tuple((re.compile(rf"(^|\.)({pattern})$"), names) for pattern, names in RULES)


# -- the mesh --------------------------------------------------------------------------------
def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, ...]:
    """(data, fsdp, tensor) on `n_devices`: a -1 size takes the devices the others leave;
    without one the sizes may use fewer devices than there are (the first ones)."""
    sizes = [getattr(mesh_cfg, a) for a in MESH_AXES]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes and n_devices % fixed == 0:
        sizes = [n_devices // fixed if s == -1 else s for s in sizes]
    elif -1 in sizes or fixed > n_devices:
        want = f"a multiple of {fixed}" if -1 in sizes else f"at least {fixed}"
        raise ConfigError(f"mesh: {' '.join(f'{a}={s}' for a, s in zip(MESH_AXES, sizes))} "
                          f"needs {want} devices, jax sees {n_devices}")
    return tuple(sizes)


def make_mesh(cfg, devices=None) -> Mesh:
    """The config's mesh over `devices` (default: every device of every process). Axes are
    Auto: shardings are hints the SPMD partitioner propagates, not part of array types."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(cfg.mesh, len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices[:math.prod(shape)])


# -- logical axes -> PartitionSpec -----------------------------------------------------------
def spec(logical_axes, shape, mesh_sizes: dict) -> P:
    """PartitionSpec for an array of `shape` whose dimensions have `logical_axes` names.

    Each dimension takes the mesh axes of its name, in order, while they divide it and no
    earlier dimension took them; size-1 mesh axes are left out. So a dimension too small or
    odd for the mesh is replicated, and a name's later axis may still apply."""
    used, out = set(), []
    for name, size in zip(logical_axes, shape):
        axes, split = [], 1
        for axis in LOGICAL[name] if name else ():
            n = mesh_sizes.get(axis, 1)
            if n > 1 and axis not in used and size % (split * n) == 0:
                axes.append(axis)
                split *= n
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_axes(path: str, ndim: int) -> tuple:
    """Logical names of a parameter's dimensions (None: unnamed) by `RULES`; `path` may have
    any prefix (an optimizer state's moments match their parameter's rule)."""
    for pattern, names in _RULES:
        if pattern.search(path) and ndim >= len(names):
            return (None,) * (ndim - len(names)) + tuple(names)
    return (None,) * ndim


def path_name(keys) -> str:
    """A tree path as the rules match it: "blocks.0.ffn.w_gate.kernel"."""
    return jax.tree_util.keystr(keys, simple=True, separator=".")


def tree_specs(tree, mesh: Mesh):
    """PartitionSpecs for a parameter tree or an optimizer state of one (same structure)."""
    sizes = dict(mesh.shape)
    return jax.tree_util.tree_map_with_path(
        lambda k, x: spec(param_axes(path_name(k), np.ndim(x)), np.shape(x), sizes), tree)


def tree_shardings(tree, mesh: Mesh):
    """NamedShardings for a parameter tree or an optimizer state (see `tree_specs`)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs(tree, mesh),
                        is_leaf=lambda s: isinstance(s, P))


def init_params(make, mesh: Mesh | None = None):
    """(graphdef, params) of the nnx module `make()` builds. On a mesh of several devices
    the parameters are created by one jitted program whose outputs are split by RULES, so
    each device makes only its shards and no parameter ever exists whole on one device;
    the values equal the one-device init's (jax's random bits do not depend on the layout;
    float32 rounding may differ in the last bit). On one device, eagerly: compiling the
    init program costs more than running it op by op."""
    from flax import nnx

    if mesh is None or mesh.size == 1:
        graphdef, state = nnx.split(make())
        return graphdef, nnx.to_pure_dict(state)
    graphdef, program = init_program(make, mesh)
    return graphdef, program()


def init_program(make, mesh: Mesh):
    """(graphdef, the jitted program that creates `make()`'s parameters split on `mesh`)."""
    from flax import nnx

    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    out = tree_shardings(nnx.to_pure_dict(abstract), mesh)
    return graphdef, jax.jit(lambda: nnx.to_pure_dict(nnx.state(make())), out_shardings=out)


def batch_sharding(mesh: Mesh, shape) -> NamedSharding:
    """Rows over data and fsdp (as many of them as divide the batch), the rest replicated."""
    return NamedSharding(mesh, spec(("batch",) + (None,) * (len(shape) - 1), shape,
                                    dict(mesh.shape)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put(tree, shardings):
    """Host values (the same on every process) laid out as global arrays. One process:
    device_put; several: each process fills only the shards its devices hold."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):  # one for every leaf
        shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(lambda x, s: jax.make_array_from_callback(
        np.shape(x), s, lambda idx, x=np.asarray(x): x[idx]), tree, shardings)


# -- activations -----------------------------------------------------------------------------
def constrain(x, logical_axes):
    """`x` constrained to the layout its dimensions' logical names give on the active mesh
    (jax.set_mesh, as the sharded train step traces under); a no-op without one, or on one
    device. For activations at layer boundaries, e.g. ("batch", "seq", "embed")."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, spec(logical_axes, x.shape, dict(mesh.shape)))


# -- processes -------------------------------------------------------------------------------
def _cluster_env() -> bool:
    """A launcher that started several processes of one job: jax's own env variable, or the
    clusters jax.distributed detects (SLURM, Open MPI, multi-host Cloud TPU)."""
    env = os.environ
    return bool(env.get("JAX_COORDINATOR_ADDRESS")
                or ("SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1") or 1) > 1)
                or int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1
                or "," in env.get("TPU_WORKER_HOSTNAMES", ""))


def initialize_distributed() -> bool:
    """Join a multi-process job when the environment describes one; call it before any other
    jax call. JAX_COORDINATOR_ADDRESS=host:port with JAX_NUM_PROCESSES and JAX_PROCESS_ID set
    by hand, otherwise jax's cluster auto-detection. True if it initialized."""
    if not _cluster_env() or jax.distributed.is_initialized():
        return False
    env = os.environ
    num = env.get("JAX_NUM_PROCESSES")
    pid = env.get("JAX_PROCESS_ID")
    jax.distributed.initialize(num_processes=int(num) if num else None,
                               process_id=int(pid) if pid else None)
    return True


# -- caches ----------------------------------------------------------------------------------
def row_axes(mesh: Mesh, batch: int) -> tuple[str, ...]:
    """The mesh axes a batch of `batch` rows is split over (as `batch_sharding` splits it)."""
    axes = spec(("batch",), (batch,), dict(mesh.shape))
    return () if not axes else axes[0] if isinstance(axes[0], tuple) else (axes[0],)


def row_shards(mesh: Mesh, batch: int) -> int:
    return math.prod(mesh.shape[a] for a in row_axes(mesh, batch))


def cache_specs(units, state, mesh: Mesh):
    """PartitionSpecs for a decode state (model.DecodeState) on `mesh`: every leaf split
    along its row axis over the batch's mesh axes, so each device holds the caches of its own
    rows: positions, rings, compressor states, contiguous caches, and the paged caches' page
    tables and pages (pool groups, one per row shard: paged.regroup); a unit's caches as
    dsattn.scan lays them out (`units`: scan.units). MHA's key/value heads also split over
    `tensor`; every other cached vector (an MLA latent, a V4 entry or indexer key, a window)
    is one vector that all heads read, kept whole on each device."""
    rows = row_axes(mesh, state.pos.shape[0]) or None
    tensor = mesh.shape.get("tensor", 1)
    return state.replace(pos=P(rows), overflow=P(rows), evaluations=P(rows),
                         layers=tuple(scan.layer_specs(u, c, rows, tensor)
                                      for u, c in zip(units, state.layers)))


def constrain_cache(units, state):
    """`state` constrained to `cache_specs` on the active mesh (a program's output cache keeps
    its input's layout, so the next call runs the same program); a no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return state
    return jax.tree.map(jax.lax.with_sharding_constraint, state,
                        cache_specs(units, state, mesh))


def cache_shardings(units, state, mesh: Mesh):
    """NamedShardings of `cache_specs`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(units, state, mesh),
                        is_leaf=lambda s: isinstance(s, P))
