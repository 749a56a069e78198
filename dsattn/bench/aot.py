"""Every preset's programs compiled for a chip that is not here (dsattn.targets), as users
run them, with what the compiled program says: whether it compiles (or the one-line error),
compile time, argument / temporary / output bytes, the kernels one run launches (from the
optimized HLO: dsattn.bench.hlo), a bytes and FLOPs roofline and, on a TPU, XLA's cost model
where it can be trusted. scripts/aot_check.py writes the rows to docs/bench/aot_<target>.

The programs (`PROGRAMS`), each under `attention.impl=xla indexer.impl=xla` ("xla") and
under `auto` for both ("kernels": the target's kernels wherever they fit the config; the row
says which implementation each op resolved to, and why not a kernel):

    train        the real TrainStep (AdamW, bf16 compute over fp32 master weights), 4 x 8192
    train_long   the same at 1 x 32768
    prefill      one prefill chunk (generate.PREFILL_CHUNK tokens) over a 32K cache, batch 1
    decode       one decode step at batch 1, at 32K and at 128K cached tokens
    decode_max   the decode step at the largest batch whose compiled program fits the chip
                 (memory at batch 1 and 2, extrapolated, then compiled at that batch)
    decode_flat  the decode step at batch 1 and 32K with its layers unrolled
                 (model.scan_layers=false): no loop, so a TPU's cost model holds for it
    train_max    the training step at 8192 tokens a row, at the largest batch that fits (as
                 decode_max)
                 (decode_flat and train_max are not in the default set)
    serve        the serving scheduler's programs over 8 rows of a 32K cache: the step that
                 decodes every row (width 1), a prefill chunk of 64 over one row's sub-batch,
                 per-row sampling and clearing rows

On a mesh (`mesh=True`: the target's `mesh_topology`) the training step runs FSDP over every
chip and the decode step splits its rows over them (data), both as dsattn.sharding lays
them out.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from dsattn import config, flops, generate, kvbytes, sharding, targets
from dsattn.bench import hlo
from dsattn.kernels import registry
from dsattn.model import Transformer
from dsattn.trainstep import TrainStep

IMPLS = {"xla": ("attention.impl=xla", "indexer.impl=xla"),
         "kernels": ("attention.impl=auto", "indexer.impl=auto")}
CONTEXTS = (32768, 131072)
SERVE_ROWS, SERVE_CHUNK, SERVE_CONTEXT = 8, 64, 32768


@dataclasses.dataclass(frozen=True)
class Spec:
    """One program to compile: `program` of PROGRAMS at `batch` x `length` (tokens of a
    training row, or cached tokens), for the target's one chip or its mesh."""

    preset: str
    impl: str
    program: str
    batch: int
    length: int
    mesh: bool = False

    @property
    def key(self) -> str:
        where = "mesh" if self.mesh else "chip"
        return f"{self.preset}/{self.impl}/{self.program}/{self.batch}x{self.length}/{where}"


def preset_config(configs_dir, preset: str, impl: str, *overrides) -> config.Config:
    return config.load(f"{configs_dir}/{preset}.yaml", [*IMPLS[impl], *overrides])


def make_mesh(devices, shape) -> Mesh:
    """A (data, fsdp, tensor) mesh of `shape` over `devices` (a target's, from a topology)."""
    n = math.prod(shape)
    return Mesh(np.array(devices[:n]).reshape(shape), sharding.MESH_AXES,
                axis_types=(AxisType.Auto,) * 3)


def _placed(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


# -- the programs --------------------------------------------------------------------------
def train(cfg, devices, batch: int, seq: int, mesh: bool):
    """The traced TrainStep.train of `cfg` at batch x seq: FSDP over `devices` on a mesh."""
    cfg = config.with_values(cfg, {("train", "batch_size"): batch, ("train", "seq_len"): seq,
                                   ("model", "max_seq_len"): max(cfg.model.max_seq_len, seq)})
    m = make_mesh(devices, (1, len(devices), 1) if mesh else (1, 1, 1))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    params = nnx.to_pure_dict(state)
    step = TrainStep(cfg, graphdef, params, m)
    opt = jax.eval_shape(step.tx.init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    with step.on_mesh():
        traced = step.train.trace(params, opt, {"inputs": tokens, "targets": tokens},
                                  jax.ShapeDtypeStruct((), jnp.int32))
    tok = batch * seq
    return traced, {"flops": flops.train_flops_per_token(cfg, seq) * tok, "tokens": tok}


def _engine_args(cfg, devices, batch: int, context: int, mesh: bool, pool_tokens=None):
    """(graph, weights, cache, mesh) as abstract arrays laid out on `devices`."""
    from dsattn.bench.lower import abstract_engine
    from dsattn.serve.pool import with_pool

    cfg = config.with_values(cfg, {("model", "max_seq_len"): max(cfg.model.max_seq_len,
                                                                 context)})
    eng = abstract_engine(cfg)
    m = make_mesh(devices, (len(devices), 1, 1) if mesh else (1, 1, 1))
    shapes = nnx.merge(eng.graph.graphdef, nnx.State(eng.state))
    groups = sharding.row_shards(m, batch)

    def make():
        state = shapes.init_cache(batch, context)
        if pool_tokens is not None:
            state = with_pool(cfg, state, pool_tokens)
        return generate.split_pools(state, groups)

    cache = jax.eval_shape(make)
    weights = _placed(eng.state, sharding.tree_shardings(eng.state, m))
    cache = _placed(cache, sharding.cache_shardings(eng.units, cache, m))
    return cfg, eng, weights, cache, m


def decode(cfg, devices, batch: int, context: int, mesh: bool):
    cfg, eng, weights, cache, m = _engine_args(cfg, devices, batch, context, mesh)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32,
                                  sharding=sharding.batch_sharding(m, (batch,)))
    with jax.set_mesh(m):
        traced = generate.decode_program.trace(eng.graph, weights, tokens, cache)
    read = kvbytes.report(cfg, context)["read_bytes"]
    return traced, {"flops": flops.decode_flops_per_token(cfg, context) * batch,
                    "bytes": eng.weight_bytes + batch * read, "tokens": batch}


def prefill(cfg, devices, batch: int, context: int, mesh: bool,
            chunk: int = generate.PREFILL_CHUNK):
    cfg, eng, weights, cache, m = _engine_args(cfg, devices, batch, context, mesh)
    rows = sharding.batch_sharding(m, (batch,))
    tokens = jax.ShapeDtypeStruct((batch, chunk), jnp.int32,
                                  sharding=sharding.batch_sharding(m, (batch, chunk)))
    n_new = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
    with jax.set_mesh(m):
        traced = generate.prefill_program.trace(eng.graph, weights, tokens, n_new, cache,
                                                None, None)
    return traced, {"flops": flops.decode_flops_per_token(cfg, context) * batch * chunk,
                    "tokens": batch * chunk}


def serve(cfg, devices, rows: int, context: int, mesh: bool):
    """The scheduler's programs: {name: (traced, facts)} (module docstring)."""
    from dsattn.serve import programs

    out = {"serve_step": prefill(cfg, devices, rows, context, mesh, chunk=1),
           "serve_chunk": prefill(cfg, devices, 1, context, mesh, chunk=SERVE_CHUNK)}
    cfg2, eng, weights, cache, m = _engine_args(cfg, devices, rows, context, mesh)
    vocab = cfg.model.vocab_size
    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32)
    ints = jax.ShapeDtypeStruct((rows,), jnp.int32)
    floats = jax.ShapeDtypeStruct((rows,), jnp.float32)
    with jax.set_mesh(m):
        out["sample_rows"] = (programs.sample_rows.trace(logits, ints, ints, floats, floats),
                              {"tokens": rows})
        blank = _engine_args(cfg, devices, 1, context, False)[3]
        out["clear_rows"] = (programs.clear_rows.trace(
            eng.units, cache, jax.ShapeDtypeStruct((rows,), jnp.bool_), blank), {})
    return out


PROGRAMS = ("train", "train_long", "prefill", "decode", "decode_max", "serve", "decode_flat",
            "train_max")
DEFAULT_PROGRAMS = PROGRAMS[:-2]


# -- compiling and reading the result --------------------------------------------------------
def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    first = next((ln for ln in text if "RESOURCE_EXHAUSTED" in ln or "Error" in ln), text[0])
    return first[:400]


def choices(cfg, platform: str) -> dict:
    """{op's config key: the implementation a program lowered for `platform` runs, and why
    not a kernel where the platform has one that does not fit}."""
    out = {}
    for op, name, fmt, key in ((registry.Op.ATTENTION, cfg.attention.impl, None, None),
                               (registry.Op.INDEXER_SCORE, cfg.indexer.impl,
                                cfg.cache.key_format, "cache.key_format")):
        chosen = registry.resolve(op, cfg, name, fmt, key or "format").on(platform)
        entry = {"runs": chosen}
        if chosen == registry.reference(op) and name == registry.AUTO:
            for k in registry.kernels(op):
                e = registry.get(op, k)
                if e.platforms and e.runs_on(platform):
                    why = e.why_not(cfg) or (None if fmt is None or e.reads(fmt) else
                                             f"it does not read {key}={fmt}")
                    entry["kernel_refused"] = f"{k}: {why}"
                    break
        out[op.value] = entry
    return out


def analyse(traced, facts: dict, target: targets.Target, n_layers: int) -> dict:
    """Compile `traced` and read the row's figures off the compiled program."""
    row = {"compiled": False}
    t0 = time.perf_counter()
    try:
        lowered = traced.lower()  # a Mosaic kernel outside shard_map fails here, on a mesh
        try:
            compiled = lowered.compile()
        except Exception as e:  # noqa: BLE001 - one XLA:GPU failure has a known way round
            if target.platform != "cuda" or "Couldn't find output tile sizes" not in str(e):
                raise
            # XLA's deviceless GEMM fusion finds no tiling for some fused dots (a device's
            # autotuner picks among its configs instead): compile with cuBLAS's GEMMs
            row["retried"] = {"error": _one_line(e), "with": "xla_gpu_enable_triton_gemm=false"}
            compiled = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
    except Exception as e:  # noqa: BLE001 - a row records any compile failure in one line
        row.update(error=_one_line(e), compile_s=round(time.perf_counter() - t0, 1))
        if re.search(r"Ran out of memory|exceeds available HBM", row["error"]):
            row["fits"] = False  # libtpu refuses a program larger than the chip's memory
            asked = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT])\)",
                              row["error"])
            if asked:  # what it asked for, for the search of the largest batch
                row["asked_bytes"] = int(float(asked.group(1)) * 1024 ** " KMGT".index(
                    asked.group(2)))
        return row
    row.update(compiled=True, compile_s=round(time.perf_counter() - t0, 1))
    mem = compiled.memory_analysis()
    arg, temp = int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes)
    out, alias = int(mem.output_size_in_bytes), int(mem.alias_size_in_bytes)
    peak = arg + temp + out - alias
    row.update(argument_bytes=arg, temp_bytes=temp, output_bytes=out, alias_bytes=alias,
               peak_bytes=peak, fits=peak <= target.usable_bytes)
    text = compiled.as_text()
    launches = hlo.launches(text)
    customs = {k.removeprefix("custom-call "): v for k, v in launches.by_kind.items()
               if k.startswith("custom-call ")}
    row["kernels"] = {"per_step": launches.total,
                      "per_layer": round(launches.per(n_layers), 1),
                      "fusions": launches.by_kind.get("fusion", 0),
                      "fusion_names": dict(list(launches.fusions.items())[:12]),
                      "custom_calls": customs,
                      # every kernel it may launch, in any branch of its conditionals
                      "custom_call_names": sorted(k.removeprefix("custom-call ")
                                                  for k in launches.kinds
                                                  if k.startswith("custom-call ")),
                      "collectives": {k.removeprefix("collective "): v
                                      for k, v in launches.by_kind.items()
                                      if k.startswith("collective ")},
                      "other": {k: v for k, v in launches.by_kind.items()
                                if k != "fusion" and not k.startswith(("custom-call ",
                                                                        "collective "))},
                      "loops": [{"trip_count": n, "kernels_per_trip": k}
                                for _, n, k in launches.loops]}
    roof = {}
    if facts.get("flops"):
        roof["flops"] = facts["flops"]
        roof["compute_s"] = facts["flops"] / target.peak_bf16_flops
    if facts.get("bytes"):
        roof["bytes"] = facts["bytes"]
        roof["memory_s"] = facts["bytes"] / target.bandwidth_bytes_per_s
    if roof:
        roof["roofline_s"] = max(roof.get("compute_s", 0), roof.get("memory_s", 0))
        row["roofline"] = roof
    if target.platform == "tpu":
        row["cost_model"] = _cost_model(compiled, launches)
    return row


def _cost_model(compiled, launches: hlo.Launches) -> dict:
    """XLA's TPU cost model, only for a program without loops: it counts a loop's body once
    whatever its trip count, so with loops its figures are not the program's. Its time
    (`optimal_seconds`) is kept only for a program without custom calls (a Mosaic kernel,
    libtpu's own): with them it is not a time (negative: -4.0 s for a tiny V4 decode step)."""
    looped = [n for _, n, _ in launches.loops if n != 1]
    if looped:
        trips = ", ".join(sorted({str(n) for n in looped}))
        return {"trusted": False, "why": f"{len(looped)} loops: XLA's cost model counts a "
                                         f"loop body once (trip counts {trips})"}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    keep = {k: float(v) for k, v in (cost or {}).items() if k in ("flops", "bytes accessed")}
    customs = sum(v for k, v in launches.by_kind.items() if k.startswith("custom-call "))
    why = "no loops: the whole program as compiled"
    if customs:
        why += (f"; with its {customs} custom calls the model's time is not a time "
                f"({float(cost['optimal_seconds']):.3g} s): left out")
    else:
        keep["optimal_seconds"] = float(cost["optimal_seconds"])
    return {"trusted": True, "why": why, **keep}


def max_batch(peak_at, usable: float, cap: int = 1 << 14) -> int | None:
    """The largest batch whose program fits `usable` bytes, from `peak_at(b)` (compiled peak
    bytes at batch b; for a program refused for its size, what it asked for; None where
    nothing is known): linear through batch 1 and 2, checked at that estimate, then
    narrowed to within 1/32 between the largest that fits and the smallest that does not,
    by the line through them (a TPU pads small batches, so batch 1 and 2 may weigh the
    same), else halfway. An estimate that fits is not the answer: batch 2 may cost more
    than a row past it, so the line through the two largest that fit goes on up until a
    batch does not fit (or gains less than 1/32). None: not even batch 1 fits."""
    p1, p2 = peak_at(1), peak_at(2)
    if p1 is None or p1 > usable:
        return None
    if p2 is None or p2 > usable:
        return 1
    per_row = max(p2 - p1, 1)
    lo, p_lo = 2, p2  # fits
    hi = max(3, min(cap, int((usable - (p1 - per_row)) // per_row)))
    while (p_hi := peak_at(hi)) is not None and p_hi <= usable:
        if hi >= cap:
            return hi
        per_row = max((p_hi - p_lo) / (hi - lo), 1)
        lo, p_lo = hi, p_hi
        hi = min(cap, lo + int((usable - p_lo) // per_row))
        if hi - lo <= max(1, lo // 32):
            return lo
    while hi - lo > max(1, lo // 32):
        mid = (lo + hi) // 2
        if p_hi is not None and p_hi > p_lo:  # where the line through both meets `usable`
            mid = lo + int((usable - p_lo) * (hi - lo) / (p_hi - p_lo))
        mid = min(max(mid, lo + 1), hi - 1)
        p = peak_at(mid)
        if p is not None and p <= usable:
            lo, p_lo = mid, p
        else:
            hi, p_hi = mid, p
    return lo


def search_weight(row: dict, usable: int) -> int | None:
    """A row's bytes for `max_batch`: a compiled program's peak; for one refused for its size,
    what it asked for, and never a size that fits (libtpu names only the temporaries and
    refuses them against its own limit, which may be below `usable`); None for any other
    failure."""
    if row.get("compiled"):
        return row["peak_bytes"]
    if row.get("fits") is False and "asked_bytes" in row:
        return max(row["asked_bytes"], usable + 1)
    return None


def rows_for(spec: Spec, target: targets.Target, devices, configs_dir, log=print) -> list:
    """The report rows of one Spec (decode_max and serve give several)."""
    cfg = preset_config(configs_dir, spec.preset, spec.impl)
    base = {"target": target.name, "preset": spec.preset, "impl": spec.impl,
            "mesh": target.mesh_topology if spec.mesh else "1 chip",
            "chips": len(devices), "implementations": choices(cfg, target.platform)}
    n_layers = cfg.model.n_layers

    def row(program, traced_facts, batch, length):
        with targets.building_for(target):
            traced, facts = traced_facts() if callable(traced_facts) else traced_facts
        r = {**base, "program": program, "batch": batch, "length": length,
             **analyse(traced, facts, target, n_layers)}
        log(_summary(r))
        return r

    def built(fn, *args):
        """Trace under the target (its kernel limits); a trace error is the row's error."""
        with targets.building_for(target):
            return fn(*args)

    if (spec.impl == "kernels" and spec.program.startswith("train")
            and base["implementations"]["attention.impl"]["runs"] == registry.reference(
                registry.Op.ATTENTION)):
        # training scores the indexer by XLA (indexer.IN_TRAINING): no kernel is left
        r = {**base, "program": spec.program, "batch": spec.batch, "length": spec.length,
             "compiled": None, "same_as": "xla",
             "why": f"no attention kernel runs on {target.platform} for this config, and "
                    f"training scores the indexer by XLA: the xla row's program"}
        log(_summary(r))
        return [r]
    try:
        if spec.program in ("train", "train_long"):
            return [row(spec.program, lambda: built(train, cfg, devices, spec.batch,
                                                    spec.length, spec.mesh),
                        spec.batch, spec.length)]
        if spec.program == "prefill":
            return [row("prefill", lambda: built(prefill, cfg, devices, spec.batch,
                                                 spec.length, spec.mesh),
                        spec.batch, spec.length)]
        if spec.program == "decode":
            return [row("decode", lambda: built(decode, cfg, devices, spec.batch, spec.length,
                                                spec.mesh), spec.batch, spec.length)]
        if spec.program == "decode_flat":  # unrolled: no loop, so a TPU's cost model holds
            flat = config.with_values(cfg, {("model", "scan_layers"): False})
            return [row("decode_flat", lambda: built(decode, flat, devices, spec.batch,
                                                     spec.length, spec.mesh),
                        spec.batch, spec.length)]
        if spec.program in ("decode_max", "train_max"):
            found = {}
            program = decode if spec.program == "decode_max" else train

            def peak_at(b):
                if b not in found:
                    found[b] = row(spec.program, lambda: built(
                        program, cfg, devices, b, spec.length, spec.mesh), b, spec.length)
                return search_weight(found[b], target.usable_bytes)

            b = max_batch(peak_at, target.usable_bytes)
            if b is None:
                return [{**found[1], "largest_fitting_batch": 0}]
            return [{**found[b], "largest_fitting_batch": b}]
        if spec.program == "serve":
            progs = built(serve, cfg, devices, spec.batch, spec.length, spec.mesh)
            return [row(name, tf, spec.batch, spec.length) for name, tf in progs.items()]
    except Exception as e:  # noqa: BLE001 - a trace failure is the row's one-line error
        r = {**base, "program": spec.program, "batch": spec.batch, "length": spec.length,
             "compiled": False, "error": _one_line(e)}
        log(_summary(r))
        return [r]
    raise ValueError(f"unknown program {spec.program!r}; known: {', '.join(PROGRAMS)}")


def specs(presets, impls, programs, mesh: bool, chips: int = 1) -> list[Spec]:
    """The programs to compile. On a mesh of `chips` a training step and a decode step take
    at least a row per chip, so every chip holds rows of its own."""
    rows = chips if mesh else 1
    shapes = {"train": [(max(4, rows), 8192)], "train_long": [(rows, 32768)],
              "prefill": [(rows, 32768)], "decode": [(rows, c) for c in CONTEXTS],
              "decode_max": [(0, c) for c in CONTEXTS], "serve": [(SERVE_ROWS, SERVE_CONTEXT)],
              "decode_flat": [(rows, CONTEXTS[0])], "train_max": [(0, 8192)]}
    out = []
    for program in programs:
        if program not in shapes:
            raise ValueError(f"unknown program {program!r}; known: {', '.join(PROGRAMS)}")
    for preset in presets:
        for impl in impls:
            for program in programs:
                out.extend(Spec(preset, impl, program, b, n, mesh) for b, n in shapes[program])
    return out


# -- the kernels' shared memory, measured ----------------------------------------------------
def shared_memory_request(target: targets.Target, f, shapes) -> int:
    """The most shared memory (bytes) any Triton kernel of jit(f) at `shapes` ((shape,
    dtype) pairs) asks a block for on GPU `target`: compiled for a copy of the target that
    allows 1 KiB, XLA names the first kernel's request, which the next compile allows, and
    so on until the program compiles."""
    limit, request = 1024, 0
    while True:
        gpu = {**target.gpu, "shared_memory_per_block_optin": limit,
               "shared_memory_per_block": min(limit, target.gpu["shared_memory_per_block"])}
        device = dataclasses.replace(target, gpu=gpu).devices()[0]
        mesh = Mesh(np.array([device]), ("x",))
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
                for shape, dtype in shapes]
        try:
            jax.jit(f).trace(*args).lower().compile()
            return request
        except Exception as e:  # noqa: BLE001 - only XLA's shared-memory refusal is expected
            found = re.search(r"Shared memory size limit exceeded: requested (\d+)", str(e))
            if not found:
                raise
            request = limit = int(found.group(1))


def tile_requests(target: targets.Target, log=print) -> list[dict]:
    """Shared memory the training kernels' programs ask for at each tile size: the dense
    kernel (forward, dq, dk/dv) per channel of dk + dv at 128 rows, and the selected-entries
    kernel (forward, backward, entry mass) per its padded heads and entry width: the figures
    behind the kernels' tile choice (dense_attention.SMEM_PER_KEY_CHANNEL, sparse_attention's
    smem_bytes)."""
    from dsattn.kernels import dense_attention as da, sparse_attention as sa

    bf16, out = jnp.bfloat16, []
    for (dk, dv), bk, st in itertools.product(((64, 64), (128, 128), (256, 256), (288, 256)),
                                              (64, 32, 16), (2, 1)):
        def dense(q, k, v):
            pos = jnp.broadcast_to(jnp.arange(256), (1, 256))
            def loss(q, k, v):
                o, l = da.attention(q, k, v, scale=0.1, q_positions=pos, k_positions=pos,
                                    block_q=64, block_h=2, block_k=bk, num_stages=st)
                return jnp.sum(o.astype(jnp.float32)) + jnp.sum(l)
            return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
        got = shared_memory_request(target, dense, [((1, 256, 2, dk), bf16),
                                                    ((1, 256, 1, dk), bf16),
                                                    ((1, 256, 1, dv), bf16)])
        out.append({"kernel": "dense", "dk": dk, "dv": dv, "rows": 128, "block_k": bk,
                    "num_stages": st, "bytes": got, "model": da.smem_bytes(dk + dv, 128, bk, st)})
        log(out[-1])
    for heads, width, value, bk, st in itertools.product((12, 64), (256, 288, 576), (False, True),
                                                         (64, 32, 16), (2, 1)):
        vd = width - width % 256 if value else None
        def sparse(q, store, idx, sink):
            def loss(q, store, sink):
                o, l = sa.attention(q, store, idx, scale=0.1, sink=sink, block_k=bk,
                                    num_stages=st, value=None if vd is None else store[..., :vd])
                m = sa.entry_mass(q, store, idx, l, scale=0.1, block_k=bk, num_stages=st)
                return jnp.sum(o.astype(jnp.float32)) + jnp.sum(l) + jnp.sum(m)
            return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, store, sink)
        got = shared_memory_request(target, sparse, [((1, 64, heads, width), bf16),
                                                     ((1, 512, width), bf16),
                                                     ((1, 64, 256), jnp.int32),
                                                     ((heads,), jnp.float32)])
        out.append({"kernel": "sparse", "heads": heads, "width": width, "value": vd,
                    "block_k": bk, "num_stages": st, "bytes": got,
                    "model": sa.smem_bytes(heads, width, vd, bk, st)})
        log(out[-1])
    return out


# -- what a real device adds ------------------------------------------------------------------
IMPL_OF = {"xla": "xla", "pallas_gpu": "kernels", "auto": "kernels"}  # attention.impl -> ours


def compiled_rows(device_kind: str, bench_dir) -> list[dict]:
    """The rows compiled for the target whose device is `device_kind` (a real device's
    jax device_kind), from bench_dir/aot_<target>.json; [] where none is."""
    from pathlib import Path

    for name in targets.names():
        t = targets.load(name)
        path = Path(bench_dir) / f"aot_{t.name}.json"
        if t.device == device_kind and path.is_file():
            return Report.load(path).all_rows()
    return []


def prediction(rows: list[dict], preset: str, impl: str, program: str, batch: int,
               length: int) -> dict | None:
    """What the compile said of one program a device check measures (the one-chip row of
    `preset` under attention.impl=`impl` at batch x length), or None."""
    for r in rows:
        if (r["preset"], r["impl"], r["program"], r["batch"], r["length"]) == (
                preset, IMPL_OF.get(impl, impl), program, batch, length) and \
                r["mesh"] == "1 chip" and r.get("compiled"):
            keep = ("peak_bytes", "temp_bytes", "argument_bytes", "compile_s", "roofline")
            return {**{k: r[k] for k in keep if k in r},
                    "kernels_per_step": r["kernels"]["per_step"],
                    "kernels_per_layer": r["kernels"]["per_layer"]}
    return None


class Report:
    """A target's rows, by Spec key, kept across runs (a rerun adds or replaces rows)."""

    def __init__(self, rows: dict | None = None):
        self.rows = rows or {}

    @classmethod
    def load(cls, path) -> Report:
        from pathlib import Path

        path = Path(path)
        return cls(json.loads(path.read_text())["rows"] if path.is_file() else {})

    def has(self, target: str, spec: Spec) -> bool:
        return f"{target}/{spec.key}" in self.rows

    def put(self, target: str, spec: Spec, rows: list) -> None:
        self.rows[f"{target}/{spec.key}"] = rows

    def all_rows(self) -> list:
        return [r for key in sorted(self.rows) for r in self.rows[key]]

    def save(self, out, target: targets.Target | None = None) -> None:
        """OUT.json (every row) and OUT.txt (a line each), written whole; with the target,
        each compiled row's `fits` by its memory as the target file has it now."""
        from pathlib import Path

        from dsattn.runlog import atomic_write

        for row in self.all_rows():
            if target is not None and row.get("compiled"):
                row["fits"] = row["peak_bytes"] <= target.usable_bytes
        out = Path(out)
        atomic_write(out.with_suffix(".json"),
                     json.dumps({"rows": self.rows}, indent=1, sort_keys=True) + "\n")
        atomic_write(out.with_suffix(".txt"),
                     "\n".join(_summary(r) for r in self.all_rows()) + "\n")
        atomic_write(out.with_suffix(".md"), table(self.all_rows()))


def table(rows: list[dict]) -> str:
    """A markdown table of a target's rows, one line per (mesh, preset, implementation):
    each program's peak memory (GiB; * where it does not fit the chip, x where it did not
    compile), kernels a layer of the batch-1 decode step at 32K, the largest decode batch
    at 32K and 128K. On a mesh each program is the one `specs` builds there, at a row per
    chip at least."""
    programs = (("train", 4, 8192), ("train_long", 1, 32768), ("prefill", 1, 32768),
                ("decode", 1, 32768), ("decode", 1, 131072), ("serve_step", SERVE_ROWS,
                                                                  SERVE_CONTEXT))
    head = ("| chips | preset | impl | train 4x8K | train 1x32K | prefill | decode 32K | "
            "decode 128K | serve step | decode kernels/layer | decode batch 32K / 128K |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    keys = sorted({(r["mesh"], r["preset"], r["impl"]) for r in rows},
                  key=lambda k: (k[0] != "1 chip", k[0], k[1], k[2]))
    for mesh, preset, impl in keys:
        mine = [r for r in rows if (r["mesh"], r["preset"], r["impl"]) == (mesh, preset, impl)]
        chips = 1 if mesh == "1 chip" else max(r.get("chips", 1) for r in mine)

        def find(program, batch, length):
            return next((r for r in mine if (r["program"], r["batch"], r["length"]) ==
                         (program, max(batch, chips), length)), None)

        def cell(program, batch, length):
            r = find(program, batch, length)
            if r is None:
                return ""
            if r.get("same_as"):
                return f"= {r['same_as']}"
            if not r.get("compiled"):
                return "x (memory)" if r.get("fits") is False else "x"
            return f"{r['peak_bytes'] / 2**30:.2f}{'' if r['fits'] else '*'}"

        dec = find("decode", 1, 32768)
        dec = dec if dec and dec.get("compiled") else None
        most = [str(next((r.get("largest_fitting_batch") for r in mine
                          if r["program"] == "decode_max" and r["length"] == n), "") or "")
                for n in CONTEXTS]
        lines.append(f"| {mesh} | {preset} | {impl} | "
                     + " | ".join(cell(*p) for p in programs)
                     + f" | {dec['kernels']['per_layer'] if dec else ''} | {' / '.join(most)} |")
    return "\n".join(lines) + "\n"


def _summary(r: dict) -> str:
    head = (f"{r['target']} {r['mesh']:>8} {r['preset']:>4} {r['impl']:>7} "
            f"{r['program']:>11} {r['batch']:>4}x{r['length']:<6}")
    if r.get("same_as"):
        return f"{head} = the {r['same_as']} row ({r['why']})"
    if not r.get("compiled"):
        return f"{head} FAILED {r.get('error', '')}"
    retried = " (cuBLAS GEMMs: XLA found no Triton GEMM tiling)" if r.get("retried") else ""
    k = r["kernels"]
    calls = ", ".join(f"{n} x{c}" for n, c in k["custom_calls"].items())
    return (f"{head} {r['compile_s']:>6.1f}s peak {r['peak_bytes'] / 2**30:7.2f} GiB "
            f"(temp {r['temp_bytes'] / 2**30:.2f}) kernels {k['per_step']} "
            f"({k['per_layer']}/layer){'; ' + calls if calls else ''}{retried}")
