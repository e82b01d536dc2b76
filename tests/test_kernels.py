"""Reference kernels against independent, naive computations."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3serve.kernels import ops
from k3serve.kernels.moe import expert_ffn
from k3serve.kernels.mxfp4 import quantize_mxfp4_np, unpack_mxfp4_np
from k3serve.model.layers import situ


def _kda_inputs(rng, B=2, T=37, H=3, dk=8, dv=6):
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(rng.normal(size=(B, T, H, dk))) * dk ** -0.5
    k = unit(rng.normal(size=(B, T, H, dk)))
    v = rng.normal(size=(B, T, H, dv))
    g = -5 / (1 + np.exp(-2 * rng.normal(size=(B, T, H, dk))))
    beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
    S0 = rng.normal(size=(B, H, dk, dv))
    return [x.astype(np.float32) for x in (q, k, v, g, beta, S0)]


def _kda_numpy(q, k, v, g, beta, S):
    """Plain float64 loop of the spec: decay, then the delta rule, then read."""
    S = S.astype(np.float64).copy()
    B, T, H, _ = q.shape
    out = np.zeros(v.shape)
    for t in range(T):
        S *= np.exp(g[:, t])[..., None]
        pred = np.einsum("bhk,bhkv->bhv", k[:, t], S)
        S += k[:, t][..., None] * ((v[:, t] - pred) * beta[:, t][..., None])[..., None, :]
        out[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return out, S


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_kda_chunked_and_recurrent_agree_with_spec(chunk):
    q, k, v, g, beta, S0 = _kda_inputs(np.random.default_rng(0))
    ref_o, ref_S = _kda_numpy(q, k, v, g, beta, S0)
    o, S = ops.kda_recurrent(q, k, v, g, beta, S0)
    np.testing.assert_allclose(o, ref_o, atol=2e-5)
    np.testing.assert_allclose(S, ref_S, atol=2e-5)
    o, S = jax.jit(ops.kda_chunked, static_argnums=6)(q, k, v, g, beta, S0, chunk)
    np.testing.assert_allclose(o, ref_o, atol=2e-5 * max(1, chunk / 8))
    np.testing.assert_allclose(S, ref_S, atol=2e-5 * max(1, chunk / 8))


def test_kda_decode_step_matches_spec_token_by_token():
    """The rearranged one-token update (decode rows) against the float64 spec, 12 tokens in a row."""
    from k3serve.kernels.kda import kda_decode_step

    q, k, v, g, beta, S0 = _kda_inputs(np.random.default_rng(2), T=12)
    ref_o, ref_S = _kda_numpy(q, k, v, g, beta, S0)
    step = jax.jit(kda_decode_step)
    S, outs = S0, []
    for t in range(q.shape[1]):
        o, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        outs.append(o)
    np.testing.assert_allclose(np.stack(outs, axis=1), ref_o, atol=2e-5)
    np.testing.assert_allclose(S, ref_S, atol=2e-5)


def test_kda_padding_positions_are_no_ops():
    q, k, v, g, beta, S0 = _kda_inputs(np.random.default_rng(1), T=10)
    g[:, 6:] = 0.0
    beta[:, 6:] = 0.0
    _, S_pad = ops.kda_chunked(q, k, v, g, beta, S0, 4)
    _, S_ref = ops.kda_recurrent(q[:, :6], k[:, :6], v[:, :6], g[:, :6], beta[:, :6], S0)
    np.testing.assert_allclose(S_pad, S_ref, atol=1e-5)


def test_mla_paged_attention_matches_dense_with_scattered_pages():
    rng = np.random.default_rng(2)
    B, T, H, L, R, ps, P = 2, 5, 3, 8, 4, 4, 9
    ctx = [11, 6]  # tokens before this step
    tables = np.array([[7, 2, 5, 0], [4, 8, 1, 3]], np.int32)
    pages = jnp.zeros((P, ps, L + R), jnp.float32)
    rows_all = [rng.normal(size=(c + T, L + R)).astype(np.float32) for c in ctx]
    pos = np.stack([np.arange(c, c + T) for c in ctx]).astype(np.int32)
    # write history then this step's rows through the same scatter the model uses
    for b, c in enumerate(ctx):
        hist = np.arange(c)[None]
        pages = ops.write_kv_pages(pages, rows_all[b][None, :c], tables[b : b + 1], hist, np.ones((1, c), bool))
    new = np.stack([r[c:] for r, c in zip(rows_all, ctx)])
    valid = np.ones((B, T), bool)
    valid[1, 3:] = False  # row 1 has 3 real new tokens
    pages = ops.write_kv_pages(pages, new, tables, pos, valid)
    kv_lens = np.array([ctx[0] + T, ctx[1] + 3], np.int32)
    ql = rng.normal(size=(B, T, H, L)).astype(np.float32)
    qr = rng.normal(size=(B, T, H, R)).astype(np.float32)
    out = np.asarray(ops.mla_paged_attention(ql, qr, pages, tables, pos, kv_lens, 0.3, L))
    for b in range(B):
        keys = rows_all[b][: kv_lens[b]]
        for t in range(T if b == 0 else 3):
            s = (ql[b, t] @ keys[: pos[b, t] + 1, :L].T + qr[b, t] @ keys[: pos[b, t] + 1, L:].T) * 0.3
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.testing.assert_allclose(out[b, t], p @ keys[: pos[b, t] + 1, :L], atol=1e-5)
    # pages no table names stay untouched
    assert not np.asarray(pages[6]).any()


def _expert_case(rng, N, K, I, E, k, mx):
    x = rng.normal(size=(N, K)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    w = rng.random((N, k)).astype(np.float32)
    dense = {n: rng.normal(size=s).astype(np.float32) / np.sqrt(s[-1]) for n, s in
             (("w1", (E, I, K)), ("w3", (E, I, K)), ("w2", (E, K, I)))}
    if mx:
        weights = {n: quantize_mxfp4_np(a) for n, a in dense.items()}
        dense = {n: unpack_mxfp4_np(*p) for n, p in weights.items()}
    else:
        weights = dense
    return x, idx, w, dense, weights


def _expert_ref(x, idx, w, dense, act):
    ref = np.zeros(x.shape)
    for n in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[n, j]
            h = np.asarray(act(dense["w1"][e] @ x[n], dense["w3"][e] @ x[n]))
            ref[n] += w[n, j] * (dense["w2"][e] @ h)
    return ref


def _ACT(g, u):
    return situ(g, u, 4.0, 25.0)


@pytest.mark.parametrize("mx", [False, True])
def test_expert_strategies_agree(mx):
    rng = np.random.default_rng(3)
    N, K, I, E, k = 12, 64, 32, 8, 3
    x, idx, w, dense, weights = _expert_case(rng, N, K, I, E, k, mx)
    ref = _expert_ref(x, idx, w, dense, _ACT)
    for strategy in ("gather", "dense", "grouped", "blocked"):
        out = expert_ffn(x, idx, w, weights["w1"], weights["w2"], weights["w3"], _ACT, E, strategy=strategy)
        np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4, err_msg=strategy)


@pytest.mark.parametrize("mx", [False, True])
def test_expert_blocked_tiles_and_padding_tokens(mx):
    """``blocked`` at several row tiles (a hot expert's group spans many tiles, most experts
    are empty) equals the loop reference, under jit; tokens with ``valid`` False come out zero
    from every strategy and the others equal a run without those tokens."""
    rng = np.random.default_rng(4)
    N, K, I, E, k = 11, 64, 32, 16, 2
    x, idx, w, dense, weights = _expert_case(rng, N, K, I, E, k, mx)
    idx[:, 0] = 5  # expert 5 gets every token: 11 rows = several tiles of 1, 2 or 4
    idx[:, 1] = rng.integers(0, 4, N)  # the rest in experts 0..3; 4 and 6..15 stay empty
    valid = np.ones(N, bool)
    valid[[2, 7, 10]] = False
    ref = _expert_ref(x, idx, w, dense, _ACT)
    ws = (weights["w1"], weights["w2"], weights["w3"])
    ffn = jax.jit(lambda x, i, w, v, W, s, t: expert_ffn(x, i, w, *W, _ACT, E, strategy=s, valid=v, tile_rows=t),
                  static_argnums=(5, 6))
    for tm in (1, 2, 4):
        out = np.asarray(ffn(x, idx, w, None, ws, "blocked", tm))
        np.testing.assert_allclose(out, ref, atol=1e-4, err_msg=f"blocked tm={tm}")
    alone = np.asarray(ffn(x[valid], idx[valid], w[valid], None, ws, "blocked", 2))  # padding dropped
    np.testing.assert_allclose(alone, ref[valid], atol=1e-4)
    for s, tm in (("gather", None), ("dense", None), ("grouped", None), ("blocked", 1), ("blocked", 2)):
        out = np.asarray(ffn(x, idx, w, valid, ws, s, tm))
        assert not out[~valid].any(), s
        np.testing.assert_allclose(out[valid], alone, atol=1e-5, err_msg=f"{s} tm={tm}")


def test_expert_blocked_skips_padding_work():
    """Padding tokens add no tile: with every token invalid the loop runs zero steps, so even
    NaN weights leave the output finite (zero); an invalid token's NaN input does not leak."""
    rng = np.random.default_rng(5)
    N, K, I, E, k = 6, 32, 16, 4, 2
    x, idx, w, dense, weights = _expert_case(rng, N, K, I, E, k, False)
    nan_w = {n: np.full_like(a, np.nan) for n, a in weights.items()}
    ffn = jax.jit(lambda x, v, W, s: expert_ffn(x, idx, w, *W, _ACT, E, strategy=s, valid=v, tile_rows=2),
                  static_argnums=3)
    out = ffn(x, np.zeros(N, bool), (nan_w["w1"], nan_w["w2"], nan_w["w3"]), "blocked")
    assert (np.asarray(out) == 0).all()
    x_bad = x.copy()
    x_bad[3] = np.nan
    valid = np.arange(N) != 3
    for s in ("gather", "dense", "grouped", "blocked"):
        out = np.asarray(ffn(x_bad, valid, (weights["w1"], weights["w2"], weights["w3"]), s))
        assert np.isfinite(out).all() and not out[3].any(), s


def test_expert_strategy_chooser():
    """The measured CPU rule (kernels/moe.py docstring): ``gather`` for MXFP4 experts while
    the pairs are fewer than the experts and the gathered copy is small, ``blocked``
    otherwise; other platforms keep the earlier rule."""
    from k3serve.kernels.moe import blocked_tile_rows, choose_strategy

    for N in (1, 8, 32, 128, 512, 8192):
        assert choose_strategy(N, 4, 32, 256, 512, platform="cpu") == "blocked"  # 105M Kimi Linear, f32
        assert choose_strategy(N, 8, 64, 128, 256, platform="cpu") == "blocked"
    for N, want in ((1, "gather"), (4, "gather"), (8, "blocked"), (32, "blocked"), (512, "blocked")):
        assert choose_strategy(N, 8, 64, 128, 256, mxfp4=True, platform="cpu") == want, N
    assert choose_strategy(1, 8, 384, 2048, 7168, mxfp4=True, platform="cpu") == "blocked"  # copy too big
    assert choose_strategy(512, 8, 64, 128, 256, platform="gpu") == "dense"
    assert [blocked_tile_rows(N, 8, 64) for N in (1, 8, 16, 32, 128, 512, 4096)] == [1, 1, 1, 4, 16, 64, 128]
    assert [blocked_tile_rows(N, 8, 64, mxfp4=True) for N in (1, 8, 32, 512)] == [1, 2, 8, 128]


def test_mla_partial_attention_merge_equals_whole():
    """Decode context parallelism's math on one device: the pages of each sequence dealt
    round-robin to N "ranks" (starting at a per-row rank), each rank attending over only its
    own columns (LSE returned), merged exactly == attention over all pages; a rank with no
    page of a short row contributes nothing."""
    from k3serve.kernels.mla import merge_partials

    rng = np.random.default_rng(7)
    B, T, H, L, R, ps, N = 3, 2, 4, 8, 4, 4, 4
    lens = np.array([5, 30, 13])  # row 0 has 2 pages: ranks without a page of it
    P = -(-int(lens.max()) // ps)
    pool = jnp.asarray(rng.normal(size=(B * P + 3, ps, L + R)), jnp.float32)
    table = np.arange(B * P, dtype=np.int32).reshape(B, P)
    ql = jnp.asarray(rng.normal(size=(B, T, H, L)), jnp.float32)
    qr = jnp.asarray(rng.normal(size=(B, T, H, R)), jnp.float32)
    pos = jnp.asarray(lens[:, None] - T + np.arange(T)[None, :], jnp.int32)
    kv_lens = jnp.asarray(lens, jnp.int32)
    whole = np.asarray(ops.mla_paged_attention(ql, qr, pool, jnp.asarray(table), pos, kv_lens, 0.3, L))
    first = np.array([0, 3, 1])  # each row's starting rank
    outs, lses = [], []
    for r in range(N):
        J = -(-P // N)
        ords = (r - first)[:, None] % N + N * np.arange(J)[None, :]
        cols = np.where(ords < P, np.take_along_axis(table, np.minimum(ords, P - 1), axis=1), -1)
        o, lse = ops.mla_paged_attention(ql, qr, pool, jnp.asarray(cols), pos, kv_lens, 0.3, L,
                                         page_ordinals=jnp.asarray(ords, jnp.int32), return_lse=True)
        outs.append(o)
        lses.append(lse)
    assert np.isneginf(np.asarray(lses[2])[0]).all()  # rank 2 holds no page of row 0 (pages on ranks 0, 1)
    merged = np.asarray(merge_partials(jnp.stack(outs), jnp.stack(lses)))
    np.testing.assert_allclose(merged, whole, rtol=1e-5, atol=1e-6)
