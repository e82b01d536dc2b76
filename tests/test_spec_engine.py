"""The engine with speculative decoding against the same engine without it: the same tokens.

Random weights make a weight-free drafter's natural acceptance near zero, so most tests use an
oracle drafter (test code only, never a serving option): it proposes the tokens plain decoding
emitted, with wrong tokens injected at chosen output positions — so rows accept every length
from 0 to k, and a wrong fold, a wrong rollback or a stop inside a block shows as a different
token. Checked: greedy on two K3 models and Kimi Linear; seeded sampling with penalties and
``min_new_tokens`` (same keys, so the same tokens); stop ids and ``max_new_tokens`` inside a
block; prefix caching (a second request resumes from the first one's cache); preemption; the
n-gram and suffix drafters on prompts that repeat; nothing leaks.
"""
from __future__ import annotations

import numpy as np
import pytest

from _util import load_case
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams

K = 4


class OracleDrafter:
    """Proposes ``truth[prompt]``'s next tokens; output positions in ``wrong`` get a wrong token."""

    def __init__(self, truth: dict, vocab: int, wrong=lambda pos: pos % 5 == 3):
        self.truth, self.vocab, self.wrong = truth, vocab, wrong
        self.finished = []

    def propose(self, req, max_tokens, after=()):
        seq = self.truth[tuple(req.prompt)]
        at = len(req.output) + len(after)
        out = list(seq[at:at + max_tokens])
        return [(t + 1) % self.vocab if self.wrong(at + j) else t for j, t in enumerate(out)]

    def finish(self, req, keep=True):
        self.finished.append(req.rid)


# one engine shape for every k3-tiny-a run of the module (11 pages of 16: a request of the
# prefix test is preempted), so plain and speculative programs compile once per module (the
# session's compile cache serves the later engines)
SHAPE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, page_size=16, bucket_growth=16,
             num_pages=11, prefix_unit=16)


def _run(model, prompts, params, spec=None, drafter=None, **kw):
    # no warm-up: only the buckets a test uses are compiled
    args = dict(SHAPE, warmup=False)
    args.update(kw)
    e = Engine(model, speculative=spec, drafter=drafter, **args)
    ids = [e.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    out, steps = {}, 0
    while e.has_unfinished():
        steps += 1
        assert steps < 400
        for o in e.step():
            if o.finished:
                out[o.rid] = (o.token_ids, o.finish_reason, o.matched_stop)
    e.check_invariants()
    assert e.cache_mgr.num_free_slots == e.capacity_plan.max_concurrent_slots
    return [out[i] for i in ids], e


_PLAIN: dict = {}


def _plain(model, prompts, params):
    """Plain decoding's outputs (with the default engine settings), computed once per module."""
    key = (id(model), repr(prompts), repr(params))
    if key not in _PLAIN:
        _PLAIN[key] = _run(model, prompts, params)[0]
    return _PLAIN[key]


def _prompts(V, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, V, 9).tolist()
    return [base * 3, rng.integers(0, V, 21).tolist(), base[:4] * 5 + [1, 2]]


@pytest.mark.parametrize("case,async_scheduling", [("k3-tiny-a", True), ("k3-tiny-a", False),
                                                    ("kimi-linear-tiny", True)])
def test_greedy_oracle_with_wrong_tokens_equals_plain(case, async_scheduling):
    """Async scheduling (the default): each decode row is planned while the request's previous
    verify row runs, its start corrected on the device and its drafts proposed after a guess of
    that row's outcome (kept only when the guess held). Synchronous: planned after it."""
    model = load_case(case)
    V = model.config.vocab_size
    prompts = _prompts(V)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    plain = _plain(model, prompts, params)
    drafter = OracleDrafter({tuple(p): o[0] for p, o in zip(prompts, plain)}, V, wrong=lambda pos: pos % 7 == 3)
    got, e = _run(model, prompts, params, spec={"num_speculative_tokens": K}, drafter=drafter,
                  async_scheduling=async_scheduling)
    assert got == plain
    counts = e.stats()["spec_accept_counts"]
    assert sum(counts) > 0 and counts[K] > 0 and sum(counts[:K]) > 0, counts  # full blocks and rejections
    assert e.num_steps < 0.6 * 20 * len(prompts)  # fewer steps than one token a step
    # the prefill steps (no drafts, nothing to fold) ran the plain program
    assert 0 < e.stats()["spec_steps"] < e.num_steps
    assert len(drafter.finished) == len(set(drafter.finished)) == len(prompts)  # each request told once
    st = e.stats()
    if async_scheduling:  # rows planned on a guess: some held (their drafts verified), some not (dropped);
        # blocks cut short by the wrong tokens make some steps wait for the one in flight
        assert 0 < st["spec_guess_held"] < st["spec_guess_rows"], st
        assert st["sync_steps"] > 0, st
    else:
        assert st["spec_guess_rows"] == st["sync_steps"] == 0
    if async_scheduling and case == "k3-tiny-a":  # a drafter that is always right: every guess holds
        got, e = _run(model, prompts, params, spec={"num_speculative_tokens": K},
                      drafter=OracleDrafter(drafter.truth, V, wrong=lambda pos: False))
        assert got == plain
        st = e.stats()
        assert st["spec_guess_held"] == st["spec_guess_rows"] > 0 and st["sync_steps"] == 0, st
        assert st["spec_accepted_tokens"] == st["spec_draft_tokens"], st


def test_sampled_with_penalties_and_stops_inside_blocks():
    model = load_case("k3-tiny-b")
    V = model.config.vocab_size
    prompts = _prompts(V, seed=1)
    params = [SamplingParams(max_new_tokens=18, temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.5,
                             presence_penalty=0.3, repetition_penalty=1.2, min_new_tokens=3),
              SamplingParams(max_new_tokens=13, temperature=0.7, seed=11),
              SamplingParams(max_new_tokens=18, temperature=0.0)]
    plain, _ = _run(model, prompts, params)
    # a stop id plain greedy decoding emits mid-way, on a fourth request (the same prompt as the
    # third): the speculative run must stop at the same token (greedy: plain decoding would stop
    # at its first occurrence)
    stop = plain[2][0][6]
    prompts.append(prompts[2] + [])
    params.append(SamplingParams(max_new_tokens=18, temperature=0.0, stop_token_ids=[stop]))
    plain.append((plain[2][0][:plain[2][0].index(stop) + 1], "stop", stop))
    drafter = OracleDrafter({tuple(p): o[0] + [0] * K for p, o in zip(prompts, plain)}, V,
                            wrong=lambda pos: pos % 7 == 2)
    got, e = _run(model, prompts, params, spec={"num_speculative_tokens": K}, drafter=drafter)
    assert got == plain
    assert e.stats()["spec_accepted_tokens"] > 0
    assert [len(g[0]) for g in got] == [len(r[0]) for r in plain]  # max_new_tokens held inside blocks


def test_prefix_cache_and_preemption():
    model = load_case("k3-tiny-a")
    V = model.config.vocab_size
    rng = np.random.default_rng(3)
    shared = rng.integers(0, V, 40).tolist()
    prompts = [shared + [1, 2, 3], shared + [4, 5], rng.integers(0, V, 30).tolist(), shared + [6]]
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    # 11 pages of 16 (SHAPE) for four requests of up to 67 tokens (5 pages each, 2 shared):
    # someone is preempted
    plain, e0 = _run(model, prompts, params)
    drafter = OracleDrafter({tuple(p): o[0] for p, o in zip(prompts, plain)}, V)
    # max_rows 2: speculation switches off while three or four requests run, so rows also follow
    # in-flight verify rows without drafts of their own (async: start corrected on the device)
    got, e = _run(model, prompts, params, spec={"num_speculative_tokens": K, "max_rows": 2}, drafter=drafter)
    assert got == plain
    st = e.stats()
    assert st["num_preemptions"] > 0 and st["spec_accepted_tokens"] > 0
    assert st["prefix_hits"] > 0


def test_weight_free_drafters_equal_plain():
    """n-gram on prompts that repeat; suffix decoding on a request whose tenant ran the same
    prompt before (its output is in the tenant's trie: an agentic replay)."""
    model = load_case("k3-tiny-a")
    V = model.config.vocab_size
    prompts = _prompts(V)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    plain = _plain(model, prompts, params)
    got, e = _run(model, prompts, params, spec={"method": "ngram", "num_speculative_tokens": K})
    assert got == plain
    st = e.stats()
    # the repeating prompts gave drafts (async: proposed on guesses of the in-flight rows' outcome,
    # which a random model seldom follows, so most were dropped unverified)
    assert st["spec_draft_tokens"] + st["spec_guess_rows"] > 0, st
    e = Engine(model, warmup=False, speculative={"method": "suffix", "num_speculative_tokens": K}, **SHAPE)
    for turn in range(2):
        rid = e.add_request(prompts[1], params, cache_salt="tenant-a")
        while e.has_unfinished():
            for o in e.step():
                if o.finished:
                    assert o.rid == rid and o.token_ids == plain[1][0]
    assert e.stats()["spec_accepted_tokens"] >= 10  # the second turn replays the first one's output
    e.check_invariants()


def test_bad_settings_are_refused():
    model = load_case("k3-tiny-a")
    with pytest.raises(ValueError, match="unknown speculative method"):
        Engine(model, speculative={"method": "eagle", "num_speculative_tokens": 2}, warmup=False)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(model, speculative={"method": "ngram", "num_speculative_tokens": 0}, warmup=False)


def _chi2_homogeneity(a: list, b: list) -> tuple[float, int]:
    """Two-sample chi-square statistic and degrees of freedom over the outcomes of ``a`` and
    ``b``; outcomes expected fewer than 5 times in either sample are pooled into one bin."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    keys = sorted(set(ca) | set(cb))
    small = [x for x in keys if (ca[x] + cb[x]) * min(na, nb) / (na + nb) < 5]
    bins = [(ca[x], cb[x]) for x in keys if x not in small]
    if small:
        bins.append((sum(ca[x] for x in small), sum(cb[x] for x in small)))
    stat = 0.0
    for oa, ob in bins:
        tot = oa + ob
        for o, n in ((oa, na), (ob, nb)):
            e = tot * n / (na + nb)
            stat += (o - e) ** 2 / e
    return stat, len(bins) - 1


def _chi2_quantile_999(df: int) -> float:
    """The chi-square distribution's 99.9 % quantile (Wilson-Hilferty; within 1 % for df >= 3)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_distribution_matches_plain_sampling():
    """Unseeded-alike: 300 requests with seeds 0..299 speculate, 300 with seeds 1000..1299 do
    not; the joint law of their first three tokens (top-3 sampling at temperature 1, so a small
    vocabulary of outcomes) is the same (two-sample chi-square, 99.9 %). The drafter proposes
    the greedy chain, so drafts are accepted about as often as the sample is the argmax and the
    emitted tokens mix accepted drafts, corrections and bonus tokens. The same statistic
    separates plain sampling from the drafts themselves (the test has power)."""
    model = load_case("k3-tiny-a")
    V = model.config.vocab_size
    prompt = _prompts(V)[1]
    greedy = _plain(model, [prompt], SamplingParams(max_new_tokens=20, temperature=0.0))[0][0]

    class Greedy:
        def propose(self, req, max_tokens, after=()):
            at = len(req.output) + len(after)
            return greedy[at:at + max_tokens]

        def finish(self, req, keep=True):
            pass

    n = 300
    draw = lambda s: SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
    spec, e = _run(model, [prompt] * n, [draw(s) for s in range(n)], spec={"num_speculative_tokens": K},
                   drafter=Greedy())
    plain, _ = _run(model, [prompt] * n, [draw(1000 + s) for s in range(n)])
    st = e.stats()
    assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st  # some drafts kept, some rejected
    a, b = [tuple(x[0]) for x in spec], [tuple(x[0]) for x in plain]
    stat, df = _chi2_homogeneity(a, b)
    assert df >= 3 and stat < _chi2_quantile_999(df), (stat, df)
    stat, df = _chi2_homogeneity([tuple(greedy[:3])] * n, b)
    assert stat > _chi2_quantile_999(df), (stat, df)


def test_abort_between_speculative_steps_leaks_nothing():
    """A request aborted after a verify step whose accepted drafts are still unfolded, and a
    fourth request aborted at the same moment wherever it is: the others' tokens equal plain decoding's, every slot, page, token
    table row and journal entry comes back, and the aborted requests' drafters are told once."""
    model = load_case("k3-tiny-a")
    V = model.config.vocab_size
    prompts = _prompts(V)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    plain = _plain(model, prompts, params)
    drafter = OracleDrafter({tuple(p): o[0] for p, o in zip(prompts, plain)}, V)
    e = Engine(model, warmup=False, speculative={"num_speculative_tokens": K}, drafter=drafter, **SHAPE)
    ids = [e.add_request(p, params) for p in prompts]
    late = e.add_request(prompts[0], params)  # a fourth, aborted wherever it is (11 pages: it may wait)
    out, aborted = {}, False
    for _ in range(400):
        if not e.has_unfinished():
            break
        for o in e.step():
            if o.finished:
                out[o.rid] = (o.token_ids, o.finish_reason)
        if not aborted and e.stats()["spec_accepted_tokens"] > 0:  # a fold is pending for ids[1]
            assert e.abort(ids[1]) and e.abort(late)
            aborted = True
    assert aborted
    assert out[ids[1]][1] == "abort" and out[late][1] == "abort"
    for i in (0, 2):
        assert out[ids[i]][0] == plain[i][0]
    e.check_invariants()
    assert e.cache_mgr.num_free_slots == e.capacity_plan.max_concurrent_slots
    assert not e.runner._journal_row and sum(map(len, e.runner._journal_free)) == e.runner.journal[0].shape[1]
    assert sorted(drafter.finished) == sorted(ids + [late])
