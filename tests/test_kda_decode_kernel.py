"""The KDA decode Pallas kernel (issue #15, kernel 2) in TPU interpret mode (race detection on,
uninitialised memory NaN) against its pure-JAX reference, and the reference against a
token-by-token composition of the layer's formulas.

Random tiny shapes (H 2-4 heads of width 16-32, W = 4, up to 6 rows, 8 slots, 2 layers in
the pools), both gate variants, bf16 token inputs, rows_per_tile not dividing R, fresh rows
whose slot holds NaN / huge garbage, rows past ``n_dec`` (pools untouched), snapshots, prefix
hits (read slot != write slot), out-of-range write slots (dropped). Outputs within 1e-5 of the
reference; the pools byte-identical to the input outside the (layer, slot) entries the call
writes, and those entries within 1e-5 of the reference's; no race reported, also with DMAs
executed eagerly. Grids stay at a few steps each (an interpreted step of this kernel costs
tens of ms; each configuration compiles once, ~3-4 s, so configurations are few).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3serve.kernels.kda import kda_decode_step
from k3serve.kernels.kda_decode_kernel import kda_decode, kda_decode_reference

try:
    INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
except TypeError:  # an older jax without those fields
    INTERPRET = pltpu.InterpretParams()

TOL = 1e-5
L, S, W = 2, 8, 4


def _races_found() -> bool:
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:
        return False
    return bool(getattr(ipc.races, "races_found", False)) if getattr(ipc, "races", None) is not None else False


def _inputs(rng, T, H, d, dtype=np.float32):
    P = H * d
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(
        qkv_raw=cast(rng.standard_normal((T, 3 * P))), f=cast(rng.standard_normal((T, P)) * 2),
        beta=cast(rng.random((T, H))), gate_out=cast(rng.standard_normal((T, P))),
        state_pool=jnp.asarray(rng.standard_normal((L, S, H, d, d)) * 0.3, jnp.float32),
        conv_pool=jnp.asarray(rng.standard_normal((L, S, W - 1, 3 * P)), jnp.float32),
        conv_w=jnp.asarray(rng.standard_normal((3 * P, W)) * 0.5, jnp.float32),
        A_log=jnp.asarray(rng.standard_normal(H) * 0.5, jnp.float32),
        dt_bias=jnp.asarray(rng.standard_normal(P) * 0.3, jnp.float32),
        o_norm=jnp.asarray(1 + 0.2 * rng.standard_normal(d), jnp.float32))


def _call(fn, x, meta, **kw):
    return fn(x["qkv_raw"], x["f"], x["beta"], x["gate_out"], x["state_pool"], x["conv_pool"], meta["layer"],
              *(jnp.asarray(meta[k], jnp.int32) for k in ("tok", "read", "write", "snap", "fresh")), meta["n_dec"],
              x["conv_w"], x["A_log"], x["dt_bias"], x["o_norm"], **kw)


def _touched(meta):
    """(layer, slot) entries the call may write: live rows' in-range write and snapshot slots."""
    n = meta["n_dec"]
    slots = [s for key in ("write", "snap") for s in meta[key][:n] if 0 <= s < S]
    assert len(slots) == len(set(slots)), "test metadata must keep written slots distinct"
    return {(meta["layer"], s) for s in slots}


def _check(x, meta, blocks, lower_bound, poison=(), interpret=INTERPRET):
    """Kernel vs reference on one metadata set; returns the max abs errors (o, state, conv)."""
    x = dict(x)
    for slot in poison:  # garbage in fresh rows' read slots: must not leak
        lay = meta["layer"]
        x["state_pool"] = x["state_pool"].at[lay, slot].set(jnp.nan).at[lay, slot, 0].set(3e38)
        x["conv_pool"] = x["conv_pool"].at[lay, slot].set(-1e30).at[lay, slot, 0].set(jnp.nan)
    want = _call(kda_decode_reference, x, meta, lower_bound=lower_bound)
    got = _call(kda_decode, x, meta, lower_bound=lower_bound, blocks=blocks, interpret=interpret)
    assert not _races_found()
    o, o_ref = np.asarray(got[0]), np.asarray(want[0])
    assert o.shape == o_ref.shape == (len(meta["tok"]),) + x["state_pool"].shape[2:4]
    assert np.isfinite(o).all()
    np.testing.assert_allclose(o, o_ref, rtol=TOL, atol=TOL)
    assert not o[meta["n_dec"]:].any()  # skipped rows
    touched = _touched(meta)
    errs = [float(np.abs(o - o_ref).max())]
    for k, name in ((1, "state_pool"), (2, "conv_pool")):
        before, new, ref = np.asarray(x[name]), np.asarray(got[k]), np.asarray(want[k])
        mask = np.zeros(before.shape[:2], bool)
        for lay, s in touched:
            mask[lay, s] = True
        # untouched entries (the other layer entirely): the input, bit for bit, as the reference keeps them
        assert np.array_equal(new[~mask].view(np.uint32), before[~mask].view(np.uint32)), name
        assert np.array_equal(new[~mask].view(np.uint32), ref[~mask].view(np.uint32)), name
        assert np.isfinite(new[mask]).all(), name
        np.testing.assert_allclose(new[mask], ref[mask], rtol=TOL, atol=TOL, err_msg=name)
        errs.append(float(np.abs(new[mask] - ref[mask]).max()) if mask.any() else 0.0)
    return errs


# metadata sets on R = 5 rows (slots 0..7 of layer `layer`)
META_5 = [
    # row 0 in place; row 1 prefix hit (reads snapshot slot 5, writes 2) + snapshot to 7; row 2
    # fresh over garbage (slot 3); row 3 in place + snapshot to 6; row 4 past n_dec (slot 0)
    dict(layer=1, tok=[3, 0, 7, 2, 5], read=[1, 5, 3, 4, 0], write=[1, 2, 3, 4, 0], snap=[-1, 7, -1, 6, 5],
         fresh=[0, 0, 1, 0, 0], n_dec=4, poison=[3]),
    # all rows live, layer 0; a fresh row reading a garbage slot it does not write; a write slot
    # out of range (dropped, its snapshot still taken); tokens repeated
    dict(layer=0, tok=[1, 1, 8, 4, 0], read=[6, 2, 0, 5, 3], write=[7, 2, 1, S, 3], snap=[-1, -1, -1, 4, -1],
         fresh=[1, 0, 0, 0, 1], n_dec=5, poison=[6, 3]),
    # nothing to do: n_dec = 0 leaves both pools untouched
    dict(layer=1, tok=[0, 1, 2, 3, 4], read=[0, 1, 2, 3, 4], write=[0, 1, 2, 3, 4], snap=[5, 6, 7, -1, -1],
         fresh=[0, 0, 0, 0, 0], n_dec=0, poison=[]),
]


@pytest.fixture(scope="module")
def inputs_h4():
    return _inputs(np.random.default_rng(0), T=9, H=4, d=16)


@pytest.mark.parametrize("case", range(len(META_5)))
def test_k3_gate_matches_reference(inputs_h4, case):
    """K3's bounded gate; 3 row tiles of 2 (R = 5: the last tile half padding) x 2 head blocks."""
    meta = dict(META_5[case])
    _check(inputs_h4, meta, blocks=(2, 2), lower_bound=-5.0, poison=meta.pop("poison"))


def test_eager_dmas(inputs_h4):
    """The same call with DMAs executed when started (the default runs them at the wait): a
    buffer read before its wait, or changed while an outgoing copy is in flight, would show."""
    try:
        eager = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", dma_execution_mode="eager")
    except TypeError:
        pytest.skip("this jax's InterpretParams has no dma_execution_mode")
    meta = dict(META_5[0])
    _check(inputs_h4, meta, blocks=(2, 2), lower_bound=-5.0, poison=meta.pop("poison"), interpret=eager)


def test_fresh_rows_ignore_what_their_slot_holds(inputs_h4):
    """A fresh row gives the same bits whether its read slot holds garbage or zeros (the
    stale-slot = fresh-slot check)."""
    meta = dict(META_5[1])
    runs = []
    for fill in (jnp.nan, 0.0):
        x = dict(inputs_h4)
        for slot in meta["poison"]:
            x["state_pool"] = x["state_pool"].at[0, slot].set(fill)
            x["conv_pool"] = x["conv_pool"].at[0, slot].set(fill)
        runs.append([np.asarray(a) for a in _call(kda_decode, x, meta, lower_bound=-5.0, blocks=(2, 2),
                                                  interpret=INTERPRET)])
    assert np.array_equal(runs[0][0], runs[1][0])
    for w in (7, 3):  # the fresh rows' write slots
        for k in (1, 2):
            assert np.array_equal(runs[0][k][0, w], runs[1][k][0, w])


def test_kimi_linear_gate_bf16_inputs():
    """Kimi Linear's softplus gate, bf16 token inputs, H = 2 heads of 32 (one head per block),
    R = 6 rows in tiles of 4, a prefix hit and a fresh garbage slot."""
    rng = np.random.default_rng(1)
    x = _inputs(rng, T=8, H=2, d=32, dtype=jnp.bfloat16)
    meta = dict(layer=0, tok=[7, 2, 5, 0, 3, 6], read=[0, 5, 2, 7, 1, 5], write=[0, 3, 2, 6, 1, 5],
                snap=[-1, -1, 4, -1, -1, -1], fresh=[0, 0, 0, 1, 0, 0], n_dec=5)
    _check(x, meta, blocks=(4, 1), lower_bound=None, poison=[7])


def test_rejects_blocks_that_do_not_divide_heads(inputs_h4):
    meta = dict(META_5[0])
    with pytest.raises(ValueError, match="heads_per_block"):
        _call(kda_decode, inputs_h4, meta, blocks=(2, 3), interpret=INTERPRET)


# ---- the oracle against the layer's formulas, token by token


def _silu(x):
    return x / (1 + np.exp(-x))


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _compose(x, toks, lower_bound, eps):
    """One sequence decoded token by token from a fresh state, formulas of model/kda.py in
    float64 (conv over the zero-padded history, column W-1 on the newest token; SiLU; L2 norms
    with eps 1e-6 inside the rsqrt; q times d^-1/2; the gate; output RMSNorm times o_norm times
    sigmoid(gate)) around ``kernels.kda.kda_decode_step``. Returns o [len(toks), H, d]."""
    H, d = x["state_pool"].shape[2:4]
    P = H * d
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    raw, f, beta, go = (f64(x[k])[toks] for k in ("qkv_raw", "f", "beta", "gate_out"))
    cw, A, dtb, on = (f64(x[k]) for k in ("conv_w", "A_log", "dt_bias", "o_norm"))
    hist = np.concatenate([np.zeros((W - 1, 3 * P)), raw])
    S = jnp.zeros((H, d, d), jnp.float32)
    out = []
    for t in range(len(toks)):
        y = _silu(sum(hist[t + i] * cw[:, i] for i in range(W)))
        q, k, v = (y[c * P:(c + 1) * P].reshape(H, d) for c in range(3))
        l2 = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
        q, k = l2(q) * d ** -0.5, l2(k)
        fx = f[t].reshape(H, d) + dtb.reshape(H, d)
        a = np.exp(A)[:, None]
        g = lower_bound * _sigmoid(a * fx) if lower_bound is not None else -a * np.logaddexp(fx, 0)
        o, S = kda_decode_step(*(jnp.asarray(z, jnp.float32) for z in (q, k, v, g, beta[t])), S)
        o = np.asarray(o, np.float64)
        o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * on * _sigmoid(go[t].reshape(H, d))
        out.append(o)
    return np.stack(out)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_reference_matches_token_by_token_composition(lower_bound):
    """Four successive decode calls of the reference over shared pools: rows A and B start
    fresh in slots 1 and 2; after call 2 row A also snapshots into slot 6; from call 3 a third
    row C resumes from that snapshot (a prefix hit: reads 6, writes 3) with A's later tokens,
    so its outputs equal A's. Every output equals the per-sequence composition of the
    formulas within 1e-5; the other layer stays untouched."""
    rng = np.random.default_rng(2)
    H, d, eps = 3, 16, 1e-5
    x = _inputs(rng, T=12, H=H, d=d)
    seq = {"A": [0, 1, 2, 3], "B": [4, 5, 6, 7]}
    want = {k: _compose(x, v, lower_bound, eps) for k, v in seq.items()}
    sp, cp = x["state_pool"], x["conv_pool"]
    other = (np.asarray(sp[0]).copy(), np.asarray(cp[0]).copy())
    for step in range(4):
        c_live = step >= 2
        meta = dict(layer=1, tok=[seq["A"][step], seq["B"][step], seq["A"][step]],
                    read=[1, 2, 6 if step == 2 else 3], write=[1, 2, 3], snap=[6 if step == 1 else -1, -1, -1],
                    fresh=[step == 0, step == 0, 0], n_dec=3 if c_live else 2)
        o, sp, cp = _call(kda_decode_reference, dict(x, state_pool=sp, conv_pool=cp), meta,
                          lower_bound=lower_bound, eps=eps)
        o = np.asarray(o)
        np.testing.assert_allclose(o[0], want["A"][step], rtol=TOL, atol=TOL)
        np.testing.assert_allclose(o[1], want["B"][step], rtol=TOL, atol=TOL)
        if c_live:
            np.testing.assert_allclose(o[2], want["A"][step], rtol=TOL, atol=TOL)
        else:
            assert not o[2].any()
    assert np.array_equal(np.asarray(sp[0]), other[0]) and np.array_equal(np.asarray(cp[0]), other[1])


def test_row_layout_conv_pool(inputs_h4):
    """The conv pool in the row layout ``[L, S, (W-1)*3H, d]`` (the same elements; the layout
    that compiles for TPU without a copy of the pool, tests/test_tpu_aot_kda.py): same results
    as the reference on the same pool, other entries untouched."""
    x = dict(inputs_h4)
    H, d = x["state_pool"].shape[2:4]
    x["conv_pool"] = x["conv_pool"].reshape(L, S, (W - 1) * 3 * H, d)
    meta = dict(META_5[0])
    _check(x, meta, blocks=(2, 2), lower_bound=-5.0, poison=meta.pop("poison"))
