"""Every implementation of an operation that has more than one (an attention read, the
indexer's score pass over the paged cache), with what each needs: the platforms it runs
compiled on, the cache formats it reads, and its fit checks on a config. Config validation,
the layers, the indexer and the benchmarks read this table instead of spelling names.

An entry names its function as "module:attribute", imported when first called, so loading a
config imports no Pallas code. `resolve(op, cfg)` turns the configured name into a `Choice`:
what runs on each platform a program may be lowered for. `auto` is, per platform, the first
entry in table order that runs compiled there, reads the configured format and fits the
config, and the reference (last, always fitting) elsewhere; `dispatch` traces each distinct
entry once and lowers only the platform's (`jax.lax.platform_dependent`), so a program built
on a CPU host for a GPU or TPU takes that chip's kernels, never the host's choice. A named
entry is taken on every platform once it exists, reads the format and fits (a kernel runs
interpreted where the program is lowered for a CPU: kernels/platform.py). A kernel plugs in
as one `register` call (docs/design.md, "Attention reads").
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import Any, Callable

import jax

AUTO = "auto"


class Op(enum.Enum):
    """An operation with implementations, and the config key that names its choice."""

    ATTENTION = "attention.impl"  # attend.Read -> (output, (KL loss, recall terms) or None)
    INDEXER_SCORE = "indexer.impl"  # scores of indexer queries over a paged cache's keys


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of `op`. ``target``: "module:attribute" of its function (None:
    the op's inline reference path). ``platforms``: jax's lowering platforms it runs
    compiled on ("cuda", "rocm", "tpu", "cpu"; empty: every). ``formats``: cache formats it
    reads, or "module:attribute" of that tuple (None: every). ``misfit(cfg)``: why it
    cannot run a config (a message naming the key) or None."""

    op: Op
    name: str
    target: str | None
    platforms: tuple[str, ...] = ()
    formats: tuple[str, ...] | str | None = None
    misfit: Callable | None = None
    reference: bool = False

    def reads(self, fmt: str) -> bool:
        return self.formats is None or fmt in self.supported_formats()

    def supported_formats(self) -> tuple[str, ...]:
        return _resolve(self.formats) if isinstance(self.formats, str) else self.formats

    def runs_on(self, platform: str) -> bool:
        """Whether it runs compiled on `platform` (jax's lowering platform, or a backend name:
        "gpu" is CUDA's)."""
        return not self.platforms or _PLATFORM.get(platform, platform) in self.platforms

    def why_not(self, cfg) -> str | None:
        return self.misfit(cfg) if self.misfit is not None else None


_PLATFORM = {"gpu": "cuda"}  # jax.default_backend()'s name -> the lowering platform's

_TABLE: dict[Op, dict[str, Implementation]] = {op: {} for op in Op}


@dataclasses.dataclass(frozen=True)
class Choice:
    """What an op runs as in a program lowered for each platform: ``platforms`` pairs
    (platform, entry name); every other platform runs ``default``."""

    default: str
    platforms: tuple[tuple[str, str], ...] = ()

    def on(self, platform: str) -> str:
        """The entry a program lowered for `platform` runs."""
        return dict(self.platforms).get(_PLATFORM.get(platform, platform), self.default)

    def names(self) -> tuple[str, ...]:
        """Every entry the choice may run, each once."""
        return tuple(dict.fromkeys([n for _, n in self.platforms] + [self.default]))


def dispatch(choice: Choice, run: Callable[[str], Any]):
    """`run(name)` for the entry the lowering platform takes: each distinct entry is traced
    once, and only the lowering platform's is lowered and compiled."""
    if len(choice.names()) == 1:
        return run(choice.default)
    return jax.lax.platform_dependent(default=lambda: run(choice.default),
                                      **{p: (lambda n=n: run(n)) for p, n in choice.platforms})


def register(impl: Implementation) -> Implementation:
    """Add `impl` ahead of the reference, so `auto` prefers it where it runs and fits."""
    if impl.name == AUTO or impl.name in _TABLE[impl.op]:
        raise ValueError(f"{impl.op.value}: {impl.name!r} is already registered")
    entries = dict(_TABLE[impl.op])
    refs = {n: e for n, e in entries.items() if e.reference}
    _TABLE[impl.op] = {**{n: e for n, e in entries.items() if not e.reference},
                       impl.name: impl, **refs}
    return impl


def unregister(op: Op, name: str) -> None:
    entry = get(op, name)
    if entry.reference:
        raise ValueError(f"{op.value}: the reference {name!r} cannot be removed")
    del _TABLE[op][name]


def names(op: Op) -> tuple[str, ...]:
    """What the config key may say: `auto` and every registered name."""
    return (AUTO, *_TABLE[op])


def get(op: Op, name: str) -> Implementation:
    try:
        return _TABLE[op][name]
    except KeyError:
        raise KeyError(f"{op.value}={name!r} is not registered; registered: "
                       f"{', '.join(names(op))}") from None


def kernels(op: Op) -> tuple[str, ...]:
    """The names of `op`'s implementations other than its reference."""
    return tuple(n for n, e in _TABLE[op].items() if not e.reference)


def reference(op: Op) -> str:
    return next(n for n, e in _TABLE[op].items() if e.reference)


def misfit(op: Op, name: str, cfg) -> str | None:
    """Why the configured `name` cannot run `cfg` (None: it can, or `auto`): not registered,
    or its fit check fails. Config validation raises it; formats are checked by `resolve`."""
    if name == AUTO:
        return None
    if name not in _TABLE[op]:
        return (f"{op.value}: {name!r} is not registered; registered: "
                f"{', '.join(names(op))}")
    return get(op, name).why_not(cfg)


def resolve(op: Op, cfg, name: str, fmt: str | None = None,
            fmt_key: str = "format") -> Choice:
    """What `name` (the config's value) runs as, for data in cache format `fmt` (the config's
    `fmt_key`): `auto` per platform (module docstring), a named entry everywhere. Raises for a
    named one that cannot read `fmt` (NotImplementedError) or does not fit (ValueError)."""
    if name == AUTO:
        chosen: dict[str, str] = {}
        for n, e in _TABLE[op].items():
            if e.reference or (fmt is not None and not e.reads(fmt)) or e.why_not(cfg):
                continue
            for platform in e.platforms:
                chosen.setdefault(platform, n)
        return Choice(reference(op), tuple(chosen.items()))
    entry = get(op, name)
    if fmt is not None and not entry.reads(fmt):
        raise NotImplementedError(f"{op.value}={name}: it reads data stored as "
                                  f"{', '.join(entry.supported_formats())}, not "
                                  f"{fmt_key}={fmt!r}")
    why = entry.why_not(cfg)
    if why:
        raise ValueError(why)
    return Choice(name)


def load(op: Op, name: str) -> Callable | None:
    """The function of implementation `name` (None for an inline reference path)."""
    entry = get(op, name)
    return None if entry.target is None else _resolve(entry.target)


def _resolve(ref: str):
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


# -- the indexer's score pass ---------------------------------------------------------------
def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def _indexer_kernel_misfit(impl: str):
    """The Pallas score kernels' fit: the pool's block maxima tile pages exactly, Triton
    tiles are powers of two and it loads native/bf16 keys whole."""
    def misfit(cfg) -> str | None:
        from dsattn import plan
        from dsattn.cache import formats

        a, ix, c = cfg.attention, cfg.indexer, cfg.cache
        specs = plan.resolve(cfg)
        if any(s.builds_pool for s in specs):
            if c.page_size % a.pool_block_size:
                return (f"attention.pool_block_size: {a.pool_block_size} must divide "
                        f"cache.page_size={c.page_size} for indexer.impl={impl}")
            if impl == "pallas_gpu" and not _pow2(a.pool_block_size):
                return (f"attention.pool_block_size: {a.pool_block_size} must be a power of "
                        f"two for indexer.impl=pallas_gpu")
        indexed = any(s.kind.scans_keys for s in specs)
        if (indexed and impl == "pallas_gpu" and not formats.spec(c.key_format).block
                and (ix.head_dim < 16 or not _pow2(ix.head_dim))):
            return (f"indexer.head_dim: {ix.head_dim} must be a power of two >= 16 for "
                    f"indexer.impl=pallas_gpu with cache.key_format={c.key_format}")
        return None
    return misfit


_KEY_FORMATS = "dsattn.kernels.indexer_score:KERNEL_FORMATS"
register(Implementation(Op.INDEXER_SCORE, "xla", None, reference=True))
register(Implementation(Op.INDEXER_SCORE, "pallas_tpu",
                        "dsattn.kernels.indexer_score:paged_scores_tpu", ("tpu",),
                        _KEY_FORMATS, _indexer_kernel_misfit("pallas_tpu")))
register(Implementation(Op.INDEXER_SCORE, "pallas_gpu",
                        "dsattn.kernels.indexer_score_gpu:paged_scores_gpu", ("cuda",),
                        _KEY_FORMATS, _indexer_kernel_misfit("pallas_gpu")))

# -- attention reads ------------------------------------------------------------------------
def _fused_reads_misfit(cfg) -> str | None:
    """Why the kernels cannot run `cfg`'s reads (None: they can). The dense kernel reads a
    head dim in power-of-two pieces of at least 16 (Triton tiles), so every head dim it
    sees must be a multiple of 16; the selected-entries kernel pads its own."""
    from dsattn import plan

    a = cfg.attention
    dims = {}  # the config keys that set a dense read's (dk, dv), per family
    for spec in plan.resolve(cfg):
        family = spec.kind.family
        if family is plan.Family.MHA:
            dims["attention.head_dim"] = (a.head_dim,)
        elif family is plan.Family.V4:
            dims["attention.entry_dim"] = (a.entry_dim,)
        else:  # MLA and DSA: the absorbed read (cached; DSA's dense warm-up) of the latents
            dims["attention.kv_lora_rank + attention.qk_rope_dim"] = (
                a.kv_lora_rank + a.qk_rope_dim, a.kv_lora_rank)
            if family is plan.Family.MLA:  # the training forward's expanded heads
                dims["attention.qk_nope_dim + attention.qk_rope_dim"] = (
                    a.qk_nope_dim + a.qk_rope_dim,)
                dims["attention.v_head_dim"] = (a.v_head_dim,)
    for key, values in dims.items():
        if any(d % 16 for d in values):
            return (f"{key}: {', '.join(map(str, values))} must be multiples of 16 for "
                    f"attention.impl=pallas_gpu (Triton tiles)")
    return _shared_memory_misfit(cfg)


def _shared_memory_misfit(cfg) -> str | None:
    """Why the kernels' smallest tiles would not fit the GPU's shared memory (the program's
    target, else the smallest GPU target: dsattn.targets), or None. The selected-entries
    kernel holds every head of a query at once, so many heads over wide entries do not fit."""
    from dsattn import plan, targets
    from dsattn.kernels import dense_attention, sparse_attention

    a, limit = cfg.attention, targets.shared_memory()
    for spec in plan.resolve(cfg):
        family, picks = spec.kind.family, spec.kind.selector in (plan.Selector.INDEXER,
                                                                 plan.Selector.REUSE)
        if family is plan.Family.MHA:
            channels = 2 * a.head_dim
        elif family is plan.Family.V4:
            channels = 2 * a.entry_dim
        else:
            channels = 2 * a.kv_lora_rank + a.qk_rope_dim
        need = dense_attention.smem_bytes(channels, 16, 16, 1)
        if need > limit:
            return (f"attention.impl=pallas_gpu: the dense kernel's smallest programs need "
                    f"{need // 1024} KiB of shared memory at dk + dv = {channels}, more than "
                    f"the GPU's {limit // 1024} KiB")
        if picks and family in (plan.Family.V4, plan.Family.DSA):
            width, value = ((a.entry_dim, None) if family is plan.Family.V4 else
                            (a.kv_lora_rank + a.qk_rope_dim, a.kv_lora_rank))
            need = sparse_attention.smem_bytes(a.n_heads, width, value, 16, 1)
            if need > limit:
                return (f"attention.n_heads={a.n_heads} over {width}-wide entries: the "
                        f"selected-entries kernel holds every head of a query in one program "
                        f"and needs {need // 1024} KiB of shared memory at 16 picks a step, "
                        f"more than the GPU's {limit // 1024} KiB (attention.impl=pallas_gpu)")
    return None


register(Implementation(Op.ATTENTION, "xla", "dsattn.attention.reference:run",
                        reference=True))
register(Implementation(Op.ATTENTION, "pallas_gpu", "dsattn.kernels.pallas_reads:run",
                        ("cuda",), misfit=_fused_reads_misfit))
