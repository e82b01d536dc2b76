"""The engine against the model's own greedy decode and the golden continuations:
continuous batching, chunked prefill, page sizes, forced preemption, no recompiles after
warm-up, no page or slot leaks, stops, aborts and seeded sampling."""
from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from _util import assert_all_free, golden, load_case, run_to_end
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams

CASE = "k3-tiny-a"


def _prompts():
    g = golden(CASE)
    base = [list(map(int, g[f"input_ids_{i}"])) for i in range(3)]
    expect = [list(map(int, g[f"gen_tokens_{i}"])) for i in range(3)]
    return base, expect


def _run(engine, prompts, params):
    return run_to_end(engine, [engine.add_request(p, params) for p in prompts])


@pytest.fixture(scope="module")
def engine_a():
    return Engine(load_case(CASE), max_num_seqs=4, max_num_batched_tokens=40, chunk_size=16, page_size=16,
                  max_model_len=128, num_pages=48)


def test_batched_greedy_equals_golden_and_model(engine_a):
    eng = engine_a
    compiles = eng.stats()["num_compiles"]
    base, expect = _prompts()
    m = load_case(CASE)
    # 33 to 36 tokens, so that ``m.greedy`` compiles one prefill (64 tokens, 4 pages) and one
    # decode program for all three, the ones test_golden's sequence 0 uses (the session's
    # compile cache holds them when both run); each still takes three chunks in the engine
    extra = [base[0][:35], base[1] + base[2] + base[0][:16], base[0][5:38]]
    assert all(32 < len(p) <= 64 - 12 for p in extra)
    want = expect + [m.greedy(p, 12) for p in extra]
    outs = _run(eng, base + extra, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    for o, w in zip(outs, want):
        assert o.token_ids == w and o.finish_reason == "length" and o.completion_tokens == 12
    # mixed traffic after warm-up compiled nothing new
    assert eng.stats()["num_compiles"] == compiles
    assert_all_free(eng)


_LOWERINGS = [0, False]  # XLA programs lowered while counting (every compile, counted or not)


def _on_event(event, _secs, **_):
    if _LOWERINGS[1] and event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _LOWERINGS[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def test_no_compile_after_warmup_with_prefix_copies_penalties_and_host_reload(engine_a):
    """After warm-up, a workload that takes every small program — a prefix hit mid-page (a
    page copy), penalties (the token-table row), an evicted prefix reloaded from the host tier
    (read, load, and a slot copy onto a snapshot) — lowers no XLA program at all, and
    ``num_compiles`` counts each program warm-up made, by kind."""
    eng = engine_a
    by_name = dict(eng.runner.programs.by_name)
    page_width = eng.runner.page_width  # 128 / 16 = 8 pages: 1, 2, 4, 8
    assert by_name["cache_read"] == by_name["cache_load"] == 4 and by_name["table_row"] == 1
    assert by_name["cache_pages"] == by_name["cache_slots"] == len(eng.cache_mgr.copy_widths) == 2  # 1, 4
    assert eng.stats()["num_compiles"] == eng.runner.programs_for(eng.runner.shape_buckets()) == sum(by_name.values())
    assert page_width == 8
    compiles, st0, inits = eng.stats()["num_compiles"], eng.stats(), eng.runner.table_inits
    base, _ = _prompts()
    p = (base[0] + base[1])[:45]
    pen = SamplingParams(max_new_tokens=3, temperature=0.7, seed=3, repetition_penalty=1.3, ignore_eos=True)
    _LOWERINGS[:] = [0, True]
    try:
        eng.flush_prefix_cache()
        _run(eng, [p], pen)
        _run(eng, [p + base[2][:5]], pen)  # a device hit at 40 tokens: page 2 of 16 is copied
        while eng.prefix_cache.index.evict_one():  # offloaded to the host tier
            pass
        _run(eng, [p + base[2][5:9], p[:44] + [3]], pen)  # a host reload, then a device hit
    finally:
        _LOWERINGS[1] = False
    st = eng.stats()
    assert st["prefix_host_reloads"] > st0["prefix_host_reloads"] and eng.cache_mgr.num_copies > 0, st
    assert eng.runner.table_inits > inits
    assert st["num_compiles"] == compiles
    # a program jax lowers again for inputs that differ from warm-up's in more than shape (an
    # uncommitted cache after a step: ``manager.committed``) is seen here, not in the count
    assert _LOWERINGS[0] == 0, f"{_LOWERINGS[0]} programs lowered after warm-up"
    assert_all_free(eng)


def test_token_table_has_a_row_for_every_request_slot_under_attention_dp():
    """Review finding 11: under attention DP (dp=2) with max_num_seqs=3 the cache holds
    dp * ceil(3 / 2) = 4 request slots, so 4 requests can run at once (a step carries at most
    3 rows, but a running request without a row this step keeps its slot and table row).
    Each of them gets a token-table row; a table of max_num_seqs rows was full at the 4th.
    Host bookkeeping and the one-row write program only: no model step is compiled."""
    from k3serve.server.engine.cache import CacheManager, plan_capacity
    from k3serve.server.engine.request import Request
    from k3serve.server.engine.runner import Runner

    model = load_case(CASE)
    plan = plan_capacity(model.config, page_size=16, dtype=model.dtype, max_num_seqs=3, num_pages=8, dp=2)
    mgr = CacheManager(model.config, plan, model.dtype, allocate=False)
    runner = Runner(model, mgr, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=64)
    pen = SamplingParams(max_new_tokens=2, repetition_penalty=1.3)
    rids = [f"r{i}" for i in range(8) if mgr.admit(f"r{i}")]
    assert len(rids) == plan.max_concurrent_slots == 4
    rows = [runner._init_row(Request([1, 2, 3], pen, rid=rid)) for rid in rids]
    assert sorted(rows) == [1, 2, 3, 4]


def test_preemption_with_tiny_page_budget():
    """8-token pages, 2 rows, 9 pages in all: requests preempt each other and recompute,
    and every output still equals the golden greedy continuation. Only the token buckets
    used are compiled (no warm-up, to save time): a step program per bucket and a sampling
    program per row count, whatever the context length."""
    base, expect = _prompts()
    eng = Engine(load_case(CASE), max_num_seqs=2, max_num_batched_tokens=24, chunk_size=8, page_size=8,
                 max_model_len=64, num_pages=9, warmup=False)
    outs = _run(eng, base, SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expect
    assert eng.stats()["num_preemptions"] > 0
    # a re-admission after preemption is not a new prefix-cache query
    assert eng.stats()["prefix_query_tokens"] == sum(map(len, base))
    assert eng.scheduler.running == [] and eng.scheduler.waiting == []
    assert_all_free(eng)
    assert eng.runner.shape_buckets() == [1, 2, 16, 24]
    used = eng.runner.buckets_used
    programs = eng.runner.programs.by_name
    assert programs["step"] + programs["sample"] == eng.runner.programs_for(used) == len(used) + len({min(2, b) for b in used})


def test_stops_abort_and_bad_input(engine_a):
    eng = engine_a
    base, expect = _prompts()
    # stop on the 3rd greedy token of prompt 0
    stop = expect[0][2]
    out = _run(eng, [base[0]], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop]))[0]
    assert out.token_ids == expect[0][:3] and out.finish_reason == "stop" and out.matched_stop == stop
    # abort one request mid-prefill and one mid-decode: each reports once, and its pages and
    # slot come back (the cache is flushed first, so no prefix hit changes the phases)
    eng.flush_prefix_cache()
    rid = eng.add_request(base[1], SamplingParams(max_new_tokens=50, temperature=0))
    other = eng.add_request(base[2], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
    finals = {}

    def step():
        for o in eng.step():
            if o.finished:
                assert o.rid not in finals, f"{o.rid} reported twice"
                finals[o.rid] = o

    step()
    req = eng.requests[rid]
    assert 0 < req.num_computed < len(req.prompt) and req.num_generated == 0  # mid-prefill
    assert eng.abort(rid)
    dec = eng.add_request(base[0], SamplingParams(max_new_tokens=50, temperature=0))
    while len(eng.requests[dec].output) < 2:
        step()
    req = eng.requests[dec]
    assert req.num_computed > len(req.prompt) and not req.finished  # mid-decode
    assert eng.abort(dec)
    for _ in range(100):
        if not eng.has_unfinished() and rid in finals and dec in finals:
            break
        step()
    assert finals[rid].finish_reason == "abort" and finals[rid].token_ids == []
    assert finals[dec].finish_reason == "abort" and finals[dec].token_ids == expect[0][:len(finals[dec].token_ids)]
    assert len(finals[dec].token_ids) >= 2
    assert finals[other].token_ids == expect[2]
    assert_all_free(eng)
    with pytest.raises(ValueError, match="99999"):
        eng.add_request([1, 99999])
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request([1] * 200)
    assert_all_free(eng)


def test_seeded_sampling_is_independent_of_batch_company(engine_a):
    eng = engine_a
    base, _ = _prompts()
    p = SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True, logprobs=3)
    alone = _run(eng, [base[0]], p)[0]
    noisy = SamplingParams(max_new_tokens=6, temperature=1.3, seed=7, ignore_eos=True)
    rids = [eng.add_request(base[1], noisy), eng.add_request(base[0], p), eng.add_request(base[2], noisy)]
    assert run_to_end(eng, rids)[1].token_ids == alone.token_ids
    assert len(alone.logprobs) == 8 and all(len(top) == 3 for _, top in alone.logprobs)
    lp0, top0 = alone.logprobs[0]
    assert lp0 <= 0 and top0[0][1] >= top0[-1][1]
    assert_all_free(eng)


def test_async_scheduling_overlaps_and_matches_sync(engine_a):
    """Async mode launches step N+1 before reading step N, feeds decode inputs and penalty
    histories from the device, and yields exactly what the synchronous engine yields —
    penalties, seeds, logprobs, stop tokens and length finishes included."""
    eng = engine_a
    base, expect = _prompts()
    pen = SamplingParams(max_new_tokens=10, temperature=0.8, seed=99, repetition_penalty=1.4,
                         frequency_penalty=0.7, presence_penalty=0.3, ignore_eos=True, logprobs=2)
    greedy_stop = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[expect[1][4]])
    # a repetition penalty < 1 boosts what a greedy row just produced: a stale history (the
    # pending token missing from it) in async mode shows at once
    boost = SamplingParams(max_new_tokens=8, temperature=0, repetition_penalty=0.02, ignore_eos=True)
    prompts, params = [base[0], base[1], base[2], base[2]], [pen, greedy_stop, pen, boost]
    results = {}
    events = []
    from k3serve.server.engine import runner as runner_mod

    orig_launch, orig_result = runner_mod.Runner.launch, runner_mod.InFlight.result

    def spy_launch(self, rows, prev=None, snaps=()):
        f = orig_launch(self, rows, prev, snaps)
        events.append(("launch", f.step))
        return f

    def spy_result(self):
        events.append(("result", self.step))
        return orig_result(self)

    runner_mod.Runner.launch, runner_mod.InFlight.result = spy_launch, spy_result
    try:
        for mode in (False, True):
            eng.async_scheduling = mode
            eng.flush_prefix_cache()  # both modes compute the same prompts from scratch
            events.clear()
            results[mode] = run_to_end(eng, [eng.add_request(p, sp) for p, sp in zip(prompts, params)])
            launches = [s for e, s in events if e == "launch"]
            first_results = [events.index(("result", s)) for s in launches[:-1]]
            if mode:  # every step but the last was launched before the previous one was read
                assert all(events.index(("launch", s + 1)) < i for s, i in zip(launches, first_results))
            else:
                assert all(events.index(("launch", s + 1)) > i for s, i in zip(launches, first_results))
    finally:
        runner_mod.Runner.launch, runner_mod.InFlight.result = orig_launch, orig_result
        eng.async_scheduling = True
    sync, asyn = results[False], results[True]
    for a, b in zip(sync, asyn):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert np.allclose([lp for lp, _ in a.logprobs or []], [lp for lp, _ in b.logprobs or []], atol=1e-5)
    assert asyn[1].token_ids == expect[1][:5] and asyn[1].finish_reason == "stop"
    assert asyn[3].token_ids != expect[2][:8] and len(set(asyn[3].token_ids)) < 8
    # the penalties did act: the penalized stream differs from the plain seeded one
    plain = _run(eng, [base[0]], SamplingParams(max_new_tokens=10, temperature=0.8, seed=99, ignore_eos=True))[0]
    assert plain.token_ids != asyn[0].token_ids
    assert_all_free(eng)


def test_refused_inputs_and_request_ids(engine_a):
    """Float ids, logprobs above the engine's max_logprobs and duplicate live ids are refused
    (a ``RequestError``, nothing changes); generated ids never collide with a caller's."""
    from k3serve.server.engine import request as request_mod
    from k3serve.server.engine.request import RequestError

    eng = engine_a
    base, _ = _prompts()
    for bad in ([1.5, 2], [1.0, 2.0], np.array([1.0, 2.0]), [True, 3], "abc", [[1, 2]]):
        with pytest.raises(RequestError, match="integer token ids"):
            eng.add_request(bad)
    few = Engine(load_case(CASE), max_num_seqs=4, max_num_batched_tokens=40, chunk_size=16, page_size=16,
                 max_model_len=128, num_pages=48, max_logprobs=2, warmup=False)
    with pytest.raises(RequestError, match="max_logprobs"):
        few.add_request(base[0], SamplingParams(logprobs=3))
    assert few.requests == {}
    rids = [eng.add_request(np.array(base[0][:5], dtype=np.int32), SamplingParams(max_new_tokens=2))]
    # a caller names its request as the engine would name the next one: no collision
    n = next(request_mod._ids)
    rids.append(eng.add_request(base[1], SamplingParams(max_new_tokens=2), rid=f"req-{n + 2}"))
    rids.append(eng.add_request(base[2], SamplingParams(max_new_tokens=2)))
    assert len(set(rids)) == 3 and set(rids) <= eng.requests.keys()
    with pytest.raises(RequestError, match="already in use"):
        eng.add_request(base[0], rid=rids[1])
    for r in rids:
        assert eng.abort(r)
    while eng.has_unfinished() or eng.requests:
        eng.step()
    assert_all_free(eng)


def test_recipe_leaves_the_callers_model_alone():
    import jax

    m = load_case(CASE)
    params = m.params
    eng = Engine(m, max_num_seqs=2, max_num_batched_tokens=40, chunk_size=16, page_size=16, max_model_len=64,
                 recipe="single", devices=jax.devices()[:1], warmup=False)
    assert m.params is params and eng.model is not m


@pytest.fixture(scope="module")
def demo_tok(tmp_path_factory):
    from k3serve.server.text.demo_tokenizer import write_demo_tokenizer
    from k3serve.server.text.tokenizer import load_tokenizer

    d = tmp_path_factory.mktemp("demo_tok")
    write_demo_tokenizer(d)
    return load_tokenizer(d)


def test_stop_strings_through_the_incremental_detokenizer(engine_a, demo_tok):
    """Stop strings, matched on the incremental detokenizer's tail (no whole-output decode):
    the request stops at the token that completes the string, keeps that token (SGLang keeps
    it in ``output_ids``; trimming the text is the detokenizing side's job), reports the string
    in ``matched_stop``, and async == sync. A string spanning three tokens is found although
    each step decodes only its own token; one wholly inside the first ``min_new_tokens``
    tokens is not a stop."""
    eng = engine_a
    base, expect = _prompts()
    ids = expect[1]
    d = demo_tok.detokenizer()
    pieces = [d.add([t]) for t in ids]
    ends = np.cumsum([len(p) for p in pieces])  # text length after each token
    # a stop string from the last char of token j-2's text through the first char of token j's
    j = next(j for j in range(3, len(ids)) if all(pieces[j - k] for k in range(3)) and
             "".join(pieces[:j]).find(pieces[j - 2][-1] + pieces[j - 1] + pieces[j][0]) < 0)
    full = "".join(pieces)
    stop = full[ends[j - 2] - 1: ends[j - 1] + 1]
    k = next(k for k in range(1, len(ids) + 1) if stop in full[:ends[k - 1]])
    assert k == j + 1 and len(stop) >= 3
    early = pieces[0]  # the first token's text: before min_new_tokens, so not a stop
    eng.detokenizer = demo_tok.detokenizer
    try:
        for mode in (True, False):
            eng.async_scheduling = mode
            p = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop=["\x00nope", stop])
            out = _run(eng, [base[1]], p)[0]
            assert out.token_ids == ids[:k] and out.finish_reason == "stop" and out.matched_stop == stop, mode
            assert out.completion_tokens == k
            if early and "".join(pieces[:k + 2]).find(early, 1) < 0:
                p = SamplingParams(max_new_tokens=k + 2, temperature=0, ignore_eos=True, stop=[early],
                                   min_new_tokens=2)
                out = _run(eng, [base[1]], p)[0]
                assert out.token_ids == ids[:k + 2] and out.finish_reason == "length", mode
    finally:
        eng.detokenizer = None
        eng.async_scheduling = True
    assert_all_free(eng)


def test_penalty_token_table_is_rebuilt_after_preemption():
    """Penalties and suppression read per-request token tables on the device, counted by the
    steps themselves. Under forced preemption (rows dropped and re-admitted) every table row
    equals the one built from the request's host tokens after every step, rows are rebuilt
    at re-admission, and penalized greedy outputs equal those of a run that never
    preempts (the same engine running each request alone). Same shapes as the tiny-budget
    test above (compiled programs are shared)."""
    base, _ = _prompts()
    params = [SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.5, frequency_penalty=0.5,
                             ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=0, presence_penalty=1.2, min_new_tokens=10,
                             stop_token_ids=[1, 2, 3]),
              SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=0.5, ignore_eos=True)]
    eng = Engine(load_case(CASE), max_num_seqs=2, max_num_batched_tokens=24, chunk_size=8, page_size=8,
                 max_model_len=64, num_pages=9, warmup=False)

    def run(batch):
        rids = [eng.add_request(p, sp) for p, sp in batch]
        outs = run_to_end(eng, rids, after_step=lambda: eng.runner.check_table(eng.requests))
        return [o.token_ids for o in outs]

    outs = {"tiny": run(list(zip(base, params)))}
    assert eng.stats()["num_preemptions"] > 0
    assert eng.runner.table_inits > len(base)  # rebuilt at re-admission
    pre = eng.stats()["num_preemptions"]
    outs["roomy"] = [run([(p, sp)])[0] for p, sp in zip(base, params)]  # one at a time: never preempted
    assert eng.stats()["num_preemptions"] == pre
    assert not eng.runner._table_row and len(eng.runner._table_free) == 2
    assert_all_free(eng)
    assert outs["tiny"] == outs["roomy"]
    assert all(len(o) >= 10 for o in outs["tiny"])


class _FakeEngine:
    """What ``EngineThread`` calls of an engine, host only: a request finishes on the first step
    after it was admitted (a P/D decode: after its handoff); ``raises`` maps a request id to the
    exception its submit / deliver / abort raises."""

    def __init__(self, raises=None, busy=False):
        from k3serve.server.engine.request import RequestOutput

        self.Out, self.raises, self.busy = RequestOutput, dict(raises or {}), busy
        self.requests, self.done, self.num_steps, self.num_preemptions, self.callback_errors = {}, [], 0, 0, {}

    def _maybe_raise(self, rid, what):
        if self.raises.get(rid, (None,))[0] == what:
            raise self.raises[rid][1]

    def validate(self, prompt, params=None):
        return list(prompt)

    def admit(self, ids, params=None, *, rid, export=False, **kw):
        self._maybe_raise(rid, "submit")
        self.requests[rid] = False  # awaiting a handoff?
        return rid

    def admit_prefilled(self, ids, params=None, *, rid, on_reserved=None, **kw):
        self._maybe_raise(rid, "submit")
        self.requests[rid] = True
        return rid

    def deliver(self, rid, handoff):
        self._maybe_raise(rid, "deliver")
        self.requests[rid] = False
        return True

    def abort(self, rid):
        self._maybe_raise(rid, "abort")
        if self.requests.pop(rid, None) is None:
            return False
        self.done.append(rid)
        return True

    def has_unfinished(self):
        return self.busy or any(not w for w in self.requests.values())

    def has_owed_outputs(self):
        return bool(self.done)

    def step(self):
        outs = [self.Out(r, [], [], True, "abort", None, 1, 0) for r in self.done]
        self.done = []
        for rid in [r for r, w in self.requests.items() if not w]:
            del self.requests[rid]
            self.num_steps += 1
            outs.append(self.Out(rid, [7], [7], True, "length", None, 1, 1))
        return outs

    def stats(self):
        return {}


def test_engine_thread_fails_only_the_message_that_raised():
    """A submit, deliver or abort whose engine call raises (not a RequestError: a bug, e.g.
    the P/D prefill's ``min_new_tokens`` clamp of issue #32) fails its own request with
    INTERNAL; the thread, and every other request, go on."""
    from k3serve.server.api.engine_thread import EngineThread
    from k3serve.server.engine.request import RequestError

    eng = _FakeEngine(raises={"s": ("submit", ValueError("min_new_tokens > max_new_tokens")),
                              "d": ("deliver", KeyError("slot")), "a": ("abort", RuntimeError("pool"))})
    loop = EngineThread(eng)
    try:
        bad = {r: loop.submit([1, 2], rid=r, **({"on_reserved": print} if r != "s" else {})) for r in "sda"}
        t = time.monotonic() + 10
        while not (bad["a"].admitted and bad["d"].admitted) and time.monotonic() < t:
            time.sleep(0.01)  # else the abort never reaches the engine
        loop.deliver("d", object())
        bad["a"].abort()
        for r, h in bad.items():
            with pytest.raises(RequestError) as e:
                list(h.outputs())
            assert e.value.code == "INTERNAL" and f"request {r!r} failed" in str(e.value), e.value
        good = loop.submit([1, 2], rid="ok")
        assert [o.token_ids for o in good.outputs()] == [[7]]
        assert loop.error is None and loop.accepting and set(eng.requests) == {"a"}  # "a" could not be aborted
    finally:
        loop.stop()


def test_engine_thread_waits_for_messages_while_nothing_can_move():
    """Every slot held by P/D reservations waiting for their handoffs, requests queued: the
    engine has work but a step moves nothing. The thread then waits on its inbox (a message
    wakes it at once) instead of stepping in a busy loop (issue #32)."""
    from k3serve.server.api.engine_thread import EngineThread

    eng = _FakeEngine(busy=True)
    loop = EngineThread(eng)
    try:
        time.sleep(0.2)
        n0 = loop.num_steps
        time.sleep(1.0)
        steps = loop.num_steps - n0
        assert steps < 100, f"{steps} empty steps in a second"
        t = time.monotonic()
        h = loop.submit([1], rid="wake")
        assert [o.token_ids for o in h.outputs()] == [[7]] and time.monotonic() - t < 0.5
    finally:
        loop.stop()
