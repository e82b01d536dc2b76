"""P/D handoff between two engines in one process (issue #16, ``server/engine/handoff.py``).

A prefill engine admits each request with ``export=True``: it computes the prompt, samples the
first token and hands over its KDA state, conv windows and MLA pages. A decode engine admits it
with ``admit_prefilled`` and continues. The decode's outputs must be token-identical to one
unified engine's — greedy, seeded sampling with penalties, logprobs — for prompts that end
inside a page, on a page boundary and across several pages, with the prefix cache on and a
second turn that hits both prefix caches (the decode then asks only for the pages past its
own cached prefix). A handoff whose KDA state is zeroed must change
the output (so the suite would see a state that was never sent). Nothing leaks on either side.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from _util import assert_all_free, golden, load_case, run_to_end
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams

CASE = "k3-tiny-a"
# as test_engine.py and test_grpc_server.py: the compiled programs are shared (conftest cache)
KW = dict(max_num_seqs=4, max_num_batched_tokens=40, chunk_size=16, page_size=16, max_model_len=128, num_pages=48,
          warmup=False)  # only the programs used are compiled


@pytest.fixture(scope="module")
def engines():
    from k3serve.server.engine.warm_programs import warm_small_programs

    m = load_case(CASE)
    engines = {name: Engine(m, pd_role=name, **KW) for name in ("unified", "prefill", "decode")}
    for eng in engines.values():  # the handoff's programs (not the steps): the serving warm-up's
        warm_small_programs(eng, eng.pd_role)
    return engines


def _small_programs(engines):
    """Compiles of every program but the steps and sampling (compiled lazily here)."""
    from k3serve.server.engine.cache import deal

    return deal.PROGRAMS.count, [{k: n for k, n in e.runner.programs.by_name.items() if k not in ("step", "sample")}
                                 for e in engines.values()]


def _prompts():
    g = golden(CASE)
    base = [list(map(int, g[f"input_ids_{i}"])) for i in range(3)]
    # lengths: inside a page, exactly two pages, several pages
    return [base[0][:13], (base[1] * 4)[:32], (base[1] + base[2]) * 2]


def _pd(engines, prompts, params, zero_state=False):
    pre, dec = engines["prefill"], engines["decode"]
    rids = [pre.admit(pre.validate(p, params), params, rid=f"p{i}", export=True) for i, p in enumerate(prompts)]
    outs = run_to_end(pre, rids)
    for o in outs:
        assert o.finished and o.finish_reason == "length" and len(o.token_ids) == 1 and o.handoff is not None
    drids = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        h = o.handoff
        assert h.first_token == o.token_ids[0] and h.prompt_len == len(p)
        if zero_state:
            state, conv, rows = h.arrays
            h = dataclasses.replace(h, arrays=(state * 0, conv, rows))
        drids.append(dec.admit_prefilled(dec.validate(p, params), params, h, rid=f"d{i}"))
    return outs, run_to_end(dec, drids)


def _unified(engines, prompts, params):
    eng = engines["unified"]
    return run_to_end(eng, [eng.add_request(p, params) for p in prompts])


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True, logprobs=3),
    SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, frequency_penalty=0.5),
], ids=["greedy-logprobs", "seeded-penalty"])
def test_decode_output_equals_unified(engines, params):
    prompts = _prompts()
    want = _unified(engines, prompts, params)
    small = _small_programs(engines)
    pre_outs, got = _pd(engines, prompts, params)
    assert _small_programs(engines) == small  # export, cuts, assemble, import: warm-up compiled them all
    for w, g, p in zip(want, got, pre_outs):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.token_ids[0] == p.token_ids[0]
        if params.logprobs:
            # fp32 noise: the decode side runs each position in a step of another row count than the
            # unified engine (XLA:CPU's reductions tile by it): a gap of 1.57e-5 was seen here
            np.testing.assert_allclose([lp for lp, _ in g.logprobs], [lp for lp, _ in w.logprobs], rtol=1e-5, atol=1e-5)
            assert [[i for i, _ in top] for _, top in g.logprobs] == [[i for i, _ in top] for _, top in w.logprobs]
    for eng in engines.values():
        assert_all_free(eng)


def test_second_turn_hits_both_prefix_caches(engines):
    """The second turn hits the prefill's prefix cache (it computes less) and the decode's
    (the decode maps the cached prefix's whole pages and asks only for the rest)."""
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    first = _prompts()[2]
    _, got1 = _pd(engines, [first], params)
    second = first + got1[0].token_ids + [5, 6, 7, 8, 9]
    want = _unified(engines, [second], params)
    dec = engines["decode"]
    hits, kv_hit = dec.prefix_cache.num_hits, dec.prefix_cache.kv_hit_tokens
    pre_outs, got = _pd(engines, [second], params)
    # the decode registered the first turn's cache as it finished; its whole pages are reused
    assert dec.prefix_cache.num_hits == hits + 1 and dec.prefix_cache.kv_hit_tokens - kv_hit >= 16, \
        (dec.prefix_cache.num_hits - hits, dec.prefix_cache.kv_hit_tokens - kv_hit)
    assert pre_outs[0].cached_tokens > 0 and pre_outs[0].handoff.cached_tokens == pre_outs[0].cached_tokens
    assert got[0].cached_tokens == pre_outs[0].cached_tokens
    assert got[0].token_ids == want[0].token_ids
    for eng in engines.values():
        assert_all_free(eng)


def test_zeroed_kda_state_changes_the_output(engines):
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    prompts = _prompts()
    want = _unified(engines, prompts, params)
    _, got = _pd(engines, prompts, params, zero_state=True)
    assert any(g.token_ids != w.token_ids for g, w in zip(got, want))
    assert_all_free(engines["decode"])


def test_first_token_can_finish_the_decode(engines):
    """max_new_tokens 1, or a first token that is a stop id: the decode finishes at once,
    taking no slot or page; an abort of a waiting prefilled request frees nothing it never had."""
    prompts = _prompts()[:1]
    params = SamplingParams(max_new_tokens=1, temperature=0)
    pre_outs, got = _pd(engines, prompts, params)
    assert got[0].token_ids == pre_outs[0].token_ids and got[0].finish_reason == "length"
    tok = pre_outs[0].token_ids[0]
    stop = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=[tok])
    _, got = _pd(engines, prompts, stop)
    assert got[0].token_ids == [tok] and got[0].finish_reason == "stop" and got[0].matched_stop == tok
    dec = engines["decode"]
    pre_outs2 = run_to_end(engines["prefill"], [engines["prefill"].admit(prompts[0], params, rid="pa", export=True)])
    dec.admit_prefilled(prompts[0], SamplingParams(max_new_tokens=5, temperature=0), pre_outs2[0].handoff, rid="da")
    assert dec.abort("da")
    run_to_end(dec, [])
    assert not dec.requests
    for eng in engines.values():
        assert_all_free(eng)


def test_reserve_then_deliver(engines):
    """The server's order: the decode queues the request without its handoff, reserves a slot
    and pages (``on_reserved``), and only then gets the handoff (``deliver``); the first token
    is output on the step after it. A reservation aborted before its handoff frees everything."""
    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    p = _prompts()[1]
    want = _unified(engines, [p], params)[0]
    pre, dec = engines["prefill"], engines["decode"]
    h = run_to_end(pre, [pre.admit(p, params, rid="pr", export=True)])[0].handoff
    reserved = []
    dec.admit_prefilled(p, params, rid="dr", on_reserved=reserved.append)
    dec.admit_prefilled(p, params, rid="dx", on_reserved=reserved.append)
    free_pages = dec.cache_mgr.num_free_pages
    outs = dec.step()
    assert reserved == ["dr", "dx"] and not outs
    assert dec.cache_mgr.num_free_pages == free_pages - 2 * (-(-(len(p) + 1) // KW["page_size"]))
    for _ in range(3):  # nothing runs while the handoff is away
        assert dec.step() == [] and dec.requests["dr"].num_computed == len(p)
    assert dec.abort("dx")
    assert dec.deliver("dr", h) and not dec.deliver("dx", h)
    outs = dec.step()
    assert [o.new_token_ids for o in outs if o.rid == "dr"] == [[h.first_token]]
    got = run_to_end(dec, ["dr"])[0]
    assert got.token_ids == want.token_ids
    assert_all_free(dec)


def test_handoff_is_checked(engines):
    from k3serve.server.engine.request import RequestError

    pre = engines["prefill"]
    p = _prompts()[0]
    h = run_to_end(pre, [pre.admit(p, SamplingParams(temperature=0), rid="pc", export=True)])[0].handoff
    with pytest.raises(RequestError, match="covers"):
        engines["decode"].admit_prefilled(p + [1], SamplingParams(), h, rid="dc")
    assert "dc" not in engines["decode"].requests


def test_min_tokens_and_stops_on_the_prefill_leg(engines):
    """smg sends the decode's settings to both legs: ``min_new_tokens`` above one and stop
    strings/ids must not break the 1-token export (issue #32). The prefill still honours
    ``min_new_tokens`` for its one token (the first token may not be a stop id), so P/D equals
    unified."""
    prompts = _prompts()[1:2]  # two pages exactly
    free = _unified(engines, prompts, SamplingParams(max_new_tokens=1, temperature=0))
    firsts = tuple(o.token_ids[0] for o in free)  # what each prompt would sample first unconstrained
    params = SamplingParams(max_new_tokens=9, min_new_tokens=3, temperature=0, stop=("zz",), stop_token_ids=firsts)
    want = _unified(engines, prompts, params)
    pre_outs, got = _pd(engines, prompts, params)
    for w, g, p, f in zip(want, got, pre_outs, firsts):
        assert p.token_ids[0] != f  # suppressed on the prefill, as on the unified engine
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
    for eng in engines.values():
        assert_all_free(eng)


def test_a_failing_reservation_callback_ends_only_its_request(engines):
    """``on_reserved`` runs after the step: one that raises aborts its request (the error kept
    for the caller) and the engine is not broken."""
    dec = engines["decode"]
    params = SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)
    p = _prompts()[0]

    def boom(rid):
        raise RuntimeError("the pull pool is shut down")

    dec.admit_prefilled(p, params, rid="cb-bad", on_reserved=boom)
    ok = dec.add_request(p, params, rid="cb-ok")
    outs = {o.rid: o for o in run_to_end(dec, ["cb-bad", "cb-ok"])}
    assert dec.broken is None and isinstance(dec.callback_errors.pop("cb-bad"), RuntimeError)
    assert outs["cb-bad"].finish_reason == "abort" and len(outs[ok].token_ids) == 3
    assert_all_free(dec)


class _ByteVocab:
    """A tokenizer for grammars over the test model's 512 ids: ids 0..255 are their byte, the
    rest control tokens (no bytes)."""

    vocab_size = 512
    special_tokens: dict = {}

    def is_special(self, i):
        return i >= 256

    def token_bytes(self, i):
        return bytes([i]) if i < 256 else b""


@pytest.mark.skipif(not __import__("k3serve.server.structured.xgrammar_native", fromlist=["x"]).available(),
                    reason="xgrammar is not installed")
def test_a_grammar_travels_with_the_handoff(engines):
    """The prefill leg samples the first token under the grammar, the decode side's matcher
    takes it from the handoff and goes on: the output equals the unified engine's and matches;
    the first token's ``token_ids_logprob`` row rides on the handoff."""
    import re

    params = SamplingParams(max_new_tokens=12, temperature=0, regex="[a-f]{3}-[0-9]{2}", token_ids_logprob=(97, 48))
    try:
        for eng in engines.values():
            eng.tokenizer, eng._grammars = _ByteVocab(), None
        prompts = _prompts()
        want = _unified(engines, prompts, params)
        _, got = _pd(engines, prompts, params)
    finally:
        for eng in engines.values():
            eng.tokenizer, eng._grammars = None, None
    eos = engines["unified"].model.config.eos_token_id
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == "stop" and g.token_ids[-1] == eos
        # token_ids_logprob: a row per output token, the first carried by the handoff
        assert len(g.id_logprobs) == len(g.token_ids) and [i for i, _ in g.id_logprobs[0]] == [97, 48]
        np.testing.assert_allclose([v for r in g.id_logprobs for _, v in r], [v for r in w.id_logprobs for _, v in r],
                                   rtol=1e-5, atol=1e-5)
        assert re.fullmatch("[a-f]{3}-[0-9]{2}", bytes(g.token_ids[:-1]).decode()), g.token_ids
    for eng in engines.values():
        assert_all_free(eng)
