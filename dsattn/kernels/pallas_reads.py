"""The fused attention reads as one implementation of `attention.impl` (``pallas_gpu``):
the contract's adapter (attention/fused.py) over the dense / window kernel
(kernels/dense_attention.py) and the selected-entries kernel with its entry-mass pass
(kernels/sparse_attention.py), and the decode kernel (kernels/decode_attention.py) for a
decode step over shared entries (the V4 family, MLA's absorbed path, DSA). Every read of
training, prefill and decode then runs as a few Pallas programs over the whole sequence:
no per-block score array and no gathered entries leave a kernel, and a decode step reads
what it selects from the caches as stored.

On an NVIDIA GPU Triton compiles the kernels. On any other backend the Pallas interpreter
runs them: exact and slow, which is how the tests check them on a CPU, and why `auto` picks
this entry only on a GPU (kernels/registry.py).
"""

from __future__ import annotations

import jax

from dsattn.attention import fused
from dsattn.kernels import decode_attention, dense_attention, sparse_attention


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def _dense(q, k, v, **kw):
    return dense_attention.attention(q, k, v, interpret=_interpret(), **kw)


def _sparse(q, store, idx, **kw):
    return sparse_attention.attention(q, store, idx, interpret=_interpret(), **kw)


def _entry_mass(q, store, idx, lse, **kw):
    return sparse_attention.entry_mass(q, store, idx, lse, interpret=_interpret(), **kw)


def _decode(q, q_pos, parts, **kw):
    return decode_attention.attention(q, q_pos, parts, interpret=_interpret(), **kw)


run = fused.adapter(_dense, _sparse, _entry_mass, _decode)

