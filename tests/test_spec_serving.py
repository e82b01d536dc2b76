"""Speculative decoding where it is served: over gRPC with the golden K3 model, a P/D handoff
into a speculative decode engine, under recipes on 4 virtual devices (a child process each).
The engine-level checks and the oracle drafter are ``test_spec_engine.py``'s; this module is
separate so that the two run on different test workers."""
from __future__ import annotations

from _util import load_case
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams
from test_spec_engine import K, OracleDrafter, _plain, _prompts


def test_grpc_golden_with_speculation():
    """Over gRPC (the smg stubs): the golden K3 model's greedy tokens with an oracle drafter that
    injects wrong tokens; GenerateComplete's draft counts, GetServerInfo's speculative settings,
    GetLoads' acceptance, the Prometheus histogram."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    from _util import collect_generate, golden
    from test_grpc_server import CASE, Served, _req

    g = golden(CASE)
    prompts = [list(map(int, g[f"input_ids_{i}"])) for i in range(3)]
    expect = [list(map(int, g[f"gen_tokens_{i}"])) for i in range(3)]
    model = load_case(CASE)
    drafter = OracleDrafter({tuple(p): e + [0] * K for p, e in zip(prompts, expect)}, model.config.vocab_size)
    eng = Engine(model, max_num_seqs=4, max_num_batched_tokens=40, chunk_size=16, page_size=16, max_model_len=128,
                 num_pages=48, warmup=False, bucket_growth=16,
                 speculative={"method": "oracle-test", "num_speculative_tokens": K}, drafter=drafter)
    s = Served(eng)
    try:
        for i in range(3):
            chunks, done = collect_generate(s.stub, _req(prompts[i], rid=f"s{i}"))
            assert list(done.output_ids) == expect[i] == [t for c in chunks for t in c.token_ids]
            assert done.spec_draft_tokens > 0 and 0 < done.spec_accepted_tokens <= done.spec_draft_tokens
        si = s.stub.GetServerInfo(pb.GetServerInfoRequest())
        assert si.server_args["speculative_algorithm"] == "oracle-test"
        assert si.server_args["speculative_num_draft_tokens"] == K
        spec = s.stub.GetLoads(pb.GetLoadsRequest()).loads[0].speculative
        assert 1.5 < spec.accept_length <= K + 1 and 0.3 < spec.accept_rate <= 1.0
        from prometheus_client import generate_latest

        text = generate_latest(s.metrics.registry).decode()
        assert f'k3serve_spec_accepted_drafts_bucket{{le="{K}"}}' in text and "k3serve_spec_draft_tokens_total" in text
    finally:
        s.close()


def test_pd_handoff_into_a_speculative_decode():
    """A plain prefill engine hands its requests over to a speculative decode engine: the tokens
    equal one unified plain engine's (the decode's first verify rows start from the imported
    state; nothing is pending to fold at a handoff because the prefill leg never speculates)."""
    from _util import run_to_end
    from k3serve.server.engine.warm_programs import warm_small_programs

    model = load_case("k3-tiny-a")
    V = model.config.vocab_size
    kw = dict(max_num_seqs=4, max_num_batched_tokens=40, chunk_size=16, page_size=16, max_model_len=128,
              num_pages=48, warmup=False, bucket_growth=16)
    prompts = _prompts(V)
    params = SamplingParams(max_new_tokens=20, temperature=0.0)
    plain = _plain(model, prompts, params)
    pre = Engine(model, pd_role="prefill", **kw)
    drafter = OracleDrafter({tuple(p): o[0] + [0] * K for p, o in zip(prompts, plain)}, V)
    dec = Engine(model, pd_role="decode", speculative={"num_speculative_tokens": K}, drafter=drafter, **kw)
    for e in (pre, dec):
        warm_small_programs(e, e.pd_role)
    rids = [pre.admit(pre.validate(p, params), params, rid=f"p{i}", export=True) for i, p in enumerate(prompts)]
    outs = run_to_end(pre, rids)
    drids = [dec.admit_prefilled(dec.validate(p, params), params, o.handoff, rid=f"d{i}")
             for i, (p, o) in enumerate(zip(prompts, outs))]
    got = run_to_end(dec, drids)
    assert [o.token_ids for o in got] == [p[0] for p in plain]
    assert dec.stats()["spec_accepted_tokens"] > 0
    for e in (pre, dec):
        e.check_invariants()
        assert e.cache_mgr.num_free_slots == e.capacity_plan.max_concurrent_slots


def test_under_recipes():
    """On 4 virtual devices, one child process per recipe, side by side: EP2 x TP2 with DCP2
    (experts exchanged, KDA heads and the journal split over TP, MLA pages dealt over DCP
    ranks) and attention DP2 x DCP2 (each group's requests journal in the group's block of
    entries): speculation equals plain decoding under the same recipe. DSpark under the second
    (attention DP with DCP: its context rows in each group's pages, written and attended per DCP
    rank): its tokens, and each block proposed equal to one device's (the first child, whose
    recipe runs no DSpark, computes one device's blocks: the two children take about as long)."""
    import os

    from _util import run_children

    here = os.path.dirname(os.path.abspath(__file__))
    recipes = ["ep=2,tp=2,dcp=2", "ep=4,tp=1,dp=2,dcp=2"]
    children = [{"case": "k3-tiny-a", "recipes": [recipes[0]], "dspark": [None]},
                {"case": "k3-tiny-a", "recipes": [recipes[1]], "dspark": [recipes[1]]}]
    res = run_children(os.path.join(here, "_spec_recipe_check.py"), [], children, 4, timeout=1500)
    for r in recipes:
        assert res[r]["equal"] and res[r]["accepted"] > 0, (r, res[r])
    assert res["ep=4,tp=1,dp=2,dcp=2"]["groups"] == [0, 1], res  # both DP groups speculated at once
    # DSpark under each recipe: plain decoding's tokens, and every block it proposed (context rows
    # written and attended per DCP rank, the taps gathered from the recipe's step) is the block
    # one device proposed after the same sequence
    ref = res["dspark one device"]
    one = {tuple(seq): block for seq, block in ref["blocks"]}
    assert len(one) >= 16 and ref["equal"]
    for r in recipes[1:]:
        ds = res[f"dspark {r}"]
        assert ds["equal"] and ds["drafts"] == ref["drafts"] > 0, (r, ds["drafts"])
        assert ds["accepted"] == ref["accepted"], r
        got = {tuple(seq): block for seq, block in ds["blocks"]}
        assert got == one, r
