"""Configs: YAML presets -> frozen, hashable dataclasses (static under jit).

A config file has up to seven sections (`model`, `attention`, `indexer`, `cache`, `train`,
`data`, `mesh`) plus a `name`. Overrides are `section.key=value` strings whose value is
parsed as YAML. Everything is validated at load time; errors name the offending key.

Layer plans and per-layer lists accept a short form: ``"swa*2, (csa, hca)*20, csa"``.
Ratios resolve in this order: explicit ``attention.ratios`` list, else the per-kind default
(``csa_ratio``, ``hca_ratio``, ``csa2_ratio``); then ``attention.ratio`` (if > 0) sets every
compressed layer's ratio at once, so a ratio ablation is one override.

Each key declares its `Kind` once, on its field: what changing it means to a run directory
or a finished sweep run (a model change, a layout, how the step runs, the schedule, the
data order...). `keys_of(kind)` and `kind_of(section, key)` are what the resume checks
(dsattn.checkpoint, dsattn.train) and a sweep run's fingerprint (dsattn.ablate) read.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import re
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import jax
import yaml


from dsattn import datasource, depth, plan
from dsattn.cache import formats
from dsattn.migrations import RENAMED, upgrade_saved  # noqa: F401  (upgrade_saved re-exported)
from dsattn.errors import ConfigError  # noqa: F401  (re-exported: dsattn.config.ConfigError)
from dsattn.kernels import registry
from dsattn.plan import Family

DTYPES = ("float32", "float64", "bfloat16", "float16")
INDEXER_TOPK = ("exact", "approx")  # lax.top_k | lax.approx_max_k (recall 1.0; for TPU)
KEY_NORMS = ("layernorm", "rmsnorm")


class Kind(enum.Enum):
    """What a config key means to what already exists (a checkpoint to resume, a finished
    sweep run to skip). Declared once, on each section field (`_key`: the field's metadata
    "kind"); every check reads it through `kind_of` and `keys_of`."""

    # What the weights compute (their shapes and meaning): a run restores only under the
    # same value (checkpoint.check_compatible), and a finished sweep run is skipped only
    # under the same value.
    MODEL = "model"
    # How the parameters are laid out, not what they compute: a run restores across it
    # (checkpoint.layouts, migrations.SAVED_LAYOUTS).
    LAYOUT = "layout"
    # How a step runs (block sizes, remat, micro-batches, the device mesh), not what it
    # computes: may change on resume, and left out of a sweep run's fingerprint, so a
    # finished run is kept under another value.
    EXECUTION = "execution"
    # The learning-rate schedule: a resume under other values rebuilds it, with a warning.
    SCHEDULE = "schedule"
    # Which batch each step draws (data.batch_at): a resume under other values warns and is
    # recorded as not exact (train.Trainer; strict refuses it).
    DATA_ORDER = "data_order"
    # The optimizer's other settings: a resume takes the new values.
    OPTIMIZER = "optimizer"
    # What a run validates, logs and keeps (validation, logs, checkpoints, MFU): a resume
    # takes the new values.
    RECORDING = "recording"


def _key(default, kind: Kind):
    """A section field with its default and its Kind."""
    return field(default=default, metadata={"kind": kind})


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = _key(256, Kind.MODEL)
    d_model: int = _key(128, Kind.MODEL)
    n_layers: int = _key(4, Kind.MODEL)
    ffn_hidden: int = _key(384, Kind.MODEL)
    norm_eps: float = _key(1e-6, Kind.MODEL)
    tie_embeddings: bool = _key(True, Kind.MODEL)
    # Compute dtype: every layer computes in it (parameters cast to it where used); softmax,
    # norms, the indexer's scores and top-k and the losses run in at least float32 whatever
    # it is (docs/design.md, "Precision"). float32, bfloat16, float16 or float64.
    dtype: str = _key("float32", Kind.MODEL)
    # Parameter dtype (and so the optimizer's moments): weights keep small updates in
    # float32 under bfloat16 compute. Never narrower than `dtype`: parameters are stored in
    # the wider of the two (jnp.promote_types), so model.dtype=float64 alone runs in exact
    # float64. Run directories saved before it existed read it as their `dtype`.
    param_dtype: str = _key("float32", Kind.MODEL)
    init_std: float = _key(0.02, Kind.MODEL)
    # Longest sequence: bounds train.seq_len; default cache length
    max_seq_len: int = _key(1024, Kind.MODEL)
    # Run each repeated group of layers as one scan (plan.units): compiles in constant time
    # whatever the depth (docs/design.md, "Depth"); a layout, not a model change.
    scan_layers: bool = _key(True, Kind.LAYOUT)
    # Rematerialisation in the training step, around each block and the scan body: none,
    # block (keep only each block's inputs), or a jax.checkpoint_policies name. The default
    # keeps the weight matmuls and recomputes the rest: without it a scanned stack kept
    # per-block values quadratic in T (tiny mha at 32K: 6.5 GiB of temporaries, 1.6 with it;
    # docs/design.md, "Long context"). How the step runs, not what it computes.
    remat: str = _key("dots_with_no_batch_dims_saveable", Kind.EXECUTION)
    # From this many tokens per sequence on, the training step rematerialises whole blocks
    # (as remat=block) whatever `remat` names: what a policy keeps grows with T, and at
    # long context it, not attention, decides the step's memory (docs/design.md). Set it
    # above model.max_seq_len to keep `remat` at every length.
    remat_block_from: int = _key(16384, Kind.EXECUTION)


@dataclass(frozen=True)
class AttentionConfig:
    # One kind per layer (or one kind for all layers)
    layers: tuple[str, ...] = _key(("mha",), Kind.MODEL)
    n_heads: int = _key(4, Kind.MODEL)
    head_dim: int = _key(32, Kind.MODEL)  # per-head dim of mha/gqa/mqa
    n_kv_heads: int = _key(0, Kind.MODEL)  # mha/gqa/mqa; 0 means n_heads
    # mha/gqa/mqa: RoPE on the last this many dims of each head, the rest position-free
    # (partial RoPE, as GPT-NeoX's rotary_pct and MHA2MLA's first step); 0: all of head_dim
    mha_rope_dim: int = _key(0, Kind.MODEL)
    rope_theta: float = _key(10000.0, Kind.MODEL)
    # RoPE scaling (none | yarn), on the roles DeepSeek scales: every MLA/DSA/MHA layer's
    # rope (and the MLA softmax scale by mscale(factor, mscale_all_dim)^2), and V4's
    # compressed layers (compress_rope_theta; SWA layers keep the plain rope). Active only
    # when model.max_seq_len > yarn_original_max_position, as in DeepSeek's reference.
    # docs/design.md, "YaRN".
    rope_scaling: str = _key("none", Kind.MODEL)
    yarn_factor: float = _key(1.0, Kind.MODEL)
    yarn_original_max_position: int = _key(4096, Kind.MODEL)
    yarn_beta_fast: float = _key(32.0, Kind.MODEL)
    yarn_beta_slow: float = _key(1.0, Kind.MODEL)
    # With mscale_all_dim: cos/sin x mscale(f, this)/mscale(f, all)
    yarn_mscale: float = _key(0.0, Kind.MODEL)
    yarn_mscale_all_dim: float = _key(0.0, Kind.MODEL)  # 0: no softmax-scale factor (V4)
    # MLA (V2/V3/V3.2)
    # 0: queries straight from x (MHA/MLA); V4 family needs > 0
    q_lora_rank: int = _key(0, Kind.MODEL)
    kv_lora_rank: int = _key(64, Kind.MODEL)
    # RMSNorm on MLA's latent C^KV (V2/V3 have it). false: the latent is W^DKV x itself, so
    # keys and values stay linear in x: an MHA converted by factorising its key and value
    # projections (dsattn.convert) is then exact; the norm makes them scale-free in x.
    latent_norm: bool = _key(True, Kind.MODEL)
    qk_nope_dim: int = _key(32, Kind.MODEL)
    qk_rope_dim: int = _key(16, Kind.MODEL)
    v_head_dim: int = _key(32, Kind.MODEL)
    # V4 family
    # Entry width c: each head's query, the window KV, compressed entries
    entry_dim: int = _key(32, Kind.MODEL)
    rope_dim: int = _key(16, Kind.MODEL)  # RoPE on the last rope_dim dims of queries and entries
    window: int = _key(16, Kind.MODEL)
    o_groups: int = _key(1, Kind.MODEL)
    o_lora_rank: int = _key(64, Kind.MODEL)
    query_norm: bool = _key(True, Kind.MODEL)  # V4 RMS-normalises each head's query; V4.1 does not
    compress_rope_theta: float = _key(10000.0, Kind.MODEL)
    ratios: tuple[int, ...] = _key((), Kind.MODEL)  # resolved per-layer compression ratio (0: none)
    ratio: int = _key(0, Kind.MODEL)  # >0: every compressed layer uses this ratio
    csa_ratio: int = _key(4, Kind.MODEL)
    hca_ratio: int = _key(128, Kind.MODEL)
    csa2_ratio: int = _key(2, Kind.MODEL)
    # False turns every reindex/reuse layer into a full layer
    sharing: bool = _key(True, Kind.MODEL)
    ced_split: int = _key(0, Kind.MODEL)  # first decoder layer under CED; 0: decoder-only stack
    pool_blocks: int = _key(0, Kind.MODEL)  # hierarchical indexer: candidate blocks kept (0: off)
    pool_block_size: int = _key(8, Kind.MODEL)
    # Entries (tokens for dsa) each query selects through the indexer
    top_k: int = _key(8, Kind.MODEL)
    # Queries per block in the training forward and a prefill chunk (attention/blocks.py):
    # what attention holds live scales with the block, not with T x T. Not a model change.
    query_block: int = _key(512, Kind.EXECUTION)
    # Entries per step of the online softmax over a long shared read (HCA over compressed
    # entries; attention/reference.py), when no training target needs the per-entry
    # probabilities.
    entry_block: int = _key(2048, Kind.EXECUTION)
    # Which implementation runs every attention read (kernels/registry.py): "xla", the
    # blocked reference; "auto": in a program lowered for a GPU (the platform, not this
    # process's backend), the first registered kernel that runs compiled there and fits
    # the config, else the reference. Same numbers, another program.
    impl: str = _key("xla", Kind.EXECUTION)


@dataclass(frozen=True)
class IndexerConfig:
    n_heads: int = _key(4, Kind.MODEL)
    head_dim: int = _key(32, Kind.MODEL)
    rope_dim: int = _key(16, Kind.MODEL)
    key_norm: str = _key("layernorm", Kind.MODEL)  # DSA: LayerNorm on the key; CSA2: RMSNorm
    loss_weight: float = _key(1.0, Kind.MODEL)
    dense_warmup_steps: int = _key(0, Kind.MODEL)
    impl: str = _key("auto", Kind.MODEL)
    # true: the score kernel runs in the Pallas interpreter everywhere (a debugging aid);
    # false: compiled where the program is lowered for a GPU or TPU, interpreted for a CPU
    interpret: bool = _key(False, Kind.MODEL)
    # approx: lax.approx_max_k, fast on TPU; ties may differ
    topk_method: str = _key("exact", Kind.MODEL)
    # Keys scored per step of the running top-k (indexer.top_k)
    key_block: int = _key(4096, Kind.EXECUTION)
    # Rotate queries and keys by a Hadamard matrix wherever cache.key_format is FP8 or FP4
    # (scores unchanged, quantization error spread over the channels); head_dim a power of 2.
    hadamard: bool = _key(True, Kind.MODEL)


@dataclass(frozen=True)
class CacheConfig:
    local_format: str = _key("native", Kind.MODEL)  # V4-family window (ring buffer)
    main_format: str = _key("native", Kind.MODEL)  # compressed entries, MLA latents, MHA K/V
    key_format: str = _key("native", Kind.MODEL)  # indexer search keys
    page_size: int = _key(16, Kind.MODEL)  # entries per page of the global (paged) cache
    # Apply the formats' quantize-dequantize in the training forward
    fake_quant: bool = _key(False, Kind.MODEL)


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = _key(8, Kind.DATA_ORDER)
    seq_len: int = _key(128, Kind.DATA_ORDER)
    steps: int = _key(200, Kind.SCHEDULE)
    lr: float = _key(3e-3, Kind.SCHEDULE)
    min_lr_ratio: float = _key(0.1, Kind.SCHEDULE)
    warmup_steps: int = _key(20, Kind.SCHEDULE)
    weight_decay: float = _key(0.1, Kind.OPTIMIZER)
    b1: float = _key(0.9, Kind.OPTIMIZER)
    b2: float = _key(0.95, Kind.OPTIMIZER)
    grad_clip: float = _key(1.0, Kind.OPTIMIZER)
    eval_every: int = _key(50, Kind.RECORDING)
    eval_batches: int = _key(4, Kind.RECORDING)
    ckpt_every: int = _key(100, Kind.RECORDING)
    keep_checkpoints: int = _key(2, Kind.RECORDING)
    log_every: int = _key(10, Kind.RECORDING)
    seed: int = _key(0, Kind.DATA_ORDER)
    # Peak TFLOP/s of one device, for the MFU training logs; 0: jax's device_kind looked
    # up in dsattn.flops.PEAK_TFLOPS (a device not there logs no MFU).
    peak_tflops: float = _key(0.0, Kind.RECORDING)
    # Micro-batches per optimizer step (batch_size / grad_accum rows each), their gradients
    # summed in a scan: batch_size stays the step's batch, so only memory changes.
    grad_accum: int = _key(1, Kind.EXECUTION)
    # Parameter-path patterns (fnmatch, `*` crosses `/`) whose parameters and optimizer state
    # stay fixed: the optimizer is masked (optax.multi_transform), so a frozen parameter
    # gets no update, no weight decay and no moments. Later patterns win; `!pattern`
    # trains what an earlier one froze, e.g. ["*", "!*/selector/*"]. Paths are the model's
    # (`dsattn.trainstep.parameter_paths`). The optimizer state's shape depends on it, so
    # a run resumes only under the same value: a new stage is a new run (--init-from).
    freeze: tuple[str, ...] = _key((), Kind.MODEL)


@dataclass(frozen=True)
class DataConfig:
    # "stdlib", recall:..., text file/glob, .u16/.bin tokens, or a token dir: its text parsed
    # here, once (dsattn.datasource); config.yaml keeps the text
    source: datasource.DataSource = _key(datasource.STDLIB, Kind.DATA_ORDER)
    val_fraction: float = _key(0.05, Kind.DATA_ORDER)
    max_bytes: int = _key(8_000_000, Kind.DATA_ORDER)  # cap on the corpus read (0: no cap)

    def __post_init__(self):
        object.__setattr__(self, "source", datasource.parse(self.source))


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (dsattn.sharding); -1: the devices the other axes leave. The default
    is one device: nothing is sharded."""
    data: int = _key(1, Kind.EXECUTION)  # batch rows
    fsdp: int = _key(1, Kind.EXECUTION)  # batch rows, and parameters and optimizer state split
    tensor: int = _key(1, Kind.EXECUTION)  # attention/indexer heads, FFN hidden, vocabulary split


def _section(cls, full_size: bool = False):
    """A Config field holding a section; `full_size`: its keys describe the attention design
    whatever the model's size, so a sweep row's overrides of them carry to the sweep's
    full-size preset (dsattn.ablate.full_size); the model's shape, training and data don't."""
    return field(default_factory=cls, metadata={"full_size": full_size})


@dataclass(frozen=True)
class Config:
    name: str = "unnamed"
    model: ModelConfig = _section(ModelConfig)
    attention: AttentionConfig = _section(AttentionConfig, full_size=True)
    indexer: IndexerConfig = _section(IndexerConfig, full_size=True)
    cache: CacheConfig = _section(CacheConfig, full_size=True)
    train: TrainConfig = _section(TrainConfig)
    data: DataConfig = _section(DataConfig)
    mesh: MeshConfig = _section(MeshConfig)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["data"]["source"] = self.data.source.text  # its text, as written
        return d

    def to_yaml(self) -> str:
        d = self.to_dict()
        for sec in d.values():
            if isinstance(sec, dict):
                for k, v in sec.items():
                    if isinstance(v, tuple):
                        sec[k] = list(v)
        return yaml.safe_dump(d, sort_keys=False)


_SECTION_CLASSES = {f.name: f.default_factory for f in dataclasses.fields(Config)
                    if f.name != "name"}  # in Config's order


# ----------------------------------------------------------------------------- key kinds
def kind_of(section: str, key: str) -> Kind | None:
    """The Kind of `section.key` (None for a key no section has, e.g. one an old run
    directory saved before it was removed)."""
    return _KINDS.get((section, key))


def keys_of(*kinds: Kind) -> tuple[tuple[str, str], ...]:
    """The (section, key) pairs of these kinds, in declaration order (sections in Config's
    order, keys in their dataclass's)."""
    return tuple(k for k, kind in _KINDS.items() if kind in kinds)


def sections_of(*kinds: Kind) -> tuple[str, ...]:
    """The sections holding a key of these kinds, in Config's order."""
    return tuple(dict.fromkeys(sec for sec, _ in keys_of(*kinds)))


def full_size_sections() -> tuple[str, ...]:
    """The sections whose overrides keep their meaning in a full-size preset (`_section`)."""
    return tuple(f.name for f in dataclasses.fields(Config) if f.metadata.get("full_size"))


def without(d: dict, *kinds: Kind) -> dict:
    """A config dict (Config.to_dict's shape) without the keys of these kinds."""
    return {sec: ({k: v for k, v in keys.items() if kind_of(sec, k) not in kinds}
                  if isinstance(keys, dict) else keys) for sec, keys in d.items()}


def with_values(cfg: Config, values: dict) -> Config:
    """`cfg` with {(section, key): value} set (not validated)."""
    sections = {}
    for (sec, key), value in values.items():
        sections.setdefault(sec, {})[key] = value
    return dataclasses.replace(cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **kv)
                                       for sec, kv in sections.items()})


def _kinds() -> dict:
    kinds = {}
    for sec, cls in _SECTION_CLASSES.items():
        for f in dataclasses.fields(cls):
            if not isinstance(f.metadata.get("kind"), Kind):
                raise TypeError(f"{sec}.{f.name}: no Kind (declare it with _key)")
            kinds[sec, f.name] = f.metadata["kind"]
    return kinds


_KINDS = _kinds()  # {(section, key): Kind}, in declaration order


# ----------------------------------------------------------------------------- short forms
def expand_pattern(spec, key: str = "pattern") -> list[str]:
    """Expand ``"swa*2, (csa, hca)*3"`` (or a YAML list of such items) into a flat list."""
    if isinstance(spec, (list, tuple)):
        out: list[str] = []
        for item in spec:
            out.extend(expand_pattern(str(item), key))
        return out
    text = str(spec).strip()
    if not text:
        return []
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{key}: unbalanced ')' in {text!r}")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ConfigError(f"{key}: unbalanced '(' in {text!r}")
    items.append(cur)
    out = []
    for item in items:
        item = item.strip()
        m = re.fullmatch(r"(.+?)\s*\*\s*(\d+)", item, flags=re.S)
        body, times = (m.group(1).strip(), int(m.group(2))) if m else (item, 1)
        if body.startswith("(") and body.endswith(")"):
            inner = expand_pattern(body[1:-1], key)
        elif body:
            inner = [body]
        else:
            raise ConfigError(f"{key}: empty item in {text!r}")
        out.extend(inner * times)
    return out


# ----------------------------------------------------------------------------- coercion
def _coerce(value, typ, key: str):
    origin = typing.get_origin(typ)
    if origin is tuple:
        elem = typing.get_args(typ)[0]
        items = expand_pattern(value, key) if isinstance(value, (str, list, tuple)) else [value]
        return tuple(_coerce(_parse_scalar(v), elem, key) for v in items)
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if typ is str or typ is datasource.DataSource:  # data.source: DataConfig parses it
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {typ} for {key}")


def _parse_scalar(v):
    if isinstance(v, str):
        try:
            return yaml.safe_load(v)
        except yaml.YAMLError:
            return v
    return v


def _build_section(cls, raw: dict, section: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in raw.items():
        if (section, k) in RENAMED:
            raise ConfigError(f"{section}.{k}: renamed to {section}.{RENAMED[section, k]}")
        if k not in names:
            raise ConfigError(
                f"{section}.{k}: unknown key{_did_you_mean(k, names, section + '.')}; "
                f"valid keys in '{section}' are: {', '.join(names)}"
            )
        kwargs[k] = _coerce(v, hints[k], f"{section}.{k}")
    return cls(**kwargs)


def _did_you_mean(key: str, valid, prefix: str = "") -> str:
    """' (did you mean section.key?)' for the closest valid key (difflib), else ''."""
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


# ----------------------------------------------------------------------------- loading
def apply_overrides(raw: dict, overrides) -> dict:
    """Apply ``section.key=value`` strings to a raw config dict (values parsed as YAML)."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for ov in overrides or ():
        if "=" not in ov:
            raise ConfigError(f"override {ov!r}: expected key=value, e.g. attention.top_k=8")
        key, value = ov.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if parts == ["name"]:
            raw["name"] = value
            continue
        if len(parts) != 2 or parts[0] not in _SECTION_CLASSES:
            every = [f"{sec}.{f.name}" for sec, cls in _SECTION_CLASSES.items()
                     for f in dataclasses.fields(cls)]
            raise ConfigError(
                f"{key}: unknown key{_did_you_mean(key, every)}; use section.key with section "
                f"one of {', '.join(_SECTION_CLASSES)}"
            )
        raw.setdefault(parts[0], {})
        if not isinstance(raw[parts[0]], dict):
            raise ConfigError(f"{parts[0]}: expected a mapping")
        raw[parts[0]][parts[1]] = _parse_scalar(value)
    return raw


def from_dict(raw: dict, overrides=(), scale_schedule: bool = False) -> Config:
    """A Config from a raw dict and overrides; `scale_schedule`: a run whose overrides
    shorten train.steps scales the schedule's other step counts with it (`scale_schedule_of`)."""
    given = raw or {}
    raw = apply_overrides(given, overrides)
    unknown = set(raw) - set(_SECTION_CLASSES) - {"name"}
    if unknown:
        k = sorted(unknown)[0]
        raise ConfigError(
            f"{k}: unknown section; valid sections are: name, {', '.join(_SECTION_CLASSES)}"
        )
    sections = {}
    for name, cls in _SECTION_CLASSES.items():
        sec = raw.get(name) or {}
        if not isinstance(sec, dict):
            raise ConfigError(f"{name}: expected a mapping, got {sec!r}")
        sections[name] = _build_section(cls, sec, name)
    cfg = Config(name=str(raw.get("name", "unnamed")), **sections)
    cfg = _fit_depth(cfg, overridden_keys(overrides))
    if scale_schedule:
        cfg = scale_schedule_of(cfg, _preset_steps(given), overridden_keys(overrides))
    cfg = _resolve(cfg)
    validate(cfg)
    return cfg


def overridden_keys(overrides) -> set[tuple[str, str]]:
    """The (section, key) pairs that ``section.key=value`` overrides set."""
    return {tuple(ov.split("=", 1)[0].strip().split(".", 1)) for ov in overrides or ()
            if "=" in ov and "." in ov.split("=", 1)[0]}


# The steps a run counts in: each should fit in train.steps (the key, where it applies).
SCHEDULE_STEPS = (("train", "warmup_steps"), ("indexer", "dense_warmup_steps"),
                  ("train", "eval_every"))
# How often a run records (Kind.RECORDING: a resume takes new values): scaled with the
# schedule by --scale-schedule, so a short run checkpoints and logs as often for its length.
CADENCE_STEPS = (("train", "ckpt_every"), ("train", "log_every"))
SCALED_STEPS = SCHEDULE_STEPS + CADENCE_STEPS  # what --scale-schedule fits to a run


def short_schedule(cfg: Config) -> list[tuple[str, int]]:
    """The schedule keys (SCHEDULE_STEPS) longer than train.steps: a warm-up the run never
    finishes (the lr never decays; the indexer's top-k is never trained) or a validation
    interval it never reaches. The indexer's only where a layer has one."""
    indexed = any(s.kind.scans_keys for s in plan.resolve(cfg))
    return [(f"{sec}.{key}", getattr(getattr(cfg, sec), key)) for sec, key in SCHEDULE_STEPS
            if getattr(getattr(cfg, sec), key) > cfg.train.steps
            and (sec != "indexer" or indexed)]


def _preset_steps(raw: dict) -> int:
    """The train.steps a preset's own dict names (before overrides)."""
    return _coerce(((raw or {}).get("train") or {}).get("steps", TrainConfig.steps), int,
                   "train.steps")


def preset_steps(path) -> int:
    """The train.steps of the preset at `path` (before overrides)."""
    return _preset_steps(_read_preset(path))


def scale_schedule_of(cfg: Config, preset_steps: int, overridden=frozenset()) -> Config:
    """The SCHEDULE_STEPS and CADENCE_STEPS keys not in `overridden` scaled by train.steps /
    preset_steps when the run is the shorter (each from 1 step to train.steps): a preset's
    schedule fitted to a short run (scripts/train.py --scale-schedule)."""
    steps = cfg.train.steps
    if not 0 < steps < preset_steps:
        return cfg
    scaled = {}
    for sec, key in SCALED_STEPS:
        value = getattr(getattr(cfg, sec), key)
        if (sec, key) not in overridden and value:
            scaled[sec, key] = min(steps, max(1, round(value * steps / preset_steps)))
    return with_values(cfg, scaled)


# What a short run (configs/tiny: 600 steps of 16 x 128 tokens) trains with where the rest
# of a preset is at its own scale: the tiny presets' rate, a top-k of a quarter of the
# entries an indexer chooses from (their dsa and v4) and a window of an eighth of the
# sequence. tests/test_schedule.py checks the tiny presets still say so.
SHORT_RUN_LR = 3e-3


def _lr_advice(cfg: Config, preset_steps: int):
    if cfg.train.lr < SHORT_RUN_LR:
        return SHORT_RUN_LR, (f"the preset's rate for {preset_steps:,} steps; configs/tiny's "
                              f"short runs use {SHORT_RUN_LR:g}")


def _top_k_advice(cfg: Config, preset_steps: int):
    # the indexed layer choosing from the fewest entries at train.seq_len
    n, kind = min(((cfg.train.seq_len // s.stride, s.name) for s in plan.resolve(cfg)
                   if s.kind.scans_keys), default=(math.inf, ""))
    if cfg.attention.top_k >= n:
        return max(1, n // 4), (f"{kind} picks from only {n} entries at train.seq_len="
                                f"{cfg.train.seq_len}: its sparse attention is dense")


def _window_advice(cfg: Config, preset_steps: int):
    t = cfg.train.seq_len
    if cfg.attention.window >= t and any(s.kind.window for s in plan.resolve(cfg)):
        return max(1, t // 8), (f"it spans all {t} tokens of train.seq_len: every layer "
                                f"attends densely")


# ((section, key), rule(cfg, preset_steps) -> (value to try, why) or None): keys that
# depend on a run's scale but are no step counts, so --scale-schedule leaves them alone.
SHORT_RUN_RULES = ((("train", "lr"), _lr_advice), (("attention", "top_k"), _top_k_advice),
                   (("attention", "window"), _window_advice))


def short_run_advice(cfg: Config, preset_steps: int, overridden=frozenset()) -> list[str]:
    """For a run shorter than its preset's `preset_steps`: a line per SHORT_RUN_RULES key
    not in `overridden` whose value suits the preset's run and not this one, with a value
    to try and why; [] when none applies (scripts/train.py --scale-schedule prints them)."""
    if not cfg.train.steps < preset_steps:
        return []
    lines = []
    for (sec, key), rule in SHORT_RUN_RULES:
        advice = None if (sec, key) in overridden else rule(cfg, preset_steps)
        if advice:
            value, why = advice
            lines.append(f"{sec}.{key}={getattr(getattr(cfg, sec), key):g}: {why}; try "
                         f"{sec}.{key}={value:g}")
    return lines


_DEPTH_KEYS = (("attention", "layers"), ("attention", "ratios"), ("attention", "ced_split"))


def _fit_depth(cfg: Config, overridden: set) -> Config:
    """The per-layer keys (attention.layers, ratios, ced_split) checked together against
    model.n_layers. An override of model.n_layers alone derives them from the preset's plan
    (dsattn.depth), warning about the mechanisms N layers cannot keep; any other mismatch
    is one ConfigError naming every key that does not fit and a plan that does."""
    a, n = cfg.attention, cfg.model.n_layers
    written = max(len(a.layers), len(a.ratios))  # the depth the plan is written for
    misfits = {  # each key that does not fit, with a fix of its own
        "layers": (f"attention.layers has {len(a.layers)} kinds",
                   f"model.n_layers={len(a.layers)}"),
        "ratios": (f"attention.ratios has {len(a.ratios)} ratios",
                   "attention.ratios=[] (each kind's default ratio)"),
        "ced_split": (f"attention.ced_split={a.ced_split} is not a layer index in 1..{n - 1}",
                      "attention.ced_split=0 (off)")}
    fits = {"layers": len(a.layers) in (1, n), "ratios": len(a.ratios) in (0, 1, n),
            "ced_split": a.ced_split < n}
    misfits = {k: v for k, v in misfits.items() if not fits[k]}
    if not misfits or n < 1:
        return cfg
    derived = None
    if 1 < written and n < written:  # a plan shrinks; a deeper stack is the user's to write
        try:
            preset = _resolve(with_values(cfg, {("model", "n_layers"): written}))
            plan.check(preset)
            derived = depth.at_depth(preset, n)
        except ConfigError:
            pass  # the plan is not valid at its own depth either: no suggestion from it
    if derived is not None and ("model", "n_layers") in overridden and not (
            overridden & set(_DEPTH_KEYS)):
        if derived.dropped:
            warnings.warn(
                f"model.n_layers={n}: the preset's {written}-layer plan shrinks to "
                f"{derived.overrides()}, without {', '.join(derived.dropped)} (model.n_layers"
                f" >= {derived.keeps_all_from} keeps every mechanism)", stacklevel=3)
        return with_values(cfg, {("attention", "layers"): derived.layers,
                                 ("attention", "ratios"): derived.ratios,
                                 ("attention", "ced_split"): derived.ced_split})
    what = "; ".join(m for m, _ in misfits.values())
    if derived:
        raise ConfigError(f"{what} for model.n_layers={n}: use {derived.overrides()} (the "
                          f"plan at {n} layers) or set model.n_layers={written}")
    raise ConfigError(f"{what} for model.n_layers={n}: use "
                      + " and ".join(fix for _, fix in misfits.values()))


def _read_preset(path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    raw.setdefault("name", path.stem)
    return raw


def load(path, overrides=(), scale_schedule: bool = False) -> Config:
    """Load a YAML preset and apply ``key=value`` overrides (`scale_schedule`: from_dict)."""
    return from_dict(_read_preset(path), overrides, scale_schedule)


def load_scaled(path, overrides=()) -> tuple[Config, dict]:
    """The preset with `overrides` and its schedule scaled (`scale_schedule_of`), and what
    the scaling changed, as a run directory records it: {"preset_steps", "steps",
    "scaled": {"section.key": [the preset's value, the scaled one]}}; {} when it changed
    nothing (a run as long as the preset's, or every key set on the command line)."""
    raw = _read_preset(path)
    plain, cfg = from_dict(raw, overrides), from_dict(raw, overrides, scale_schedule=True)
    value = lambda c, sec, key: getattr(getattr(c, sec), key)  # noqa: E731
    scaled = {f"{sec}.{key}": [value(plain, sec, key), value(cfg, sec, key)]
              for sec, key in SCALED_STEPS
              if value(plain, sec, key) != value(cfg, sec, key)}
    if not scaled:
        return cfg, {}
    return cfg, {"preset_steps": _preset_steps(raw), "steps": cfg.train.steps, "scaled": scaled}


def loads(text: str, overrides=()) -> Config:
    return from_dict(yaml.safe_load(text) or {}, overrides)


# ----------------------------------------------------------------------------- resolution
def _resolve(cfg: Config) -> Config:
    """Expand per-layer lists to n_layers entries and compute per-layer ratios (plan.expand)."""
    layers, ratios = plan.expand(cfg)
    return dataclasses.replace(
        cfg, attention=dataclasses.replace(cfg.attention, layers=layers, ratios=ratios))


def _positive(value, key):
    if value < 1:
        raise ConfigError(f"{key}: must be >= 1, got {value}")


# Float checks are written so that NaN fails them too.
def _above_zero(value, key):
    if not 0 < value < math.inf:
        raise ConfigError(f"{key}: must be a finite number > 0, got {value}")


def _at_least_zero(value, key):
    if not 0 <= value < math.inf:
        raise ConfigError(f"{key}: must be a finite number >= 0, got {value}")


def _unit(value, key, closed: bool):
    """value in [0, 1] (closed) or [0, 1)."""
    if not (0 <= value <= 1 if closed else 0 <= value < 1):
        raise ConfigError(f"{key}: must be in [0, 1{']' if closed else ')'}, got {value}")


def _choice(value, allowed, key):
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of: {', '.join(allowed)}")


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first bad key, section by section (SECTION_CHECKS)."""
    for check in SECTION_CHECKS:
        check(cfg)


def _check_model(cfg: Config) -> None:
    m = cfg.model
    for key in ("vocab_size", "d_model", "n_layers", "ffn_hidden", "max_seq_len",
                "remat_block_from"):
        _positive(getattr(m, key), f"model.{key}")
    _above_zero(m.norm_eps, "model.norm_eps")
    _above_zero(m.init_std, "model.init_std")
    _choice(m.dtype, DTYPES, "model.dtype")
    _choice(m.param_dtype, DTYPES, "model.param_dtype")
    if m.remat not in ("none", "block") and not callable(
            getattr(jax.checkpoint_policies, m.remat, None)):
        raise ConfigError(f"model.remat: {m.remat!r} is not none, block or a "
                          f"jax.checkpoint_policies name")


def _check_attention(cfg: Config) -> None:
    m, a, ix = cfg.model, cfg.attention, cfg.indexer
    fams = plan.families(cfg)

    _positive(a.n_heads, "attention.n_heads")
    if a.n_kv_heads < 0:
        raise ConfigError(f"attention.n_kv_heads: must be >= 0 (0: n_heads), got {a.n_kv_heads}")
    _above_zero(a.rope_theta, "attention.rope_theta")
    _choice(a.rope_scaling, ("none", "yarn"), "attention.rope_scaling")
    if a.rope_scaling == "yarn":
        if not 1 <= a.yarn_factor < math.inf:
            raise ConfigError(f"attention.yarn_factor: must be >= 1, got {a.yarn_factor}")
        _positive(a.yarn_original_max_position, "attention.yarn_original_max_position")
        _above_zero(a.yarn_beta_slow, "attention.yarn_beta_slow")
        if a.yarn_beta_fast <= a.yarn_beta_slow:
            raise ConfigError(f"attention.yarn_beta_fast: must exceed yarn_beta_slow="
                              f"{a.yarn_beta_slow}, got {a.yarn_beta_fast}")
        _at_least_zero(a.yarn_mscale, "attention.yarn_mscale")
        _at_least_zero(a.yarn_mscale_all_dim, "attention.yarn_mscale_all_dim")
    if Family.MHA in fams:
        _positive(a.head_dim, "attention.head_dim")
        kv = a.n_kv_heads or a.n_heads
        if a.n_heads % kv:
            raise ConfigError(
                f"attention.n_kv_heads: {kv} must divide attention.n_heads={a.n_heads}"
            )
        if a.head_dim % 2:
            raise ConfigError(f"attention.head_dim: must be even for RoPE, got {a.head_dim}")
        if not 0 <= a.mha_rope_dim <= a.head_dim or a.mha_rope_dim % 2:
            raise ConfigError(f"attention.mha_rope_dim: must be even and in [0, head_dim="
                              f"{a.head_dim}] (0: all of it), got {a.mha_rope_dim}")
    if fams & {Family.MLA, Family.DSA}:
        for key in ("kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"):
            _positive(getattr(a, key), f"attention.{key}")
        if a.qk_rope_dim % 2:
            raise ConfigError(f"attention.qk_rope_dim: must be even, got {a.qk_rope_dim}")
    if a.q_lora_rank < 0:
        raise ConfigError(f"attention.q_lora_rank: must be >= 0, got {a.q_lora_rank}")
    if Family.V4 in fams:
        _positive(a.entry_dim, "attention.entry_dim")
        _positive(a.window, "attention.window")
        _positive(a.q_lora_rank, "attention.q_lora_rank")
        _positive(a.o_groups, "attention.o_groups")
        _positive(a.o_lora_rank, "attention.o_lora_rank")
        if a.n_heads % a.o_groups:
            raise ConfigError(
                f"attention.o_groups: {a.o_groups} must divide attention.n_heads={a.n_heads}"
            )
        if not 0 < a.rope_dim <= a.entry_dim or a.rope_dim % 2:
            raise ConfigError(
                f"attention.rope_dim: must be even and in (0, entry_dim={a.entry_dim}], "
                f"got {a.rope_dim}"
            )
        _above_zero(a.compress_rope_theta, "attention.compress_rope_theta")
    if a.ced_split < 0 or a.ced_split >= m.n_layers:
        raise ConfigError(
            f"attention.ced_split: must be 0 (off) or a layer index in 1..{m.n_layers - 1}, "
            f"got {a.ced_split}"
        )
    if a.pool_blocks < 0:
        raise ConfigError(f"attention.pool_blocks: must be >= 0, got {a.pool_blocks}")
    _positive(a.pool_block_size, "attention.pool_block_size")
    _positive(a.query_block, "attention.query_block")
    _positive(a.entry_block, "attention.entry_block")
    _positive(ix.key_block, "indexer.key_block")
    plan.check(cfg)
    _choice(a.impl, registry.names(registry.Op.ATTENTION), "attention.impl")


def _check_indexer(cfg: Config) -> None:
    a, ix = cfg.attention, cfg.indexer
    if any(s.kind.scans_keys for s in plan.resolve(cfg)):  # a layer scores keys
        for key in ("n_heads", "head_dim"):
            _positive(getattr(ix, key), f"indexer.{key}")
        _positive(a.top_k, "attention.top_k")
        if ix.rope_dim < 0 or ix.rope_dim > ix.head_dim or ix.rope_dim % 2:
            raise ConfigError(
                f"indexer.rope_dim: must be even and in [0, head_dim={ix.head_dim}], "
                f"got {ix.rope_dim}"
            )
        if rotates_keys(cfg) and ix.head_dim & (ix.head_dim - 1):
            raise ConfigError(
                f"indexer.hadamard: the rotation before {cfg.cache.key_format} keys needs a "
                f"power-of-two indexer.head_dim, got {ix.head_dim} (or set "
                f"indexer.hadamard=false)")
    _choice(ix.key_norm, KEY_NORMS, "indexer.key_norm")
    _choice(ix.impl, registry.names(registry.Op.INDEXER_SCORE), "indexer.impl")
    _choice(ix.topk_method, INDEXER_TOPK, "indexer.topk_method")
    if ix.dense_warmup_steps < 0:
        raise ConfigError("indexer.dense_warmup_steps: must be >= 0")
    _at_least_zero(ix.loss_weight, "indexer.loss_weight")


def rotates_keys(cfg: Config) -> bool:
    """Whether the indexer rotates its queries and keys (indexer.hadamard) before they meet:
    only where the keys are stored in FP8 or FP4, whose per-block scales an outlier channel
    would otherwise set."""
    return cfg.indexer.hadamard and bool(formats.spec(cfg.cache.key_format).elem)


def _check_cache(cfg: Config) -> None:
    c = cfg.cache
    for role in ("local_format", "main_format", "key_format"):
        _choice(getattr(c, role), tuple(formats.FORMATS), f"cache.{role}")
    _positive(c.page_size, "cache.page_size")
    formats.validate_roles(cfg)
    _check_kernels(cfg)


def _check_train(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    for key in ("batch_size", "seq_len", "steps", "eval_every", "eval_batches", "ckpt_every",
                "keep_checkpoints", "log_every", "grad_accum"):
        _positive(getattr(t, key), f"train.{key}")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.grad_accum: {t.grad_accum} must divide train.batch_size="
                          f"{t.batch_size} (each micro-batch has batch_size / grad_accum rows)")
    if t.seq_len > m.max_seq_len:  # the model's position limit (a huge one would only OOM)
        raise ConfigError(f"train.seq_len: {t.seq_len} exceeds model.max_seq_len="
                          f"{m.max_seq_len}")
    for key in ("warmup_steps", "seed"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}: must be >= 0, got {getattr(t, key)}")
    _above_zero(t.lr, "train.lr")
    # optax clips to this global norm: <= 0 zeroes or flips every update (no "off" value)
    _above_zero(t.grad_clip, "train.grad_clip")
    _at_least_zero(t.weight_decay, "train.weight_decay")
    _at_least_zero(t.peak_tflops, "train.peak_tflops")
    _unit(t.min_lr_ratio, "train.min_lr_ratio", closed=True)
    _unit(t.b1, "train.b1", closed=False)
    _unit(t.b2, "train.b2", closed=False)


def _check_data(cfg: Config) -> None:
    d = cfg.data
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction: must be in (0, 1), got {d.val_fraction}")
    if d.max_bytes < 0:
        raise ConfigError(f"data.max_bytes: must be >= 0, got {d.max_bytes}")


def _check_mesh(cfg: Config) -> None:
    """Sizes >= 1 or -1 (at most one); whether they fit the devices is checked when the mesh
    is built (sharding.make_mesh), since a config may be loaded on another machine."""
    sizes = dataclasses.asdict(cfg.mesh)
    for key, value in sizes.items():
        if value != -1 and value < 1:
            raise ConfigError(f"mesh.{key}: must be >= 1 or -1 (the rest), got {value}")
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError("mesh: at most one size may be -1, got "
                          + ", ".join(f"{k}={v}" for k, v in sizes.items()))


# validate's checks, in the order errors are reported (the attention section's layer plan
# before the indexer, which needs it).
SECTION_CHECKS = (_check_model, _check_attention, _check_indexer, _check_cache, _check_train,
                  _check_data, _check_mesh)


def _check_kernels(cfg: Config) -> None:
    """An explicitly chosen implementation must fit the config (registry: `auto` falls back
    to the reference where nothing fits)."""
    for op, name in ((registry.Op.ATTENTION, cfg.attention.impl),
                     (registry.Op.INDEXER_SCORE, cfg.indexer.impl)):
        misfit = registry.misfit(op, name, cfg)
        if misfit:
            raise ConfigError(misfit)
