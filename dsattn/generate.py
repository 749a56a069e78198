"""Prefill, decode_step and a sampling loop over explicit, donated cache pytrees, run by an
`Engine`.

Both prefill and decode extend the cache by some tokens per row: prefill by a padded chunk
(each row its own length), decode by one token per row. Rows are ragged: every row keeps
its own next position in ``cache.pos``. Prompts are padded to power-of-two buckets so
compiles stay bounded, and the decode program compiles once per (model structure, batch,
max_len).

An ``Engine(model)`` is a value: the model's graph, a snapshot of its weights (a pure dict)
and an optional mesh. Its programs are this module's jitted functions with the graph as a
static argument, so every engine of models of one structure shares them::

    eng = generate.Engine(model)
    cache = eng.init_cache(batch, max_len)
    logits, cache = eng.prefill(tokens, lengths, cache, replay=None)   # [B, V]
    logits, cache = eng.decode_step(next_tokens, cache)                # [B, V]
    generate.evaluations(cache)        # (position, layer) evaluations run for the cache
    eng.generate(prompts, max_new_tokens, ...)

The engine holds the weights it was made with: after training further, make a new one
(cheap: nothing compiles again). It holds and reads the weight matrices in the model's
compute dtype (`model.dtype`: bfloat16 for configs/small, half the bytes a decode step
reads), which changes no result since every layer casts them to it where it uses them;
``Engine(model, weights_dtype=jnp.float32)`` keeps them in float32 (`held_weights`).
Caches keep their own formats (cache.formats). ``Engine(model, mesh)`` runs the same
programs on a device mesh (dsattn.sharding): weights and caches split, caches made in place
on their devices, decode still compiled once.

The module functions ``prefill(model, ...)``, ``decode_step(model, ...)`` and
``generate(model, ...)`` make an engine of the model's current weights for the call (they
also accept an engine, used as it is); a loop of steps should make its engine once.

A cache holds ``max_len`` positions per row. prefill and decode_step refuse, with
``CacheExhausted`` and before anything runs, a call that would take a row past it, so the
cache stays as it was. The positions they check travel with the cache on the host
(``DecodeState.host_pos``, set by each call), so the check reads nothing from the device
and decode stays asynchronous; a cache whose host positions are unknown (one returned by a
jax transformation) is read once. The compiled programs also refuse such rows themselves
(see ``check_cache``).
"""

from __future__ import annotations

import contextlib
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn import plan, sharding
from dsattn.cache.protocol import is_container
from dsattn.errors import CacheExhausted, InputError
from dsattn.model import DecodeState, Transformer, check_tokens

MIN_BUCKET = 16
PREFILL_CHUNK = 1024  # longer prompts run in chunks: activations stay O(chunk · context)


_GRAPHDEFS: dict[int, list] = {}  # hash -> the distinct graphdefs seen (`canonical`)


def canonical(graphdef, graphdef_hash: int | None = None):
    """The first graphdef seen that equals `graphdef` (this one if none): models of one
    structure share one graphdef object. Comparing two GraphDefs walks both module graphs (as
    slow as hashing), so equal structures are matched once here, when an Engine is made, and
    every later comparison of their Graphs (jit's cache lookups, each call) is by identity.
    Kept for the process's life, as jit keeps the programs compiled for them."""
    seen = _GRAPHDEFS.setdefault(hash(graphdef) if graphdef_hash is None else graphdef_hash, [])
    for g in seen:
        if g is graphdef or g == graphdef:
            return g
    seen.append(graphdef)
    return graphdef


class Graph:
    """A model's graphdef as a static argument of the compiled programs. Hashing a GraphDef
    walks the whole module graph (ms for a tiny V4.1), too slow for every call, so the hash
    is taken once; graphs of models of one structure are equal, so their engines share the
    compiled programs. The graphdef is `canonical`'s, so equal graphs hold the same object
    and compare by identity; comparing never changes either operand."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef):
        self._hash = hash(graphdef)
        self.graphdef = canonical(graphdef, self._hash)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, Graph) or self._hash != other._hash:
            return False
        # canonical graphdefs: identity, unless one was assigned after construction
        return self.graphdef is other.graphdef or self.graphdef == other.graphdef


class Engine:
    """A model as a value: its graph, its weights as a plain nested dict of arrays (which
    jit flattens in C++; nnx Variables would cost a Python callback each) and an optional
    mesh. `nnx.split` walks the whole module graph (a few ms for a tiny model), more than a
    tiny decode step, so an engine splits once; it keeps the weights it was made with and
    not the model."""

    def __init__(self, model: Transformer, mesh: jax.sharding.Mesh | None = None, *,
                 weights_dtype=None):
        if not isinstance(model, nnx.Module):
            raise InputError(f"Engine: expected an nnx model, got {type(model).__name__}")
        self.cfg = model.cfg
        self.units = model.units
        # On a mesh of several devices the weights and caches are split (dsattn.sharding)
        # and the programs run under it; None: one device, as always.
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        # The dtype the weight matrices are held and read in (`held_weights`): by default
        # the compute dtype, since every layer casts its matrices to it where it uses them,
        # so a decode step reading them stored wider reads bytes it then throws away.
        self.weights_dtype = jnp.dtype(model.cfg.model.dtype if weights_dtype is None
                                       else weights_dtype)
        graphdef, state = nnx.split(model)
        self.graph = Graph(graphdef)
        self.state = self._placed(nnx.to_pure_dict(held_weights(state, self.weights_dtype)))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as the engine holds them: what each decode step reads."""
        return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                       for x in jax.tree.leaves(self.state)))

    def _placed(self, state):
        """The weights laid out on the mesh (as they are without one)."""
        if self.mesh is None:
            return state
        return sharding.put(state, sharding.tree_shardings(state, self.mesh))

    def _on_mesh(self):
        """The context the programs run in: the engine's mesh, if any."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    # -- caches ---------------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int | None = None) -> DecodeState:
        """An empty cache for `batch` rows of up to `max_len` tokens (default: the model's
        `model.max_seq_len`)."""
        shapes = nnx.merge(self.graph.graphdef, nnx.State(jax.eval_shape(lambda: self.state)))
        if self.mesh is None:
            return shapes.init_cache(batch, max_len)
        # On a mesh: one pool group per row shard, and each shard made on its own device.
        groups = sharding.row_shards(self.mesh, batch)
        make = lambda: split_pools(shapes.init_cache(batch, max_len), groups)
        out = sharding.cache_shardings(self.units, jax.eval_shape(make), self.mesh)
        return jax.jit(make, out_shardings=out)().replace(host_pos=np.zeros(batch))

    # -- programs -------------------------------------------------------------------------
    def prefill(self, tokens, lengths, cache, replay=None, chunk: int = PREFILL_CHUNK):
        """Append each row's prompt to its cache; return next-token logits [B, V] and the
        cache.

        tokens: [B, T] ints (rows right-padded); lengths: [B] valid tokens per row (None: T).
        A row with length 0 is left untouched (its logits are meaningless). Prompts longer
        than `chunk` (a power of two) run chunk by chunk, each chunk seeing the cache the
        previous ones wrote, so peak memory follows the chunk, not the prompt. `replay=R`
        (CED configs) runs the decoder over only each row's last R prompt positions (True:
        R = attention.window); local KV before them is absent, so logits deviate from exact
        prefill unless R covers the prompt. `evaluations(cache)` then counts the
        (position, layer) evaluations run.
        """
        cfg = self.cfg
        replay = _check_replay(cfg, replay)
        if chunk < MIN_BUCKET or chunk & (chunk - 1):
            raise InputError(f"prefill: chunk must be a power of two >= {MIN_BUCKET}, "
                             f"got {chunk}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 2:
            raise InputError(f"tokens: expected [batch, time], got shape {tokens.shape}")
        b, t = tokens.shape
        lengths = (np.full((b,), t, np.int32) if lengths is None
                   else np.asarray(lengths, np.int32))
        if lengths.shape != (b,) or (lengths < 0).any() or (lengths > t).any():
            raise InputError(f"lengths: expected {b} values in [0, {t}], "
                             f"got {lengths.tolist()}")
        for row in range(b):
            check_tokens(tokens[row, : lengths[row]], cfg.model.vocab_size,
                         f"tokens (row {row})")
        max_len = cache_capacity(cache)
        start = host_positions(cache)
        if start is None:
            raise InputError("prefill runs on the host: call it outside jit, with a concrete "
                             "cache")
        _check_room(start, lengths, max_len, "prefill: prompt too long for the cache")
        # Decoder positions kept under replay: each row's last R (absolute positions).
        replay_from = (None if replay is None
                       else jnp.asarray(start + lengths - replay, jnp.int32))
        logits = None
        for c0 in range(0, max(int(lengths.max(initial=0)), 1), chunk):
            n_new = np.clip(lengths - c0, 0, chunk).astype(np.int32)
            width = bucket_length(int(n_new.max(initial=1)), max_len)
            padded = np.zeros((b, width), np.int32)
            part = tokens[:, c0: c0 + width]
            padded[:, : part.shape[1]] = part
            with self._on_mesh():
                out, cache = prefill_program(self.graph, self.state, jnp.asarray(padded),
                                             jnp.asarray(n_new), cache, replay, replay_from)
            # Each row's logits come from the chunk holding its last prompt token.
            logits = out if logits is None else jnp.where(jnp.asarray(n_new > 0)[:, None],
                                                          out, logits)
        check_cache(cache)
        return logits, cache.replace(host_pos=start + lengths)

    def decode_step(self, next_tokens, cache):
        """Append one token per row; return next-token logits [B, V] and the updated cache.

        Host inputs are validated; device arrays (e.g. sampled tokens) are trusted, so the
        step stays free of host round trips. A row whose cache is full (max_len positions)
        raises CacheExhausted before anything runs: the cache is then unchanged and still
        valid. The check reads the positions the cache carries on the host (from its prefill
        and earlier steps); a cache without them is read once.
        """
        if not isinstance(next_tokens, jax.Array):
            check_tokens(next_tokens, self.cfg.model.vocab_size, "next_tokens")
            next_tokens = np.asarray(next_tokens, np.int32).reshape(-1)
        pos = host_positions(cache)
        if pos is None:  # under an outer jit: the compiled check applies
            return self.decode_unchecked(next_tokens, cache)
        _check_room(pos, 1, cache_capacity(cache), "decode_step")
        logits, cache = self.decode_unchecked(next_tokens, cache)
        return logits, cache.replace(host_pos=pos + 1)

    def decode_unchecked(self, next_tokens, cache):
        """The compiled decode step alone: no validation and no host capacity check. A row
        that would pass max_len is refused inside the step (it writes nothing, keeps its
        position, gets NaN logits and is flagged for check_cache); the returned cache does not
        carry its positions on the host (decode_step reads them once)."""
        with self._on_mesh():
            return decode_program(self.graph, self.state, next_tokens, cache)

    # -- sampling loop --------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, eos_id: int | None = None, stop=(), seed: int = 0,
                 max_len: int | None = None, on_token=None):
        """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

        A row stops at `eos_id` (not included in its output) or once its output ends with one
        of the `stop` token sequences (included). The token loop (sample, record, stop,
        decode) runs on the device as one compiled program (`sample_loop_fn`), with no host
        round trip per token; with `on_token(row, token)`, called as tokens are produced, it
        runs on the host instead, one sync per token, and gives the same tokens. Returns one
        list of new tokens per prompt. Row i's step-s draw uses
        fold_in(fold_in(PRNGKey(seed), s), i): it does not depend on the other rows.
        Parameters are checked before any work.
        """
        _check_sampling(temperature, top_p)
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise InputError(f"generate: max_new_tokens must be an integer >= 0, "
                             f"got {max_new_tokens!r}")
        vocab = self.cfg.model.vocab_size
        if eos_id is not None:
            check_tokens([eos_id], vocab, "eos_id")
        stop = [list(s) for s in stop]
        for s in stop:
            check_tokens(s, vocab, "stop")
        prompts = [list(p) for p in prompts]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InputError("generate: every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        need = longest + max_new_tokens
        # Default cache length: a power of two, so repeated calls share compiled programs.
        max_len = max_len or max(64, 1 << (need - 1).bit_length())
        if need > max_len:
            raise InputError(f"generate: prompt ({longest}) + max_new_tokens "
                             f"({max_new_tokens}) exceeds max_len {max_len}")
        b = len(prompts)
        tokens = np.zeros((b, longest), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        cache = self.init_cache(b, max_len)
        logits, cache = self.prefill(tokens, [len(p) for p in prompts], cache)
        key = jax.random.PRNGKey(seed)
        if on_token is None:  # the whole token loop as one compiled program
            with self._on_mesh():
                out, n, cache = sample_loop_program(
                    self.graph, self.state, logits, cache, key, jnp.float32(max(temperature, 1e-6)),
                    jnp.float32(top_p), jnp.int32(-1 if eos_id is None else eos_id),
                    jnp.int32(max_new_tokens), stops=tuple(map(tuple, stop)),
                    greedy=temperature == 0)
            check_cache(cache)
            out, n = jax.device_get((out, n))
            return [out[i, : n[i]].tolist() for i in range(b)]
        outputs: list[list[int]] = [[] for _ in range(b)]
        done = np.zeros(b, bool)
        for step in range(max_new_tokens):
            nxt = sample(logits, jax.random.fold_in(key, step), temperature, top_p)
            host = np.asarray(jax.device_get(nxt))
            for i in range(b):
                if done[i]:
                    continue
                tok = int(host[i])
                if eos_id is not None and tok == eos_id:
                    done[i] = True
                    continue
                outputs[i].append(tok)
                if on_token is not None:
                    on_token(i, tok)
                if any(s and outputs[i][-len(s):] == s for s in stop):
                    done[i] = True
            if done.all() or step == max_new_tokens - 1:
                break
            logits, cache = self.decode_step(nxt, cache)
            check_cache(cache)  # cheap: this loop syncs on the sampled tokens anyway
        return outputs


def held_weights(state: nnx.State, dtype) -> nnx.State:
    """`state` with every floating parameter matrix (ndim >= 2: projections, embeddings,
    the compressors' position biases; all but a few kB of the bytes) in `dtype`. Vectors
    (norm scales and biases, V4's sink logits) keep their stored dtype: they feed float32
    islands and weigh nothing. Layers cast matrices to the compute dtype where they use
    them, so holding them in it changes no result, except a matrix read in a float32 island
    (the compressors' position bias), which is rounded once. Shapes (an abstract model) stay
    shapes."""

    def hold(v):
        x = v.get_value()
        if not (isinstance(v, nnx.Param) and len(x.shape) >= 2
                and jnp.issubdtype(x.dtype, jnp.floating)) or x.dtype == dtype:
            return v
        if isinstance(x, jax.ShapeDtypeStruct):
            return v.replace(jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding))
        return v.replace(x.astype(dtype))

    return jax.tree.map(hold, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def engine(model: Transformer | Engine) -> Engine:
    """An engine of the model's current weights (an engine is returned as it is)."""
    return model if isinstance(model, Engine) else Engine(model)


def host_positions(cache: DecodeState) -> np.ndarray | None:
    """Each row's next position [B] on the host: carried by the cache, else read from the
    device (a sync); None under a jax transformation (the compiled check applies)."""
    if cache.host_pos is not None:
        return cache.host_pos
    if isinstance(cache.pos, jax.core.Tracer):
        return None
    return np.asarray(jax.device_get(cache.pos))


def evaluations(cache: DecodeState) -> int:
    """(position, layer) evaluations run to produce `cache`, over all rows: every prefill
    chunk and decode step since init_cache (a replay prefill runs its decoder layers over
    only R positions per row)."""
    return int(np.sum(np.asarray(jax.device_get(cache.evaluations), np.int64)))


def init_cache(cfg_or_model, batch: int, max_len: int | None = None) -> DecodeState:
    """An empty cache for `batch` rows of up to `max_len` tokens (default: the config's
    `model.max_seq_len`); shapes only from the config."""
    if isinstance(cfg_or_model, Transformer):
        return cfg_or_model.init_cache(batch, max_len)
    if isinstance(cfg_or_model, Engine):
        return cfg_or_model.init_cache(batch, max_len)
    model = nnx.eval_shape(lambda: Transformer(cfg_or_model, rngs=nnx.Rngs(0)))
    return model.init_cache(batch, max_len)


def cache_capacity(cache) -> int:
    """max_len of a cache (positions per row), a static field of the decode state."""
    return cache.max_len


def bucket_length(n: int, max_len: int) -> int:
    """Smallest power of two >= n (at least MIN_BUCKET), capped at max_len."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return max(n, min(b, max_len))


def _extend_impl(graph: Graph, state, tokens, n_new, cache, replay=None, replay_from=None):
    """(logits [B, V], cache): `n_new` [B] tokens appended to each row."""
    model = nnx.merge(graph.graphdef, nnx.State(state))
    b, t = tokens.shape
    start = cache.pos
    # A row that would pass max_len is refused whole: it writes nothing in any layer, keeps
    # its position, gets NaN logits and is flagged for check_cache. prefill and decode_step
    # refuse such calls on the host first; this keeps the compiled programs safe on their own.
    fits = start + n_new <= cache_capacity(cache)
    n_new = jnp.where(fits, n_new, 0)
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    valid = jnp.arange(t)[None] < n_new[:, None]
    h, layers, evals = model.extend(tokens, positions, valid, cache.layers, replay,
                                    replay_from)
    logits = jnp.where(fits[:, None], model.logits(h), jnp.nan)
    cache = cache.replace(pos=start + n_new, overflow=cache.overflow | ~fits,
                          evaluations=cache.evaluations + evals, layers=layers)
    return logits, sharding.constrain_cache(model.units, cache)


def _decode_impl(graph: Graph, state, tokens, cache):
    # Shaping the tokens in here, not eagerly: each eager op costs ~0.1-0.5 ms of dispatch,
    # a sizeable share of a tiny model's step.
    tokens = tokens.astype(jnp.int32).reshape(-1, 1)
    return _extend_impl(graph, state, tokens, jnp.ones(tokens.shape[:1], jnp.int32), cache)


def _sample_loop(graph: Graph, state, logits, cache, key, temperature, top_p, eos, max_new, *,
                 stops: tuple, greedy: bool):
    """generate's token loop in one program (lax.while_loop): step s samples each row's
    token with fold_in(key, s) as `sample` does, appends it unless the row is done or it is
    `eos` (-1: none), marks rows that drew eos or now end with a stop sequence done, and
    decodes the sampled tokens while steps and live rows remain. Returns the tokens
    [B, max_len] (row i's first counts[i] are its output), counts [B] and the cache."""
    b = logits.shape[0]
    rows = jnp.arange(b)
    width = cache_capacity(cache)  # max_new <= max_len: generate checks it

    def body(carry):
        step, logits, cache, out, n, done = carry
        nxt = _sample(logits, jax.random.fold_in(key, step), temperature, top_p, greedy)
        hit_eos = nxt == eos
        take = ~done & ~hit_eos
        out = out.at[rows, n].set(jnp.where(take, nxt, out[rows, n]))
        n = n + take
        stopped = jnp.zeros(b, bool)
        for seq in stops:
            if not seq:
                continue
            tail = out[rows[:, None], jnp.maximum(n[:, None] - len(seq), 0)
                       + jnp.arange(len(seq))]
            stopped |= (n >= len(seq)) & jnp.all(tail == jnp.array(seq, jnp.int32), axis=1)
        done = done | hit_eos | (take & stopped)
        go = (step + 1 < max_new) & ~jnp.all(done)
        logits, cache = jax.lax.cond(go, lambda: _decode_impl(graph, state, nxt, cache),
                                     lambda: (logits, cache))
        return step + 1, logits, cache, out, n, done

    def more(carry):
        step, *_, done = carry
        return (step < max_new) & ~jnp.all(done)

    start = (jnp.int32(0), logits, cache, jnp.zeros((b, width), jnp.int32),
             jnp.zeros(b, jnp.int32), jnp.zeros(b, bool))
    _, _, cache, out, n, _ = jax.lax.while_loop(more, body, start)
    return out, n, cache


# The compiled programs, shared by every engine of one model structure (the graph is
# static); public for lowering (dsattn.bench.lower). Their cache argument is donated.
# prefill_program(graph, state, tokens [B, T], n_new [B], cache, replay, replay_from)
prefill_program = jax.jit(_extend_impl, static_argnums=(0, 5), donate_argnums=4)
# decode_program(graph, state, tokens [B], cache)
decode_program = jax.jit(_decode_impl, static_argnums=0, donate_argnums=3)
# sample_loop_program(graph, state, logits, cache, key, temperature, top_p, eos, max_new, *,
# stops, greedy) -> (tokens [B, max_len], counts [B], cache): generate's token loop.
sample_loop_program = jax.jit(_sample_loop, static_argnums=0, donate_argnums=3,
                              static_argnames=("stops", "greedy"))


def split_pools(state: DecodeState, groups: int) -> DecodeState:
    """An empty decode state with every paged cache's pool split into `groups` (one per row
    shard of a mesh: paged.regroup)."""
    split = lambda c: c.split_rows(groups) if is_container(c) else c  # noqa: E731
    return state.replace(layers=jax.tree.map(split, state.layers, is_leaf=is_container))


def _check_room(start, n_new, max_len: int, who: str) -> None:
    """Raise CacheExhausted, before anything runs, if a row would pass max_len."""
    need = start + n_new
    over = np.nonzero(need > max_len)[0]
    if over.size:
        r = int(over[0])
        what = (f"row {r} reached max_len={max_len}" if start[r] >= max_len else
                f"row {r} would need {int(need[r])} positions, max_len={max_len}")
        raise CacheExhausted(f"{who}: {what}; nothing was written and the cache is unchanged "
                             f"(size it with init_cache(..., max_len=...))")


def prefill(model: Transformer | Engine, tokens, lengths, cache, replay=None,
            chunk: int = PREFILL_CHUNK):
    """`engine(model).prefill(...)`: next-token logits [B, V] and the cache (see
    Engine.prefill)."""
    return engine(model).prefill(tokens, lengths, cache, replay, chunk)


def decode_step(model: Transformer | Engine, next_tokens, cache):
    """`engine(model).decode_step(...)`: next-token logits [B, V] and the cache (see
    Engine.decode_step)."""
    return engine(model).decode_step(next_tokens, cache)


def generate(model: Transformer | Engine, prompts, max_new_tokens: int, *,
             temperature: float = 0.0, top_p: float = 1.0, eos_id: int | None = None, stop=(),
             seed: int = 0, max_len: int | None = None, on_token=None):
    """`engine(model).generate(...)`: one list of new tokens per prompt (see
    Engine.generate)."""
    return engine(model).generate(prompts, max_new_tokens, temperature=temperature,
                                  top_p=top_p, eos_id=eos_id, stop=stop, seed=seed,
                                  max_len=max_len, on_token=on_token)


def _check_replay(cfg, replay):
    """None (exact prefill) or the replay length R; True means R = window."""
    if replay is None or replay is False:
        return None
    a = cfg.attention
    if not a.ced_split:
        raise InputError("prefill(replay=...) needs a causal encoder-decoder config "
                         "(attention.ced_split > 0); this model has none")
    replay = a.window if replay is True else int(replay)
    if replay < 1:
        raise InputError(f"prefill: replay must be >= 1 positions, got {replay}")
    bad = [s for s in plan.resolve(cfg) if s.decoder and not s.kind.replayable]
    if bad:
        ok = "/".join(k.name for k in plan.KINDS.values() if k.replayable)
        raise InputError(f"prefill(replay=...): decoder layer {bad[0].index} ({bad[0].name}) "
                         f"would miss global KV for skipped positions; only {ok} decoders can "
                         f"replay")
    return replay


def check_cache(cache) -> None:
    """Raise CacheExhausted if a compiled step refused a row (it would have passed max_len)
    or any layer's global page pool ran out (host sync). Either way the cache is consistent:
    a refused row or append wrote nothing and kept its position/length, the other rows'
    writes completed (a row refused for max_len also got NaN logits)."""
    over = np.nonzero(np.asarray(jax.device_get(cache.overflow)))[0]
    if over.size:
        raise CacheExhausted(
            f"row {int(over[0])} reached max_len={cache_capacity(cache)}: a step past it was "
            f"refused for that row (nothing written, NaN logits); size the cache with "
            f"init_cache(..., max_len=...)")
    for c in jax.tree.leaves(cache.layers, is_leaf=is_container):
        if is_container(c):
            c.check()


# ------------------------------------------------------------------------------ sampling
@partial(jax.jit, static_argnames=("greedy",))
def _sample(logits, key, temperature, top_p, greedy: bool):
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    probs = jax.nn.softmax(logits, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    keep_sorted = (jnp.cumsum(sorted_p, axis=-1) - sorted_p) < top_p  # always keeps the top
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(probs.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
    # One key per row, fold_in(key, row): a row's draw depends on the key, its index and its
    # own logits only. (One [B, V] draw from a shared key depends on B under JAX's
    # non-partitionable threefry.)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(logits.shape[0]))
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def _check_sampling(temperature, top_p) -> None:
    # Written so that NaN fails too (a NaN temperature used to sample token 0 everywhere).
    if not 0 <= temperature < math.inf:
        raise InputError(f"sampling: temperature must be a finite number >= 0 (0: greedy), "
                         f"got {temperature}")
    if not 0 < top_p <= 1:
        raise InputError(f"sampling: top_p must be in (0, 1], got {top_p}")


def sample(logits, key, temperature: float = 0.0, top_p: float = 1.0):
    """Greedy when temperature == 0, else temperature + nucleus (top-p) sampling; row i
    draws with jax.random.fold_in(key, i)."""
    _check_sampling(temperature, top_p)
    return _sample(logits, key, jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p),
                   greedy=temperature == 0)
