"""Caches of a scanned layer group (model.ScannedBlocks): every leaf carries a leading
copies axis, one slice per copy of the group.

A scan body works on one copy. Slicing a copy's stored vectors out of the stacked arrays and
writing them back would copy the whole cache of a layer every step, which is what a decode
step must never do: it reads only what it selects. So a copy's *view* slices the small leaves
(positions, page tables, lengths, compressor accumulators) but leaves the stored vectors
(`storage`, cache.protocol: a paged cache's pages, a ring's or contiguous cache's vectors)
stacked, with the copy's index in the cache (`copy`); the cache functions read and write them at
`[copy, ...]`, so XLA updates the stacked arrays in place. `merge` puts a copy's small
leaves back and takes its (already updated) stored vectors as they are.
"""

import jax
import jax.numpy as jnp

from dsattn.cache.protocol import index, is_container


def _small(c):
    """A container without its stored vectors and the fields it keeps whole."""
    return c.with_vectors({}).replace(**{f: None for f in c.whole})


def _with_whole(small, node):
    return small.with_vectors(node.vectors).replace(**{f: getattr(node, f) for f in node.whole})


def view(stacked, i):
    """Copy `i` (a traced int) of a tree of stacked caches, read and written in place."""
    def one(node):
        if not is_container(node):
            return jax.tree.map(lambda a: a[i], node)
        return _with_whole(jax.tree.map(lambda a: a[i], _small(node)).replace(copy=i), node)

    return jax.tree.map(one, stacked, is_leaf=is_container)


def merge(stacked, new, i):
    """`stacked` with copy `i` replaced by `new` (a `view` after the copy's updates)."""
    def one(old, node):
        if not is_container(node):
            return jax.tree.map(lambda a, b: a.at[i].set(b), old, node)
        small = jax.tree.map(lambda a, b: a.at[i].set(b), _small(old),
                             _small(node).replace(copy=None))
        return _with_whole(small, node)

    return jax.tree.map(one, stacked, new, is_leaf=is_container)


def begin_scan(tree, positions, valid):
    """Each container of a group's stacked caches before a scan over its copies."""
    return jax.tree.map(lambda n: n.begin_scan(positions, valid) if is_container(n) else n,
                        tree, is_leaf=is_container)


def end_scan(tree):
    return jax.tree.map(lambda n: n.end_scan() if is_container(n) else n, tree,
                        is_leaf=is_container)


def stack(tree, copies: int):
    """A tree of (empty) caches for `copies` copies of a scanned group (each container's
    `stack`; other leaves gain a leading copies axis)."""
    return jax.tree.map(lambda n: n.stack(copies) if is_container(n) else
                        jnp.broadcast_to(n, (copies,) + n.shape).copy(), tree,
                        is_leaf=is_container)


def copy_at(tree, c: int):
    """Copy `c` (a Python int) of a tree of stacked caches, unstacked."""
    return jax.tree.map(lambda n: n.copy_at(c) if is_container(n) else index(n, c), tree,
                        is_leaf=is_container)


def join(trees: list):
    """The inverse of `copy_at`: the stacked tree from every copy's tree, in order."""
    return jax.tree.map(lambda *ns: ns[0].stacked(list(ns)) if is_container(ns[0]) else
                        jnp.stack(ns), *trees, is_leaf=is_container)
