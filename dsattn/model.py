"""The stack: pre-norm blocks (attention + SwiGLU FFN) whose attention kind comes per layer
from the config. One set of weights runs three ways: `model(tokens)` (teacher-forced),
and `extend` over an explicit cache pytree (prefill and decode, driven by dsattn.generate).
"""

import dataclasses
import functools
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import plan, scan, sharding
from dsattn.attention import blocks, selectors, sources
from dsattn.attention.context import CachedContext, Stream, StackContext
from dsattn.attention.dsa import DSA
from dsattn.attention.layer import V4Attention
from dsattn.attention.mha import MHA
from dsattn.attention.mla import MLA
from dsattn.cache.layer_caches import LayerCache
from dsattn.config import Config
from dsattn.errors import InputError
from dsattn.nn.layers import Embedding, SwiGLU
from dsattn.nn.norms import RMSNorm
from dsattn.nn.precision import Precision
from dsattn.nn.remat import in_order as remat_in_order
from dsattn.plan import Family

ATTENTION = {Family.MHA: MHA, Family.MLA: MLA, Family.DSA: DSA, Family.V4: V4Attention}


def make_attention(cfg: Config, spec: plan.LayerSpec, rngs: nnx.Rngs):
    """The attention module of one layer, by its kind's family."""
    return ATTENTION[spec.kind.family](cfg, spec, rngs)


@functools.cache  # one policy object per name: models of one config get equal graphdefs
def remat_policy(name: str):
    """`model.remat` as a jax.checkpoint policy: None for none (no remat). Every policy also
    keeps the indexers' selections (small integer arrays): recomputing one would rerun the
    indexer's O(T * S) scoring and top-k in the backward pass, for no gradient."""
    if name == "none":
        return None
    cp = jax.checkpoint_policies
    # block: save nothing inside: recompute the block in the backward pass
    policy = cp.nothing_saveable if name == "block" else getattr(cp, name)
    return cp.save_from_both_policies(policy, cp.save_only_these_names(selectors.SELECTION))


@dataclasses.dataclass(frozen=True)
class Remat:
    """`model.remat` and `model.remat_block_from`: sequences of `block_from` tokens or more
    rematerialise whole blocks whatever `name` says, since what a policy keeps grows with T
    (docs/design.md, "Long context")."""

    name: str
    block_from: int

    @classmethod
    def of(cls, cfg: Config) -> "Remat":
        return cls(cfg.model.remat, cfg.model.remat_block_from)

    def policy(self, t: int):
        """The jax.checkpoint policy of a training forward over `t` tokens (None: none)."""
        return remat_policy("block" if t >= self.block_from else self.name)


def check_tokens(tokens, vocab_size: int, where: str = "tokens"):
    """Raise if concrete tokens fall outside [0, vocab_size). Tracers pass unchecked."""
    if isinstance(tokens, jax.core.Tracer):
        return
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = arr[(arr < 0) | (arr >= vocab_size)].ravel()[0]
        raise InputError(f"{where}: token id {int(bad)} is outside the vocabulary "
                         f"[0, {vocab_size})")


@partial(jax.tree_util.register_dataclass,
         data_fields=("pos", "overflow", "evaluations", "layers"), meta_fields=("max_len",),
         drop_fields=("host_pos",))
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What cached generation carries between calls: each row's next position, which rows
    a compiled step refused because they would pass `max_len` (sticky; see
    generate.check_cache), each row's (position, layer) evaluations so far, and the layers'
    caches: one per unit (dsattn.scan.units, which lays a scanned group's out;
    `layer_caches` gives one per layer). `max_len`
    is static (not a leaf).

    `host_pos` is `pos` as the host already knows it (a read-only numpy copy), so a
    capacity check needs no device read; it is not part of the pytree: whatever a jax
    transformation returns has None there (unknown: read `pos` when needed), and `replace`
    with a new `pos` drops it unless given."""

    pos: jax.Array  # int32 [B]
    overflow: jax.Array  # bool [B]
    evaluations: jax.Array  # int32 [B]
    layers: tuple[LayerCache | tuple[LayerCache, ...], ...]
    max_len: int
    host_pos: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def replace(self, **changes) -> "DecodeState":
        if "pos" in changes:
            changes.setdefault("host_pos", None)
        if changes.get("host_pos") is not None:
            host = np.array(changes["host_pos"], np.int32)
            host.setflags(write=False)
            changes["host_pos"] = host
        return dataclasses.replace(self, **changes)


class Block(nnx.Module):
    def __init__(self, cfg: Config, spec: plan.LayerSpec, rngs: nnx.Rngs):
        m, dt = cfg.model, Precision.of(cfg.model)
        self.attn_norm = RMSNorm(m.d_model, m.norm_eps, dtype=dt)
        self.attn = make_attention(cfg, spec, rngs)
        self.ffn_norm = RMSNorm(m.d_model, m.norm_eps, dtype=dt)
        self.ffn = SwiGLU(m.d_model, m.ffn_hidden, rngs, dt, m.init_std)
        self.remat, self.token_block = Remat.of(cfg), cfg.attention.query_block

    def __call__(self, x, positions, step=None, ctx=StackContext()):
        """(output, aux losses, the context for the next block)."""
        a, aux, ctx = self.attn(self.attn_norm(x), positions, step, ctx)
        x = x + a
        return _rows(x + self._ffn_by_blocks(x)), aux, ctx

    def _ffn_by_blocks(self, x):
        """The FFN of a training forward, under rematerialisation by blocks of tokens, so a
        backward pass that recomputes it holds one block's hidden activations, not [T, F]."""
        policy = self.remat.policy(x.shape[1])
        if policy is None:
            return self.ffn(self.ffn_norm(x))
        return blocks.map_queries(lambda start, h: (self.ffn(self.ffn_norm(h)), ()),
                                  self.token_block, x, policy)[0]

    def extend(self, x, positions, valid, cache, ctx=CachedContext()):
        """(output, the layer's new cache, the context for the next block)."""
        a, cache, ctx = self.attn.extend(self.attn_norm(x), positions, valid, cache, ctx)
        x = x + a
        return _rows(x + self.ffn(self.ffn_norm(x))), cache, ctx

    def init_cache(self, batch: int, max_len: int) -> LayerCache:
        return self.attn.init_cache(batch, max_len)


class Transformer(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        m, dt = cfg.model, Precision.of(cfg.model)
        self.embedding = Embedding(m.vocab_size, m.d_model, rngs, dt, m.tie_embeddings,
                                   m.init_std)
        specs = plan.resolve(cfg)
        self.units = scan.units(cfg)
        # One entry per unit: a Block, or a scanned group (dsattn.scan).
        self.blocks = nnx.List([
            scan.ScannedBlocks(cfg, u, rngs, partial(Block, cfg), Remat.of(cfg),
                               sources.published) if u.scanned
            else Block(cfg, specs[u.start], rngs)
            for u in self.units])
        self.norm = RMSNorm(m.d_model, m.norm_eps, dtype=dt)

    def forward(self, tokens, step=None):
        """Teacher-forced forward: (logits [B, T, V], per-layer aux dicts).

        `step` (the training step) lets layers run a dense warm-up of their selection.
        """
        h, auxes = self.hidden(tokens, step)
        return self.sequence_logits(h), auxes

    def hidden(self, tokens, step=None):
        """The teacher-forced forward up to the final norm: (hidden states [B, T, D],
        per-layer aux dicts). The training loss unembeds them a block of positions at a time
        (dsattn.trainstep.blocked_token_nll), never holding [B, T, V] logits."""
        check_tokens(tokens, self.cfg.model.vocab_size)
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = _rows(self.embedding(tokens))
        auxes, ctx = [], StackContext()
        policy = Remat.of(self.cfg).policy(t)

        def run(block, x, ctx):
            return block(x, positions, step, ctx)

        def remat(block, x, ctx):
            graphdef, state = nnx.split(block)
            pure = lambda st, x, ctx, pos, step: nnx.merge(graphdef, st)(x, pos, step, ctx)
            return remat_in_order(pure, policy)(state, x, ctx, positions, step)

        for unit, block in zip(self.units, self.blocks):
            if unit.start == self.cfg.attention.ced_split and unit.start:
                ctx = StackContext(encoder_out=x)  # decoder: global KV from the encoder
            # a scanned group rematerialises its scan body itself
            x, aux, ctx = (run if unit.scanned or policy is None else remat)(block, x, ctx)
            auxes.extend(aux if unit.scanned else [aux])
        return self.norm(x), auxes

    def sequence_logits(self, h):
        """Logits [B, T, V] of final hidden states [B, T, D] (rows split as the batch is)."""
        return sharding.constrain(self.embedding.logits(h), ("batch", "seq", "vocab"))

    def __call__(self, tokens):
        return self.forward(tokens)[0]

    # -- cached execution ----------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int | None = None) -> "DecodeState":
        """An empty decode state for `batch` rows of up to `max_len` positions (default:
        `model.max_seq_len`)."""
        max_len = self.cfg.model.max_seq_len if max_len is None else max_len
        state = DecodeState(pos=jnp.zeros((batch,), jnp.int32),
                            overflow=jnp.zeros((batch,), jnp.bool_),
                            evaluations=jnp.zeros((batch,), jnp.int32),
                            layers=tuple(b.init_cache(batch, max_len) for b in self.blocks),
                            max_len=max_len)
        return state.replace(host_pos=np.zeros((batch,), np.int32))

    def extend(self, tokens, positions, valid, layer_caches, replay: int | None = None,
               replay_from=None):
        """Run new tokens [B, T] at `positions` (where `valid`) through the stack.

        With `replay=R` (CED only) the encoder runs over every position and the decoder only
        over each row's last R valid positions, or, given `replay_from` [B], over its valid
        positions >= replay_from (at most R of them: a chunk of a longer prompt); decoder
        full layers still compress the encoder output of every position. Returns the last
        valid position's final hidden
        state per row [B, D], the new caches, and the number of (position, layer)
        evaluations.
        """
        chex.assert_rank(tokens, 2)
        chex.assert_equal_shape([tokens, positions, valid])
        chex.assert_equal(len(layer_caches), len(self.blocks))
        split = self.cfg.attention.ced_split
        x = _rows(self.embedding(tokens))
        ctx = CachedContext()
        new, evals = [], jnp.zeros(tokens.shape[:1], jnp.int32)
        for unit, block, cache in zip(self.units, self.blocks, layer_caches):
            if split and unit.start == split:
                ctx = CachedContext(encoder_out=Stream(x, positions, valid))
                if replay is not None:
                    x, positions, valid = _last_positions(x, positions, valid, replay,
                                                          replay_from)
            x, cache, ctx = block.extend(x, positions, valid, cache, ctx)
            evals = evals + len(unit.layers) * jnp.sum(valid, axis=-1, dtype=jnp.int32)
            new.append(cache)
        last = jnp.maximum(jnp.sum(valid, -1) - 1, 0)
        h = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
        return self.norm(h), tuple(new), evals

    def logits(self, h):
        return self.embedding.logits(h)


def _rows(x):
    """Hidden states [B, T, D] between layers: rows split as the batch is, on a mesh
    (dsattn.sharding; nothing without one)."""
    return sharding.constrain(x, ("batch", "seq", "embed"))


def layer_caches(cfg: Config, state: DecodeState) -> list:
    """The decode state's caches, one per layer in stack order (scanned groups unstacked)."""
    return scan.per_layer(scan.units(cfg), state.layers)


def with_layer_caches(cfg: Config, state: DecodeState, caches: list) -> DecodeState:
    """`state` holding `caches` (one per layer, as `layer_caches` gives them)."""
    return state.replace(layers=tuple(scan.per_unit(scan.units(cfg), caches)))


def _last_positions(x, positions, valid, r: int, keep_from=None):
    """Each row's last k <= r valid positions as [B, r] slices (valid ones form a prefix, and
    so do the returned ones); k counts the positions >= keep_from when given."""
    keep = valid if keep_from is None else valid & (positions >= keep_from[:, None])
    n, k = jnp.sum(valid, -1), jnp.minimum(jnp.sum(keep, -1), r)
    idx = jnp.minimum((n - k)[:, None] + jnp.arange(r), x.shape[1] - 1)
    take = lambda a: jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), 1)
    return take(x), take(positions), jnp.arange(r)[None] < k[:, None]
