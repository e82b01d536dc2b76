"""MLA attention over the paged latent cache on ONE flattened token axis (pure JAX).

A step is ``T`` tokens (static bucket) of ``R`` rows (static). Row ``r`` owns the contiguous
tokens ``[cu_q_lens[r], cu_q_lens[r + 1])`` (``q_lens[r]`` of them; unused rows have 0 and come
last, ``cu_q_lens`` repeating its last value). ``tok_row[t]`` is token t's row (``R`` for the
padding tokens after ``cu_q_lens[R]``), ``pos[t]`` its absolute position in its sequence and
``kv_lens[r]`` the row's cached tokens after this step (``start_pos + q_len``).

Semantics are those of :func:`kernels.mla.mla_paged_attention` applied row by row (absorbed
form, softmax in f32, output in latent space), but the cost follows the real kv lengths, not the
page-table width: columns of the table are visited in blocks of ``kv_block_pages`` with an online
softmax, in loops whose trip counts are traced values (the blocks the rows actually need), so one
compiled program serves every context length up to ``P * page_size``.

* decode rows (``q_len == 1``) run batched over all ``R`` rows: each block gathers
  ``[R, kv_block_pages]`` pages (per-row page gathers, never per token);
* prefill rows (``q_len >= 2``) run by query tiles of up to ``min(Q_TILE, T)`` tokens of one
  row, enumerated in-graph from ``cu_q_lens``/``q_lens`` (at most ``T // tile + R`` tiles); each
  tile gathers only its own row's blocks, up to its last query's position.

Pages a loop visits are masked but still multiplied (``0 * x``), as in the reference: a table
column inside a visited block must point at finite data or be out of range.

A step with no decode rows runs zero decode blocks and a step with no prefill rows zero tiles.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Q_TILE = 64  # queries of one row per prefill tile
KV_BLOCK_TOKENS = 128  # default kv block: this many tokens' worth of pages (at least one page)


def _drop_ids(ids, num_pages):
    """Page ids outside ``[0, num_pages)`` mapped to ``num_pages``: dropped by a ``mode="drop"``
    scatter (a negative index would otherwise wrap around to a real page)."""
    return jnp.where((ids >= 0) & (ids < num_pages), ids, num_pages)


def write_kv_rows(kv_pool, rows, page_table, tok_row, pos, layer=None):
    """Scatter this step's cache rows ``rows [T, W]`` into the paged pool.

    Token t of row ``r = tok_row[t]`` goes to page ``page_table[r, pos[t] // page_size]`` at offset
    ``pos[t] % page_size``. Padding tokens (``tok_row >= R``), positions outside the table and page
    ids out of range (``< 0`` or ``>= num_pages``) are dropped, never written. With ``layer``,
    ``kv_pool`` is the stacked pool ``[L, pages, page_size, W]`` and only that layer is written.
    """
    num_pages, page_size, _ = kv_pool.shape[-3:]
    R, P = page_table.shape
    col = pos // page_size
    ok = (tok_row >= 0) & (tok_row < R) & (pos >= 0) & (col < P)
    ids = page_table[jnp.clip(tok_row, 0, R - 1), jnp.clip(col, 0, P - 1)]
    ids = jnp.where(ok, _drop_ids(ids, num_pages), num_pages)
    off = pos % page_size
    rows = rows.astype(kv_pool.dtype)
    if layer is not None:
        return kv_pool.at[layer, ids, off].set(rows, mode="drop")
    return kv_pool.at[ids, off].set(rows, mode="drop")


def _online_update(state, s, c, pv_spec):
    """One online-softmax step. state = (m, l, acc) with m, l [..., H] and acc [..., H, L];
    s [..., H, S] masked scores (-inf where masked), c the block's latent rows, combined with the
    probabilities by ``einsum(pv_spec, p, c)``."""
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_safe)  # m = -inf -> 0
    p = jnp.exp(s - m_safe[..., None])  # masked -> 0
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum(pv_spec, p, c)
    return m_new, l, acc


def _finish(state):
    m, l, acc = state
    has = l > 0
    out = acc / jnp.where(has, l, 1.0)[..., None]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.where(has, m_safe + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
    return out, lse


def mla_ragged_attention(q_lat, q_rope, kv_pool, page_table, tok_row, pos, kv_lens, cu_q_lens, q_lens, scale,
                         latent_dim, layer=None, page_ordinals=None, return_lse=False, kv_block_pages=None):
    """Ragged paged MLA attention (absorbed form) over a flattened step.

    q_lat [T, H, latent_dim]; q_rope [T, H, Rr]; kv_pool [(L,) pages, page_size, latent_dim + Rr]
    (stacked when ``layer`` is given); page_table [R, P] int; tok_row, pos [T]; kv_lens [R];
    cu_q_lens [R + 1]; q_lens [R]. ``page_ordinals`` None (``0..P-1``), [P] or [R, P]: which page
    of the sequence each table column is (decode context parallelism); a column whose page id is
    out of range is skipped. Query t of row r attends to key positions
    ``kpos = ordinal * page_size + offset`` with ``kpos <= pos[t]`` and ``kpos < kv_lens[r]``.

    Returns out_lat [T, H, latent_dim] float32 and, with ``return_lse``, the log-sum-exp [T, H]
    (``-inf`` where the query saw no key). Padding tokens give zeros and ``-inf``.
    ``kv_block_pages``: table columns per kv block (default: ``KV_BLOCK_TOKENS`` tokens' worth).
    """
    T, H, L = q_lat.shape
    assert L == latent_dim, (L, latent_dim)
    num_pages, page_size, W = kv_pool.shape[-3:]
    Rr = q_rope.shape[-1]  # the rope key's lanes; zeros may follow them up to W
    R, P = page_table.shape
    bp = kv_block_pages or max(1, KV_BLOCK_TOKENS // page_size)
    bp = max(1, min(int(bp), P))
    NB = -(-P // bp)
    Pp = NB * bp
    S = bp * page_size  # keys per block
    f32 = jnp.float32

    # ---- metadata (all traced)
    page_table = page_table.astype(jnp.int32)
    if page_ordinals is None:
        ords = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32)[None], (R, P))
    else:
        ords = jnp.broadcast_to(jnp.asarray(page_ordinals, jnp.int32).reshape((-1, P)), (R, P))
    table = jnp.pad(page_table, ((0, 0), (0, Pp - P)), constant_values=-1)
    ords = jnp.pad(ords, ((0, 0), (0, Pp - P)))
    present = (table >= 0) & (table < num_pages)  # [R, Pp]
    ids = jnp.clip(table, 0, num_pages - 1)
    kv_lens = kv_lens.astype(jnp.int32)
    q_lens = q_lens.astype(jnp.int32)
    cu = cu_q_lens.astype(jnp.int32)
    pos = pos.astype(jnp.int32)
    col_blk = jnp.arange(Pp, dtype=jnp.int32) // bp + 1  # [Pp] blocks needed to reach column j
    offs = jnp.arange(page_size, dtype=jnp.int32)

    # token arrays padded by one tile so dynamic slices never clamp onto other tokens
    QT = max(1, min(Q_TILE, T))  # small buckets get smaller tiles
    pad = QT
    ql = jnp.pad(q_lat.astype(f32), ((0, pad), (0, 0), (0, 0)))
    qr = jnp.pad(q_rope.astype(f32), ((0, pad), (0, 0), (0, 0)))
    pos_p = jnp.pad(pos, (0, pad))
    out_buf = jnp.zeros((T + pad, H, L), f32)
    lse_buf = jnp.full((T + pad, H), -jnp.inf, f32)

    def gather_kv(blk_ids):
        kv = kv_pool[blk_ids] if layer is None else kv_pool[layer, blk_ids]
        return kv.astype(f32)

    def blocks_needed(rows_mask, max_qpos):
        """[rows] -> blocks of columns needed: the last column whose page is present and holds a
        key position the row's queries can see (< kv_len and <= max_qpos)."""
        first_kpos = ords * page_size  # [R, Pp]
        need = present & (first_kpos < kv_lens[:, None]) & (first_kpos <= max_qpos[:, None]) & rows_mask[:, None]
        return jnp.max(jnp.where(need, col_blk[None], 0), axis=1)

    # ---- decode rows: batched over all R rows, one query each
    dec = q_lens == 1
    dtok = jnp.clip(cu[:R], 0, T + pad - 1)
    dq_lat, dq_rope, dpos = ql[dtok], qr[dtok], pos_p[dtok]  # [R, H, L], [R, H, Rr], [R]
    n_dec_blk = jnp.max(blocks_needed(dec, dpos))

    def dec_body(b, state):
        blk_ids = jax.lax.dynamic_slice_in_dim(ids, b * bp, bp, axis=1)  # [R, bp]
        blk_ord = jax.lax.dynamic_slice_in_dim(ords, b * bp, bp, axis=1)
        blk_pres = jax.lax.dynamic_slice_in_dim(present, b * bp, bp, axis=1)
        kv = gather_kv(blk_ids).reshape(R, S, W)
        c, kr = kv[..., :latent_dim], kv[..., latent_dim:latent_dim + Rr]
        s = (jnp.einsum("rhl,rsl->rhs", dq_lat, c) + jnp.einsum("rhd,rsd->rhs", dq_rope, kr)) * scale
        kpos = (blk_ord[:, :, None] * page_size + offs).reshape(R, S)
        mask = (jnp.repeat(blk_pres, page_size, axis=1) & (kpos <= dpos[:, None]) & (kpos < kv_lens[:, None])
                & dec[:, None])
        s = jnp.where(mask[:, None, :], s, -jnp.inf)
        return _online_update(state, s, c, "rhs,rsl->rhl")

    init = (jnp.full((R, H), -jnp.inf, f32), jnp.zeros((R, H), f32), jnp.zeros((R, H, L), f32))
    dec_out, dec_lse = _finish(jax.lax.fori_loop(0, n_dec_blk, dec_body, init))
    widx = jnp.where(dec, cu[:R], T + pad)  # non-decode rows dropped
    out_buf = out_buf.at[widx].set(dec_out, mode="drop")
    lse_buf = lse_buf.at[widx].set(dec_lse, mode="drop")

    # ---- prefill rows: tiles of up to QT queries of one row
    NT = T // QT + R  # static bound on the number of tiles
    pre = q_lens >= 2
    ntiles = jnp.where(pre, -(-q_lens // QT), 0)
    cu_t = jnp.cumsum(ntiles)
    n_tiles = cu_t[-1]
    tidx = jnp.arange(NT, dtype=jnp.int32)
    t_row = jnp.clip(jnp.searchsorted(cu_t, tidx, side="right"), 0, R - 1).astype(jnp.int32)
    t_local = tidx - (cu_t[t_row] - ntiles[t_row])
    t_tok0 = cu[t_row] + QT * t_local
    t_len = jnp.clip(q_lens[t_row] - QT * t_local, 0, QT)
    first_kpos = ords * page_size
    row_need = present & (first_kpos < kv_lens[:, None])  # [R, Pp]
    qi = jnp.arange(QT, dtype=jnp.int32)

    def tile_body(i, bufs):
        out_buf, lse_buf = bufs
        r, tok0, n = t_row[i], t_tok0[i], t_len[i]
        tq_lat = jax.lax.dynamic_slice_in_dim(ql, tok0, QT)  # [Q, H, L]
        tq_rope = jax.lax.dynamic_slice_in_dim(qr, tok0, QT)
        tpos = jax.lax.dynamic_slice_in_dim(pos_p, tok0, QT)
        qvalid = qi < n
        r_ids, r_ord, r_pres = ids[r], ords[r], present[r]  # [Pp]
        kvl = kv_lens[r]
        # the tile's last query position bounds the kv it needs (causal)
        need = row_need[r] & (first_kpos[r] <= jnp.max(jnp.where(qvalid, tpos, -1)))
        nblk = jnp.max(jnp.where(need, col_blk, 0))

        def blk_body(b, state):
            blk_ids = jax.lax.dynamic_slice_in_dim(r_ids, b * bp, bp)
            blk_ord = jax.lax.dynamic_slice_in_dim(r_ord, b * bp, bp)
            blk_pres = jax.lax.dynamic_slice_in_dim(r_pres, b * bp, bp)
            kv = gather_kv(blk_ids).reshape(S, W)
            c, kr = kv[:, :latent_dim], kv[:, latent_dim:latent_dim + Rr]
            s = (jnp.einsum("qhl,sl->qhs", tq_lat, c) + jnp.einsum("qhd,sd->qhs", tq_rope, kr)) * scale
            kpos = (blk_ord[:, None] * page_size + offs).reshape(S)
            kok = jnp.repeat(blk_pres, page_size) & (kpos < kvl)
            mask = kok[None, :] & (kpos[None, :] <= tpos[:, None]) & qvalid[:, None]
            s = jnp.where(mask[:, None, :], s, -jnp.inf)
            return _online_update(state, s, c, "qhs,sl->qhl")

        init = (jnp.full((QT, H), -jnp.inf, f32), jnp.zeros((QT, H), f32), jnp.zeros((QT, H, L), f32))
        o, lse = _finish(jax.lax.fori_loop(0, nblk, blk_body, init))
        # read-modify-write: only this tile's own tokens change
        old_o = jax.lax.dynamic_slice_in_dim(out_buf, tok0, QT)
        old_l = jax.lax.dynamic_slice_in_dim(lse_buf, tok0, QT)
        o = jnp.where(qvalid[:, None, None], o, old_o)
        lse = jnp.where(qvalid[:, None], lse, old_l)
        out_buf = jax.lax.dynamic_update_slice_in_dim(out_buf, o, tok0, axis=0)
        lse_buf = jax.lax.dynamic_update_slice_in_dim(lse_buf, lse, tok0, axis=0)
        return out_buf, lse_buf

    out_buf, lse_buf = jax.lax.fori_loop(0, n_tiles, tile_body, (out_buf, lse_buf))
    out = out_buf[:T]
    if not return_lse:
        return out
    return out, lse_buf[:T]
