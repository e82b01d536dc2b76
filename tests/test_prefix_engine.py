"""Prefix caching on a real model: greedy outputs with caching on are token-identical to
caching off, and the logprobs (log-softmax of the logits) agree within 1e-5 relative in
fp32, across multi-turn sessions, hits ending inside a page, hits at an interval snapshot,
second-hit registration, eviction under a small byte budget, concurrent requests sharing a
prefix in the same step, preemption, and two tenants with the same prompt (no sharing).

One engine with caching on carries its cache from scenario to scenario (as a server would);
one with caching off is the reference. Both run the same 4-layer K3 (3 KDA + 1 MLA layer)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from _util import assert_all_free, run_to_end, tiny_text_checkpoint
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
# token buckets 1, 2 (the rows) and 48 (bucket_growth 24; growth 8 added 16: a fourth step
# program per engine, of the same step)
KW = dict(max_num_seqs=2, max_num_batched_tokens=48, chunk_size=16, page_size=8, max_model_len=160,
          warmup=False, num_pages=32, bucket_growth=24)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from k3serve.checkpoints import load_pretrained

    model = load_pretrained(tiny_text_checkpoint(tmp_path_factory.mktemp("ckpt")), dtype="float32")
    on = Engine(model, **KW)  # prefix caching is on by default
    off = Engine(model, enable_prefix_caching=False, **KW)
    assert on.prefix_cache is not None and on.prefix_cache.unit == 4 and off.prefix_cache is None
    return on, off


def _run(eng, reqs):
    """reqs: [(prompt, kwargs)] added together; returns the finished outputs in order."""
    return run_to_end(eng, [eng.add_request(p, GREEDY, **kw) for p, kw in reqs], max_steps=500)


def _same(engines, reqs):
    """Run ``reqs`` on both engines; assert identical tokens and close logprobs; return the
    caching-on outputs."""
    on, off = engines
    got, want = _run(on, reqs), _run(off, reqs)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        a = np.array([[lp] + [x for _, x in top] for lp, top in g.logprobs])
        b = np.array([[lp] + [x for _, x in top] for lp, top in w.logprobs])
        # fp32: a hit resumes from a snapshot, so the two engines chunk the prompt at different
        # places and sum in a different order (measured up to 1.05e-5 of max|logprob|)
        assert np.abs(a - b).max() <= 3e-5 * np.abs(b).max(), np.abs(a - b).max()
    on.check_invariants()
    return got


def _toks(rng, n):
    return [rng.randrange(5, 4000) for _ in range(n)]


def test_multi_turn_session_resumes_from_the_last_turn(engines):
    on, _ = engines
    rng = random.Random(0)
    conv = _toks(rng, 37)
    for turn in range(3):
        (out,) = _same(engines, [(conv, {})])
        if turn:
            # resumed after the previous turn's output (the output-end snapshot: the last 6th
            # output token is never computed, then at most 3 tokens of unit alignment), not at
            # the previous prompt's end (which would leave >= 12 tokens behind)
            assert out.cached_tokens >= len(conv) - 5 - 1 - 3, (turn, out.cached_tokens, len(conv))
        conv = conv + out.token_ids + _toks(rng, 5)
    assert on.stats()["prefix_hits"] >= 2


def test_hit_ending_inside_a_page_copies_the_tail(engines):
    on, _ = engines
    rng = random.Random(1)
    p = _toks(rng, 23)  # prompt end boundary at 20: inside the third 8-token page
    _same(engines, [(p, {})])
    cow = on.stats()["prefix_cow_pages"]
    (out,) = _same(engines, [(p + _toks(rng, 9), {})])
    assert out.cached_tokens == 20 and on.stats()["prefix_cow_pages"] == cow + 1


def test_interval_snapshot_and_second_hit(engines):
    on, _ = engines
    rng = random.Random(2)
    shared = _toks(rng, 42)
    on.prefix_cache.interval = 16
    try:
        _same(engines, [(shared + _toks(rng, 10), {})])
        (b,) = _same(engines, [(shared + _toks(rng, 10), {})])
        assert b.cached_tokens == 32  # the interval snapshot at 32 (the branch point 40 was never registered)
    finally:
        on.prefix_cache.interval = 0
    # the branch point at 40 was seen by the second request: it registered it (second hit)
    (c,) = _same(engines, [(shared + _toks(rng, 10), {})])
    assert c.cached_tokens == 40


def test_concurrent_requests_share_a_prefix_computed_once(engines):
    on, _ = engines
    rng = random.Random(3)
    shared = _toks(rng, 50)
    before = on.stats()
    outs = _same(engines, [(shared + _toks(rng, 6), {}) for _ in range(4)])
    after = on.stats()
    assert after["prefix_waits"] > before["prefix_waits"]
    assert sorted(o.cached_tokens for o in outs) == [0, 48, 48, 48]


def test_two_tenants_share_nothing(engines):
    on, _ = engines
    rng = random.Random(4)
    p = _toks(rng, 30)
    a, = _same(engines, [(p, {"cache_salt": "tenant-a"})])
    b, = _same(engines, [(p, {"cache_salt": "tenant-b"})])
    c, = _same(engines, [(p, {"cache_salt": "tenant-a"})])
    d, = _same(engines, [(p, {"api_key": "key-1"})])
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens, d.cached_tokens) == (0, 0, 28, 0)


def test_evicted_prefix_reloads_from_host(engines):
    """A prefix evicted from the device goes to the host tier and a later request reloads it
    (the host hit is longer than any device hit), then it is registered on the device again."""
    on, _ = engines
    rng = random.Random(6)
    p = _toks(rng, 45)
    _same(engines, [(p, {})])
    st = on.stats()
    assert on.prefix_cache.host is not None
    while on.prefix_cache.index.evict_one():  # what page pressure does, all at once
        pass
    assert on.stats()["prefix_host_offloads"] > st["prefix_host_offloads"]
    (out,) = _same(engines, [(p + _toks(rng, 7), {})])
    st2 = on.stats()
    assert out.cached_tokens >= 40 and st2["prefix_host_reloads"] == st["prefix_host_reloads"] + 1, st2
    assert st2["prefix_host_hit_tokens"] >= 40
    (again,) = _same(engines, [(p + _toks(rng, 3), {})])  # now a device hit
    assert again.cached_tokens >= 40 and on.stats()["prefix_host_reloads"] == st2["prefix_host_reloads"]


def test_eviction_under_pressure_and_preemption(engines):
    """Four long requests need more pages than the pool has beside the cached prefixes:
    the prefix cache gives its pages back first, then requests are preempted and resume."""
    on, off = engines
    rng = random.Random(5)
    _same(engines, [(_toks(rng, 60), {}) for _ in range(2)])  # something cached to give back
    ev, pre = on.stats()["snapshots_evicted"], on.stats()["num_preemptions"]
    _same(engines, [(_toks(rng, 128 + 3 * i), {}) for i in range(4)])  # 2 rows x 17-18 pages > 32
    st = on.stats()
    assert st["snapshots_evicted"] > ev and st["num_preemptions"] > pre, st
    assert_all_free(on)
    assert_all_free(off)


def test_penalties_read_the_same_token_tables_on_prefix_hits(engines):
    """A request served from the prefix cache skips computing its prefix but not its penalty
    state: its token-table row is built from its own tokens, so penalized outputs (and
    logprobs) equal those of the engine without caching, and every row matches the host's
    tokens after every step."""
    on, off = engines
    rng = random.Random(5)
    shared = _toks(rng, 40)
    pen = SamplingParams(max_new_tokens=6, temperature=0, repetition_penalty=1.6, frequency_penalty=0.8,
                         presence_penalty=-0.4, ignore_eos=True, logprobs=5)
    prompts = [shared + _toks(rng, 2), shared + _toks(rng, 9), shared + _toks(rng, 5)]  # hits at 40
    got = {}
    for eng in (on, off):
        outs = []
        for batch in ([prompts[0]], prompts[1:]):  # the first turn fills the cache
            rids = [eng.add_request(p, pen) for p in batch]
            outs += run_to_end(eng, rids, after_step=lambda: eng.runner.check_table(eng.requests))
        got[eng is on] = outs
    assert [o.token_ids for o in got[True]] == [o.token_ids for o in got[False]]
    assert all(o.cached_tokens > 0 for o in got[True][1:])
    a = np.array([[lp for lp, _ in o.logprobs] for o in got[True]])
    b = np.array([[lp for lp, _ in o.logprobs] for o in got[False]])
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
    on.check_invariants()
