"""Ragged paged MLA attention as a Pallas TPU kernel (issue #15, kernel 3; TPU v7x: issue #33).

Same semantics as ``write_kv_rows`` followed by ``mla_ragged_attention(..., layer=layer,
return_lse=True)`` (``kernels/mla_ragged.py``, the oracle): this step's new ``[latent | rope]``
cache rows are written into their pages first, then every real token attends, in the absorbed
form, to the keys of its row at positions ``kpos <= pos[t]`` and ``kpos < kv_lens[row]``, with
``kpos = ordinal * page_size + offset`` (``page_ordinals`` for decode context parallelism; a
column whose page id is out of range is skipped). The softmax runs online in float32 over kv
blocks of ``kv_pages_per_block`` pages; the output is ``out_lat [T, H, Lat]`` float32 and the
exact log-sum-exp ``lse [T, H]`` that ``kernels/mla.py::merge_partials`` needs (a DCP rank's
partial). Padding tokens (``tok_row >= R``) get zeros and ``-inf`` and write nothing; rows with
``q_len == 0`` are skipped.

Layout. One flattened step of ``T`` tokens and ``R`` rows (see ``kernels/mla_ragged.py``). The
pool ``kv_pool [L, pages, page_size, W]`` is passed whole with a ``layer`` index (never a
per-layer slice) and stays in HBM (``memory_space=ANY``); ``W`` may pad the row beyond ``Lat +
Rr`` (only the first ``Lat + Rr`` lanes are read; ``new_rows`` is ``[T, W]``, written whole).

* **Write first, with XLA.** The step's rows go in by ``write_kv_rows`` (an XLA scatter) before
  the kernel, which then only reads the pool. Why: a row is one sublane of a packed bf16
  ``(16, 128)`` tile, and Mosaic rejects a DMA to an arbitrary sublane of it ("Offsets along
  tiled dimensions must be aligned to tiles"); XLA's scatter writes single rows in place. The
  data dependency orders it before every read (this step's own rows included). The pool is not
  aliased through the kernel; the scatter updates it in place when the caller donates it (jit
  with the pool donated, or a scan carry), so no whole-pool copy — **provided the pool's HBM
  layout is row-major**: a TPU's default layout for a bf16 pool whose ``W`` is not a multiple of
  128 (K3: 576) puts a 128-multiple axis (pages) minor to save the lane padding, and XLA then
  copies the whole pool into row-major and back around the kernel (measured on tpu7x, 6.75 GiB
  each way at K3 decode scale). Pad ``W`` to 640, or pin the pool's layout
  (``Format(Layout(major_to_minor=(0, 1, 2, 3)))`` on the cache arrays and the step's in/out
  shardings): both cost the same HBM, since row-major tiles pad 576 to 640 lanes anyway.
* **Page table per tile.** Only the small per-step metadata (``kv_lens``, ``cu_q_lens``,
  ``pos``, the work lists) is scalar-prefetched. The page table and its ordinals stay in HBM
  (padded to whole chunks with -1) and reach SMEM ``table_chunk`` columns (256: a multiple of
  128 lanes, so each fetch starts on a tile) at a time, per tile row, into two slots: a kv block
  that starts a new chunk fetches it (synchronously, once per ``chunk / bp`` blocks) into the
  slot the block in use does not hold. Why: the whole ``[R, P]`` table (and ordinals) at 128K
  context and 16-token pages is 2 + 2 MiB, far past SMEM; a tile needs ``2 * rows * chunk * 8``
  bytes (32 KiB).
* **Masks as f32 / int32.** Mosaic cannot reshape bool vectors (``kvalid[..., None]``) nor carry
  them through loops, so masks are built as int32 / f32 and compared where used.

Grid (static, one "arbitrary" axis, so steps run in order on one core):
``ceil(R / rows)`` decode tiles, then ``(T + min(R, T//2) * (q_block - 1)) // q_block`` query
blocks (a bound on ``sum_r ceil(q_len_r / q_block)`` over rows with ``q_len >= 2``). Work lists
are built in-graph by the wrapper and scalar-prefetched; steps past the real tiles/blocks do
nothing (``pl.when`` on the prefetched counts).

* **Decode tiles** (``q_len == 1``): ``rows`` decode rows per grid step. Their queries are DMA'd
  by token; each kv block DMAs, per row, only the pages that row needs (present, first key
  ``< kv_len`` and ``<= pos``) into a double-buffered VMEM tile ``[2, rows, bp * ps, W]``, and
  the next block's pages are in flight while the current one is multiplied. The loop runs to
  the tile's largest block count; keys a row does not need (pages not fetched, masked
  positions) are zeroed before the matmuls and masked to ``-inf`` in the scores, so stale or
  uninitialised VMEM never reaches the output.
* **Query blocks** (``q_len >= 2``): ``q_block`` queries of one row per step (a row's last block
  may be short), read as one window of the token axis (clamped into ``[0, T)``; queries outside
  the row are masked); kv blocks as above, up to the block's last query position (causal).
* Outputs are DMA'd per token into the HBM outputs, which are aliased to a zeros / ``-inf``
  initialisation (that fill is what padding tokens keep).

VMEM. ``vmem_limit_bytes`` is set explicitly (default 56 MiB of a v7x TensorCore's 64; without
it Mosaic allows 32). ``blocks=None`` (the default) picks them by :func:`choose_blocks`: 8
decode rows, then the largest query block and keys per block whose :func:`vmem_estimate` fits
``44 / 56`` of the limit (the estimate overshoots Mosaic's count by ~10-30%). Measured on
tpu7x (libtpu 0.0.42.1, compile only): 96 heads -> (8, 16, 512 keys), 32 MiB scoped; 24 heads
(tp = 4) -> (8, 32, 512 keys), 28.5 MiB. Query block 32 at 96 heads does not fit 60 MiB: the live
``[q_block * H, S]`` f32 scores and ``[q_block * H, Lat]`` accumulators scale with both.

Cost per call (``H`` heads, ``D = Lat + Rr``, ``K_r`` the keys row r's queries can reach, rounded
up to pages, itemsize ``b`` of the pool): HBM bytes ≈ ``sum_decode K_r * W * b`` + ``sum_blocks
K_block * W * b`` (a prefill row's pages are read once per query block) + new rows ``T * W * b``
(the scatter) + queries ``T * H * D * q_itemsize`` + outputs and their init fill ``2 * T * H *
(Lat + 1) * 4`` + the table chunks. FLOPs ≈ ``2 * H * (D + Lat) * (sum_decode K_r + q_block *
sum_blocks K_block)`` (scores and the latent output; masked keys inside a fetched page are
multiplied too), plus the softmax's ``O(H * keys)`` exp.

DMA copies are issued from loops (one copy site per kind: the interpreter's program, and its
compile time, grow with every site). Nothing here has run on a TPU: DMA ordering and speed are
checked in interpret mode (race detector) and the compile by ``tests/test_tpu_aot_mla.py``.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import cost_estimates
from .mla_ragged import write_kv_rows

DEFAULT_BLOCKS = None  # derived per shape by :func:`choose_blocks` from the VMEM budget
VMEM_LIMIT = 56 * 2**20  # the kernel's vmem_limit_bytes: a v7x TensorCore has 64 MiB
VMEM_BUDGET = 44 * 2**20  # what the block choice may plan for (the estimate is rough: headroom)
TABLE_CHUNK = 256  # page-table columns fetched into SMEM at a time (a multiple of 128 lanes)

_KV0, _KV1, _QSEM, _OSEM, _TSEM = range(5)  # DMA semaphores
_PREC = jax.lax.Precision.HIGHEST  # f32 matmuls in full f32 on the MXU (the reference's precision)


def vmem_estimate(blocks, H, W, Lat, Rr, ps, kv_itemsize, q_itemsize) -> int:
    """Bytes of VMEM the kernel needs at ``blocks = (rows, q_block, kv_pages_per_block)``: the
    double-buffered kv tile ``2 * rows * S * W * b`` (``S = bp * ps`` keys per block), its f32
    masked copy and [latent | rope] split ``2 * rows' * S * W * 4`` (``rows'`` = rows, or 1 for a
    query block), query scratch and their f32 values ``NB * H * (Lat + Rr) * (b_q + 4)``, output
    scratch ``NB * H * (Lat + 1) * 4``, and per query row (``M = max(rows, q_block) * H``) the
    live f32 scores / probabilities / mask ``3 * M * S * 4`` and accumulator, p@V and rescaled
    accumulator ``3 * M * Lat * 4``. Calibrated against Mosaic's ``used_scoped_memory`` on
    tpu7x (tests/test_tpu_aot_mla.py checks used <= limit)."""
    B, QB, bp = blocks
    S = bp * ps
    NB = max(B, QB)
    M = NB * H
    kv = 2 * B * S * W * kv_itemsize + 2 * B * S * W * 4
    q = NB * H * (Lat + Rr) * (q_itemsize + 4) + NB * H * (Lat + 1) * 4
    live = 3 * M * S * 4 + 3 * M * Lat * 4
    return kv + q + live


# (query block, keys per block) in order of preference: a prefill row's pages are read once per
# query block (HBM bytes ~ 1 / q_block), while a short kv block only costs a loop trip and a DMA
# wait; 32 x 96 heads does not fit with any key block worth having
_PREFERENCE = ((32, 512), (32, 256), (16, 512), (16, 256), (32, 128), (16, 128), (8, 512), (8, 256), (8, 128),
               (4, 128), (2, 128), (1, 128), (1, 64), (1, 32), (1, 16))


def choose_blocks(T, R, P, H, W, Lat, Rr, ps, kv_itemsize, q_itemsize, budget=VMEM_BUDGET):
    """The first ``(rows, q_block, kv_pages_per_block)`` in :data:`_PREFERENCE` whose
    :func:`vmem_estimate` fits ``budget``: 8 decode rows per step (one sublane tile of rows;
    the decode matmuls are ``[H, Lat] x [Lat, S]`` per row either way), then the largest query
    block, then the most keys per block (at least one page)."""
    B = max(1, min(8, R))
    for QB, keys in _PREFERENCE:
        blocks = (B, max(1, min(QB, T)), max(1, min(keys // ps, P)))
        if vmem_estimate(blocks, H, W, Lat, Rr, ps, kv_itemsize, q_itemsize) <= budget:
            return blocks
    return B, 1, 1


def grid_bounds(T: int, R: int, blocks) -> tuple[int, int]:

    """Static ``(ND, NQ)``: decode tiles ``ceil(R / rows)`` and query blocks
    ``(T + min(R, T // 2) * (q_block - 1)) // q_block`` (at least 1), which bound
    ``sum_r ceil(q_len_r / q_block)`` over the rows with ``q_len >= 2`` (at most ``min(R, T // 2)``
    of them, their q_lens summing to at most T)."""
    B, QB = blocks[0], blocks[1]
    return -(-R // B), max(1, (T + min(R, T // 2) * (QB - 1)) // QB)


def work_lists(page_table, kv_lens, cu_q_lens, q_lens, pos, ords, num_pages, page_size, blocks):
    """In-graph work lists (what the kernel prefetches), from the step's metadata.

    Returns a dict: ``dec_rows [ND * rows]`` (decode rows in row order, then ``R``),
    ``dec_nblk [ND]`` (kv blocks each decode tile runs), ``qb_row / qb_tok0 / qb_len / qb_nblk /
    qb_maxpos [NQ]`` (query blocks of the rows with ``q_len >= 2``, in row order) and ``counts``
    ``[2]`` = (decode tiles, query blocks) in use; ``ND, NQ`` from :func:`grid_bounds`."""
    R, P = page_table.shape
    T = pos.shape[0]
    B, QB, bp = blocks
    ND, NQ = grid_bounds(T, R, blocks)
    i32 = jnp.int32
    present = (page_table >= 0) & (page_table < num_pages)
    first_kpos = ords * page_size
    col_blk = jnp.arange(P, dtype=i32) // bp + 1

    def nblk_for(rows, maxpos):
        need = present[rows] & (first_kpos[rows] < kv_lens[rows, None]) & (first_kpos[rows] <= maxpos[:, None])
        return jnp.max(jnp.where(need, col_blk[None], 0), axis=1).astype(i32)

    # decode rows, batched B per tile
    dec = q_lens == 1
    n_dec = jnp.sum(dec.astype(i32))
    order = jnp.argsort(jnp.logical_not(dec), stable=True).astype(i32)
    ridx = jnp.arange(ND * B, dtype=i32)
    dec_rows = jnp.where(ridx < n_dec, jnp.pad(order, (0, ND * B - R)), R).astype(i32)
    rc = jnp.minimum(dec_rows, R - 1)
    dpos = pos[jnp.clip(cu_q_lens[rc], 0, T - 1)]
    dnb = jnp.where(dec_rows < R, nblk_for(rc, dpos), 0)
    dec_nblk = jnp.max(dnb.reshape(ND, B), axis=1)

    # query blocks of the rows with q_len >= 2
    pre = q_lens >= 2
    nb = jnp.where(pre, -(-q_lens // QB), 0)
    cu_b = jnp.cumsum(nb)
    n_qb = cu_b[-1]
    k = jnp.arange(NQ, dtype=i32)
    row = jnp.clip(jnp.searchsorted(cu_b, k, side="right"), 0, R - 1).astype(i32)
    local = k - (cu_b[row] - nb[row])
    use = k < n_qb
    tok0 = jnp.where(use, cu_q_lens[row] + QB * local, 0).astype(i32)
    qlen = jnp.where(use, jnp.clip(q_lens[row] - QB * local, 0, QB), 0).astype(i32)
    win = tok0[:, None] + jnp.arange(QB, dtype=i32)[None]
    maxpos = jnp.max(jnp.where(jnp.arange(QB)[None] < qlen[:, None], pos[jnp.clip(win, 0, T - 1)], -1), axis=1)
    qb_nblk = jnp.where(use, nblk_for(row, maxpos), 0).astype(i32)
    counts = jnp.stack([-(-n_dec // B), n_qb]).astype(i32)
    return dict(dec_rows=dec_rows, dec_nblk=dec_nblk.astype(i32), qb_row=row, qb_tok0=tok0, qb_len=qlen,
                qb_nblk=qb_nblk, qb_maxpos=maxpos.astype(i32), counts=counts)


def _online(state, s, c, pv_dims):
    """One online-softmax step; ``s`` masked scores (-inf where masked), ``c`` the block's
    (masked-to-zero) latent rows, contracted with the probabilities by ``pv_dims``."""
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jax.lax.dot_general(p, c, pv_dims, preferred_element_type=jnp.float32, precision=_PREC)
    return m_new, l, alpha[..., None] * acc + pv


def _finish(state):
    m, l, acc = state
    has = l > 0
    out = acc / jnp.where(has, l, 1.0)[..., None]
    m_safe = jnp.where(m > -jnp.inf, m, 0.0)
    return out, jnp.where(has, m_safe + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)


def _kernel(meta, kv_lens, cu, pos, dec_rows, dec_nblk, qb_row, qb_tok0, qb_len, qb_nblk, qb_maxpos,
            q_lat, q_rope, pos2d, table, ords, pool, _out_in, _lse_in, out, lse,
            kvbuf, qlb, qrb, qposb, ob, lb, tsm, osm, sem, *, T, R, NP, ps, B, QB, bp, CH, ND, H, Lat, Rr, scale):
    g = pl.program_id(0)
    layer = meta[0]
    S = bp * ps
    f32 = jnp.float32

    def run_all(descs, op):
        for ok, d in descs:
            if ok is True:
                getattr(d, op)()
            else:
                pl.when(ok)(getattr(d, op))

    def dma_loop(n, make, op):
        """``make(i) -> [(cond, desc)]``: start (or wait on) each for i in [0, n), in a loop (one
        copy site, not n: the interpreter's program grows with every site)."""
        def body(i, c):
            run_all(make(i), op)
            return c
        jax.lax.fori_loop(0, n, body, 0)

    def fetch_table(n, row_of, c):
        """Page ids and ordinals of table chunk ``c`` (columns ``[c * CH, (c + 1) * CH)``) of the
        tile's ``n`` rows into SMEM slot ``c % 2``; ``row_of(i) -> (valid, row)``. Synchronous:
        it runs once per ``CH / bp`` kv blocks, and the other slot (the block in use) is untouched."""
        slot = c % 2

        def copies(i):
            ok, r = row_of(i)
            dst = pl.ds((slot * B + i) * CH, CH)
            return [(ok, pltpu.make_async_copy(table.at[r, pl.ds(c * CH, CH)], tsm.at[dst], sem.at[_TSEM])),
                    (ok, pltpu.make_async_copy(ords.at[r, pl.ds(c * CH, CH)], osm.at[dst], sem.at[_TSEM]))]

        dma_loop(n, copies, "start")
        dma_loop(n, copies, "wait")

    def attend(nblk, n_rows, row_of, n_pages, page_copy, compute, init):
        """Double-buffered loop over ``nblk`` kv blocks: block b+1's pages fly while b is used;
        a block starting a new table chunk fetches it first. ``page_copy(b, slot, idx) -> [(cond,
        desc)]`` for the ``n_pages`` page copies of a block; ``compute(state, slot, b)`` -> state."""
        @pl.when(nblk > 0)
        def _():
            fetch_table(n_rows, row_of, 0)
            dma_loop(n_pages, functools.partial(page_copy, 0, 0), "start")

        def body(b, state):
            slot = b % 2
            nb = b + 1

            @pl.when(nb < nblk)
            def _():
                @pl.when((nb * bp) % CH == 0)
                def _():
                    fetch_table(n_rows, row_of, (nb * bp) // CH)

                dma_loop(n_pages, functools.partial(page_copy, nb, 1 - slot), "start")

            dma_loop(n_pages, functools.partial(page_copy, b, slot), "wait")
            return compute(state, slot, b)

        return jax.lax.fori_loop(0, nblk, body, init)

    def page_need(i, j, kvl, maxpos):
        """(needed, ordinal, page id) of table column j of the tile's i-th row (from SMEM)."""
        at = ((j // CH) % 2 * B + i) * CH + j % CH
        pid, o = tsm[at], osm[at]
        need = (pid >= 0) & (pid < NP) & (o * ps < kvl) & (o * ps <= maxpos)
        return need, o, jnp.clip(pid, 0, NP - 1)

    def kv_copy(pid, slot, i, k):
        return pltpu.make_async_copy(pool.at[layer, pid], kvbuf.at[slot, i, pl.ds(k * ps, ps)],
                                     sem.at[_KV0 + slot])

    def key_table(n, page, shape):
        """``(page_ok, first key position)`` per key of a block (int32; Mosaic has no bool loop
        carries), ``shape`` = (rows, S): ``page(idx) -> (row, k, needed, ordinal)`` for idx in
        [0, n) fills row ``row``'s keys of page k."""
        rowi = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        keyp = jax.lax.broadcasted_iota(jnp.int32, shape, 1) // ps

        def body(idx, c):
            ok, base = c
            i, k, need, o = page(idx)
            sel = (rowi == i) & (keyp == k)
            return jnp.where(sel, need.astype(jnp.int32), ok), jnp.where(sel, o * ps, base)

        return jax.lax.fori_loop(0, n, body, (jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32)))

    def split_kv(kv, kvf):
        """``kv [n, S, W]`` with keys where ``kvf [n, S]`` (f32 0/1: Mosaic cannot reshape bool
        vectors) is 0 zeroed (unfetched VMEM may hold anything), as f32 latent and rope parts."""
        kv = jnp.where(kvf[..., None] > 0, kv.astype(f32), 0.0)
        return kv[..., :Lat], kv[..., Lat:Lat + Rr]

    # ---- 1. decode tiles: B rows of one query each
    @pl.when(g < meta[1])
    def _():
        def drow(i):
            """(valid, row, token, query position, kv_len) of the tile's i-th row."""
            r = dec_rows[g * B + i]
            rc = jnp.minimum(r, R - 1)
            tok = jnp.clip(cu[rc], 0, T - 1)
            return r < R, rc, tok, pos[tok], kv_lens[rc]

        def q_copies(i):
            ok, _, tok, _, _ = drow(i)
            return [(ok, pltpu.make_async_copy(q_lat.at[tok], qlb.at[i], sem.at[_QSEM])),
                    (ok, pltpu.make_async_copy(q_rope.at[tok], qrb.at[i], sem.at[_QSEM]))]

        dma_loop(B, q_copies, "start")
        dma_loop(B, q_copies, "wait")
        rowv = jax.lax.broadcasted_iota(jnp.int32, (B, 1), 0)

        def fill(i, c):
            ok, _, _, qp, kl = drow(i)
            return tuple(jnp.where(rowv == i, x, v) for x, v in zip((qp, kl, ok.astype(jnp.int32)), c))

        z = jnp.zeros((B, 1), jnp.int32)
        qpos_v, kvl_v, val_v = jax.lax.fori_loop(0, B, fill, (z, z, z))
        valf = val_v.astype(f32)[:, :, None]  # [B, 1, 1]
        ql = jnp.where(valf > 0, qlb[pl.ds(0, B)].astype(f32), 0.0)  # [B, H, Lat]
        qr = jnp.where(valf > 0, qrb[pl.ds(0, B)].astype(f32), 0.0)  # [B, H, Rr]

        def row_of(i):
            ok, rc, _, _, _ = drow(i)
            return ok, rc

        def page(b, idx):
            i, k = idx // bp, idx % bp
            ok, _, _, qp, kl = drow(i)
            need, o, pid = page_need(i, b * bp + k, kl, qp)
            return i, k, ok & need, o, pid

        def page_copy(b, slot, idx):
            i, k, need, _, pid = page(b, idx)
            return [(need, kv_copy(pid, slot, i, k))]

        def compute(state, slot, b):
            page_ok, kbase = key_table(B * bp, lambda idx: page(b, idx)[:4], (B, S))
            kpos = kbase + jax.lax.broadcasted_iota(jnp.int32, (B, S), 1) % ps
            kvf = ((page_ok > 0) & (kpos < kvl_v) & (kpos <= qpos_v)).astype(f32)  # [B, S]
            c, kr = split_kv(kvbuf[slot], kvf)  # [B, S, Lat], [B, S, Rr]
            bdims = (((2,), (2,)), ((0,), (0,)))
            s = (jax.lax.dot_general(ql, c, bdims, preferred_element_type=f32, precision=_PREC)
                 + jax.lax.dot_general(qr, kr, bdims, preferred_element_type=f32, precision=_PREC)) * scale
            s = jnp.where(kvf[:, None, :] > 0, s, -jnp.inf)  # [B, H, S]
            return _online(state, s, c, (((2,), (1,)), ((0,), (0,))))

        init = (jnp.full((B, H), -jnp.inf, f32), jnp.zeros((B, H), f32), jnp.zeros((B, H, Lat), f32))
        o, s = _finish(attend(dec_nblk[g], B, row_of, B * bp, page_copy, compute, init))
        ob[pl.ds(0, B)] = o
        lb[pl.ds(0, B)] = s

        def out_copies(i):
            ok, _, tok, _, _ = drow(i)
            return [(ok, pltpu.make_async_copy(ob.at[i], out.at[tok], sem.at[_OSEM])),
                    (ok, pltpu.make_async_copy(lb.at[i], lse.at[tok], sem.at[_OSEM]))]

        dma_loop(B, out_copies, "start")
        dma_loop(B, out_copies, "wait")

    # ---- 2. query blocks: up to QB queries of one row
    kq = g - ND

    @pl.when((g >= ND) & (kq < meta[2]))
    def _():
        k = jnp.clip(kq, 0, qb_row.shape[0] - 1)
        r, tok0, n, mp = qb_row[k], qb_tok0[k], qb_len[k], qb_maxpos[k]
        kvl = kv_lens[r]
        ws = jnp.minimum(tok0, T - QB)  # the window of QB tokens holding the block
        d0 = tok0 - ws
        qd = [(True, pltpu.make_async_copy(q_lat.at[pl.ds(ws, QB)], qlb.at[pl.ds(0, QB)], sem.at[_QSEM])),
              (True, pltpu.make_async_copy(q_rope.at[pl.ds(ws, QB)], qrb.at[pl.ds(0, QB)], sem.at[_QSEM])),
              (True, pltpu.make_async_copy(pos2d.at[pl.ds(ws, QB)], qposb, sem.at[_QSEM]))]
        run_all(qd, "start")
        run_all(qd, "wait")
        qi = jax.lax.broadcasted_iota(jnp.int32, (QB, 1), 0)
        qvalid = (qi >= d0) & (qi < d0 + n)  # [QB, 1]
        qvf = qvalid.astype(f32)[:, :, None]  # [QB, 1, 1]
        qpos = qposb[...]  # [QB, 1]
        ql = jnp.where(qvf > 0, qlb[pl.ds(0, QB)].astype(f32), 0.0).reshape(QB * H, Lat)
        qr = jnp.where(qvf > 0, qrb[pl.ds(0, QB)].astype(f32), 0.0).reshape(QB * H, Rr)

        def page(b, kk):
            need, o, pid = page_need(0, b * bp + kk, kvl, mp)
            return 0, kk, need, o, pid

        def page_copy(b, slot, kk):
            _, _, need, _, pid = page(b, kk)
            return [(need, kv_copy(pid, slot, 0, kk))]

        def compute(state, slot, b):
            page_ok, kbase = key_table(bp, lambda kk: page(b, kk)[:4], (1, S))
            kpos = kbase + jax.lax.broadcasted_iota(jnp.int32, (1, S), 1) % ps  # [1, S]
            kok = (page_ok > 0) & (kpos < kvl)
            c, kr = split_kv(kvbuf[slot, pl.ds(0, 1)], kok.astype(f32))  # [1, S, Lat], [1, S, Rr]
            c, kr = c[0], kr[0]
            cdims = (((1,), (1,)), ((), ()))
            s = (jax.lax.dot_general(ql, c, cdims, preferred_element_type=f32, precision=_PREC)
                 + jax.lax.dot_general(qr, kr, cdims, preferred_element_type=f32, precision=_PREC)) * scale
            mf = (kok & (kpos <= qpos) & qvalid).astype(f32)  # [QB, S]
            s = jnp.where(mf[:, None, :] > 0, s.reshape(QB, H, S), -jnp.inf)
            return _online(state, s.reshape(QB * H, S), c, (((1,), (0,)), ((), ())))

        init = (jnp.full((QB * H,), -jnp.inf, f32), jnp.zeros((QB * H,), f32), jnp.zeros((QB * H, Lat), f32))
        o, s = _finish(attend(qb_nblk[k], 1, lambda i: (True, r), bp, page_copy, compute, init))
        ob[pl.ds(0, QB)] = o.reshape(QB, H, Lat)
        lb[pl.ds(0, QB)] = s.reshape(QB, H)

        def out_copies(q):
            ok = (q >= d0) & (q < d0 + n)
            return [(ok, pltpu.make_async_copy(ob.at[q], out.at[ws + q], sem.at[_OSEM])),
                    (ok, pltpu.make_async_copy(lb.at[q], lse.at[ws + q], sem.at[_OSEM]))]

        dma_loop(QB, out_copies, "start")
        dma_loop(QB, out_copies, "wait")


@functools.partial(jax.jit, static_argnames=("scale", "latent_dim", "blocks", "vmem_limit_bytes", "table_chunk",
                                             "interpret", "cost_rows"))
def mla_ragged_attention_kernel(q_lat, q_rope, new_rows, kv_pool, layer, page_table, tok_row, pos, kv_lens, cu_q_lens,
                                q_lens, scale, latent_dim, *, page_ordinals=None, blocks=DEFAULT_BLOCKS,
                                vmem_limit_bytes=VMEM_LIMIT, table_chunk=TABLE_CHUNK, interpret=None, cost_rows=None):
    """``(out_lat [T, H, Lat] f32, lse [T, H] f32, kv_pool)``: ``new_rows [T, W]`` (or None)
    written into ``kv_pool [L, pages, page_size, W]`` at ``layer``, then ragged paged MLA
    attention of ``q_lat [T, H, Lat]`` / ``q_rope [T, H, Rr]`` over the written pool — the
    semantics of ``write_kv_rows`` + ``mla_ragged_attention(..., layer=layer, return_lse=True)``.
    ``lse`` is exact (what a DCP rank's partial needs for ``merge_partials``).

    ``page_table [R, P]``, ``tok_row``/``pos [T]``, ``kv_lens``/``q_lens [R]``, ``cu_q_lens
    [R + 1]`` as in ``kernels/mla_ragged.py``; ``page_ordinals`` None, ``[P]`` or ``[R, P]``.
    ``blocks = (decode rows per step, queries per block, kv pages per block)`` (clamped to R, T,
    P), or None: :func:`choose_blocks` for ``vmem_limit_bytes``. ``table_chunk``: page-table
    columns per SMEM fetch (rounded up to a multiple of the kv block's pages; on a TPU a multiple
    of 128 when the table has more columns, so each fetch starts on a lane tile). ``interpret``: a
    ``pltpu.InterpretParams`` (CPU tests) or None (compile for TPU). The rows are written by an
    XLA scatter into the pool, which the kernel then only reads: donate the pool (or carry it
    through a scan) to update it in place. ``cost_rows``: rows whose pages the call reads, for
    XLA's cost model only (None: all R; 0: a write-only call)."""
    T, H, Lat = q_lat.shape
    Rr = q_rope.shape[-1]
    if Lat != latent_dim:
        raise ValueError(f"q_lat's last dim {Lat} != latent_dim {latent_dim}")
    if kv_pool.ndim != 4:
        raise ValueError(f"kv_pool must be the stacked [L, pages, page_size, W] pool, got {kv_pool.shape}")
    _, NP, ps, W = kv_pool.shape
    if W < Lat + Rr:
        raise ValueError(f"pool rows of width {W} cannot hold latent {Lat} + rope {Rr}")
    if new_rows is not None and new_rows.shape != (T, W):
        raise ValueError(f"new_rows {new_rows.shape} must be [T, W] = {(T, W)}")
    R, P = page_table.shape
    i32 = jnp.int32
    if new_rows is not None:  # XLA's in-place scatter (a 1-row DMA into a packed bf16 tile does not lower)
        kv_pool = write_kv_rows(kv_pool, new_rows, page_table, jnp.asarray(tok_row, i32), jnp.asarray(pos, i32),
                                layer=layer)
    if blocks is None:
        limit = vmem_limit_bytes or 32 * 2**20
        blocks = choose_blocks(T, R, P, H, W, Lat, Rr, ps, kv_pool.dtype.itemsize, q_lat.dtype.itemsize,
                               budget=int(limit * VMEM_BUDGET / VMEM_LIMIT))
    B = max(1, min(int(blocks[0]), R))
    QB = max(1, min(int(blocks[1]), T))
    bp = max(1, min(int(blocks[2]), P))
    Pb = -(-P // bp) * bp
    # a chunk: whole kv blocks (a block never straddles two) and whole 128-lane rows of int32
    # (Mosaic's DMA moves 512-byte multiples; a short table is padded up to one chunk); a
    # table_chunk under 128 (interpret-mode tests of several chunks) drops the lane rule
    unit = math.lcm(bp, 128) if table_chunk >= 128 else bp
    CH = -(-min(Pb, int(table_chunk)) // unit) * unit
    NC = -(-Pb // CH)
    table = page_table.astype(i32)
    if page_ordinals is None:
        ords = jnp.broadcast_to(jnp.arange(P, dtype=i32)[None], (R, P))
    else:
        ords = jnp.broadcast_to(jnp.asarray(page_ordinals, i32).reshape((-1, P)), (R, P))
    kv_lens, cu, q_lens, pos = (jnp.asarray(a).astype(i32) for a in (kv_lens, cu_q_lens, q_lens, pos))
    wl = work_lists(table, kv_lens, cu, q_lens, pos, ords, NP, ps, (B, QB, bp))
    ND, NQ = grid_bounds(T, R, (B, QB, bp))
    meta = jnp.concatenate([jnp.asarray(layer, i32).reshape(1), wl["counts"]])
    prefetch = [meta, kv_lens, cu, pos, wl["dec_rows"], wl["dec_nblk"], wl["qb_row"], wl["qb_tok0"], wl["qb_len"],
                wl["qb_nblk"], wl["qb_maxpos"]]
    pad = ((0, 0), (0, NC * CH - P))
    inputs = [q_lat, q_rope, pos.reshape(T, 1), jnp.pad(table, pad, constant_values=-1), jnp.pad(ords, pad), kv_pool,
              jnp.zeros((T, H, Lat), jnp.float32), jnp.full((T, H), -jnp.inf, jnp.float32)]
    n_pf, n_in = len(prefetch), len(inputs)
    NB = max(B, QB)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=n_pf, grid=(ND + NQ,),
        in_specs=[hbm] * n_in,
        out_specs=[hbm] * 2,
        scratch_shapes=[pltpu.VMEM((2, B, bp * ps, W), kv_pool.dtype),
                        pltpu.VMEM((NB, H, Lat), q_lat.dtype),
                        pltpu.VMEM((NB, H, Rr), q_rope.dtype),
                        pltpu.VMEM((QB, 1), i32),
                        pltpu.VMEM((NB, H, Lat), jnp.float32),
                        pltpu.VMEM((NB, H), jnp.float32),
                        pltpu.SMEM((2 * B * CH,), i32),
                        pltpu.SMEM((2 * B * CH,), i32),
                        pltpu.SemaphoreType.DMA((5,))])
    kernel = functools.partial(_kernel, T=T, R=R, NP=NP, ps=ps, B=B, QB=QB, bp=bp, CH=CH, ND=ND, H=H, Lat=Lat, Rr=Rr,
                               scale=float(scale))
    out, lse = pl.pallas_call(
        kernel, grid_spec=spec,
        out_shape=(jax.ShapeDtypeStruct((T, H, Lat), jnp.float32), jax.ShapeDtypeStruct((T, H), jnp.float32)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit_bytes),
        input_output_aliases={n_pf + n_in - 2: 0, n_pf + n_in - 1: 1},
        cost_estimate=cost_estimates.mla_ragged(q_lat, q_rope, kv_pool, page_table, T if cost_rows is None else
                                                min(T, cost_rows), R if cost_rows is None else cost_rows, ps,
                                                2 * T * H * (Lat + 1) * 4),
        interpret=interpret)(*prefetch, *inputs)
    return out, lse, kv_pool
