"""Speculative verify rows in the flattened step (``KimiLM.step(..., journal=...)``) against plain
decoding of the same tokens, one token per step.

A request's history is prefilled; then either plain decoding runs tokens ``x0 .. x4`` one step
each, or one speculative step runs ``x0`` and the drafts ``x1 .. x4`` as one decode row (beside a
decode row without drafts and a prefill chunk of the same length, whose kind must not be taken
from its length), and the next step folds ``a`` accepted drafts and decodes ``x_{a+1}``. For
every ``a`` in 0..4: the verify step's logits at every position equal plain decoding's, and after
the fold step the request's KDA state and conv window and its MLA rows for positions ``< start +
a + 2`` equal plain decoding's bit for bit (the reference path; both run the same update,
``kernels/kda_spec.py``). Nothing else in the cache changes.

Bit for bit on a dense model (Kimi Linear without experts). With routed experts the reference
MoE's matmuls see a different number of tokens per expert in a step of several tokens than in
a step of one, and XLA's CPU matmul rounds differently with the row count: there the figures
agree to fp32 noise (relative 1e-5), exactly as plain decoding of one request differs in a
batch of other requests.

``kimi-linear-tiny-dense@pallas-interpret``: the same model on the interpreted Pallas kernels, so a
speculative step runs the KDA decode kernel's record mode (``kernels/kda_spec_kernel.py``: fold
fused in, drafts journaled in place) and plain decoding runs ``kda_decode``; accept lengths 0, 2
and 4 only (interpreted steps are slow), relative 1e-5: the two kernels round the delta step's
multiply-adds differently (``tests/test_kda_spec_kernel.py``), so not bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _util import load_case, rel_err
from k3serve.model.k3 import journal_shapes
from k3serve.model.step import FlatBatch

T, R, NS, PAGE = 16, 3, 2, 8
NUM_SLOTS, NUM_PAGES, WIDTH, DRAFTS, J = 6, 24, 8, 4, 3
HIST = 13  # history tokens before the decode rows


# case -> relative tolerance (0: bit for bit); "@pallas-interpret": the Pallas kernels, interpreted
CASES = {"kimi-linear-tiny-dense": 0.0, "k3-tiny-a": 1e-5, "kimi-linear-tiny-dense@pallas-interpret": 1e-5}
PALLAS_ACCEPTED = (0, 2, DRAFTS)  # interpreted steps are slow: a few accept lengths


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param


@pytest.fixture(scope="module")
def model(case):
    name, _, kernels = case.partition("@")
    if not kernels:
        return load_case(name)
    from _util import DATA
    from k3serve.checkpoints import load_pretrained

    m = load_pretrained(DATA / name, dtype="float32", kernels=kernels)
    assert m.config.kernels == kernels
    return m


@pytest.fixture(scope="module")
def fns(model):
    graphdef = model.graphdef

    @jax.jit
    def plain(params, fb, cache):  # logits at each row's last token, as a serving step
        return nnx.merge(graphdef, params).step(fb, cache)

    @jax.jit
    def spec(params, fb, cache, journal):
        return nnx.merge(graphdef, params).step(fb, cache, journal=journal)

    return (lambda fb, cache: plain(model.params, fb, cache),
            lambda fb, cache, journal: spec(model.params, fb, cache, journal))


def _flat(rows, spec: bool):
    """rows: dicts (ids, start, slot, pages, decode, fold, jrow)."""
    ids, pos, tok_row = np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, -1, np.int32)
    cu = np.zeros(R + 1, np.int32)
    c = {k: np.zeros(R, np.int32) for k in ("start", "q", "read", "write", "fold", "jrow")}
    c["write"][:] = NUM_SLOTS
    c["jrow"][:] = -1
    decode, fresh = np.zeros(R, bool), np.ones(R, bool)
    lidx = np.full((R, DRAFTS + 1), -1, np.int32)
    table = np.full((R, WIDTH), -1, np.int32)
    t = 0
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[t:t + n], pos[t:t + n], tok_row[t:t + n] = r["ids"], np.arange(r["start"], r["start"] + n), i
        c["start"][i], c["q"][i], c["read"][i], c["write"][i] = r["start"], n, r["slot"], r["slot"]
        c["fold"][i], c["jrow"][i] = r.get("fold", 0), r.get("jrow", -1)
        decode[i] = r.get("decode", False)
        lidx[i, :n if decode[i] else 1] = np.arange(t, t + n) if decode[i] else t + n - 1
        fresh[i] = r["start"] == 0
        table[i, :len(r["pages"])] = r["pages"]
        t += n
        cu[i + 1:] = t
    a = jnp.asarray
    extra = dict(decode=a(decode), fold_len=a(c["fold"]), jrow=a(c["jrow"])) if spec else {}
    return FlatBatch(ids=a(ids), pos=a(pos), tok_row=a(tok_row), cu_q_lens=a(cu), start_pos=a(c["start"]),
                     q_lens=a(c["q"]), read_slot=a(c["read"]), write_slot=a(c["write"]), fresh=a(fresh),
                     page_table=a(table), logits_idx=a(lidx if spec else lidx[:, 0]), snap_row=a(np.full(NS, -1)),
                     snap_len=a(np.zeros(NS, np.int32)), snap_slot=a(np.full(NS, NUM_SLOTS, np.int32)), **extra)


def _journal(cfg, dtype):
    return tuple(jnp.full(s, 7.0, d) for s, d in journal_shapes(cfg, J, DRAFTS, dtype))  # junk: never read unfolded


@pytest.fixture(scope="module")
def setup(model, fns):
    plain, _ = fns
    rng = np.random.default_rng(0)
    V = model.config.vocab_size
    cache = model.new_cache(NUM_SLOTS, NUM_PAGES, PAGE)
    cache = type(cache)(kda_state=cache.kda_state + 0.01, kda_conv=cache.kda_conv - 0.01, mla_kv=cache.mla_kv + 0.02)
    hist = rng.integers(0, V, HIST).tolist()
    other = rng.integers(0, V, HIST).tolist()
    pages_a, pages_b, pages_c = [0, 5, 9], [1, 6, 10], [2, 7, 11]
    _, cache = plain(_flat([dict(ids=hist, start=0, slot=1, pages=pages_a)], False), cache)
    _, cache = plain(_flat([dict(ids=other, start=0, slot=2, pages=pages_b)], False), cache)
    xs = rng.integers(0, V, DRAFTS + 2).tolist()
    return dict(cache=cache, hist=hist, xs=xs, other=other, pages=(pages_a, pages_b, pages_c),
                prefill=rng.integers(0, V, DRAFTS + 1).tolist())


def _same(got, want, tol):
    if tol == 0.0:
        np.testing.assert_array_equal(got, want)
    else:
        assert rel_err(got, want) < tol


def _plain_run(plain, cache, setup, n):
    """Plain decoding of ``xs[:n]`` for request A (slot 1), one token a step: logits per token."""
    pa = setup["pages"][0]
    out = []
    for j, x in enumerate(setup["xs"][:n]):
        lg, cache = plain(_flat([dict(ids=[x], start=HIST + j, slot=1, pages=pa)], False), cache)
        out.append(np.asarray(lg)[0])  # row 0's logits
    return np.stack(out), cache


@pytest.mark.parametrize("accepted", range(DRAFTS + 1))
def test_verify_then_fold_equals_plain_decoding(case, model, fns, setup, accepted):
    plain, spec = fns
    tol = CASES[case]
    if "@" in case and accepted not in PALLAS_ACCEPTED:
        pytest.skip("interpreted kernels: a few accept lengths")
    cache0, xs = setup["cache"], setup["xs"]
    pa, pb, pc = setup["pages"]
    want_logits, want = _plain_run(plain, cache0, setup, accepted + 2)
    journal = _journal(model.config, model.dtype)
    rows = [dict(ids=xs[:DRAFTS + 1], start=HIST, slot=1, pages=pa, decode=True, jrow=2),
            dict(ids=[setup["other"][0]], start=HIST, slot=2, pages=pb, decode=True, jrow=0),
            dict(ids=setup["prefill"], start=0, slot=3, pages=pc)]  # a prefill of 1 + DRAFTS tokens
    lg, cache, journal = spec(_flat(rows, True), cache0, journal)
    lg = np.asarray(lg).reshape(R, DRAFTS + 1, -1)
    m = min(accepted + 2, DRAFTS + 1)
    _same(lg[0, :m], want_logits[:m], tol)
    # the prefill chunk of DRAFTS + 1 tokens ran as a prefill: its state equals a plain prefill's
    _, pre = plain(_flat([rows[2] | dict(decode=False)], False), cache0)
    _same(np.asarray(cache.kda_state[:, 3]), np.asarray(pre.kda_state[:, 3]), tol)
    # the next step: fold the accepted drafts, decode the token after them
    nxt = [dict(ids=[xs[accepted + 1]], start=HIST + accepted + 1, slot=1, pages=pa, decode=True, jrow=2,
                fold=accepted)]
    _, cache, journal = spec(_flat(nxt, True), cache, journal)
    got_state, want_state = np.asarray(cache.kda_state[:, 1]), np.asarray(want.kda_state[:, 1])
    _same(got_state, want_state, tol)
    _same(np.asarray(cache.kda_conv[:, 1]), np.asarray(want.kda_conv[:, 1]), tol)
    L = HIST + accepted + 2  # MLA rows of positions < L are the committed ones
    kv_got = np.asarray(cache.mla_kv)[:, pa].reshape(cache.mla_kv.shape[0], -1, cache.mla_kv.shape[-1])[:, :L]
    kv_want = np.asarray(want.mla_kv)[:, pa].reshape(want.mla_kv.shape[0], -1, want.mla_kv.shape[-1])[:, :L]
    _same(kv_got, kv_want, tol)
    # untouched: the empty slots 4, 5 and the scratch slot
    for s in (0, 4, 5):
        np.testing.assert_array_equal(np.asarray(cache.kda_state[:, s]), np.asarray(cache0.kda_state[:, s]))
