"""How a Pallas kernel runs: compiled for the platform its program is lowered for (Triton on
an NVIDIA GPU, Mosaic on a TPU), or by the Pallas interpreter where that platform is the CPU.

The choice is made when the program is lowered, not when it is traced, and never from the
process's default backend: a program compiled ahead of time on a CPU host for a GPU or TPU
that is not there (scripts/aot_check.py), or laid out on a mesh of such devices, gets the
compiled kernel; the same function jitted for the host's CPU gets the interpreter. Both
forms are traced (`jax.lax.platform_dependent`); only the one for the lowering platform is
lowered and compiled.

``interpret``: None follows the platform as above; True always interprets (a debugging aid:
the interpreter runs on any backend); False always compiles (lowering fails on a CPU).
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl


def pallas_call(kernel, *, interpret: bool | None = None, **kw):
    """`pl.pallas_call(kernel, **kw)` whose mode follows the lowering platform (module
    docstring). The interpreter is Pallas's generic one: the TPU interpreter's ordered
    callbacks are an effect every enclosing `platform_dependent` would carry to the
    platforms whose branch drops them, and lowering refuses that."""
    if interpret is not None:
        return pl.pallas_call(kernel, interpret=interpret, **kw)
    compiled = pl.pallas_call(kernel, interpret=False, **kw)
    interpreted = pl.pallas_call(kernel, interpret=True, **kw)

    def call(*args):
        return jax.lax.platform_dependent(*args, cpu=interpreted, default=compiled)

    return call
