"""The ragged paged MLA Pallas kernel (issue #15, kernel 3) in TPU interpret mode (race
detection on, uninitialised memory NaN; once with eager DMAs) against the pure-JAX reference
``write_kv_rows`` + ``mla_ragged_attention(..., return_lse=True)`` on random flattened steps:
q_len in {0, 1, 2, 5, 9}, start positions off page boundaries and rows ending exactly on one,
out-of-range table columns (-1 and >= pages) inside the visible range, stale columns past a
row's pages, DCP page ordinals with absent columns (and two ranks' partials merged by
``merge_partials`` equal to the whole attention: the LSE is exact), a 2-layer pool (the other
layer byte-identical afterwards), padding tokens (NaN queries), padded pool rows, no new rows.
Out and LSE within 1e-5 (fp32); the written pool byte-identical to the reference's. Grids stay
small (interpret mode costs a few ms per grid step and per DMA, and each kernel shape compiles
for a few seconds)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3serve.kernels import ops
from k3serve.kernels.mla_ragged_kernel import grid_bounds, mla_ragged_attention_kernel, work_lists

try:
    INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
    # DMAs run when started, not when waited on: a read of a buffer whose DMA was not waited
    # for is then a detected race (in "on_wait" mode it reads stale data instead)
    EAGER = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", dma_execution_mode="eager")
except TypeError:  # an older jax without those fields
    INTERPRET = EAGER = pltpu.InterpretParams()

H, LAT, RR, PS = 2, 16, 8, 4
W = LAT + RR
SCALE = 0.37
QLENS = (0, 1, 2, 5, 9)
TOL = 1e-5


def _races_found() -> bool:
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:
        return False
    return bool(getattr(ipc.races, "races_found", False)) if getattr(ipc, "races", None) is not None else False


def make_step(seed, T=24, R=6, P=4, n_layers=2, width=W, q_lens=None, holes=True):
    """A random flattened step: rows' q_lens from QLENS (empty rows anywhere), starts off page
    boundaries, at 0, or chosen so the row ends exactly on a page boundary; distinct random pages
    per row, the columns past a row's pages holding -1 or some other row's page (never needed);
    with ``holes``, one visible column of some row out of range (-1 or >= pages): skipped."""
    rng = np.random.default_rng(seed)
    cap = P * PS
    if q_lens is None:
        q_lens, total = [], 0
        for _ in range(R):
            q = int(rng.choice([x for x in QLENS if total + x <= T]))
            q_lens.append(q)
            total += q
    q_lens = np.asarray(q_lens, np.int32)
    start = np.zeros(R, np.int32)
    for r in range(R):
        q = int(q_lens[r])
        kind = rng.integers(3)
        if kind == 0:  # ends exactly on a page boundary
            start[r] = int(rng.choice([e for e in range(PS, cap + 1, PS) if e >= q])) - q
        elif kind == 1:
            start[r] = int(rng.integers(0, cap - q + 1)) | 1  # odd: never page-aligned
            start[r] = min(start[r], cap - q)
        else:
            start[r] = int(rng.integers(0, cap - q + 1))
    kv_lens = np.where(q_lens > 0, start + q_lens, rng.integers(0, cap, R)).astype(np.int32)
    num_pages = R * P + 3
    table = rng.permutation(num_pages)[: R * P].reshape(R, P).astype(np.int32)
    for r in range(R):
        used = -(-int(kv_lens[r]) // PS)
        for j in range(used, P):
            table[r, j] = -1 if rng.random() < 0.5 else int(rng.integers(num_pages))
    if holes:  # a visible page this step does not write, out of range
        for r in range(R):
            if q_lens[r] and start[r] >= PS:
                table[r, 0] = -1 if r % 2 else num_pages + 2
                break
    cu = np.zeros(R + 1, np.int32)
    cu[1:] = np.cumsum(q_lens)
    tok_row = np.full(T, R, np.int32)
    pos = np.zeros(T, np.int32)
    for r in range(R):
        tok_row[cu[r]:cu[r + 1]] = r
        pos[cu[r]:cu[r + 1]] = start[r] + np.arange(q_lens[r])
    pos[cu[R]:] = rng.integers(0, cap, T - cu[R])  # padding tokens: arbitrary positions
    q_lat = rng.normal(size=(T, H, LAT)).astype(np.float32)
    q_lat[cu[R]:] = np.nan  # padding queries must never reach a real output
    return dict(
        q_lat=q_lat, q_rope=rng.normal(size=(T, H, RR)).astype(np.float32),
        rows=rng.normal(size=(T, width)).astype(np.float32),
        pool=rng.normal(size=(n_layers, num_pages, PS, width)).astype(np.float32),
        table=table, tok_row=tok_row, pos=pos, kv_lens=kv_lens, cu=cu, q_lens=q_lens, start=start)


@functools.partial(jax.jit, static_argnames=("write",))
def _reference(pool, rows, q_lat, q_rope, table, tok_row, pos, kv_lens, cu, q_lens, layer, ords, write=True):
    if write:
        pool = ops.write_kv_rows(pool, rows, table, tok_row, pos, layer=layer)
    out, lse = ops.mla_ragged_attention(q_lat, q_rope, pool[..., :LAT + RR], table, tok_row, pos, kv_lens, cu, q_lens,
                                        SCALE, LAT, layer=layer, page_ordinals=ords, return_lse=True,
                                        kv_block_pages=2)
    return pool, out, lse


def reference(st, layer, ords=None, write=True):
    w = st["pool"].shape[-1]
    pool = jnp.asarray(st["pool"])
    if w != LAT + RR and write:  # the reference writes whole rows; it attends over [latent | rope] only
        pool = ops.write_kv_rows(pool, st["rows"], st["table"], st["tok_row"], st["pos"], layer=layer)
        write = False
    return [np.asarray(x) for x in _reference(
        pool, st["rows"][:, :LAT + RR], st["q_lat"], st["q_rope"], st["table"], st["tok_row"], st["pos"],
        st["kv_lens"], st["cu"], st["q_lens"], jnp.int32(layer), ords, write=write)]


def kernel(st, layer, blocks, ords=None, write=True, interpret=INTERPRET, **kw):
    out, lse, pool = mla_ragged_attention_kernel(
        jnp.asarray(st["q_lat"]), jnp.asarray(st["q_rope"]), jnp.asarray(st["rows"]) if write else None,
        jnp.asarray(st["pool"]), jnp.int32(layer), jnp.asarray(st["table"]), jnp.asarray(st["tok_row"]),
        jnp.asarray(st["pos"]), jnp.asarray(st["kv_lens"]), jnp.asarray(st["cu"]), jnp.asarray(st["q_lens"]),
        SCALE, LAT, page_ordinals=ords, blocks=blocks, interpret=interpret, **kw)
    return np.asarray(pool), np.asarray(out), np.asarray(lse)


ERRS = {"out": 0.0, "lse": 0.0}


def check(st, got, want, layer):
    pool, out, lse = got
    rpool, rout, rlse = want
    np.testing.assert_array_equal(pool.view(np.uint32), rpool.view(np.uint32))  # byte-identical
    other = [i for i in range(st["pool"].shape[0]) if i != layer]
    np.testing.assert_array_equal(pool[other].view(np.uint32), st["pool"][other].view(np.uint32))
    R = st["q_lens"].shape[0]
    real = st["tok_row"] < R
    np.testing.assert_allclose(out[real], rout[real], rtol=TOL, atol=TOL)
    fin = np.isfinite(rlse[real])
    np.testing.assert_array_equal(np.isfinite(lse[real]), fin)
    np.testing.assert_allclose(lse[real][fin], rlse[real][fin], rtol=TOL, atol=TOL)
    ERRS["out"] = max(ERRS["out"], float(np.abs(out[real] - rout[real]).max(initial=0)))
    ERRS["lse"] = max(ERRS["lse"], float(np.abs(lse[real][fin] - rlse[real][fin]).max(initial=0)))
    assert (out[~real] == 0).all() and np.isneginf(lse[~real]).all()
    assert not _races_found()


# one static shape (T=24, R=6, P=4) for most tests: an interpreted kernel compiles in seconds
# (per shape, blocks and argument structure), then runs a step in a fraction of one
@pytest.mark.parametrize("blocks,seeds", [
    ((2, 4, 2), (0, 1, 2, 3)),  # decode tiles of 2 rows, query blocks of 4, 2 pages per kv block
    ((3, 3, 1), (4,)),  # one page per kv block; query blocks not dividing the rows
    ((8, 9, 3), (5,)),  # every decode row in one tile; a 9-query row in one block; a ragged last kv block
])
def test_matches_reference_on_random_steps(blocks, seeds):
    for seed in seeds:
        st = make_step(seed)
        layer = seed % 2
        check(st, kernel(st, layer, blocks), reference(st, layer), layer)


def _set_rows(st, q_lens, start, kv_lens=None):
    """Rewrites a step's rows (same T, R): q_lens, starts, kv_lens (default start + q_len)."""
    st["q_lens"] = np.asarray(q_lens, np.int32)
    st["start"] = np.asarray(start, np.int32)
    st["kv_lens"] = np.asarray(st["start"] + st["q_lens"] if kv_lens is None else kv_lens, np.int32)
    R = len(q_lens)
    st["cu"] = np.concatenate([[0], np.cumsum(st["q_lens"])]).astype(np.int32)
    st["tok_row"][:] = R
    for r in range(R):
        st["tok_row"][st["cu"][r]:st["cu"][r + 1]] = r
        st["pos"][st["cu"][r]:st["cu"][r + 1]] = st["start"][r] + np.arange(st["q_lens"][r])
    return st


def test_every_kind_of_row_in_one_step():
    """q_len 0 / 1 / 2 / 5 / 9 rows (decode rows not first), a decode row at position 0, a
    prefill row ending exactly on a page, rows starting mid-page, visible out-of-range columns
    (-1 for a decode row, >= pages for a prefill row)."""
    st = _set_rows(make_step(7, holes=False), [5, 1, 0, 9, 1, 2], [3, 0, 0, 7, 14, 5])
    assert (st["start"][3] + 9) % PS == 0  # row 3 ends on a page boundary
    st["table"][4, 1] = -1  # decode row 4 (position 14) cannot see page 1
    st["table"][3, 0] = st["pool"].shape[1]  # prefill row 3 (from 7): page 0 out of range
    check(st, kernel(st, 1, (2, 4, 2)), reference(st, 1), 1)


def test_empty_and_decode_only_steps():
    st = _set_rows(make_step(8), [0] * 6, [0] * 6, [0] * 6)
    check(st, kernel(st, 0, (2, 4, 2)), reference(st, 0), 0)
    st = _set_rows(make_step(9, holes=False), [1, 0, 1, 1, 1, 0], [15, 0, 4, 0, 7, 0])
    check(st, kernel(st, 1, (2, 4, 2)), reference(st, 1), 1)


def test_dcp_page_ordinals_with_absent_columns():
    """A DCP rank's view: [R, P] ordinals (which page of the sequence each column is: every
    other page, odd or even per row) with some columns absent (-1 / >= pages), kv_lens past
    what the rank holds: same as the reference (which also defines the write: column
    pos // page_size of the row's table, dropped past it)."""
    rng = np.random.default_rng(11)
    st = _set_rows(make_step(11), [1, 5, 9, 0, 1, 2], [12, 12, 17, 0, 29, 20])
    first = rng.integers(0, 2, size=6)
    ords = (first[:, None] + 2 * np.arange(4)[None]).astype(np.int32)  # pages 0,2,4,6 or 1,3,5,7
    num_pages = st["pool"].shape[1]
    st["table"] = rng.permutation(num_pages)[:24].reshape(6, 4).astype(np.int32)
    st["table"][0, 1] = -1
    st["table"][2, 0] = -1
    st["table"][4, 3] = num_pages + 5
    ords = jnp.asarray(ords)
    check(st, kernel(st, 0, (2, 4, 2), ords=ords), reference(st, 0, ords=ords), 0)


def test_dcp_ranks_merge_to_the_whole_attention():
    """Decode context parallelism on 2 emulated ranks: rank k holds the pages of ordinals
    k, k+2, k+4, k+6 of every sequence (``page_ordinals`` [P], shared by the rows) in its own
    pool, some of them absent (-1); no new rows (each rank's pool comes back unchanged); pool
    rows padded past latent + rope. ``merge_partials`` of the two ranks' outputs and the
    log-add-exp of their LSEs equal the reference over the whole pool (both ranks' pages)."""
    from k3serve.kernels.mla import merge_partials

    rng = np.random.default_rng(13)
    st = _set_rows(make_step(13, holes=False), [1, 9, 5, 1, 2, 1], [31, 3, 20, 0, 14, 8])
    R, P, NPr = 6, 4, st["pool"].shape[1]
    wide = W + 8
    pools = [rng.normal(size=(2, NPr, PS, wide)).astype(np.float32) for _ in range(2)]
    tables = [np.stack([rng.permutation(NPr)[:P] for _ in range(R)]).astype(np.int32) for _ in range(2)]
    tables[0][1, 1] = -1  # row 1's page 2 is lost on rank 0 ...
    tables[1][2, 2] = NPr + 1  # ... and row 2's page 5 on rank 1
    whole = np.full((R, 2 * P), -1, np.int32)  # column = ordinal; page ids of the concatenated pool
    for k in range(2):
        ok = (tables[k] >= 0) & (tables[k] < NPr)
        whole[:, k::2] = np.where(ok, tables[k] + k * NPr, -1)
    outs, lses = [], []
    for k in range(2):
        rank = dict(st, pool=pools[k], table=tables[k])
        ords = jnp.asarray(k + 2 * np.arange(P, dtype=np.int32))
        pool, o, lse = kernel(rank, 1, (2, 4, 2), ords=ords, write=False)
        np.testing.assert_array_equal(pool, pools[k])
        assert not _races_found()
        outs.append(o)
        lses.append(lse)
    _, rout, rlse = [np.asarray(x) for x in _reference(
        jnp.concatenate([jnp.asarray(p) for p in pools], axis=1), None, st["q_lat"], st["q_rope"], whole,
        st["tok_row"], st["pos"], st["kv_lens"], st["cu"], st["q_lens"], jnp.int32(1), None, write=False)]
    real = st["tok_row"] < R
    assert np.isfinite(rlse[real]).all()
    merged = np.asarray(merge_partials(jnp.stack(outs), jnp.stack(lses)))
    np.testing.assert_allclose(merged[real], rout[real], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.logaddexp(*lses)[real], rlse[real], rtol=TOL, atol=TOL)
    assert all(np.isneginf(x[~real]).all() for x in lses)


def test_page_table_fetched_in_chunks():
    """The page table reaches SMEM a chunk of columns at a time (2 of the 4 here, one page per kv
    block: a chunk is fetched every other block, into the slot the block in use does not hold),
    with DCP ordinals and absent columns: same as the reference."""
    st = _set_rows(make_step(17), [1, 5, 9, 0, 1, 2], [12, 3, 6, 0, 15, 9])
    ords = jnp.asarray(np.arange(4, dtype=np.int32)[None] + np.zeros((6, 1), np.int32))
    check(st, kernel(st, 1, (2, 4, 1), ords=ords, table_chunk=2), reference(st, 1, ords=ords), 1)


def test_eager_dma_execution_finds_no_race():
    """With DMAs executed at start, the race detector sees every read of a kv / query / output
    buffer or pool row that is not ordered after its DMA's wait (the write phase, the double
    buffer's next block, the per-token outputs)."""
    for seed in (0, 3):  # pool rows padded past latent + rope: whole rows written, [latent | rope] read
        st = make_step(seed, width=W + 8)
        check(st, kernel(st, 1, (2, 4, 2), interpret=EAGER), reference(st, 1), 1)


def test_work_list_bounds_hold():
    """The static grid bounds cover every layout: decode tiles <= ceil(R / rows) and query blocks
    <= (T + min(R, T // 2) * (q_block - 1)) // q_block, on extreme and random layouts."""
    rng = np.random.default_rng(0)
    T, R, P = 24, 6, 4
    cases = [[2] * 6, [1] * 6, [24, 0, 0, 0, 0, 0], [19, 1, 1, 1, 2, 0], [0] * 6]
    cases += [list(rng.multinomial(int(rng.integers(0, T + 1)), [1 / R] * R)) for _ in range(20)]
    table = jnp.zeros((R, P), jnp.int32)
    ords = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (R, P))
    wls = jax.jit(work_lists, static_argnums=(6, 7, 8))
    for q in cases:
        q = np.asarray(q, np.int32)
        cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        for blocks in ((2, 4, 2), (1, 1, 1), (6, 24, 4)):
            wl = wls(table, jnp.asarray(q + 3), jnp.asarray(cu), jnp.asarray(q), jnp.zeros(T, jnp.int32), ords,
                     R * P, PS, blocks)
            ND, NQ = grid_bounds(T, R, blocks)
            n_dec, n_qb = map(int, wl["counts"])
            B, QB = blocks[:2]
            assert n_dec == -(-int((q == 1).sum()) // B) <= ND
            assert n_qb == int(sum(-(-x // QB) for x in q if x >= 2)) <= NQ
            covered = sorted(t for k in range(n_qb) for t in range(int(wl["qb_tok0"][k]),
                                                                    int(wl["qb_tok0"][k] + wl["qb_len"][k])))
            assert covered == [t for r in range(R) if q[r] >= 2 for t in range(cu[r], cu[r + 1])]


def test_max_errors_report():
    """Runs last in the file: the largest errors seen against the reference stay within TOL."""
    assert ERRS["out"] <= TOL and ERRS["lse"] <= TOL
    print(f"max |out - ref| {ERRS['out']:.2e}, max |lse - ref| {ERRS['lse']:.2e}")
