"""The longest chain of dependent kernels in a traced program: a floor on the kernels one
step of it launches one after another, whatever fuses around them.

XLA:GPU runs every matmul (`dot_general`) as a kernel of its own (cuBLAS, or a Triton GEMM
into which elementwise work fuses), and so every Pallas call, sort, top-k and scatter (a
cache write); none of them shares a kernel with another that reads its output. The longest
path through the program's data flow that counts those ops is therefore a floor on its
sequential launches, and divided by the layers a floor on kernels per layer. It leaves out
what may fuse (elementwise work) and what the floor need not count to be one (the
normalisations' and softmaxes' reductions, which add kernels of their own on a GPU).

Sub-programs are followed: jit, custom_jvp/vjp and remat bodies in place; a cond's longest
branch; a scan's body once per iteration, a while loop's once (its trip count is not known
when tracing). A Pallas call counts once, whatever its body holds.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator

from jax.extend import core

COUNTED = frozenset({"dot_general", "pallas_call", "sort", "top_k", "scatter", "scatter-add"})


@dataclasses.dataclass(frozen=True)
class Chain:
    """``length`` counted ops one after another; ``path``: the chain as (op, where) steps,
    where = the innermost dsattn functions that issued it; ``counts``: every counted op of
    the program by kind (chain or not, a scan's body once per iteration)."""

    length: int
    path: tuple
    counts: dict


_NOT_WHERE = ("site-packages", "/dsattn/nn/", "/dsattn/bench/", "<frozen")


def _where(eqn) -> str:
    frames = [f for f in eqn.source_info.traceback.frames  # not jax's, flax's nor ours
              if not any(p in f.file_name for p in _NOT_WHERE)]
    return " < ".join(f"{f.file_name.rsplit('/', 1)[-1][:-3]}.{f.function_name}"
                      for f in frames[:2]) or "?"


def _bodies(eqn):
    if eqn.primitive.name == "pallas_call":
        return []
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, core.ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, core.Jaxpr):
                found.append(v)
    return found


_START = (0, ())


def _longest(items):
    return max(items, key=lambda c: c[0], default=_START)


def _walk(jaxpr, inputs, counts, times: int):
    """The (length, path) at each output of `jaxpr` given its inputs'; `counts` gains the
    counted ops, each `times` over."""
    at = dict(zip(jaxpr.invars, inputs))
    get = lambda a: _START if isinstance(a, core.Literal) else at.get(a, _START)  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [get(a) for a in eqn.invars]
        first = _longest(ins)
        name, bodies = eqn.primitive.name, _bodies(eqn)
        if name == "cond":  # operand 0 picks one branch: its longest, its most ops
            per = [collections.Counter() for _ in bodies]
            outs = [_longest(o) for o in zip(*(_walk(b, ins[1:], c, times)
                                               for b, c in zip(bodies, per)))]
            counts.update(functools.reduce(operator.or_, per))
        elif name in ("scan", "while"):
            body = bodies[0] if name == "scan" else bodies[-1]
            n = int(eqn.params.get("length", 1))
            one = _longest(_walk(body, [first] * len(body.invars), counts, times * n))
            steps = one[1][len(first[1]):]  # one iteration's, after the inputs' chain
            outs = [(first[0] + len(steps) * n, first[1] + steps * n)] * len(eqn.outvars)
        elif bodies:  # a call: its body in place
            body = bodies[0]
            outs = _walk(body, ins if len(ins) == len(body.invars)
                         else [first] * len(body.invars), counts, times)
        elif name in COUNTED:
            counts[name] += times
            outs = [(first[0] + 1, first[1] + ((name, _where(eqn)),))] * len(eqn.outvars)
        else:
            outs = [first] * len(eqn.outvars)
        at.update(zip(eqn.outvars, outs))
    return [get(v) for v in jaxpr.outvars]


def of_jaxpr(closed: core.ClosedJaxpr) -> Chain:
    """The chain of a traced program (``jax.make_jaxpr(f)(...)``, or ``.jaxpr`` of
    ``jax.jit(f).trace(...)``)."""
    counts = collections.Counter()
    jaxpr = closed.jaxpr
    length, path = _longest(_walk(jaxpr, [_START] * len(jaxpr.invars), counts, 1))
    return Chain(length, path, dict(counts))
