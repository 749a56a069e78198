"""The compiled programs continuous batching adds to dsattn.generate's (whose
prefill_program runs every step: each row extends by its own count of tokens, 0 for an idle
row, 1 for a decoding one, a chunk for a prefilling one): per-row sampling, clearing rows
for their next owner, and taking a few rows out of the decode state and putting them back
(so a prefill chunk runs over the prefilling rows alone, not over the whole batch). All keep
static shapes: the batch of rows is fixed, a sub-batch's size is a power of two."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from dsattn import generate, scan
from dsattn.cache.protocol import blanked, is_container


@jax.jit
def sample_rows(logits, seeds, steps, temperature, top_p):
    """One token per row [B] from logits [B, V], each with its own sampling: greedy where
    temperature [B] is 0, else temperature + top-p [B] with key
    fold_in(PRNGKey(seed), step): exactly the draw Engine.generate makes for a request run
    alone (its row 0 at that step)."""

    def one(lg, seed, step, t, p):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        drawn = generate._sample(lg[None], key, jnp.maximum(t, 1e-6), p, greedy=False)[0]
        return jnp.where(t == 0, jnp.argmax(lg).astype(jnp.int32), drawn)

    return jax.vmap(one)(logits, seeds, steps, temperature.astype(jnp.float32),
                         top_p.astype(jnp.float32))


def _clear(rows, cache, blank):
    """One container (or bare leaf) with `rows` [B] cleared for their next owner, as it
    declares (cache.protocol's `cleared`: a paged cache's pages go back to its free stack;
    other containers' rows take the values of `blank`, the same container for one empty row),
    so no page, window slot or open compressor span of the last owner survives."""
    return cache.cleared(rows, blank) if is_container(cache) else blanked(cache, rows, blank)


@partial(jax.jit, static_argnums=0, donate_argnums=1)
def clear_rows(units, state, rows, blank):
    """`state` (a DecodeState) with the rows where `rows` [B] is True emptied, as
    init_cache makes them: position 0, pages released, local state reset. `blank`: an
    empty DecodeState of one row (same model and max_len); `units`: scan.units of the
    model, which lay out both."""
    layers = scan.per_layer(units, state.layers)
    blanks = scan.per_layer(units, blank.layers)
    new = [jax.tree.map(partial(_clear, rows), lc, bl, is_leaf=is_container)
           for lc, bl in zip(layers, blanks)]
    return state.replace(pos=jnp.where(rows, 0, state.pos),
                         overflow=jnp.where(rows, False, state.overflow),
                         evaluations=jnp.where(rows, 0, state.evaluations),
                         layers=tuple(scan.per_unit(units, new)))


def row_axes(shaped) -> tuple[int | None, ...]:
    """Each leaf's row axis in a decode state, in `jax.tree.leaves` order; None for a leaf
    the rows share (a page pool, its free stack). `shaped(b)`: the state's shapes for b rows
    with the same pools. The row axis is the one that grows with one more row, whatever the
    container or the scan layout that holds the leaf."""
    one, more = (jax.tree.leaves(jax.eval_shape(lambda b=b: shaped(b))) for b in (1, 2))
    axes = []
    for a, b in zip(one, more):
        grown = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(grown) > 1 or a.ndim != b.ndim:
            raise ValueError(f"decode state leaf {a.shape} -> {b.shape}: no single row axis")
        axes.append(grown[0] if grown else None)
    return tuple(axes)


def split(state, axes):
    """(the row leaves, the shared leaves, how to rebuild): `state`'s leaves by `axes`."""
    leaves, tree = jax.tree.flatten(state)
    rows = [x for x, a in zip(leaves, axes) if a is not None]
    shared = [x for x, a in zip(leaves, axes) if a is None]
    return rows, shared, tree


def join(tree, axes, rows, shared):
    """`split`'s inverse."""
    rows, shared = iter(rows), iter(shared)
    return jax.tree.unflatten(tree, [next(shared) if a is None else next(rows) for a in axes])


@partial(jax.jit, static_argnums=(0, 1, 7), donate_argnums=5)
def extend_rows(graph, axes, state, tokens, n_new, cache, idx, replay=None, replay_from=None):
    """(logits [p, V], cache): generate.prefill_program over rows `idx` [p] of `cache` alone
    (tokens [p, T], n_new [p]: the sub-batch's), in one program: the rows taken out (an
    index past the batch: a stand-in taking 0 tokens), extended over the pools every row
    shares, and put back. `axes`: row_axes of the cache."""
    row_axes = tuple(a for a in axes if a is not None)
    rows, shared, tree = split(cache, axes)
    sub = join(tree, axes, take_rows(row_axes, rows, idx), shared)
    logits, sub = generate._extend_impl(graph, state, tokens, n_new, sub, replay, replay_from)
    sub_rows, shared, _ = split(sub, axes)
    return logits, join(tree, axes, put_rows(row_axes, rows, idx, sub_rows), shared)


@partial(jax.jit, static_argnums=3)
def merge_rows(logits, idx, sub, rows: int):
    """Logits [rows, V] with rows `idx` [p] taken from `sub` [p, V] (indices past the batch
    dropped); `logits` None: zeros elsewhere (a step whose rows all ran in the sub-batch)."""
    if logits is None:
        logits = jnp.zeros((rows, sub.shape[-1]), sub.dtype)
    return logits.at[idx].set(sub, mode="drop")


@partial(jax.jit, static_argnums=0)
def take_rows(axes: tuple[int, ...], leaves, idx):
    """Rows `idx` [p] of every row leaf (an index past the batch takes the last row: a
    stand-in that the sub-batch runs with 0 tokens and `put_rows` drops)."""
    return [jnp.take(x, idx, axis=a, mode="clip") for x, a in zip(leaves, axes)]


@partial(jax.jit, static_argnums=0, donate_argnums=1)
def put_rows(axes: tuple[int, ...], leaves, idx, sub):
    """Every row leaf with rows `idx` [p] replaced by `sub`'s (indices past the batch are
    dropped)."""
    def put(x, a, s):
        at = (slice(None),) * a + (idx,)
        return x.at[at].set(s, mode="drop")

    return [put(x, a, s) for x, a, s in zip(leaves, axes, sub)]
