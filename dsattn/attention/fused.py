"""An attention read (`attend.Read`) through kernels of the fused-attention contract
(docs/design.md, "Attention reads"): the adapter that turns a dense kernel, a
selected-entries kernel and its entry-mass pass into a registry entry.

    dense(q, k, v, *, scale, q_positions, k_positions, causal, window, sink, k_valid)
        -> (out [B, T, H, dv], lse [B, T, H])          q [B,T,H,dk], k/v [B,S,Hk,dk|dv]
    sparse(q, store, idx, *, scale, sink, value) -> (out, lse)   store [B,N,c], idx [B,T,k]
    entry_mass(q, store, idx, lse, *, scale) -> [B, T, k]   probability per pick, over heads
    decode(q, q_pos, parts, *, scale, sink, value_dim) -> (out, lse)   optional: one
        decode step's parts (kernels/decode_attention.py: a window's ring after the step's
        write, picks or every visible entry of a paged cache, a contiguous cache's slots,
        the step's own keys) in one call, read from the caches in their stored formats;
        q [B, H, c], q_pos [B]

Each part of the read is one kernel call over the whole sequence (a kernel blocks it
itself); the parts are merged by their log-sum-exp with the sink added once, the
epilogue runs over the whole output, and the indexer's KL target (and, where a selection is
read densely, its recall) comes from `entry_mass` at the merged log-sum-exp.
Nothing here materialises per-block scores. A decode step over shared entries (the V4
family's window and global part, MLA's absorbed latents, DSA's picked tokens) goes to
`decode` when given, so it reads only what it selects, as stored; otherwise a paged store
is decoded whole (`read_all`) for the other kernels. MHA's decode step (GROUPED, one query
per row) stays with the reference's dots over its head-major cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsattn.attention import blocks, indexer, reads, reference
from dsattn.attention.attend import Keys, Layout, Read
from dsattn.attention.local import Window
from dsattn.cache.paged import PagedCache
from dsattn.kernels import decode_attention
from dsattn.kernels import mesh as kernel_mesh


def _contract_q(read: Read, q):
    """The queries as the contract's [B, T, H, dk]."""
    if read.layout is Layout.PER_HEAD:  # [q_nope | q_pe] against [K^C | K^R]
        return jnp.concatenate(q, -1)
    return q


def _contract_kv(read: Read, arrays, heads: int):
    """A `Keys` part's arrays as the contract's (k [B, S, Hk, dk], v [B, S, Hk, dv])."""
    if read.layout is Layout.GROUPED:  # head-major [B, G, S, d]
        return tuple(jnp.swapaxes(a, 1, 2) for a in arrays)
    if read.layout is Layout.PER_HEAD:
        k_nope, k_pe, v = arrays
        k_pe = jnp.broadcast_to(k_pe[:, :, None], k_pe.shape[:2] + (heads, k_pe.shape[-1]))
        return jnp.concatenate([k_nope, k_pe], -1), v
    return _entries_kv(read, arrays[0])


def _entries_kv(read: Read, entries):
    """Entries [B, S, c] as one K/V head: K the entry, V its first value_dim channels."""
    k = entries[:, :, None]
    return k, (k if read.value_dim is None else k[..., :read.value_dim])


def _merge(parts, sink):
    """(out, lse) of parts [(out, lse)] under one softmax, the sink [H] in its
    denominator; a row that sees nothing gets zeros."""
    lses = [lse for _, lse in parts]
    if sink is not None:
        lses.append(jnp.broadcast_to(sink.astype(lses[0].dtype), lses[0].shape))
    lse = jax.nn.logsumexp(jnp.stack(lses), axis=0)
    seen = jnp.isfinite(lse)
    safe = jnp.where(seen, lse, 0)
    out = sum(jnp.where(seen & jnp.isfinite(l), jnp.exp(l - safe), 0)[..., None]
              * o.astype(jnp.promote_types(o.dtype, l.dtype)) for o, l in parts)
    return out.astype(parts[0][0].dtype), lse


_OWN_KEYS = 64  # keys as computed that one kernel program walks (a step's own token)


def _decode_parts(read: Read, q):
    """The parts (kernels/decode_attention.py) a decode kernel reads `read` by, from the
    caches as stored, when it is one decode step it can read: one query per row, SHARED
    entries, no KL target, every part a window with its ring, a global read of a paged cache,
    a contiguous cache's slots or a few cached-execution keys as computed (with their
    `seen`). Else None."""
    if q.shape[1] != 1 or read.layout is not Layout.SHARED or read.target is not None:
        return None
    q_pos, parts = read.positions[:, 0], []
    for part in read.parts:
        if isinstance(part, Window) and part.ring is not None:
            parts.append(decode_attention.window(part.ring, part.size))
        elif isinstance(part, reads.Visible) and isinstance(part.store, PagedCache):
            parts.append(decode_attention.visible(part.store, q_pos, part.stride))
        elif (isinstance(part, reads.Picked) and isinstance(part.store, PagedCache)
              and part.selection.dense is None):
            sel = part.selection
            parts.append(decode_attention.picks(part.store, jnp.where(sel.ok, sel.idx, -1)[:, 0]))
        elif isinstance(part, Keys) and part.slots is not None:
            sl = part.slots
            parts.append(decode_attention.prefix(sl.stored, sl.fmt, sl.rope, sl.count))
        elif (isinstance(part, Keys) and not part.sequence and part.seen is not None
              and part.pos.shape[1] <= _OWN_KEYS):
            pos = jnp.where(part.seen, part.pos, -1)
            parts.append(decode_attention.values(part.arrays[0], pos))
        else:
            return None
    return parts


def adapter(dense, sparse, entry_mass, decode=None):
    """The registry's attention function (`attend.attend` calls it) for kernels of the
    contract's form (module docstring). On a mesh the kernels run per row shard
    (kernels/mesh.py); the prologue and epilogue run outside, as XLA partitions them."""

    def run(read: Read, prologue, epilogue):
        if read.layout is Layout.GROUPED and read.positions.shape[1] == 1:
            # MHA's decode step: XLA's batched dots read the head-major cache in place,
            # where the dense kernel's [B, S, Hk, d] keys would be a transposed copy of it
            return reference.run(read, prologue, epilogue)
        q = _contract_q(read, prologue(read.q))

        def rows(per_row, whole):
            (read, q), (sink,) = per_row, whole
            return kernels(read.replace(sink=sink), q)

        out, sums = kernel_mesh.by_rows(rows, q.shape[0], (read.replace(q=None, sink=None), q),
                                        (read.sink,))
        y = epilogue(out, read.positions)
        if read.target is None:
            return y, None
        (total, count), recall = sums
        return y, (total / jnp.maximum(count, 1), recall)

    def kernels(read: Read, q):
        """(the read's output [B, T, H, dv] before the epilogue, and with a KL target its
        ((total, count) of KL terms, recall terms); else ()), every part by a kernel."""
        heads, pos = q.shape[2], read.positions
        parts = None if decode is None else _decode_parts(read, q)
        if parts is not None:
            out, _ = decode(q[:, 0], pos[:, 0], parts, scale=read.scale, sink=read.sink,
                            value_dim=read.value_dim)
            return out[:, None], ()
        common = dict(scale=read.scale, q_positions=pos)
        local = []
        for part in read.parts:
            if isinstance(part, Keys):
                k, v = _contract_kv(read, part.arrays, heads)
                local.append(dense(q, k, v, k_positions=part.pos, causal=True,
                                   k_valid=part.seen, **common))
            elif isinstance(part, Window):
                k, v = _entries_kv(read, part.keys)
                local.append(dense(q, k, v, k_positions=part.pos, causal=True,
                                   window=part.size, k_valid=part.pos >= 0, **common))
        glob = read.global_read
        if glob is None:
            return _merge(local, read.sink)[0], ()

        def visible():
            entries, stored = glob.store.read_all("entry", read.dtype)
            n = entries.shape[1]
            k_pos = jnp.broadcast_to((jnp.arange(n, dtype=jnp.int32) + 1) * glob.stride - 1,
                                     stored.shape)
            k, v = _entries_kv(read, entries)
            part = dense(q, k, v, k_positions=k_pos, causal=True, k_valid=stored, **common)
            if read.target is None:
                return part, ()
            # every visible entry is a pick: its ids, mass and KL terms exist for one block
            # of queries at a time ([B, block, N]), never for the whole [B, T, N]
            lse = _merge([part, *local], read.sink)[1]
            keys = glob.store.read_all("key", read.dtype)[0]
            # the dense warm-up's selection, whose recall of the mass the read measures
            picks = ((glob.selection.idx, glob.selection.ok)
                     if isinstance(glob, reads.Picked) else None)

            def one(start, blk):
                q_blk, lse_blk, pos_blk, iq, w, ok_rows, picks_blk = blk
                seen = stored[:, None, :] & reads.visible(pos_blk, glob.stride, n)
                ids = jnp.where(seen, jnp.arange(n, dtype=jnp.int32), -1)
                mass = entry_mass(q_blk, entries, ids, lse_blk, scale=read.scale)
                seen = seen & ok_rows[..., None]
                return (), (indexer.kl_terms(indexer.scores(iq, w, keys), mass, seen),
                            indexer.no_recall(mass) if picks_blk is None
                            else indexer.recall_terms(mass, seen, *picks_blk))

            valid = jnp.ones(pos.shape, bool) if read.valid is None else read.valid
            return part, blocks.map_queries(one, read.query_block, (
                q, lse, pos, read.target.q, read.target.w, valid, picks))[1]

        def picked():
            entries = glob.store.read_all("entry", read.dtype)[0]
            sel = glob.selection
            ids = jnp.where(sel.ok, sel.idx, -1)
            value = None if read.value_dim is None else entries[..., :read.value_dim]
            return finish(sparse(q, entries, ids, scale=read.scale, value=value), entries,
                          ids)

        def finish(part, entries, ids):
            """The global part and, with a target, its KL terms at the merged lse."""
            if read.target is None:
                return part, ()
            lse = _merge([part, *local], read.sink)[1]
            mass = entry_mass(q, entries, ids, lse, scale=read.scale)
            return part, _kl_terms(read, glob.store, ids, mass)

        if isinstance(glob, reads.Visible):
            part, sums = visible()
        elif glob.selection.dense is None:
            part, sums = picked()
        else:  # the dense warm-up reads every complete entry
            part, sums = jax.lax.cond(glob.selection.dense, visible, picked)
        return _merge([part, *local], read.sink)[0], sums

    return run


def _kl_terms(read: Read, store, ids, mass):
    """The indexer's KL terms over the picks `ids` [B, T, k] (-1: none) given the attention
    mass on them, by query blocks (the indexer's keys gathered for one block at a time)."""
    valid = jnp.ones(ids.shape[:2], bool) if read.valid is None else read.valid

    def one(start, blk):
        iq, w, idx, m, ok_rows = blk
        keys, got = store.gather("key", idx, read.dtype)
        mask = (idx >= 0) & got & ok_rows[..., None]
        kl = indexer.kl_terms(indexer.gathered_scores(iq, w, keys), m, mask)
        return (), (kl, indexer.no_recall(m))  # read only the picks: no recall

    return blocks.map_queries(one, read.query_block,
                              (read.target.q, read.target.w, ids, mass, valid))[1]
