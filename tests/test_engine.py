"""The engine against the model's own greedy decode and the golden continuations:
continuous batching, chunked prefill, page sizes, forced preemption, no recompiles after
warm-up, no page or slot leaks, stops, aborts and seeded sampling."""
from __future__ import annotations

import numpy as np
import pytest

from _util import golden, load_case
from k3serve.server.engine import Engine
from k3serve.server.sampling_params import SamplingParams

CASE = "k3-tiny-a"


def _prompts():
    g = golden(CASE)
    base = [list(map(int, g[f"input_ids_{i}"])) for i in range(3)]
    expect = [list(map(int, g[f"gen_tokens_{i}"])) for i in range(3)]
    return base, expect


def _run(engine, prompts, params):
    rids = [engine.add_request(p, params) for p in prompts]
    done, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.rid] = out
        steps += 1
        assert steps < 2000
    return [done[r] for r in rids]


def _assert_all_free(engine):
    engine.cache.check_invariants()
    s = engine.stats()
    assert s["free_pages"] == engine.plan.num_pages
    assert s["free_slots"] == engine.plan.num_slots - 1  # minus the scratch slot


@pytest.fixture(scope="module")
def engine_a():
    return Engine(load_case(CASE), max_num_seqs=4, max_num_batched_tokens=40, chunk_size=16, page_size=16,
                  max_model_len=128, num_pages=48)


def test_batched_greedy_equals_golden_and_model(engine_a):
    eng = engine_a
    compiles = eng.stats()["num_compiles"]
    base, expect = _prompts()
    m = load_case(CASE)
    extra = [base[0][:25], base[1] + base[2], base[0][5:36]]
    want = expect + [m.greedy(p, 12) for p in extra]
    outs = _run(eng, base + extra, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    for o, w in zip(outs, want):
        assert o.token_ids == w and o.finish_reason == "length" and o.completion_tokens == 12
    # mixed traffic after warm-up compiled nothing new
    assert eng.stats()["num_compiles"] == compiles
    _assert_all_free(eng)


def test_preemption_with_tiny_page_budget():
    """8-token pages, 2 rows, 9 pages in all: requests preempt each other and recompute,
    and every output still equals the golden greedy continuation."""
    base, expect = _prompts()
    eng = Engine(load_case(CASE), max_num_seqs=2, max_num_batched_tokens=24, chunk_size=8, page_size=8,
                 max_model_len=64, num_pages=9)
    outs = _run(eng, base, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expect
    assert eng.stats()["num_preemptions"] > 0
    assert eng.scheduler.running == [] and eng.scheduler.waiting == []
    _assert_all_free(eng)
    assert eng.stats()["num_compiles"] == len(eng.runner.row_buckets) * len(eng.runner.tok_buckets)


def test_stops_abort_and_bad_input(engine_a):
    eng = engine_a
    base, expect = _prompts()
    # stop on the 3rd greedy token of prompt 0
    stop = expect[0][2]
    out = _run(eng, [base[0]], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop]))[0]
    assert out.token_ids == expect[0][:3] and out.finish_reason == "stop" and out.matched_stop == stop
    # abort a running request: it reports once, and its pages and slot come back
    rid = eng.add_request(base[1], SamplingParams(max_new_tokens=50, temperature=0))
    other = eng.add_request(base[2], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.abort(rid)
    finals = {}
    while eng.has_unfinished() or rid not in finals:
        for o in eng.step():
            if o.finished:
                finals[o.rid] = o
    assert finals[rid].finish_reason == "abort"
    assert finals[other].token_ids == expect[2]
    _assert_all_free(eng)
    with pytest.raises(ValueError, match="99999"):
        eng.add_request([1, 99999])
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request([1] * 200)
    _assert_all_free(eng)


def test_seeded_sampling_is_independent_of_batch_company(engine_a):
    eng = engine_a
    base, _ = _prompts()
    p = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True, logprobs=3)
    alone = _run(eng, [base[0]], p)[0]
    noisy = SamplingParams(max_new_tokens=6, temperature=1.3, seed=7, ignore_eos=True)
    rids = [eng.add_request(base[1], noisy), eng.add_request(base[0], p), eng.add_request(base[2], noisy)]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.rid] = o
    assert done[rids[1]].token_ids == alone.token_ids
    assert len(alone.logprobs) == 8 and all(len(top) == 3 for _, top in alone.logprobs)
    lp0, top0 = alone.logprobs[0]
    assert lp0 <= 0 and top0[0][1] >= top0[-1][1]
    _assert_all_free(eng)
