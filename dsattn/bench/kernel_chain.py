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
branch after its predicate; a scan's body once per iteration with the carry's chains fed
back (so work that does not depend on the carry does not add up; past 64 iterations each
further one adds the last one's growth); a while loop's body once (its trip count is not
known when tracing). A Pallas call counts once, whatever its body holds.
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
    where = the two innermost functions that issued it (neither jax's, flax's nor the
    model's building blocks in dsattn/nn); ``counts``: the counted ops one run of the
    program issues, by kind (chain or not; a scan's body once per iteration, of a cond's
    branches the most any of them issues of each kind)."""

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
_ITERATIONS = 64  # a scan's iterations walked one by one


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
        if name == "cond":  # operand 0 picks one branch: after it, the longest
            per = [collections.Counter() for _ in bodies]
            outs = [_longest(o + (ins[0],)) for o in zip(*(_walk(b, ins[1:], c, times)
                                                           for b, c in zip(bodies, per)))]
            counts.update(functools.reduce(operator.or_, per))  # per kind, the most
        elif name == "scan":
            outs = _scan(eqn, bodies[0], ins, counts, times)
        elif name == "while":  # its trip count is not known here: one pass of its body
            body = bodies[-1]
            outs = _walk(body, [first] * len(body.invars), counts, times)
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


def _scan(eqn, body, ins, counts, times: int):
    """A scan's outputs: its body walked once per iteration, the carry's chains fed back
    (past `_ITERATIONS`, each further iteration adds the last one's growth)."""
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    n = int(eqn.params["length"])
    consts, carry = ins[:n_consts], ins[n_consts:n_consts + n_carry]
    xs = ins[n_consts + n_carry:]
    tops, outs = [], carry
    for k in range(min(n, _ITERATIONS)):  # every iteration issues the first one's ops
        outs = _walk(body, consts + carry + xs, counts if k == 0 else collections.Counter(),
                     times * n)
        carry = outs[:n_carry]
        tops.append(_longest(outs)[0])
    growth = (n - len(tops)) * (tops[-1] - tops[-2] if len(tops) > 1 else 0)
    return [(length + growth, path) for length, path in outs]


def of_jaxpr(closed: core.ClosedJaxpr) -> Chain:
    """The chain of a traced program (``jax.make_jaxpr(f)(...)``, or ``.jaxpr`` of
    ``jax.jit(f).trace(...)``)."""
    counts = collections.Counter()
    jaxpr = closed.jaxpr
    length, path = _longest(_walk(jaxpr, [_START] * len(jaxpr.invars), counts, 1))
    return Chain(length, path, dict(counts))
