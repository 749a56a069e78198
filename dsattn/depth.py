"""A preset at another depth: `model.n_layers=N` alone gives a valid stack of the same family.

A preset's layer plan (attention.layers, ratios, ced_split) is written for its own depth.
`at_depth` picks N of its layers, in order, so that every layer it keeps still finds the
layer it borrows entries or a selection from (plan.resolve's sources), and so that the kept
layers keep as many of the preset's mechanisms as N allows: each layer kind, the causal
encoder-decoder split ("ced": layers on both sides of ced_split) and the hierarchical
indexer's pool ("pool": a reindex layer reading a full layer's pool). Layers left over once
every mechanism is kept follow the preset's proportions of kinds. Each kept layer keeps its
ratio; ced_split becomes the number of kept encoder layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsattn import plan

CED, POOL = "ced", "pool"  # the mechanisms that are not a layer kind


@dataclass(frozen=True)
class Plan:
    """A stack derived for `len(layers)` layers, and the preset's mechanisms it lost."""

    layers: tuple[str, ...]
    ratios: tuple[int, ...]
    ced_split: int
    dropped: tuple[str, ...]  # mechanisms of the preset this depth cannot keep
    keeps_all_from: int  # the smallest depth this derivation keeps every mechanism at

    def overrides(self) -> str:
        """The same plan as overrides a user could type."""
        return (f"attention.layers='{short_form(self.layers)}' attention.ratios="
                f"'{short_form(self.ratios)}' attention.ced_split={self.ced_split}")


def short_form(items) -> str:
    """[swa, swa, full] -> 'swa*2, full' (config.expand_pattern reads it back)."""
    runs: list[list] = []
    for x in items:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return ", ".join(f"{x}*{k}" if k > 1 else f"{x}" for x, k in runs)


def mechanisms(specs, kept, ced_split: int) -> set[str]:
    """The mechanisms the layers `kept` (indices into `specs`) have between them."""
    out = {specs[i].name for i in kept}
    if ced_split and any(i < ced_split for i in kept) and any(i >= ced_split for i in kept):
        out.add(CED)
    if any(specs[i].kind.reads_pool and specs[specs[i].kv_source].builds_pool for i in kept):
        out.add(POOL)
    return out


def _closure(specs, i: int) -> set[int]:
    """Layer i and every layer it needs: its entries' and its selection's sources."""
    out, todo = set(), [i]
    while todo:
        j = todo.pop()
        if j in out:
            continue
        out.add(j)
        todo += [s for s in (specs[j].kv_source, specs[j].select_source)
                 if s is not None and s != j]
    return out


_RANK = {name: r for r, name in enumerate(plan.KINDS)}  # later in the table: more elaborate


def _choose(specs, ced_split: int, n: int) -> set[int]:
    """Up to n layer indices: greedily the most mechanisms gained (ties: fewer layers, the
    more elaborate kind, the earlier layer), then the kinds furthest below their share."""
    kept: set[int] = set()
    while True:
        have, best, best_key = mechanisms(specs, kept, ced_split), None, None
        for i in range(len(specs)):
            add = _closure(specs, i) - kept
            if not add or len(kept) + len(add) > n:
                continue
            gain = len(mechanisms(specs, kept | add, ced_split) - have)
            key = (gain, -len(add), _RANK[specs[i].name], -i)
            if gain and (best_key is None or key > best_key):
                best, best_key = add, key
        if best is None:
            break
        kept |= best
    total = len(specs)
    while len(kept) < n:
        count = lambda name, among: sum(specs[j].name == name for j in among)  # noqa: E731
        fits = [i for i in range(total) if i not in kept
                and len(kept | _closure(specs, i)) <= n]
        if not fits:
            break
        i = max(fits, key=lambda i: (count(specs[i].name, range(total)) * n / total
                                     - count(specs[i].name, kept), -i))
        kept |= _closure(specs, i)
    return kept


def at_depth(preset, n: int) -> Plan:
    """The layer plan of `preset` (a loaded config, valid at its own depth) for n layers."""
    specs, ced = plan.resolve(preset), preset.attention.ced_split
    every = mechanisms(specs, range(len(specs)), ced)
    kept = sorted(_choose(specs, ced, n))
    have = mechanisms(specs, kept, ced)
    keeps_all = next(k for k in range(1, len(specs) + 1)
                     if mechanisms(specs, _choose(specs, ced, k), ced) == every)
    return Plan(layers=tuple(specs[i].name for i in kept),
                ratios=tuple(specs[i].ratio for i in kept),
                ced_split=sum(i < ced for i in kept) if CED in have else 0,
                dropped=tuple(m for m in sorted(every, key=str) if m not in have),
                keeps_all_from=keeps_all)
