"""KDA decode rows under speculative decoding as a Pallas TPU kernel: the record mode of
``kernels/kda_decode_kernel.py`` (whose docstring explains the pools, the row layout of the conv
pool, the manual DMA and the aliasing assumption; all of that holds here unchanged).

A decode row carries its last token and ``d_r`` drafts (``0 <= d_r <= D``, ``D`` = the journal's
draft axis, static; ``n = 1 + D`` positions are gathered per row, those past ``d_r`` are junk and
nothing reads them). Per live row and head block, one grid step:

1. **Fused fold.** The row's ``fold_len[r]`` drafts accepted last step are committed from its
   journal entry ``jrow[r]`` into the state and conv window read from the read slot (zeros when
   fresh), in ``kernels/kda_spec.py::advance``'s operation order (``S · e^{g} + k ⊗ δ`` per
   position), and the conv window becomes the last ``W - 1`` rows of ``window ++ raw[:fold_len]``
   (a select, exact). So the engine never runs ``model.k3.fold_journal`` for these rows.
2. **Commit.** The first token is decoded from there exactly as ``kda_decode`` does (same
   formulas, same order): the state and the window after it go to the write slot (and the
   snapshot slot, which may cover the first token only).
3. **Verify.** Each draft is run from the committed state, in VMEM, without writing the pool:
   its output, and its journal entry ``(k, e^g, δ)`` fp32 written in place to entry ``jrow[r]``
   of the layer's journal (the three arrays ``[nK, J, D, H, d]`` aliased input -> output, moved
   by manual DMA like the pools). A draft's conv input is the committed window plus the row's
   earlier tokens.

The journal's fourth part, the pre-conv rows ``[nK, J, D, 3P]`` (model dtype), is handled by the
wrapper in XLA: the rows a fold shifts into the window are gathered in row order and enter as a
token block (like the rows' tokens: a one-row bf16 DMA does not lower on TPU, see the decode
kernel), and this step's draft rows are scattered into the entry afterwards (in place when the
journal is donated). Rows with ``jrow < 0`` fold nothing and journal nothing.

Layout inside a grid step (``rt`` rows, ``hb`` heads of width ``d``, ``C = hb·d``): the vector
prologue runs on ``[rt, C]`` tiles in a ``fori_loop`` over the positions (the folded window ++
the tokens in ``[W-1+n, 3, rt, C]`` scratch, so a tap is a leading index): conv, SiLU, norms and
gates; each position's q, k, e^g go through one transpose into ``cols [n, hb, d, 3·rt]`` (lane
``c·rt + j`` = part c of row j; the state's k axis is its second-minor one), the fold's journal
k and e^g likewise into ``[D, hb, d, 2·rt]``; rows (v, beta, the fold's δ) are stored per
head ``[.., hb, rt, d]``. Position and head are leading (untiled) indices everywhere, so both
can be loop indices; only the row (a lane / sublane offset) stays static. The delta steps run
row by row (static); per row the fold + commit is a ``fori_loop`` over heads with the fold a
``fori_loop`` of ``fold_len`` trips inside, and the drafts a ``fori_loop`` over positions with
a ``fori_loop`` over heads inside, the drafts' state in ``[hb, d, d]`` scratch. A position's
output and δ rows are merged into ``[hb, d]`` accumulators by a select on the sublane index,
so no store needs a dynamic sublane offset. Each row's state leaves (write / snapshot DMA) as
soon as its first token is done; its journal entry after its drafts. Nothing is reshaped or
bitcast as a ref.

Cost over ``kda_decode``, per live row and layer: the journal entry read (fold) and written,
``2·3·D·H·d·4`` bytes (K3, D = 7: 2 x 1.03 MB against 12.6 MB of state), the gathered tokens
``n``-fold, and ``(D + D)·~7·H·d²`` FLOPs (fold and drafts): still bandwidth-bound.
VMEM per step: :func:`spec_vmem_bytes`.

Compile time (tpu7x, K3: 96 heads of 128, D = 7, 16 rows; tests/test_kda_spec_kernel.py, 2-core
host): 10.7 s, scoped VMEM 31.7 MiB of the 48 MiB limit (:func:`spec_vmem_bytes` plans 21.9
MiB), ``memory_analysis()``: code 5.8 MiB, arguments 283.9 MiB, outputs 274.5 MiB of which
268.5 MiB aliased, temporaries 31.6 MiB; no copy of the pools or of any journal part. It once
took 531 s: most of it (not the kernel) was XLA:TPU compiling the journal's pre-conv scatter
with ``[D, 3P]`` windows (28 s alone at 24 heads); with one ``[3P]`` row per (row, draft) it
compiles in seconds. The position loops then took the kernel from 13.1 s (positions unrolled:
8 rows x 15 delta steps, 25.6 MiB scoped VMEM) to 10.7 s at K3, and from 7.1 s to 2.9 s at
8 heads (one grid step's body), for ~6 MiB more VMEM (a column buffer per position).

Status: interpret mode on the CPU (tests/test_kda_spec_kernel.py, against
:func:`kda_spec_decode_reference`, built from ``kda_ragged``'s decode/drafts branch and
``kda_fold``) and compiled for tpu7x (same test file); never run on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import cost_estimates
from .kda_decode_kernel import (VMEM_LIMIT, _check, _l2_normalize, _log_decay, _pad, _rms_normalize,
                                conv_is_rows, conv_slot_rows, conv_slot_window)
from .kda_ragged import kda_ragged, ragged_causal_conv
from .kda_spec import conv_window_commit, kda_fold

F32 = jnp.float32
I32 = jnp.int32

# semaphore columns per row: reads (conv q/k/v, state, journal k/eg/delta)
_IN_CONV, _IN_STATE, _IN_J, _N_IN = 0, 3, 4, 7
# writes (conv q/k/v to write slot, to snapshot slot, state to write / snapshot slot, journal x3)
_OUT_CONV, _OUT_CONV_SNAP, _OUT_STATE, _OUT_STATE_SNAP, _OUT_J, _N_OUT = 0, 3, 6, 7, 8, 11


def _kernel(rd_ref, wr_ref, sn_ref, fr_ref, nd_ref, jr_ref, fl_ref, n_ref, layer_ref,
            cw_ref, a_ref, dtb_ref, on_ref, x_ref, f_ref, b_ref, go_ref, xj_ref,
            state_hbm, conv_hbm, jk_hbm, jeg_hbm, jd_hbm,
            o_ref, state_out, conv_out, jk_out, jeg_out, jd_out,
            win_buf, cnew_buf, seq_buf, s_buf, sv_buf, cols_buf, vb_buf, jin_buf, fcols_buf, fdel_buf, jout_buf, o_buf,
            sem_in, sem_out, *, rt, hb, d, P, Wm1, D, num_slots, lower_bound, eps, conv_rows):
    i, h = pl.program_id(0), pl.program_id(1)
    C = hb * d
    H = P // d
    n = D + 1
    col0 = h * C
    layer = layer_ref[0]
    n_dec = n_ref[0]

    def row(j):
        r = i * rt + j
        live = r < n_dec
        fresh = fr_ref[r] != 0
        w, s, jr = wr_ref[r], sn_ref[r], jr_ref[r]
        rec = live & (jr >= 0)
        return dict(r=r, live=live, load=live & jnp.logical_not(fresh), fresh=live & fresh,
                    write=live & (w >= 0) & (w < num_slots), snap=live & (s >= 0) & (s < num_slots),
                    rec=rec, fold=rec & (fl_ref[r] > 0), rd=rd_ref[r], wr=w, sn=s, jr=jnp.maximum(jr, 0),
                    a=jnp.where(rec, fl_ref[r], 0), nd=nd_ref[r])

    rows = [row(j) for j in range(rt)]

    def conv_at(ref, slot, p, t):  # as kda_decode_kernel: [W-1, C] or window row t [hb, d]
        if t is None:
            return ref.at[layer, slot, :, pl.ds(p * P + col0, C)]
        return ref.at[layer, slot, pl.ds((t * 3 + p) * H + h * hb, hb)]

    ts = list(range(Wm1)) if conv_rows else [None]

    def buf_at(buf, j, p, t):
        return buf.at[j, p] if t is None else buf.at[j, p, t]

    def conv_in_copies(j, slot):
        return [pltpu.make_async_copy(conv_at(conv_hbm, slot, p, t), buf_at(win_buf, j, p, t),
                                      sem_in.at[j, _IN_CONV + p]) for p in range(3) for t in ts]

    def conv_out_copies(j, slot, k0):
        return [pltpu.make_async_copy(buf_at(cnew_buf, j, p, t), conv_at(conv_out, slot, p, t),
                                      sem_out.at[j, k0 + p]) for p in range(3) for t in ts]

    def state_in(j, m):
        return pltpu.make_async_copy(state_hbm.at[layer, m["rd"], pl.ds(h * hb, hb)], s_buf.at[j],
                                     sem_in.at[j, _IN_STATE])

    def state_out_copy(j, slot, k):
        return pltpu.make_async_copy(s_buf.at[j], state_out.at[layer, slot, pl.ds(h * hb, hb)], sem_out.at[j, k])

    def journal_in(j, m):  # the entry's k, e^g, delta of this head block: [D, hb, d] each
        return [pltpu.make_async_copy(ref.at[layer, m["jr"], :, pl.ds(h * hb, hb)], jin_buf.at[c, j],
                                      sem_in.at[j, _IN_J + c]) for c, ref in enumerate((jk_hbm, jeg_hbm, jd_hbm))]

    def journal_out(j, m):
        return [pltpu.make_async_copy(jout_buf.at[c, j], ref.at[layer, m["jr"], :, pl.ds(h * hb, hb)],
                                      sem_out.at[j, _OUT_J + c]) for c, ref in enumerate((jk_out, jeg_out, jd_out))]

    tile_live = i * rt < n_dec

    @pl.when(tile_live)
    def _():
        # ---- reads: windows and journal entries first (the prologue needs them), then states
        for j, m in enumerate(rows):
            @pl.when(m["load"])
            def _():
                for cp in conv_in_copies(j, m["rd"]):
                    cp.start()

            @pl.when(m["fresh"])
            def _():
                win_buf[j] = jnp.zeros(win_buf.shape[1:], win_buf.dtype)

            @pl.when(m["fold"])
            def _():
                for cp in journal_in(j, m):
                    cp.start()

            @pl.when(jnp.logical_not(m["fold"]))
            def _():  # never selected by the fold; zeros keep the tile's junk finite
                jin_buf[:, j] = jnp.zeros((3,) + jin_buf.shape[2:], jin_buf.dtype)

        for j, m in enumerate(rows):
            @pl.when(m["load"])
            def _():
                state_in(j, m).start()

        for j, m in enumerate(rows):
            @pl.when(m["load"])
            def _():
                for cp in conv_in_copies(j, m["rd"]):
                    cp.wait()

            @pl.when(m["fold"])
            def _():
                for cp in journal_in(j, m):
                    cp.wait()

        # ---- vector prologue on the whole tile, every position
        sub = jax.lax.broadcasted_iota(I32, (rt, C), 0)
        a_vec = jnp.zeros((rt, C), I32)  # each row's fold length
        for j, m in enumerate(rows):
            a_vec = jnp.where(sub == j, m["a"], a_vec)
        for p in range(3):
            # the folded window: rows a .. a + W-2 of window ++ the journal's raw rows
            cat = [win_buf[:, p, t].astype(F32).reshape(rt, C) for t in range(Wm1)]
            cat += [xj_ref[t, p].astype(F32) for t in range(D)]
            for mm in range(Wm1):
                v = cat[mm]
                for s in range(1, D + 1):
                    v = jnp.where(a_vec == s, cat[mm + s], v)
                seq_buf[mm, p] = v
            # the committed window: after the first token only
            for t in range(Wm1):
                v = seq_buf[1 + t, p] if 1 + t < Wm1 else x_ref[0, p].astype(F32)
                cnew_buf[:, p, t] = v.reshape(cnew_buf.shape[:1] + cnew_buf.shape[3:]).astype(cnew_buf.dtype)

        for j, m in enumerate(rows):
            @pl.when(m["write"])
            def _():
                for cp in conv_out_copies(j, m["wr"], _OUT_CONV):
                    cp.start()

            @pl.when(m["snap"])
            def _():
                for cp in conv_out_copies(j, m["sn"], _OUT_CONV_SNAP):
                    cp.start()

        def prologue(pos, carry):  # position pos of every row: conv, SiLU, norms, gates
            ys = []
            for p in range(3):
                x = x_ref[pos, p].astype(F32)
                seq_buf[Wm1 + pos, p] = x  # window ++ the row's tokens
                y = x * cw_ref[p, pl.ds(Wm1, 1)].astype(F32)  # kda_decode's order: the newest tap, then oldest
                for t in range(Wm1):
                    y = y + seq_buf[pos + t, p] * cw_ref[p, pl.ds(t, 1)].astype(F32)
                ys.append(y * jax.nn.sigmoid(y))
            q = _l2_normalize(ys[0].reshape(rt, hb, d)).reshape(rt, C) * (d ** -0.5)
            k = _l2_normalize(ys[1].reshape(rt, hb, d)).reshape(rt, C)
            eg = jnp.exp(_log_decay(f_ref[pos].astype(F32), a_ref[...], dtb_ref[...], lower_bound))
            bv = b_ref[pos].astype(F32)
            for hh in range(hb):  # rows per head: v, beta
                vb_buf[pos, 0, hh] = ys[2][:, hh * d:(hh + 1) * d]
                vb_buf[pos, 1, hh] = bv[:, hh * d:(hh + 1) * d]
            # columns: q, k, e^g of row j are lanes j, rt + j, 2 rt + j of cols_buf[pos]
            cols_buf[pos] = jnp.concatenate([q, k, eg], axis=0).T.reshape(hb, d, 3 * rt)

            @pl.when(pos > 0)
            def _():  # this step's journal: a draft's key and decay (its delta comes out of the delta steps)
                k3, e3 = k.reshape(rt, hb, d), eg.reshape(rt, hb, d)
                for j in range(rt):
                    jout_buf[0, j, pos - 1] = k3[j]
                    jout_buf[1, j, pos - 1] = e3[j]

            return carry

        jax.lax.fori_loop(0, n, prologue, 0)

        def fold_prologue(t, carry):  # the fold's journal entries: k, e^g as columns, delta as rows per head
            vals = [jin_buf[c, :, t].reshape(rt, C) for c in range(2)]
            fcols_buf[t] = jnp.concatenate(vals, axis=0).T.reshape(hb, d, 2 * rt)  # lanes j, rt + j
            dl = jin_buf[2, :, t].reshape(rt, C)
            for hh in range(hb):
                fdel_buf[t, hh] = dl[:, hh * d:(hh + 1) * d]
            return carry

        jax.lax.fori_loop(0, D, fold_prologue, 0)

        # ---- the delta steps, row by row
        hsub = jax.lax.broadcasted_iota(I32, (hb, d), 0)

        def put(acc, hh, val):  # row hh of an [hb, d] accumulator
            return jnp.where(hsub == hh, val, acc)

        for j, m in enumerate(rows):
            @pl.when(m["load"])
            def _():
                state_in(j, m).wait()

            @pl.when(m["fresh"])
            def _():
                s_buf[j] = jnp.zeros(s_buf.shape[1:], s_buf.dtype)

            def col(buf, t, hh, lane):  # t: a position (may be traced), on a leading dim
                return buf[t, hh, :, pl.ds(lane, 1)]  # [d, 1]

            def delta_step(S, pos, hh):
                qc, kc, egc = (col(cols_buf, pos, hh, c * rt + j) for c in range(3))
                vr = vb_buf[pos, 0, hh, pl.ds(j, 1), :]  # [1, d]
                br = vb_buf[pos, 1, hh, pl.ds(j, 1), :]
                Sd = S * egc
                pred = jnp.sum(kc * Sd, axis=0, keepdims=True)
                oq = jnp.sum(qc * Sd, axis=0, keepdims=True)
                delta = (vr - pred) * br
                o = oq + jnp.sum(qc * kc, axis=0, keepdims=True) * delta
                return o, delta, Sd + kc * delta

            @pl.when(m["live"])
            def _():
                a = m["a"]

                def fold_and_commit(hh, acc):
                    def fold(t, S):  # advance(): S · e^g + k ⊗ delta, for t < fold_len
                        egc, kc = col(fcols_buf, t, hh, rt + j), col(fcols_buf, t, hh, j)
                        dr = fdel_buf[t, hh, pl.ds(j, 1), :]
                        return S * egc + kc * dr

                    S = jax.lax.fori_loop(0, a, fold, s_buf[j, hh].astype(F32))  # [d(k), d(v)]
                    o, _, S = delta_step(S, 0, hh)
                    s_buf[j, hh] = S.astype(s_buf.dtype)
                    sv_buf[hh] = S  # the drafts' state
                    return put(acc, hh, o)

                o_buf[0, j] = jax.lax.fori_loop(0, hb, fold_and_commit, jnp.zeros((hb, d), F32))

            @pl.when(m["write"])
            def _():
                state_out_copy(j, m["wr"], _OUT_STATE).start()

            @pl.when(m["snap"])
            def _():
                state_out_copy(j, m["sn"], _OUT_STATE_SNAP).start()

            @pl.when(m["live"])
            def _():
                nd = m["nd"]

                def verify(t, carry):  # position t = 1..D, every head; a draft past nd keeps the state
                    def head(hh, accs):
                        S = sv_buf[hh]
                        o, delta, S_next = delta_step(S, t, hh)
                        sv_buf[hh] = jnp.where(t <= nd, S_next, S)
                        return put(accs[0], hh, o), put(accs[1], hh, delta)

                    zero = jnp.zeros((hb, d), F32)
                    o_t, d_t = jax.lax.fori_loop(0, hb, head, (zero, zero))
                    o_buf[t, j] = o_t
                    jout_buf[2, j, t - 1] = d_t
                    return carry

                jax.lax.fori_loop(1, n, verify, 0)

            @pl.when(m["rec"])
            def _():
                for cp in journal_out(j, m):
                    cp.start()

        # ---- gated output norm, every position
        live = (i * rt + jax.lax.broadcasted_iota(I32, (rt, 1, 1), 0)) < n_dec

        def norm(pos, carry):
            gate = jax.nn.sigmoid(go_ref[pos].astype(F32)).reshape(rt, hb, d)
            o = _rms_normalize(o_buf[pos], eps) * on_ref[...] * gate
            o_ref[pos] = jnp.where(live, o, 0.0)
            return carry

        jax.lax.fori_loop(0, n, norm, 0)

        # ---- every write lands before the step ends
        for j, m in enumerate(rows):
            @pl.when(m["write"])
            def _():
                for cp in conv_out_copies(j, m["wr"], _OUT_CONV):
                    cp.wait()
                state_out_copy(j, m["wr"], _OUT_STATE).wait()

            @pl.when(m["snap"])
            def _():
                for cp in conv_out_copies(j, m["sn"], _OUT_CONV_SNAP):
                    cp.wait()
                state_out_copy(j, m["sn"], _OUT_STATE_SNAP).wait()

            @pl.when(m["rec"])
            def _():
                for cp in journal_out(j, m):
                    cp.wait()

    @pl.when(jnp.logical_not(tile_live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def spec_vmem_bytes(rt: int, hb: int, d: int, W: int, D: int) -> int:
    """VMEM one grid step of :func:`kda_spec_decode` holds with blocks ``(rt, hb)`` and ``D``
    drafts (f32, (8, 128) tiles with padding): states (and the drafts' state of one row),
    windows, the token blocks of ``n = D + 1`` positions and the journal's raw rows
    (double-buffered), the folded window ++ tokens, the column buffers (one per position, lanes
    padded to 128), the row buffers, the journal entries read and written, o and the
    parameters."""
    C, n = hb * d, D + 1
    state = 4 * (rt + 1) * hb * _pad(d, 8) * _pad(d, 128)
    windows = 2 * 4 * rt * 3 * _pad(W - 1, 8) * C
    tokens = 2 * 4 * (6 * n + 3 * D) * _pad(rt, 8) * C
    seq = 4 * (W - 1 + n) * 3 * _pad(rt, 8) * C
    cols = 4 * hb * d * (n * _pad(3 * rt, 128) + D * _pad(2 * rt, 128))
    rows = 4 * (2 * n + D) * hb * _pad(rt, 8) * _pad(d, 128)
    journal = 2 * 4 * 3 * rt * D * _pad(hb, 8) * _pad(d, 128)
    out = 4 * 3 * n * rt * _pad(hb, 8) * _pad(d, 128)  # o before the norm, o out (x2)
    params = 2 * 4 * (3 * _pad(W, 8) * C + 2 * 8 * C + 8 * 128)
    return state + windows + tokens + seq + cols + rows + journal + out + params


def spec_blocks(R: int, H: int) -> tuple[int, int]:
    """``(rows_per_tile, heads_per_block)``: 8 rows (all when fewer) and the smallest head block
    Mosaic accepts (a multiple of 8 dividing H, or H). Small on purpose: the head loop carries
    ``2·D`` accumulators of ``[hb, d]`` in vregs, and a bigger block only saves grid steps."""
    ok = [m for m in range(1, H + 1) if H % m == 0 and (m % 8 == 0 or m == H)]
    return max(1, min(8, R)), min(ok)


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "blocks", "interpret", "vmem_limit_bytes"))
def kda_spec_decode(qkv_raw, f, beta, gate_out, state_pool, conv_pool, journal, layer, tok, n_drafts, jrow, fold_len,
                    read_slot, write_slot, snap_slot, fresh, n_dec, conv_w, A_log, dt_bias, o_norm, *,
                    lower_bound: float | None = -5.0, eps: float = 1e-5, blocks: tuple[int, int] | None = None,
                    interpret=None, vmem_limit_bytes: int = VMEM_LIMIT):
    """Decode rows with drafts for one KDA layer, the journal's fold fused in (module docstring).

    As :func:`kda_decode_kernel.kda_decode`, plus: ``journal`` = ``(k, e^g, delta)`` fp32 ``[nK,
    J, D, H, d]`` and the pre-conv rows ``[nK, J, D, 3P]`` (``model.k3.journal_shapes``); per row
    ``tok`` its first token (its drafts follow it), ``n_drafts`` (0..D), ``jrow`` (its journal
    entry, < 0: none) and ``fold_len`` (last step's accepted drafts to fold first, 0..D).
    Returns ``(o [R, n, H, d] float32 after the gated norm (positions past a row's drafts:
    junk), state_pool, conv_pool, journal)``, everything updated in place (donate them). The
    live rows' journal entries must be distinct, like their written slots."""
    T, L, S, H, d, P, W = _check(qkv_raw, f, beta, gate_out, state_pool, conv_pool, tok, conv_w, A_log, dt_bias,
                                 o_norm)
    jk, jeg, jd, jraw = journal
    J, D = jk.shape[1], jk.shape[2]
    if D < 1 or jk.shape[3:] != (H, d) or jraw.shape[1:] != (J, D, 3 * P):
        raise ValueError(f"kda_spec_decode: journal shapes {[x.shape for x in journal]} do not match H={H}, d={d}")
    n = D + 1
    R = tok.shape[0]
    rt, hb = blocks if blocks is not None else spec_blocks(R, H)
    if rt < 1 or hb < 1 or H % hb:
        raise ValueError(f"blocks {blocks}: heads_per_block must divide H={H}")
    nt = -(-R // rt)
    Rp = nt * rt
    C = hb * d

    def meta(a, fill):
        return jnp.pad(jnp.asarray(a).astype(I32), (0, Rp - R), constant_values=fill)

    nd = jnp.clip(jnp.asarray(n_drafts, I32), 0, D)
    jr = jnp.where(jnp.asarray(jrow, I32) < J, jnp.asarray(jrow, I32), -1)
    fl = jnp.where(jr >= 0, jnp.clip(jnp.asarray(fold_len, I32), 0, D), 0)
    n_dec = jnp.clip(jnp.asarray(n_dec, I32), 0, R)
    scalars = (meta(jnp.clip(read_slot, 0, S - 1), 0), meta(write_slot, -1), meta(snap_slot, -1), meta(fresh, 1),
               meta(nd, 0), meta(jr, -1), meta(fl, 0), n_dec.reshape(1), jnp.asarray(layer, I32).reshape(1))
    cw = conv_w.astype(F32).reshape(3, P, W).transpose(0, 2, 1)  # [3, W, P]
    a = jnp.repeat(jnp.exp(A_log.astype(F32)), d).reshape(1, P)
    dtb = dt_bias.astype(F32).reshape(1, P)
    on = o_norm.astype(F32).reshape(1, d)
    # every position's token, gathered in row order: [n, Rp]
    t = jnp.clip(meta(tok, 0)[None, :] + jnp.arange(n, dtype=I32)[:, None], 0, T - 1)
    x = qkv_raw[t].reshape(n, Rp, 3, P).transpose(0, 2, 1, 3)  # [n, 3, Rp, P]
    b = jnp.repeat(beta[t], d, axis=-1)  # [n, Rp, P]
    # the fold's pre-conv rows (the entry as last step left it), gathered in row order
    jr_p = meta(jnp.maximum(jr, 0), 0)
    d_idx = jnp.tile(jnp.arange(D, dtype=I32), Rp)  # per (row, draft), like the scatter below
    xj = jraw[layer, jnp.repeat(jr_p, D), d_idx].reshape(Rp, D, 3, P).transpose(1, 2, 0, 3)  # [D, 3, Rp, P]

    rows_layout = conv_is_rows(conv_pool.shape, H, d, W)
    win_shape = (rt, 3, W - 1, hb, d) if rows_layout else (rt, 3, W - 1, C)
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    pos_spec = pl.BlockSpec((n, rt, C), lambda i, h, *_: (0, i, h))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(nt, H // hb),
        in_specs=[pl.BlockSpec((3, W, C), lambda i, h, *_: (0, 0, h)),
                  pl.BlockSpec((1, C), lambda i, h, *_: (0, h)),
                  pl.BlockSpec((1, C), lambda i, h, *_: (0, h)),
                  pl.BlockSpec((1, d), lambda i, h, *_: (0, 0)),
                  pl.BlockSpec((n, 3, rt, C), lambda i, h, *_: (0, 0, i, h)), pos_spec, pos_spec, pos_spec,
                  pl.BlockSpec((D, 3, rt, C), lambda i, h, *_: (0, 0, i, h)),
                  hbm, hbm, hbm, hbm, hbm],
        out_specs=[pl.BlockSpec((n, rt, hb, d), lambda i, h, *_: (0, i, h, 0)), hbm, hbm, hbm, hbm, hbm],
        scratch_shapes=[pltpu.VMEM(win_shape, conv_pool.dtype),  # windows read
                        pltpu.VMEM(win_shape, conv_pool.dtype),  # windows written
                        pltpu.VMEM((W - 1 + n, 3, rt, C), F32),  # the folded window ++ the tokens, per part
                        pltpu.VMEM((rt, hb, d, d), state_pool.dtype),  # states (the committed one stays)
                        pltpu.VMEM((hb, d, d), F32),  # the drafts' state (one row at a time)
                        pltpu.VMEM((n, hb, d, 3 * rt), F32),  # q, k, e^g columns per position
                        pltpu.VMEM((n, 2, hb, rt, d), F32),  # v, beta rows per head
                        pltpu.VMEM((3, rt, D, hb, d), F32),  # journal entries read (fold)
                        pltpu.VMEM((D, hb, d, 2 * rt), F32),  # the fold's k, e^g columns per position
                        pltpu.VMEM((D, hb, rt, d), F32),  # the fold's delta rows per head
                        pltpu.VMEM((3, rt, D, hb, d), F32),  # journal entries written
                        pltpu.VMEM((n, rt, hb, d), F32),  # o before the norm
                        pltpu.SemaphoreType.DMA((rt, _N_IN)),
                        pltpu.SemaphoreType.DMA((rt, _N_OUT))])
    n_pre = len(scalars) + 9  # operands before the pools
    o, state_pool, conv_pool, jk, jeg, jd = pl.pallas_call(
        functools.partial(_kernel, rt=rt, hb=hb, d=d, P=P, Wm1=W - 1, D=D, num_slots=S, lower_bound=lower_bound,
                          eps=eps, conv_rows=rows_layout),
        grid_spec=spec,
        out_shape=[jax.ShapeDtypeStruct((n, Rp, H, d), F32),
                   *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (state_pool, conv_pool, jk, jeg, jd))],
        input_output_aliases={n_pre + c: 1 + c for c in range(5)},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        # per row: its state read and written, the journal entry read and written, the window,
        # every position's q, k, v, f, beta and gate in, o out; FLOPs of 2D + 1 delta steps
        cost_estimate=cost_estimates.kda_state_rows(
            Rp, H, d, d, state_pool.dtype.itemsize, Rp * (2 * D + 1), 0,
            extra_bytes=Rp * n * 7 * P * 4 + 2 * Rp * 3 * (W - 1) * P * conv_pool.dtype.itemsize
            + 2 * Rp * 3 * D * P * 4),
        interpret=interpret,
    )(*scalars, cw, a, dtb, on, x, f[t], b, gate_out[t], xj, state_pool, conv_pool, jk, jeg, jd)
    # this step's draft rows into the live rows' entries (after the fold's gather above)
    # one scatter index per (row, draft), a [3P] row each: the same as ``jraw.at[layer, entries].set(
    # [R, D, 3P])`` but with [D, 3P] windows XLA:TPU's scatter took minutes to compile at K3 size
    # (most of the 531 s this module once took; 28 s at 24 heads); a dynamic-update-slice loop
    # compiles fast but re-lays the whole journal out (two copies per call)
    rec = (jnp.arange(R) < n_dec) & (jr >= 0)
    raw_drafts = qkv_raw[t[1:, :R]].transpose(1, 0, 2).reshape(R * D, 3 * P)  # row-major (row, draft)
    entry = jnp.repeat(jnp.where(rec, jr, J), D)
    jraw = jraw.at[layer, entry, d_idx[:R * D]].set(raw_drafts.astype(jraw.dtype),
                                                                            mode="drop")
    return jnp.swapaxes(o, 0, 1)[:R], state_pool, conv_pool, (jk, jeg, jd, jraw)


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "blocks", "interpret", "vmem_limit_bytes"))
def kda_spec_decode_reference(qkv_raw, f, beta, gate_out, state_pool, conv_pool, journal, layer, tok, n_drafts, jrow,
                              fold_len, read_slot, write_slot, snap_slot, fresh, n_dec, conv_w, A_log, dt_bias, o_norm,
                              *, lower_bound: float | None = -5.0, eps: float = 1e-5, blocks=None, interpret=None,
                              vmem_limit_bytes: int = VMEM_LIMIT):
    """:func:`kda_spec_decode` in pure JAX, the model's reference path on the same rows: the
    fold of ``model.k3.fold_journal`` (``kda_fold``, ``conv_window_commit``), the conv of
    ``ragged_causal_conv`` committing the first token, ``kda_ragged``'s decode/drafts branch and
    the norms and gates of ``kda_decode_reference``; pools and journal updated by scatter."""
    del blocks, interpret, vmem_limit_bytes
    T, L, S, H, d, P, W = _check(qkv_raw, f, beta, gate_out, state_pool, conv_pool, tok, conv_w, A_log, dt_bias,
                                 o_norm)
    jk, jeg, jd, jraw = journal
    J, D = jk.shape[1], jk.shape[2]
    n, R = D + 1, tok.shape[0]
    live = jnp.arange(R) < n_dec
    fr = jnp.asarray(fresh).astype(bool)
    rd = jnp.clip(read_slot, 0, S - 1)
    nd = jnp.clip(jnp.asarray(n_drafts, I32), 0, D)
    jr = jnp.where(live & (jnp.asarray(jrow, I32) < J), jnp.asarray(jrow, I32), -1)
    # the rows' tokens laid out as a flattened step of n tokens per row, q_len 1 + n_drafts
    ql = jnp.where(live, 1 + nd, 0)
    cu = jnp.arange(R + 1, dtype=I32) * n
    t = jnp.clip(tok[:, None] + jnp.arange(n)[None, :], 0, T - 1).reshape(-1)  # [R * n]
    pos = jnp.tile(jnp.arange(n), R)
    tok_row = jnp.where(pos < jnp.repeat(ql, n), jnp.repeat(jnp.arange(R, dtype=I32), n), R)
    conv_rows = jnp.where(fr[:, None, None], 0.0, conv_slot_window(conv_pool[layer, rd].astype(F32), W, P))
    state_rows = jnp.where(fr[:, None, None, None], 0.0, state_pool[layer, rd].astype(F32))
    at = jnp.maximum(jr, 0)
    a = jnp.where(jr >= 0, jnp.clip(jnp.asarray(fold_len, I32), 0, D), 0)
    state_rows = kda_fold(state_rows, (jk[layer, at], jeg[layer, at], jd[layer, at]), a)
    conv_rows = conv_window_commit(conv_rows, jraw[layer, at].reshape(R, D, 3 * P), a)
    none, no_snap = jnp.zeros((1,), I32), jnp.full((1,), R, I32)  # one unused snapshot entry
    raw = qkv_raw[t]
    y, new_conv, _ = ragged_causal_conv(raw, conv_rows, conv_w, tok_row, cu, ql, no_snap, none,
                                        jnp.minimum(ql, 1))
    y = jax.nn.silu(y)
    q, k, v = (y[:, c * P:(c + 1) * P].reshape(R * n, H, d) for c in range(3))
    q = _l2_normalize(q) * (d ** -0.5)
    k = _l2_normalize(k)
    fx = f[t].astype(F32).reshape(R * n, H, d) + dt_bias.astype(F32).reshape(H, d)
    ea = jnp.exp(A_log.astype(F32))[:, None]
    g = -ea * jax.nn.softplus(fx) if lower_bound is None else lower_bound * jax.nn.sigmoid(ea * fx)
    o, new_state, _, (nk, neg, ndl) = kda_ragged(q, k, v, g, beta[t].astype(F32), state_rows, tok_row, cu, ql,
                                                 jnp.ones((R,), I32), no_snap, none, decode=live, drafts=D)
    gate = jax.nn.sigmoid(gate_out[t].astype(F32).reshape(R * n, H, d))
    o = (_rms_normalize(o, eps) * o_norm.astype(F32) * gate).reshape(R, n, H, d)
    o = jnp.where(live[:, None, None, None], o, 0.0)

    def target(slot):
        return jnp.where(live & (slot >= 0) & (slot < S), slot, S)  # S: dropped

    for slot in (write_slot, snap_slot):
        idx = target(jnp.asarray(slot, I32))
        state_pool = state_pool.at[layer, idx].set(new_state.astype(state_pool.dtype), mode="drop")
        conv_pool = conv_pool.at[layer, idx].set(conv_slot_rows(new_conv, conv_pool.shape).astype(conv_pool.dtype),
                                                 mode="drop")
    je = jnp.where(jr >= 0, jr, J)
    raw_drafts = raw.reshape(R, n, 3 * P)[:, 1:]
    journal = tuple(pool.at[layer, je].set(val.astype(pool.dtype), mode="drop")
                    for pool, val in zip(journal, (nk, neg, ndl, raw_drafts)))
    return o, state_pool, conv_pool, journal
