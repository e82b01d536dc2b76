"""P/D through the gRPC surface, in one process: a prefill server, a decode server and a
unified one (three engines), with the test in smg's place — one identical GenerateRequest
(same id, same ``disaggregated_params``) sent to both legs at once, the client reading the
decode leg and the prefill leg to its end (issue #16). The router itself is in
``test_pd_smg.py``.
"""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from _util import DATA, assert_all_free, collect_generate as _collect, golden, load_case
from k3serve.server.api.engine_thread import EngineThread
from k3serve.server.api.grpc_service import GrpcServer, Servicer
from k3serve.server.engine.engine import Engine
from k3serve.server.pd.decode import DecodeSide
from k3serve.server.pd.prefill import PrefillSide

CASE = "k3-tiny-a"
SECRET = b"test-cluster-secret-0123456789"  # both sides share it: every handoff here is authenticated


def _engine():  # as test_engine.py / test_grpc_server.py: the compiled programs are shared
    return Engine(load_case(CASE), max_num_seqs=4, max_num_batched_tokens=40, chunk_size=16, page_size=16,
                  max_model_len=128, num_pages=48, warmup=False)


class Server:
    def __init__(self, role: str, bootstrap_port: int = 0, wait_s: float = 30.0):
        self.loop = EngineThread(_engine())
        self.servicer = Servicer(model_dir=DATA / CASE)
        self.server = GrpcServer(self.servicer, host="127.0.0.1", port=0)
        self.side = None
        if role == "prefill":
            self.side = self.servicer.pd_prefill = PrefillSide(self.loop.engine, host="127.0.0.1", secret=SECRET,
                                                               bootstrap_port=bootstrap_port, wait_s=wait_s, stage_s=20)
        elif role == "decode":
            self.side = self.servicer.pd_decode = DecodeSide(self.loop.engine, await_s=30, transfer_s=20, secret=SECRET)
        self.server.set_ready(self.loop)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)

    def check_free(self):
        self.loop.call(assert_all_free, timeout=30)

    def close(self):
        self.channel.close()
        self.server.shutdown(grace_s=5)
        if self.side is not None:
            self.side.stop()


@pytest.fixture(scope="module")
def pd():
    servers = {"unified": Server("unified"), "prefill": Server("prefill"), "decode": Server("decode")}
    yield servers
    for s in servers.values():
        s.close()


def _req(ids, rid, max_new=8, stream=True, room=None, port=None, logprobs=None, **sp):
    sp.setdefault("ignore_eos", True)
    extra = sp.pop("custom_params", None)
    r = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
                           sampling_params=pb.SamplingParams(max_new_tokens=max_new, **sp))
    if extra:
        r.sampling_params.custom_params.update(extra)
    if logprobs is not None:
        r.return_logprob, r.top_logprobs_num = True, logprobs
    if room is not None:
        r.disaggregated_params.CopyFrom(pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=port,
                                                               bootstrap_room=room))
    return r


def _dual(pd, req):
    """smg's parallel dispatch: both legs at once; returns (prefill leg, decode leg)."""
    box = {}

    def leg(name):
        try:
            box[name] = _collect(pd[name].stub, req)
        except grpc.RpcError as e:
            box[name] = e

    ts = [threading.Thread(target=leg, args=(n,)) for n in ("decode", "prefill")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    return box["prefill"], box["decode"]


def _prompts():
    g = golden(CASE)
    base = [list(map(int, g[f"input_ids_{i}"])) for i in range(3)]
    return [base[0][:13], (base[1] * 4)[:32], (base[1] + base[2]) * 2]  # in a page, two pages, three


@pytest.mark.parametrize("stream,sp", [(True, dict(temperature=0)),
                                       (False, dict(temperature=0.8, top_p=0.9, frequency_penalty=0.3))],
                         ids=["stream-greedy", "unary-seeded"])
def test_pd_equals_unified(pd, stream, sp):
    sp = dict(sp)
    for i, ids in enumerate(_prompts()):
        if sp.get("temperature"):
            sp["custom_params"] = {"seed": 11 + i}
        rid = f"pd-{stream}-{sp.get('temperature')}-{i}"
        want = _collect(pd["unified"].stub, _req(ids, rid, stream=stream, logprobs=2, **sp))[1]
        (pchunks, pdone), (dchunks, ddone) = _dual(pd, _req(ids, rid, stream=stream, logprobs=2,
                                                            room=random.getrandbits(31), port=pd["prefill"].side.port, **sp))
        assert pdone.finish_reason == "length" and list(pdone.output_ids) == list(want.output_ids[:1])
        assert list(ddone.output_ids) == list(want.output_ids) and ddone.finish_reason == want.finish_reason
        assert ddone.prompt_tokens == len(ids) and ddone.completion_tokens == len(want.output_ids)
        got_lp, want_lp = ddone.output_logprobs, want.output_logprobs
        assert list(got_lp.token_ids) == list(want_lp.token_ids)
        assert max(abs(a - b) for a, b in zip(got_lp.token_logprobs, want_lp.token_logprobs)) < 1e-5
        if stream:  # the decode streams the prefill's first token as its own first chunk
            assert list(dchunks[0].token_ids)[:1] == list(want.output_ids[:1])
            assert sum((list(c.token_ids) for c in dchunks), []) == list(want.output_ids)
    for s in pd.values():
        s.check_free()


def test_second_turn_hits_the_prefill_prefix_cache(pd):
    ids = _prompts()[2]
    port = pd["prefill"].side.port
    _, (_, first) = _dual(pd, _req(ids, "turn-1", temperature=0, room=1, port=port))
    ids2 = ids + list(first.output_ids) + [7, 8, 9]
    want = _collect(pd["unified"].stub, _req(ids2, "turn-2u", temperature=0))[1]
    (_, pdone), (_, ddone) = _dual(pd, _req(ids2, "turn-2", temperature=0, room=2, port=port))
    assert pdone.cached_tokens > 0 and ddone.cached_tokens == pdone.cached_tokens
    assert list(ddone.output_ids) == list(want.output_ids)
    for s in pd.values():
        s.check_free()


def test_server_info_and_loads(pd):
    from google.protobuf.json_format import MessageToDict

    for role in ("prefill", "decode", "unified"):
        args = MessageToDict(pd[role].stub.GetServerInfo(pb.GetServerInfoRequest()).server_args)
        assert args["disaggregation_mode"] == (role if role != "unified" else "null")
        assert args["max_running_requests"] == 4
    assert MessageToDict(pd["prefill"].stub.GetServerInfo(pb.GetServerInfoRequest()).server_args)[
        "disaggregation_bootstrap_port"] == pd["prefill"].side.port
    load = pd["decode"].stub.GetLoads(pb.GetLoadsRequest()).loads[0]
    assert load.disaggregation.mode == "decode" and load.disaggregation.kv_transfer_speed_gb_s > 0
    assert pd["prefill"].stub.GetLoads(pb.GetLoadsRequest()).loads[0].disaggregation.mode == "prefill"


def test_faults_end_one_request_and_leak_nothing(pd):
    """No decode leg: the prefill fails UNAVAILABLE after its wait and computes nothing. A
    prefill that is not there: the decode fails UNAVAILABLE. A decode leg cancelled while it
    waits for the handoff frees its reservation, and the prefill's room ends."""
    ids = _prompts()[0]
    pre = pd["prefill"]
    pre.side.wait_s = 1.0
    try:
        t = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            _collect(pre.stub, _req(ids, "lonely", room=5, port=pre.side.port))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "decode" in e.value.details()
        assert time.monotonic() - t < 10
    finally:
        pre.side.wait_s = 30.0
    from _util import free_port

    with pytest.raises(grpc.RpcError) as e:
        _collect(pd["decode"].stub, _req(ids, "orphan", room=6, port=free_port()))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # a decode leg whose prefill never comes: cancelled by its client after a moment
    call = pd["decode"].stub.Generate(_req(ids, "cancelled", room=7, port=pre.side.port), timeout=60)
    time.sleep(1.0)
    call.cancel()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (len(pre.side.rooms) or pd["decode"].loop.stats()["running"]):
        time.sleep(0.1)
    assert len(pre.side.rooms) == 0
    for s in pd.values():
        s.check_free()
    # and the pair still serves
    want = _collect(pd["unified"].stub, _req(ids, "after-u", temperature=0))[1]
    _, (_, ddone) = _dual(pd, _req(ids, "after", temperature=0, room=8, port=pre.side.port))
    assert list(ddone.output_ids) == list(want.output_ids)


def test_first_token_that_stops_ends_the_decode_at_once(pd):
    """The prefill's first token is a stop id: the decode emits it and finishes with "stop"
    (its engine thread sleeps on its inbox meanwhile: the output must still go out)."""
    ids = _prompts()[0]
    first = _collect(pd["unified"].stub, _req(ids, "stop-u", temperature=0, max_new=1))[1].output_ids[0]
    (_, pdone), (_, ddone) = _dual(pd, _req(ids, "stop-pd", temperature=0, stop_token_ids=[first], room=9,
                                            port=pd["prefill"].side.port))
    assert list(ddone.output_ids) == [first] and ddone.finish_reason == "stop"
    assert ddone.matched_token_id == first
    for s in pd.values():
        s.check_free()


def test_replayer_dual_dispatch(pd):
    """``replay(..., prefill_target=...)`` (``k3serve bench pd``) sends each trace row to both
    servers as smg does: every request completes through the handoff."""
    from k3serve.server.client.replay import replay

    trace = [{"timestamp": 0, "input_length": 20, "output_length": 4, "hash_ids": [1, 2]},
             {"timestamp": 10, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]}]
    dec = pd["decode"].side
    before = dec.handoffs
    res = replay(f"127.0.0.1:{pd['decode'].server.port}", trace, block_size=16, concurrency=2, progress=False,
                 prefill_target=f"127.0.0.1:{pd['prefill'].server.port}", bootstrap_port=pd["prefill"].side.port)
    assert res["ok"] == 2 and res["failed"] == 0 and res["completion_tokens"] == 7
    assert dec.handoffs == before + 2
    for s in pd.values():
        s.check_free()


def test_min_tokens_on_the_prefill_leg(pd):
    """smg sends ``min_new_tokens`` to both legs: the prefill honours it for its one token and
    serves on (issue #32: the 1-token clamp raised and the engine thread died)."""
    ids = _prompts()[1]
    first = _collect(pd["unified"].stub, _req(ids, "mt-free", temperature=0, max_new=1))[1].output_ids[0]
    sp = dict(temperature=0, min_new_tokens=3, stop_token_ids=[first])
    want = _collect(pd["unified"].stub, _req(ids, "mt-u", **sp))[1]
    (_, pdone), (_, ddone) = _dual(pd, _req(ids, "mt-pd", room=21, port=pd["prefill"].side.port, **sp))
    assert list(pdone.output_ids) == list(want.output_ids[:1]) != [first]
    assert list(ddone.output_ids) == list(want.output_ids)
    for s in pd.values():
        s.check_free()


def test_a_late_decode_gets_the_prefills_failure_at_once(pd):
    """A prefill that refused a request (here: at validation) or gave up waiting for its
    decode leaves a tombstone: the decode that comes later fails at once with that status
    instead of holding its reservation for its whole wait (issue #32)."""
    pre, port = pd["prefill"], pd["prefill"].side.port
    ids = _prompts()[0]
    with pytest.raises(grpc.RpcError) as e:
        _collect(pre.stub, _req(ids, "late-1", max_new=1000, room=31, port=port))
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    pre.side.wait_s = 0.5
    try:
        with pytest.raises(grpc.RpcError) as e:
            _collect(pre.stub, _req(ids, "late-2", room=32, port=port))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        pre.side.wait_s = 30.0
    for rid, room, code in (("late-1", 31, grpc.StatusCode.OUT_OF_RANGE), ("late-2", 32, grpc.StatusCode.UNAVAILABLE)):
        t = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            _collect(pd["decode"].stub, _req(ids, rid, room=room, port=port), timeout=15)
        assert e.value.code() == code and "refused or gave up" in e.value.details()
        assert time.monotonic() - t < 5
    for s in pd.values():
        s.check_free()


def test_decode_reservations_waiting_idle_the_engine_and_count_down(pd):
    """Every decode slot held by a reservation whose prefill has not started, one more request
    queued: the decode's engine thread waits instead of spinning, GetLoads counts the queued
    one in ``decode_prealloc_queue_reqs`` and stops counting it once it is cancelled (issue
    #32: the count only ever grew); cancelling the rest frees everything."""
    dec, port = pd["decode"], pd["prefill"].side.port
    ids = _prompts()[0]
    calls = [dec.stub.Generate(_req(ids, f"hold-{i}", room=40 + i, port=port), timeout=60) for i in range(5)]

    def load():
        return dec.stub.GetLoads(pb.GetLoadsRequest()).loads[0].disaggregation

    try:
        deadline = time.monotonic() + 20
        while (load().decode_transfer_queue_reqs, load().decode_prealloc_queue_reqs) != (4, 1):
            assert time.monotonic() < deadline, load()
            time.sleep(0.05)
        n0 = dec.loop.num_steps
        time.sleep(1.0)
        assert dec.loop.num_steps - n0 < 100, f"{dec.loop.num_steps - n0} engine steps in a second"
        calls[4].cancel()
        deadline = time.monotonic() + 10
        while load().decode_prealloc_queue_reqs != 0:
            assert time.monotonic() < deadline, "decode_prealloc_queue_reqs stayed up after the cancel"
            time.sleep(0.05)
    finally:
        for c in calls:
            c.cancel()
    deadline = time.monotonic() + 20
    while load().decode_transfer_queue_reqs or dec.loop.stats()["running"] or len(pd["prefill"].side.rooms):
        assert time.monotonic() < deadline, load()
        time.sleep(0.1)
    for s in pd.values():
        s.check_free()


def test_bootstrap_calls_prove_the_cluster_secret(pd):
    """Without a proof, with another secret's, or replayed: UNAUTHENTICATED and no room is
    made. A decode holding another secret fails its request FAILED_PRECONDITION and the pair
    serves on. (Every other P/D test here runs with the right secret.)"""
    from k3serve.server.pd import bootstrap_pb2 as bpb
    from k3serve.server.pd import bootstrap_pb2_grpc as bpb_grpc
    from k3serve.server.pd.auth import BootstrapAuth
    from k3serve.server.pd.layout import cache_layout

    pre = pd["prefill"]
    stub = bpb_grpc.BootstrapStub(grpc.insecure_channel(f"127.0.0.1:{pre.side.port}"))
    layout = cache_layout(pd["decode"].loop.engine)
    reg = bpb.RegisterRequest(decode_id="probe", layout=layout)
    wait = bpb.AwaitHandoffRequest(decode_id="probe", bootstrap_room=50, request_id="probe", prompt_len=3, layout=layout)
    rel = bpb.ReleaseRequest(bootstrap_room=50, request_id="probe")
    wrong = BootstrapAuth(b"another-secret-0123456789")
    for call, req, name in ((stub.Register, reg, "Register"), (stub.AwaitHandoff, wait, "AwaitHandoff"),
                            (stub.Release, rel, "Release")):
        for md in ((), wrong.metadata(name, req)):
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=5, metadata=md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
    assert len(pre.side.rooms) == 0
    right = BootstrapAuth(SECRET)
    md = right.metadata("Register", reg)
    assert stub.Register(reg, timeout=5, metadata=md).compatible
    with pytest.raises(grpc.RpcError) as e:  # the same proof again
        stub.Register(reg, timeout=5, metadata=md)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    dec = pd["decode"].side
    ids = _prompts()[0]
    dec.auth, pre.side.wait_s = wrong, 1.0
    try:
        prefill_leg, decode_leg = _dual(pd, _req(ids, "bad-secret", room=51, port=pre.side.port))
    finally:
        dec.auth, pre.side.wait_s = right, 30.0
    assert isinstance(decode_leg, grpc.RpcError) and decode_leg.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert isinstance(prefill_leg, grpc.RpcError) and prefill_leg.code() == grpc.StatusCode.UNAVAILABLE
    want = _collect(pd["unified"].stub, _req(ids, "secret-u", temperature=0))[1]
    _, (_, ddone) = _dual(pd, _req(ids, "secret-ok", temperature=0, room=52, port=pre.side.port))
    assert list(ddone.output_ids) == list(want.output_ids)
    for s in pd.values():
        s.check_free()


def test_handoffs_over_the_memory_bound_are_refused(pd):
    """A handoff larger than the whole ``--pd-handoff-memory-gb``: on the prefill, both legs
    fail RESOURCE_EXHAUSTED before anything is computed; on the decode, its request does (the
    prefill leg then finds no decode). GetLoads reports the memory set aside. Nothing leaks."""
    pre, dec, port = pd["prefill"].side, pd["decode"].side, pd["prefill"].side.port
    ids = _prompts()[2]
    steps = pd["prefill"].loop.engine.num_steps
    pre.budget.limit = 1000
    try:
        prefill_leg, decode_leg = _dual(pd, _req(ids, "big-1", room=61, port=port))
    finally:
        pre.budget.limit = None
    for leg in (prefill_leg, decode_leg):
        assert isinstance(leg, grpc.RpcError) and leg.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, leg
        assert "handoff memory" in leg.details()
    assert pd["prefill"].loop.engine.num_steps == steps  # nothing computed
    dec.budget.limit, pre.wait_s = 1000, 1.0
    try:
        prefill_leg, decode_leg = _dual(pd, _req(ids, "big-2", room=62, port=port))
    finally:
        dec.budget.limit, pre.wait_s = None, 30.0
    assert isinstance(decode_leg, grpc.RpcError) and decode_leg.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(prefill_leg, grpc.RpcError) and prefill_leg.code() == grpc.StatusCode.UNAVAILABLE
    assert pre.budget.in_use == 0 and dec.budget.in_use == 0
    assert pd["decode"].stub.GetLoads(pb.GetLoadsRequest()).loads[0].memory.kv_cache_gb > 0
    for s in pd.values():
        s.check_free()
