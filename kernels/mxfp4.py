"""MXFP4 codec for Kimi K3's routed experts (compressed-tensors ``mxfp4-pack-quantized``).

Why this module exists: the release checkpoint stores every routed expert ``w1/w2/w3`` as
packed 4-bit E2M1 codes plus one E8M0 scale per 32 input-dimension values, and nothing else
in the model is quantized. Serving needs a jit-friendly decoder (``unpack_mxfp4``), a
reference matmul on packed weights (``mxfp4_linear``), and tests/tools need a NumPy decoder
and the OCP quantizer that produced the checkpoints (to write synthetic ones).

Layout for a logical weight ``W[..., N, K]`` (K a multiple of 32)::

    packed uint8 [..., N, K/2]    byte j: element 2j in the LOW nibble, 2j+1 in the HIGH nibble
    scale  uint8 [..., N, K/32]   E8M0 exponent s: scale = 2**(s - 127); s = 255 is NaN (OCP)
    nibble c: magnitude E2M1[c & 7] = [0, .5, 1, 1.5, 2, 3, 4, 6], negative if c & 8

Exactness: every decoded value is ``E2M1 * 2**k`` and is computed without floating point
rounding. The JAX decoder assembles the float32 bit pattern with integer ops (XLA on CPU and
GPU flushes subnormal float products to zero, so ``value * scale`` would not be exact for tiny
scales); the NumPy decoder multiplies in float64 and casts. Both agree bit for bit, including
subnormal results, -0.0 for code 8, +inf where the true value overflows float32 (s >= 253 with
large codes) and NaN for s = 255. A non-float32 ``dtype`` is a cast of the exact float32
result (exact for bfloat16 unless the value is a float32 subnormal).

This module imports nothing else from k3serve on purpose: kernels are leaf code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

GROUP_SIZE = 32
"""Number of consecutive input-dimension values that share one E8M0 scale."""

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
"""Magnitude of E2M1 codes 0..7; code | 8 is the negative."""

# Rounding boundaries between consecutive E2M1 magnitudes, and whether a value exactly on
# the boundary goes UP (the upper neighbour has the even code) or stays down. Codes: the
# midpoint between code i and i+1 ties to whichever of i, i+1 is even (round half to even
# on the E2M1 mantissa bit, as IEEE/OCP conversions do).
_MIDPOINTS = (E2M1_VALUES[:-1] + E2M1_VALUES[1:]) / 2  # .25 .75 1.25 1.75 2.5 3.5 5
_TIE_UP = np.array([(i + 1) % 2 == 0 for i in range(7)])  # upper code even -> tie goes up

_ZERO_GROUP_SCALE = 127
"""Scale byte written for an all-zero group: 2**0 = 1.0, a neutral, always-valid exponent."""

_F32_NAN_BITS = 0x7FC00000
_F32_INF_BITS = 0x7F800000


def _check_pair(packed_shape, scale_shape) -> int:
    """Validate packed/scale shapes; return the logical K."""
    if len(packed_shape) < 2 or len(scale_shape) < 2:
        raise ValueError(
            f"MXFP4 weight_packed/weight_scale must be at least 2-D [..., N, K/2] / [..., N, K/32]; "
            f"got {tuple(packed_shape)} / {tuple(scale_shape)}"
        )
    k = 2 * packed_shape[-1]
    if k == 0 or k % GROUP_SIZE:
        raise ValueError(
            f"MXFP4 weight_packed last dim {packed_shape[-1]} gives K={k}, which is not a positive "
            f"multiple of {GROUP_SIZE}"
        )
    expect = tuple(packed_shape[:-1]) + (k // GROUP_SIZE,)
    if tuple(scale_shape) != expect:
        raise ValueError(
            f"MXFP4 weight_scale shape {tuple(scale_shape)} does not match weight_packed "
            f"{tuple(packed_shape)}: expected {expect} (one scale per {GROUP_SIZE} values)"
        )
    return k


def _check_uint8(name: str, dtype) -> None:
    if np.dtype(dtype) != np.uint8:
        raise ValueError(f"MXFP4 {name} must be uint8, got {np.dtype(dtype)}")


# --------------------------------------------------------------------------------------------
# JAX decoder
# --------------------------------------------------------------------------------------------


def _f32_bits_from_codes(codes, s):
    """Exact float32 bit pattern of E2M1 ``codes`` (uint32) times 2**(s-127) (s uint32)."""
    u32 = jnp.uint32
    sign = (codes >> 3) & u32(1)
    mag = codes & u32(7)
    e = mag >> 1  # E2M1 exponent field
    mant = jnp.where(e > 0, mag & u32(1), u32(0))
    # value = (1 + mant/2) * 2**E with E = e - 1 (normal codes) or -1 (code 1 = 0.5)
    # biased float32 exponent b = E + 127 + (s - 127) = E + s, kept signed.
    big_e = jnp.where(e > 0, e.astype(jnp.int32) - 1, jnp.int32(-1))
    b = big_e + s.astype(jnp.int32)
    normal = (b.astype(u32) << 23) | (mant << 22)
    # b <= 0: subnormal, value = (2 + mant) * 2**(b - 128) = ((2 + mant) << (b + 21)) * 2**-149;
    # b >= -1 always (E >= -1, s >= 0), so the shift is non-negative.
    sub = (u32(2) + mant) << jnp.clip(b + 21, 0, 31).astype(u32)
    mag_bits = jnp.where(b >= 255, u32(_F32_INF_BITS), jnp.where(b >= 1, normal, sub))
    mag_bits = jnp.where(mag == 0, u32(0), mag_bits)
    bits = mag_bits | (sign << 31)
    return jnp.where(s == 255, u32(_F32_NAN_BITS), bits)


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_mxfp4(packed, scale, dtype=jnp.float32):
    """Decode MXFP4 ``packed [..., N, K/2]`` + ``scale [..., N, K/32]`` (uint8) to ``[..., N, K]``.

    Pure jax.numpy, any leading dims; jitted (one compiled kernel per shape when called eagerly,
    inlined when called under an outer jit/vmap). Shape errors raise ValueError at trace time.
    The float32 result is exact (see the module docstring); other dtypes are a cast of it.
    """
    packed = jnp.asarray(packed)
    scale = jnp.asarray(scale)
    _check_uint8("weight_packed", packed.dtype)
    _check_uint8("weight_scale", scale.dtype)
    k = _check_pair(packed.shape, scale.shape)
    lead = packed.shape[:-1]

    p = packed.astype(jnp.uint32)
    codes = jnp.stack([p & jnp.uint32(0xF), p >> 4], axis=-1)  # [..., N, K/2, 2]
    codes = codes.reshape(*lead, k // GROUP_SIZE, GROUP_SIZE)
    s = scale.astype(jnp.uint32)[..., None]  # [..., N, K/32, 1]
    bits = _f32_bits_from_codes(codes, s)
    out = jax.lax.bitcast_convert_type(bits, jnp.float32).reshape(*lead, k)
    dtype = jnp.dtype(dtype)
    return out if dtype == jnp.float32 else out.astype(dtype)


@jax.jit
def mxfp4_linear(x, packed, scale):
    """Reference ``y = x @ W.T`` with ``W [N, K]`` dequantized from MXFP4 inside the op.

    ``x [..., K]`` (float32 or bfloat16 keeps its dtype for the matmul inputs; anything else is
    cast to float32). Accumulation and output are float32. W is exact in both float32 and
    bfloat16 (E2M1 has a 2-bit significand) for normal-range scales.
    """
    x = jnp.asarray(x)
    packed = jnp.asarray(packed)
    if packed.ndim != 2:
        raise ValueError(f"mxfp4_linear expects a 2-D weight_packed [N, K/2], got {packed.shape}")
    k = 2 * packed.shape[-1]
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"mxfp4_linear: x last dim {x.shape[-1:]} does not match weight K={k}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        x = x.astype(jnp.float32)
    w = unpack_mxfp4(packed, scale, dtype=x.dtype)
    return jax.lax.dot_general(
        x,
        w,
        dimension_numbers=(((x.ndim - 1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )


# --------------------------------------------------------------------------------------------
# NumPy decoder and quantizer
# --------------------------------------------------------------------------------------------

_SIGNED_E2M1_F64 = np.concatenate([E2M1_VALUES, -E2M1_VALUES]).astype(np.float64)  # [8] = -0.0


def unpack_mxfp4_np(packed, scale) -> np.ndarray:
    """NumPy twin of :func:`unpack_mxfp4` -> float32 ``[..., N, K]`` (independent arithmetic:
    float64 ``ldexp`` then one exact cast)."""
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    _check_uint8("weight_packed", packed.dtype)
    _check_uint8("weight_scale", scale.dtype)
    k = _check_pair(packed.shape, scale.shape)
    lead = packed.shape[:-1]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*lead, k // GROUP_SIZE, GROUP_SIZE)
    exps = scale.astype(np.int32)[..., None] - 127
    with np.errstate(over="ignore"):
        vals = np.ldexp(_SIGNED_E2M1_F64[codes], exps).astype(np.float32)
    vals = np.where(scale[..., None] == 255, np.float32(np.nan), vals)
    return vals.reshape(*lead, k)


def quantize_mxfp4_np(w) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float ``w [..., N, K]`` (K % 32 == 0) to MXFP4 ``(packed, scale)`` uint8 arrays.

    OCP MX rule, per group of 32 consecutive values along K:

    * shared exponent ``e = floor(log2(max|w|)) - 2`` (so the group max lands in [4, 8)),
      scale byte ``e + 127`` clipped to [0, 254] (a clipped-high group saturates, a
      clipped-low one rounds towards zero). An all-zero group gets byte 127 (scale 1.0).
    * each ``w / 2**e`` is rounded to the nearest E2M1 magnitude, ties to the even code
      (e.g. 2.5 -> 2, 3.5 -> 4, 5 -> 4), and saturated at 6.
    * a value that rounds to 0 is written as code 0 (never -0).

    The computation is exact (float64, power-of-two division). ``w`` must be finite.
    """
    w = np.asarray(w)
    if not (np.issubdtype(w.dtype, np.floating) or w.dtype.name == "bfloat16"):
        raise ValueError(f"quantize_mxfp4_np expects a float array, got dtype {w.dtype}")
    if w.ndim < 2:
        raise ValueError(f"quantize_mxfp4_np expects w of shape [..., N, K], got {w.shape}")
    k = w.shape[-1]
    if k == 0 or k % GROUP_SIZE:
        raise ValueError(
            f"quantize_mxfp4_np: last dim K={k} must be a positive multiple of {GROUP_SIZE} "
            f"(got shape {w.shape})"
        )
    wd = w.astype(np.float64)
    if not np.all(np.isfinite(wd)):
        raise ValueError("quantize_mxfp4_np: w contains NaN or inf")
    lead = w.shape[:-1]
    g = wd.reshape(*lead, k // GROUP_SIZE, GROUP_SIZE)
    amax = np.max(np.abs(g), axis=-1)
    _, e2 = np.frexp(amax)  # amax = m * 2**e2, m in [0.5, 1)  ->  floor(log2 amax) = e2 - 1
    byte = np.clip(e2.astype(np.int64) - 1 - 2 + 127, 0, 254)
    byte = np.where(amax == 0, _ZERO_GROUP_SCALE, byte).astype(np.uint8)

    x = np.ldexp(g, 127 - byte.astype(np.int32)[..., None])  # exact division by the scale
    mag = np.abs(x)
    code = np.zeros(mag.shape, dtype=np.uint8)
    for mid, up in zip(_MIDPOINTS.astype(np.float64), _TIE_UP):
        code += (mag >= mid) if up else (mag > mid)
    code |= np.where((x < 0) & (code != 0), np.uint8(8), np.uint8(0))
    code = code.reshape(*lead, k)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return packed, byte
