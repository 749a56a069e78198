"""Scanning: a stack's repeated groups of layers run as one `jax.lax.scan` each, so a model
compiles one layer per distinct behaviour whatever its depth. This is the one module that
knows a layer may be one of several copies; everything else sees one layer at a time.

- **Grouping** (`Unit`, `units`): which layers form a scanned group, and which runs of
  equal layers inside a group scan again (nested).
- **Stacking** (`stacked_blocks`, `stack`): a group's parameters and caches carry a leading
  axis over its copies (a slot's: over copies x run, copy c's j-th layer at c * run + j).
- **Relayout** (`per_layer`, `per_unit`, `relayout`, and the layouts earlier versions
  saved): between one item per unit and one per layer, scanned and unrolled.
- **A copy's view** of stacked caches (`view`, `merge`, `finish`): a scan body works on
  one copy, but slicing its stored vectors out and writing them back would copy a layer's
  whole cache every step, which a decode step must never do (it reads only what it
  selects). So a view slices the bookkeeping (positions, page tables, lengths, open spans)
  and hands the stored vectors (cache.protocol `storage`) over as array-likes that index
  the stacked arrays in place (`InPlace`). A container whose steps read all of its stored
  vectors (`reads_whole`: a contiguous cache, read by dots) keeps one array per copy
  instead (`PerCopy`): its view (`Deferred`) runs a read under a `lax.switch` on the copy,
  each branch on that copy's arrays as they lie, and holds its write until the scan is done
  (`finish`), one scatter per copy, since XLA:CPU copies an array that is read before a
  write into it.
- **The scanned blocks** (`ScannedBlocks`) and the **mesh layout** of stacked caches
  (`layer_specs`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsattn import plan
from dsattn.cache.protocol import is_container

# ------------------------------------------------------------------------------- grouping
MIN_SCAN_COPIES = 3  # a group (or a run in one) repeated fewer times runs unrolled


@dataclass(frozen=True)
class Unit:
    """A run of the stack executed as one piece: a single layer (`copies` 1), or `copies`
    consecutive copies of a `period`-layer group scanned over parameters and caches
    stacked along a leading axis.

    Inside a group, `runs` splits the period into slots: a run of equal layers (at least
    MIN_SCAN_COPIES of them) is one slot, scanned again inside each copy, so it is traced
    once; any other layer is a slot of its own. A slot's parameters and caches are stacked
    over copies x run (copy c's layer j at c * run + j)."""

    start: int
    period: int = 1
    copies: int = 1
    runs: tuple[int, ...] | None = None  # layers per slot (None: one per layer)

    def __post_init__(self):
        if self.runs is None:
            object.__setattr__(self, "runs", (1,) * self.period)

    @property
    def scanned(self) -> bool:
        return self.copies > 1

    @property
    def layers(self) -> range:
        return range(self.start, self.start + self.period * self.copies)

    @property
    def slots(self) -> tuple[tuple[int, int], ...]:
        """(offset in the group, run length) of each slot."""
        return tuple(zip(accumulate(self.runs[:-1], initial=0), self.runs))

    @property
    def traced(self) -> int:
        """Layers traced (and compiled) for this unit: one per slot."""
        return len(self.runs)

    def layer(self, slot: int, c: int, j: int) -> int:
        """The stack index of copy c's j-th layer of `slot`."""
        return self.start + c * self.period + self.slots[slot][0] + j


def _behaviour(s: plan.LayerSpec) -> tuple:
    """What a layer does, whatever its index: copies with equal behaviours run as one scan
    body (what they borrow is the latest source in the context, so sources need not match)."""
    return (s.kind, s.ratio, s.decoder, s.from_encoder, s.builds_pool, s.local, s.entry,
            s.key, s.fields)


def _scannable(group) -> bool:
    """A group whose copies publish entries must publish before it borrows: a copy's
    published cache stays in the group's stacked caches and is not carried to the next
    copy (ScannedBlocks)."""
    shares = [q for q, s in enumerate(group) if s.kind.shares]
    borrows = [q for q, s in enumerate(group) if s.kind.source is plan.Source.BORROWED]
    return not (shares and borrows) or shares[0] < borrows[0]


def _runs(group) -> tuple[int, ...]:
    """A group's slots: each maximal run of at least MIN_SCAN_COPIES equal behaviours, and
    every other layer alone."""
    out, q = [], 0
    while q < len(group):
        r = 1
        while q + r < len(group) and group[q + r] == group[q]:
            r += 1
        out.extend([r] if r >= MIN_SCAN_COPIES else [1] * r)
        q += r
    return tuple(out)


def units(cfg) -> tuple[Unit, ...]:
    """The stack as units (`model.scan_layers`): greedily from the first layer, the repeated
    group covering the most layers with at least MIN_SCAN_COPIES copies becomes a scanned
    unit, its runs of equal layers nested scans (`Unit.runs`). No unit spans the CED
    split."""
    specs = plan.resolve(cfg)
    n, split = len(specs), cfg.attention.ced_split
    if not cfg.model.scan_layers:
        return tuple(Unit(i) for i in range(n))
    beh = [_behaviour(s) for s in specs]
    out, i = [], 0
    while i < n:
        end = split if 0 < split and i < split else n  # stay on one side of the split
        best = (0, 1, 1)  # (layers covered, period, copies)
        for p in range(1, (end - i) // MIN_SCAN_COPIES + 1):
            c = 1
            while i + (c + 1) * p <= end and beh[i + c * p: i + (c + 1) * p] == beh[i: i + p]:
                c += 1
            if c >= MIN_SCAN_COPIES and c * p > best[0] and _scannable(specs[i: i + p]):
                best = (c * p, p, c)
        _, p, c = best
        if c == 1:
            out.append(Unit(i))
            i += 1
            continue
        out.append(Unit(i, p, c, _runs(beh[i: i + p])))
        i += c * p
    return tuple(out)


# Layouts earlier versions saved scanned runs in (dsattn.migrations.SAVED_LAYOUTS).
def context_writers_unrolled(units_now, specs) -> tuple:
    """The units a scanned run had when saved before scans carried a fixed context (through
    commit 49035c5): a group whose layers write the context (entries, a selection, a pool)
    ran its first copy unrolled, and the scan only the other copies."""
    out = []
    for u in units_now:
        if u.scanned and any(specs[i].writes_context for i in range(u.start, u.start + u.period)):
            out.extend(Unit(i) for i in range(u.start, u.start + u.period))
            u = Unit(u.start + u.period, u.period, u.copies - 1)
        out.append(u)
    return tuple(out)


def without_runs(units_now) -> tuple:
    """The units a scanned run had when saved before runs of equal layers in a group were
    nested scans (through commit 46e758a): every layer its own slot."""
    return tuple(Unit(u.start, u.period, u.copies) for u in units_now)


# ----------------------------------------------------------------------- stored vectors
@jax.tree_util.register_pytree_node_class
class InPlace:
    """Copy `index` of a stacked array [copies, ...], as an array: reads (`a[idx]`) and
    writes (`a.at[idx].set(v)`) go to the stacked array at [index, ...], in place."""

    def __init__(self, stack, index):
        self.stack, self.index = stack, index

    def tree_flatten(self):
        return (self.stack, self.index), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    shape = property(lambda self: self.stack.shape[1:])
    dtype = property(lambda self: self.stack.dtype)
    ndim = property(lambda self: self.stack.ndim - 1)

    def __getitem__(self, idx):
        return self.stack[(self.index,) + _as_tuple(idx)]

    @property
    def at(self):
        return _At(lambda idx, v, mode: InPlace(
            self.stack.at[(self.index,) + _as_tuple(idx)].set(v, mode=mode), self.index))

    def reshape(self, *shape):
        """Its own dims reshaped (the copies axis stays in front: no data moves)."""
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        return InPlace(self.stack.reshape((self.stack.shape[0],) + tuple(shape)), self.index)

    def batch_axes(self, axis: int):
        """jax.vmap axes that map this view's dimension `axis`."""
        return InPlace(axis + 1, None)

    def flat_rows(self):
        """(every copy's rows as one array [copies * rows, ...], this copy's first row)."""
        s = self.stack
        return s.reshape((-1,) + s.shape[2:]), self.index * s.shape[1]


@jax.tree_util.register_pytree_node_class
class PerCopy:
    """A stored array of a `reads_whole` container in a scanned group: one array per copy
    (a copy's read is then an operand XLA reads where it lies), and the copies' writes held
    during a scan (`pending`: (index, values), each stacked over the copies; done with
    out-of-range indices dropped)."""

    def __init__(self, arrays: tuple, pending=None):
        self.arrays, self.pending = tuple(arrays), pending

    def tree_flatten(self):
        return (self.arrays, self.pending), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


@jax.tree_util.register_pytree_node_class
class Deferred:
    """Copy `index` of a `PerCopy` array, as an array: `reading` runs its reader on the
    copy's own array; a write (`a.at[idx].set(v)`) is held (`write`) and merged into the
    group's pending writes, done after the scan (`finish`)."""

    def __init__(self, arrays: tuple, index, write=None):
        self.arrays, self.index, self.write = tuple(arrays), index, write

    def tree_flatten(self):
        return (self.arrays, self.index, self.write), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    shape = property(lambda self: self.arrays[0].shape)
    dtype = property(lambda self: self.arrays[0].dtype)
    ndim = property(lambda self: self.arrays[0].ndim)

    def __getitem__(self, idx):
        raise TypeError("stored arrays a step reads whole (reads_whole) are read through "
                        "cache.protocol.reading, not indexed")

    @property
    def at(self):
        def write(idx, v, mode):
            if self.write is not None or mode not in (None, "drop"):
                raise ValueError("a scanned copy's stored arrays that a step reads whole take "
                                 "one write per step, out-of-range indices dropped")
            return Deferred(self.arrays, self.index, (_as_tuple(idx), v))

        return _At(write)

    @staticmethod
    def read_in_place(tree, f):
        """f(tree), each Deferred leaf its copy's array: one switch branch per copy."""
        views = [a for a in jax.tree.leaves(tree, is_leaf=_is_view) if isinstance(a, Deferred)]

        def branch(j):
            return lambda: f(jax.tree.map(lambda a: a.arrays[j] if isinstance(a, Deferred)
                                          else a, tree, is_leaf=_is_view))

        return jax.lax.switch(views[0].index, [branch(j) for j in range(len(views[0].arrays))])


class _At:
    def __init__(self, write):
        self._write = write

    def __getitem__(self, idx):
        return _Set(self._write, idx)


class _Set:
    def __init__(self, write, idx):
        self._write, self._idx = write, idx

    def set(self, v, mode=None):
        return self._write(self._idx, v, mode)


def _as_tuple(idx) -> tuple:
    return idx if isinstance(idx, tuple) else (idx,)


def _is_view(a) -> bool:
    return isinstance(a, (InPlace, PerCopy, Deferred))


# ------------------------------------------------------------------------ stacked caches
def _index(a, c):
    """a[c] along the leading axis, for arrays and abstract shapes (eval_shape'd states)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
    return a[c]


def _each_container(tree, container, other, *more):
    """`tree` (with `more`, trees of its structure) with each container mapped by
    `container` and every other leaf by `other`."""
    return jax.tree.map(lambda n, *m: container(n, *m) if is_container(n) else other(n, *m),
                        tree, *more, is_leaf=is_container)


def _parts(c, bookkeeping, vectors, *more):
    """A container with its bookkeeping leaves mapped by `bookkeeping` and its stored
    vectors (each array or array-like) by `vectors`; `more`: containers of its structure."""
    small = jax.tree.map(bookkeeping, c.with_vectors({}), *(m.with_vectors({}) for m in more))
    return small.with_vectors(jax.tree.map(vectors, c.vectors, *(m.vectors for m in more),
                                           is_leaf=_is_view))


def _lead(copies: int):
    return lambda a: jnp.broadcast_to(a, (copies,) + a.shape).copy()


def stack(tree, copies: int):
    """A tree of (empty) caches for `copies` copies of a scanned group: every leaf gains a
    leading copies axis, but a `reads_whole` container's stored arrays are one per copy."""
    lead = _lead(copies)

    def per_copy(a):
        return PerCopy(tuple(jnp.copy(a) for _ in range(copies)))

    def container(c):
        return _parts(c, lead, per_copy if c.reads_whole else lead)

    return _each_container(tree, container, lead)


def unstack(tree, c: int):
    """Copy `c` (a Python int) of a tree of stacked caches, as an unstacked tree."""
    take = lambda a: _index(a, c)  # noqa: E731
    return _each_container(tree, lambda n: _parts(
        n, take, lambda a: a.arrays[c] if isinstance(a, PerCopy) else take(a)), take)


def join(trees: list):
    """The inverse of `unstack`: the stacked tree from every copy's tree, in order."""
    put = lambda *a: jnp.stack(a)  # noqa: E731
    return _each_container(trees[0], lambda n, *m: _parts(
        n, put, lambda *a: PerCopy(a) if n.reads_whole else put(*a), *m), put, *trees[1:])


def view(stacked, i):
    """Copy `i` (a traced int) of a tree of stacked caches, its stored vectors read and
    written in place (module docstring)."""
    take = lambda a: a[i]  # noqa: E731
    return _each_container(stacked, lambda n: _parts(
        n, take, lambda a: Deferred(a.arrays, i) if isinstance(a, PerCopy)
        else InPlace(a, i)), take)


def _merge_vector(old, new, i):
    if isinstance(new, InPlace):  # written in place already
        return new.stack
    if new.write is None:
        return old
    idx, v = new.write
    pending = (_no_writes(jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((len(old.arrays),) + a.shape, a.dtype), (idx, v)))
        if old.pending is None else old.pending)
    return PerCopy(old.arrays, jax.tree.map(lambda p, a: p.at[i].set(a), pending, (idx, v)))


def merge(stacked, new, i):
    """`stacked` with copy `i` replaced by `new` (a `view` after the copy's updates)."""
    put = lambda old, a: old.at[i].set(a)  # noqa: E731
    return _each_container(stacked, lambda n, m: _parts(
        n, put, lambda old, a: _merge_vector(old, a, i), m), put, new)


def _no_writes(shape):
    """Held writes (index, values) shaped as `shape` that write nothing: every index past
    any array's end, so a copy that holds no write leaves its arrays as they are."""
    idx, v = shape
    return (jax.tree.map(lambda a: jnp.full(a.shape, jnp.iinfo(a.dtype).max, a.dtype), idx),
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), v))


def finish(tree):
    """After a scan over a group's copies: each copy's held write done, in place."""
    def vector(a):
        if not isinstance(a, PerCopy) or a.pending is None:
            return a
        idx, v = a.pending
        return PerCopy(tuple(arr.at[tuple(x[j] for x in idx)].set(v[j], mode="drop")
                             for j, arr in enumerate(a.arrays)))

    return _each_container(tree, lambda n: _parts(n, lambda a: a, vector), lambda a: a)


def _pending_like(value, shape):
    """`value` (a carry item) with each PerCopy's missing pending writes shaped as `shape`
    (the carry item a scan body returns) has them, writing nothing (`_no_writes`)."""
    def one(a, s):
        if isinstance(a, PerCopy) and a.pending is None and s.pending is not None:
            return PerCopy(a.arrays, _no_writes(s.pending))
        return a

    return jax.tree.map(one, value, shape, is_leaf=lambda a: isinstance(a, PerCopy))


def _has_per_copy(tree) -> bool:
    return any(isinstance(a, PerCopy)
               for a in jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, PerCopy)))


# --------------------------------------------------------------------- relayout by layer
def per_layer(units_, items) -> list:
    """One item per layer, in stack order, from one per unit: a scanned unit's item is
    indexable by slot (Unit.slots), each a tree stacked over copies x run."""
    out = []
    for unit, item in zip(units_, items):
        if not unit.scanned:
            out.append(item)
            continue
        for c in range(unit.copies):
            for s, r in enumerate(unit.runs):
                out.extend(unstack(item[s], c * r + j) for j in range(r))
    return out


def per_unit(units_, layers) -> list:
    """The inverse of `per_layer`: a scanned unit's item is a tuple over its slots of the
    slot's layers' trees stacked (copy c's j-th at c * run + j)."""
    out = []
    for unit in units_:
        if not unit.scanned:
            out.append(layers[unit.start])
            continue
        out.append(tuple(join([layers[unit.layer(s, c, j)] for c in range(unit.copies)
                               for j in range(r)]) for s, r in enumerate(unit.runs)))
    return out


def block_layers(units_, blocks: dict) -> list:
    """A model's "blocks" subtree (params or optimizer moments, one entry per unit; a
    scanned group's slots under "layers", each stacked) as one tree per layer."""
    return per_layer(units_, [blocks[j]["layers"] if u.scanned else blocks[j]
                              for j, u in enumerate(units_)])


def layer_blocks(units_, layers: list) -> dict:
    """`block_layers`' inverse: the "blocks" subtree of `units_` holding `layers`."""
    return {j: {"layers": dict(enumerate(item))} if u.scanned else item
            for j, (u, item) in enumerate(zip(units_, per_unit(units_, layers)))}


def relayout(tree, units_from, units_to, rewrite):
    """A params (or optimizer-state) tree laid out for `units_from` re-laid out for
    `units_to`. `rewrite(tree, key, fn)` applies fn to every subtree under `key`
    (migrations.rewrite)."""
    def blocks(units_blocks: dict) -> dict:
        return layer_blocks(units_to, block_layers(units_from, units_blocks))

    return tree if units_from == units_to else rewrite(tree, "blocks", blocks)


# ------------------------------------------------------------------------- mesh layout
def layer_specs(unit: Unit, cache, rows, tensor: int):
    """PartitionSpecs of one unit's caches on a mesh (rows over `rows`, `tensor`: the mesh's
    tensor size): each container's own (`Container.specs`), other state split by rows; a
    scanned group's stacked copies keep their leading axis whole."""
    def one(tree):
        return _each_container(tree, lambda c: c.specs(rows, tensor), lambda _: P(rows))

    if not unit.scanned:
        return one(cache)
    return tuple(_restack_specs(slot, one(unstack(slot, 0))) for slot in cache)


def _restack_specs(stacked, spec):
    """The specs of a stacked tree from those of one copy (`spec`, same structure as one)."""
    is_p = lambda s: isinstance(s, P)  # noqa: E731
    lead = lambda s: P(None, *s)  # noqa: E731

    def container(n, s):
        small = jax.tree.map(lead, s.with_vectors({}), is_leaf=is_p)
        vec = jax.tree.map(lambda a, sp: (PerCopy((sp,) * len(a.arrays))
                                          if isinstance(a, PerCopy) else lead(sp)),
                           n.vectors, s.vectors, is_leaf=lambda a: _is_view(a) or is_p(a))
        return small.with_vectors(vec)

    return jax.tree.map(lambda n, s: container(n, s) if is_container(n) else lead(s),
                        stacked, spec, is_leaf=lambda a: is_container(a) or is_p(a))


# ----------------------------------------------------------------------- scanned blocks
def stacked_blocks(make_block: Callable, n: int, rngs: nnx.Rngs):
    """`n` blocks (`make_block(rngs)`) with their parameters stacked along a leading axis."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return make_block(rngs)

    return create(rngs)


def _shaped_like(value, shape):
    """`value` if it has the structure, shapes and dtypes of `shape` (a tree of
    ShapeDtypeStructs), else zeros of those."""
    def spec(t):
        return jax.tree.structure(t), [(a.shape, a.dtype) for a in jax.tree.leaves(t)]

    if spec(value) == spec(shape):
        return value
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape)


def _scan(body, carry, xs, writes_context: bool):
    """`jax.lax.scan(body, carry, xs)` over copies of layers (the carry's second item is the
    context, a third the stacked caches), the carry given the structure one copy gives it
    first:
    - a context field the copies write but find empty (None), or holding another shape (an
      earlier full layer's entries at another ratio), enters as zeros of the shape a copy
      writes, so every copy, the first included, runs the one scanned body. That value is
      never read: a copy writes such a field before its layers read it (what a layer reads
      before its group writes it has the shape the group writes: a borrower shares its
      source's ratio, plan.check);
    - the caches' held writes (`PerCopy.pending`) enter as zeros too."""
    if writes_context or (len(carry) > 2 and _has_per_copy(carry[2])):
        out = jax.eval_shape(body, carry, jax.tree.map(lambda a: a[0], xs))[0]
        ctx = carry[1]
        if writes_context:
            ctx = ctx.replace(**{f.name: _shaped_like(getattr(ctx, f.name),
                                                       getattr(out[1], f.name))
                                 for f in dataclasses.fields(ctx)})
        carry = (carry[0], ctx, *(_pending_like(c, o) for c, o in zip(carry[2:], out[2:])))
    return jax.lax.scan(body, carry, xs)


class ScannedBlocks(nnx.Module):
    """The `copies` copies of a repeated group of blocks (a scanned Unit), run as one
    `jax.lax.scan` whose body is one copy, and inside it each run of equal layers as a
    nested scan: one layer per slot is traced and compiled, whatever the depth. A slot's
    parameters and caches are stacked along one leading axis over copies x run. What flows
    between layers (x and the context) is the scans' carry. `make_block(spec, rngs)` builds
    one block (model.Block); `remat` is the model's rematerialisation (model.Remat);
    `published(spec, cache)`, what a sharing layer's cache lends later layers
    (attention.sources.published)."""

    def __init__(self, cfg, unit: Unit, rngs: nnx.Rngs, make_block: Callable, remat,
                 published: Callable):
        specs = plan.resolve(cfg)
        slot_specs = [specs[unit.layer(s, 0, 0)] for s in range(unit.traced)]
        self.copies, self.runs = unit.copies, unit.runs
        self.remat, self.published = remat, published
        self.layers = nnx.List([
            stacked_blocks(lambda r, spec=spec: make_block(spec, r), unit.copies * n, rngs)
            for spec, n in zip(slot_specs, unit.runs)])
        self.specs = tuple(slot_specs)
        # The group's last slot that publishes its paged cache to later layers, if any.
        self.publisher = next((q for q in reversed(range(unit.traced))
                               if slot_specs[q].kind.shares), None)

    def _slots(self):
        """(graphdef, parameters) of each slot, a run's parameters as [copies, run, ...]."""
        out = []
        for layer, r in zip(self.layers, self.runs):
            graphdef, p = nnx.split(layer)
            if r > 1:
                p = jax.tree.map(lambda a: a.reshape(self.copies, r, *a.shape[1:]), p)
            out.append((graphdef, p))
        return out

    def __call__(self, x, positions, step, ctx):
        """(output, one aux dict per layer in stack order, next context)."""
        slots = self._slots()

        def one_copy(carry, ps):
            auxes = []
            for s, ((graphdef, _), p) in enumerate(zip(slots, ps)):
                def one_layer(carry, p, graphdef=graphdef):
                    x, aux, ctx = nnx.merge(graphdef, p)(carry[0], positions, step, carry[1])
                    return (x, ctx), aux

                carry, aux = (one_layer(carry, p) if self.runs[s] == 1 else
                              _scan(one_layer, carry, p, self.specs[s].writes_context))
                auxes.append(aux)
            return carry, auxes

        policy = self.remat.policy(x.shape[1])
        if policy is not None:
            one_copy = jax.checkpoint(one_copy, policy=policy, prevent_cse=False)
        (x, ctx), auxes = _scan(one_copy, (x, ctx), [p for _, p in slots],
                                self.writes_context)
        per_layer_aux = [jax.tree.map(lambda v: v[c] if r == 1 else v[c, j], auxes[s])
                         for c in range(self.copies)
                         for s, r in enumerate(self.runs) for j in range(r)]
        return x, per_layer_aux, ctx

    def extend(self, x, positions, valid, caches, ctx):
        """(output, the group's new stacked caches, next context). The caches are updated in
        place (`view`), so a decode step reads only what each layer selects."""
        slots = self._slots()
        if self.publisher is not None:  # each copy publishes before it borrows (units)
            ctx = ctx.replace(global_cache=None)

        def one_copy(carry, xs):
            x, ctx, caches = carry
            ps, i = xs
            caches = list(caches)
            for s, ((graphdef, _), p) in enumerate(zip(slots, ps)):
                x, ctx, caches[s] = self._extend_slot(s, graphdef, p, i, x, positions, valid,
                                                      ctx, caches[s])
            if self.publisher is not None:  # a view into `caches`: not carried twice
                ctx = ctx.replace(global_cache=None)
            return (x, ctx, tuple(caches)), None

        (x, ctx, caches), _ = _scan(one_copy, (x, ctx, tuple(caches)),
                                    ([p for _, p in slots],
                                     jnp.arange(self.copies, dtype=jnp.int32)),
                                    self.writes_context)
        caches = finish(caches)
        if self.publisher is not None:
            q = self.publisher
            ctx = ctx.replace(global_cache=self._published(q, caches[q], self.copies - 1))
        return x, caches, ctx

    def _extend_slot(self, s, graphdef, p, i, x, positions, valid, ctx, cache):
        """Copy `i`'s layers of slot `s` on the slot's stacked caches: (x, ctx, cache)."""
        r, shares = self.runs[s], self.specs[s].kind.shares

        def one_layer(carry, xs):
            x, ctx, cache = carry
            p, k = xs
            x, new, ctx = nnx.merge(graphdef, p).extend(x, positions, valid,
                                                        view(cache, k), ctx)
            if r > 1 and shares:  # a view into `cache`: not carried twice
                ctx = ctx.replace(global_cache=None)
            return (x, ctx, merge(cache, new, k)), None

        if r == 1:
            return one_layer((x, ctx, cache), (p, i))[0]
        if shares:
            ctx = ctx.replace(global_cache=None)
        (x, ctx, cache), _ = _scan(one_layer, (x, ctx, cache),
                                   (p, i * r + jnp.arange(r, dtype=jnp.int32)),
                                   self.specs[s].writes_context)
        if shares:
            ctx = ctx.replace(global_cache=self._published(s, cache, i))
        return x, ctx, cache

    @property
    def writes_context(self) -> bool:
        return any(spec.writes_context for spec in self.specs)

    def _published(self, s: int, cache, c):
        """What the layers after copy `c` of publishing slot `s` borrow: the paged cache of
        the slot's last layer in that copy."""
        r = self.runs[s]
        return view(self.published(self.specs[s], cache), c * r + r - 1)

    def init_cache(self, batch: int, max_len: int) -> tuple:
        """One cache per slot of the group, stacked over its copies x run."""
        return tuple(stack(block.init_cache(batch, max_len), self.copies * r)
                     for block, r in zip(self.layers, self.runs))

