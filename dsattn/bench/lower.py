"""Full-size programs from shapes alone: a preset's decode step and a prefill chunk are
traced and compiled from `jax.ShapeDtypeStruct`s (nothing allocated), for what a step will
hold on an accelerator: XLA's memory analysis (argument, output and temporary bytes) beside
kvbytes' cache bytes, the program's op count, and the decode step's longest chain of
dependent kernels (dsattn.bench.kernel_chain).

The model is the preset's whole stack (embedding, attention layers, a dense SwiGLU FFN of
`model.ffn_hidden`; DeepSeek's MoE, hyper-connections and MTP are out of scope). The memory
analysis is the backend's, of the program compiled for this process's backend: on a CPU it
tells the sizes that a TPU or GPU program of the same shapes holds in its arguments.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import generate, kvbytes
from dsattn.bench import kernel_chain
from dsattn.cache.protocol import is_container
from dsattn.model import Transformer



def abstract_engine(cfg) -> generate.Engine:
    """An engine over the model's parameter shapes (no parameter is allocated)."""
    return generate.Engine(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))


def nbytes(tree) -> int:
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(tree)))


def cache_value_bytes(cache) -> int:
    """Bytes of a decode state's stored vectors (window, entries, keys, latents, K/V), without
    its bookkeeping (positions, page tables, lengths, free stacks, compressor accumulators):
    what kvbytes counts."""
    return sum(c.stored_bytes() for c in jax.tree.leaves(cache.layers, is_leaf=is_container)
               if is_container(c))


def _ops(hlo_text: str) -> int:
    """Instructions in an HLO module's text (one `name = type op(...)` line each)."""
    return len(re.findall(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = ", hlo_text, flags=re.M))


def traced(cfg, batch: int, max_len: int, chunk: int | None = None):
    """(traced program, abstract decode state): decode (chunk None) or a `chunk`-token
    prefill over a cache of `max_len` positions per row."""
    eng = abstract_engine(cfg)
    cache = jax.eval_shape(lambda: eng.init_cache(batch, max_len))
    if chunk is None:
        return generate.decode_program.trace(
            eng.graph, eng.state, jax.ShapeDtypeStruct((batch,), jnp.int32), cache), cache
    tokens = jax.ShapeDtypeStruct((batch, chunk), jnp.int32)
    n_new = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return generate.prefill_program.trace(eng.graph, eng.state, tokens, n_new, cache, None,
                                          None), cache


def lowered(cfg, batch: int, max_len: int, chunk: int | None = None):
    """(lowered program, abstract decode state) of `traced`."""
    program, cache = traced(cfg, batch, max_len, chunk)
    return program.lower(), cache


def decode_chain(cfg, batch: int, max_len: int) -> kernel_chain.Chain:
    """The longest chain of dependent kernels of the decode step (dsattn.bench.kernel_chain),
    from shapes alone."""
    return kernel_chain.of_jaxpr(traced(cfg, batch, max_len)[0].jaxpr)


def analyse(cfg, batch: int, max_len: int, chunk: int | None = None,
            compile: bool = True) -> dict:
    """Sizes of a full-size program, with kvbytes' figure for the same cache."""
    program, cache = traced(cfg, batch, max_len, chunk)
    out = {"program": "decode" if chunk is None else f"prefill {chunk}", "batch": batch,
           "max_len": max_len,
           "param_bytes": abstract_engine(cfg).weight_bytes,  # as the programs read them
           "cache_value_bytes": cache_value_bytes(cache),
           "kvbytes_cache_bytes": batch * kvbytes.global_bytes(cfg, max_len)
           + batch * kvbytes.local_bytes(cfg, context=max_len),
           "cache_argument_bytes": nbytes(cache)}
    if chunk is None:  # its longest chain of dependent kernels (a floor on launches)
        chain = kernel_chain.of_jaxpr(program.jaxpr)
        out.update(kernel_chain=chain.length, kernel_counts=chain.counts,
                   kernel_chain_path=[list(step) for step in chain.path])
    if compile:
        compiled = program.lower().compile()
        mem = compiled.memory_analysis()
        out.update(argument_bytes=int(mem.argument_size_in_bytes),
                   output_bytes=int(mem.output_size_in_bytes),
                   temp_bytes=int(mem.temp_size_in_bytes),
                   alias_bytes=int(mem.alias_size_in_bytes),
                   hlo_ops=_ops(compiled.as_text()))
    return out
