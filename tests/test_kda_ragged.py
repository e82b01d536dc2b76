"""kernels.kda_ragged: the flattened-step KDA core and causal conv against per-row references
(kernels.kda.kda_recurrent and model.kda.causal_conv run on each row's own tokens)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3serve.kernels import ops
from k3serve.kernels.kda import kda_recurrent
from k3serve.kernels.kda_ragged import ragged_tiles
from k3serve.model.kda import causal_conv

H, DK, DV, W, CH = 2, 16, 32, 4, 24  # heads, key dim, value dim, conv width, conv channels
R, NS, CS = 6, 12, 64  # rows, snapshot entries, chunk size

kda_jit = jax.jit(ops.kda_ragged, static_argnames="chunk_size")
conv_jit = jax.jit(ops.ragged_causal_conv)
ref_kda = jax.jit(kda_recurrent)
ref_conv = jax.jit(causal_conv)
tiles_jit = jax.jit(ragged_tiles, static_argnums=(3, 4))


def _layout(rng, T, q_lens=None, start_pos=None, fresh=None):
    """Row metadata for a step of T tokens: q_lens (used rows in random order, unused last),
    start positions, fresh flags, and snapshot entries (several per row, some unused)."""
    if q_lens is None:
        menu = [0, 1, 1, 2, 3, 63, 64, 65, 17, 100, 130]
        q_lens, left = [], T
        for _ in range(R):
            n = min(int(rng.choice(menu)), left)
            q_lens.append(n)
            left -= n
        used = [n for n in q_lens if n]
        rng.shuffle(used)
        q_lens = used + [0] * (R - len(used))
    q_lens = np.asarray(q_lens, np.int32)
    if start_pos is None:
        start_pos = rng.choice([0, 5, 64, 100, 127, 128, 191, 250], size=R)
    start_pos = np.asarray(start_pos, np.int32)
    fresh = rng.random(R) < 0.3 if fresh is None else np.asarray(fresh)
    start_pos = np.where(fresh, 0, start_pos).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tok_row = np.full(T, R, np.int32)
    for r in range(R):
        tok_row[cu[r] : cu[r + 1]] = r

    cands = []
    for r in range(R):
        n = int(q_lens[r])
        if n == 0:
            continue
        first = min(n, CS - int(start_pos[r]) % CS)  # end of the row's first tile
        offs = {1, n, first, first + CS, 63, (1 + n) // 2, int(rng.integers(1, n + 1))}
        cands += [(r, o) for o in sorted(offs) if 1 <= o <= n]
    rng.shuffle(cands)
    cands = cands[: NS - 3]
    # unused entries: a padding row, a zero length, a negative length
    cands += [(R, 1), (0, 0), (1, -3)]
    cands += [(R, 0)] * (NS - len(cands))
    order = rng.permutation(NS)
    snap_row = np.asarray([cands[i][0] for i in order], np.int32)
    snap_len = np.asarray([cands[i][1] for i in order], np.int32)
    return dict(q_lens=q_lens, start_pos=start_pos, fresh=fresh, cu=cu, tok_row=tok_row,
                snap_row=snap_row, snap_len=snap_len)


def _inputs(rng, T, lay, mode="plain"):
    """mode "plain": random keys, moderate decay; "hard": nearly parallel keys, beta near 1 and
    almost no decay (the chunk's (I + A) is far from I); "steep": log-decays down to -5 per
    token (K3's gate lower bound; a tile's cumulative decay is far outside float32's exp range).
    (At -20 per token the chunked form itself drifts to ~3e-6 absolute, from G_t - G_j of
    large cumulative sums, kernels.kda.kda_chunked alike.)"""
    q = rng.standard_normal((T, H, DK)).astype(np.float32)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * DK ** -0.5
    k = rng.standard_normal((T, H, DK)).astype(np.float32)
    if mode == "hard":
        k = 0.3 * k + rng.standard_normal((1, H, DK)).astype(np.float32)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((T, H, DV)).astype(np.float32)
    g = (-0.2 * np.exp(rng.standard_normal((T, H, DK)))).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, H)).astype(np.float32)
    if mode == "hard":
        g = -0.01 * rng.uniform(0.0, 1.0, (T, H, DK)).astype(np.float32)
        beta = rng.uniform(0.8, 1.0, (T, H)).astype(np.float32)
    elif mode == "steep":
        g = -5.0 * rng.uniform(0.0, 1.0, (T, H, DK)).astype(np.float32)
    pad = lay["tok_row"] == R  # garbage (finite) in padding tokens must not leak anywhere
    for x in (q, k, v, g):
        x[pad] = 1e3
    beta[pad] = 7.0
    S0 = (0.5 * rng.standard_normal((R, H, DK, DV))).astype(np.float32)
    S0[lay["fresh"]] = 0.0
    raw = rng.standard_normal((T, CH)).astype(np.float32)
    raw[pad] = 1e3
    conv0 = rng.standard_normal((R, W - 1, CH)).astype(np.float32)
    conv0[lay["fresh"]] = 0.0
    wconv = rng.standard_normal((CH, W)).astype(np.float32)
    return q, k, v, g, beta, S0, raw, conv0, wconv


def _per_row(x, lay, T, lens):
    """[T, ...] tokens -> [R, T, ...] each row's own tokens, zero past lens[r]."""
    out = np.zeros((R, T) + x.shape[1:], x.dtype)
    for r in range(R):
        n = int(lens[r])
        out[r, :n] = x[lay["cu"][r] : lay["cu"][r] + n]
    return out


def _reference(lay, T, q, k, v, g, beta, S0, raw, conv0, wconv):
    """Each row separately; positions past the row's length are no-ops (g = 0, beta = 0)."""
    ql = lay["q_lens"]
    rows = [_per_row(x, lay, T, ql) for x in (q, k, v, g, beta)]
    o_rows, S_new = (np.asarray(a) for a in ref_kda(*rows, S0))
    o = np.zeros((T, H, DV), np.float32)
    for r in range(R):
        o[lay["cu"][r] : lay["cu"][r + 1]] = o_rows[r, : ql[r]]
    raw_rows = _per_row(raw, lay, T, ql)
    y_rows, conv_new = (np.asarray(a) for a in ref_conv(raw_rows, conv0, wconv, ql))
    y = np.zeros((T, CH), np.float32)
    for r in range(R):
        y[lay["cu"][r] : lay["cu"][r + 1]] = y_rows[r, : ql[r]]

    # snapshots: the recurrence / conv over the row's first snap_len tokens only
    sr, sl = lay["snap_row"], lay["snap_len"]
    used = (sr < R) & (sl >= 1)
    used[used] &= sl[used] <= ql[sr[used]]
    snap_S = np.zeros((NS, H, DK, DV), np.float32)
    snap_c = np.zeros((NS, W - 1, CH), np.float32)
    for s in np.flatnonzero(used):
        r, n = int(sr[s]), int(sl[s])
        row = [x[r : r + 1].copy() for x in rows]
        row[3][:, n:] = 0.0  # g
        row[4][:, n:] = 0.0  # beta
        snap_S[s] = np.asarray(ref_kda(*row, S0[r : r + 1])[1])[0]
        snap_c[s] = np.asarray(ref_conv(raw_rows[r : r + 1], conv0[r : r + 1], wconv, np.array([n]))[1])[0]
    return o, S_new, snap_S, y, conv_new, snap_c, used


def _close(name, got, want, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert np.all(np.isfinite(got)), name
    scale = max(1e-3, float(np.abs(want).max()))  # relative to the array's magnitude
    err = float(np.abs(got - want).max()) / scale
    assert err < tol, f"{name}: max err {err:.3g} (scale {scale:.3g})"


def _check(lay, T, seed, kda_fn=None, conv_fn=None, mode="plain"):
    rng = np.random.default_rng(1000 + seed)
    q, k, v, g, beta, S0, raw, conv0, wconv = _inputs(rng, T, lay, mode)
    meta = [jnp.asarray(lay[n]) for n in ("tok_row", "cu", "q_lens")]
    o, S_new, snap_S = (kda_fn or functools.partial(kda_jit, chunk_size=CS))(q, k, v, g, beta, S0, *meta, jnp.asarray(lay["start_pos"]),
                               jnp.asarray(lay["snap_row"]), jnp.asarray(lay["snap_len"]))
    y, conv_new, snap_c = (conv_fn or conv_jit)(raw, conv0, wconv, *meta, jnp.asarray(lay["snap_row"]),
                                   jnp.asarray(lay["snap_len"]))
    ref = _reference(lay, T, q, k, v, g, beta, S0, raw, conv0, wconv)
    r_o, r_S, r_snapS, r_y, r_conv, r_snapc, used = ref

    valid = lay["tok_row"] < R
    _close("o", np.asarray(o)[valid], r_o[valid])
    _close("new_state", S_new, r_S)
    _close("snap_state", snap_S, r_snapS)
    _close("y", np.asarray(y)[valid], r_y[valid])
    _close("new_conv", conv_new, r_conv)
    _close("snap_conv", snap_c, r_snapc)
    # padding tokens: finite (zeros); unused rows: bit-identical; unused snapshots: zeros
    assert np.all(np.asarray(o)[~valid] == 0) and np.all(np.asarray(y)[~valid] == 0)
    idle = lay["q_lens"] == 0
    assert np.array_equal(np.asarray(S_new)[idle], S0[idle])
    assert np.array_equal(np.asarray(conv_new)[idle], conv0[idle])
    assert np.all(np.asarray(snap_S)[~used] == 0) and np.all(np.asarray(snap_c)[~used] == 0)


@pytest.mark.parametrize("T", [128, 256])
@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_match_per_row_reference(T, seed):
    rng = np.random.default_rng(seed + 17 * T)
    _check(_layout(rng, T), T, seed)


@pytest.mark.parametrize("mode", ["hard", "steep"])
def test_hard_inputs_match_per_row_reference(mode):
    T = 256
    lay = _layout(np.random.default_rng(77), T, q_lens=[130, 1, 65, 2, 50, 0], start_pos=[5, 9, 64, 63, 100, 0])
    _check(lay, T, 5, mode=mode)


@pytest.mark.parametrize(
    "q_lens,start_pos",
    [
        ([1, 1, 1, 1, 0, 0], [5, 64, 0, 127, 3, 9]),  # decode only (no tiles)
        ([128, 0, 0, 0, 0, 0], [37, 0, 0, 0, 0, 0]),  # one row fills the step, unaligned start
        ([64, 64, 0, 0, 0, 0], [64, 128, 0, 0, 0, 0]),  # aligned starts, exactly one tile each
        ([2, 1, 65, 1, 59, 0], [63, 7, 63, 0, 1, 0]),  # tiny first tiles (1 token to the boundary)
        ([66, 2, 2, 2, 2, 2], [63] * 6),  # most tiles per token: 13 of the bound's 14
    ],
)
def test_edge_layouts(q_lens, start_pos):
    rng = np.random.default_rng(sum(q_lens) + sum(start_pos))
    lay = _layout(rng, 128, q_lens=q_lens, start_pos=start_pos, fresh=[False] * R)
    _check(lay, 128, 99)


def test_compiles_once_for_different_layouts():
    T, traces = 128, []

    def kda(*a):
        traces.append("kda")
        return ops.kda_ragged(*a, chunk_size=CS)

    def conv(*a):
        traces.append("conv")
        return ops.ragged_causal_conv(*a)

    kda_fn, conv_fn = jax.jit(kda), jax.jit(conv)
    layouts = [_layout(np.random.default_rng(500 + s), T) for s in range(2)]
    layouts.append(_layout(np.random.default_rng(9), T, q_lens=[3, 1, 0, 0, 0, 0]))
    layouts.append(_layout(np.random.default_rng(8), T, q_lens=[1, 1, 1, 0, 0, 0]))  # decode only
    for seed, lay in enumerate(layouts):
        _check(lay, T, seed, kda_fn, conv_fn)
    assert sorted(traces) == ["conv", "kda"]


@pytest.mark.parametrize("seed", range(6))
def test_tiles_partition_rows_and_end_on_absolute_chunk_boundaries(seed):
    T = 256
    rng = np.random.default_rng(seed)
    if seed == 0:  # many tiles for few tokens (2 per 2-token row)
        lay = _layout(rng, T, q_lens=[66, 2, 2, 2, 2, 2], start_pos=[63] * 6, fresh=[False] * R)
    else:
        lay = _layout(rng, T)
    tl = {n: np.asarray(a) for n, a in
          tiles_jit(lay["cu"], lay["q_lens"], lay["start_pos"], T, CS).items()}
    nt = int(tl["num_tiles"])
    assert nt <= T // CS + 2 * R == tl["tile_row"].shape[0]
    if seed == 0:
        assert nt == 13  # 3 + 5 * 2
    seen = {}
    for i in range(nt):
        r, loc0, n = int(tl["tile_row"][i]), int(tl["tile_loc0"][i]), int(tl["tile_len"][i])
        assert 1 <= n <= CS and tl["tile_tok0"][i] == lay["cu"][r] + loc0
        assert loc0 == seen.get(r, 0), "tiles of a row are consecutive, in order"
        assert bool(tl["tile_first"][i]) == (loc0 == 0)
        seen[r] = loc0 + n
        assert bool(tl["tile_last"][i]) == (seen[r] == lay["q_lens"][r])
        a0 = int(lay["start_pos"][r]) + loc0  # absolute positions [a0, a0 + n)
        assert a0 // CS == (a0 + n - 1) // CS, "a tile never crosses an absolute chunk boundary"
        if not tl["tile_last"][i]:
            assert (a0 + n) % CS == 0, "a tile that is not the row's last ends on a boundary"
    assert seen == {r: int(n) for r, n in enumerate(lay["q_lens"]) if n >= 2}


@pytest.mark.parametrize("decay", [0.05, 20.0])
def test_subblocked_decay_scores_match_pairwise(decay):
    """The sub-blocked scores (used by the tiles) equal the pairwise-tensor form, finite even
    when the cumulative decay over a chunk is far below float32's exp range."""
    from k3serve.kernels.kda import decay_scores

    rng = np.random.default_rng(3)
    q, k = (rng.standard_normal((H, CS, DK)).astype(np.float32) for _ in range(2))
    G = np.cumsum(-decay * rng.uniform(0, 1, (H, CS, DK)), axis=1).astype(np.float32)
    full = jax.jit(lambda q, k, G: decay_scores(q, k, G))(q, k, G)
    sub = jax.jit(lambda q, k, G: decay_scores(q, k, G, 16))(q, k, G)
    for a, b in zip(sub, full):
        _close("scores", a, b)
        assert np.all(np.triu(np.asarray(a), 1) == 0)


def test_blocked_solve_matches_row_loop_when_a_is_large():
    """Nearly parallel keys, beta = 1, no decay: A is ~ the all-ones strictly lower matrix, so
    (I + A)^-1 needs every power of each diagonal block."""
    from k3serve.kernels.kda import blocked_unit_lower_solve, unit_lower_solve

    rng = np.random.default_rng(4)
    k = rng.standard_normal((H, CS, DK)).astype(np.float32) * 0.1 + rng.standard_normal((H, 1, DK))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
    A = np.tril(np.einsum("htd,hjd->htj", k, k), -1).astype(np.float32)
    rhs = rng.standard_normal((H, CS, 8)).astype(np.float32), k
    want = np.linalg.solve(np.eye(CS) + A.astype(np.float64), np.concatenate(rhs, -1).astype(np.float64))
    for solve in (unit_lower_solve, blocked_unit_lower_solve):
        got = np.concatenate([np.asarray(x) for x in jax.jit(solve)(A, *rhs)], -1)
        _close(solve.__name__, got, want, tol=1e-5)
