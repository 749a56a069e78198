"""A compressor's streaming state: the open entries' softmax-pooling accumulators, per row
(attention/compressor.py merges tokens into them). Bookkeeping, not stored vectors: a
container without `storage` (cache.protocol), split by rows on a mesh, counted as 0
stored bytes."""

import jax
from flax import struct

from dsattn.cache.protocol import Container


@struct.dataclass
class PoolState(Container):
    """Streaming accumulators of the open entries, per row and channel: softmax-pooling
    (max, denominator, weighted sum), each [B, open entries, width] in the stats dtype."""

    max: jax.Array
    den: jax.Array
    num: jax.Array
    storage = None  # no stored vectors
