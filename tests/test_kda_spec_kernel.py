"""The KDA decode kernel's record mode (``kernels/kda_spec_kernel.py``: fused fold, commit of the
first token, drafts verified and journaled) in TPU interpret mode, against the model's reference
path on the same rows (``kda_spec_decode_reference``: ``kda_fold`` / ``conv_window_commit``,
``ragged_causal_conv`` committing one token, ``kda_ragged(decode=..., drafts=D)``).

One call holds rows of 0, 1, 2 and D drafts, a row without a journal entry, a fresh row, a
snapshot, a prefix hit and a row past ``n_dec``; the fold lengths rotate over the rows so that
every row sees every fold length 0..D over D + 1 calls. Outputs (each row's valid positions),
committed states, conv windows and journal entries (each row's drafts) within 2e-5 of the
reference: the kernel's delta step multiplies ``k · (S e^g)`` where the reference multiplies
``(k e^g) · S`` and sums in another order (fp32 rounding, the same gap as ``kda_decode`` against
its reference); the pre-conv journal rows are a copy (exact). Everything else in the pools and
the journal is byte-identical to the input.

The fused fold against ``model.k3.fold_journal`` followed by the plain decode kernel
(``kda_decode``): the conv window bit for bit (a copy); state and output within 1e-6 (measured
6e-8 and 2e-7). Both run ``advance``'s operations in its order and the first token
``kda_decode``'s formulas, but the interpreter runs each kernel body as its own XLA:CPU program,
and those round the same multiply-adds differently (even without a fold the committed state
differs from ``kda_decode``'s by 1 ulp), so bit-for-bit is not observable here.

Five interpret-mode tests, 20 s on a 2-core host (~2 s per call: 3 row tiles x 2 head blocks),
and the TPU compile at K3 size, 11 s (its docstring has the figures).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3serve.kernels.kda_decode_kernel import kda_decode
from k3serve.kernels.kda_spec_kernel import kda_spec_decode, kda_spec_decode_reference
from k3serve.model.k3 import fold_journal

try:
    INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
except TypeError:  # an older jax without those fields
    INTERPRET = pltpu.InterpretParams()

TOL = 2e-5
L, S, W, D, J = 2, 8, 4, 3, 4
H, d = 4, 16
N = D + 1
LAYER = 1
# rows: drafts, journal entry, read slot, write slot, snapshot slot, fresh
ROWS = [dict(nd=0, jrow=1, rd=0, wr=0, sn=-1, fresh=0),
        dict(nd=1, jrow=0, rd=1, wr=1, sn=6, fresh=0),
        dict(nd=D, jrow=3, rd=7, wr=2, sn=-1, fresh=0),  # a prefix hit: reads slot 7
        dict(nd=2, jrow=-1, rd=3, wr=3, sn=-1, fresh=0),  # no journal: no fold, nothing journaled
        dict(nd=D, jrow=2, rd=4, wr=4, sn=-1, fresh=1),  # fresh: its slot holds garbage
        dict(nd=1, jrow=-1, rd=5, wr=5, sn=-1, fresh=0)]  # past n_dec: untouched
R = len(ROWS)
N_DEC = R - 1


def _inputs(rng):
    T = R * N + 2
    P = H * d
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    x = dict(qkv_raw=f32(rng.standard_normal((T, 3 * P))), f=f32(rng.standard_normal((T, P)) * 2),
             beta=f32(rng.random((T, H))), gate_out=f32(rng.standard_normal((T, P))),
             state_pool=f32(rng.standard_normal((L, S, H, d, d)) * 0.3),
             conv_pool=f32(rng.standard_normal((L, S, W - 1, 3 * P))),
             conv_w=f32(rng.standard_normal((3 * P, W)) * 0.5), A_log=f32(rng.standard_normal(H) * 0.5),
             dt_bias=f32(rng.standard_normal(P) * 0.3), o_norm=f32(1 + 0.2 * rng.standard_normal(d)))
    k = rng.standard_normal((L, J, D, H, d))
    journal = (f32(k / np.linalg.norm(k, axis=-1, keepdims=True)), f32(rng.uniform(0.5, 1.0, (L, J, D, H, d))),
               f32(rng.standard_normal((L, J, D, H, d)) * 0.3), f32(rng.standard_normal((L, J, D, 3 * P))))
    fr = ROWS[4]["rd"]  # garbage in the fresh row's slot must not leak
    x["state_pool"] = x["state_pool"].at[LAYER, fr].set(jnp.nan)
    x["conv_pool"] = x["conv_pool"].at[LAYER, fr].set(-1e30)
    return x, journal


def _meta(fold):
    m = {k: np.array([r[k] for r in ROWS], np.int32) for k in ("nd", "jrow", "rd", "wr", "sn", "fresh")}
    m["tok"] = np.arange(R, dtype=np.int32) * N + 1  # the rows' tokens are consecutive
    m["fold"] = np.asarray(fold, np.int32)
    return m


def _call(fn, x, journal, m, **kw):
    a = lambda k: jnp.asarray(m[k], jnp.int32)  # noqa: E731
    return fn(x["qkv_raw"], x["f"], x["beta"], x["gate_out"], x["state_pool"], x["conv_pool"], journal, LAYER,
              a("tok"), a("nd"), a("jrow"), a("fold"), a("rd"), a("wr"), a("sn"), a("fresh").astype(bool), N_DEC,
              x["conv_w"], x["A_log"], x["dt_bias"], x["o_norm"], lower_bound=-5.0, **kw)


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all(), what
    if not got.size:
        return
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err < TOL, (what, err)


@pytest.fixture(scope="module")
def data():
    return _inputs(np.random.default_rng(0))


@pytest.mark.parametrize("shift", range(D + 1))
def test_record_mode_matches_the_reference(data, shift):
    x, journal = data
    # fold lengths rotate: over the D + 1 cases every row folds 0..D (rows without an entry fold nothing)
    m = _meta([(i + shift) % (D + 1) for i in range(R)])
    t0 = time.perf_counter()
    got = _call(kda_spec_decode, x, journal, m, blocks=(2, 2), interpret=INTERPRET)
    jax.block_until_ready(got)
    print(f"kernel call {time.perf_counter() - t0:.2f} s")
    want = _call(kda_spec_decode_reference, x, journal, m)
    o, o_ref = np.asarray(got[0]), np.asarray(want[0])
    assert o.shape == o_ref.shape == (R, N, H, d)
    for r in range(N_DEC):  # each live row's first token and drafts
        _close(o[r, :1 + m["nd"][r]], o_ref[r, :1 + m["nd"][r]], ("o", r))
    assert (o[N_DEC:] == 0).all()
    for name, g, w, x0 in (("state", got[1], want[1], x["state_pool"]), ("conv", got[2], want[2], x["conv_pool"])):
        g, w, x0 = np.asarray(g), np.asarray(w), np.asarray(x0)
        written = {(LAYER, s) for r in range(N_DEC) for s in (m["wr"][r], m["sn"][r]) if s >= 0}
        for lay in range(L):
            for s in range(S):
                if (lay, s) in written:
                    _close(g[lay, s], w[lay, s], (name, s))
                else:
                    np.testing.assert_array_equal(g[lay, s], x0[lay, s], err_msg=f"{name} {lay} {s}")
    for c, (g, w, x0) in enumerate(zip(got[3], want[3], journal)):
        g, w, x0 = np.array(g), np.asarray(w), np.array(x0)
        for r, row in enumerate(ROWS):
            e = row["jrow"]
            if e < 0 or r >= N_DEC:
                continue
            nd = row["nd"]
            if c == 3:  # the pre-conv rows: a copy
                np.testing.assert_array_equal(g[LAYER, e, :nd], w[LAYER, e, :nd])
            else:
                _close(g[LAYER, e, :nd], w[LAYER, e, :nd], ("journal", c, r))
            g[LAYER, e], x0[LAYER, e] = 0, 0  # written (drafts past nd: junk)
        np.testing.assert_array_equal(g, x0, err_msg=f"journal part {c} outside the written entries")


def test_fused_fold_equals_fold_then_plain_decode(data):
    """Rows without drafts: the fused kernel == ``fold_journal`` then ``kda_decode`` within
    1e-6 (a few fp32 ulps; measured 2e-7 on o, 6e-8 on the state)."""
    x, journal = data
    m = _meta([D, 2, 1, 0, 3, 0])
    m["nd"][:] = 0
    m["sn"][:] = -1
    got = _call(kda_spec_decode, x, journal, m, blocks=(2, 2), interpret=INTERPRET)
    # the reference fold, written back to the read slots, then the plain decode kernel
    rd = jnp.asarray(m["rd"])
    live = np.arange(R) < N_DEC
    jr = jnp.asarray(np.where(live, m["jrow"], -1))
    fresh = jnp.asarray(m["fresh"], bool)
    st, cv = fold_journal(jnp.where(fresh[None, :, None, None, None], 0.0, x["state_pool"][:, rd]),
                          jnp.where(fresh[None, :, None, None], 0.0, x["conv_pool"][:, rd]), journal, jr,
                          jnp.asarray(m["fold"]))
    sp = x["state_pool"].at[:, rd].set(st)
    cp = x["conv_pool"].at[:, rd].set(cv)
    want = kda_decode(x["qkv_raw"], x["f"], x["beta"], x["gate_out"], sp, cp, LAYER, jnp.asarray(m["tok"]), rd,
                      jnp.asarray(m["wr"]), jnp.asarray(m["sn"]), jnp.zeros((R,), bool), N_DEC, x["conv_w"],
                      x["A_log"], x["dt_bias"], x["o_norm"], lower_bound=-5.0, blocks=(2, 2), interpret=INTERPRET)
    for r in range(N_DEC):
        w = m["wr"][r]
        for g, wa in ((np.asarray(got[0])[r, 0], np.asarray(want[0])[r]),
                      (np.asarray(got[1])[LAYER, w], np.asarray(want[1])[LAYER, w])):
            assert np.abs(g - wa).max() <= 1e-6 * max(1.0, np.abs(wa).max()), r
        np.testing.assert_array_equal(np.asarray(got[2])[LAYER, w], np.asarray(want[2])[LAYER, w])  # a copy


def test_record_mode_compiles_for_tpu7x_at_k3_heads():
    """The record-mode kernel at K3's 96 heads of 128, 7 drafts, 16 rows, through Mosaic for
    ``tpu7x`` (libtpu on this CPU host, ``sharding/tpu_aot.py``): compiled, the kernel's scoped
    VMEM within its explicit limit, no copy of the state pool, the conv pool (row layout) or
    any part of the journal.

    Measured (2-core host): compiled in 10.7 s (it took 531 s while the pre-conv journal rows
    went through a scatter with ``[D, 3P]`` windows and the kernel unrolled 8 rows x 15
    positions; ``kda_decode`` compiles in ~7 s), scoped VMEM 31.7 MiB of the 48 MiB limit
    (8 rows x 8 heads), ``memory_analysis()``: code 5.8 MiB, arguments 283.9 MiB, outputs
    274.5 MiB of which 268.5 MiB aliased to the arguments (pools and journal in place),
    temporaries 31.6 MiB (the gathered token blocks)."""
    from k3serve.kernels.kda_decode_kernel import VMEM_LIMIT
    from k3serve.model.config import k3_full
    from k3serve.sharding import tpu_aot

    tpu_aot.require_libtpu()
    mesh = tpu_aot.tpu_mesh("tpu7x:2x2x1")
    cfg = k3_full()
    Hk, dk, Wk, Dk, Jk, Lk, Sk = cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size, 7, 17, 2, 17
    Rk = 16
    Tk = Rk * (Dk + 1)
    Pk = Hk * dk
    F32_, BF16, I32_ = jnp.float32, jnp.bfloat16, jnp.int32
    p = lambda shape, dt: tpu_aot.placed(shape, dt, mesh)  # noqa: E731
    state = p((Lk, Sk, Hk, dk, dk), F32_)
    conv = p((Lk, Sk, (Wk - 1) * 3 * Hk, dk), F32_)
    jparts = [p((Lk, Jk, Dk, Hk, dk), F32_)] * 3 + [p((Lk, Jk, Dk, 3 * Pk), BF16)]
    args = [p((Tk, 3 * Pk), BF16), p((Tk, Pk), BF16), p((Tk, Hk), BF16), p((Tk, Pk), BF16), state, conv,
            tuple(jparts), p((), I32_), *[p((Rk,), I32_)] * 7, p((Rk,), jnp.bool_), p((), I32_),
            p((3 * Pk, Wk), BF16), p((Hk,), F32_), p((Pk,), F32_), p((dk,), F32_)]
    t0 = time.perf_counter()
    compiled, _ = tpu_aot.compile_for_tpu(lambda *a: kda_spec_decode(*a), args, mesh, donate_argnums=(4, 5, 6))
    print(f"compile {time.perf_counter() - t0:.1f} s")
    kernels = tpu_aot.scoped_vmem(compiled)
    print(kernels)
    assert len(kernels) == 1
    assert 0 < kernels[0]["used"] <= kernels[0]["limit"] == VMEM_LIMIT
    names = ["f32[" + ",".join(map(str, a.shape)) + "]" for a in (state, conv, jparts[0])]
    names.append("bf16[" + ",".join(map(str, jparts[3].shape)) + "]")
    pool_copies = [c for c in tpu_aot.copies(compiled) if any(nm in c.split("copy", 1)[0] for nm in names)]
    assert not pool_copies, pool_copies[:2]
    print(compiled.memory_analysis())
