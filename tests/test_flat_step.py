"""The flattened step (``KimiLM.step`` on ``model.step.FlatBatch``) with random mixes of rows
against the same model run one row at a time.

Rows: decode rows and prefill rows with ``q_len`` in {1, 2, 63, 64, 65, ...}, start positions
not multiples of 64, rows ending on page boundaries, rows reading their state from a slot
other than the one they write (a prefix hit), and prefix snapshots at offsets 1, 63, mid-chunk
and the row's end. Each row alone is the reference: same compiled program (token bucket and
row count are static), same cache before the step. Compared: every token's logits, the row's
written KDA state and conv window, its MLA rows, each snapshot (= the state after running the
row alone for that many tokens), and that nothing else in the cache changed.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _util import load_case, rel_err
from k3serve.model.step import FlatBatch

T, R, NS, PAGE = 320, 6, 4, 16
NUM_SLOTS, NUM_PAGES, WIDTH = 16, 96, 16


@pytest.fixture(scope="module")
def model():
    return load_case("k3-tiny-a")


@pytest.fixture(scope="module")
def step_fn(model):
    graphdef = model.graphdef

    @jax.jit
    def run(params, fb, cache):  # no donation: the tests keep the cache they started from
        return nnx.merge(graphdef, params).step(fb, cache, all_logits=True)

    return lambda fb, cache: run(model.params, fb, cache)


def _flat(rows, snaps=()):
    """rows: dicts (ids, start, read, write, pages); snaps: (row, n, slot)."""
    ids = np.zeros(T, np.int32)
    pos = np.zeros(T, np.int32)
    tok_row = np.full(T, -1, np.int32)
    cu = np.zeros(R + 1, np.int32)
    col = {k: np.zeros(R, np.int32) for k in ("start", "q", "read", "write", "logits")}
    col["write"][:] = NUM_SLOTS
    col["logits"][:] = -1
    fresh = np.ones(R, bool)
    table = np.full((R, WIDTH), -1, np.int32)
    t = 0
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[t:t + n], pos[t:t + n], tok_row[t:t + n] = r["ids"], np.arange(r["start"], r["start"] + n), i
        col["start"][i], col["q"][i], col["read"][i], col["write"][i] = r["start"], n, r["read"], r["write"]
        col["logits"][i] = t + n - 1
        fresh[i] = r["start"] == 0
        table[i, :len(r["pages"])] = r["pages"]
        t += n
        cu[i + 1:] = t
    assert t <= T
    sr, sl, ss = np.full(NS, -1, np.int32), np.zeros(NS, np.int32), np.full(NS, NUM_SLOTS, np.int32)
    for e, (i, n, slot) in enumerate(snaps):
        sr[e], sl[e], ss[e] = i, n, slot
    a = jnp.asarray
    return FlatBatch(ids=a(ids), pos=a(pos), tok_row=a(tok_row), cu_q_lens=a(cu), start_pos=a(col["start"]),
                     q_lens=a(col["q"]), read_slot=a(col["read"]), write_slot=a(col["write"]), fresh=a(fresh),
                     page_table=a(table), logits_idx=a(col["logits"]), snap_row=a(sr), snap_len=a(sl),
                     snap_slot=a(ss))


def _layout(rng, V):
    """Random rows: decode rows first, then prefill rows; distinct slots and pages."""
    q_choices = [1, 1, 2, 63, 64, 65, 17, 40]
    rows, slots, pages = [], list(rng.permutation(np.arange(1, NUM_SLOTS))), list(rng.permutation(NUM_PAGES))
    qs = sorted(int(rng.choice(q_choices)) for _ in range(rng.integers(3, R + 1)))
    budget = T
    for q in qs:
        if q > budget:
            break
        start = int(rng.choice([0, 0, 5, 16, 31, 64, 70, 100, 128 - q % PAGE]))  # some end on a page boundary
        if start + q > WIDTH * PAGE:
            start = 0
        hist = rng.integers(0, V, start + q).tolist()
        read = int(slots.pop())
        write = read if rng.random() < 0.6 else int(slots.pop())  # else: a prefix hit's read slot
        need = -(-(start + q) // PAGE)
        rows.append(dict(hist=hist, ids=hist[start:], start=start, read=read, write=write,
                         pages=[int(pages.pop()) for _ in range(need)]))
        budget -= q
    return rows, slots


def _history(step_fn, cache, rows):
    """Put each row's first ``start`` tokens in the cache (state in its read slot)."""
    for r in rows:
        if r["start"] > 0:
            _, cache = step_fn(_flat([dict(ids=r["hist"][:r["start"]], start=0, read=r["read"], write=r["read"],
                                           pages=r["pages"])]), cache)
    return cache


def _row_logits(logits, fb, i):
    cu = np.asarray(fb.cu_q_lens)
    return np.asarray(logits)[cu[i]:cu[i + 1]]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mixed_layout_equals_rows_alone(model, step_fn, seed):
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    cache0 = model.new_cache(NUM_SLOTS, NUM_PAGES, PAGE)
    # dirty every slot and page first, so "fresh" and untouched slots are really tested
    cache0 = dataclasses.replace(
        cache0, kda_state=cache0.kda_state + 0.01 * jax.random.normal(jax.random.key(seed), cache0.kda_state.shape),
        kda_conv=cache0.kda_conv + 0.01, mla_kv=cache0.mla_kv + 0.02)
    rows, free_slots = _layout(rng, V)
    cache = _history(step_fn, cache0, rows)
    # snapshots: offsets 1, 63 (or the row's end), mid-chunk, and the whole row
    snaps = []
    for i, r in enumerate(rows):
        q = len(r["ids"])
        for n in sorted({1, min(63, q), max(1, q // 2), q}):
            if len(snaps) < NS and free_slots and rng.random() < 0.5:
                snaps.append((i, n, int(free_slots.pop())))
    fb = _flat(rows, snaps)
    logits, out = step_fn(fb, cache)
    st, cv, kv = (np.asarray(a) for a in (out.kda_state, out.kda_conv, out.mla_kv))
    touched_slots = {r["write"] for r in rows} | {s for _, _, s in snaps}
    touched_pages = {p for r in rows for p in r["pages"]}
    for i, r in enumerate(rows):
        # the reference reads and writes one slot (the row's read slot): no hit
        fb1 = _flat([dict(r, write=r["read"])])
        l1, c1 = step_fn(fb1, cache)
        assert rel_err(_row_logits(logits, fb, i), _row_logits(l1, fb1, 0)) < 1e-5, (seed, i, r["start"], len(r["ids"]))
        w = r["write"]
        np.testing.assert_allclose(st[:, w], np.asarray(c1.kda_state)[:, r["read"]], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cv[:, w], np.asarray(c1.kda_conv)[:, r["read"]], rtol=1e-5, atol=1e-5)
        for p in r["pages"]:
            np.testing.assert_allclose(kv[:, p], np.asarray(c1.mla_kv)[:, p], rtol=1e-5, atol=1e-5)
        if r["read"] != w:  # the read slot (a snapshot) is left as it was
            np.testing.assert_array_equal(st[:, r["read"]], np.asarray(cache.kda_state)[:, r["read"]])
    for i, n, slot in snaps:
        r = rows[i]
        part = dict(r, ids=r["ids"][:n], write=r["read"])
        _, c1 = step_fn(_flat([part]), cache)
        w = r["read"]
        np.testing.assert_allclose(st[:, slot], np.asarray(c1.kda_state)[:, w], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cv[:, slot], np.asarray(c1.kda_conv)[:, w], rtol=1e-5, atol=1e-5)
    # nothing else changed
    before = (np.asarray(cache.kda_state), np.asarray(cache.kda_conv), np.asarray(cache.mla_kv))
    for s in set(range(NUM_SLOTS)) - touched_slots:
        np.testing.assert_array_equal(st[:, s], before[0][:, s])
        np.testing.assert_array_equal(cv[:, s], before[1][:, s])
    for p in set(range(NUM_PAGES)) - touched_pages:
        np.testing.assert_array_equal(kv[:, p], before[2][:, p])


def test_fresh_row_ignores_its_read_slot(model, step_fn):
    """A row at position 0 starts from zeros whatever its read slot holds."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, model.config.vocab_size, 70).tolist()
    row = dict(ids=ids, start=0, read=3, write=3, pages=[0, 1, 2, 3, 4])
    clean = model.new_cache(NUM_SLOTS, NUM_PAGES, PAGE)
    dirty = dataclasses.replace(clean, kda_state=clean.kda_state + 1.0, kda_conv=clean.kda_conv - 1.0)
    la, ca = step_fn(_flat([row]), clean)
    lb, cb = step_fn(_flat([row]), dirty)
    np.testing.assert_array_equal(np.asarray(la)[:70], np.asarray(lb)[:70])
    np.testing.assert_array_equal(np.asarray(ca.kda_state)[:, 3], np.asarray(cb.kda_state)[:, 3])


def _loop_computations(hlo: str) -> dict[str, list[str]]:
    """The computations of an HLO module run by its top-level while loops (bodies and all they
    call), name -> instruction lines."""
    import re

    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    callees = lambda lines: {c for ln in lines for c in re.findall(r"(?:calls|body|condition|to_apply)=(%[\w.-]+)", ln)
                             + [c for grp in re.findall(r"branch_computations=\{([^}]*)\}", ln)
                                for c in re.findall(r"%[\w.-]+", grp)]}
    todo = [m for ln in comps["ENTRY"] if " while(" in ln for m in re.findall(r"body=(%[\w.-]+)", ln)]
    seen: dict[str, list[str]] = {}
    while todo:
        c = todo.pop()
        if c not in seen and c in comps:
            seen[c] = comps[c]
            todo += list(callees(comps[c]))
    return seen


def test_step_updates_big_buffers_in_place(model):
    """In the compiled step (cache donated, as the engine runs it) the layer loop copies
    neither the MLA pool nor the carried KDA rows: the per-kind ``lax.switch`` only reads them
    (a buffer passed through a switch is copied on every layer)."""
    graphdef = model.graphdef
    cache = model.new_cache(NUM_SLOTS, NUM_PAGES)
    fb = _flat([dict(ids=[3], start=7, read=1, write=1, pages=[0])])
    step = jax.jit(lambda p, fb, c: nnx.merge(graphdef, p).step(fb, c), donate_argnums=(2,))
    loop = _loop_computations(step.lower(model.params, fb, cache).compile().as_text())
    assert loop, "no layer loop in the compiled step"
    n_kda = cache.kda_state.shape[0]
    shapes = {"mla pool": cache.mla_kv.shape, "kda state rows": (n_kda, R) + cache.kda_state.shape[2:],
              "kda conv rows": (n_kda, R, model.config.conv_kernel_size - 1, 3 * model.config.kda_proj_size)}
    for what, shape in shapes.items():
        pattern = f"f32[{','.join(map(str, shape))}]" + "{"
        copies = [ln.strip()[:160] for lines in loop.values() for ln in lines if pattern in ln and " copy(" in ln]
        assert not copies, f"{what} {shape} copied in the layer loop: {copies[:2]}"


def test_token_buckets_ladder():
    """1, the rows rounded up to a power of two, that times powers of the growth, the budget."""
    from k3serve.model.step import token_buckets

    assert token_buckets(256, 4) == [1, 4, 32, 256]
    assert token_buckets(256, 8) == [1, 8, 64, 256]
    assert token_buckets(256, 6) == [1, 8, 64, 256]
    assert token_buckets(256, 1) == [1, 8, 64, 256]
    assert token_buckets(256, 4, growth=4) == [1, 4, 16, 64, 256]
    assert token_buckets(24, 2) == [1, 2, 16, 24]
    assert token_buckets(4, 4) == [1, 4]
    assert token_buckets(1, 1) == [1]
    with pytest.raises(ValueError):
        token_buckets(256, 4, growth=1)
