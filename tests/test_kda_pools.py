"""One KDA layer's core on the pools with the Pallas kernels (``ops.kda_layer_on_pools``, what the
model runs on a Pallas backend) against the model's reference core on gathered rows
(``model.kda._flat_core`` + the gated output norm, results scattered by slot), in TPU interpret
mode: one-token rows anywhere in the step (not only first), a fresh row over a garbage slot, a
prefix hit (read slot != write slot), snapshots on a one-token row and mid-row in a prefill
row, an empty row, padding tokens, and a masked layer (all ``q_len`` 0) that must change
nothing."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3serve.kernels import ops
from k3serve.kernels.kda_decode_kernel import _log_decay, _rms_normalize
from k3serve.model.kda import _flat_core

H, D, W, L, S = 2, 8, 4, 2, 10
P = H * D
T, R = 24, 5
EPS, LB = 1e-5, -5.0


# rows: (q_len, start, read, write, fresh); row 4 is empty; tokens 21.. are padding
ROWS = [(9, 3, 3, 4, False), (1, 5, 1, 1, False), (1, 0, 2, 2, True), (10, 0, 9, 5, True), (0, 0, 0, S, True)]
SNAPS = [(0, 4, 6), (1, 1, 7), (3, 10, 8)]  # (row, length, slot): mid-row, one-token row, row end


def _step(rows=ROWS, snaps=SNAPS):
    cu = np.zeros(R + 1, np.int32)
    tok_row = np.full(T, R, np.int32)
    t = 0
    for i, (q, *_rest) in enumerate(rows):
        tok_row[t:t + q] = i
        t += q
        cu[i + 1] = t
    col = lambda j, dt=np.int32: np.array([r[j] for r in rows], dt)  # noqa: E731
    sr = np.array([s[0] for s in snaps] + [R], np.int32)
    sl = np.array([s[1] for s in snaps] + [0], np.int32)
    ss = np.array([s[2] for s in snaps] + [S], np.int32)
    return dict(tok_row=tok_row, cu_q_lens=cu, q_lens=col(0), start_pos=col(1), read_slot=col(2), write_slot=col(3),
                fresh=col(4, bool), snap_row=sr, snap_len=sl, snap_slot=ss)


def _inputs(seed):
    rng = np.random.default_rng(seed)
    f32 = np.float32
    tok = dict(qkv_raw=rng.normal(size=(T, 3 * P)).astype(f32), f=rng.normal(size=(T, P)).astype(f32),
               beta=(1 / (1 + np.exp(-rng.normal(size=(T, H))))).astype(f32),
               gate_out=rng.normal(size=(T, P)).astype(f32))
    par = dict(conv_w=(0.5 * rng.normal(size=(3 * P, W))).astype(f32), A_log=rng.normal(size=(H,)).astype(f32),
               dt_bias=rng.normal(size=(P,)).astype(f32), o_norm=(1 + 0.1 * rng.normal(size=(D,))).astype(f32))
    state = (0.3 * rng.normal(size=(L, S, H, D, D))).astype(f32)
    conv = rng.normal(size=(L, S, W - 1, 3 * P)).astype(f32)
    state[1, 2] = np.nan  # the fresh row's read slot holds garbage
    conv[1, 2] = 1e30
    return tok, par, state, conv


def _reference(tok, par, state, conv, layer, m):
    """The model's reference core on gathered rows, scattered back by slot."""
    fresh = m["fresh"]
    st_rows = np.where(fresh[:, None, None, None], 0.0, state[layer, m["read_slot"]])
    cv_rows = np.where(fresh[:, None, None], 0.0, conv[layer, m["read_slot"]])
    j = {k: jnp.asarray(v) for k, v in m.items()}
    a = np.exp(par["A_log"])[:, None]
    g = _log_decay(jnp.asarray(tok["f"]).reshape(T, H, D), a, jnp.asarray(par["dt_bias"]).reshape(H, D), LB)
    o, (new_conv, new_state, snap_conv, snap_state) = _flat_core(
        jnp.asarray(tok["qkv_raw"]), jnp.asarray(par["conv_w"]), g, jnp.asarray(tok["beta"]), jnp.asarray(cv_rows),
        jnp.asarray(st_rows), j["tok_row"], j["cu_q_lens"], j["q_lens"], j["start_pos"], j["snap_row"],
        j["snap_len"], H=H, dk=D, P=P)
    gate = jax.nn.sigmoid(jnp.asarray(tok["gate_out"]).reshape(T, H, D))
    o = np.array(_rms_normalize(o, EPS) * par["o_norm"] * gate)
    o[m["tok_row"] >= R] = 0.0
    state, conv = state.copy(), conv.copy()
    for r in range(R):
        if m["q_lens"][r] and m["write_slot"][r] < S:
            state[layer, m["write_slot"][r]] = new_state[r]
            conv[layer, m["write_slot"][r]] = new_conv[r]
    for e in range(len(m["snap_row"])):
        if m["snap_row"][e] < R and m["snap_slot"][e] < S:
            state[layer, m["snap_slot"][e]] = snap_state[e]
            conv[layer, m["snap_slot"][e]] = snap_conv[e]
    return o, state, conv


@functools.partial(jax.jit, static_argnames="prefill_rows")
def _core(tok, par, state, conv, layer, m, prefill_rows=True):  # metadata are arguments
    return ops.kda_layer_on_pools(
        *(tok[k] for k in ("qkv_raw", "f", "beta", "gate_out")),
        *(par[k] for k in ("conv_w", "A_log", "dt_bias", "o_norm")), state, conv, layer, m["tok_row"],
        m["cu_q_lens"], m["q_lens"], m["start_pos"], m["read_slot"], m["write_slot"], m["fresh"], m["snap_row"],
        m["snap_len"], m["snap_slot"], lower_bound=LB, eps=EPS, backend="pallas-interpret",
        prefill_rows=prefill_rows)


def _run(tok, par, state, conv, layer, m, **kw):
    return _core(*(jax.tree.map(jnp.asarray, x) for x in (tok, par, state, conv)), jnp.int32(layer),
                 jax.tree.map(jnp.asarray, m), **kw)


def test_layer_on_pools_matches_the_reference_core():
    tok, par, state, conv = _inputs(0)
    m = _step()
    o, st, cv = (np.asarray(x) for x in _run(tok, par, state, conv, 1, m))
    o_ref, st_ref, cv_ref = _reference(tok, par, state, conv, 1, m)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    written = sorted({4, 1, 2, 5, 6, 7, 8})
    np.testing.assert_allclose(st[1, written], st_ref[1, written], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cv[1, written], cv_ref[1, written], rtol=1e-5, atol=1e-5)
    untouched = [s for s in range(S) if s not in written]
    # slots nothing wrote, and the other layer, are bit-identical (NaN included)
    np.testing.assert_array_equal(st[1, untouched], state[1, untouched])
    np.testing.assert_array_equal(cv[1, untouched], conv[1, untouched])
    np.testing.assert_array_equal(st[0], state[0])
    np.testing.assert_array_equal(cv[0], conv[0])


def test_decode_step_takes_no_prefill_path():
    """A step whose rows have at most one token (a fresh row, a prefix hit, a snapshot after the
    token, an empty row): the prefill path's ``cond`` is not taken, and the program built without
    that path (``prefill_rows=False``, what ``k3serve compile`` measures a decode step with) gives
    the same outputs and pools, bit for bit; both match the reference core."""
    tok, par, state, conv = _inputs(2)
    m = _step([(1, 5, 3, 4, False), (1, 5, 1, 1, False), (1, 0, 2, 2, True), (1, 7, 9, 5, False), (0, 0, 0, S, True)],
              [(1, 1, 7), (3, 1, 8)])
    got = [np.asarray(x) for x in _run(tok, par, state, conv, 1, m)]
    static = [np.asarray(x) for x in _run(tok, par, state, conv, 1, m, prefill_rows=False)]
    for a, b in zip(got, static):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got, _reference(tok, par, state, conv, 1, m)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_masked_layer_changes_nothing():
    tok, par, state, conv = _inputs(1)
    m = dict(_step(), q_lens=np.zeros(R, np.int32))
    o, st, cv = (np.asarray(x) for x in _run(tok, par, state, conv, 0, m))
    assert not o.any()
    np.testing.assert_array_equal(st, state)
    np.testing.assert_array_equal(cv, conv)


def test_row_layout_conv_pool_gives_the_same_result():
    """The conv pool in the row layout ``[L, S, (W-1)*3H, d]`` (the same elements; the one that
    compiles for TPU without a copy of the pool, tests/test_tpu_aot_kda.py): the same outputs
    and pools, bit for bit, as the ``[L, S, W-1, 3P]`` layout."""
    tok, par, state, conv = _inputs(0)
    m = _step()
    o, st, cv = (np.asarray(x) for x in _run(tok, par, state, conv, 1, m))
    o2, st2, cv2 = (np.asarray(x) for x in _run(tok, par, state, conv.reshape(L, S, (W - 1) * 3 * H, D), 1, m))
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(st2, st)
    np.testing.assert_array_equal(cv2.reshape(cv.shape), cv)


def test_conv_pool_rows_blocks_hold_each_ranks_heads():
    """The engine's conv pool stores each window as rows of one head (``model.cache``):
    row ``(g, t, part, h)`` is head ``g * Hl + h``'s ``d`` values of window position ``t`` of
    q, k or v, so with the KDA heads split over G ranks rank j's block of rows is exactly the
    kernels' row layout for its heads, followed by zero rows up to a multiple of 8 (a block of
    whole TPU tiles: ``conv_block_rows``); the inverse restores ``[W-1, q | k | v]``, and with
    G = 1 the rows are the logical window's elements in order, unpadded."""
    from k3serve.model.cache import conv_block_rows, conv_groups_of, conv_pool_logical, conv_pool_rows

    G, H, d, W1 = 4, 8, 2, 3
    Pw, Hl = H * d, H // G
    x = jnp.arange(2 * W1 * 3 * Pw, dtype=jnp.float32).reshape(2, W1, 3 * Pw)  # [slots, W-1, q|k|v]
    y = conv_pool_rows(x, G, d)
    B = conv_block_rows(W1, H, G)
    assert B == 24 and y.shape == (2, G * B, d)  # 18 rows a rank, padded to 24
    for j in range(G):
        block = y[:, j * B:j * B + W1 * 3 * Hl].reshape(2, W1, 3, Hl, d)
        for part in range(3):
            heads = x[..., part * Pw:(part + 1) * Pw].reshape(2, W1, H, d)[:, :, j * Hl:(j + 1) * Hl]
            np.testing.assert_array_equal(block[:, :, part], heads)
        assert not np.asarray(y[:, j * B + W1 * 3 * Hl:(j + 1) * B]).any()
    np.testing.assert_array_equal(conv_pool_logical(y, G, W1, H), x)
    np.testing.assert_array_equal(conv_pool_rows(x, 1, d), x.reshape(2, W1 * 3 * H, d))
    np.testing.assert_array_equal(conv_pool_logical(conv_pool_rows(x, 1, d), 1, W1, H), x)
    assert conv_groups_of(jax.device_put(y)) == 1 and conv_groups_of(np.asarray(y)) == 1
