"""KDA decode over batched rows as a Pallas TPU kernel (issue #15, kernel 2): for R decode rows
(one token each) of one KDA layer, the conv-window update, SiLU, L2 norms, the forget gate,
the delta step on the recurrent state and the gated output RMSNorm, in one ``pallas_call``;
the state and the conv window are read from the row's read slot and written **in place** to
its write slot (and to its snapshot slot when asked).

Why: at K3 size a sequence's KDA state is 69 layers x 96 heads x 128 x 128 float32 (about
6.3 MB per layer), read and written every decode step — the dominant HBM traffic of decode
below ~32K context. The reference path gathers every layer's rows before the layer scan and
scatters them back after; this kernel moves each row's state once per layer, straight
between the pool and VMEM.

Inputs (T tokens of the flattened step; row r's token is ``tok[r]``)::

  qkv_raw  [T, 3P]  raw (pre-conv) q|k|v projections, P = H*d (any float dtype)
  f        [T, P]   raw forget projection (before dt_bias)
  beta     [T, H]   write strength (already sigmoided)
  gate_out [T, P]   raw output gate (sigmoided here)
  state_pool [L, S, H, d, d]   S[k, v] per layer and slot (float32), passed whole
  conv_pool  [L, S, W-1, 3P]   last W-1 raw q|k|v projections, oldest first, passed whole;
         or [L, S, (W-1)*3H, d]  the same elements in the same order ("row layout": window
                               row t, part p (q|k|v), head h is row (t*3 + p)*H + h) — the one
                               to use on TPU (below)
  layer      scalar: which layer of the pools
  tok, read_slot, write_slot, snap_slot, fresh [R]; n_dec scalar
  conv_w [3P, W] (column W-1 multiplies the newest), A_log [H], dt_bias [P], o_norm [d]

Per live row (``r < n_dec``): window = [conv_pool[layer, read_slot] (zeros if fresh) |
qkv_raw[tok]] -> depthwise causal conv -> SiLU -> q, k, v per head; q L2-normalised times
d^-1/2, k L2-normalised (eps 1e-6 inside the rsqrt); ``g = lower_bound * sigmoid(exp(A_log) *
(f + dt_bias))`` (K3) or ``-exp(A_log) * softplus(f + dt_bias)`` (Kimi Linear, ``lower_bound
None``); the delta step of ``kernels/kda.py::kda_decode_step`` on ``state_pool[layer,
read_slot]`` (zeros if fresh); ``o = rms_normalize(o, eps) * o_norm * sigmoid(gate_out)``.
The new state and window go to ``write_slot`` and, when ``0 <= snap_slot < S``, also to
``snap_slot`` (a write slot outside ``[0, S)`` is dropped, as the engine's scatter does).
Rows ``r >= n_dec`` are skipped: nothing read, nothing written, their ``o`` is zero.

Grid ``(ceil(R / rows_per_tile), H / heads_per_block)``, both axes "parallel": a grid step
owns ``rows_per_tile`` rows and ``heads_per_block`` heads, i.e. disjoint (slot, head-range)
regions of both pools, so steps never depend on one another. Row tiles wholly past ``n_dec``
do nothing (the grid is static; ``n_dec`` is traced). Metadata are scalar-prefetched into
SMEM. The rows' tokens are gathered by the wrapper in row order (``[3, R, P]`` q|k|v, ``[R,
P]`` f and gate, beta repeated per channel to ``[R, P]``, in the inputs' dtype) and enter as
ordinary ``(rt, hb*d)`` blocks that Pallas pipelines. Why: a row's token is one row of ``[T,
3P]``, and a one-row DMA of bf16 (two rows packed per sublane) is rejected by Mosaic on TPU
("Slice sizes along tiled dimensions must be aligned"), from HBM and into VMEM alike; a block
of 8 gathered rows is a whole tile. The gather costs ``R·6P·isz`` read and written by XLA
(bf16: 9.4 MB at 64 rows, K3), against ~800 MB of state traffic.
The pools stay in HBM (``pltpu.HBM``; with ``pl.ANY`` a small operand may be placed in VMEM)
and are moved by manual DMA, since rows are ragged: per live row its conv window (3 DMAs, the
q, k and v column ranges; 3 (W-1) DMAs of ``[hb, d]`` rows in the row layout) and its state
``[hb, d, d]``. Within a step every read is started first; the windows are awaited, the
vector prologue (conv, SiLU, norms, gates) runs on the whole tile, the new conv windows are
written out; then row by row
the state is awaited, updated in place in VMEM head by head (a ``[d, d]`` tile at a time)
and its write DMA started, so a row's update overlaps the DMAs of the others. Every write is
awaited before the step ends. Nothing is reshaped or bitcast as a ref: the VMEM scratch is
declared in its final shapes and only values are reshaped (TPU interpret mode rejects ref
reshapes).

Aliasing assumption (the engine's): among the live rows, write slots and snapshot slots are
pairwise distinct, and no row reads a slot another row writes (a row may read and write its
own slot — the usual case — and a prefix hit reads a snapshot slot and writes its own slot).
Reads then see the pools as they were before the call, whatever the order of the grid steps.
If a row read a slot another row writes, it could see the old state, the new one or a mix
(another tile's step may have written it already; within a tile the read and the other row's
write can be in flight together — the interpreter's race detector reports that), and
duplicate written slots keep one writer's data, unspecified (the reference's XLA scatter has
the same caveat).

Cost per call, with R' = live rows, F = fresh ones among them, N = rows with a snapshot,
H heads of width d, P = H*d, W the conv width, ``isz`` the token inputs' itemsize::

  HBM bytes ≈ 4·H·d²·((R' - F) + R' + N)        state: read, write, snapshot
            + 4·(W-1)·3P·((R' - F) + R' + N)    conv window: same
            + 3·R·6P·isz                         the rows' q|k|v, f, gate_out, beta per channel
                                                 (gathered by XLA, read by the kernel)
            + 4·R·H·d                            o
  FLOPs ≈ R'·(7·H·d² + 2·3P·W + ~30·P)          delta step (decay, two reductions, rank-1
                                                 update), conv, norms and gates

so at K3 size (H=96, d=128, W=4) a non-fresh row without a snapshot moves 12.6 MB of state
and 0.9 MB of conv window for ~11 MFLOP: under 1 FLOP per byte, bandwidth-bound on any TPU.
VMEM per step (:func:`decode_vmem_bytes`, what :func:`decode_blocks` plans with) ≈
4·rt·hb·d² (states) + 8·rt·3·8·hb·d (windows read and written, W-1 rows padded to a sublane
tile) + 48·8·hb·d (token blocks, double-buffered, f32 at most) + the column buffer ``[3, hb, d, rt]`` (rt on
lanes, padded to 128) + small; 8 rows x 8 heads at d = 128: 4 + 1.5 + 0.4 + 1.5 MiB. The
kernel asks for ``vmem_limit_bytes`` = 48 MiB (:data:`VMEM_LIMIT`; the default scoped limit is
32 MiB of a v7x TensorCore's 64) and plans blocks within half of it, the rest left to Mosaic's
own values of the prologue. Compiled for ``tpu7x`` (libtpu, tests/test_tpu_aot_kda.py): 8 x 8
blocks use 6.6 MiB at 96 and at 24 heads.

The conv pool on TPU: XLA's default layout of ``f32[L, S, W-1, 3P]`` does not keep the window
rows (3) second-minor (it picks ``{1, 2, 0, 3}``, S outermost, to avoid padding 3 to 8), Mosaic
wants row-major tiles, so XLA copies the whole pool in and out around the kernel (~57 MiB per
layer of 129 slots at 96 heads; on every call). ``[L, S, (W-1)*3H, d]`` is the same bytes with a
second-minor dim that needs no padding when ``(W-1)*3H`` is a multiple of 8 (H = 96: 864 rows):
its default layout is row-major and the compiled program has no copy of either pool. The
engine's pool is stored so (``model.cache.conv_pool_rows``; under a recipe each rank's block
of rows is this layout for its heads: at 3 heads, 27 rows, XLA still prefers a slot-minor
layout and relays the pool out, docs/compile.md).

Speculative decoding: decode rows that carry drafts run this kernel's record mode,
``kernels/kda_spec_kernel.py`` (a separate ``pallas_call`` with the same pools, DMA scheme and
aliasing rules: last step's accepted drafts folded in from the journal, the first token
committed exactly as here, the drafts verified in VMEM and journaled in place). This kernel is
plain decoding only.

Status: interpret mode on the CPU (tests/test_kda_decode_kernel.py) and compiled for tpu7x
(tests/test_tpu_aot_kda.py); never run on a TPU (speed and DMA ordering unverified).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import cost_estimates
from .kda import kda_decode_step
from .kda_ragged import ragged_causal_conv

F32 = jnp.float32
I32 = jnp.int32
L2_EPS = 1e-6  # as model/kda.py::l2_normalize

# semaphore columns per row: reads (conv q/k/v, state)
_IN_CONV, _IN_STATE, _N_IN = 0, 3, 4
# writes (conv q/k/v to write slot, to snapshot slot, state to write slot, to snapshot slot)
_OUT_CONV, _OUT_CONV_SNAP, _OUT_STATE, _OUT_STATE_SNAP, _N_OUT = 0, 3, 6, 7, 8


def _l2_normalize(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _rms_normalize(x, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def _softplus(x):
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _log_decay(f, a, dt_bias, lower_bound):
    """Per-channel log-decay from the raw forget projection; ``a = exp(A_log)`` broadcast per
    channel. Static choice of K3's bounded gate or Kimi Linear's softplus gate."""
    x = f + dt_bias
    if lower_bound is None:
        return -a * _softplus(x)
    return lower_bound * jax.nn.sigmoid(a * x)


def _kernel(rd_ref, wr_ref, sn_ref, fr_ref, n_ref, layer_ref,
            cw_ref, a_ref, dtb_ref, on_ref, x_ref, f_ref, b_ref, go_ref,
            state_hbm, conv_hbm,
            o_ref, state_out, conv_out,
            win_buf, cnew_buf, s_buf, cols_buf, rows_buf, o_buf, sem_in, sem_out,
            *, rt, hb, d, P, Wm1, num_slots, lower_bound, eps, conv_rows):
    i, h = pl.program_id(0), pl.program_id(1)
    C = hb * d
    col0 = h * C  # first channel of this head block within a q/k/v part
    layer = layer_ref[0]
    n_dec = n_ref[0]

    def row(j):
        r = i * rt + j
        live = r < n_dec
        fresh = fr_ref[r] != 0
        w, s = wr_ref[r], sn_ref[r]
        return dict(r=r, live=live, load=live & jnp.logical_not(fresh), fresh=live & fresh,
                    write=live & (w >= 0) & (w < num_slots), snap=live & (s >= 0) & (s < num_slots),
                    rd=rd_ref[r], wr=w, sn=s)

    rows = [row(j) for j in range(rt)]

    # ---- reads: descriptors (rebuilt identically for the waits)
    H = P // d

    def conv_at(ref, slot, p, t):
        """Part p of a window in the pool, this head block: all W-1 rows (``t`` None, pool
        ``[L, S, W-1, 3P]``) or window row t (pool ``[L, S, (W-1)*3H, d]``: hb whole rows)."""
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

    tile_live = i * rt < n_dec

    @pl.when(tile_live)
    def _():
        # small reads first (needed first), then the states
        for j, m in enumerate(rows):
            @pl.when(m["load"])
            def _():
                for cp in conv_in_copies(j, m["rd"]):
                    cp.start()

            @pl.when(m["fresh"])
            def _():
                win_buf[j] = jnp.zeros(win_buf.shape[1:], win_buf.dtype)

        for j, m in enumerate(rows):
            @pl.when(m["load"])
            def _():
                state_in(j, m).start()

        for j, m in enumerate(rows):
            @pl.when(m["load"])
            def _():
                for cp in conv_in_copies(j, m["rd"]):
                    cp.wait()

        # ---- vector prologue on the whole tile (rows that are not live compute garbage that
        # is never stored: their o is masked and their pools are not written)
        cw = cw_ref[...].astype(F32)  # [3, W, C]
        ys = []
        for p in range(3):
            x = x_ref[p].astype(F32)  # [rt, C]
            y = x * cw[p, Wm1:Wm1 + 1]
            for t in range(Wm1):
                y = y + win_buf[:, p, t].astype(F32).reshape(rt, C) * cw[p, t:t + 1]
            ys.append(y * jax.nn.sigmoid(y))  # SiLU
            # new window: drop the oldest, append this token
            if Wm1 > 1:
                cnew_buf[:, p, pl.ds(0, Wm1 - 1)] = win_buf[:, p, pl.ds(1, Wm1 - 1)]
            cnew_buf[:, p, Wm1 - 1] = x.reshape(cnew_buf.shape[:1] + cnew_buf.shape[3:]).astype(cnew_buf.dtype)

        # the new windows can leave now
        for j, m in enumerate(rows):
            @pl.when(m["write"])
            def _():
                for cp in conv_out_copies(j, m["wr"], _OUT_CONV):
                    cp.start()

            @pl.when(m["snap"])
            def _():
                for cp in conv_out_copies(j, m["sn"], _OUT_CONV_SNAP):
                    cp.start()

        q = _l2_normalize(ys[0].reshape(rt, hb, d)) * (d ** -0.5)
        k = _l2_normalize(ys[1].reshape(rt, hb, d))
        v = ys[2].reshape(rt, hb, d)
        g = _log_decay(f_ref[...].astype(F32), a_ref[...], dtb_ref[...], lower_bound)  # [rt, C]
        eg = jnp.exp(g)
        bv = b_ref[...].astype(F32).reshape(rt, hb, d)
        # q, k, e^g as columns (the state's k axis is its second-minor one): one transpose per tile
        for c, val in enumerate((q.reshape(rt, C), k.reshape(rt, C), eg)):
            cols_buf[c] = val.T.reshape(hb, d, rt)
        rows_buf[0] = v
        rows_buf[1] = bv

        # ---- the delta step, row by row, head by head; each row's state leaves when done
        for j, m in enumerate(rows):
            @pl.when(m["load"])
            def _():
                state_in(j, m).wait()

            @pl.when(m["fresh"])
            def _():
                s_buf[j] = jnp.zeros(s_buf.shape[1:], s_buf.dtype)

            @pl.when(m["live"])
            def _():
                for hh in range(hb):
                    S = s_buf[j, hh].astype(F32)  # [d(k), d(v)]
                    qc = cols_buf[0, hh, :, pl.ds(j, 1)]  # [d, 1]
                    kc = cols_buf[1, hh, :, pl.ds(j, 1)]
                    egc = cols_buf[2, hh, :, pl.ds(j, 1)]
                    vr = rows_buf[0, j, pl.ds(hh, 1), :]  # [1, d]
                    br = rows_buf[1, j, pl.ds(hh, 1), :]
                    Sd = S * egc
                    pred = jnp.sum(kc * Sd, axis=0, keepdims=True)
                    oq = jnp.sum(qc * Sd, axis=0, keepdims=True)
                    delta = (vr - pred) * br
                    o_buf[j, pl.ds(hh, 1), :] = oq + jnp.sum(qc * kc, axis=0, keepdims=True) * delta
                    s_buf[j, hh] = (Sd + kc * delta).astype(s_buf.dtype)

            @pl.when(m["write"])
            def _():
                state_out_copy(j, m["wr"], _OUT_STATE).start()

            @pl.when(m["snap"])
            def _():
                state_out_copy(j, m["sn"], _OUT_STATE_SNAP).start()

        # ---- gated output norm on the tile
        o = o_buf[...]  # [rt, hb, d]
        gate = jax.nn.sigmoid(go_ref[...].astype(F32)).reshape(rt, hb, d)
        o = _rms_normalize(o, eps) * on_ref[...] * gate
        live = (i * rt + jax.lax.broadcasted_iota(I32, (rt, 1, 1), 0)) < n_dec
        o_ref[...] = jnp.where(live, o, 0.0)

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

    @pl.when(jnp.logical_not(tile_live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


VMEM_LIMIT = 48 * 2**20  # the kernel's scoped VMEM limit (a v7x TensorCore has 64 MiB)


def _pad(n, m):
    return -(-n // m) * m


def decode_vmem_bytes(rt: int, hb: int, d: int, W: int) -> int:
    """VMEM one grid step of :func:`kda_decode` holds with blocks ``(rt, hb)`` (f32, tiles of
    (8, 128) with padding): the states, the conv windows read and written, the token blocks
    (double-buffered by the pipeline), the column / row / o buffers and the parameter blocks."""
    C = hb * d
    state = 4 * rt * hb * _pad(d, 8) * _pad(d, 128)
    windows = 2 * 4 * rt * 3 * _pad(W - 1, 8) * C
    tokens = 2 * 4 * 6 * _pad(rt, 8) * C
    cols = 4 * 3 * hb * d * _pad(rt, 128)
    rows = 4 * 4 * rt * _pad(hb, 8) * _pad(d, 128)  # v, beta, o before the norm, o out (x2)
    params = 2 * 4 * (3 * _pad(W, 8) * C + 2 * 8 * C + 8 * 128)
    return state + windows + tokens + cols + rows + params


MAX_UNROLL = 64  # rows x heads per grid step: the delta step is unrolled per (row, head)


def decode_blocks(R: int, H: int, d: int, W: int, budget: int) -> tuple[int, int]:
    """``(rows_per_tile, heads_per_block)`` for :func:`kda_decode`: 8 rows per tile (one f32
    sublane tile of the token blocks; all rows when fewer) and the largest head block that
    Mosaic accepts (a multiple of 8 dividing H, or H) whose :func:`decode_vmem_bytes` fits
    ``budget`` and with at most ``MAX_UNROLL`` (row, head) pairs per step; the smallest such
    block when none fits. Why the cap: the kernel body unrolls the delta step per row and
    head, and compile time follows (tpu7x, 96 heads, 8 rows: 6.5 s at 8 x 8 = 6.9 MiB of VMEM,
    14.3 s at 8 x 24 = 20.5 MiB, on a loaded 2-core host); a bigger block only saves grid
    steps (~0.35 us each against ~2 us of state traffic per 8 x 8 step)."""
    rt = max(1, min(8, R))
    ok = [n for n in range(1, H + 1) if H % n == 0 and (n % 8 == 0 or n == H)]
    fit = [n for n in ok if decode_vmem_bytes(rt, n, d, W) <= budget and rt * n <= max(MAX_UNROLL, rt * min(ok))]
    return rt, max(fit) if fit else min(ok)


def conv_is_rows(shape, H: int, d: int, W: int) -> bool:
    """Whether a conv pool of ``shape`` is in the row layout ``[L, S, (W-1)*3H, d]`` rather
    than ``[L, S, W-1, 3P]`` (the same elements in the same order, P = H*d; module docstring:
    why the row layout). The rows may go on to a multiple of 8 (``model.cache.conv_block_rows``:
    padding rows, never read or written here)."""
    n = (W - 1) * 3 * H
    return len(shape) == 4 and shape[3] == d and (shape[2] == n or (shape[2] == -(-n // 8) * 8))


def conv_slot_window(x, W: int, P: int):
    """A slot's conv window ``[..., W-1, 3P]`` from its pool rows ``[..., rows, d]`` or
    ``[..., W-1, 3P]`` (either layout; padding rows dropped)."""
    lead = x.shape[:-2]
    flat = x.reshape(lead + (-1,))[..., :(W - 1) * 3 * P]
    return flat.reshape(lead + (W - 1, 3 * P))


def conv_slot_rows(win, pool_shape):
    """The inverse of :func:`conv_slot_window`: windows ``[..., W-1, 3P]`` as slots of a pool of
    ``pool_shape`` (padding rows zeros)."""
    lead = win.shape[:-2]
    flat = win.reshape(lead + (-1,))
    n = pool_shape[2] * pool_shape[3]
    if n > flat.shape[-1]:
        flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, n - flat.shape[-1])])
    return flat.reshape(lead + tuple(pool_shape[2:]))


def _check(qkv_raw, f, beta, gate_out, state_pool, conv_pool, tok, conv_w, A_log, dt_bias, o_norm):
    T, P3 = qkv_raw.shape
    L, S, H, d, dv = state_pool.shape
    P = H * d
    W = conv_w.shape[1]
    want = {"qkv_raw": (qkv_raw.shape, (T, 3 * P)), "f": (f.shape, (T, P)), "beta": (beta.shape, (T, H)),
            "gate_out": (gate_out.shape, (T, P)),
            "conv_pool": (conv_pool.shape, (L, S, conv_pool.shape[2], d) if conv_is_rows(conv_pool.shape, H, d, W)
                          else (L, S, W - 1, 3 * P)),
            "conv_w": (conv_w.shape, (3 * P, W)), "A_log": (A_log.shape, (H,)), "dt_bias": (dt_bias.shape, (P,)),
            "o_norm": (o_norm.shape, (d,)), "state_pool": ((dv,), (d,))}
    bad = [f"{k} {got} (want {exp})" for k, (got, exp) in want.items() if tuple(got) != tuple(exp)]
    if bad or W < 2 or tok.ndim != 1:
        raise ValueError("kda_decode: shapes do not match: " + "; ".join(bad or [f"W={W}, tok {tok.shape}"]))
    return T, L, S, H, d, P, W


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "blocks", "interpret", "vmem_limit_bytes"))
def kda_decode(qkv_raw, f, beta, gate_out, state_pool, conv_pool, layer, tok, read_slot, write_slot, snap_slot,
               fresh, n_dec, conv_w, A_log, dt_bias, o_norm, *, lower_bound: float | None = -5.0, eps: float = 1e-5,
               blocks: tuple[int, int] | None = None, interpret=None, vmem_limit_bytes: int = VMEM_LIMIT):
    """One decode token for each of R rows of one KDA layer (module docstring: layout, math,
    grid, aliasing assumption, cost). Returns ``(o [R, H, d] float32 after the gated norm,
    state_pool, conv_pool)`` with the pools updated in place (aliased; donate them at the
    outermost jit or XLA keeps a copy of the caller's arrays).

    ``blocks = (rows_per_tile, heads_per_block)``; heads_per_block must divide H, R needs no
    relation to rows_per_tile. On a TPU, tiles want ``heads_per_block * d`` a multiple of 128
    and ``heads_per_block`` a multiple of 8 (or H). None: :func:`decode_blocks` (the largest
    head block whose VMEM estimate fits half of ``vmem_limit_bytes``, the kernel's scoped VMEM
    limit). ``lower_bound``: K3's gate bound (static);
    None selects Kimi Linear's softplus gate. ``eps``: the output RMSNorm's. ``interpret``:
    None (compile for TPU), True or a ``pltpu.InterpretParams`` (CPU tests)."""
    T, L, S, H, d, P, W = _check(qkv_raw, f, beta, gate_out, state_pool, conv_pool, tok, conv_w, A_log, dt_bias,
                                 o_norm)
    R = tok.shape[0]
    rt, hb = blocks if blocks is not None else decode_blocks(R, H, d, W, vmem_limit_bytes // 2)
    if rt < 1 or hb < 1 or H % hb:
        raise ValueError(f"blocks {blocks}: heads_per_block must divide H={H}")
    nt = -(-R // rt)
    Rp = nt * rt
    C = hb * d

    def meta(a, fill):
        return jnp.pad(jnp.asarray(a).astype(I32), (0, Rp - R), constant_values=fill)

    scalars = (meta(jnp.clip(read_slot, 0, S - 1), 0), meta(write_slot, -1),
               meta(snap_slot, -1), meta(fresh, 1), jnp.clip(jnp.asarray(n_dec, I32), 0, R).reshape(1),
               jnp.asarray(layer, I32).reshape(1))
    # per-layer parameters, laid out channel-last (tiny)
    cw = conv_w.astype(F32).reshape(3, P, W).transpose(0, 2, 1)  # [3, W, P]
    a = jnp.repeat(jnp.exp(A_log.astype(F32)), d).reshape(1, P)
    dtb = dt_bias.astype(F32).reshape(1, P)
    on = o_norm.astype(F32).reshape(1, d)
    # the rows' tokens gathered in row order and widened to f32 (module docstring: why)
    t = meta(jnp.clip(tok, 0, T - 1), 0)
    x = qkv_raw[t].reshape(Rp, 3, P).transpose(1, 0, 2)  # [3, Rp, P]
    b = jnp.repeat(beta[t], d, axis=1)  # [Rp, P]: beta per channel
    tok_spec = pl.BlockSpec((rt, C), lambda i, h, *_: (i, h))

    rows_layout = conv_is_rows(conv_pool.shape, H, d, W)
    win_shape = (rt, 3, W - 1, hb, d) if rows_layout else (rt, 3, W - 1, C)
    any_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=(nt, H // hb),
        in_specs=[pl.BlockSpec((3, W, C), lambda i, h, *_: (0, 0, h)),
                  pl.BlockSpec((1, C), lambda i, h, *_: (0, h)),
                  pl.BlockSpec((1, C), lambda i, h, *_: (0, h)),
                  pl.BlockSpec((1, d), lambda i, h, *_: (0, 0)),
                  pl.BlockSpec((3, rt, C), lambda i, h, *_: (0, i, h)), tok_spec, tok_spec, tok_spec,
                  any_spec, any_spec],
        out_specs=[pl.BlockSpec((rt, hb, d), lambda i, h, *_: (i, h, 0)), any_spec, any_spec],
        scratch_shapes=[pltpu.VMEM(win_shape, conv_pool.dtype),  # windows read
                        pltpu.VMEM(win_shape, conv_pool.dtype),  # windows written
                        pltpu.VMEM((rt, hb, d, d), state_pool.dtype),  # states, updated in place
                        pltpu.VMEM((3, hb, d, rt), F32),  # q, k, e^g as columns
                        pltpu.VMEM((2, rt, hb, d), F32),  # v, beta as rows
                        pltpu.VMEM((rt, hb, d), F32),  # o before the norm
                        pltpu.SemaphoreType.DMA((rt, _N_IN)),
                        pltpu.SemaphoreType.DMA((rt, _N_OUT))])
    n_pre = len(scalars) + 8  # operands before the pools
    o, state_pool, conv_pool = pl.pallas_call(
        functools.partial(_kernel, rt=rt, hb=hb, d=d, P=P, Wm1=W - 1, num_slots=S, lower_bound=lower_bound, eps=eps,
                          conv_rows=rows_layout),
        grid_spec=spec,
        out_shape=[jax.ShapeDtypeStruct((Rp, H, d), F32), jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
                   jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype)],
        input_output_aliases={n_pre: 1, n_pre + 1: 2},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        # per row: its state read and written, its conv window (3 x (W-1) taps) read and written,
        # q, k, v, f, beta and the gate in (f32 after the gather), o out
        cost_estimate=cost_estimates.kda_state_rows(
            Rp, H, d, d, state_pool.dtype.itemsize, Rp, 6 * P * 4 + H * d * 4,
            extra_bytes=2 * Rp * 3 * (W - 1) * P * conv_pool.dtype.itemsize),
        interpret=interpret,
    )(*scalars, cw, a, dtb, on, x, f[t], b, gate_out[t], state_pool, conv_pool)
    return o[:R], state_pool, conv_pool


@functools.partial(jax.jit, static_argnames=("lower_bound", "eps", "blocks", "interpret"))
def kda_decode_reference(qkv_raw, f, beta, gate_out, state_pool, conv_pool, layer, tok, read_slot, write_slot,
                         snap_slot, fresh, n_dec, conv_w, A_log, dt_bias, o_norm, *, lower_bound: float | None = -5.0,
                         eps: float = 1e-5, blocks=None, interpret=None):
    """:func:`kda_decode` in pure JAX (the oracle and the CPU path), same signature and result;
    ``blocks`` and ``interpret`` are ignored. Built from the existing references: the rows'
    windows through ``ragged_causal_conv`` (one token per row), ``kda_decode_step``, and the
    L2 / RMS norms and gates of ``model/kda.py``; pools updated by scatter (write slots, then
    snapshot slots)."""
    del blocks, interpret
    T, L, S, H, d, P, W = _check(qkv_raw, f, beta, gate_out, state_pool, conv_pool, tok, conv_w, A_log, dt_bias,
                                 o_norm)
    R = tok.shape[0]
    live = jnp.arange(R) < n_dec
    fr = jnp.asarray(fresh).astype(bool)
    rd = jnp.clip(read_slot, 0, S - 1)
    t = jnp.clip(tok, 0, T - 1)
    conv_rows = jnp.where(fr[:, None, None], 0.0, conv_slot_window(conv_pool[layer, rd].astype(F32), W, P))
    state_rows = jnp.where(fr[:, None, None, None], 0.0, state_pool[layer, rd].astype(F32))
    rows = jnp.arange(R, dtype=I32)
    none = jnp.zeros((0,), I32)
    y, new_conv, _ = ragged_causal_conv(qkv_raw[t], conv_rows, conv_w, rows, jnp.arange(R + 1, dtype=I32),
                                        jnp.ones((R,), I32), none, none)
    y = jax.nn.silu(y)
    q, k, v = (y[:, c * P:(c + 1) * P].reshape(R, H, d) for c in range(3))
    q = _l2_normalize(q) * (d ** -0.5)
    k = _l2_normalize(k)
    fx = f[t].astype(F32).reshape(R, H, d) + dt_bias.astype(F32).reshape(H, d)
    a = jnp.exp(A_log.astype(F32))[:, None]
    g = -a * jax.nn.softplus(fx) if lower_bound is None else lower_bound * jax.nn.sigmoid(a * fx)
    o, new_state = kda_decode_step(q, k, v, g, beta[t].astype(F32), state_rows)
    gate = jax.nn.sigmoid(gate_out[t].astype(F32).reshape(R, H, d))
    o = _rms_normalize(o, eps) * o_norm.astype(F32) * gate
    o = jnp.where(live[:, None, None], o, 0.0)

    def target(slot):
        return jnp.where(live & (slot >= 0) & (slot < S), slot, S)  # S: dropped

    for slot in (write_slot, snap_slot):
        idx = target(jnp.asarray(slot, I32))
        state_pool = state_pool.at[layer, idx].set(new_state.astype(state_pool.dtype), mode="drop")
        conv_pool = conv_pool.at[layer, idx].set(conv_slot_rows(new_conv, conv_pool.shape).astype(conv_pool.dtype),
                                                 mode="drop")
    return o, state_pool, conv_pool
