"""A prefix cache's device side: `n` slots, each one row of the decode state (every leaf
with a row axis: page tables and lengths, window rings, compressor state, contiguous K/V or
latents, the row's position) as it stood at a block boundary, beside the scheduler's decode
state and sharing its page pools (docs/prefix_caching.md).

A slot's pages are held by reference (the container's `retained`: one more holder per
page), never copied: a row that restores a slot points at the same pages and copies one
only before it writes it (the paged cache's copy on write). Everything else of the row is
copied whole. Dropping a slot releases its pages as clearing a row does (`cleared`), so a
page still held by a row or another slot stays.

Each program has static shapes: the row and slot index vectors are always `rows` long,
padded with indices past the end (taken as the last row, written nowhere)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dsattn import scan
from dsattn.cache.protocol import is_container
from dsattn.serve import programs


def _each_container(units, state, fn):
    """`state` with `fn` applied to every cache container of every layer."""
    layers = scan.per_layer(units, state.layers)
    new = [jax.tree.map(lambda c: fn(c) if is_container(c) else c, lc, is_leaf=is_container)
           for lc in layers]
    return state.replace(layers=tuple(scan.per_unit(units, new)))


def _retain(units, state, rows):
    """`state` with one more holder of every page the rows where `rows` [B] is True hold."""
    return _each_container(units, state, lambda c: c.retained(rows))


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _take(units, axes, state, store, rows, slots):
    """(state, store): slots `slots` take rows `rows`; their pages gain a holder."""
    leaves, _, _ = programs.split(state, axes)
    row_axes = tuple(a for a in axes if a is not None)
    copied = programs.take_rows(row_axes, leaves, rows)
    store = programs.put_rows(row_axes, store, slots, copied)
    mask = jnp.zeros(_n_rows(leaves, row_axes), bool).at[rows].set(True, mode="drop")
    return _retain(units, state, mask), store


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _give(units, axes, state, store, rows, slots):
    """`state` with rows `rows` taking slots `slots` (the rows hold nothing: just cleared);
    their pages gain a holder."""
    leaves, shared, tree = programs.split(state, axes)
    row_axes = tuple(a for a in axes if a is not None)
    copied = programs.take_rows(row_axes, store, slots)
    leaves = programs.put_rows(row_axes, leaves, rows, copied)
    mask = jnp.zeros(_n_rows(leaves, row_axes), bool).at[rows].set(True, mode="drop")
    return _retain(units, programs.join(tree, axes, leaves, shared), mask)


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def _drop(units, axes, state, store, slots):
    """(state, store): the slots where `slots` [n] is True give their pages back (a view of
    the store's rows over the state's pools, whose pooled containers release those rows).
    Nothing else of a slot is cleared: it is read only after a publish overwrote it whole,
    and blanking a row of every leaf costs a pass over the whole store (MHA's: a whole
    contiguous cache per slot)."""
    leaves, shared, tree = programs.split(state, axes)
    view = _each_container(units, programs.join(tree, axes, store, shared), lambda c: (
        c.cleared(slots, None) if c.page_pool() is not None else c))
    store, shared, _ = programs.split(view, axes)
    return programs.join(tree, axes, leaves, shared), store


def _n_rows(leaves, row_axes) -> int:
    return leaves[0].shape[row_axes[0]]


class Snapshots:
    """`n` snapshot slots of a decode state's rows. `axes`: programs.row_axes of the state;
    `empty(b)`: an empty decode state of b rows (any pools: only its rows are kept)."""

    def __init__(self, units, axes, empty, n: int):
        if n < 1:
            raise ValueError(f"snapshots: need at least one slot, got {n}")
        self.units, self.axes, self.n = units, axes, n
        self.store, _, _ = programs.split(empty(n), axes)
        self.bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in self.store)

    def _pad(self, idx, size: int, past: int) -> np.ndarray:
        idx = list(idx)
        return np.asarray(idx + [past] * (size - len(idx)), np.int32)

    def take(self, state, rows, slots, batch: int):
        """`state` after slots `slots` took copies of rows `rows` (pairwise)."""
        state, self.store = _take(self.units, self.axes, state, self.store,
                                  self._pad(rows, batch, batch), self._pad(slots, batch, self.n))
        return state

    def give(self, state, rows, slots, batch: int):
        """`state` with (just cleared) rows `rows` restored from slots `slots` (pairwise)."""
        return _give(self.units, self.axes, state, self.store,
                     self._pad(rows, batch, batch), self._pad(slots, batch, self.n))

    def drop(self, state, slots):
        """`state` after slots `slots` were emptied (their page references released)."""
        mask = np.zeros(self.n, bool)
        mask[list(slots)] = True
        state, self.store = _drop(self.units, self.axes, state, self.store, mask)
        return state
