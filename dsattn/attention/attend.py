"""One home for an attention read: `Read` describes what a layer's queries read, `attend`
runs it through the implementation the config names (`attention.impl`, looked up in
dsattn/kernels/registry.py). Every family calls `attend` (MHA/GQA/MQA, MLA's naive and
absorbed paths, DSA, the V4 family's sink core); the blocked XLA code behind it is
attention/reference.py, and a fused kernel plugs in as another registry entry
(docs/design.md, "Attention reads").

A read is the queries, their positions, and one or more parts under one softmax:

- `Keys`: keys visible by position (key j to query i when pos[j] <= q_pos[i] and, if given,
  seen[j]): MHA/MLA's own sequence in training, a contiguous cache's slots and a chunk's
  own tokens in cached execution;
- `local.Window`: the V4 family's sliding window (keys in position order, masked by the
  window's width);
- `reads.Visible` / `reads.Picked`: global items of a store, every complete one or the ids
  a selection picks (not gathered entries: an implementation gathers what it reads).

Plus a sink logit per head (V4), the softmax scale, and the indexer's KL target when the
indexer's mass per picked entry is wanted (training of DSA, CSA and CSA2).
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import jax
from flax import struct

from dsattn.attention import reads
from dsattn.kernels import registry


class Layout(enum.Enum):
    """How a read's keys are laid out, which decides how its scores and mixing are formed.

    GROUPED: MHA/GQA/MQA, q [B, T, H, d], K and V per K/V head, head-major [B, G, S, d].
    PER_HEAD: MLA's naive path, q = (q_nope [B,T,H,dn], q_pe [B,T,H,dr]), keys
      (K^C [B, S, H, dn], the shared K^R [B, S, dr], V [B, S, H, dv]).
    SHARED: one entry per key serves every head as key and value (the V4 family, MLA's
      absorbed path and DSA): q [B, T, H, c], entries [B, S, c].
    """

    GROUPED = "grouped"
    PER_HEAD = "per_head"
    SHARED = "shared"


@struct.dataclass
class Keys:
    """A key set read by position: key j is visible to query i when ``pos[b, j] <=
    q_pos[b, i]`` and ``seen[b, j]`` (None: every key). ``arrays``: the layout's key and
    value arrays. ``sequence``: the keys are the training sequence itself (key j at position
    j, the queries the same positions), so a causal segment of query blocks reads only the
    keys before its end. ``slots`` (SHARED layout only, or None): the same keys as a
    contiguous cache stores them (`cache.contiguous.Slots`), which a decode kernel reads in
    place of the decoded ``arrays``."""

    arrays: tuple
    pos: jax.Array
    seen: jax.Array | None = None
    sequence: bool = struct.field(pytree_node=False, default=False)
    slots: Any = None


GLOBAL = (reads.Visible, reads.Picked)


@struct.dataclass
class Read:
    """What one attention call reads (module docstring).

    ``q``: the queries in the layout's form (an array or a tuple of arrays [B, T, ...]);
    ``positions`` [B, T]; ``valid`` [B, T] (None: every query; only the indexer's KL loss
    reads it); ``parts``: a global read (`reads.Visible` / `reads.Picked`) first if any, then
    `Keys` and `local.Window`; ``sink`` [H] or None; ``target``: the indexer's query whose
    KL loss learns the attention mass on the global items (None: no mass wanted). Static:
    the layout, the softmax ``scale``, ``value_dim`` (SHARED: the output is the mix of each
    entry's first value_dim channels; None: all), the query and entry block sizes
    (``entry_block`` None: no online softmax) and ``dtype`` (what a store decodes to). With
    a target the read returns (KL loss, (Σ recall, queries measured)): the indexer's recall
    where a selection is read densely (`indexer.recall_terms`, the dense warm-up's metric;
    (0, 0) where it read only its picks).
    """

    q: Any
    positions: jax.Array
    valid: jax.Array | None
    parts: tuple
    sink: jax.Array | None
    target: reads.KLTarget | None
    layout: Layout = struct.field(pytree_node=False)
    scale: float = struct.field(pytree_node=False)
    query_block: int = struct.field(pytree_node=False)
    dtype: Any = struct.field(pytree_node=False)
    value_dim: int | None = struct.field(pytree_node=False, default=None)
    entry_block: int | None = struct.field(pytree_node=False, default=None)

    @property
    def global_read(self):
        """The read's global part (`reads.Visible` / `reads.Picked`), or None."""
        return self.parts[0] if self.parts and isinstance(self.parts[0], GLOBAL) else None


# prologue(q_block) -> the queries in the layout's form (MLA: W^UK folded in), and
# epilogue(out [B, Tq, H, dv], positions [B, Tq]) -> the layer's output: applied per query
# block by the reference, once over the whole sequence by a fused kernel.
Prologue = Callable[[Any], Any]
Epilogue = Callable[[jax.Array, jax.Array], jax.Array]


def attend(read: Read, impl: str, prologue: Prologue | None = None,
           epilogue: Epilogue | None = None):
    """(the layer's output [B, T, ...], with a KL target (KL loss, recall terms), else None)
    of ``read`` through the registered attention implementation ``impl`` chooses for the
    platform the program is lowered for (a `registry.Choice` from `registry.resolve`)."""
    prologue, epilogue = prologue or (lambda q: q), epilogue or (lambda o, pos: o)
    return registry.dispatch(impl, lambda name: registry.load(registry.Op.ATTENTION, name)(
        read, prologue, epilogue))
