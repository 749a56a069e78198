"""The lightning indexer (V3.2 DSA, V4 CSA, V4.1 CSA2): I(t,s) = Σ_j w(t,j)·ReLU(q(t,j)·k(s)),
top-k over the entries visible at t, and the KL loss that trains it.

The query side (`IndexerQuery`) is the same in every family: per-head queries from the
attention's query latent with RoPE on their last `rope_dim` dims, and per-head weights from
x. Keys differ per family and are built by their owners (DSA: LayerNorm(W^K x); CSA: its own
compressor; CSA2: a projection of the main entry). Top-k is discrete, so the indexer learns
only from `kl_loss`; its inputs are detached so that loss trains the indexer alone.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsattn.attention import blocks
from dsattn.attention.common import shared_scores, softmax_dtype, wide_product
from dsattn.config import rotates_keys
from dsattn.kernels import mesh as kernel_mesh
from dsattn.kernels import registry
from dsattn.nn import hadamard
from dsattn.nn.layers import dense
from dsattn.nn.precision import Precision
from dsattn.nn.rope import apply_rope_last


class IndexerQuery(nnx.Module):
    def __init__(self, cfg, q_in: int, rngs: nnx.Rngs):
        ix, m = cfg.indexer, cfg.model
        dt = Precision.of(m)
        self.n, self.d, self.rope_dim = ix.n_heads, ix.head_dim, ix.rope_dim
        self.wq = dense(q_in, self.n * self.d, rngs, dt, m.init_std)
        self.w_heads = dense(m.d_model, self.n, rngs, dt, m.init_std)
        self.scale = (self.n ** -0.5) * (self.d ** -0.5)
        self.rotate = rotates_keys(cfg)

    def __call__(self, q_latent, x, positions, theta):
        """Queries [B, T, n, d] and head weights [B, T, n] (inputs detached)."""
        q_latent, x = jax.lax.stop_gradient(q_latent), jax.lax.stop_gradient(x)
        b, t = x.shape[:2]
        q = self.wq(q_latent).reshape(b, t, self.n, self.d)
        if self.rope_dim:
            q = apply_rope_last(q, positions, theta, self.rope_dim)
        return rotated(q, self.rotate), self.w_heads(x) * self.scale


def rotated(v, enabled: bool):
    """Queries or keys after RoPE, rotated by the Hadamard matrix when the layer's keys are
    stored low-bit (config.rotates_keys): both sides turn alike, so scores stay q·k."""
    return hadamard.rotate(v) if enabled else v


# The scores decide top-k, and decode's kernels take IEEE float32 dots: a GPU's default would
# run float32 dots in TF32 (10-bit mantissa), so training and decode could select differently.
# On bfloat16 inputs HIGHEST is the plain bf16 dot with float32 accumulation.
_DECIDE = jax.lax.Precision.HIGHEST


def scores(q, w, keys):
    """I [B, T, S] for queries q [B,T,n,d], weights w [B,T,n] and keys [B,S,d]."""
    sd = softmax_dtype(q.dtype)
    dots = shared_scores(q, keys, precision=_DECIDE)
    return jnp.einsum("btns,btn->bts", jax.nn.relu(dots), w.astype(sd), precision=_DECIDE)


def gathered_scores(q, w, keys):
    """I [B, T, S] for queries q [B,T,n,d] and weights w [B,T,n] against per-query keys
    [B, T, S, d] (the candidate pool's keys, gathered for each query)."""
    sd = softmax_dtype(q.dtype)
    dots = wide_product(functools.partial(jnp.einsum, "btnd,btsd->btns", precision=_DECIDE),
                        q, keys)
    return jnp.einsum("btns,btn->bts", jax.nn.relu(dots), w.astype(sd), precision=_DECIDE)


def _top(x, k: int, method: str):
    """(values, positions) of the k largest along the last axis; exact ties keep the lower
    position first (lax.top_k is stable). -0.0 becomes +0.0 first: top_k orders -0.0 below
    +0.0, and which sign a zero ReLU score gets depends on how its dot was summed."""
    x = jnp.where(x == 0, jnp.zeros((), x.dtype), x)
    if method == "approx":
        return jax.lax.approx_max_k(x, k, recall_target=1.0)
    if method == "exact":
        return jax.lax.top_k(x, k)
    raise ValueError(f"indexer.select: method={method!r} is not one of: exact, approx")


def select(score, visible, k: int, method: str = "exact"):
    """Top-k entry indices [B, T, k] among the visible ones, and which picks are real.

    ``method="exact"``: lax.top_k, ties break toward the lowest index (it is stable).
    ``method="approx"``: lax.approx_max_k with recall_target=1.0, for TPU, where it runs the
    partial-reduce top-k instead of a sort; it returns the same set on tie-free scores, but
    which of several tied entries it picks is unspecified (order may differ as well).
    When fewer than k entries are visible the extra picks are marked invalid.
    """
    k = min(k, score.shape[-1])
    vals, idx = _top(jnp.where(visible, score, -jnp.inf), k, method)
    return idx.astype(jnp.int32), vals > -jnp.inf


def top_k(q, w, keys, stored, n_visible, k: int, key_block: int, method: str = "exact",
          block_max: int | None = None, query_block: int = 1):
    """The indexer's top-k of queries q [B,T,n,d] (weights w [B,T,n]) over keys [B,S,d],
    scored key block by key block with a running top-k, so no [B, T, n, S] (nor [B, T, S])
    array is ever live: O(T·(k + key_block)).

    A query at t may pick key s where ``stored`` [B, S] and s < ``n_visible`` [B, T]. Returns
    (idx [B, T, min(k, S)], ok), equal to ``select`` over the whole score (ties to the lowest
    index: the running set holds lower indices than every later block and top_k is stable),
    and with ``block_max`` also each block of that many entries' maximum candidate score
    [B, T, ceil(S / block_max)] (``block_scores``).
    """
    s_len = keys.shape[1]
    k = min(k, s_len)
    key_block = blocks.per_step(key_block, query_block, q.shape[1])
    if block_max:  # maxima per key block must not straddle two key blocks
        key_block = -(-key_block // block_max) * block_max

    def scored(keys_blk, stored_blk, lo):
        ok = stored_blk[:, None, :] & (lo + jnp.arange(keys_blk.shape[1]) < n_visible[..., None])
        return jnp.where(ok, scores(q, w, keys_blk), -jnp.inf)

    if s_len <= key_block:
        s = scored(keys, stored, 0)
        vals, idx = _top(s, k, method)
        maxima = block_scores(s, s > -jnp.inf, block_max) if block_max else None
        return idx.astype(jnp.int32), vals > -jnp.inf, maxima
    n_blk = -(-s_len // key_block)
    # padding is never stored
    key_blocks = (blocks.split(keys, 1, key_block), blocks.split(stored, 1, key_block))
    sd = softmax_dtype(q.dtype)
    init = (jnp.full(q.shape[:2] + (k,), -jnp.inf, sd), jnp.zeros(q.shape[:2] + (k,), jnp.int32))

    def merge(run, xs):
        (keys_blk, stored_blk), j = xs
        lo = j * key_block
        s = scored(keys_blk, stored_blk, lo)
        ids = jnp.broadcast_to(lo + jnp.arange(key_block, dtype=jnp.int32), s.shape)
        vals, pos = _top(jnp.concatenate([run[0], s], -1), k, method)
        ids = jnp.take_along_axis(jnp.concatenate([run[1], ids], -1), pos, axis=-1)
        maxima = block_scores(s, s > -jnp.inf, block_max) if block_max else None
        return (vals, ids), maxima

    (vals, idx), maxima = jax.lax.scan(merge, init,
                                       (key_blocks, jnp.arange(n_blk, dtype=jnp.int32)))
    if block_max:  # [n_blk, B, T, key_block / block_max] -> [B, T, ceil(S / block_max)]
        maxima = jnp.moveaxis(maxima, 0, 2).reshape(q.shape[:2] + (-1,))
        maxima = maxima[..., : -(-s_len // block_max)]
    return idx, vals > -jnp.inf, maxima


def selection_mask(idx, valid, n: int):
    """Boolean [B, T, n] with True at the selected entries (training forward)."""
    one_hot = (idx[..., None] == jnp.arange(n)) & valid[..., None]
    return jnp.any(one_hot, axis=-2)


def kl_terms(score, target_probs, mask):
    """(Σ KL(target || softmax(score)), number of queries with any target mass) over the
    masked entries; the loss is their ratio (``kl_loss``), so sums over query blocks combine.

    target_probs [B, T, S]: the main attention's probability on each entry, summed over heads
    (it is renormalised here and carries no gradient).
    """
    sd = softmax_dtype(score.dtype)
    p = jax.lax.stop_gradient(jnp.where(mask, target_probs, 0).astype(sd))
    total = jnp.sum(p, -1, keepdims=True)
    has = total[..., 0] > 0
    p = p / jnp.where(total > 0, total, 1)
    logq = jax.nn.log_softmax(jnp.where(mask, score.astype(sd), -jnp.inf), axis=-1)
    logq = jnp.where(mask, logq, 0)
    logp = jnp.log(jnp.where(p > 0, p, 1))
    kl = jnp.sum(p * (logp - logq), axis=-1)
    return jnp.sum(jnp.where(has, kl, 0)), jnp.sum(has).astype(sd)


def kl_loss(score, target_probs, mask):
    """KL(target || softmax(score)) over masked entries, averaged over queries with any."""
    total, count = kl_terms(score, target_probs, mask)
    return total / jnp.maximum(count, 1)


def recall_terms(target_probs, mask, idx, ok):
    """(Σ recall, number of queries with any target mass) of the picks (idx, ok) [B, T, k]:
    how much of the attention's mass the indexer's top-k would keep, measured where the
    attention read every entry (the dense warm-up). Sums, so query blocks combine.

    A query's recall is the target mass on its valid picks over the most that any k' of its
    masked entries hold (the mass's own top-k', k' its number of valid picks): 1 when the
    indexer picks the attention's top-k', ties included. target_probs [B, T, S] as in
    `kl_terms` (a ratio: no need to renormalise). Both sides add the same values in the
    same (descending) order, so picking the top-k' gives exactly 1.
    """
    sd = softmax_dtype(target_probs.dtype)
    p = jax.lax.stop_gradient(jnp.where(mask, target_probs, 0).astype(sd))
    k = min(idx.shape[-1], p.shape[-1])  # a causal segment may hold fewer entries than k
    picked = jnp.take_along_axis(p, jnp.clip(idx, 0, p.shape[-1] - 1), axis=-1)
    hit = jnp.sum(jax.lax.top_k(jnp.where(ok, picked, 0), k)[0], -1)
    n = jnp.sum(ok, -1, keepdims=True)
    best = jnp.sum(jnp.where(jnp.arange(k) < n, jax.lax.top_k(p, k)[0], 0), -1)
    has = jnp.sum(p, -1) > 0
    recall = hit / jnp.where(best > 0, best, 1)  # no valid pick: 0
    return jnp.sum(jnp.where(has, recall, 0)), jnp.sum(has).astype(sd)


def no_recall(target_probs):
    """`recall_terms`' (0, 0): a read that measures no recall (it read only the picks)."""
    zero = jnp.zeros((), softmax_dtype(target_probs.dtype))
    return zero, zero


# -- hierarchical indexer (V4.1 decoder): a candidate pool of blocks ------------------------
def block_scores(score, visible, block: int):
    """Max visible score in each block of `block` consecutive entries: [B, T, ceil(N/block)]."""
    n = score.shape[-1]
    nb = -(-n // block)
    s = jnp.where(visible, score, -jnp.inf)
    s = jnp.pad(s, [(0, 0)] * (s.ndim - 1) + [(0, nb * block - n)], constant_values=-jnp.inf)
    return jnp.max(s.reshape(s.shape[:-1] + (nb, block)), axis=-1)


def candidate_pool(block_max, n_visible, block: int, n_blocks: int):
    """Entry ids [B, T, n_blocks·block] of the pool and which are real candidates.

    ``block_max`` [B, T, nb]: each block's maximum visible score (``block_scores``, or the
    score kernels' in-kernel maxima). The pool is the `n_blocks` blocks with the highest block
    maximum; the block holding the newest visible entry is always in it (pinned with +inf),
    counted within `n_blocks`. Ids come in ascending order.
    """
    newest = (n_visible - 1) // block
    pinned = (jnp.arange(block_max.shape[-1]) == newest[..., None]) & (n_visible[..., None] > 0)
    bs = jnp.where(pinned, jnp.inf, block_max)
    vals, ids = _top(bs, min(n_blocks, bs.shape[-1]), "exact")
    # Entry ids ascending, so top-k ties inside the pool (ReLU makes exact zeros common)
    # break toward the lowest entry id, as in the forward's dense mask.
    order = jnp.argsort(ids, axis=-1)
    ids, vals = (jnp.take_along_axis(a, order, axis=-1) for a in (ids, vals))
    idx = ids[..., None] * block + jnp.arange(block)
    ok = (vals > -jnp.inf)[..., None] & (idx < n_visible[..., None, None])
    return idx.reshape(idx.shape[:-2] + (-1,)).astype(jnp.int32), ok.reshape(ok.shape[:-2] + (-1,))


# -- the score pass over the paged global cache, through the configured implementation -----
# The training forward scores its own sequence's keys by the reference's key blocks (a
# score kernel reads a paged cache).
IN_TRAINING = registry.Choice(registry.reference(registry.Op.INDEXER_SCORE))


def resolve_impl(cfg) -> registry.Choice:
    """The score pass `indexer.impl` runs as (kernels/registry.py). `auto`: in a program
    lowered for a GPU or TPU, that chip's compiled kernel (pallas_gpu, pallas_tpu) when it
    reads this key format and fits the config; the XLA path elsewhere (CPU). Raises for an
    explicit kernel that cannot read the configured key format."""
    return registry.resolve(registry.Op.INDEXER_SCORE, cfg, cfg.indexer.impl,
                            cfg.cache.key_format, "cache.key_format")


def uses_kernel(impl: str) -> bool:
    """Whether the score pass `impl` is a compiled kernel over the pages (not the inline XLA
    path, which reads every key and scores them)."""
    return registry.load(registry.Op.INDEXER_SCORE, impl) is not None


def paged_scores(q, w, cache, n_visible, impl: str, interpret: bool | None, dtype,
                 block_max: int | None = None):
    """Scores [B, T, max_entries] of queries against every stored search key of a paged
    cache; -inf where the entry is not visible (index >= n_visible [B, T] or >= length).
    With ``block_max`` also each block's maximum (``block_scores``): (scores, maxima), from
    the kernel itself on the pallas paths."""
    from dsattn.cache import paged

    kernel = registry.load(registry.Op.INDEXER_SCORE, impl)
    if kernel is not None:  # on a mesh, per row shard over its own pool group
        def rows(per_row, _):
            q, w, cache, n_visible = per_row
            pages, table = paged.pool(cache, "key")
            return kernel(q, w, pages, table, cache.length, n_visible,
                          cache.fields["key"].fmt, interpret=interpret,
                          max_entries=cache.max_entries, block_max=block_max), ()

        return kernel_mesh.by_rows(rows, q.shape[0], (q, w, cache, n_visible))[0]
    keys, stored = paged.read_all(cache, "key", dtype)
    visible = stored[:, None, :] & (jnp.arange(keys.shape[1]) < n_visible[..., None])
    score = jnp.where(visible, scores(q, w, keys), -jnp.inf)
    return score if block_max is None else (score, block_scores(score, visible, block_max))
