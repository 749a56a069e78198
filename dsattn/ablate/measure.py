"""What a sweep measures of a trained run: held-out loss along training and beyond its
length, recall by distance on shared probes, KV byte figures (own config and full size),
training tokens/s and decode step time. Application code: it may use dsattn.bench."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from dsattn import data, kvbytes, recall, runlog
from dsattn.cache import formats
from dsattn.ablate.full_size import full_size_config
from dsattn.ablate.reach import window_reach
from dsattn.ablate.spec import Row, Sweep, recall_spec
from dsattn.errors import DsattnError
from dsattn.rundir import INIT_FILE


CONTEXTS = {"8k": 8192, "128k": 131072}


def cache_formats(cfg) -> str:
    """The deployed cache formats by role, "native" spelled with the dtype it stores."""
    c = cfg.cache
    return " ".join(f"{role}={fmt}" + (f"({cfg.model.dtype})" if formats.spec(fmt).exact else "")
                    for role, fmt in (("main", c.main_format), ("key", c.key_format),
                                      ("local", c.local_format)))


def kv_figures(cfg) -> dict:
    """KV bytes of a config: per token and one decode step's reads, in its deployed cache
    formats (`cache_formats`) and with every vector in BF16."""
    out = {"cache_formats": cache_formats(cfg),
           "storage_bytes_per_token": kvbytes.storage_per_token(cfg),
           "storage_bf16_bytes_per_token": kvbytes.storage_per_token(cfg, bf16=True),
           "local_bytes": float(kvbytes.local_bytes(cfg))}
    if (not out["storage_bytes_per_token"] and window_reach(cfg) is not None
            and cfg.attention.window >= cfg.train.seq_len):
        # windows that hold the whole training sequence: full attention at its length, each
        # token in every layer's ring (drawn there, not at 0, on pareto.png)
        out["full_window_bytes_per_token"] = out["local_bytes"] / cfg.attention.window
    for tag, ctx in CONTEXTS.items():
        rep = kvbytes.report(cfg, ctx)
        out[f"read_bytes_{tag}"] = float(rep["read_bytes"])
        out[f"read_bf16_bytes_{tag}"] = float(rep["read_bf16_bytes"])
    return out


def loss_unit(cfg) -> str:
    """What the held-out loss is averaged over: recall sources weigh only answers (unless
    other_weight > 0), byte vocabularies predict bytes."""
    spec = recall_spec(cfg)
    if spec is not None and spec.other_weight == 0:
        return "nats per answer token"
    return "nats per byte" if cfg.model.vocab_size == 256 else "nats per token"


def row_facts(sweep: Sweep, row: Row, cfg) -> dict:
    """What a run's numbers are read against, the same for every seed of a row: its window
    reach, recall's chance level and probes (their length and count per distance), its
    training length, the loss's unit and KV figures (own config, full size)."""
    full, applied, skipped = full_size_config(sweep, row)
    return {"reach": window_reach(cfg), "recall_chance": recall.chance(recall_spec(cfg)),
            "probe_len": sweep.probe_len, "per_distance": sweep.per_distance,
            "train_seq_len": cfg.train.seq_len,
            "loss_unit": loss_unit(cfg), "kv": kv_figures(cfg),
            "kv_full": kv_figures(full) if full is not None else None,
            "full_overrides_applied": applied, "full_overrides_skipped": skipped,
            "control": row.control}


def complete(sweep: Sweep, results: list[dict]) -> list[dict]:
    """Results saved before a field of `row_facts` existed, with it filled in from the
    sweep's configs, and the lengths each multiple ran at (`measure`'s recall_seq_len,
    loss_seq_len) where they were not recorded (rows the sweep no longer has are left as
    they are)."""
    rows = {r.name: r for r in sweep.rows}
    out = []
    for r in results:
        if r.get("row") in rows and "error" not in r:
            row = rows[r["row"]]
            cfg = sweep.config(row, r.get("seed", sweep.seeds[0]))
            facts = row_facts(sweep, row, cfg)
            beyond = {m: {"recall_seq_len": int(m) * sweep.probe_len,
                          "loss_seq_len": int(m) * cfg.train.seq_len, **b}
                      for m, b in (r.get("beyond") or {}).items()}
            r = {**r, **{k: v for k, v in facts.items() if k not in r},
                 "kv": {**facts["kv"], **(r.get("kv") or {})},
                 "kv_full": (None if facts["kv_full"] is None else
                             {**facts["kv_full"], **(r.get("kv_full") or {})}),
                 **({"beyond": beyond} if "beyond" in r else {})}
        out.append(r)
    return out


def _curve(run_dir: Path, start: int = 0) -> list[list[float]]:
    """Held-out loss along training, from metrics.jsonl (the last record per step wins),
    its steps counted from `start` (a run started from another's step `start`)."""
    points = {r["step"]: r["val_loss"] for r in runlog.records(run_dir) if "val_loss" in r}
    return [[start + s, points[s]] for s in sorted(points)]


def _start_step(run_dir: Path) -> int:
    """The steps trained before this run's first: the step of the run it started from
    (--init-from's record) plus that run's own start, along the chain; 0 for a fresh run."""
    path = Path(run_dir) / INIT_FILE
    if not path.exists():
        return 0
    source, step = json.loads(path.read_text())["source"].rsplit(":", 1)
    return int(step) + _start_step(Path(source))


def _tokens_per_s(run_dir: Path):
    """Median training tokens/s over the run's metrics records (the Trainer times the steps
    between records; compile, validation and checkpoint time are not in it)."""
    rates = [float(r["tokens_per_s"]) for r in runlog.records(run_dir) if "tokens_per_s" in r]
    return float(np.median(rates)) if rates else None


def _held_out_loss(model, cfg, seq_len: int) -> float | None:
    """Nats per token of the validation split at `seq_len` (None if the split is shorter)."""
    from dsattn import evaluate

    try:
        return evaluate.evaluate(model, cfg, [seq_len])[0]["nats_per_token"]
    except DsattnError:  # the validation split holds fewer than seq_len + 1 tokens
        return None


@dataclasses.dataclass
class Trained:
    """A run trained to its last step: its Trainer, final held-out loss, this session's
    training seconds (a group's over its seeds) and how many seeds trained together. A run
    measured again after a kill restored its weights through its Trainer, which verifies the
    checkpoint (checkpoint.restore_latest): nothing here reads a checkpoint itself."""
    trainer: object  # dsattn.train.Trainer
    val_loss: float
    train_s: float = 0.0
    together: int = 1


def measure(sweep: Sweep, row: Row, run: Trained, probes) -> dict:
    """A trained run's result: its held-out loss curve, recall at the sweep's distances and
    beyond the training length (`probes` by multiple of it, 1: the sweep's own), held-out
    loss there, KV figures (own and full size) and decode step time."""
    import jax

    from dsattn import recall_eval
    from dsattn.bench import measures as bench

    start = time.perf_counter()
    trainer, cfg = run.trainer, run.trainer.cfg
    model = trainer.model()
    acc = recall_eval.accuracy(model, probes[1])
    # recall on probes[m] (rows m x probe_len), loss on windows of m x the row's seq_len:
    # each length records the lengths it ran at and whether its rows end with the 1x rows
    beyond = {str(m): {"val_loss": _held_out_loss(model, cfg, m * cfg.train.seq_len),
                       "recall": {str(d): a for d, a in recall_eval.accuracy(model, p).items()},
                       "recall_seq_len": int(p.tokens.shape[1]),
                       "loss_seq_len": m * cfg.train.seq_len,
                       "same_probes_as_1x": _ends_with(p, probes[1])}
              for m, p in probes.items() if m > 1}
    decode_ms = None
    if sweep.decode_context:
        decode_ms = bench.time_decode(model, sweep.decode_context, batch=1, steps=5,
                                      warmup=1)["step_ms"]
    return {
        "row": row.name, "seed": cfg.train.seed, "overrides": list(row.overrides),
        # a row started from another (Row.init) counts its steps after the source's
        "start_step": _start_step(trainer.run_dir), "steps": trainer.step,
        "val_loss": run.val_loss,
        "curve": _curve(trainer.run_dir, _start_step(trainer.run_dir)),
        "params": int(sum(np.size(x) for x in jax.tree.leaves(trainer.params))),
        "train_tokens_per_s": _tokens_per_s(trainer.run_dir),
        "seeds_together": run.together,  # trained as one vmapped model with this many seeds
        "decode_context": sweep.decode_context or None, "decode_ms": decode_ms,
        "recall": {str(d): a for d, a in acc.items()},
        **row_facts(sweep, row, cfg),  # reach, chance, loss unit, KV figures
        # through the decode cache, as deployed (its formats), when the sweep asks for it
        **({"recall_cache": {str(d): a for d, a in recall_eval.cache_accuracy(
            model, probes[1]).items()}} if sweep.through_cache else {}),
        # {multiple: held-out loss, recall by distance, the lengths they ran at}
        "beyond": beyond,
        # this session's share of the run: its training (a group's time over its seeds)
        # and its measurements
        "wall_s": run.train_s + time.perf_counter() - start,
    }


def _ends_with(p: recall.Probes, one: recall.Probes) -> bool:
    """Each of p's rows is the 1x row `one` after earlier tokens (same answers, distances)."""
    n = one.tokens.shape[1]
    return bool(p.tokens.shape[0] == one.tokens.shape[0] and p.tokens.shape[1] >= n
                and (p.tokens[:, -n:] == one.tokens).all()
                and (p.distance == one.distance).all())


def probes_for(sweep: Sweep, cfg, times: int = 1) -> recall.Probes:
    """Recall probes shared by every run: contexts from the recall validation stream when the
    sweep trains on one, else from a fresh noise stream. With `times`, rows that many times
    longer: byte recall places facts that many times farther back (distances past
    recall.MAX_DIST left out: new probes); multi-query recall (facts within a block) puts
    (times - 1) x probe_len earlier tokens before each 1x row (`_after_earlier_tokens`), so
    at every multiple the same facts, distances and answers sit past the training length."""
    spec, background = recall_spec(cfg), None
    if spec is not None:
        background = data.recall_streams(spec, cfg.data.val_fraction, cfg.data.max_bytes)[1]
    spec = spec or recall.RecallSpec()
    if spec.format == "mqar":
        one = recall.probes(sweep.distances, sweep.per_distance, sweep.probe_len, spec,
                            background if background is not None
                            and len(background) >= sweep.probe_len else None)
        if times == 1:
            return one
        longest = max((times, *sweep.lengths))  # one prefix per row: x2's rows end x4's
        rows = _after_earlier_tokens(one, (longest - 1) * sweep.probe_len, spec, background)
        cut = (longest - times) * sweep.probe_len
        return recall.Probes(rows.tokens[:, cut:], rows.answer_pos - cut, rows.distance)
    if background is not None and len(background) < times * sweep.probe_len:
        background = None
    most = recall.distance_bounds(spec, times * sweep.probe_len)[1]
    dists = [times * d for d in sweep.distances if times * d <= min(most, recall.MAX_DIST)]
    return recall.probes(dists, sweep.per_distance, times * sweep.probe_len, spec, background)


def _after_earlier_tokens(p: recall.Probes, n: int, spec, background, seed: int = 0
                          ) -> recall.Probes:
    """format=mqar probes `p` each after `n` earlier tokens: the n tokens before a block
    start of `background` (the validation stream's blocks, drawn per row; a fresh stream when
    it holds too few), with the probe's key made noise there as recall.probes makes it in the
    probe block (its query key, and with joint=1 its facts), so the only fact for the
    query's key is the 1x row's, at the same distance."""
    blocks = -(-n // spec.block)
    rng = np.random.default_rng([seed, 3])
    if background is None or len(background) // spec.block < blocks + 1:
        background = recall.mqar_stream(64 + blocks, spec, rng)[0]
    n_blocks = len(background) // spec.block
    q = p.answer_pos[:, 0] - 1  # the query's key token: its value is the answer
    keys = p.tokens[np.arange(len(q)), q]
    base = recall.MQAR_JKEY0 if spec.joint else recall.MQAR_KEY0
    rows = []
    for row, key in zip(p.tokens, keys):
        s = int(rng.integers(blocks, n_blocks)) * spec.block
        before = np.array(background[s - n:s], np.int32)
        recall.without_key(before, int(key) - base, spec, rng)
        rows.append(np.concatenate([before, row]))
    return recall.Probes(np.stack(rows), p.answer_pos + n, p.distance)
