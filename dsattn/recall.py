"""The long-range task: key-value associative recall whose answers lie beyond the window.

A byte stream carries *facts* ``FACT k1 k2 v1 v2`` and, ``d`` positions later, *queries*
``QUERY k1 k2 v1 v2`` (keys: two letters, values: two digits). Predicting a query's value
bytes needs the fact, ``d`` positions back: distance ``d`` = query start - fact start, drawn
uniformly from [min_dist, max_dist]. Between pairs the stream is filler: noise bytes, or a
text corpus (``corpus=stdlib``: a mixture of corpus and recall). Values are uniform and
independent of everything else in the stream, so a model that cannot see back ``d``
positions scores chance (0.1 per answer byte) and a lookup scores 1.0.

``data.source`` selects it, parameters in the string (no config fields):
``recall`` or ``recall:min_dist=32,max_dist=128,density=0.3,corpus=stdlib``;
dsattn.datasource reads the string when the config loads (the one reader of data.source)
and `make_spec` here checks the parameters into a `RecallSpec` (its `DataSource.recall`),
which every other function takes.
Scoring uses probes: a validation window with one pair at an exact distance whose query ends
the window; accuracy is over the probe's answer bytes (teacher-forced argmax).

``format=mqar`` (Zoology's multi-query associative recall, Arora et al. 2023) is the dense
variant small models learn: the stream is a run of independent blocks of ``block`` tokens,
each a sequence of two-token units ``k v``: ``pairs`` facts (a key unique in its block, a
random value) each re-asked ``d`` tokens later by a query (the same key; its value is the
answer), d even in [min_dist, max_dist]; the other units are noise. Keys and values are
single bytes from disjoint ranges (``keys`` from MQAR_KEY0, ``values`` from MQAR_VALUE0),
so chance is 1 / values. Training windows start at block starts (Corpus.block) and the loss
weighs answer tokens 1 and every other target ``other_weight`` (Corpus weights), so every
sequence trains recall and nothing else dilutes it:
``recall:format=mqar,min_dist=2,max_dist=126,pairs=16,keys=64,values=64``.

This module makes the streams, probes and scores (numpy, no I/O, no model); dsattn.data
turns a recall source into a Corpus (data.recall_streams, with a corpus's bytes as filler) and
never the other way round; dsattn.recall_eval runs a model on the probes.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from dsattn.errors import ConfigError

FACT, QUERY = 1, 2  # control bytes: rare in text, so markers never collide with the corpus
KEY_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
VALUE_ALPHABET = np.frombuffer(b"0123456789", np.uint8)
NOISE_ALPHABET = np.frombuffer(b" .,-_:;~", np.uint8)
KEY_LEN, VALUE_LEN = 2, 2
PAIR_LEN = 1 + KEY_LEN + VALUE_LEN  # one fact or one query
CHANCE = 1 / len(VALUE_ALPHABET)
# Keys cycle through all 676 in fact order, so the same key recurs only >= 675 facts
# (>= 675 * PAIR_LEN bytes) later: no second fact with a query's key can lie between them.
MAX_DIST = (len(KEY_ALPHABET) ** KEY_LEN - 1) * PAIR_LEN
MQAR_KEY0, MQAR_VALUE0 = 128, 192  # format=mqar: keys and values, disjoint byte ranges
MQAR_UNIT = 2  # format=mqar: a fact or query is `key value`
# format=mqar,joint=1: a fact is `J n`, J = MQAR_JOINT0 + key * values + value one token for
# the pair (n: a noise byte), a query `key value` with keys from MQAR_JKEY0 and values from
# MQAR_JVALUE0: the answer is one attention hop from the query's key (no induction circuit).
MQAR_JOINT0, MQAR_JKEY0, MQAR_JVALUE0 = 128, 0x10, 0x40


@dataclasses.dataclass(frozen=True)
class RecallSpec:
    min_dist: int = 32
    max_dist: int = 96
    density: float = 0.3  # fraction of stream bytes inside facts and queries
    corpus: str = ""  # filler source ("stdlib", a file or glob); "" = noise bytes
    length: int = 2_000_000  # training stream bytes (validation: val_fraction of it)
    seed: int = 0  # the stream's own seed: every run of a sweep sees the same data
    format: str = "bytes"  # "bytes": FACT/QUERY marker pairs in filler; "mqar": see above
    # format=mqar only:
    block: int = 128  # tokens per independent sequence (train.seq_len <= block)
    pairs: int = 16  # fact/query pairs per block
    keys: int = 64  # key vocabulary (bytes MQAR_KEY0..)
    values: int = 64  # value vocabulary (bytes MQAR_VALUE0..)
    other_weight: float = 0.0  # loss weight of targets that are not answers (answers: 1)
    joint: int = 0  # 1: a fact is one token for the (key, value) pair (single-hop recall)
    # > 0: noise units come in repeated pairs `a b a b`; the repeat's `b` weighs this (a local
    # target a previous-token head predicts: it trains the first hop of the induction circuit)
    repeat: float = 0.0
    # > 0: the first warm_steps training steps draw facts at most warm_dist back (a curriculum:
    # a model whose reach is short learns the lookup where every answer is within reach first)
    warm_steps: int = 0
    warm_dist: int = 8


def make_spec(params: dict[str, str]) -> RecallSpec:
    """The RecallSpec of a recall source's parameters ({key: value text}, as
    dsattn.datasource.parse reads them from ``recall:key=value,...``), checked; errors name
    data.source and the key."""
    fields = {f.name: f.type for f in dataclasses.fields(RecallSpec)}
    kwargs = {}
    for key, value in params.items():
        if key not in fields:
            raise ConfigError(f"data.source: recall parameter {key!r} unknown; "
                              f"valid: {', '.join(fields)}")
        try:
            kwargs[key] = {"int": int, "float": float, "str": str}[fields[key]](value)
        except ValueError:
            raise ConfigError(f"data.source: recall {key}={value!r} is not a {fields[key]}")
    spec = RecallSpec(**kwargs)
    if spec.format == "mqar":
        return _check_mqar(spec)
    if spec.format != "bytes":
        raise ConfigError(f"data.source: recall format {spec.format!r} unknown; valid: bytes, mqar")
    if not PAIR_LEN <= spec.min_dist <= spec.max_dist <= MAX_DIST:
        raise ConfigError(f"data.source: recall needs {PAIR_LEN} <= min_dist <= max_dist <= "
                          f"{MAX_DIST}, got {spec.min_dist}..{spec.max_dist}")
    if not 0 < spec.density < 1 or spec.length < 4 * spec.max_dist:
        raise ConfigError("data.source: recall density must be in (0, 1) and length >= "
                          f"4 * max_dist, got {spec.density}, {spec.length}")
    return spec


def source_text(spec: RecallSpec) -> str:
    """The data.source string of `spec` (its parameters that differ from the defaults):
    dsattn.datasource.parse reads it back to an equal spec."""
    default = RecallSpec()
    params = [f"{f.name}={getattr(spec, f.name)}" for f in dataclasses.fields(RecallSpec)
              if getattr(spec, f.name) != getattr(default, f.name)]
    return "recall" + (":" + ",".join(params) if params else "")


def _check_mqar(spec: RecallSpec) -> RecallSpec:
    u = MQAR_UNIT
    if spec.block < 2 * u or spec.block % u:
        raise ConfigError(f"data.source: recall block must be an even number >= 4, got "
                          f"{spec.block}")
    if not u <= spec.min_dist <= spec.max_dist <= spec.block - u:
        raise ConfigError(f"data.source: recall format=mqar needs {u} <= min_dist <= max_dist "
                          f"<= block - {u} = {spec.block - u}, got "
                          f"{spec.min_dist}..{spec.max_dist}")
    if not 1 <= spec.pairs <= min(spec.keys, spec.block // (2 * u)):
        raise ConfigError(f"data.source: recall pairs must be in [1, min(keys, block / 4)], "
                          f"got {spec.pairs}")
    if spec.joint:
        if not (2 <= spec.keys <= 16 and 2 <= spec.values <= 16
                and spec.keys * spec.values <= 256 - MQAR_JOINT0):
            raise ConfigError(f"data.source: recall joint=1 needs keys, values in [2, 16] and "
                              f"keys * values <= 128, got {spec.keys}, {spec.values}")
    elif not 2 <= spec.keys <= MQAR_VALUE0 - MQAR_KEY0 or not 2 <= spec.values <= 256 - MQAR_VALUE0:
        raise ConfigError(f"data.source: recall keys and values must be in [2, 64], got "
                          f"{spec.keys}, {spec.values}")
    if spec.warm_steps < 0 or (spec.warm_steps and not u <= spec.warm_dist <= spec.max_dist):
        raise ConfigError(f"data.source: recall warm_steps must be >= 0 and warm_dist in "
                          f"[{u}, max_dist = {spec.max_dist}], got {spec.warm_steps}, "
                          f"{spec.warm_dist}")
    if not 0 <= spec.other_weight <= 1 or spec.length < 4 * spec.block:
        raise ConfigError(f"data.source: recall other_weight must be in [0, 1] and length >= "
                          f"4 * block, got {spec.other_weight}, {spec.length}")
    return spec


def distance_bounds(spec: RecallSpec, probe_len: int) -> tuple[int, int, int]:
    """(least, most, step) of a probe distance in rows of probe_len tokens: a pair's length
    up to probe_len - PAIR_LEN (bytes), or even distances in [2, min(probe_len, block) - 2]
    (format=mqar: whole units, rows inside a block)."""
    if spec.format == "mqar":
        return MQAR_UNIT, min(probe_len, spec.block) - MQAR_UNIT, MQAR_UNIT
    return PAIR_LEN, probe_len - PAIR_LEN, 1


def chance(spec: RecallSpec | None) -> float:
    """A guesser's accuracy on a recall source's answers: 1 / values (format=mqar), else
    CHANCE (also for None: no recall source, probes of the default byte task)."""
    return 1 / spec.values if spec is not None and spec.format == "mqar" else CHANCE


# ----------------------------------------------------------------------------- generation
def make_stream(n: int, spec: RecallSpec, filler: np.ndarray | None, rng) -> tuple:
    """A stream of n bytes with pairs placed at random; returns (tokens, fact starts,
    query starts). Pairs never overlap one another; filler is cut from `filler` (cycled)
    or drawn from NOISE_ALPHABET."""
    if filler is None:
        out = rng.choice(NOISE_ALPHABET, n).astype(np.int32)
    else:
        start = int(rng.integers(0, len(filler)))
        out = np.resize(np.roll(np.asarray(filler, np.int32), -start), n)
        out[(out == FACT) | (out == QUERY)] = ord(" ")  # only pairs carry markers
    busy = np.zeros(n, bool)
    facts, queries = [], []
    gap = 2 * PAIR_LEN / spec.density  # mean spacing of fact starts for the target density
    p = 0
    while True:
        p += 1 + int(rng.exponential(gap))
        d = int(rng.integers(spec.min_dist, spec.max_dist + 1))
        if p + d + PAIR_LEN > n:
            if p + spec.min_dist + PAIR_LEN > n:
                break
            continue
        if busy[p:p + PAIR_LEN].any() or busy[p + d:p + d + PAIR_LEN].any():
            continue
        busy[p:p + PAIR_LEN] = busy[p + d:p + d + PAIR_LEN] = True
        facts.append(p)
        queries.append(p + d)
    facts, queries = np.array(facts, np.int64), np.array(queries, np.int64)
    order = np.argsort(facts)
    facts, queries = facts[order], queries[order]
    perm = rng.permutation(len(KEY_ALPHABET) ** KEY_LEN)
    keys = perm[np.arange(len(facts)) % len(perm)]
    key_bytes = KEY_ALPHABET[np.stack([keys // len(KEY_ALPHABET), keys % len(KEY_ALPHABET)], 1)]
    val_bytes = rng.choice(VALUE_ALPHABET, (len(facts), VALUE_LEN))
    for starts, marker in ((facts, FACT), (queries, QUERY)):
        out[starts] = marker
        out[starts[:, None] + 1 + np.arange(KEY_LEN)] = key_bytes
        out[starts[:, None] + 1 + KEY_LEN + np.arange(VALUE_LEN)] = val_bytes
    return out, facts, queries


def mqar_block(spec: RecallSpec, rng) -> tuple:
    """One format=mqar block: (tokens [block], answer mask [block], fact starts, query
    starts). Each pair draws its distance d (even, uniform in [min_dist, max_dist]) and then a
    fact slot whose query slot is also free; a pair that finds none is redrawn (a few times)."""
    u, n_units = MQAR_UNIT, spec.block // MQAR_UNIT
    out = rng.choice(NOISE_ALPHABET, spec.block).astype(np.int32)
    busy = np.zeros(n_units, bool)
    lo, hi = -(-spec.min_dist // u), spec.max_dist // u  # distances in units
    facts, queries = [], []
    for _ in range(8 * spec.pairs):
        if len(facts) == spec.pairs:
            break
        du = int(rng.integers(lo, hi + 1))
        free = np.flatnonzero(~busy[:n_units - du] & ~busy[du:])
        if not len(free):
            continue
        f = int(rng.choice(free))
        busy[f] = busy[f + du] = True
        facts.append(f * u)
        queries.append((f + du) * u)
    facts, queries = np.array(facts, np.int64), np.array(queries, np.int64)
    k = rng.permutation(spec.keys)[:len(facts)]
    v = rng.integers(0, spec.values, len(facts))
    _write_fact(out, facts, k, v, spec)
    out[queries], out[queries + 1] = _key_token(k, spec), _value_token(v, spec)
    answer = np.zeros(spec.block, np.float32)
    if spec.repeat:  # `a b a b`: the second b is the token before its predicting position
        copied = np.zeros(n_units, bool)
        for i in range(1, n_units):
            if not (busy[i] or busy[i - 1] or copied[i - 1]):
                out[i * u:(i + 1) * u] = out[(i - 1) * u:i * u]
                answer[i * u + 1] = spec.repeat
                copied[i] = True
    answer[queries + 1] = 1.0
    return out, answer, facts, queries


def without_key(tokens: np.ndarray, key: int, spec: RecallSpec, rng) -> None:
    """Make every unit of format=mqar `tokens` that holds key `key` (its key token, or with
    joint=1 a fact of that key) noise, in place: a probe's fact is then the key's only one."""
    hit = tokens == _key_token(key, spec)
    if spec.joint:
        hit |= (tokens - MQAR_JOINT0) // spec.values == key
    for i in np.flatnonzero(hit):
        tokens[i:i + MQAR_UNIT] = rng.choice(NOISE_ALPHABET, len(tokens[i:i + MQAR_UNIT]))


def _key_token(k, spec):
    return (MQAR_JKEY0 if spec.joint else MQAR_KEY0) + k


def _value_token(v, spec):
    return (MQAR_JVALUE0 if spec.joint else MQAR_VALUE0) + v


def _write_fact(out, starts, k, v, spec):
    """Facts of keys k (indices) and values v at `starts` (the noise after a joint stays)."""
    if spec.joint:
        out[starts] = MQAR_JOINT0 + k * spec.values + v
    else:
        out[starts], out[starts + 1] = _key_token(k, spec), _value_token(v, spec)


def mqar_stream(n_blocks: int, spec: RecallSpec, rng) -> tuple:
    """(tokens, loss weights) of n_blocks independent blocks end to end; weights[p] is the
    weight of predicting token p: 1 at answers, spec.other_weight elsewhere."""
    blocks = [mqar_block(spec, rng)[:2] for _ in range(n_blocks)]
    tokens = np.concatenate([b[0] for b in blocks])
    weights = np.concatenate([b[1] for b in blocks])
    weights = np.where(weights > 0, weights, spec.other_weight).astype(np.float32)
    return tokens, weights


@functools.lru_cache(maxsize=4)
def mqar_streams(spec: RecallSpec, val_fraction: float):
    """(train, val, train weights, val weights, description) of a format=mqar source."""
    n_train = spec.length // spec.block
    n_val = max(round(n_train * val_fraction), 4)
    train, w_train = mqar_stream(n_train, spec, np.random.default_rng([spec.seed, 0]))
    val, w_val = mqar_stream(n_val, spec, np.random.default_rng([spec.seed, 1]))
    for a in (train, val, w_train, w_val):
        a.flags.writeable = False
    desc = (f"recall mqar: {n_train:,} + {n_val:,} blocks of {spec.block}, {spec.pairs} pairs, "
            f"distances {spec.min_dist}..{spec.max_dist}, {spec.keys} keys, {spec.values} "
            f"values, other_weight {spec.other_weight}"
            + (f"; steps < {spec.warm_steps}: distances {spec.min_dist}.."
               f"{min(spec.warm_dist, spec.max_dist)}" if spec.warm_steps else ""))
    return train, val, w_train, w_val, desc


@functools.lru_cache(maxsize=4)
def mqar_warm_stream(spec: RecallSpec) -> tuple:
    """(tokens, weights) the first warm_steps training steps draw from: the source's blocks
    with distances in [min_dist, warm_dist] (a stream of its own seed)."""
    near = dataclasses.replace(spec, max_dist=max(spec.min_dist, spec.warm_dist))
    tokens, weights = mqar_stream(spec.length // spec.block, near,
                                  np.random.default_rng([spec.seed, 2]))
    tokens.flags.writeable = weights.flags.writeable = False
    return tokens, weights


def byte_streams(spec: RecallSpec, val_fraction: float, filler=None):
    """(train, val, description) of a byte-format recall source, its facts planted in
    `filler` ((train, val) byte arrays of a corpus, dsattn.data loads them) or in noise."""
    filler_train, filler_val = filler if filler is not None else (None, None)
    n_val = max(round(spec.length * val_fraction), 4 * spec.max_dist)
    rng = np.random.default_rng([spec.seed, 0])
    train = make_stream(spec.length, spec, filler_train, rng)[0]
    val = make_stream(n_val, spec, filler_val, np.random.default_rng([spec.seed, 1]))[0]
    for a in (train, val):
        a.flags.writeable = False
    kind = f"{spec.corpus} filler" if spec.corpus else "noise filler"
    desc = (f"recall: {len(train):,} + {len(val):,} bytes, distances {spec.min_dist}.."
            f"{spec.max_dist}, density {spec.density}, {kind}")
    return train, val, desc


# ----------------------------------------------------------------------------- probes
@dataclasses.dataclass
class Probes:
    tokens: np.ndarray  # [N, T] int32
    answer_pos: np.ndarray  # [N, VALUE_LEN] positions of the probe's answer bytes
    distance: np.ndarray  # [N] fact-to-query distance of each row


def probes(distances, n_per_distance: int, seq_len: int, spec: RecallSpec | None = None,
           background: np.ndarray | None = None, seed: int = 0, prefix: int = 0) -> Probes:
    """Rows of `seq_len` bytes, each with one pair at exactly distance d whose query ends the
    row. The rest of the row is a window of `background` (the validation stream, so the
    context looks like training) or a fresh stream; the probe's key appears nowhere else.
    `prefix` (format=mqar): rows preceded by that many tokens of earlier blocks."""
    spec = spec or RecallSpec()
    if spec.format == "mqar":
        return _mqar_probes(distances, n_per_distance, seq_len, spec, background, seed, prefix)
    if prefix:
        raise ValueError("probes: prefix is for format=mqar (byte probes place facts farther "
                         "back instead)")
    rng = np.random.default_rng([seed, 2])
    if background is None:
        background = make_stream(max(64 * seq_len, 4 * spec.max_dist), spec, None, rng)[0]
    if len(background) < seq_len:
        raise ValueError(f"probes: background of {len(background)} bytes < seq_len {seq_len}")
    rows, answers, dists = [], [], []
    q = seq_len - PAIR_LEN
    for d in distances:
        if not PAIR_LEN <= d <= q:
            raise ValueError(f"probes: distance {d} does not fit rows of {seq_len} bytes")
        for _ in range(n_per_distance):
            s = int(rng.integers(0, len(background) - seq_len + 1))
            row = np.array(background[s:s + seq_len], np.int32)
            used = {bytes(row[i + 1:i + 1 + KEY_LEN].astype(np.uint8))
                    for i in np.flatnonzero(row == FACT)}
            while True:
                key = rng.choice(KEY_ALPHABET, KEY_LEN)
                if bytes(key) not in used:
                    break
            val = rng.choice(VALUE_ALPHABET, VALUE_LEN)
            for start, marker in ((q - d, FACT), (q, QUERY)):
                row[start] = marker
                row[start + 1:start + 1 + KEY_LEN] = key
                row[start + 1 + KEY_LEN:start + PAIR_LEN] = val
            rows.append(row)
            answers.append(q + 1 + KEY_LEN + np.arange(VALUE_LEN))
            dists.append(d)
    return Probes(np.stack(rows), np.stack(answers), np.array(dists))


def _mqar_probes(distances, n_per_distance, seq_len, spec, background, seed,
                 prefix: int = 0) -> Probes:
    """format=mqar probes: the first seq_len tokens of a block (of `background`, block
    aligned, or a fresh one) with a fact planted at q - d and its query at q = seq_len - 2, so
    the answer is the row's last token; other units with the probe's key become noise. With
    `prefix`, each row is preceded by the `prefix` tokens before its block (earlier blocks:
    the same facts and distances, at positions that many tokens later)."""
    u = MQAR_UNIT
    if seq_len > spec.block or seq_len % u or prefix < 0:
        raise ValueError(f"probes: mqar rows of {seq_len} tokens must be even and <= block "
                         f"{spec.block} (prefix {prefix} >= 0)")
    rng = np.random.default_rng([seed, 2])
    first = -(-prefix // spec.block)  # blocks before the first one a row may start at
    if background is None:
        background = mqar_stream(64 + first, spec, rng)[0]
    n_blocks = len(background) // spec.block
    if n_blocks <= first:
        raise ValueError(f"probes: a background of {n_blocks} blocks has none after a "
                         f"prefix of {prefix} tokens")
    q = prefix + seq_len - u
    rows, answers, dists = [], [], []
    for d in distances:
        if not u <= d <= seq_len - u or d % u:
            raise ValueError(f"probes: mqar distance {d} must be even and in "
                             f"[{u}, {seq_len - u}]")
        for _ in range(n_per_distance):
            s = int(rng.integers(first, n_blocks)) * spec.block
            row = np.array(background[s - prefix:s + seq_len], np.int32)
            key = int(rng.integers(0, spec.keys))
            val = int(rng.integers(0, spec.values))
            without_key(row, key, spec, rng)  # the probe's key occurs nowhere else
            _write_fact(row, np.array([q - d]), np.array([key]), np.array([val]), spec)
            row[q], row[q + 1] = _key_token(key, spec), _value_token(val, spec)
            rows.append(row)
            answers.append([q + 1])
            dists.append(d)
    return Probes(np.stack(rows), np.array(answers), np.array(dists))


def score(pred: np.ndarray, p: Probes) -> dict[int, float]:
    """Accuracy on the answer bytes per distance; pred[n, t] is the prediction of token t."""
    hit = np.take_along_axis(pred, p.answer_pos, 1) == np.take_along_axis(
        p.tokens, p.answer_pos, 1)
    return {int(d): float(hit[p.distance == d].mean()) for d in np.unique(p.distance)}


def oracle(tokens: np.ndarray, lookback: int | None = None, rng=None) -> np.ndarray:
    """Predictions of an exact lookup: at each query's value bytes, the value of the latest
    earlier fact with the same key within `lookback` positions (None: anywhere). Without one
    it guesses a digit at random (what a model that cannot see the fact can do)."""
    rng = rng or np.random.default_rng(0)
    pred = np.zeros_like(tokens)
    for n, row in enumerate(tokens):
        facts = np.flatnonzero(row == FACT)
        for qs in np.flatnonzero(row == QUERY):
            if qs + PAIR_LEN > len(row):
                continue
            key = row[qs + 1:qs + 1 + KEY_LEN]
            cands = [f for f in facts if f < qs and (lookback is None or qs - f <= lookback)
                     and np.array_equal(row[f + 1:f + 1 + KEY_LEN], key)]
            vals = slice(1 + KEY_LEN, PAIR_LEN)
            pred[n, qs + 1 + KEY_LEN:qs + PAIR_LEN] = (
                row[cands[-1]:cands[-1] + PAIR_LEN][vals] if cands
                else rng.choice(VALUE_ALPHABET, VALUE_LEN))
    return pred
