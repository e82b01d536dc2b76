"""KDA ragged chunked prefill as a Pallas TPU kernel (issue #15, kernel 4): the delta-rule core
of one KDA layer over the prefill rows (``q_len >= 2``) of a flattened step, in chunks aligned
to absolute positions, the state carried in VMEM across a row's chunks, read from the row's
read slot of the state pool and written in place to its write slot, with snapshots at any
offset of the step.

Semantics: those of ``kernels/kda_ragged.py::kda_ragged`` (the oracle) restricted to rows with
``q_len >= 2``, plus the pool traffic; ``kda_prefill_reference`` below is that composition in
pure JAX (gather the rows' states, ``kda_ragged`` with the other rows hidden, scatter).

Inputs (T tokens in R rows; layout as in ``kernels/kda_ragged.py``)::

  q, k  [T, H, dk]   after conv, SiLU and L2 norm; q already scaled by dk^-1/2
  v     [T, H, dv]
  g     [T, H, dk]   per-channel log-decay (<= 0)
  beta  [T, H]       (the wrapper passes it on as [H/hb, T, hb] float32: below)
  state_pool [L, S, H, dk, dv] float32, S[k, v]; passed whole with ``layer`` (never a slice)
  tok_row [T], cu_q_lens [R+1], q_lens [R], start_pos [R], read_slot, write_slot, fresh [R]
  snap_row, snap_len, snap_slot [NS]

Row r (``q_len[r] >= 2``) starts from ``state_pool[layer, read_slot[r]]`` (zeros if ``fresh[r]``,
whatever the slot holds) and its final state goes to ``state_pool[layer, write_slot[r]]``
(dropped when the slot is outside ``[0, S)``). Snapshot entry s (``snap_row[s] < R`` a prefill
row, ``1 <= snap_len[s] <= q_len``, ``0 <= snap_slot[s] < S``) writes the state after that row's
first ``snap_len[s]`` tokens of this step to ``state_pool[layer, snap_slot[s]]``. Rows with
``q_len < 2`` (decode rows have their own kernel, empty rows) are not touched: nothing read,
nothing written, their tokens' outputs are zero, as are padding tokens'. Returns ``(o [T, H, dv]
float32, state_pool)``, the pool aliased in and out (donate it, or XLA keeps a copy).

Tiles: a row's tokens are cut into tiles of at most C = ``chunk_size`` tokens whose ends are
aligned to absolute positions (the first tile has ``min(q_len, C - start_pos % C)`` tokens and
finishes the chunk the row starts in; later tiles end on multiples of C or at the row's end), so
no tile spans two rows and a prefix boundary that is a multiple of C is always a tile end.
The tile list (``kda_ragged.ragged_tiles``) and the per-tile snapshot ranges are computed
in-graph by the wrapper and scalar-prefetched into SMEM.

Grid ``(H / heads_per_block, NT)`` with ("parallel", "arbitrary"): ``NT = T // C + 2 *
min(R, T // 2)`` bounds the number of tiles (every tile of a row but its first and last holds C
tokens; at most ``T // 2`` rows have two tokens), steps past the real tile count do nothing.
Along the arbitrary axis a head block visits the tiles in token order, so a row's tiles are
consecutive: the state ``[hb, dk, dv]`` lives in VMEM scratch, set at the row's first tile
(zeroed, or copied from a staging buffer whose DMA from the read slot was started one step
earlier, while the previous tile computed) and DMA'd to the write slot at its last.

Per tile (all token and pool operands in HBM, ``pltpu.HBM`` — with ``pl.ANY`` a small operand
may be placed in VMEM — moved by manual DMA): one window of ``W = min(C, T)`` tokens of each of
q, k, v, g, beta for the head block is DMA'd (q/k/v/g ``[W, hb, d]`` from ``[T, H, d]``: the
window on the untiled leading dim, the heads an aligned sublane range; beta ``[W, hb]`` from
``[H/hb, T, hb]``: the head block a leading index, the window a float32 row range, the minor
dim whole — a ``[W, hb]`` window of ``[T, H]`` is a dynamic 8-lane slice of the minor dim,
which Mosaic rejects on TPU), starting at ``clamp(tok0, 0,
T - W)`` (a static size; a tile sits at offset ``off`` inside it), double-buffered: a head
block's first step fetches its own windows, every step starts the next tile's into the other
buffer before waiting for its own, so the fetch overlaps a tile's compute. Positions outside
the tile are masked to no-ops (``where``, never a multiply, so NaN/garbage of neighbouring
tokens cannot leak: k, q, v, g, beta = 0 there, which leaves the chunked form exact). Then per
head:

  * G = inclusive cumulative log-decay, as a matmul with a lower-triangular ones matrix;
  * Akk, Aqk (``sum_d k_t k_j e^{G_t - G_j}``, ``q_t`` likewise, j <= t): pairs inside a
    16-token sub-block from the pairwise decay tensor ``[sub, sub, dk]`` with ``j > t`` masked
    BEFORE the exp; pairs across sub-blocks as matmuls through the cumulative decay at the token r
    just before the sub-block, ``e^{G_t - G_r} e^{G_r - G_j}`` (both exponents <= 0: no overflow);
  * ``(I + A) X = [beta V | beta K e^G]`` with A the strictly lower ``beta_t Akk``: block forward
    substitution over 16-row blocks (matmuls), each diagonal block inverted by row substitution
    written as 15 static masked row updates (no sequential 63-step loop, no dynamic indexing);
  * ``U = X_v - X_k S0``, ``o = (q e^G) S0 + Aqk U``, ``S' = e^{G_last} S0 + (K e^{G_last - G})^T U``;
  * snapshots falling in this tile (sorted by tile in the wrapper; ``snap_lo/hi`` per tile): the
    state after tile position p is ``e^{G_p} S0 + (K e^{G_p - G} [off <= j <= p])^T U`` (design
    kernels-ragged.md 7b), the mask applied to the exponent before the exp; each is DMA'd to
    its snapshot slot. A snapshot at ``snap_len == q_len`` is the same formula at the row's last
    token (equal to the written state up to rounding).

The tile's outputs go to ``o`` (an HBM output aliased to a zeros fill, which is what the tokens
the kernel does not own keep) by at most ``log2(C) + 1`` DMAs of static power-of-two lengths
(the binary digits of the tile length), so a tile writes exactly its own tokens. Every DMA is
awaited before the step ends. Nothing is reshaped or bitcast as a ref (VMEM scratch is declared
in its final shapes; only values are reshaped).

Aliasing assumption (the engine's): among the prefill rows, write slots and snapshot slots are
pairwise distinct, and no row reads a slot another row writes (a row may read and write its own
slot; a prefix hit reads a snapshot slot and writes another). Reads then see the pool as it was
before the call whatever the order of the grid steps; otherwise the result is unspecified, as
with the reference's scatter.

Cost per call, with T' the tokens of prefill rows, NT' their tiles (NT' <= T'/C + 2 R'), R' the
prefill rows, F the fresh ones, N the snapshots, isz the token inputs' itemsize::

  HBM bytes ≈ NT'·W·H·(3·dk + dv + 1)·isz      q, k, g, v, beta windows (T'·H·(3dk+dv+1)·isz
                                                 when rows are long; short tiles re-read a window)
            + 4·T'·H·dv  (+ 4·T·H·dv)            o written (the zeros fill, by XLA)
            + 4·H·dk·dv·((R' - F) + R' + N)     states read, written, snapshots
  FLOPs ≈ NT'·H·(C²·(7·dk + 3·dv) + 6·C·dk·dv)  cumsum, scores, solve, U, o, new state
        + N·H·2·C·dk·dv                         snapshots

i.e. per token and head about ``C·(7dk + 3dv) + 6·dk·dv`` ≈ 0.18 MFLOP at C = 64, dk = dv =
128 (17 MFLOP per token at K3's 96 heads) against ≈ 2 KB of bf16 inputs and f32 output per head:
~90 FLOP/byte, so on the MXU's f32 path the kernel is compute-bound on TPU. VMEM per step ≈
``2·W·hb·(3dk + dv + 1)·isz`` (windows, double-buffered) + ``4·hb·(W·dv + W·(2dk + dv) +
4·dk·dv)`` (o, G/k/U scratch, carried / staged / new / snapshot states) + the pairwise sub-block
tensor ``4·sub²·dk`` per head; at hb = 8, C = 64, d = 128, bf16 inputs: ≈ 1 + 3.1 + 0.1 MiB.
:func:`prefill_vmem_bytes` counts the same with tile padding and f32 inputs (what the layer
passes), plus the live ``[W, W]`` matrices of one head's tile math; :func:`prefill_heads`
picks the heads per step from it within half of ``vmem_limit_bytes`` (48 MiB,
:data:`VMEM_LIMIT`, explicit: the default scoped limit is 32 MiB of a v7x TensorCore's 64).
Compiled for ``tpu7x`` (libtpu, tests/test_tpu_aot_kda.py): hb = 8, T 512, C 64 uses 7.0 MiB
(C 128: see the design notes), at 96 and at 24 heads.

Not yet done: snapshot and final-state writes are awaited in the step that starts them (not
overlapped with the next tile). Checked in interpret mode on the CPU
(tests/test_kda_prefill_kernel.py) and compiled for tpu7x (tests/test_tpu_aot_kda.py); never
run on a TPU (speed and DMA ordering unverified).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import cost_estimates
from .kda_ragged import kda_ragged, ragged_tiles

F32 = jnp.float32
I32 = jnp.int32
_PREC = jax.lax.Precision.HIGHEST  # f32 matmuls in full f32 on the MXU (the reference's precision)

# metadata rows of the prefetched [N_META, NT] table
_ROW_TOK0, _ROW_LEN, _ROW_W0, _ROW_FIRST, _ROW_LAST, _ROW_RD, _ROW_WR, _ROW_FRESH, _ROW_SLO, _ROW_SHI = range(10)
_N_META = 10
# DMA semaphores: state in, state out, snapshot out (the token windows have their own [2, 5])
_SEM_STATE_IN, _SEM_STATE_OUT, _SEM_SNAP, _N_SEM = 0, 1, 2, 3


def _dot(a, b):
    return jnp.dot(a, b, precision=_PREC, preferred_element_type=F32)


def _dot_t(a, b):
    """a^T b: contract the leading (token) axis of both."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_PREC, preferred_element_type=F32)


def _dot_nt(a, b):
    """a b^T: contract the trailing axis of both."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_PREC, preferred_element_type=F32)


def _unit_lower_inverse(D):
    """(I + D)^-1 for a strictly lower [n, n] D by row substitution: row t of the inverse is
    e_t - D[t] X (rows < t final by then; D[t, j >= t] = 0). Static rows, masked updates."""
    n = D.shape[0]
    rid = jax.lax.broadcasted_iota(I32, (n, n), 0)
    cid = jax.lax.broadcasted_iota(I32, (n, n), 1)
    X = (rid == cid).astype(F32)
    for t in range(1, n):
        row = X[t:t + 1] - _dot(D[t:t + 1], X)
        X = jnp.where(rid == t, row, X)
    return X


def _tile_math(q, k, v, g, b, S0, valid, sub):
    """The chunked form on one tile window for one head. q, k, g [W, dk]; v [W, dv]; b [W, 1];
    S0 [dk, dv]; valid [W, 1] bool (the tile's positions; everything else becomes a no-op).
    Returns (o [W, dv], S' [dk, dv], G [W, dk], U [W, dv], k masked [W, dk])."""
    W, dk = q.shape
    q, k, v, g, b = (jnp.where(valid, x, 0.0) for x in (q, k, v, g, b))
    rid = jax.lax.broadcasted_iota(I32, (W, W), 0)
    cid = jax.lax.broadcasted_iota(I32, (W, W), 1)
    G = _dot((rid >= cid).astype(F32), g)  # inclusive cumulative log-decay [W, dk]

    nb = W // sub
    t3 = jax.lax.broadcasted_iota(I32, (sub, sub, 1), 0)
    j3 = jax.lax.broadcasted_iota(I32, (sub, sub, 1), 1)
    kk_rows, qk_rows = [], []
    for bi in range(nb):
        t0 = bi * sub
        Gb, kb, qb = G[t0:t0 + sub], k[t0:t0 + sub], q[t0:t0 + sub]
        diff = Gb[:, None, :] - Gb[None, :, :]  # [sub(t), sub(j), dk]
        P = jnp.exp(jnp.where(t3 >= j3, diff, -jnp.inf))  # j > t masked before the exp
        kk = [jnp.sum(kb[:, None, :] * kb[None, :, :] * P, axis=-1)]
        qk = [jnp.sum(qb[:, None, :] * kb[None, :, :] * P, axis=-1)]
        if bi:  # pairs with the earlier sub-blocks, through G_r (r = t0 - 1)
            Gr = G[t0 - 1:t0]
            dec_t = jnp.exp(Gb - Gr)
            kj = k[:t0] * jnp.exp(Gr - G[:t0])
            kk.insert(0, _dot_nt(kb * dec_t, kj))
            qk.insert(0, _dot_nt(qb * dec_t, kj))
        if t0 + sub < W:
            z = jnp.zeros((sub, W - t0 - sub), F32)
            kk.append(z)
            qk.append(z)
        kk_rows.append(jnp.concatenate(kk, axis=1) if len(kk) > 1 else kk[0])
        qk_rows.append(jnp.concatenate(qk, axis=1) if len(qk) > 1 else qk[0])
    Akk = jnp.concatenate(kk_rows, axis=0) if nb > 1 else kk_rows[0]
    Aqk = jnp.concatenate(qk_rows, axis=0) if nb > 1 else qk_rows[0]
    A = jnp.where(rid > cid, Akk * b, 0.0)

    eG = jnp.exp(G)
    rhs = jnp.concatenate([v * b, k * eG * b], axis=1)  # [W, dv + dk]
    X = []
    for bi in range(nb):
        t0 = bi * sub
        r = rhs[t0:t0 + sub]
        if bi:
            prev = jnp.concatenate(X, axis=0) if len(X) > 1 else X[0]
            r = r - _dot(A[t0:t0 + sub, :t0], prev)
        X.append(_dot(_unit_lower_inverse(A[t0:t0 + sub, t0:t0 + sub]), r))
    X = jnp.concatenate(X, axis=0) if nb > 1 else X[0]
    dv = v.shape[1]
    U = X[:, :dv] - _dot(X[:, dv:], S0)
    o = _dot(q * eG, S0) + _dot(Aqk, U)
    Glast = G[W - 1:W]  # positions after the tile have g = 0
    S1 = S0 * jnp.exp(Glast).reshape(dk, 1) + _dot_t(k * jnp.exp(Glast - G), U)
    return o, S1, G, U, k


def _kernel(meta_ref, ntiles_ref, layer_ref, sp_ref, ss_ref,
            q_hbm, k_hbm, v_hbm, g_hbm, b_hbm, state_hbm, o_init,
            o_hbm, state_out,
            q_buf, k_buf, v_buf, g_buf, b_buf, o_buf, s_scr, s_next, s_new, g_scr, u_scr, kk_scr, snap_buf, wsem, sem, osem,
            *, hb, W, T, C, sub, num_slots):
    del o_init  # aliased to o_hbm: the zeros the kernel leaves at tokens it does not own
    h, i = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(h * hb, hb)
    layer = layer_ref[0]
    m = lambda row: meta_ref[row, i]  # noqa: E731
    tok0, L, w0 = m(_ROW_TOK0), m(_ROW_LEN), m(_ROW_W0)
    first, last = m(_ROW_FIRST) != 0, m(_ROW_LAST) != 0
    rd, wr, fresh = m(_ROW_RD), m(_ROW_WR), m(_ROW_FRESH) != 0
    off = tok0 - w0  # the tile's first position inside the window

    def windows(w0_, slot):
        """Tile windows into buffer slot ``slot`` (double-buffered: the next tile's are in
        flight while this one computes)."""
        win = pl.ds(w0_, W)
        cps = [pltpu.make_async_copy(src.at[win, heads], dst.at[slot], wsem.at[slot, n])
               for n, (src, dst) in enumerate(((q_hbm, q_buf), (k_hbm, k_buf), (v_hbm, v_buf), (g_hbm, g_buf)))]
        # beta is [H/hb, T, hb]: the head block is a leading index, the window a row range
        cps.append(pltpu.make_async_copy(b_hbm.at[h, win], b_buf.at[slot], wsem.at[slot, 4]))
        return cps

    def state_in(slot):
        """A row's initial state into the staging buffer (started one step ahead)."""
        return pltpu.make_async_copy(state_hbm.at[layer, slot, heads], s_next, sem.at[_SEM_STATE_IN])

    state_wr = pltpu.make_async_copy(s_scr, state_out.at[layer, wr, heads], sem.at[_SEM_STATE_OUT])
    load = first & jnp.logical_not(fresh)
    write = last & (wr >= 0) & (wr < num_slots)

    # the tile's outputs as power-of-two pieces (binary digits of L, largest first)
    nbits = C.bit_length()

    def out_pieces():
        ps = []
        for bit in reversed(range(nbits)):
            n = 1 << bit
            if n > W:
                continue
            start = L & ~((n << 1) - 1)  # tokens covered by the larger pieces
            ps.append(((L & n) != 0, pltpu.make_async_copy(o_buf.at[pl.ds(off + start, n)],
                                                           o_hbm.at[pl.ds(tok0 + start, n), heads], osem.at[bit])))
        return ps

    nt = ntiles_ref[0]
    cur = i % 2

    @pl.when((i == 0) & (nt > 0))  # a head block's first tile fetches its own windows
    def _():
        for cp in windows(w0, 0):
            cp.start()

    @pl.when(i + 1 < nt)  # the next tile's windows, into the other slot
    def _():
        for cp in windows(meta_ref[_ROW_W0, i + 1], 1 - cur):
            cp.start()

    @pl.when((i == 0) & (nt > 0) & load)  # a head block's first row fetches its own state
    def _():
        state_in(rd).start()

    @pl.when(i < nt)
    def _():
        @pl.when(first & fresh)
        def _():
            s_scr[...] = jnp.zeros(s_scr.shape, s_scr.dtype)

        for cp in windows(w0, cur):
            cp.wait()

        @pl.when(load)
        def _():
            state_in(rd).wait()
            s_scr[...] = s_next[...].astype(F32)

        # the next row's state, if the next tile starts one, while this tile computes
        @pl.when((i + 1 < nt) & (meta_ref[_ROW_FIRST, jnp.minimum(i + 1, nt - 1)] != 0)
                 & (meta_ref[_ROW_FRESH, jnp.minimum(i + 1, nt - 1)] == 0))
        def _():
            state_in(meta_ref[_ROW_RD, i + 1]).start()

        pos = jax.lax.broadcasted_iota(I32, (W, 1), 0)
        valid = (pos >= off) & (pos < off + L)
        for hh in range(hb):
            o, S1, G, U, km = _tile_math(q_buf[cur, :, hh, :].astype(F32), k_buf[cur, :, hh, :].astype(F32),
                                         v_buf[cur, :, hh, :].astype(F32), g_buf[cur, :, hh, :].astype(F32),
                                         b_buf[cur, :, pl.ds(hh, 1)].astype(F32), s_scr[hh], valid, sub)
            o_buf[:, hh, :] = o
            s_new[hh] = S1
            g_scr[hh] = G
            u_scr[hh] = U
            kk_scr[hh] = km

        for ok, cp in out_pieces():
            @pl.when(ok)
            def _():
                cp.start()

        # snapshots in this tile: the state after window position p, from the tile's S0 (s_scr)
        def snap(e, carry):
            p = off + sp_ref[e]
            jpos = jax.lax.broadcasted_iota(I32, (W, 1), 0)
            mask = (jpos >= off) & (jpos <= p)
            for hh in range(hb):
                G = g_scr[hh]
                Gp = g_scr[hh, pl.ds(p, 1), :]  # [1, dk]
                kd = jnp.where(mask, kk_scr[hh] * jnp.exp(jnp.where(mask, Gp - G, 0.0)), 0.0)
                snap_buf[hh] = s_scr[hh] * jnp.exp(Gp).reshape(-1, 1) + _dot_t(kd, u_scr[hh])
            cp = pltpu.make_async_copy(snap_buf, state_out.at[layer, ss_ref[e], heads], sem.at[_SEM_SNAP])
            cp.start()
            cp.wait()
            return carry

        jax.lax.fori_loop(m(_ROW_SLO), m(_ROW_SHI), snap, 0)

        s_scr[...] = s_new[...]

        @pl.when(write)
        def _():
            state_wr.start()
            state_wr.wait()

        for ok, cp in out_pieces():
            @pl.when(ok)
            def _():
                cp.wait()


VMEM_LIMIT = 48 * 2**20  # the kernel's scoped VMEM limit (a v7x TensorCore has 64 MiB)
MAX_HEADS = 8  # heads per grid step at most: the tile math is unrolled per head (compile time)


def prefill_vmem_bytes(hb: int, W: int, dk: int, dv: int) -> int:
    """VMEM one grid step of :func:`kda_prefill` holds (f32, (8, 128) tiles with padding): the
    q/k/v/g windows and the beta window, double-buffered; o of the window; the carried,
    staged, new and snapshot states; the G / U / masked-k scratch; plus the live values of one
    head's tile math (the ``[W, W]`` score and solve matrices, the ``[16, 16, dk]`` in-block
    decay tensor), counted as four ``[W, max(W, 128)]`` and one ``[16, 16, dk]`` f32 arrays."""
    lanes = lambda n: -(-n // 128) * 128  # noqa: E731
    hb8 = -(-hb // 8) * 8
    windows = 2 * 4 * W * hb8 * (3 * lanes(dk) + lanes(dv)) + 2 * 4 * W * lanes(hb)
    o = 4 * W * hb8 * lanes(dv)
    states = 4 * 4 * hb * dk * lanes(dv)
    scratch = 4 * hb * W * (2 * lanes(dk) + lanes(dv))
    live = 4 * (4 * W * lanes(max(W, dk + dv)) + 16 * 16 * lanes(dk))
    return windows + o + states + scratch + live


def prefill_heads(H: int, W: int, dk: int, dv: int, budget: int) -> int:
    """Heads per grid step for :func:`kda_prefill`: the largest divisor of H that Mosaic
    accepts (a multiple of 8, or H) up to ``MAX_HEADS`` whose :func:`prefill_vmem_bytes` fits
    ``budget`` (the smallest such when none fits). Why at most 8: the per-head tile math is
    unrolled in the kernel body and compile time grows with it, while the head axis is already
    "parallel" and a step's matmuls are per head, so more heads per step buy nothing but
    fewer steps (at 96 heads, T 512, C 64, rows 8: 7.0 MiB used, 17 s on a loaded 2-core host)."""
    ok = [n for n in range(1, H + 1) if H % n == 0 and (n % 8 == 0 or n == H)]
    fit = [n for n in ok if n <= max(MAX_HEADS, min(ok)) and prefill_vmem_bytes(n, W, dk, dv) <= budget]
    return max(fit) if fit else min(ok)


def _check(q, k, v, g, beta, state_pool, chunk_size, blocks, vmem_limit_bytes=VMEM_LIMIT):
    T, H, dk = q.shape
    dv = v.shape[-1]
    L, S = state_pool.shape[:2]
    want = {"k": (k.shape, (T, H, dk)), "v": (v.shape, (T, H, dv)), "g": (g.shape, (T, H, dk)),
            "beta": (beta.shape, (T, H)), "state_pool": (state_pool.shape, (L, S, H, dk, dv))}
    bad = [f"{n} {tuple(got)} (want {exp})" for n, (got, exp) in want.items() if tuple(got) != tuple(exp)]
    if bad:
        raise ValueError("kda_prefill: shapes do not match: " + "; ".join(bad))
    if state_pool.dtype != F32:
        raise ValueError(f"kda_prefill: state_pool must be float32, not {state_pool.dtype}")
    if chunk_size < 2:
        raise ValueError(f"chunk_size {chunk_size} must be >= 2")
    W = min(chunk_size, T)
    if blocks is None:
        blocks = (prefill_heads(H, W, dk, dv, vmem_limit_bytes // 2),)
    hb = blocks[0]
    sub = blocks[1] if len(blocks) > 1 else 16
    if hb < 1 or H % hb:
        raise ValueError(f"blocks {blocks}: heads_per_block must divide H={H}")
    if sub < 1 or W % sub or sub > W:
        sub = W  # one block: the whole window inverted by row substitution
    return T, H, dk, dv, L, S, hb, sub, W


def _prefill_rows(q_lens):
    ql = q_lens.astype(I32)
    return jnp.where(ql >= 2, ql, 0)


def _snap_used(snap_row, snap_len, snap_slot, ql, R, S):
    srow = jnp.minimum(snap_row, R - 1).astype(I32)
    slen = snap_len.astype(I32)
    used = (snap_row < R) & (slen >= 1) & (slen <= ql[srow]) & (snap_slot >= 0) & (snap_slot < S)
    return srow, slen, used


@functools.partial(jax.jit, static_argnames=("chunk_size", "blocks", "interpret", "vmem_limit_bytes"))
def kda_prefill(q, k, v, g, beta, state_pool, layer, tok_row, cu_q_lens, q_lens, start_pos, read_slot, write_slot,
                fresh, snap_row, snap_len, snap_slot, *, chunk_size: int = 64, blocks: tuple | None = None, interpret=None,
                vmem_limit_bytes: int = VMEM_LIMIT):
    """The prefill rows (``q_len >= 2``) of one KDA layer over the flattened step (module
    docstring: layout, math, grid, aliasing assumption, cost). Returns ``(o [T, H, dv] float32,
    state_pool)``, the pool updated in place (aliased; donate it at the outermost jit).

    ``blocks = (heads_per_block,)`` or ``(heads_per_block, sub_block)``: heads per grid step
    (must divide H; on a TPU a multiple of 8 or H) and the row block of the solve and of the
    in-block decay pairs (default 16; the whole window if it does not divide ``min(chunk_size,
    T)``). ``chunk_size``: C, static. ``interpret``: None (compile for TPU), True or a
    ``pltpu.InterpretParams`` (CPU tests)."""
    T, H, dk, dv, L, S, hb, sub, W = _check(q, k, v, g, beta, state_pool, chunk_size, blocks, vmem_limit_bytes)
    C = chunk_size
    R = q_lens.shape[0]
    NS = snap_row.shape[0]
    ql = _prefill_rows(q_lens)
    cu = cu_q_lens.astype(I32)
    tl = ragged_tiles(cu, ql, start_pos.astype(I32), T, C)
    NT = max(1, min(tl["tile_row"].shape[0], T // C + 2 * min(R, T // 2)))  # >= 1: a grid needs a step
    row = tl["tile_row"][:NT]
    tok0, tlen, loc0 = tl["tile_tok0"][:NT], tl["tile_len"][:NT], tl["tile_loc0"][:NT]

    # snapshots: the tile holding token snap_len - 1 of the row, entries sorted by tile
    srow, slen, used = _snap_used(snap_row, snap_len, jnp.asarray(snap_slot, I32), ql, R, S)
    first_len, cu_tiles = tl["first_len"], tl["cu_tiles"]
    s_m = jnp.where(slen - 1 < first_len[srow], 0, 1 + (slen - 1 - first_len[srow]) // C)
    s_tile = jnp.where(used, cu_tiles[srow] + s_m, NT)  # NT: never visited
    order = jnp.argsort(s_tile)
    s_sorted = s_tile[order]
    tiles = jnp.arange(NT, dtype=I32)
    s_lo = jnp.searchsorted(s_sorted, tiles, side="left").astype(I32)
    s_hi = jnp.searchsorted(s_sorted, tiles, side="right").astype(I32)
    s_p = (slen[order] - 1 - loc0[jnp.minimum(s_sorted, NT - 1)]).astype(I32)  # position in the tile
    s_slot = jnp.asarray(snap_slot, I32)[order]
    if NS == 0:  # SMEM arrays need an element
        s_p, s_slot = jnp.zeros((1,), I32), jnp.zeros((1,), I32)

    meta = jnp.zeros((_N_META, NT), I32)
    vals = {_ROW_TOK0: tok0, _ROW_LEN: tlen, _ROW_W0: jnp.clip(tok0, 0, T - W),
            _ROW_FIRST: tl["tile_first"][:NT], _ROW_LAST: tl["tile_last"][:NT],
            _ROW_RD: jnp.clip(jnp.asarray(read_slot, I32)[row], 0, S - 1),
            _ROW_WR: jnp.asarray(write_slot, I32)[row], _ROW_FRESH: jnp.asarray(fresh)[row],
            _ROW_SLO: s_lo, _ROW_SHI: s_hi}
    for r_, x in vals.items():
        meta = meta.at[r_].set(x.astype(I32))
    ntiles = jnp.minimum(tl["num_tiles"], NT).reshape(1).astype(I32)
    scalars = (meta, ntiles, jnp.asarray(layer, I32).reshape(1), s_p, s_slot)

    # beta by head block [H/hb, T, hb] float32: a window is rows w0.. of one block, whole in
    # its minor dim (a dynamic lane offset h * hb in [T, H] does not lower)
    beta_b = beta.astype(F32).reshape(T, H // hb, hb).transpose(1, 0, 2)
    any_spec = pl.BlockSpec(memory_space=pltpu.HBM)  # not ANY: a small operand may land in VMEM
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(H // hb, NT),
        in_specs=[any_spec] * 7,
        out_specs=[any_spec, any_spec],
        scratch_shapes=[pltpu.VMEM((2, W, hb, dk), q.dtype), pltpu.VMEM((2, W, hb, dk), k.dtype),
                        pltpu.VMEM((2, W, hb, dv), v.dtype), pltpu.VMEM((2, W, hb, dk), g.dtype),
                        pltpu.VMEM((2, W, hb), F32),  # token windows, double-buffered
                        pltpu.VMEM((W, hb, dv), F32),  # o of the window
                        pltpu.VMEM((hb, dk, dv), F32),  # the carried state (S0 of the tile)
                        pltpu.VMEM((hb, dk, dv), F32),  # a row's initial state, prefetched
                        pltpu.VMEM((hb, dk, dv), F32),  # the state after the tile
                        pltpu.VMEM((hb, W, dk), F32),  # G
                        pltpu.VMEM((hb, W, dv), F32),  # U
                        pltpu.VMEM((hb, W, dk), F32),  # k, masked
                        pltpu.VMEM((hb, dk, dv), F32),  # a snapshot
                        pltpu.SemaphoreType.DMA((2, 5)),
                        pltpu.SemaphoreType.DMA((_N_SEM,)),
                        pltpu.SemaphoreType.DMA((C.bit_length(),))])
    n = len(scalars)
    o, state_pool = pl.pallas_call(
        functools.partial(_kernel, hb=hb, W=W, T=T, C=C, sub=sub, num_slots=S),
        grid_spec=spec,
        out_shape=[jax.ShapeDtypeStruct((T, H, dv), F32), jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={n + 6: 0, n + 5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        # each prefill row's state read and written (at most T // 2 rows hold two tokens or
        # more; the others are not touched, so a decode step's rows count once, in the decode
        # kernel), each snapshot written; per token q, k, v, g, beta in and o out
        cost_estimate=cost_estimates.kda_state_rows(
            min(R, T // 2), H, dk, dv, state_pool.dtype.itemsize, T,
            H * ((2 * dk + dk) * q.dtype.itemsize + dv * v.dtype.itemsize + 4 + dv * 4),
            extra_bytes=NS * H * dk * dv * state_pool.dtype.itemsize),
        interpret=interpret,
    )(*scalars, q, k, v, g, beta_b, state_pool, jnp.zeros((T, H, dv), F32))
    return o, state_pool


@functools.partial(jax.jit, static_argnames=("chunk_size", "blocks", "interpret"))
def kda_prefill_reference(q, k, v, g, beta, state_pool, layer, tok_row, cu_q_lens, q_lens, start_pos, read_slot,
                          write_slot, fresh, snap_row, snap_len, snap_slot, *, chunk_size: int = 64, blocks=None,
                          interpret=None):
    """:func:`kda_prefill` in pure JAX (the oracle and the CPU path), same signature and result;
    ``blocks`` and ``interpret`` are ignored. The prefill rows' states are gathered from the
    pool (zeros for fresh rows), ``kda_ragged`` runs with the rows of ``q_len < 2`` hidden (their
    length 0, their tokens padding), then the final states of the prefill rows and the used
    snapshots are scattered into the pool (write slots, then snapshot slots)."""
    del blocks, interpret
    T, H, dk, dv, L, S, *_ = _check(q, k, v, g, beta, state_pool, chunk_size, (1,))
    R = q_lens.shape[0]
    ql = _prefill_rows(q_lens)
    tr = jnp.asarray(tok_row, I32)
    tr = jnp.where((tr < R) & (ql[jnp.minimum(tr, R - 1)] > 0), tr, R)
    fr = jnp.asarray(fresh).astype(bool)
    rows = state_pool[layer, jnp.clip(jnp.asarray(read_slot, I32), 0, S - 1)].astype(F32)
    rows = jnp.where(fr[:, None, None, None], 0.0, rows)
    srow_in, slen_in = snap_row, snap_len
    if snap_row.shape[0] == 0:  # kda_ragged indexes its entries: give it one unused entry
        srow_in, slen_in = jnp.full((1,), R, I32), jnp.zeros((1,), I32)
    o, new_state, snaps = kda_ragged(q, k, v, g, beta, rows, tr, cu_q_lens, ql, start_pos, srow_in, slen_in,
                                     chunk_size=chunk_size)
    ws = jnp.asarray(write_slot, I32)
    ws = jnp.where((ql >= 2) & (ws >= 0) & (ws < S), ws, S)  # S: dropped
    state_pool = state_pool.at[layer, ws].set(new_state.astype(state_pool.dtype), mode="drop")
    ss = jnp.asarray(snap_slot, I32)
    _, _, used = _snap_used(snap_row, snap_len, ss, ql, R, S)
    state_pool = state_pool.at[layer, jnp.where(used, ss, S)].set(snaps[:ss.shape[0]].astype(state_pool.dtype),
                                                                  mode="drop")
    return o, state_pool
