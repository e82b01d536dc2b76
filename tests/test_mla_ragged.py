"""Ragged (flattened-token) paged MLA: kernels.mla_ragged against the per-row reference
kernels.mla (write_kv_pages / mla_paged_attention run on each row's own tokens)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3serve.kernels import ops
from k3serve.kernels.mla import merge_partials, mla_paged_attention, write_kv_pages

H, L, RR, R = 2, 32, 8, 5
W = L + RR
SCALE = 0.3
QLENS = [0, 1, 1, 2, 15, 16, 17, 63, 64, 65]


def make_layout(seed, T, ps, P, n_layers=None, mixed_order=True, q_lens=None, kv_lens=None, kv_jitter=False):
    """A random flattened step: row lengths from QLENS (empty rows last), start positions not
    page-aligned or ending exactly on a page boundary, distinct random pages per row; the table
    columns past a row's pages hold -1 or some other real page (never needed: kpos >= kv_len).
    ``q_lens``/``kv_lens`` given: that layout instead of random lengths. ``kv_jitter``: kv_lens
    moved off ``start + q_len`` (some cached keys past the queries, or fewer keys than positions),
    which the reference's semantics define (both masks then matter for every kind of row)."""
    rng = np.random.default_rng(seed)
    cap = P * ps
    if q_lens is not None:
        q_lens, kv_lens = np.asarray(q_lens, np.int32), np.asarray(kv_lens, np.int32)
        return _finish_layout(rng, T, ps, P, n_layers, q_lens, kv_lens - q_lens, kv_lens)
    q_lens = []
    total = 0
    for _ in range(R):
        q = int(rng.choice([x for x in QLENS if total + x <= T]))
        q_lens.append(q)
        total += q
    nz = [q for q in q_lens if q]
    if not mixed_order:
        nz.sort()  # decode rows first
    q_lens = np.array(nz + [0] * (R - len(nz)), np.int32)
    start = np.zeros(R, np.int32)
    for r in range(R):
        q = int(q_lens[r])
        if q == 0:
            continue
        kind = rng.integers(3)
        if kind == 0:  # end exactly on a page boundary
            ends = [e for e in range(ps, cap + 1, ps) if e >= q]
            start[r] = int(rng.choice(ends)) - q
        elif kind == 1:
            start[r] = 0
        else:
            start[r] = int(rng.integers(0, cap - q + 1))
    kv_lens = (start + q_lens).astype(np.int32)
    if kv_jitter:
        kv_lens = np.where(q_lens > 0, np.clip(kv_lens + rng.integers(-6, 20, size=R), 0, cap), 0).astype(np.int32)
    return _finish_layout(rng, T, ps, P, n_layers, q_lens, start, kv_lens)


def _finish_layout(rng, T, ps, P, n_layers, q_lens, start, kv_lens):
    num_pages = R * P + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    table = perm[: R * P].reshape(R, P).copy()
    for r in range(R):
        used = -(-int(max(kv_lens[r], start[r] + q_lens[r])) // ps)
        for j in range(used, P):
            table[r, j] = -1 if rng.random() < 0.5 else int(rng.integers(num_pages))
    cu = np.zeros(R + 1, np.int32)
    cu[1:] = np.cumsum(q_lens)
    tok_row = np.full(T, R, np.int32)
    pos = np.zeros(T, np.int32)
    for r in range(R):
        tok_row[cu[r] : cu[r + 1]] = r
        pos[cu[r] : cu[r + 1]] = start[r] + np.arange(q_lens[r])
    pool_shape = (num_pages, ps, W) if n_layers is None else (n_layers, num_pages, ps, W)
    return dict(
        q_lat=rng.normal(size=(T, H, L)).astype(np.float32),
        q_rope=rng.normal(size=(T, H, RR)).astype(np.float32),
        rows=rng.normal(size=(T, W)).astype(np.float32),
        pool=rng.normal(size=pool_shape).astype(np.float32),
        table=table, tok_row=tok_row, pos=pos, kv_lens=kv_lens, cu=cu, q_lens=q_lens,
    )


@functools.partial(jax.jit, static_argnames=("layer",))
def _ref_write(pool, rows, table, positions, valid, layer=None):
    return write_kv_pages(pool, rows, table, positions, valid, layer=layer)


@functools.partial(jax.jit, static_argnames=("layer",))
def _ref_attend(q_lat, q_rope, pool, table, positions, kv_lens, layer=None):
    return mla_paged_attention(q_lat, q_rope, pool, table, positions, kv_lens, SCALE, L, layer=layer,
                               return_lse=True)


def reference(lay, layer=None):
    """Per-row reference: each row's tokens as a [1, T] batch (its q_len tokens first; the
    padding queries after them are ignored and their writes masked off), so the jitted
    reference compiles once per shape."""
    pool = jnp.asarray(lay["pool"])
    T = lay["q_lat"].shape[0]

    def row_batch(x, a, b):
        return np.pad(x[a:b], [(0, T - (b - a))] + [(0, 0)] * (x.ndim - 1))[None]

    for r in range(R):
        a, b = lay["cu"][r], lay["cu"][r + 1]
        if b > a:
            pool = _ref_write(pool, row_batch(lay["rows"], a, b), lay["table"][r : r + 1],
                              row_batch(lay["pos"], a, b), (np.arange(T) < b - a)[None], layer=layer)
    out = np.zeros((T, H, L), np.float32)
    lse = np.full((T, H), -np.inf, np.float32)
    for r in range(R):
        a, b = lay["cu"][r], lay["cu"][r + 1]
        if b > a:
            o, s = _ref_attend(row_batch(lay["q_lat"], a, b), row_batch(lay["q_rope"], a, b), pool,
                               lay["table"][r : r + 1], row_batch(lay["pos"], a, b), lay["kv_lens"][r : r + 1],
                               layer=layer)
            out[a:b], lse[a:b] = np.asarray(o[0, : b - a]), np.asarray(s[0, : b - a])
    return np.asarray(pool), out, lse


TRACES = {"n": 0}


@functools.lru_cache(maxsize=None)
def step_fn(kv_block_pages, stacked):
    """write_kv_rows then mla_ragged_attention, jitted (the model's order)."""

    def f(pool, rows, q_lat, q_rope, table, tok_row, pos, kv_lens, cu, q_lens, layer):
        TRACES["n"] += 1
        lyr = layer if stacked else None
        pool = ops.write_kv_rows(pool, rows, table, tok_row, pos, layer=lyr)
        out, lse = ops.mla_ragged_attention(q_lat, q_rope, pool, table, tok_row, pos, kv_lens, cu, q_lens, SCALE, L,
                                            layer=lyr, return_lse=True, kv_block_pages=kv_block_pages)
        return pool, out, lse

    return jax.jit(f)


def run(lay, kv_block_pages=None, layer=None):
    f = step_fn(kv_block_pages, layer is not None)
    return [np.asarray(x) for x in f(lay["pool"], lay["rows"], lay["q_lat"], lay["q_rope"], lay["table"],
                                     lay["tok_row"], lay["pos"], lay["kv_lens"], lay["cu"], lay["q_lens"],
                                     jnp.int32(layer or 0))]


def check(lay, got, want):
    pool, out, lse = got
    rpool, rout, rlse = want
    np.testing.assert_array_equal(pool, rpool)
    valid = lay["tok_row"] < R
    np.testing.assert_allclose(out[valid], rout[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse[valid], rlse[valid], rtol=1e-5, atol=1e-5)
    assert (out[~valid] == 0).all() and np.isneginf(lse[~valid]).all()


@pytest.mark.parametrize("T,ps,P,kvb,seeds", [
    (64, 8, 12, 5, (0, 1, 2, 3)),  # 3 blocks of 5 columns (the last one padded)
    (128, 16, 8, 1, (4, 5, 6)),  # one page per block
    (128, 8, 12, None, (7, 8, 9)),  # default block (whole table here)
])
def test_ragged_matches_per_row_reference(T, ps, P, kvb, seeds):
    for seed in seeds:
        lay = make_layout(seed, T, ps, P, mixed_order=seed % 2 == 0)
        check(lay, run(lay, kvb), reference(lay))


def test_ragged_kv_lens_off_the_query_positions():
    """The reference's semantics in full: with kv_lens not equal to start + q_len, a query sees
    key positions <= its own AND < kv_len (decode and prefill rows alike); a column whose page id
    is out of range (-1, >= num_pages) is skipped even inside the visible range."""
    for seed in (51, 86):  # decode and prefill rows with kv_len both above and below pos + 1
        lay = make_layout(seed, 128, 8, 12, kv_jitter=True)
        start = lay["pos"][np.minimum(lay["cu"][:R], 127)]
        holes = 0
        for r in range(R):  # a page this step does not write
            if lay["q_lens"][r] and start[r] >= 8:
                lay["table"][r, 0] = -1 if r % 2 else lay["pool"].shape[0] + 3
                holes += 1
        assert holes >= 2
        assert (lay["kv_lens"] != lay["pos"][np.maximum(lay["cu"][1:] - 1, 0)] + 1)[lay["q_lens"] > 0].any()
        check(lay, run(lay, 5), reference(lay))


def test_ragged_stacked_pool_writes_and_reads_one_layer():
    for seed in (10, 11):
        lay = make_layout(seed, 128, 8, 12, n_layers=3)
        got = run(lay, 4, layer=1)
        check(lay, got, reference(lay, layer=1))
        np.testing.assert_array_equal(got[0][[0, 2]], lay["pool"][[0, 2]])  # other layers untouched


def test_write_kv_rows_drops_padding_and_out_of_range_pages():
    """Padding tokens and page ids < 0 or >= num_pages never write (a -1 must not wrap onto the
    last page); every other token lands at page_table[row, pos // ps], pos % ps."""
    lay = make_layout(3, 64, 8, 12)
    lay["pool"] = np.concatenate([lay["pool"], lay["pool"][:1] * 0 + 7])  # a last page no row uses
    table = lay["table"].copy()
    num_pages = lay["pool"].shape[0]
    r = int(lay["tok_row"][0])
    table[r, lay["pos"][0] // 8] = -1
    r2 = int(lay["tok_row"][lay["cu"][1] - 1]) if lay["cu"][1] > 0 else r
    table[r2, lay["pos"][lay["cu"][1] - 1] // 8] = num_pages + 2
    rows = lay["rows"].copy()
    rows[lay["tok_row"] >= R] = np.nan  # padding rows must never land anywhere
    pool = np.asarray(ops.write_kv_rows(jnp.asarray(lay["pool"]), rows, table, lay["tok_row"], lay["pos"]))
    want = lay["pool"].copy()
    for t in range(64):
        rr = lay["tok_row"][t]
        if rr < R:
            pid = table[rr, lay["pos"][t] // 8]
            if 0 <= pid < num_pages:
                want[pid, lay["pos"][t] % 8] = rows[t]
    np.testing.assert_array_equal(pool, want)


def test_cost_follows_kv_lens_not_table_width():
    """With one page per block, table columns past every row's last needed page point to a
    NaN page: the loops must never visit them (NaN * 0 would poison the output). Decode rows
    all need the same 3 pages; one prefill row needs 4."""
    ps, P, T = 8, 12, 64
    rng = np.random.default_rng(0)
    num_pages = R * P + 1
    nan_page = num_pages - 1
    pool = rng.normal(size=(num_pages, ps, W)).astype(np.float32)
    pool[nan_page] = np.nan
    q_lens = np.array([1, 1, 1, 40, 0], np.int32)
    kv_lens = np.array([20, 17, 24, 30, 0], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    table = rng.permutation(num_pages - 1)[: R * P].reshape(R, P).astype(np.int32)
    clean = table.copy()
    for r in range(R):
        used = -(-int(kv_lens[r]) // ps)
        table[r, used:] = nan_page
        clean[r, used:] = -1
    tok_row = np.full(T, R, np.int32)
    pos = np.zeros(T, np.int32)
    for r in range(R):
        tok_row[cu[r] : cu[r + 1]] = r
        pos[cu[r] : cu[r + 1]] = kv_lens[r] - q_lens[r] + np.arange(q_lens[r])
    q_lat = rng.normal(size=(T, H, L)).astype(np.float32)
    q_rope = rng.normal(size=(T, H, RR)).astype(np.float32)
    f = jax.jit(functools.partial(ops.mla_ragged_attention, scale=SCALE, latent_dim=L, return_lse=True,
                                  kv_block_pages=1))
    out, lse = f(q_lat, q_rope, pool, table, tok_row, pos, kv_lens, cu, q_lens)
    ref_out, ref_lse = f(q_lat, q_rope, pool, clean, tok_row, pos, kv_lens, cu, q_lens)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))


def test_page_ordinals_dcp_merge_equals_single_rank():
    """Decode context parallelism emulated on 2 "ranks": each rank's block of the pool holds
    pages (k + o_r) % 2 == rank of row r's sequence; a rank attends over its own columns
    (page ids relative to its block, ordinals saying which page of the sequence each is) and the
    LSE-weighted merge of the two partials equals attention over the whole pool."""
    T, ps, P, N = 128, 8, 12, 2
    lay = make_layout(21, T, ps, P)
    rng = np.random.default_rng(21)
    ppr = R * P  # pages per rank block
    first = rng.integers(0, N, size=R)
    gtable = np.full((R, P), -1, np.int32)
    free = [list(rng.permutation(ppr)) for _ in range(N)]
    for r in range(R):
        for k in range(P):
            rank = (k + first[r]) % N
            gtable[r, k] = rank * ppr + free[rank].pop()
    pool = rng.normal(size=(N * ppr, ps, W)).astype(np.float32)
    meta = (lay["tok_row"], lay["pos"], lay["kv_lens"], lay["cu"], lay["q_lens"])
    pool = ops.write_kv_rows(jnp.asarray(pool), lay["rows"], gtable, lay["tok_row"], lay["pos"])
    f = jax.jit(functools.partial(ops.mla_ragged_attention, scale=SCALE, latent_dim=L, return_lse=True,
                                  kv_block_pages=2))
    whole, whole_lse = f(lay["q_lat"], lay["q_rope"], pool, gtable, *meta)
    outs, lses = [], []
    J = -(-P // N)
    for rank in range(N):
        base = rank * ppr
        ords = (rank - first)[:, None] % N + N * np.arange(J)[None, :]
        cols = np.where(ords < P, np.take_along_axis(gtable, np.minimum(ords, P - 1), axis=1), -1)
        rel = np.where(cols >= 0, cols - base, -1).astype(np.int32)
        assert ((rel >= 0) & (rel < ppr) | (cols < 0)).all()
        o, s = f(lay["q_lat"], lay["q_rope"], pool[base : base + ppr], rel, *meta,
                 page_ordinals=jnp.asarray(ords, jnp.int32))
        outs.append(o)
        lses.append(s)
    merged = np.asarray(merge_partials(jnp.stack(outs), jnp.stack(lses)))
    valid = lay["tok_row"] < R
    np.testing.assert_allclose(merged[valid], np.asarray(whole)[valid], rtol=1e-5, atol=1e-5)
    # and the whole matches the per-row reference on this table
    ref = dict(lay, table=gtable, pool=np.asarray(pool))  # (rewrites the same rows)
    _, rout, rlse = reference(ref)
    np.testing.assert_allclose(np.asarray(whole)[valid], rout[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(whole_lse)[valid], rlse[valid], rtol=1e-5, atol=1e-5)


def test_compiles_once_across_layouts_and_context_lengths():
    """One program per static shape: different row mixes, q_lens and kv lengths (including a
    decode-only and a prefill-only step) reuse it."""
    f = step_fn(3, False)
    T, ps, P = 64, 8, 12
    lays = [make_layout(s, T, ps, P) for s in (30, 31, 32)]
    lays.append(make_layout(33, T, ps, P, q_lens=[1, 1, 1, 1, 0], kv_lens=[96, 7, 40, 1, 0]))  # decode only
    lays.append(make_layout(34, T, ps, P, q_lens=[40, 20, 0, 0, 0], kv_lens=[40, 83, 0, 0, 0]))  # prefill only
    lays.append(make_layout(35, T, ps, P, q_lens=[0] * R, kv_lens=[0] * R))  # empty step
    run(lays[0], 3)
    n0 = TRACES["n"]
    for lay in lays:
        check(lay, run(lay, 3), reference(lay))
    assert TRACES["n"] == n0
    assert f._cache_size() == 1
