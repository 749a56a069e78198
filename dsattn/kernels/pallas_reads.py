"""The fused attention reads as one implementation of `attention.impl` (``pallas_gpu``):
the contract's adapter (attention/fused.py) over the dense / window kernel
(kernels/dense_attention.py) and the selected-entries kernel with its entry-mass pass
(kernels/sparse_attention.py), and the decode kernel (kernels/decode_attention.py) for a
decode step over shared entries (the V4 family, MLA's absorbed path, DSA). Every read of
training, prefill and decode then runs as a few Pallas programs over the whole sequence:
no per-block score array and no gathered entries leave a kernel, and a decode step reads
what it selects from the caches as stored.

A program lowered for an NVIDIA GPU compiles the kernels with Triton; one lowered for the
CPU runs them in the Pallas interpreter (exact and slow: how the tests check them), whatever
the process's default backend (kernels/platform.py). `auto` picks this entry for programs
lowered for a GPU (kernels/registry.py).
"""

from __future__ import annotations

from dsattn.attention import fused
from dsattn.kernels import decode_attention, dense_attention, sparse_attention


def _dense(q, k, v, **kw):
    return dense_attention.attention(q, k, v, **kw)


def _sparse(q, store, idx, **kw):
    return sparse_attention.attention(q, store, idx, **kw)


def _entry_mass(q, store, idx, lse, **kw):
    return sparse_attention.entry_mass(q, store, idx, lse, **kw)


def _decode(q, q_pos, parts, **kw):
    return decode_attention.attention(q, q_pos, parts, **kw)


run = fused.adapter(_dense, _sparse, _entry_mass, _decode)

