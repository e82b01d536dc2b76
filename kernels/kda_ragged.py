"""KDA over one flattened token axis (ragged step): the causal conv and the delta-rule core.

Layout (all metadata are traced arrays, all shapes static):
  T tokens in R rows; row r owns tokens [cu_q_lens[r], cu_q_lens[r+1]), q_lens[r] of them
  (0 for unused rows, which come last); tok_row[t] = row of token t, R for padding tokens
  (those after cu_q_lens[R]); start_pos[r] = tokens of row r processed before this step.
  Snapshots: snap_row [NS], snap_len [NS]: the state after the first snap_len[s] tokens of row
  snap_row[s] in this step. An entry is used when snap_row < R and 1 <= snap_len <= q_len of
  that row; unused entries come back as zeros.

Core (``kda_ragged``), math as in kernels/kda.py (S[k, v], o = S^T q):
  * q_len == 1 rows: one recurrent step for all R rows at once (one token gathered per row;
    state is indexed per row, never per token).
  * q_len >= 2 rows: the chunked form over tiles of <= C tokens of one row whose ends are
    aligned to absolute positions (first tile min(q_len, C - start_pos % C) tokens, later
    tiles end on multiples of C), run by a loop whose trip count is the traced number of
    tiles; the row's state is carried from tile to tile. A decode-only step runs zero trips.
  * a snapshot inside a tile (after tile token p) is exact without splitting the tile
    (design kernels-ragged.md 7b): S_p = e^{G_p} * S0 + (K * e^{G_p - G} * [j <= p])^T U, with
    the j > p mask applied before the exp. Snapshots at snap_len == q_len are the row's new
    state (this covers decode rows).

Chunk solve ((I + A) X = [beta V | beta K e^G] on one 64-token tile, A [H, 64, 64]), jitted,
on this shared 2-core CPU box (load 3-5, so noisy), median / min of 50 runs, relative error vs
a float64 solve; "hard" = nearly parallel keys, beta ~ 1, little decay, so A is far from 0
(``python -m k3serve.kernels.kda_ragged``):
                              H=8, dk=64                       H=32, dk=128
  row loop (unit_lower_solve) 0.33-0.47 / 0.24-0.34 ms, 2e-7    3.1-5.2 / 2.5-2.8 ms, 1e-7
  Neumann product over 64     0.68-0.86 / 0.63-0.70 ms, 6e+8!   5.3-6.1 / 3.8-4.2 ms, 1e+9!
  blocks of 16, each block
    inverted by Neumann       0.29-0.36 / 0.19-0.28 ms, 2e-4    1.9-2.0 / 1.3-1.6 ms, 2e-4
  blocks of 8 / 16 / 32, each
    inverted by substitution  16: 0.23-0.30 / 0.17-0.23 ms,     16: 1.7-2.4 / 1.2-1.5 ms,
                              1e-7 (8 and 32 no faster)         1e-7 (8 and 32 about the same)
(errors are for the hard case; all are <= 1e-7 on easy inputs). So tiles use
``blocked_unit_lower_solve`` (blocks of 16 inverted by substitution, all blocks in one 15-step
loop, then matmuls): as accurate as the row loop and 1.2-2x faster. The solve is not the main
cost of a tile on CPU, though: the pairwise decay tensor [H, C, C, dk] is. Tiles use
``decay_scores(..., sub=16)`` (pairs across 16-token sub-blocks as matmuls): 8 tiles of
H=8, dk=64 in a loop took 21 ms instead of 72 ms (kernels.kda.kda_chunked keeps the full
pairwise form).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .kda import blocked_unit_lower_solve, kda_chunk, kda_decode_step

F32 = jnp.float32
I32 = jnp.int32


def _conv_windows(raw, conv_rows, cu_q_lens, rows, n):
    """Conv window [N, W-1, C] of row rows[i] after its first n[i] tokens of this step.

    Slot m (oldest first) holds the row's input at local index n - (W-1) + m: from this step's
    tokens when >= 0, else from the row's window before the step (slot n + m).
    """
    T = raw.shape[0]
    Wm1 = conv_rows.shape[1]
    j = n[:, None] - Wm1 + jnp.arange(Wm1)[None, :]  # [N, W-1]
    from_step = raw[jnp.clip(cu_q_lens[rows][:, None] + j, 0, T - 1)]  # [N, W-1, C]
    from_old = conv_rows[rows[:, None], jnp.clip(j + Wm1, 0, Wm1 - 1)]  # [N, W-1, C]
    return jnp.where((j >= 0)[..., None], from_step, from_old)


def ragged_causal_conv(raw, conv_rows, weight, tok_row, cu_q_lens, q_lens, snap_row, snap_len, commit_lens=None):
    """Depthwise causal conv over the flattened step, each row continuing its own window.

    raw [T, C] (pre-conv projections, any float dtype); conv_rows [R, W-1, C] the rows' windows
    before the step (last W-1 raw inputs, oldest first; zero for fresh rows); weight [C, W]
    (column W-1 multiplies the newest input); ``commit_lens`` [R] (default ``q_lens``): the
    tokens of each row the new window and snapshots may include (a speculative decode row
    commits its first token only; its drafts are journaled, ``kernels/kda_spec.py``).
    Returns, in float32:
      y [T, C]           conv output before the activation (zeros at padding tokens)
      new_conv [R, W-1, C]   window after each row's committed tokens (q_len 0: unchanged)
      snap_conv [NS, W-1, C] window after snap_len[s] tokens of row snap_row[s] (unused: 0)
    """
    if commit_lens is None:
        commit_lens = q_lens
    T, C = raw.shape
    R, Wm1, _ = conv_rows.shape
    raw = raw.astype(F32)
    conv = conv_rows.astype(F32)
    w = weight.astype(F32)
    cu = cu_q_lens.astype(I32)
    valid = tok_row < R
    r = jnp.minimum(tok_row, R - 1).astype(I32)
    i = jnp.arange(T, dtype=I32) - cu[r]  # local index of each token in its row
    raw_p = jnp.concatenate([jnp.zeros((Wm1, C), F32), raw], axis=0)
    y = raw * w[:, Wm1]
    for s in range(1, Wm1 + 1):  # input s tokens back: this step's token or the old window
        shifted = raw_p[Wm1 - s : Wm1 - s + T]
        old = conv[r, jnp.clip(Wm1 + i - s, 0, Wm1 - 1)]
        y = y + jnp.where((i >= s)[:, None], shifted, old) * w[:, Wm1 - s]
    y = jnp.where(valid[:, None], y, 0.0)

    commit = commit_lens.astype(I32)
    new_conv = _conv_windows(raw, conv, cu, jnp.arange(R, dtype=I32), commit)
    srow = jnp.minimum(snap_row, R - 1).astype(I32)
    slen = snap_len.astype(I32)
    s_ok = (snap_row < R) & (slen >= 1) & (slen <= commit[srow])
    snap_conv = _conv_windows(raw, conv, cu, srow, jnp.where(s_ok, slen, 0))
    snap_conv = jnp.where(s_ok[:, None, None], snap_conv, 0.0)
    return y, new_conv, snap_conv


def ragged_tiles(cu_q_lens, q_lens, start_pos, T: int, chunk_size: int = 64):
    """Enumerate the prefill tiles of a step in-graph (rows with q_len >= 2, in token order).

    A row's first tile has min(q_len, C - start_pos % C) tokens, later tiles end on absolute
    multiples of C (or at the row's end); no tile crosses rows. Returns a dict of int32 arrays:
    per row first_len [R], n_tiles [R], cu_tiles [R+1]; num_tiles (scalar, traced); per tile
    [NT_max] tile_row, tile_loc0 (first token, row-local), tile_tok0 (first token in the step),
    tile_len, tile_first, tile_last (bool); entries >= num_tiles are junk.

    NT_max = T // C + 2 R bounds the number of tiles: every tile of a row except its first and
    last holds exactly C tokens and those two hold >= 1 each, so a row with n >= 2 tiles has
    q_len >= (n - 2) C + 2, i.e. n - 2 <= floor(q_len / C) (also true for n = 1, and rows
    without tiles add 0). Summing over rows, a sum of floors being <= the floor of the sum:
    num_tiles <= 2 R + floor(sum q_len / C) <= 2 R + T // C.
    """
    C = chunk_size
    R = q_lens.shape[0]
    NT_max = T // C + 2 * R
    cu = cu_q_lens.astype(I32)
    ql = q_lens.astype(I32)
    first_len = jnp.minimum(ql, C - start_pos.astype(I32) % C)
    n_tiles = jnp.where(ql >= 2, 1 + (ql - first_len + C - 1) // C, 0)
    cu_tiles = jnp.concatenate([jnp.zeros((1,), I32), jnp.cumsum(n_tiles).astype(I32)])
    tiles = jnp.arange(NT_max, dtype=I32)
    tile_row = jnp.minimum(jnp.searchsorted(cu_tiles[1:], tiles, side="right"), R - 1).astype(I32)
    m = tiles - cu_tiles[tile_row]  # index of the tile within its row
    tile_loc0 = jnp.where(m == 0, 0, first_len[tile_row] + (m - 1) * C)
    tile_len = jnp.where(m == 0, first_len[tile_row], jnp.minimum(C, ql[tile_row] - tile_loc0))
    return dict(first_len=first_len, n_tiles=n_tiles, cu_tiles=cu_tiles, num_tiles=cu_tiles[R],
                tile_row=tile_row, tile_loc0=tile_loc0, tile_tok0=cu[tile_row] + tile_loc0,
                tile_len=tile_len, tile_first=m == 0, tile_last=m == n_tiles[tile_row] - 1)


def draft_tokens(x, cu_q_lens, drafts: int):
    """Each row's tokens ``1 .. drafts`` of ``x`` [T, ...] (a speculative decode row's drafts),
    ``[R, drafts, ...]``; entries past a row's tokens are junk (nothing reads them)."""
    T, R = x.shape[0], cu_q_lens.shape[0] - 1
    t = jnp.minimum(cu_q_lens[:R, None].astype(I32) + 1 + jnp.arange(drafts, dtype=I32)[None, :], T - 1)
    return x[t]


def kda_ragged(q, k, v, g, beta, state_rows, tok_row, cu_q_lens, q_lens, start_pos, snap_row, snap_len,
               chunk_size: int = 64, decode=None, drafts: int = 0):
    """KDA core over the flattened step (layout and snapshot rules in the module docstring).

    q, k [T, H, dk] (L2-normalised, q scaled); v [T, H, dv]; g [T, H, dk] log-decay <= 0;
    beta [T, H]; state_rows [R, H, dk, dv] each row's state before the step (zero for fresh
    rows). Returns float32 (o [T, H, dv] (zeros at padding tokens), new_state [R, H, dk, dv]
    (q_len-0 rows unchanged), snap_state [NS, H, dk, dv] (unused entries zeros)).

    ``decode`` (bool [R], the step's explicit row kinds; default: the rows of one token) and
    ``drafts`` (static, speculative decoding): a decode row is its last token plus up to
    ``drafts`` drafts, ``q_len`` 1 .. 1 + drafts. It never takes the tile path whatever its
    length: its first token is decoded and committed as plain decoding does, its drafts are
    verified from there without writing the state (``kernels/kda_spec.py``), and a fourth
    output, the journal ``(k, e^g, delta)`` ``[R, drafts, H, d]`` fp32, holds what the fold
    needs to commit the accepted ones. Snapshots of a decode row may cover its first token only.
    """
    T, H, dk = q.shape
    dv = v.shape[-1]
    R = state_rows.shape[0]
    NS = snap_row.shape[0]
    C = chunk_size
    valid = tok_row < R
    vt = valid[:, None, None]
    # padding tokens become exact no-ops (and finite whatever the caller left there)
    q, k, v, g = (jnp.where(vt, x.astype(F32), 0.0) for x in (q, k, v, g))
    beta = jnp.where(valid[:, None], beta.astype(F32), 0.0)
    S0 = state_rows.astype(F32)
    cu = cu_q_lens.astype(I32)
    ql = q_lens.astype(I32)
    sp = start_pos.astype(I32)

    # ---- decode rows: one recurrent step for all R rows, one gathered token per row
    if decode is None:
        if drafts:
            raise ValueError("speculative rows need the step's explicit row kinds (decode)")
        is_dec = ql == 1
    else:
        is_dec = (jnp.asarray(decode, bool) & (ql >= 1)) | (ql == 1)
    t_dec = jnp.minimum(cu[:R], T - 1)
    o1, S1 = kda_decode_step(q[t_dec], k[t_dec], v[t_dec], g[t_dec], beta[t_dec], S0)
    o_buf = jnp.zeros((T + C, H, dv), F32)  # C extra rows: a tile's slice never clamps
    o_buf = o_buf.at[jnp.where(is_dec, t_dec, T + C)].set(o1, mode="drop")
    new_state = jnp.where(is_dec[:, None, None, None], S1, S0)
    journal = None
    if drafts:  # verify the drafts from the committed state, in registers; journal each position
        from .kda_spec import _position, advance

        S, entries = S1, []
        for j in range(1, drafts + 1):
            live = is_dec & (j < ql)
            tj = jnp.minimum(cu[:R] + j, T - 1)
            kj = k[tj]
            oj, eg, delta = _position(q[tj], kj, v[tj], g[tj], beta[tj], S)
            o_buf = o_buf.at[jnp.where(live, tj, T + C)].set(oj, mode="drop")
            if j < drafts:
                S = jnp.where(live[:, None, None, None], advance(S, kj, eg, delta), S)
            entries.append((kj, eg, delta))
        journal = tuple(jnp.stack(e, axis=1) for e in zip(*entries))
    ql_tiles = ql if decode is None else jnp.where(is_dec, 0, ql)  # rows the tile path runs
    commit = jnp.where(is_dec, jnp.minimum(ql, 1), ql)  # tokens whose state a row commits

    srow = jnp.minimum(snap_row, R - 1).astype(I32)
    slen = snap_len.astype(I32)
    s_used = (snap_row < R) & (slen >= 1) & (slen <= commit[srow])

    def prefill(o_buf, new_state, snap_state):
        # ---- tiles of the q_len >= 2 rows, in token order
        tl = ragged_tiles(cu, ql_tiles, sp, T, chunk_size)
        NT_max = tl["tile_row"].shape[0]
        first_len, cu_tiles, num_tiles = tl["first_len"], tl["cu_tiles"], tl["num_tiles"]
        tile_row, tile_tok0, tile_loc0, tile_len = tl["tile_row"], tl["tile_tok0"], tl["tile_loc0"], tl["tile_len"]
        tile_first, tile_last = tl["tile_first"], tl["tile_last"]
        tiles = jnp.arange(NT_max, dtype=I32)

        # ---- snapshots strictly inside a row's step (snap_len == q_len is read off new_state)
        s_inner = s_used & (slen < commit[srow])
        s_m = jnp.where(slen - 1 < first_len[srow], 0, 1 + (slen - 1 - first_len[srow]) // C)
        s_tile = jnp.where(s_inner, cu_tiles[srow] + s_m, NT_max)  # NT_max: never visited
        s_order = jnp.argsort(s_tile).astype(I32)
        s_tile_sorted = s_tile[s_order]
        snap_lo = jnp.searchsorted(s_tile_sorted, tiles, side="left").astype(I32)
        snap_hi = jnp.searchsorted(s_tile_sorted, tiles, side="right").astype(I32)

        pad = lambda x: jnp.concatenate([x, jnp.zeros((C,) + x.shape[1:], F32)], axis=0)
        qp, kp, vp, gp, bp = (pad(x) for x in (q, k, v, g, beta))
        pos = jnp.arange(C, dtype=I32)

        def tile_body(i, carry):
            S, o_buf, new_state, snap_state = carry
            row, tok0, L = tile_row[i], tile_tok0[i], tile_len[i]
            S_in = jnp.where(tile_first[i], S0[row], S)
            live = pos < L
            sl = lambda x: jax.lax.dynamic_slice_in_dim(x, tok0, C, axis=0)
            qi, ki, vi = (jnp.swapaxes(sl(x), 0, 1) for x in (qp, kp, vp))  # [H, C, d]
            gi = jnp.swapaxes(jnp.where(live[:, None, None], sl(gp), 0.0), 0, 1)
            bi = jnp.swapaxes(jnp.where(live[:, None], sl(bp), 0.0), 0, 1)  # [H, C]
            Gi = jnp.cumsum(gi, axis=1)
            o, S_out, U = kda_chunk(qi, ki, vi, bi, Gi, S_in, solve=blocked_unit_lower_solve, sub=16)
            o_old = jax.lax.dynamic_slice_in_dim(o_buf, tok0, C, axis=0)
            o_new = jnp.where(live[:, None, None], jnp.swapaxes(o, 0, 1), o_old)
            o_buf = jax.lax.dynamic_update_slice_in_dim(o_buf, o_new, tok0, axis=0)
            keep = jnp.where(tile_last[i], S_out, new_state[row])
            new_state = jax.lax.dynamic_update_index_in_dim(new_state, keep, row, axis=0)

            def snap_body(j, snap_state):
                s = s_order[j]
                p = slen[s] - 1 - tile_loc0[i]  # state after tile token p
                Gp = jax.lax.dynamic_index_in_dim(Gi, p, axis=1)  # [H, 1, dk]
                diff = jnp.where((pos <= p)[None, :, None], Gp - Gi, -jnp.inf)  # mask before exp
                Sp = S_in * jnp.exp(Gp[:, 0, :])[..., None] + jnp.einsum("hjd,hjv->hdv", ki * jnp.exp(diff), U)
                return jax.lax.dynamic_update_index_in_dim(snap_state, Sp, s, axis=0)

            snap_state = jax.lax.fori_loop(snap_lo[i], snap_hi[i], snap_body, snap_state)
            return S_out, o_buf, new_state, snap_state

        init = (jnp.zeros((H, dk, dv), F32), o_buf, new_state, snap_state)
        _, o_buf, new_state, snap_state = jax.lax.fori_loop(0, num_tiles, tile_body, init)
        return o_buf, new_state, snap_state

    # a step without q_len >= 2 rows skips the tile path entirely (metadata, padding, loop);
    # a one-token step cannot have one, so its program leaves the path out
    snap_state = jnp.zeros((NS, H, dk, dv), F32)
    if T > 1:
        o_buf, new_state, snap_state = jax.lax.cond(jnp.any(ql_tiles >= 2), prefill, lambda *c: c, o_buf,
                                                    new_state, snap_state)

    s_end = s_used & (slen == commit[srow])
    snap_state = jnp.where(s_end[:, None, None, None], new_state[srow], snap_state)
    if drafts:
        return o_buf[:T], new_state, snap_state, journal
    return o_buf[:T], new_state, snap_state


def _bench_solve():  # the chunk-solve comparison quoted in the module docstring
    import functools
    import time

    import numpy as np

    from .kda import unit_lower_solve

    def neumann_blocks(A, *rhs, block=16):  # diagonal blocks inverted as a Neumann product
        C = A.shape[-1]
        R = jnp.concatenate(rhs, axis=-1)
        sl = [slice(i * block, (i + 1) * block) for i in range(C // block)]
        N = -jnp.stack([A[..., s, s] for s in sl], axis=-3)
        inv, n = jnp.eye(block, dtype=A.dtype) + N, 2
        while n < block:  # (I + D)^-1 = (I - D)(I + D^2)(I + D^4)..., D^block = 0 (block = C: whole A)
            N = N @ N
            inv = inv + N @ inv
            n *= 2
        X = []
        for i, s in enumerate(sl):
            r = R[..., s, :] - (A[..., s, : i * block] @ jnp.concatenate(X, axis=-2) if i else 0)
            X.append(inv[..., i, :, :] @ r)
        return jnp.concatenate(X, axis=-2)

    variants = [("row loop", unit_lower_solve), ("neumann 64", functools.partial(neumann_blocks, block=64)),
                ("neumann blocks 16", neumann_blocks)] + [
        (f"blocked {b}", functools.partial(blocked_unit_lower_solve, block=b)) for b in (8, 16, 32)]
    for H, dk in [(8, 64), (32, 128)]:
        for hard in (False, True):  # hard: nearly parallel keys, beta ~ 1, little decay
            rng = np.random.default_rng(0)
            C = 64
            k = rng.standard_normal((H, C, dk))
            if hard:
                k = 0.1 * k + rng.standard_normal((H, 1, dk))
            k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
            G = np.cumsum(-(0.01 if hard else 0.1) * np.abs(rng.standard_normal((H, C, dk))), axis=1)
            beta = rng.uniform(0.8 if hard else 0.0, 1.0, (H, C))
            diff = np.where(np.tril(np.ones((C, C), bool), -1)[:, :, None], G[:, :, None] - G[:, None], -np.inf)
            A = (np.einsum("htd,hjd,htjd->htj", k, k, np.exp(diff)) * beta[..., None]).astype(np.float32)
            v = rng.standard_normal((H, C, dk)).astype(np.float32)
            want = np.linalg.solve(np.eye(C) + A.astype(np.float64), np.concatenate([v, k], -1).astype(np.float64))
            for name, f in variants:
                jf = jax.jit(f)
                got = jf(A, v, k)
                got = np.concatenate([np.asarray(x) for x in got], -1) if isinstance(got, list) else np.asarray(got)
                ts = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    jax.block_until_ready(jf(A, v, k))
                    ts.append(time.perf_counter() - t0)
                err = np.abs(got - want).max() / np.abs(want).max()
                print(f"H={H} dk={dk} hard={hard} {name}: median {np.median(ts) * 1e3:.3f} ms, "
                      f"min {np.min(ts) * 1e3:.3f} ms, rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    _bench_solve()
