"""The MXFP4 grouped-matmul Pallas kernel (issue #15, kernel 1) in TPU interpret mode (race
detection on, uninitialised memory NaN) against the NumPy MXFP4 decoder and a float64 matmul:
ragged groups (empty ones, one straddling row tiles, rows past the groups that keep
``existing``), a layer index into the stacked weights and an EP shard's ``group_offset``,
bf16 activations, and exact decoding at scale bytes 0 / 127 / 254 / 255 and code 8 (-0).
Grids stay small (a few dozen steps)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3serve.kernels.gmm_mxfp4 import group_metadata, mxfp4_gmm, pad_scales, repack_halves
from k3serve.kernels.mxfp4 import unpack_mxfp4_np

INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def _unrepack(packed, tk):
    """The inverse of repack_halves (the checkpoint's pairing of elements 2j, 2j+1)."""
    lead, half = packed.shape[:-1], packed.shape[-1]
    blocks = packed.reshape(*lead, half * 2 // tk, tk // 2)
    codes = np.concatenate([blocks & 0xF, blocks >> 4], axis=-1).reshape(*lead, half * 2)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def test_repack_is_lossless_and_pairs_halves():
    rng = np.random.default_rng(0)
    p = rng.integers(0, 256, (3, 4, 128), dtype=np.uint8)  # K = 256
    for tk in (64, 128, 256):
        r = repack_halves(p, tk)
        np.testing.assert_array_equal(_unrepack(r, tk), p)
        np.testing.assert_array_equal(np.asarray(repack_halves(jnp.asarray(p), tk)), r)
    with pytest.raises(ValueError, match="multiple of 32"):
        repack_halves(p, 48)


def _visits_brute(sizes, M, tm):
    out, o = [], 0
    for g, n in enumerate(sizes):
        if n:
            out += [(g, t) for t in range(o // tm, -(-(o + n) // tm))]
        o += n
    return out


@pytest.mark.parametrize("sizes", [[5, 0, 11, 3], [0, 0, 32], [8, 8, 8, 8], [0, 0, 0], [1, 30, 1], [3]])
def test_group_metadata_lists_every_group_tile_in_row_order(sizes):
    M, tm = 32, 8
    offsets, gids, tiles, num = (np.asarray(a) for a in group_metadata(jnp.asarray(sizes, jnp.int32), M, tm))
    want = _visits_brute(sizes, M, tm)
    assert int(num) == len(want) and len(gids) == M // tm + len(sizes) - 1
    assert list(zip(gids[:len(want)].tolist(), tiles[:len(want)].tolist())) == want
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(sizes)]))
    if want:  # padding repeats the last real visit
        assert all((g, t) == want[-1] for g, t in zip(gids[len(want):], tiles[len(want):]))


def _reference(x, packed, scale, sizes, base, existing):
    out = existing.astype(np.float64).copy()
    o = 0
    for g, n in enumerate(sizes):
        w = unpack_mxfp4_np(packed[base + g], scale[base + g]).astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            out[o:o + n] = x[o:o + n].astype(np.float64) @ w.T
        o += n
    return out


def _run(x, packed, scale, sizes, layer, E, blocks, group_offset=0, existing=None):
    # scales in the stored (padded) layout; the bf16 and fused tests pass the checkpoint's
    w = jnp.asarray(repack_halves(packed, blocks[1])), jnp.asarray(pad_scales(scale))
    return np.asarray(mxfp4_gmm(jnp.asarray(x), *w, jnp.asarray(sizes, jnp.int32), layer, num_experts=E,
                                group_offset=group_offset, blocks=blocks, existing=None if existing is None else jnp.asarray(existing),
                                interpret=INTERPRET))


@pytest.mark.parametrize("sizes,layer,group_offset,blocks", [
    ([5, 0, 11, 3], 1, 0, (8, 128, 128)),    # empty group, a group over two tiles, 13 rows past
    ([0, 9, 0, 23], 0, 2, (8, 64, 64)),      # EP shard: groups are experts 2.. of the layer; K in two tiles
    ([32], 2, 3, (16, 128, 64)),             # one group fills M
    ([4, 12, 16], 0, 0, (8, 32, 128)),       # tk = 32: both halves share one scale group
])
def test_matches_reference_on_ragged_groups(sizes, layer, group_offset, blocks):
    rng = np.random.default_rng(sum(sizes) + layer)
    L, E, N, K, M = 3, 6, 128, 128, 32
    packed = rng.integers(0, 256, (L * E, N, K // 2), dtype=np.uint8)
    scale = rng.integers(118, 132, (L * E, N, K // 32), dtype=np.uint8)
    x = rng.standard_normal((M, K)).astype(np.float32)
    existing = rng.standard_normal((M, N)).astype(np.float32)
    y = _run(x, packed, scale, sizes, layer, E, blocks, group_offset, existing)
    want = _reference(x, packed, scale, sizes, layer * E + group_offset, existing)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.array_equal(y[sum(sizes):], existing[sum(sizes):])  # rows past the groups are kept


def test_bf16_activations_accumulate_in_f32():
    rng = np.random.default_rng(7)
    E, N, K, M = 2, 64, 128, 16
    packed = rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    scale = rng.integers(120, 130, (E, N, K // 32), dtype=np.uint8)
    x = rng.standard_normal((M, K)).astype(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    y = np.asarray(mxfp4_gmm(xb, jnp.asarray(repack_halves(packed, 128)), jnp.asarray(scale),
                             jnp.asarray([7, 9], jnp.int32), num_experts=E, blocks=(8, 128, 64), interpret=INTERPRET))
    want = _reference(np.asarray(xb.astype(jnp.float32)), packed, scale, [7, 9], 0, np.zeros((M, N)))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _special_weights(N, K, seed=3):
    """Codes over all 16 values with scale bytes 0 / 127 / 254 / 255 by row (magnitudes <= 1 at
    254, so 2^127 stays finite) and -0 (code 8) in the first row."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (N, K), dtype=np.uint8)
    scale = np.array([0, 127, 254, 255] * (N // 4), np.uint8)[:, None].repeat(K // 32, 1)
    codes[scale[:, 0] == 254] &= 0b1010
    codes[0, :4] = 8
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), scale


def test_in_kernel_decode_is_bit_exact():
    """The kernel's decode of a repacked tile, run inside a Pallas kernel: the float32 bit
    patterns of the NumPy decoder, subnormals (scale 0), -0 and NaN (scale 255) included."""
    import jax
    from jax.experimental import pallas as pl

    from k3serve.kernels.gmm_mxfp4 import decode_tile, pad_scales, tile_scales

    N, K = 16, 128
    packed, scale = _special_weights(N, K)
    rp = repack_halves(packed, K)

    def kernel(p_ref, s_ref, o_ref):  # the padded scale block, as the kernel reads it
        lo, hi = decode_tile(p_ref[...], *tile_scales(s_ref[...], 0, K))
        o_ref[:, : K // 2] = lo
        o_ref[:, K // 2:] = hi

    got = np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((N, K), jnp.float32),
                                    interpret=INTERPRET)(jnp.asarray(rp), jnp.asarray(pad_scales(scale))))
    want = unpack_mxfp4_np(packed, scale).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert (np.abs(want[scale[:, 0] == 0]) < np.finfo(np.float32).tiny).any()  # subnormals were tested


def test_special_scales_through_the_matmul():
    """One-hot activations read the decoded weights out column by column: exact values at
    scale bytes 127 and 254 (2^127), NaN columns at 255; subnormal weights (scale 0) come out
    flushed to zero, as XLA's and the MXU's matmuls flush them."""
    E, N, K, M = 1, 64, 64, 64
    packed, scale = _special_weights(N, K)
    x = np.eye(M, K, dtype=np.float32)  # row j picks input column j
    y = _run(x, packed[None], scale[None], [M], 0, E, (8, 64, 64))
    w = unpack_mxfp4_np(packed, scale).astype(np.float32)  # [N, K]
    w = np.where(np.abs(w) < np.finfo(np.float32).tiny, 0.0, w)
    nan_rows = scale[:, 0] == 255
    np.testing.assert_array_equal(y[:, ~nan_rows], w[~nan_rows].T)
    assert np.isnan(y[:, nan_rows]).all()


def test_expert_ffn_pallas_backend_matches_the_reference_strategies():
    """``expert_ffn(..., backend="pallas-interpret")`` on repacked MXFP4 layer stacks equals the
    reference (``blocked``) on the checkpoint's bytes: random top-k routing, padding tokens
    routed nowhere, a layer row of the stack."""
    from k3serve.kernels.moe import expert_ffn
    from k3serve.kernels.moe_gmm import repack_experts

    rng = np.random.default_rng(11)
    L, E, I, K, N, k = 2, 8, 64, 32, 6, 2

    def mx(n, c):
        return (rng.integers(0, 256, (L, E, n, c // 2), dtype=np.uint8),
                rng.integers(122, 130, (L, E, n, c // 32), dtype=np.uint8))

    w1, w3, w2 = mx(I, K), mx(I, K), mx(K, I)
    x = rng.standard_normal((N, K)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    tw = rng.random((N, k)).astype(np.float32)
    valid = np.array([True, True, False, True, True, False])
    act = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    J = lambda w: tuple(jnp.asarray(a) for a in w)  # noqa: E731
    want = np.asarray(expert_ffn(x, idx, tw, J(w1), J(w2), J(w3), act, E, valid=valid, layer=1, strategy="blocked"))
    R = lambda w: tuple(jnp.asarray(a) for a in repack_experts(*w))  # noqa: E731
    got = np.asarray(expert_ffn(x, idx, tw, R(w1), R(w2), R(w3), act, E, valid=valid, layer=1,
                                backend="pallas-interpret"))
    assert R(w1)[1].shape == (L, E, I, 128)  # the stored layout: scales padded to 128 columns
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not got[~valid].any()


def test_fused_gate_up_applies_the_activation_to_both_products():
    rng = np.random.default_rng(5)
    L, E, N, K, M = 1, 3, 64, 64, 16
    wg = (rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8), rng.integers(122, 130, (E, N, K // 32), dtype=np.uint8))
    wu = (rng.integers(0, 256, (E, N, K // 2), dtype=np.uint8), rng.integers(122, 130, (E, N, K // 32), dtype=np.uint8))
    x = rng.standard_normal((M, K)).astype(np.float32)
    sizes = [6, 0, 7]
    act = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    R = lambda w: (jnp.asarray(repack_halves(w[0], 64)), jnp.asarray(w[1]))  # noqa: E731
    got = np.asarray(mxfp4_gmm(jnp.asarray(x), *R(wg), jnp.asarray(sizes, jnp.int32), num_experts=E,
                               blocks=(8, 64, 64), up=R(wu), act=act, interpret=INTERPRET))
    g = _reference(x, *wg, sizes, 0, np.zeros((M, N)))
    u = _reference(x, *wu, sizes, 0, np.zeros((M, N)))
    want = np.asarray(act(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32)))
    np.testing.assert_allclose(got[:13], want[:13], rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not got[13:].any()
    with pytest.raises(ValueError, match="needs both"):
        mxfp4_gmm(jnp.asarray(x), *R(wg), jnp.asarray(sizes, jnp.int32), num_experts=E, blocks=(8, 64, 64),
                  up=R(wu), interpret=INTERPRET)


def test_blocks_fit_the_vmem_budget():
    """Column blocks are the widest multiple of 128 dividing N whose estimate fits the budget;
    a tighter budget gives narrower ones; toy widths keep N whole."""
    from k3serve.kernels.gmm_mxfp4 import VMEM_LIMIT, choose_blocks, scale_groups, vmem_estimate

    assert scale_groups(3584) == scale_groups(3072) == 128 and scale_groups(8192) == 256
    for K, N, tm, nw in ((3584, 3072, 128, 2), (3072, 896, 8, 1), (3584, 768, 8, 2)):
        tm_, tk, tn = choose_blocks(K, N, tm, weights=nw)
        assert (tm_, tk) == (tm, 512) and N % tn == 0 and tn % 128 == 0
        assert vmem_estimate(tm, tk, tn, K, weights=nw) <= VMEM_LIMIT // 2
        assert choose_blocks(K, N, tm, weights=nw, budget=VMEM_LIMIT // 8)[2] < tn
    assert choose_blocks(64, 96, 8)[2] == 96
    with pytest.raises(ValueError, match="no column block"):
        choose_blocks(3584, 3072, 128, budget=2**20)


def test_repack_experts_gives_an_abstract_stack_its_stored_shapes():
    from k3serve.kernels.moe_gmm import repack_experts

    p, s = jax.ShapeDtypeStruct((92, 28, 3072, 1792), jnp.uint8), jax.ShapeDtypeStruct((92, 28, 3072, 112), jnp.uint8)
    rp, rs = repack_experts(p, s)
    assert rp is p and (rs.shape, rs.dtype) == ((92, 28, 3072, 128), jnp.uint8)
    assert repack_experts(p) is p
