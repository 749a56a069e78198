"""Deployed cache formats: byte layouts, and which role may use which format.

Each format stores one vector of width ``w`` whose last ``r`` dims carry RoPE. Byte counts
per vector follow seed 000 and REFERENCE.md §4:

    native               w * itemsize of the compute dtype (no rounding)
    bf16                 2w
    fp8_ds_mla           (w-r) FP8 + one FP32 scale per 128 of (w-r) + r BF16   (656 at 512+64)
    fp8_fp32             w FP8 + one FP32 scale per 128                         (132 at 128)
    fp8_ue8m0_rope_bf16  (w-r) FP8 + r BF16 + one UE8M0 per 64 of (w-r),
                         scale bytes padded to a multiple of 8                  (584 at 448+64)
    fp8_ue8m0            w FP8 + one UE8M0 per 32                               (528 at 512)
    fp4_ue8m0            w/2 (E2M1 packed) + one UE8M0 per 32                   (68 at 128)
    fp4_e4m3             w/2 (E2M1 packed) + one E4M3 per 16                    (288 at 512)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsattn.config import ConfigError


@dataclass(frozen=True)
class FormatSpec:
    name: str
    block: int  # channels per scale (0: no scale)
    needs_rope_split: bool  # keeps the last r dims apart (in BF16)


FORMATS = {
    "native": FormatSpec("native", 0, False),
    "bf16": FormatSpec("bf16", 0, False),
    "fp8_ds_mla": FormatSpec("fp8_ds_mla", 128, True),
    "fp8_fp32": FormatSpec("fp8_fp32", 128, False),
    "fp8_ue8m0_rope_bf16": FormatSpec("fp8_ue8m0_rope_bf16", 64, True),
    "fp8_ue8m0": FormatSpec("fp8_ue8m0", 32, False),
    "fp4_ue8m0": FormatSpec("fp4_ue8m0", 32, False),
    "fp4_e4m3": FormatSpec("fp4_e4m3", 16, False),
}

_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def bytes_per_vector(fmt: str, width: int, rope: int = 0, native_dtype: str = "float32") -> float:
    """Bytes one stored vector of ``width`` dims (last ``rope`` of them rotary) takes."""
    w, r = width, rope
    if fmt == "native":
        return w * _ITEMSIZE[native_dtype]
    if fmt == "bf16":
        return 2 * w
    if fmt == "fp8_ds_mla":
        return (w - r) + 4 * ((w - r) // 128) + 2 * r
    if fmt == "fp8_fp32":
        return w + 4 * (w // 128)
    if fmt == "fp8_ue8m0_rope_bf16":
        return (w - r) + 2 * r + 8 * math.ceil(((w - r) // 64) / 8)
    if fmt == "fp8_ue8m0":
        return w + w // 32
    if fmt == "fp4_ue8m0":
        return w // 2 + w // 32
    if fmt == "fp4_e4m3":
        return w // 2 + w // 16
    raise ConfigError(f"unknown cache format {fmt!r}; allowed: {', '.join(FORMATS)}")


def check_width(fmt: str, width: int, rope: int, key: str) -> None:
    """Raise a ConfigError naming ``key`` if ``fmt`` cannot store this vector shape."""
    if fmt not in FORMATS:
        raise ConfigError(f"{key}: unknown cache format {fmt!r}; allowed: {', '.join(FORMATS)}")
    spec = FORMATS[fmt]
    if spec.needs_rope_split and rope <= 0:
        raise ConfigError(
            f"{key}: format {fmt!r} keeps the rotary dims in BF16 and needs a vector with "
            f"rotary dims; this role has none"
        )
    quantized = width - rope if spec.needs_rope_split else width
    if spec.block and quantized % spec.block:
        raise ConfigError(
            f"{key}: format {fmt!r} uses one scale per {spec.block} channels, but the "
            f"quantized width is {quantized} (not divisible by {spec.block})"
        )
    if fmt.startswith("fp4") and width % 2:
        raise ConfigError(f"{key}: format {fmt!r} packs two values per byte; width {width} is odd")


def role_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(width, rope dims) of the vector each cache role stores, for the kinds in ``cfg``."""
    a, ix = cfg.attention, cfg.indexer
    kinds = set(cfg.attention.layers)
    shapes: dict[str, list[tuple[int, int]]] = {"local_format": [], "main_format": [],
                                                 "key_format": []}
    if "mha" in kinds:
        shapes["main_format"].append((a.head_dim, 0))
    if kinds & {"mla", "dsa"}:
        shapes["main_format"].append((a.kv_lora_rank + a.qk_rope_dim, a.qk_rope_dim))
    if "dsa" in kinds:
        shapes["key_format"].append((ix.head_dim, ix.rope_dim))
    v4 = {"swa", "hca", "csa", "full", "reindex", "reuse"}
    if kinds & v4:
        shapes["local_format"].append((a.head_dim, a.rope_dim))
    if kinds & {"hca", "csa", "full", "reindex", "reuse"}:
        shapes["main_format"].append((a.head_dim, a.rope_dim))
    if kinds & {"csa", "full", "reindex"}:
        shapes["key_format"].append((ix.head_dim, ix.rope_dim))
    return shapes


def validate_roles(cfg) -> None:
    """Every role's format must fit every vector shape it will store."""
    for role, shapes in role_shapes(cfg).items():
        fmt = getattr(cfg.cache, role)
        for width, rope in shapes:
            check_width(fmt, width, rope, f"cache.{role}")
