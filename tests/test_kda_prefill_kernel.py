"""The KDA ragged chunked prefill Pallas kernel (issue #15, kernel 4) in TPU interpret mode (race
detection on, uninitialised memory NaN) against its pure-JAX reference (``kda_prefill_reference``,
built on ``kernels/kda_ragged.py::kda_ragged``).

Random ragged steps of T = 64 tokens in R = 8 rows, q_len in {0, 1, 2, 7, 8, 9, 17} at chunk
size 8 (rows of 1 token are decode rows the kernel must leave alone), start positions not
multiples of the chunk, snapshot offsets at 1, at the end of the row's first chunk, mid-chunk
and at q_len (plus entries that must be ignored: decode and padding rows, length 0 or past
q_len, a slot out of range), fresh rows whose read slot holds NaN / 1e30 garbage, prefix hits
(read slot != write slot), 2 layers in the pool. Outputs within 1e-5 of the reference (relative
to the array's magnitude) and exactly zero at tokens the kernel does not own; the pool
byte-identical to the input outside the (layer, slot) entries the call writes and those within
1e-5; no race reported, also with DMAs executed eagerly. Chunk sizes 8 (window of 8, solved as
one block or as two blocks of 4) and 16 (four blocks of 4), a step shorter than the chunk, and
the reference with chunk 64 against chunk 8 (the math does not depend on the chunk size beyond
rounding). Shapes are shared across cases so each configuration compiles once (~4 s); an
interpreted grid step costs ~10 ms.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3serve.kernels.kda_prefill_kernel import kda_prefill, kda_prefill_reference

try:
    INTERPRET = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
except TypeError:  # an older jax without those fields
    INTERPRET = pltpu.InterpretParams()

TOL = 1e-5
T, R, H, DK, DV, L, S, C = 64, 8, 2, 16, 32, 2, 24, 8
NS = 10  # snapshot entries per step
MENU = [0, 1, 2, 7, 8, 9, 17]


def _races_found() -> bool:
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:
        return False
    return bool(getattr(ipc.races, "races_found", False)) if getattr(ipc, "races", None) is not None else False


def _layout(rng, T=T, R=R, C=C, q_lens=None):
    """Row metadata and slots for one step: every q_len of MENU that fits, rows in random order
    (zero-length rows anywhere), distinct write / snapshot slots, prefix hits reading slots
    nobody writes, fresh rows reading garbage slots."""
    if q_lens is None:
        q_lens, left = [], T
        for n in rng.permutation(MENU + list(rng.choice(MENU, R - len(MENU)))):
            n = min(int(n), left)
            q_lens.append(n)
            left -= n
    q_lens = np.asarray(q_lens, np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tok_row = np.full(T, R, np.int32)
    for r in range(R):
        tok_row[cu[r]:cu[r + 1]] = r
    start = rng.choice([3, 5, 13, 21, 30, 41], size=R).astype(np.int32)  # never a multiple of C
    fresh = np.zeros(R, np.int32)
    fresh[rng.permutation(R)[:3]] = 1
    start[fresh == 1] = 0
    slots = rng.permutation(S)
    write = slots[:R].copy()
    read = write.copy()
    prefix = (fresh == 0) & (rng.random(R) < 0.5)
    read[prefix] = slots[R:R + prefix.sum()]  # prefix hits: slots nobody writes
    free = list(slots[R + prefix.sum():])
    read[fresh == 1] = [free.pop() for _ in range(int(fresh.sum()))]  # fresh: read a garbage slot
    garbage = [int(s) for s in read[fresh == 1]]
    write[rng.integers(R)] = S  # one write slot out of range: dropped

    snap_row, snap_len = [], []
    for r in range(R):
        n = int(q_lens[r])
        first = min(n, C - int(start[r]) % C)
        for o in sorted({1, first, n, (1 + n) // 2, first + C}):
            if 1 <= o <= n:
                snap_row.append(r)
                snap_len.append(o)
    keep = rng.permutation(len(snap_row))[:min(len(free) - 1, NS - 3)]
    pad = NS - len(keep)  # unused entries (a fixed NS: one compile per configuration)
    snap_row = [snap_row[i] for i in keep] + ([R, 0, 1] * NS)[:pad]
    snap_len = [snap_len[i] for i in keep] + ([1, 0, 99] * NS)[:pad]
    snap_slot = [int(free.pop()) for _ in keep] + [free[0]] * pad
    if len(keep):
        snap_slot[0] = -1  # one entry aimed out of range: dropped
    order = rng.permutation(len(snap_row))
    meta = dict(tok_row=tok_row, cu=cu, q_lens=q_lens, start=start, read=read, write=write, fresh=fresh,
                snap_row=np.asarray(snap_row)[order], snap_len=np.asarray(snap_len)[order],
                snap_slot=np.asarray(snap_slot)[order])
    return {k_: np.asarray(v_, np.int32) for k_, v_ in meta.items()}, garbage


def _inputs(rng, meta, garbage, T=T, mode="plain"):
    def nrm(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = nrm(rng.standard_normal((T, H, DK))) * DK ** -0.5
    k = rng.standard_normal((T, H, DK))
    if mode == "hard":  # nearly parallel keys, beta near 1, little decay: (I + A) far from I
        k = 0.3 * k + rng.standard_normal((1, H, DK))
    k = nrm(k)
    v = rng.standard_normal((T, H, DV))
    g = -0.2 * np.exp(rng.standard_normal((T, H, DK)))
    beta = rng.random((T, H))
    if mode == "hard":
        g = -0.01 * rng.random((T, H, DK))
        beta = rng.uniform(0.8, 1.0, (T, H))
    elif mode == "steep":  # K3's gate bound: down to -5 per token
        g = -5.0 * rng.random((T, H, DK))
    pad = meta["tok_row"] == R  # garbage in padding tokens must not leak
    for x in (q, k, v, g):
        x[pad] = np.nan
    beta[pad] = 1e30
    pool = rng.standard_normal((L, S, H, DK, DV)) * 0.5
    for i, s in enumerate(garbage):
        pool[1, s] = np.nan if i % 2 == 0 else 1e30
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, pool)]


def _call(fn, x, meta, layer=1, **kw):
    m = [jnp.asarray(meta[n]) for n in ("tok_row", "cu", "q_lens", "start", "read", "write", "fresh", "snap_row",
                                        "snap_len", "snap_slot")]
    return fn(*x, layer, *m, **kw)


def _touched(meta, layer, S=S):
    ql = meta["q_lens"]
    pre = ql >= 2
    slots = [int(s) for s in meta["write"][pre] if 0 <= s < S]
    for r, n, s in zip(meta["snap_row"], meta["snap_len"], meta["snap_slot"]):
        if r < len(ql) and ql[r] >= 2 and 1 <= n <= ql[r] and 0 <= s < S:
            slots.append(int(s))
    assert len(slots) == len(set(slots)), "test metadata must keep written slots distinct"
    return {(layer, s) for s in slots}


def _close(name, got, want):
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max()) / scale if got.size else 0.0
    assert np.isfinite(got).all(), name
    assert err < TOL, f"{name}: max err {err:.3g} (scale {scale:.3g})"
    return err


def _check(x, meta, layer=1, interpret=INTERPRET, **kw):
    want = [np.asarray(a) for a in _call(kda_prefill_reference, x, meta, layer, **kw)]
    got = [np.asarray(a) for a in _call(kda_prefill, x, meta, layer, interpret=interpret, **kw)]
    assert not _races_found()
    ql = meta["q_lens"]
    tr = meta["tok_row"]
    owned = (tr < len(ql)) & (ql[np.minimum(tr, len(ql) - 1)] >= 2)
    assert not got[0][~owned].any()  # decode rows, padding: exactly zero
    err_o = _close("o", got[0][owned], want[0][owned])
    before = np.asarray(x[5])
    mask = np.zeros(before.shape[:2], bool)
    for lay, s in _touched(meta, layer, before.shape[1]):
        mask[lay, s] = True
    # untouched entries (the other layer entirely): the input, bit for bit, as the reference keeps them
    assert np.array_equal(got[1][~mask].view(np.uint32), before[~mask].view(np.uint32))
    assert np.array_equal(want[1][~mask].view(np.uint32), before[~mask].view(np.uint32))
    err_s = _close("state", got[1][mask], want[1][mask])
    return err_o, err_s, int(mask.sum())


@pytest.mark.parametrize("seed,mode", [(0, "plain"), (1, "hard"), (2, "steep"), (3, "plain")])
def test_matches_reference_chunk8_two_blocks(seed, mode):
    """C = 8, one head per step, the solve in two blocks of 4 (cross-block decay pairs)."""
    rng = np.random.default_rng(seed)
    meta, garbage = _layout(rng)
    errs = _check(_inputs(rng, meta, garbage, mode=mode), meta, chunk_size=C, blocks=(1, 4))
    assert errs[2] > 0


def test_matches_reference_two_heads_per_block_eager_dmas():
    """Both heads in one step, the window solved as one block; DMAs executed when started (a
    buffer read before its wait, or overwritten while a copy from it is in flight, would show)."""
    try:
        eager = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", dma_execution_mode="eager")
    except TypeError:
        eager = INTERPRET
    rng = np.random.default_rng(4)
    meta, garbage = _layout(rng)
    x = _inputs(rng, meta, garbage)
    _check(x, meta, chunk_size=C, blocks=(2,))
    _check(x, meta, layer=0, chunk_size=C, blocks=(2,), interpret=eager)


def test_matches_reference_chunk16():
    """C = 16 (four blocks of 4), rows of 17 crossing two chunk ends."""
    rng = np.random.default_rng(5)
    meta, garbage = _layout(rng, C=16, q_lens=[17, 1, 17, 9, 0, 2, 17, 1])
    _check(_inputs(rng, meta, garbage), meta, chunk_size=16, blocks=(2, 4))


def test_step_shorter_than_chunk():
    """T = 6 < C: the window is the whole step (clamped), one row of 2, one of 3, one decode row."""
    rng = np.random.default_rng(6)
    meta, garbage = _layout(rng, T=6, R=3, q_lens=[2, 1, 3])
    _check(_inputs(rng, meta, garbage, T=6), meta, chunk_size=C, blocks=(1,))


def test_fresh_rows_ignore_what_their_slot_holds():
    """A fresh row gives the same bits whether its read slot holds garbage or zeros."""
    rng = np.random.default_rng(7)
    meta, garbage = _layout(rng)
    x = _inputs(rng, meta, garbage)
    runs = []
    for fill in (np.nan, 0.0):
        pool = x[5]
        for s in garbage:
            pool = pool.at[1, s].set(fill)
        runs.append([np.asarray(a) for a in _call(kda_prefill, x[:5] + [pool], meta, chunk_size=C, blocks=(1, 4),
                                                  interpret=INTERPRET)])
    assert np.array_equal(runs[0][0], runs[1][0])
    fr = (meta["fresh"] == 1) & (meta["q_lens"] >= 2)
    for s in meta["write"][fr]:
        if 0 <= s < S:
            assert np.array_equal(runs[0][1][1, s], runs[1][1][1, s])


def test_math_does_not_depend_on_chunk_size():
    """kda_ragged with chunk 64 against chunk 8 on the same step (through the reference), and
    the kernel at chunk 8 against the reference at chunk 64."""
    rng = np.random.default_rng(8)
    meta, garbage = _layout(rng)
    x = _inputs(rng, meta, garbage)
    a = [np.asarray(t) for t in _call(kda_prefill_reference, x, meta, chunk_size=64)]
    b = [np.asarray(t) for t in _call(kda_prefill_reference, x, meta, chunk_size=8)]
    c = [np.asarray(t) for t in _call(kda_prefill, x, meta, chunk_size=8, blocks=(1, 4), interpret=INTERPRET)]
    mask = np.zeros((L, S), bool)
    for lay, s in _touched(meta, 1):
        mask[lay, s] = True
    for other in (b, c):
        _close("o", other[0], a[0])
        _close("state", other[1][mask], a[1][mask])
        assert np.array_equal(a[1][~mask].view(np.uint32), other[1][~mask].view(np.uint32))


def test_rejects_blocks_that_do_not_divide_heads():
    rng = np.random.default_rng(0)
    meta, garbage = _layout(rng)
    with pytest.raises(ValueError, match="heads_per_block"):
        _call(kda_prefill, _inputs(rng, meta, garbage), meta, chunk_size=C, blocks=(3,), interpret=INTERPRET)


def test_step_without_prefill_rows_touches_nothing():
    """Only decode and empty rows (and their snapshot entries): the pool comes back bit for bit,
    o is all zeros (the same compiled configuration as the first test)."""
    rng = np.random.default_rng(9)
    meta, garbage = _layout(rng, q_lens=[1, 1, 0, 1, 1, 0, 1, 1])
    x = _inputs(rng, meta, garbage)
    o, pool = _call(kda_prefill, x, meta, chunk_size=C, blocks=(1, 4), interpret=INTERPRET)
    assert not _races_found()
    assert not np.asarray(o).any()
    assert np.array_equal(np.asarray(pool).view(np.uint32), np.asarray(x[5]).view(np.uint32))
