"""MXFP4 codec: exact decoding of the golden checkpoint, exact re-quantization, round trips,
JAX/NumPy bit-for-bit agreement and the reference matmul."""

from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (bfloat16 for safetensors.numpy)
import numpy as np
import pytest
from safetensors import safe_open

from k3serve.kernels.mxfp4 import (
    E2M1_VALUES,
    mxfp4_linear,
    quantize_mxfp4_np,
    unpack_mxfp4,
    unpack_mxfp4_np,
)

DATA = Path(__file__).parent / "data" / "k3-tiny-a"
EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.0.{}"


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def golden_st():
    return safe_open(str(DATA / "model.safetensors"), framework="numpy")


@pytest.mark.parametrize("w", ["w1", "w2", "w3"])
def test_golden_example_decodes_exactly(golden_st, w):
    packed = golden_st.get_tensor(EXPERT.format(f"{w}.weight_packed"))
    scale = golden_st.get_tensor(EXPERT.format(f"{w}.weight_scale"))
    ref = np.load(DATA / "golden.npz")[f"mxfp4_example_{w}"]
    np.testing.assert_array_equal(bits(unpack_mxfp4_np(packed, scale)), bits(ref))
    np.testing.assert_array_equal(bits(unpack_mxfp4(packed, scale)), bits(ref))


def test_requantize_golden_reproduces_every_expert_tensor(golden_st):
    stems = sorted({k[: -len(".weight_packed")] for k in golden_st.keys() if k.endswith(".weight_packed")})
    assert len(stems) == 9 * 16 * 3
    for stem in stems:
        packed = golden_st.get_tensor(stem + ".weight_packed")
        scale = golden_st.get_tensor(stem + ".weight_scale")
        p2, s2 = quantize_mxfp4_np(unpack_mxfp4_np(packed, scale))
        np.testing.assert_array_equal(p2, packed, err_msg=stem)
        np.testing.assert_array_equal(s2, scale, err_msg=stem)


def _random_weights(rng, shape):
    # per-group magnitudes from 2^-30 to 2^30, some exact zeros and a whole zero group
    w = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, size=shape[:-1] + (1,)))
    w = w.astype(np.float32)
    w[..., 0, :32] = 0.0
    w[rng.random(shape) < 0.02] = 0.0
    return w


def test_random_round_trip_fixed_point_and_error_bound():
    rng = np.random.default_rng(0)
    w = _random_weights(rng, (3, 40, 128))
    packed, scale = quantize_mxfp4_np(w)
    assert packed.shape == (3, 40, 64) and scale.shape == (3, 40, 4)
    assert packed.dtype == np.uint8 and scale.dtype == np.uint8
    assert np.all(scale[..., 0, 0] == 127)  # documented choice for an all-zero group
    d = unpack_mxfp4_np(packed, scale)
    # fixed point
    p2, s2 = quantize_mxfp4_np(d)
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scale)
    # error: at most half the local E2M1 step (times the scale); values in (6, 8) saturate to 6
    sc = np.repeat(np.exp2(scale.astype(np.float64) - 127), 32, axis=-1)
    x = np.abs(w.astype(np.float64)) / sc
    err = np.abs(w.astype(np.float64) - d) / sc
    hi = np.searchsorted(E2M1_VALUES, np.minimum(x, 6.0))
    half_step = np.where(hi == 0, 0.0, (E2M1_VALUES[np.clip(hi, 1, 7)] - E2M1_VALUES[np.clip(hi - 1, 0, 6)]) / 2)
    bound = np.where(x > 6, x - 6, half_step)
    assert np.all(err <= bound + 1e-12)
    assert np.all(x < 8)  # the shared exponent puts each group max in [4, 8)
    # and it is the nearest representable value (after saturation)
    grid = np.concatenate([-E2M1_VALUES[::-1], E2M1_VALUES])
    nearest = np.min(np.abs(np.clip(w / sc, -6, 6)[..., None] - grid), axis=-1)
    np.testing.assert_allclose(np.abs(np.clip(w / sc, -6, 6) - d / sc), nearest, atol=1e-12)


def test_quantize_ties_saturation_and_no_negative_zero():
    row = np.zeros(32, np.float32)
    row[:12] = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.1, -0.3, -5.0]
    packed, scale = quantize_mxfp4_np(row[None])
    assert scale.tolist() == [[127]]  # max 7.9 -> floor(log2) = 2 -> exponent 0
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(-1)
    # ties go to the even code; 7.9 saturates to 6; -0.1 -> +0 (code 0); -0.3 -> -0.5; -5 -> -4
    assert codes[:12].tolist() == [6, 0, 2, 2, 4, 4, 6, 6, 7, 0, 9, 14]
    assert np.all(codes[12:] == 0)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4_np(np.zeros((4, 48), np.float32))
    with pytest.raises(ValueError, match=r"\[..., N, K\]"):
        quantize_mxfp4_np(np.zeros(64, np.float32))
    with pytest.raises(ValueError, match="NaN"):
        quantize_mxfp4_np(np.full((1, 32), np.nan, np.float32))
    with pytest.raises(ValueError, match="weight_scale shape"):
        unpack_mxfp4_np(np.zeros((4, 32), np.uint8), np.zeros((4, 3), np.uint8))
    with pytest.raises(ValueError, match="weight_scale shape"):
        unpack_mxfp4(np.zeros((4, 32), np.uint8), np.zeros((4, 3), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        unpack_mxfp4(np.zeros((4, 32), np.int32), np.zeros((4, 2), np.uint8))


def test_jax_and_numpy_agree_bitwise_on_every_code_and_scale():
    # row r: scale byte r for all groups; bytes cycle through all 256 (code pairs)
    packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    scale = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    ref = unpack_mxfp4_np(packed, scale)
    np.testing.assert_array_equal(bits(jax.jit(unpack_mxfp4)(packed, scale)), bits(ref))
    # spot checks (element 2j = low nibble of byte j, 2j+1 = high nibble; row r has scale byte r)
    assert ref[127, 2] == 0.5 and ref[127, 4] == 1.0 and ref[127, 12] == 4.0 and ref[127, 14] == 6.0
    assert ref[127, 33] == 0.5 and ref[127, 18] == -0.5 and ref[128, 14] == 12.0
    assert bits(ref[127, 16]) == bits(np.float32(-0.0))  # code 8 is -0
    assert ref[0, 4] == np.float32(2.0**-127) and ref[0, 2] == np.float32(2.0**-128)  # exact subnormals
    assert ref[254, 6] == np.float32(1.5 * 2.0**127) and np.isinf(ref[254, 8]) and np.isinf(ref[254, 14])
    assert np.all(np.isnan(ref[255]))


def test_jax_unpack_leading_dims_jit_and_dtype():
    rng = np.random.default_rng(1)
    w = _random_weights(rng, (2, 3, 16, 64))
    packed, scale = quantize_mxfp4_np(w)
    ref = unpack_mxfp4_np(packed, scale)
    out = jax.jit(unpack_mxfp4)(packed, scale)
    assert out.shape == (2, 3, 16, 64) and out.dtype == jnp.float32
    np.testing.assert_array_equal(bits(out), bits(ref))
    np.testing.assert_array_equal(bits(jax.vmap(unpack_mxfp4)(packed, scale)), bits(ref))
    # bfloat16 output is exact for normal-range scales
    wb = rng.standard_normal((8, 64)).astype(np.float32)
    pb, sb = quantize_mxfp4_np(wb)
    ob = unpack_mxfp4(pb, sb, dtype=jnp.bfloat16)
    assert ob.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ob, np.float32), unpack_mxfp4_np(pb, sb))


def test_mxfp4_linear_matches_dequantized_matmul():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    packed, scale = quantize_mxfp4_np(w)
    wd = unpack_mxfp4_np(packed, scale)
    x = rng.standard_normal((2, 5, 96)).astype(np.float32)
    y = jax.jit(mxfp4_linear)(x, packed, scale)
    assert y.shape == (2, 5, 48) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), np.einsum("btk,nk->btn", x, wd), rtol=1e-5, atol=1e-5)
    xb = x.astype(jnp.bfloat16)
    yb = mxfp4_linear(xb, packed, scale)
    assert yb.dtype == jnp.float32
    ref_b = np.einsum("btk,nk->btn", np.asarray(xb, np.float32).astype(np.float64), wd)
    np.testing.assert_allclose(np.asarray(yb), ref_b, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="does not match"):
        mxfp4_linear(x[..., :64], packed, scale)
