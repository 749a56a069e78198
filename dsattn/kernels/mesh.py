"""Kernel calls on a device mesh. XLA's SPMD partitioner cannot split a Pallas call (a Mosaic
or Triton custom call is opaque to it), so on a mesh of several devices every kernel runs
under `jax.shard_map`: each device runs it on its own rows, as dsattn.sharding lays rows out
(over `data` and `fsdp`, as many of them as divide the batch). A paged cache's pool is split
the same way (one pool group per row shard: cache.paged), so a device's rows read only its
own pages; a scanned copy's view (scan.InPlace) is split along its stacked array's row axis
(cache.protocol.batch_axes).
What is not per row (a sink [H]) is passed whole; heads are not split (the `tensor` axis
sees every head: a tensor-split q is gathered at the boundary).

Without a mesh, or on one device, the call runs as it is: the programs of one device are
unchanged.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from dsattn import sharding


def _specs(rows, axes):
    """PartitionSpecs of `rows`' arrays: their row axis over `axes` (the leading one, or a
    view's own: cache.protocol.batch_axes), scalars whole."""
    def spec(axis, x):
        return P() if axis is None or x.ndim == 0 or not axes else P(*([None] * axis), axes)

    view = lambda x: hasattr(x, "batch_axes")  # noqa: E731 - maps its own axes

    def leaf(x):
        if view(x):
            return jax.tree.map(spec, x.batch_axes(0), x, is_leaf=lambda a: a is None)
        return spec(0, x)

    return jax.tree.map(leaf, rows, is_leaf=view)


def by_rows(f, batch: int, rows, whole=()):
    """f(rows, whole) run per row shard of the active mesh (module docstring): ``rows`` a
    pytree whose arrays hold `batch` rows on their leading axis (or a view's own), ``whole``
    what every device takes whole. f returns (per-row outputs, sums): the outputs hold rows
    on their leading axis, the sums are added over the shards and returned whole. Without a
    mesh, or on one device: f(rows, whole). On a mesh whose row axes do not divide the
    batch, every device runs f on all rows (a kernel still never meets the partitioner)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return f(rows, whole)
    axes = sharding.row_axes(mesh, batch)
    axes = axes if len(axes) != 1 else axes[0]

    def local(rows, whole):
        out, sums = f(rows, whole)
        return out, jax.tree.map(lambda s: jax.lax.psum(s, axes), sums) if axes else sums

    return jax.shard_map(local, in_specs=(_specs(rows, axes), P()),
                         out_specs=(P(axes) if axes else P(), P()), check_vma=False)(rows, whole)
