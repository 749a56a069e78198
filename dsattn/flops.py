"""Model FLOPs per token, from the layer plan, and the devices' peaks that make them an MFU.

Counting rules (docs/design.md, "FLOPs"): a multiply-add is 2 FLOPs; only matrix products
are counted (norms, softmax, RoPE, the compressor's pooling and top-k are not), and
rematerialised recomputation is not (model FLOPs, not hardware FLOPs). Per token and layer:

    weights      2 x the matmul parameters a token touches: attention projections, FFN,
                 the compressor's projections, the indexer's query/key projections (CSA2's
                 key projection runs once per entry: its parameters / m per token); plus
                 the output projection (tied or not) once; the embedding lookup is free
    attention    what one query reads x the cost of one item over all query heads:
                 mha       4 H d_head                    (q.k and p.v; GQA shares K/V, not work)
                 mla       2 H (d_nope + d_rope) + 2 H d_v          (naive: training)
                           2 H (kv_rank + d_rope) + 2 H kv_rank     (absorbed: decode; DSA always)
                 V4 family 4 H c per window position and per entry read
    indexer      2 n (d + 1) per search key scored (q.k per indexer head, then the head-weighted
                 sum); training also rescores the picked entries for its KL loss

Reads per query, training at length T (causal averages, the causal half counted once):

    mha / mla            T / 2 tokens
    dsa                  min(top_k, T / 2) tokens; scores T / 2 keys
    window (V4 family)   min(W, T) positions
    hca                  T / (2 m) entries
    csa / full           min(top_k, T / (2 m)) entries; scores T / (2 m) keys
    reindex              as csa, scoring only the candidate pool when there is one
    reuse                min(top_k, T / (2 m)) entries (the borrowed selection)

and for one decode step at context L the reads kvbytes counts (`kvbytes.read_counts`).

Training is 3 x the forward (the backward: a gradient for each input and each weight),
except the indexer's selection pass: its inputs are detached and top-k is discrete, so it has
no backward (1 x); the KL rescoring of the picks does (3 x).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsattn import kvbytes, plan
from dsattn.config import Config
from dsattn.plan import Family, Key, Selector, Source

__all__ = ["Reads", "train_reads", "decode_reads", "per_token", "train_breakdown",
           "decode_breakdown", "train_flops_per_token", "decode_flops_per_token",
           "matmul_params", "PEAK_TFLOPS", "peak_tflops", "mfu", "TrainingRate"]

TRAIN = 3  # forward + backward (gradients of inputs and of weights)
TERMS = ("weights", "attention", "indexer", "unembed")


@dataclass(frozen=True)
class Reads:
    """What one query of one layer reads (an average over a training sequence's queries)."""

    window: float = 0  # window positions attended (V4 family)
    entries: float = 0  # global items attended: tokens (mha/mla/dsa) or compressed entries
    keys: float = 0  # search keys its indexer scores to select
    picks: float = 0  # picked items the indexer's KL loss rescores (training)


# ------------------------------------------------------------------------ parameters
def _ffn(cfg: Config) -> float:
    return 3 * cfg.model.d_model * cfg.model.ffn_hidden  # SwiGLU: gate, up, down


def _mha_proj(cfg: Config, s: plan.LayerSpec) -> float:
    a, d = cfg.attention, cfg.model.d_model
    return 2 * d * a.n_heads * a.head_dim + 2 * d * (a.n_kv_heads or a.n_heads) * a.head_dim


def _mla_proj(cfg: Config, s: plan.LayerSpec) -> float:
    """Queries (through the query latent if any), [C^KV | K^R], the up-projection W^UK/W^UV
    (naive: per token; absorbed: folded into each query, the same parameters) and W^O."""
    a, d = cfg.attention, cfg.model.d_model
    q_out = a.n_heads * (a.qk_nope_dim + a.qk_rope_dim)
    query = d * a.q_lora_rank + a.q_lora_rank * q_out if a.q_lora_rank else d * q_out
    return (query + d * (a.kv_lora_rank + a.qk_rope_dim)
            + a.kv_lora_rank * a.n_heads * (a.qk_nope_dim + a.v_head_dim)
            + a.n_heads * a.v_head_dim * d)


def _v4_proj(cfg: Config, s: plan.LayerSpec) -> float:
    """Query latent and heads, the window KV, the grouped low-rank output (g groups of
    H/g heads -> r_o each, then g r_o -> D)."""
    a, d = cfg.attention, cfg.model.d_model
    hc = a.n_heads * a.entry_dim
    return (d * a.q_lora_rank + a.q_lora_rank * hc + d * a.entry_dim
            + hc * a.o_lora_rank + a.o_groups * a.o_lora_rank * d)


PROJECTIONS = {Family.MHA: _mha_proj, Family.MLA: _mla_proj, Family.DSA: _mla_proj,
               Family.V4: _v4_proj}


def _compressor(cfg: Config, s: plan.LayerSpec) -> float:
    """A layer's own entry compressor: W^KV and the gate W^Z, twice as wide with overlap;
    no gate at m = 1 without overlap (the token passes through)."""
    if s.kind.source is not Source.COMPRESSOR:
        return 0
    a, k = cfg.attention, s.kind
    gated = s.ratio > 1 or k.overlap
    return cfg.model.d_model * (2 if k.overlap else 1) * a.entry_dim * (2 if gated else 1)


KEY_PARAMS = {  # parameters per token that make a layer's own search keys
    Key.NONE: lambda cfg, s: 0,
    Key.TOKEN: lambda cfg, s: cfg.model.d_model * cfg.indexer.head_dim,  # DSA: W^K x
    # CSA: a second overlapping, gated compressor of width indexer.head_dim
    Key.COMPRESSOR: lambda cfg, s: cfg.model.d_model * 2 * cfg.indexer.head_dim * 2,
    # CSA2: W^IK of each entry, once per m tokens
    Key.ENTRY: lambda cfg, s: cfg.attention.entry_dim * cfg.indexer.head_dim / s.ratio,
}


def _indexer_weights(cfg: Config, s: plan.LayerSpec) -> float:
    """The indexer's query (from the query latent, or x without one) and head weights, and
    the layer's own search-key projection or compressor."""
    if not s.kind.scans_keys:
        return KEY_PARAMS[s.kind.key](cfg, s)
    ix, a, d = cfg.indexer, cfg.attention, cfg.model.d_model
    q_in = a.q_lora_rank or d
    return q_in * ix.n_heads * ix.head_dim + d * ix.n_heads + KEY_PARAMS[s.kind.key](cfg, s)


def matmul_params(cfg: Config) -> list[float]:
    """Matmul parameters one token touches in each layer (see the module docstring)."""
    return [PROJECTIONS[s.kind.family](cfg, s) + _ffn(cfg) + _compressor(cfg, s)
            + _indexer_weights(cfg, s) for s in plan.resolve(cfg)]


# ------------------------------------------------------------------------ per item read
def _mha_item(cfg: Config, absorbed: bool) -> float:
    a = cfg.attention
    return 4 * a.n_heads * a.head_dim


def _mla_item(cfg: Config, absorbed: bool) -> float:
    a = cfg.attention
    if absorbed:  # scores over [C^KV | K^R], values in the latent
        return 2 * a.n_heads * (a.kv_lora_rank + a.qk_rope_dim) + 2 * a.n_heads * a.kv_lora_rank
    return 2 * a.n_heads * (a.qk_nope_dim + a.qk_rope_dim) + 2 * a.n_heads * a.v_head_dim


def _v4_item(cfg: Config, absorbed: bool) -> float:
    a = cfg.attention
    return 4 * a.n_heads * a.entry_dim  # one entry is K and V for every head


ITEM = {  # FLOPs of one item one query reads, by family; (cfg, absorbed) -> FLOPs
    Family.MHA: _mha_item,
    Family.MLA: _mla_item,
    Family.DSA: lambda cfg, absorbed: _mla_item(cfg, True),  # DSA runs absorbed throughout
    Family.V4: _v4_item,
}


def _key_score(cfg: Config) -> float:
    ix = cfg.indexer
    return 2 * ix.n_heads * ix.head_dim + 2 * ix.n_heads


# ------------------------------------------------------------------------ reads
def train_reads(cfg: Config, seq_len: int) -> list[Reads]:
    """Per layer: what a query of a training sequence of `seq_len` tokens reads, on average
    (the module docstring's table)."""
    _check_length("seq_len", seq_len, 1)
    a = cfg.attention
    out = []
    for s in plan.resolve(cfg):
        k = s.kind
        visible = seq_len / (2 * s.stride) if s.entry is not None else 0  # causal average
        entries = {Selector.NONE: 0, Selector.ALL: visible}.get(k.selector,
                                                                  min(a.top_k, visible))
        keys = visible if k.scans_keys else 0
        if k.reads_pool and a.pool_blocks > 0:  # only the hierarchical indexer's pool
            keys = min(a.pool_blocks * a.pool_block_size, visible)
        out.append(Reads(window=min(a.window, seq_len) if k.window else 0, entries=entries,
                         keys=keys, picks=entries if k.scans_keys else 0))
    return out


def decode_reads(cfg: Config, context: int) -> list[Reads]:
    """Per layer: what one decode step reads with `context` tokens cached (kvbytes' counts)."""
    return [Reads(window=c["window_read"], entries=c["entries_read"], keys=c["keys_scanned"])
            for c in kvbytes.read_counts(cfg, context)]


# ------------------------------------------------------------------------ totals
def per_token(cfg: Config, reads: Sequence[Reads], training: bool) -> dict[str, float]:
    """FLOPs per token by term (``weights``, ``attention``, ``indexer``, ``unembed``) and
    their ``total``, for the given per-layer reads: a training step's (3 x the forward, the
    selection pass 1 x; MLA naive) or a decode step's (forward; MLA absorbed)."""
    specs = plan.resolve(cfg)
    if len(reads) != len(specs):
        raise ValueError(f"reads: {len(reads)} layers' reads for {len(specs)} layers")
    mult = TRAIN if training else 1
    out = dict.fromkeys(TERMS, 0.0)
    for s, r, params in zip(specs, reads, matmul_params(cfg)):
        out["weights"] += mult * 2 * params
        out["attention"] += mult * (r.window + r.entries) * ITEM[s.kind.family](cfg, not training)
        # selection: no backward; the KL loss's rescoring of the picks: a full one
        out["indexer"] += (r.keys + mult * r.picks) * _key_score(cfg)
    out["unembed"] = mult * 2 * cfg.model.d_model * cfg.model.vocab_size
    out["total"] = sum(out[t] for t in TERMS)
    return out


def train_breakdown(cfg: Config, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token at sequence length `seq_len`, by term and ``total``."""
    return per_token(cfg, train_reads(cfg, seq_len), training=True)


def decode_breakdown(cfg: Config, context: int) -> dict[str, float]:
    """FLOPs of one decode step per token with `context` tokens cached, by term and ``total``."""
    return per_token(cfg, decode_reads(cfg, context), training=False)


def train_flops_per_token(cfg: Config, seq_len: int) -> float:
    """Model FLOPs of a training step (forward + backward) per token at `seq_len`."""
    return train_breakdown(cfg, seq_len)["total"]


def decode_flops_per_token(cfg: Config, context: int) -> float:
    """Model FLOPs of a decode step per generated token at `context` cached tokens."""
    return decode_breakdown(cfg, context)["total"]


def _check_length(name: str, n, least: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise ValueError(f"{name}: expected an integer >= {least} tokens, got {n!r}")


# ------------------------------------------------------------------------ peak and MFU
# Dense BF16 peak TFLOP/s per device, keyed by jax's `device_kind`, from the vendors'
# datasheets, without structured sparsity (NVIDIA lists sparse figures: half of them).
PEAK_TFLOPS = {
    # NVIDIA H100 SXM5 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity
    "NVIDIA H100 80GB HBM3": 989.4,
    # NVIDIA H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity
    "NVIDIA H200": 989.4,
    # NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), SXM4 40/80 GB
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    # Google Cloud TPU system architecture pages: peak BF16 compute per chip
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,  # v5e
    "TPU v5e": 197.0,
    "TPU v5": 459.0,  # v5p
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,  # v6e (Trillium)
    "TPU v6e": 918.0,
}


def peak_tflops(device_kind: str, configured: float = 0.0) -> float | None:
    """Peak TFLOP/s per device: `configured` (train.peak_tflops) when > 0, else the table's
    figure for `device_kind`, else None (unknown: no MFU)."""
    if configured > 0:
        return float(configured)
    return PEAK_TFLOPS.get(device_kind)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None,
        devices: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over `devices` x `peak` TFLOP/s."""
    if not peak:
        return None
    return tokens_per_s * flops_per_token / (devices * peak * 1e12)


class TrainingRate:
    """Model TFLOP/s and MFU of a training run's tokens/s: the plan's training FLOPs per
    token at train.seq_len, and the peak of `devices` devices (train.peak_tflops, else the
    table's figure for jax's device_kind; None: no MFU)."""

    def __init__(self, cfg: Config, devices: int = 1, device_kind: str | None = None):
        import jax

        kind = jax.devices()[0].device_kind if device_kind is None else device_kind
        self.per_token = train_flops_per_token(cfg, cfg.train.seq_len)
        self.peak = peak_tflops(kind, cfg.train.peak_tflops)
        self.devices = devices

    def record(self, tokens_per_s: float) -> dict[str, float]:
        """metrics.jsonl's fields: ``model_tflops_per_s``, and ``mfu`` when the peak is known."""
        out = {"model_tflops_per_s": tokens_per_s * self.per_token / 1e12}
        if self.peak:
            out["mfu"] = mfu(tokens_per_s, self.per_token, self.peak, self.devices)
        return out

    def shown(self, tokens_per_s: float) -> dict[str, str]:
        """The progress line's fields."""
        rec = self.record(tokens_per_s)
        out = {"TFLOP/s": f"{rec['model_tflops_per_s']:.3g}"}
        if "mfu" in rec:
            out["MFU"] = f"{100 * rec['mfu']:.1f}%"
        return out
