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
            self.side = self.servicer.pd_prefill = PrefillSide(self.loop.engine, host="127.0.0.1",
                                                               bootstrap_port=bootstrap_port, wait_s=wait_s, stage_s=20)
        elif role == "decode":
            self.side = self.servicer.pd_decode = DecodeSide(self.loop.engine, await_s=30, transfer_s=20)
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
