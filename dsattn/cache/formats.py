"""Deployed cache formats: byte layouts, encode/decode, and which role may use which format.

Each format stores one vector of width ``w`` whose last ``r`` dims carry RoPE. Byte counts
per vector (docs/design.md, "Caches"; tests/test_formats.py and tests/test_kvbytes.py check them):

    native               w * itemsize of the compute dtype (no rounding)
    bf16                 2w
    fp8_ds_mla           (w-r) FP8 + one FP32 scale per 128 of (w-r) + r BF16   (656 at 512+64)
    fp8_fp32             w FP8 + one FP32 scale per 128                         (132 at 128)
    fp8_ue8m0_rope_bf16  (w-r) FP8 + r BF16 + one UE8M0 per 64 of (w-r),
                         scale bytes padded to a multiple of 8                  (584 at 448+64)
    fp8_ue8m0            w FP8 + one UE8M0 per 32                               (528 at 512)
    fp4_ue8m0            w/2 (E2M1 packed) + one UE8M0 per 32                   (68 at 128)
    fp4_e4m3             w/2 (E2M1 packed) + one E4M3 per 16                    (288 at 512)

Stored arrays (``encode`` output; leading dims are whatever the input had). Floats narrower
than 32 bits are kept as unsigned integers of their width holding the same bytes (bf16 as
uint16, e4m3/e8m0 as uint8; ``as_floats`` views them as floats; ``native`` keeps the compute
dtype), so caches scatter and gather them as integers:

    native               {"v": x}
    bf16                 {"v": bf16 [..., w]}
    fp8_ds_mla           {"q": e4m3 [..., w-r], "scale": f32 [..., (w-r)/128],
                          "rope": bf16 [..., r]}
    fp8_fp32             {"q": e4m3 [..., w],   "scale": f32 [..., w/128]}
    fp8_ue8m0_rope_bf16  {"q": e4m3 [..., w-r], "scale": e8m0 [..., ceil((w-r)/64 / 8)*8],
                          "rope": bf16 [..., r]}            (trailing pad scale bytes are 0x00)
    fp8_ue8m0            {"q": e4m3 [..., w],   "scale": e8m0 [..., w/32]}
    fp4_ue8m0            {"q": uint8 [..., w/2], "scale": e8m0 [..., w/32]}
    fp4_e4m3             {"q": uint8 [..., w/2], "scale": e4m3 [..., w/16]}

e4m3 = ``jnp.float8_e4m3fn``, e8m0 = ``jnp.float8_e8m0fnu`` (one byte = the biased exponent,
value 2^(byte-127)). FP4 bytes hold two E2M1 codes, the EVEN index in the LOW nibble
(sglang V41_FP4 layout). The summed ``nbytes`` per vector equals ``bytes_per_vector``.

Quantization (after ``act_quant`` in DeepSeek-V3.2-Exp's inference/kernel.py; the V4-family
formats as implemented here), per scale block, in float32:
    amax = max(max|x|, floor)        floor 1e-4 (FP8), 6·2^-126 (FP4/UE8M0), 6·2^-9 (FP4/E4M3)
    s    = amax / qmax               qmax 448 (E4M3) or 6 (E2M1)
    UE8M0 and both FP32-scale FP8 formats: s = 2^ceil(log2 s) (V3.2 runs act_quant with
    scale_fmt="ue8m0"; FlashMLA's 656 B layout stores those power-of-two scales as FP32).
    E4M3 scale (NVFP4-like): s clamped to ≤ 448, rounded to E4M3, bumped one E4M3 step up when
    rounding went below s, so 6·s >= amax and nothing is clipped.
    q = round_to_nearest_even(clip(x / s, ±qmax)) in E4M3 / E2M1.
Representable block ranges without saturation: fp4_e4m3 needs block amax <= 6·448 = 2688 (no
per-tensor scale in the 288 B layout); below 6·2^-9 the scale floor limits resolution.

All functions are pure jnp, traceable under jit (format names and rope widths are static).
They avoid float4/e8m0 value conversions: E2M1 codes and E8M0 bytes are computed with integer
and float32 arithmetic (bit-identical to ``astype(float4_e2m1fn)`` / ``astype(float8_e8m0fnu)``,
checked in tests/test_formats.py), so a backend only needs E4M3 casts and same-width bitcasts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dsattn import plan
from dsattn.errors import ConfigError


@dataclass(frozen=True)
class Element:
    """How a quantized format stores its values: bits each, the largest magnitude, and the
    codec (float32 values already divided by their scale <-> stored items)."""
    bits: int
    qmax: float
    dtype: object  # the float its stored bits are (None: packed codes, kept as uint8)
    encode: Callable[[jax.Array], jax.Array]  # float32 [..., n] -> stored [..., n * bits / 8]
    decode: Callable[[jax.Array], jax.Array]  # stored (as floats) -> float32 [..., n]

    @property
    def per_item(self) -> int:
        """Values per stored item (2: E2M1 codes packed two per byte)."""
        return 8 // self.bits


@dataclass(frozen=True)
class ScaleType:
    """How a quantized format stores its per-block scales."""
    nbytes: int
    dtype: object  # the float its stored bits are (None: float32, stored as it is)
    # float32 scales s -> (stored scales, the scales the values are divided by)
    store: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
    # stored scales (their floats, or their uint8 bytes) -> float32: a kernel's dequantization
    to_f32: Callable[[jax.Array], jax.Array]
    kernel_bytes: bool = False  # the kernels take them as their uint8 bytes (a bitcast)


@dataclass(frozen=True)
class FormatSpec:
    """One cache format: its layout (the fields), and so its bytes per vector, its encode and
    decode (module functions of the same names take its name) and what the indexer kernels
    read of it (`kernel`; `block`, `element` and `scale_type` are how they dequantize)."""
    name: str
    block: int  # channels per scale (0: no scale)
    needs_rope_split: bool  # keeps the last r dims apart (in BF16)
    elem: str = ""  # "": not quantized; "fp8": E4M3; "fp4": E2M1 packed two per byte
    scale: str = ""  # stored scale type: "f32", "ue8m0" or "e4m3"
    pow2: bool = False  # scale rounded up to a power of two
    amax_floor: float = 0.0  # lower clamp on the block amax
    scale_align: int = 1  # number of stored scales padded up to a multiple of this
    # Not quantized: the float its values are stored in (None: the compute dtype as it is)
    value_dtype: object = None
    kernel: bool = False  # the indexer score kernels read it (dsattn.kernels.indexer_score)

    @property
    def element(self) -> Element | None:
        return ELEMENTS.get(self.elem)

    @property
    def scale_type(self) -> ScaleType | None:
        return SCALE_TYPES.get(self.scale)

    @property
    def exact(self) -> bool:
        """Stores the compute dtype as it is: decode(encode(x)) is x."""
        return not self.block and self.value_dtype is None

    @property
    def per_item(self) -> int:
        """Values per stored item of its values array."""
        return self.element.per_item if self.element else 1

    def bytes_per_vector(self, width: int, rope: int = 0, native_dtype="float32") -> int:
        """Bytes one stored vector of ``width`` dims (last ``rope`` of them rotary) takes."""
        if not self.block:
            return width * _itemsize(native_dtype if self.value_dtype is None
                                     else self.value_dtype)
        rope = rope if self.needs_rope_split else 0  # rotary dims kept in BF16
        body = width - rope
        n_scales = -(-(body // self.block) // self.scale_align) * self.scale_align
        return (body * self.element.bits // 8 + n_scales * self.scale_type.nbytes
                + 2 * rope)


E4M3_MAX = 448.0
E2M1_MAX = 6.0

_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def _itemsize(dtype) -> int:
    if isinstance(dtype, str) and dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    return np.dtype(jnp.dtype(dtype)).itemsize


def spec(fmt: str) -> FormatSpec:
    """The FormatSpec of ``fmt``; ConfigError for an unknown name."""
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown cache format {fmt!r}; allowed: {', '.join(FORMATS)}") from None


def bytes_per_vector(fmt: str, width: int, rope: int = 0, native_dtype="float32") -> int:
    """Bytes one stored vector of ``width`` dims (last ``rope`` of them rotary) takes in
    ``fmt`` (its FormatSpec's)."""
    return spec(fmt).bytes_per_vector(width, rope, native_dtype)


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
    if width % spec.per_item:
        raise ConfigError(f"{key}: format {fmt!r} packs two values per byte; width {width} is odd")


def validate_roles(cfg) -> None:
    """Every role's format must fit every vector shape the layer plan stores in it."""
    for role, shapes in plan.role_shapes(cfg).items():
        fmt = getattr(cfg.cache, role.format_key)
        for width, rope in shapes:
            check_width(fmt, width, rope, f"cache.{role.format_key}")


# ---------------------------------------------------------------------------------------------
# Element and scale codecs (pure jnp, float32 in / out)


def e2m1_codes(y: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (uint8 0..15) of float32 ``y`` (|y| <= 6), round-to-nearest-even.

    E2M1 magnitudes are 0, .5, 1, 1.5 (step .5 below 2), 2, 3 (step 1 below 4), 4, 6 (step 2),
    codes 0..7 in that order, bit 3 = sign. Rounding |y|/step with round-half-even picks the
    code of even mantissa on ties, which is what a float4_e2m1fn cast does. NaN is undefined.
    """
    a = jnp.abs(y)
    k = jnp.where(a < 2.0, jnp.round(a * 2.0),
                  jnp.where(a < 4.0, jnp.round(a) + 2.0, jnp.round(a * 0.5) + 4.0))
    k = jnp.minimum(k, 7.0).astype(jnp.uint8)
    sign = jnp.signbit(y).astype(jnp.uint8)
    return k | (sign << 3)


def e2m1_values(codes: jax.Array) -> jax.Array:
    """float32 values of 4-bit E2M1 codes (any integer dtype, low 4 bits used)."""
    c = codes.astype(jnp.int32)
    e = (c >> 1) & 3
    m = (c & 1).astype(jnp.float32)
    pow2e = jnp.left_shift(1, e).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (2.0 + m) * pow2e * 0.25)
    return jnp.where((c & 8) != 0, -mag, mag)


def pack_fp4(codes: jax.Array) -> jax.Array:
    """[..., 2n] codes -> [..., n] uint8; element 2i in the low nibble, 2i+1 in the high."""
    c = codes.astype(jnp.uint8).reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
    return (c[..., 0] & 0xF) | ((c[..., 1] & 0xF) << 4)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """[..., n] uint8 -> [..., 2n] uint8 codes (inverse of pack_fp4)."""
    lo = packed & 0xF
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def _ceil_pow2(s: jax.Array) -> jax.Array:
    """2^ceil(log2 s) for positive normal float32 ``s``, exact (bit arithmetic, no log2)."""
    bits = jax.lax.bitcast_convert_type(s, jnp.uint32)
    exp = bits >> 23
    exp = exp + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(exp << 23, jnp.float32)


def pow2_to_e8m0(s: jax.Array) -> jax.Array:
    """Positive power-of-two float32 -> float8_e8m0fnu (byte = float32 biased exponent)."""
    byte = (jax.lax.bitcast_convert_type(s, jnp.uint32) >> 23).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(byte, jnp.float8_e8m0fnu)


def e8m0_to_f32(e: jax.Array) -> jax.Array:
    """float8_e8m0fnu (or its uint8 byte) -> float32 2^(byte-127).

    Byte 0 (2^-127, below float32's normal range; only padding and empty slots hold it) decodes
    to 0.0 and 0xFF (NaN) to inf; quantization never produces either.
    """
    if e.dtype != jnp.uint8:
        e = jax.lax.bitcast_convert_type(e, jnp.uint8)
    return jax.lax.bitcast_convert_type(e.astype(jnp.uint32) << 23, jnp.float32)


def _e4m3_round_up(s: jax.Array) -> jax.Array:
    """Smallest E4M3 value >= s for 0 < s <= 448 (float32 in, float8_e4m3fn out)."""
    c = s.astype(jnp.float8_e4m3fn)
    bits = jax.lax.bitcast_convert_type(c, jnp.uint8)
    up = jax.lax.bitcast_convert_type(bits + jnp.uint8(1), jnp.float8_e4m3fn)
    return jnp.where(c.astype(jnp.float32) < s, up, c)


def _blocked(x: jax.Array, block: int) -> jax.Array:
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _zero_bytes(shape, dtype) -> jax.Array:
    """An array of `dtype` whose every byte is 0x00 (E8M0 has no 0.0 to fill with)."""
    dtype = jnp.dtype(dtype)
    return jax.lax.bitcast_convert_type(jnp.zeros(shape, f"uint{8 * dtype.itemsize}"), dtype)


def _quantize(sp: FormatSpec, x: jax.Array) -> dict[str, jax.Array]:
    """Block-quantize float32 ``x`` [..., n] -> {"q", "scale"} as stored by ``sp``."""
    elem, scale = sp.element, sp.scale_type
    xb = _blocked(x, sp.block)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), jnp.float32(sp.amax_floor))
    s = amax / elem.qmax
    if sp.pow2:
        s = _ceil_pow2(s)
    stored_scale, s = scale.store(s)
    pad = -stored_scale.shape[-1] % sp.scale_align
    if pad:
        stored_scale = jnp.concatenate(
            [stored_scale, _zero_bytes(stored_scale.shape[:-1] + (pad,), stored_scale.dtype)], -1)
    y = jnp.clip(xb / s[..., None], -elem.qmax, elem.qmax).reshape(x.shape)
    return {"q": elem.encode(y), "scale": stored_scale}


def _e4m3_scale(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NVFP4-like E4M3 scales: clamped to 448 and rounded up, so nothing is clipped."""
    stored = _e4m3_round_up(jnp.minimum(s, E4M3_MAX))
    return stored, stored.astype(jnp.float32)


ELEMENTS = {  # FormatSpec.elem -> how its values are stored
    "fp8": Element(8, E4M3_MAX, jnp.float8_e4m3fn, lambda y: y.astype(jnp.float8_e4m3fn),
                   lambda q: q.astype(jnp.float32)),
    "fp4": Element(4, E2M1_MAX, None, lambda y: pack_fp4(e2m1_codes(y)),
                   lambda q: e2m1_values(unpack_fp4(q))),
}
SCALE_TYPES = {  # FormatSpec.scale -> how its scales are stored
    "f32": ScaleType(4, None, lambda s: (s, s), lambda a: a.astype(jnp.float32)),
    "ue8m0": ScaleType(1, jnp.float8_e8m0fnu, lambda s: (pow2_to_e8m0(s), s), e8m0_to_f32,
                       kernel_bytes=True),
    "e4m3": ScaleType(1, jnp.float8_e4m3fn, _e4m3_scale, lambda a: a.astype(jnp.float32)),
}
FORMATS = {  # every cache format; the module docstring has their bytes and stored arrays
    "native": FormatSpec("native", 0, False, kernel=True),
    "bf16": FormatSpec("bf16", 0, False, value_dtype=jnp.bfloat16, kernel=True),
    "fp8_ds_mla": FormatSpec("fp8_ds_mla", 128, True, "fp8", "f32", True, 1e-4),
    "fp8_fp32": FormatSpec("fp8_fp32", 128, False, "fp8", "f32", True, 1e-4, kernel=True),
    "fp8_ue8m0_rope_bf16": FormatSpec("fp8_ue8m0_rope_bf16", 64, True, "fp8", "ue8m0", True,
                                      1e-4, 8),
    "fp8_ue8m0": FormatSpec("fp8_ue8m0", 32, False, "fp8", "ue8m0", True, 1e-4, kernel=True),
    "fp4_ue8m0": FormatSpec("fp4_ue8m0", 32, False, "fp4", "ue8m0", True, 6 * 2.0**-126,
                            kernel=True),
    "fp4_e4m3": FormatSpec("fp4_e4m3", 16, False, "fp4", "e4m3", False, 6 * 2.0**-9),
}


# ---------------------------------------------------------------------------------------------
# Public API


def encode(fmt: str, x, rope: int = 0) -> dict[str, jax.Array]:
    """Store ``x`` [..., w] (last ``rope`` dims rotary) in format ``fmt``.

    Returns the dict of stored arrays (see the module docstring). Quantization math runs in
    float32 whatever the input dtype (float64 is rounded to float32 first); rotary dims of
    *_rope formats are rounded to BF16.
    ``rope`` only matters for formats that keep the rotary dims apart.
    """
    sp = spec(fmt)
    x = jnp.asarray(x)
    w = x.shape[-1]
    check_width(fmt, w, rope, "encode")
    if sp.exact:  # the compute dtype as it is (its bits would not say which float)
        return {"v": x}
    x = x.astype(jnp.float32)  # float64 inputs are handled exactly like their float32 rounding
    if not sp.block:
        return {"v": _as_bits(x.astype(sp.value_dtype))}
    out = {}
    body = x
    if sp.needs_rope_split:
        body = x[..., : w - rope]
        out["rope"] = x[..., w - rope:].astype(jnp.bfloat16)
    out.update(_quantize(sp, body))
    return {k: _as_bits(v) for k, v in out.items()}


def _as_bits(a):
    """Floats narrower than 32 bits as unsigned integers of their width (same bytes). Caches
    store these: XLA:CPU can neither scatter nor gather BF16/FP8 and converted a whole
    stored array to a wider float and back around every write and read (V4-Flash's FP8
    pages: 9.4 GB of a 4096-token prefill's temporaries); integers it moves in place."""
    if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4:
        return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))
    return a


def as_floats(fmt: str, stored: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Stored arrays with their bits (``encode``'s output) viewed as the format's floats:
    e4m3 values, e8m0 or e4m3 scales, bf16 rotary dims or values (same-width bitcasts)."""
    sp = spec(fmt)
    kinds = {"q": sp.element.dtype if sp.element else None,
             "scale": sp.scale_type.dtype if sp.scale_type else None,
             "rope": jnp.bfloat16, "v": sp.value_dtype}
    out = {}
    for k, a in stored.items():
        want = kinds.get(k)
        unsigned = jnp.issubdtype(a.dtype, jnp.unsignedinteger)
        if want is not None and unsigned and jnp.dtype(want).itemsize == a.dtype.itemsize:
            a = jax.lax.bitcast_convert_type(a, want)
        out[k] = a
    return out


def block_scales(fmt: str, stored: dict[str, jax.Array]) -> jax.Array:
    """Per-block dequantization scales as float32 [..., n_blocks] (padding dropped)."""
    sp = spec(fmt)
    if not sp.block:
        raise ConfigError(f"cache format {fmt!r} has no scales")
    n_blocks = stored["q"].shape[-1] * sp.per_item // sp.block
    sc = as_floats(fmt, {"scale": stored["scale"]})["scale"][..., :n_blocks]
    return sp.scale_type.to_f32(sc)


def decode(fmt: str, stored: dict[str, jax.Array], dtype=jnp.float32) -> jax.Array:
    """Stored arrays of ``fmt`` -> values [..., w] in ``dtype`` (rotary dims last)."""
    sp = spec(fmt)
    dtype = jnp.dtype(dtype)
    stored = as_floats(fmt, stored)
    if not sp.block:
        return stored["v"].astype(dtype)
    vals = sp.element.decode(stored["q"])
    s = block_scales(fmt, stored)
    vals = (_blocked(vals, sp.block) * s[..., None]).reshape(vals.shape)
    if sp.needs_rope_split:
        vals = jnp.concatenate([vals, stored["rope"].astype(jnp.float32)], axis=-1)
    return vals.astype(dtype)


def quantize_dequantize(fmt: str, x: jax.Array, rope: int = 0) -> jax.Array:
    """decode(encode(x)) in x.dtype with a straight-through gradient (fake quant).

    The forward value is exactly decode(encode(x)) (written as sg(qdq) + (x - sg(x)), where
    x - x is exactly 0, rather than x + sg(qdq - x), which can round); d/dx is the identity.
    """
    x = jnp.asarray(x)
    if spec(fmt).exact:
        check_width(fmt, x.shape[-1], rope, "quantize_dequantize")
        return x
    y = decode(fmt, encode(fmt, x, rope), x.dtype)
    return jax.lax.stop_gradient(y) + (x - jax.lax.stop_gradient(x))



def as_stored(fmt: str, x: jax.Array, rope: int = 0, enabled: bool = True) -> jax.Array:
    """`x` rounded as a cache of format `fmt` will store it when `enabled` (the config's
    `cache.fake_quant`: training sees the numbers decode reads back), else `x` itself."""
    return quantize_dequantize(fmt, x, rope) if enabled else x

def abstract(fmt: str, shape_prefix, width: int, rope: int = 0,
             dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of ``encode(fmt, x[*shape_prefix, width], rope)``."""
    spec(fmt)
    proto = jax.ShapeDtypeStruct(tuple(shape_prefix) + (width,), jnp.dtype(dtype))
    return jax.eval_shape(lambda v: encode(fmt, v, rope), proto)


def empty(fmt: str, shape_prefix, width: int, rope: int = 0,
          dtype=jnp.float32) -> dict[str, jax.Array]:
    """Zero storage for ``shape_prefix`` vectors: every byte 0x00, which decodes to 0.0
    (an E8M0 scale byte 0 is 2^-127; its q values are 0 anyway)."""
    return {name: jnp.zeros(sds.shape, sds.dtype)
            for name, sds in abstract(fmt, shape_prefix, width, rope, dtype).items()}


def store(stored: dict[str, jax.Array], index: tuple, encoded: dict[str, jax.Array]) -> dict:
    """`stored` with `encoded` (an `encode` result) written at `index`, a tuple of index
    arrays broadcast together to the updates' shape U (encoded arrays: U + their trailing
    dims); out-of-range indices are dropped.

    Always a scatter done in place: XLA turns a one-update scatter (batch-1 decode) into a
    dynamic-update-slice, which XLA:CPU performs on a copy of the whole array, every step
    (and of the whole larger array a view writes into, dsattn/scan.py). A
    second, dropped update (the last index one past its dimension) keeps it a scatter.
    """
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in index))
    if math.prod(shape) == 1:
        dim = next(iter(stored.values())).shape[len(index) - 1]
        index = tuple(jnp.concatenate([jnp.reshape(i, (1,)), jnp.reshape(
            jnp.asarray(dim, jnp.result_type(i)) if d == len(index) - 1 else i, (1,))])
            for d, i in enumerate(index))
        encoded = {k: jnp.concatenate([v.reshape((1,) + v.shape[len(shape):])] * 2)
                   for k, v in encoded.items()}
    return {k: a.at[index].set(encoded[k].astype(a.dtype), mode="drop")
            for k, a in stored.items()}
