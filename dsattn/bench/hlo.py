"""What a compiled program launches, read off its optimized HLO text (`compiled.as_text()`):
the kernels of one run of the program, each counted as often as the loops around it run.

A kernel is an instruction of a computation the program runs as control flow (the entry, the
bodies and conditions of while loops, the branches of conditionals, called computations):
a fusion, a custom call (a Triton or Mosaic kernel by its name, a cuBLAS GEMM, ...), a
collective, or any other op that is not bookkeeping (tuples, bitcasts, parameters, constants
and the control-flow ops themselves). A while loop's body counts its trip count times
(XLA's `known_trip_count`; a loop without one counts once and is listed as unknown); of a
conditional's branches the largest counts, once. Fusions' own computations are a kernel's
insides and are not walked.
"""

from __future__ import annotations

import collections
import dataclasses
import re

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")  # a header, unindented
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# a Pallas kernel's name: Triton's MLIR attribute dict, or a JSON backend config
_KERNEL_NAME = re.compile(r'(?:[{,] name = |"(?:name|kernel_name)": ?)"([^"]+)"')
_BOOKKEEPING = frozenset((
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "add-dependency", "partition-id", "replica-id", "opt-barrier",
    "domain", "async-done", "copy-done", "send-done", "recv-done", "iota"))
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-broadcast")


@dataclasses.dataclass
class Launches:
    """Kernels of one run of a program: ``by_kind`` counts per kind ("fusion", "custom-call
    <name>", "collective <op>", or the op), ``total`` their sum, ``loops`` each while loop
    reached as (name, trip count or None, the computation's kernels per iteration);
    ``kinds`` every kind the program may launch, in any branch; ``fusions`` the fusions by
    XLA's name for them ("loop_multiply_fusion", "input_reduce_fusion", ...)."""

    total: int
    by_kind: dict
    loops: list
    kinds: frozenset = frozenset()
    fusions: dict = dataclasses.field(default_factory=dict)

    def per(self, n: int) -> float:
        return self.total / max(n, 1)


def _computations(text: str) -> tuple[dict, str | None]:
    """{name: [instruction lines]} and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def _kind(op: str, line: str, instruction: str) -> str:
    if op == "custom-call":
        target = _TARGET.search(line)
        target = target.group(1) if target else "?"
        name = _KERNEL_NAME.search(line)
        if name:  # Triton's: in its backend config
            label = name.group(1)
        elif target == "tpu_custom_call":  # Mosaic's: the instruction's own name
            label = re.sub(r"\.\d+$", "", instruction)
        else:
            label = target
        return f"custom-call {label}"
    if op.startswith(_COLLECTIVES):
        return f"collective {op.removesuffix('-start')}"
    return op


def _kernels(counts) -> int:
    """The kernels of a count (its fusions' names are a breakdown of its fusions)."""
    return sum(v for k, v in counts.items() if not k.startswith("fusion: "))


def launches(text: str) -> Launches:
    """The kernels one run of the program in HLO `text` launches (module docstring)."""
    comps, entry = _computations(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    loops, kinds = [], set()
    memo: dict[str, collections.Counter] = {}

    def walk(name: str) -> collections.Counter:
        if name in memo:
            return memo[name]
        counts: collections.Counter = collections.Counter()
        for line in comps.get(name, ()):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            op = m.group(2)
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                cond = re.search(r"condition=%?([\w.\-]+)", line).group(1)
                trip = _TRIP.search(line)
                n = int(trip.group(1)) if trip else None
                inner = walk(body) + walk(cond)
                loops.append((m.group(1), n, _kernels(inner)))
                for k, v in inner.items():
                    counts[k] += v * (n or 1)
            elif op == "conditional":
                branches = re.findall(r"(?:branch_computations=\{|true_computation=|"
                                      r"false_computation=|, )%([\w.\-]+)",
                                      line.split("conditional(", 1)[1])
                options = [walk(b) for b in branches if b in comps]
                for option in options:
                    kinds.update(option)
                if options:
                    counts += max(options, key=_kernels)
            elif op == "call":
                called = re.search(r"to_apply=%?([\w.\-]+)", line)
                if called:
                    counts += walk(called.group(1))
            elif op not in _BOOKKEEPING:
                kind = _kind(op, line, m.group(1))
                counts[kind] += 1
                kinds.add(kind)
                if op == "fusion":  # what it fuses, by XLA's name for it
                    counts["fusion: " + re.sub(r"[.\d]+$", "", m.group(1))] += 1
        memo[name] = counts
        return counts

    counts = walk(entry)
    names = collections.Counter({k.removeprefix("fusion: "): v for k, v in counts.items()
                                 if k.startswith("fusion: ")})
    kernels = collections.Counter({k: v for k, v in counts.items()
                                   if not k.startswith("fusion: ")})
    return Launches(total=sum(kernels.values()), by_kind=dict(kernels.most_common()),
                    loops=loops, kinds=frozenset(kinds), fusions=dict(names.most_common()))
