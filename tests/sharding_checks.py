"""The multi-device checks of tests/test_sharding.py, run in their own process with 8 CPU
host devices (the rest of the suite sees one): sharded forward, train step, prefill and
decode against one device (with the XLA reads, and with the kernels: every Pallas call under
shard_map), a checkpoint restored onto another mesh shape, and how parameters (born split:
the sharded init program) and caches are split.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_ENABLE_X64=1 \\
        python tests/sharding_checks.py RUN_DIR

Prints one JSON object: {check name: value}; the pytest side asserts on them.

With --small (and 2 host devices) it runs the fast tier's cheaper version: every family's
forward on a 2-way tensor mesh, prefill + decode on a 2-way batch mesh (V4's paged cache)
and a 2-way tensor mesh (MLA), one train step on a 2-way fsdp mesh, each against one device.
"""

import concurrent.futures
import json
import os
import re
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dsattn import checkpoint, generate, sharding  # noqa: E402
from dsattn.bench.compiles import compilations  # noqa: E402
from dsattn.model import Transformer  # noqa: E402
from dsattn.train import Trainer  # noqa: E402
from tests.helpers import preset  # noqa: E402

T0 = time.perf_counter()
MESHES = ((8, 1, 1), (2, 2, 2), (1, 1, 8))
PRESETS = ("mla", "v4", "v41")
# Cached execution: each preset on one mesh, every mesh once (prefill and decode compile
# per engine, so all nine pairs took most of this file's time): MLA's heads over tensor, V4's
# paged cache over rows (paged_split), V4.1 on the mixed mesh.
DECODE_MESHES = {"mla": (1, 1, 8), "v4": (8, 1, 1), "v41": (2, 2, 2)}
SMALL_PRESETS = ("mha", "gqa", "mla", "dsa", "v4", "v41")  # --small: every family, 2 devices
SMALL_DECODE_MESHES = {"v4": (2, 1, 1), "mla": (1, 1, 2)}
TRAIN_PRESET = "mla"  # the train step and checkpoint checks (the fastest to compile)
# Small enough to compile fast; 8 rows divide every mesh's data x fsdp. Scanned layers: MLA's
# 4 layers hold their parameters stacked (a leading axis the rules leave unsplit).
SMALL = ("model.dtype=float64", "model.scan_layers=true", "train.batch_size=8",
         "train.seq_len=32", "train.eval_batches=1", "train.warmup_steps=0",
         "data.max_bytes=200000")


def mesh_args(shape) -> tuple:
    return tuple(f"mesh.{a}={n}" for a, n in zip(sharding.MESH_AXES, shape))


def host(tree):
    """Every leaf as a numpy array (sharded arrays gathered)."""
    return jax.tree.map(np.asarray, tree)


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y), initial=0.0))
               for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b))))


_forward = jax.jit(lambda graphdef, params, tokens: nnx.merge(
    graphdef, nnx.State(params))(tokens), static_argnums=0)


def forward(graphdef, params, tokens, mesh=None):
    """Logits; with `mesh`, params and tokens laid out on it first (jit follows them)."""
    if mesh is None:
        return np.asarray(_forward(graphdef, params, tokens))
    with jax.set_mesh(mesh):
        params = jax.device_put(params, sharding.tree_shardings(params, mesh))
        tokens = jax.device_put(tokens, sharding.batch_sharding(mesh, tokens.shape))
        return np.asarray(_forward(graphdef, params, tokens))


def forward_checks(out: dict, tokens, meshes: dict, presets=PRESETS):
    """Sharded forward logits vs one device, for every preset and mesh."""
    for name in presets:
        cfg = preset(name, *SMALL)
        graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
        params = nnx.to_pure_dict(state)
        want = forward(graphdef, params, tokens)
        for shape, mesh in meshes.items():
            out[f"forward/{name}/{shape}"] = max_diff(forward(graphdef, params, tokens, mesh),
                                                      want)
    out["time/forward"] = time.perf_counter() - T0


def decode_checks(out: dict, tokens, decode_meshes=DECODE_MESHES, overrides=(),
                  label="decode"):
    """Sharded prefill + decode steps vs one device for every preset on its mesh
    (DECODE_MESHES), the decode program compiled once per engine, and how a paged cache is
    split on (8, 1, 1)."""
    tokens = np.asarray(tokens)
    lengths = np.array([5, 17, 9, 12, 3, 20, 8, 11])
    for name in decode_meshes:
        model = Transformer(preset(name, *SMALL, *overrides), rngs=nnx.Rngs(0))

        def run(mesh=None):
            eng = generate.Engine(model, mesh)
            logits, cache = eng.prefill(tokens[:, :24], lengths, eng.init_cache(8, 32))
            steps, compiled = [np.asarray(logits)], 0
            for s in range(2):
                with compilations() as c:
                    logits, cache = eng.decode_step(tokens[np.arange(8), lengths + s], cache)
                compiled += c.n
                steps.append(np.asarray(logits))
            return np.stack(steps), cache, compiled

        want, _, _ = run()
        shape = decode_meshes[name]
        got, cache, compiled = run(sharding.make_mesh(preset(name, *mesh_args(shape))))
        out[f"{label}/{name}/{shape}"] = float(np.max(np.abs(got - want)))
        out[f"{label}/{name}/{shape}/compiled"] = compiled
        if name == "v4" and not overrides:
            out.update(paged_split(cache))
    out[f"time/{label}"] = time.perf_counter() - T0


# The kernels on a mesh (kernels/mesh.py: every Pallas call under shard_map), interpreted
# here: decode of each preset on its mesh and a train step with FSDP, against one device.
KERNELS = ("attention.impl=pallas_gpu", "indexer.impl=pallas_gpu")
KERNEL_DECODE_MESHES = {"v4": (8, 1, 1), "dsa": (2, 2, 2), "mla": (1, 1, 8)}
KERNEL_TRAIN = ("v4", (1, 8, 1))


def kernel_checks(out: dict, run_root: str, tokens):
    decode_checks(out, tokens, KERNEL_DECODE_MESHES, KERNELS, label="kernels/decode")
    name, shape = KERNEL_TRAIN
    single = Trainer(preset(name, *SMALL, *KERNELS), os.path.join(run_root, "k-single"),
                     quiet=True)
    batch = {k: np.asarray(v) for k, v in single.val_batches[0].items()}
    single.train_step(batch, 0)
    tr = Trainer(preset(name, *SMALL, *KERNELS, *mesh_args(shape)),
                 os.path.join(run_root, "k-mesh"), quiet=True)
    tr.train_step(batch, 0)
    out[f"kernels/train/{name}/{shape}"] = max_diff(tr.params, host(single.params))
    out["time/kernels"] = time.perf_counter() - T0


def paged_split(state) -> dict:
    """Shards of the first paged cache: its pages and page table, one row block per device,
    and the largest page id each device's rows hold (ids are local to the device's pages)."""
    from dsattn.cache.paged import PagedCache

    cache = next(c for c in jax.tree.leaves(state.layers,
                                            is_leaf=lambda c: isinstance(c, PagedCache))
                 if isinstance(c, PagedCache))
    pages = next(iter(cache.pages["entry"].values()))
    return {"paged/pages": [list(pages.shape), sorted({tuple(s.data.shape)
                                                       for s in pages.addressable_shards})],
            "paged/table": [list(cache.page_table.shape), sorted(
                {tuple(s.data.shape) for s in cache.page_table.addressable_shards})],
            "paged/max_local_id": max(int(np.max(s.data)) for s in
                                      cache.page_table.addressable_shards),
            "paged/rows_with_pages": int(np.sum(np.asarray(cache.length) > 0)),
            "paged/groups": cache.groups}


def split_checks(out: dict, trainer: Trainer):
    """Shard shapes of a few parameters and of their optimizer moments on (2, 2, 2)."""
    # MLA's 4 layers are one scanned group: parameters stacked [4, ...] (the copies unsplit)
    layer = ("blocks", 0, "layers", 0)
    named = {
        "ffn.w_gate": layer + ("ffn", "w_gate", "kernel"),  # [4, d_model, ffn] (-, fsdp, tensor)
        "ffn.w_down": layer + ("ffn", "w_down", "kernel"),  # [4, ffn, d_model] (-, tensor, fsdp)
        "attn.wq_b": layer + ("attn", "wq_b", "kernel"),  # MLA [4, q_lora, H*(dn+dr)]
        "embedding": ("embedding", "embed", "embedding"),  # [vocab, d_model] (tensor, fsdp)
        "norm": ("norm", "weight"),  # replicated
    }
    paths = {jax.tree_util.keystr(p, simple=True, separator="."): x
             for p, x in jax.tree_util.tree_leaves_with_path(trainer.opt_state)}
    mu = {k.split(".mu.", 1)[1]: x for k, x in paths.items() if ".mu." in k}  # Adam's 1st moment
    for label, keys in named.items():
        x = trainer.params
        for k in keys:
            x = x[k]
        m = mu[".".join(map(str, keys))]
        out[f"split/{label}"] = {
            "shape": list(x.shape), "spec": [list(s) if isinstance(s, tuple) else s
                                             for s in x.sharding.spec],
            "shards": sorted({tuple(s.data.shape) for s in x.addressable_shards}),
            "mu_shards": sorted({tuple(s.data.shape) for s in m.addressable_shards}),
            "n_shards": len(x.addressable_shards)}


def init_checks(out: dict):
    """The sharded init program (sharding.init_program) on (2, 2, 2): per-device output and
    temporary bytes against the parameters' total and largest sizes."""
    cfg = preset(TRAIN_PRESET, *SMALL, *mesh_args((2, 2, 2)))
    make = lambda: Transformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    _, program = sharding.init_program(make, sharding.make_mesh(cfg))
    mem = program.lower().compile().memory_analysis()
    sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.eval_shape(make))]
    out["init/output_bytes"] = int(mem.output_size_in_bytes)
    out["init/temp_bytes"] = int(mem.temp_size_in_bytes)
    out["init/total_bytes"], out["init/largest_bytes"] = int(sum(sizes)), int(max(sizes))


def step_counting_int_collectives(trainer: Trainer, batch) -> dict:
    """One step of `trainer` on `batch`; {op: count} of the collectives its compiled program
    runs on integer arrays (token rows moving between devices)."""
    with jax.set_mesh(trainer.mesh):
        args = (trainer.params, trainer.opt_state, trainer.trainstep.batch(batch), jnp.int32(0))
        compiled = trainer.trainstep.train.lower(*args).compile()
        trainer.params, trainer.opt_state, _ = compiled(*args)
    ops = re.findall(r"= \(?[su]\d+\[[^\n]*? (all-gather|all-to-all|collective-permute|"
                     r"all-reduce|reduce-scatter)(?:-start)?\(", compiled.as_text())
    return {op: ops.count(op) for op in sorted(set(ops))}


def train_checks(out: dict, run_root: str, tokens):
    """One sharded train step vs one single-device step, and in two micro-batches
    (train.grad_accum) on (2, 2, 2); the split of params and moments; a checkpoint saved on
    (4, 1, 2) restored on (1, 1, 8)."""
    base = preset(TRAIN_PRESET, *SMALL)
    single = Trainer(base, os.path.join(run_root, "single"), quiet=True)
    batch = {k: np.asarray(v) for k, v in single.val_batches[0].items()}
    single.train_step(batch, 0)
    want = host(single.params)
    out["time/train_single"] = time.perf_counter() - T0
    for shape in MESHES:
        cfg = preset(TRAIN_PRESET, *SMALL, *mesh_args(shape))
        tr = Trainer(cfg, os.path.join(run_root, f"mesh{shape}"), quiet=True)
        out[f"train/{shape}/sharded"] = tr.mesh is not None
        if shape == (2, 2, 2):
            out["train/int_collectives"] = step_counting_int_collectives(tr, batch)
        else:
            tr.train_step(batch, 0)
        out[f"train/{shape}"] = max_diff(tr.params, want)
        if shape == (2, 2, 2):
            split_checks(out, tr)
        out[f"time/train{shape}"] = time.perf_counter() - T0
    # The same step in two micro-batches of 4 rows (train.grad_accum), one row per device
    accum = Trainer(preset(TRAIN_PRESET, *SMALL, *mesh_args((2, 2, 2)), "train.grad_accum=2"),
                    os.path.join(run_root, "accum"), quiet=True)
    out["train/accum/int_collectives"] = step_counting_int_collectives(accum, batch)
    out["train/accum"] = max_diff(accum.params, want)
    out["time/train_accum"] = time.perf_counter() - T0

    # Saved on (4, 1, 2) with the stepped parameters and moments (as Trainer.save does),
    # restored on (1, 1, 8) by a Trainer.
    run_dir = os.path.join(run_root, "ckpt")
    cfg = preset(TRAIN_PRESET, *SMALL, *mesh_args((4, 1, 2)))
    mesh = sharding.make_mesh(cfg)
    opt_state = host(single.opt_state)
    checkpoint.save_config(Path(run_dir), cfg)
    mngr = checkpoint.manager(Path(run_dir), 2, writer=True)
    checkpoint.save(mngr, 1, params=jax.device_put(want, sharding.tree_shardings(want, mesh)),
                    opt_state=jax.device_put(opt_state,
                                             sharding.tree_shardings(opt_state, mesh)))
    mngr.wait_until_finished()
    out["ckpt/saved_shards"] = sorted({tuple(s.data.shape) for s in jax.device_put(
        want, sharding.tree_shardings(want, mesh))["blocks"][0]["layers"][0]["ffn"]["w_gate"]["kernel"]
        .addressable_shards})
    loader = Trainer(preset(TRAIN_PRESET, *SMALL, *mesh_args((1, 1, 8))), run_dir, quiet=True)
    out["ckpt/step"] = loader.step
    out["ckpt/params"] = max_diff(loader.params, want)
    out["ckpt/opt_state"] = max_diff(loader.opt_state, opt_state)
    leaf = loader.params["blocks"][0]["layers"][0]["ffn"]["w_gate"]["kernel"]
    out["ckpt/w_gate_shards"] = sorted({tuple(s.data.shape) for s in leaf.addressable_shards})
    # single's graphdef equals the forward checks' (same config): their compiled forwards
    out["ckpt/logits"] = max_diff(forward(single.graphdef, loader.params, tokens, loader.mesh),
                                  forward(single.graphdef, want, tokens))


def small_checks(out: dict, run_root: str, tokens):
    """--small: the fast tier's 2-device checks (see the module's docstring)."""
    meshes = {(1, 1, 2): sharding.make_mesh(preset("mla", *mesh_args((1, 1, 2))))}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        parts = [pool.submit(forward_checks, out, tokens, meshes, SMALL_PRESETS),
                 pool.submit(small_train_and_decode, out, run_root, tokens)]
    for part in parts:
        part.result()


def small_train_and_decode(out: dict, run_root: str, tokens):
    base = preset(TRAIN_PRESET, *SMALL)
    single = Trainer(base, os.path.join(run_root, "single"), quiet=True)
    batch = {k: np.asarray(v) for k, v in single.val_batches[0].items()}
    single.train_step(batch, 0)
    shape = (1, 2, 1)
    tr = Trainer(preset(TRAIN_PRESET, *SMALL, *mesh_args(shape)),
                 os.path.join(run_root, f"mesh{shape}"), quiet=True)
    out[f"train/{shape}/sharded"] = tr.mesh is not None
    tr.train_step(batch, 0)
    out[f"train/{shape}"] = max_diff(tr.params, host(single.params))
    out["time/train"] = time.perf_counter() - T0
    decode_checks(out, tokens, SMALL_DECODE_MESHES)


def main(run_root: str, small: bool = False):
    out = {"devices": jax.device_count(), "x64": bool(jax.config.jax_enable_x64)}
    if small:
        tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (8, 32)))
        small_checks(out, run_root, tokens)
        out["time/total"] = time.perf_counter() - T0
        print(json.dumps(out))
        return
    meshes = {shape: sharding.make_mesh(preset("mla", *mesh_args(shape)))
              for shape in MESHES}
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (8, 32)))
    # Two threads: compiling is most of the time, and XLA compiles outside the GIL (jax's
    # mesh context and nnx's graph context are per thread).
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        parts = [pool.submit(forward_checks, out, tokens, meshes),
                 pool.submit(train_checks, out, run_root, tokens),
                 pool.submit(decode_checks, out, tokens), pool.submit(init_checks, out),
                 pool.submit(kernel_checks, out, run_root, tokens)]
    for part in parts:
        part.result()  # re-raises a failed check
    out["time/total"] = time.perf_counter() - T0
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], small="--small" in sys.argv[2:])
