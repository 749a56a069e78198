"""Prefill, decode_step and a sampling loop over explicit, donated cache pytrees.

Both prefill and decode extend the cache by some tokens per row: prefill by a padded chunk
(each row its own length), decode by one token per row. Rows are ragged: every row keeps
its own next position in ``cache["pos"]``. Prompts are padded to power-of-two buckets so
compiles stay bounded, and ``decode_step`` compiles once per (config, batch, max_len).

A cache holds ``max_len`` positions per row. prefill and decode_step refuse, with
``CacheExhausted`` and before anything runs, a call that would take a row past it, so the
cache stays as it was; the compiled programs also refuse such rows themselves (see
``check_cache``).
"""

from __future__ import annotations

import math
import weakref
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsattn.cache import paged
from dsattn.errors import CacheExhausted, InputError
from dsattn.model import Transformer, check_tokens

MIN_BUCKET = 16
PREFILL_CHUNK = 1024  # longer prompts run in chunks: activations stay O(chunk · context)


class Bound(NamedTuple):
    """A model split once into (graphdef, state), with its compiled programs: a snapshot for
    a generation loop.

    `nnx.split` walks the whole module graph (about 5 ms for a tiny model) and hashing the
    graphdef, as a static jit argument would on every call, costs about 3 ms (a 10-layer
    tiny model): both exceed a tiny decode step, so loops bind once and pass the Bound to
    prefill/decode_step. Later in-place changes to the model's weights are not seen by an
    existing Bound.
    """

    graphdef: Any
    state: Any  # nnx.to_pure_dict of the model's state
    cfg: Any
    prefill_fn: Any
    decode_fn: Any


# Jitted programs per graphdef (models of one config share them; looked up once per bind).
_PROGRAMS: dict = {}


def bind(model) -> Bound:
    if isinstance(model, Bound):
        return model
    graphdef, state = nnx.split(model)
    # Plain nested dicts of arrays: jit flattens them in C++, while nnx Variables go through a
    # Python callback each (~0.5 ms a step for a 10-layer tiny model).
    state = nnx.to_pure_dict(state)
    fns = _PROGRAMS.get(graphdef)
    if fns is None:
        # Distinct jit objects, so decode's compile count stands alone.
        fns = _PROGRAMS[graphdef] = (
            jax.jit(partial(_extend_impl, graphdef), static_argnums=4, donate_argnums=3),
            jax.jit(partial(_decode_impl, graphdef), donate_argnums=2))
    return Bound(graphdef, state, model.cfg, *fns)


def init_cache(cfg_or_model, batch: int, max_len: int) -> dict:
    """An empty cache for `batch` rows of up to `max_len` tokens (shapes only from cfg)."""
    if isinstance(cfg_or_model, Transformer):
        return cfg_or_model.init_cache(batch, max_len)
    cfg = cfg_or_model.cfg if isinstance(cfg_or_model, Bound) else cfg_or_model
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return model.init_cache(batch, max_len)


def cache_capacity(cache) -> int:
    """max_len of a cache (positions per row); carried as a static shape (see init_cache)."""
    return cache["capacity"].shape[0]


def bucket_length(n: int, max_len: int) -> int:
    """Smallest power of two >= n (at least MIN_BUCKET), capped at max_len."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return max(n, min(b, max_len))


def _extend_impl(graphdef, state, tokens, n_new, cache, replay=None, replay_from=None):
    model = nnx.merge(graphdef, nnx.State(state))
    b, t = tokens.shape
    start = cache["pos"]
    # A row that would pass max_len is refused whole: it writes nothing in any layer, keeps
    # its position, gets NaN logits and is flagged for check_cache. prefill and decode_step
    # refuse such calls on the host first; this keeps the compiled programs safe on their own.
    fits = start + n_new <= cache_capacity(cache)
    n_new = jnp.where(fits, n_new, 0)
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    valid = jnp.arange(t)[None] < n_new[:, None]
    h, layers, evals = model.extend(tokens, positions, valid, cache["layers"], replay,
                                    replay_from)
    logits = jnp.where(fits[:, None], model.logits(h), jnp.nan)
    return logits, {**cache, "pos": start + n_new, "overflow": cache["overflow"] | ~fits,
                    "layers": layers, "evaluations": cache["evaluations"] + evals}


def _decode_impl(graphdef, state, tokens, cache):
    # Shaping the tokens in here, not eagerly: each eager op costs ~0.1-0.5 ms of dispatch,
    # a sizeable share of a tiny model's step.
    tokens = tokens.astype(jnp.int32).reshape(-1, 1)
    return _extend_impl(graphdef, state, tokens, jnp.ones(tokens.shape[:1], jnp.int32), cache)


# Each cache's row positions as last known on the host, keyed by its `pos` array (immutable,
# so the copy stays exact): decode_step checks capacity without waiting for the device.
# Syncing on `pos` instead costs ~30% of a tiny model's step in an asynchronous loop.
_HOST_POS: dict[int, np.ndarray] = {}


def _host_pos(cache):
    """Row positions [B] on the host (None under an outer jit: the compiled check applies)."""
    pos = cache["pos"]
    if isinstance(pos, jax.core.Tracer):
        return None
    known = _HOST_POS.get(id(pos))
    return np.asarray(jax.device_get(pos)) if known is None else known


def _remember_pos(cache, host) -> None:
    pos = cache["pos"]
    if id(pos) not in _HOST_POS:
        weakref.finalize(pos, _HOST_POS.pop, id(pos), None)  # forgotten with the array
    _HOST_POS[id(pos)] = host


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


def decode_compilations() -> int:
    """How many distinct decode_step programs have been compiled in this process."""
    return sum(decode._cache_size() for _, decode in _PROGRAMS.values())


def prefill(model: Transformer | Bound, tokens, lengths, cache, replay=None,
            chunk: int = PREFILL_CHUNK):
    """Append each row's prompt to its cache; return next-token logits [B, V] and the cache.

    tokens: [B, T] ints (rows right-padded); lengths: [B] valid tokens per row (None: T).
    A row with length 0 is left untouched (its logits are meaningless). Prompts longer than
    `chunk` (a power of two) run chunk by chunk, each chunk seeing the cache the previous
    ones wrote, so peak memory follows the chunk, not the prompt. `replay=R` (CED configs)
    runs the decoder over only each row's last R prompt positions (True: R =
    attention.window); local KV before them is absent, so logits deviate from exact prefill
    unless R covers the prompt. `cache["evaluations"]` counts (position, layer) evaluations.
    """
    replay = _check_replay(model.cfg, replay)
    if chunk < MIN_BUCKET or chunk & (chunk - 1):
        raise InputError(f"prefill: chunk must be a power of two >= {MIN_BUCKET}, got {chunk}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise InputError(f"tokens: expected [batch, time], got shape {tokens.shape}")
    b, t = tokens.shape
    lengths = np.full((b,), t, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if lengths.shape != (b,) or (lengths < 0).any() or (lengths > t).any():
        raise InputError(f"lengths: expected {b} values in [0, {t}], got {lengths.tolist()}")
    for row in range(b):
        check_tokens(tokens[row, : lengths[row]], model.cfg.model.vocab_size,
                     f"tokens (row {row})")
    max_len = cache_capacity(cache)
    start = _host_pos(cache)
    _check_room(start, lengths, max_len, "prefill: prompt too long for the cache")
    m = bind(model)
    # Decoder positions kept under replay: each row's last R (absolute positions).
    replay_from = None if replay is None else jnp.asarray(start + lengths - replay, jnp.int32)
    logits = None
    for c0 in range(0, max(int(lengths.max(initial=0)), 1), chunk):
        n_new = np.clip(lengths - c0, 0, chunk).astype(np.int32)
        width = bucket_length(int(n_new.max(initial=1)), max_len)
        padded = np.zeros((b, width), np.int32)
        part = tokens[:, c0: c0 + width]
        padded[:, : part.shape[1]] = part
        out, cache = m.prefill_fn(m.state, jnp.asarray(padded), jnp.asarray(n_new), cache,
                                  replay, replay_from)
        # Each row's logits come from the chunk holding its last prompt token.
        logits = out if logits is None else jnp.where(jnp.asarray(n_new > 0)[:, None], out,
                                                      logits)
    check_cache(cache)
    _remember_pos(cache, start + lengths)
    return logits, cache


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
    bad = [(i, k) for i, k in enumerate(a.layers[a.ced_split:], a.ced_split)
           if k not in ("swa", "full", "reindex", "reuse")]
    if bad:
        raise InputError(f"prefill(replay=...): decoder layer {bad[0][0]} ({bad[0][1]}) would "
                         f"miss global KV for skipped positions; only swa/full/reindex/reuse "
                         f"decoders can replay")
    return replay


def check_cache(cache) -> None:
    """Raise CacheExhausted if a compiled step refused a row (it would have passed max_len)
    or any layer's global page pool ran out (host sync). Either way the cache is consistent:
    a refused row or append wrote nothing and kept its position/length, the other rows'
    writes completed (a row refused for max_len also got NaN logits)."""
    over = np.nonzero(np.asarray(jax.device_get(cache["overflow"])))[0]
    if over.size:
        raise CacheExhausted(
            f"row {int(over[0])} reached max_len={cache_capacity(cache)}: a step past it was "
            f"refused for that row (nothing written, NaN logits); size the cache with "
            f"init_cache(..., max_len=...)")
    for layer in cache["layers"]:
        if "global" in layer:
            paged.check(layer["global"])


def decode_step(model: Transformer | Bound, next_tokens, cache):
    """Append one token per row; return next-token logits [B, V] and the updated cache.

    Host inputs are validated; device arrays (e.g. sampled tokens) are trusted, so the
    step stays free of host round trips. A row whose cache is full (max_len positions)
    raises CacheExhausted before anything runs: the cache is then unchanged and still
    valid. The check reads positions the host already knows (from prefill and earlier
    steps; a cache it has not seen is read once).
    """
    if not isinstance(next_tokens, jax.Array):
        check_tokens(next_tokens, model.cfg.model.vocab_size, "next_tokens")
        next_tokens = np.asarray(next_tokens, np.int32).reshape(-1)
    pos = _host_pos(cache)
    if pos is not None:
        _check_room(pos, 1, cache_capacity(cache), "decode_step")
    m = bind(model)
    logits, cache = m.decode_fn(m.state, next_tokens, cache)
    if pos is not None:
        _remember_pos(cache, pos + 1)
    return logits, cache


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


def generate(model: Transformer, prompts, max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, eos_id: int | None = None, stop=(), seed: int = 0,
             max_len: int | None = None, on_token=None):
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` tokens.

    A row stops at `eos_id` (not included in its output) or once its output ends with one
    of the `stop` token sequences (included). `on_token(row, token)` is called as tokens
    are produced. Returns one list of new tokens per prompt. Row i's step-s draw uses
    fold_in(fold_in(PRNGKey(seed), s), i): it does not depend on the other rows.
    Parameters are checked before any work.
    """
    _check_sampling(temperature, top_p)
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise InputError(f"generate: max_new_tokens must be an integer >= 0, "
                         f"got {max_new_tokens!r}")
    vocab = model.cfg.model.vocab_size
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
        raise InputError(f"generate: prompt ({longest}) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds max_len {max_len}")
    b = len(prompts)
    tokens = np.zeros((b, longest), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    cache = init_cache(model, b, max_len)
    model = bind(model)  # split once for the whole loop
    logits, cache = prefill(model, tokens, [len(p) for p in prompts], cache)
    key = jax.random.PRNGKey(seed)
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
        logits, cache = decode_step(model, nxt, cache)
        check_cache(cache)  # cheap: this loop syncs on the sampled tokens anyway
    return outputs
