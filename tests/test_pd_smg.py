"""P/D as deployed (issue #16): ``k3serve serve --role prefill`` and ``--role decode``, each its
own process, and PyPI ``smg`` in ``--pd-disaggregation`` mode in front of them, started first so
that it registers both while they load (issue #32). smg sends each
request to both servers at once with the same bootstrap room. Its output must be
token-identical to a unified k3serve asked directly: completions and chat, streaming and not,
and a second turn that hits the prefill's prefix cache. 16 concurrent streams, with every third
one hung up, leave no request, page or room held on either side. Then the kill tests: a decode
killed after it registered its room (the prefill frees it within its staging deadline and
serves on), and a prefill killed while a decode waits for it (that request fails UNAVAILABLE
within seconds, nothing leaks, and the decode serves on with a live prefill)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from _util import (ROUTER_HEALTH, assert_all_free, free_port, log_tail, pd_idle, post_json as _post, stop_process,
                   tiny_text_checkpoint, tool_path, wait_for_router, wait_scheduler_healthy)

SMG = tool_path("smg")
pytestmark = [pytest.mark.skipif(SMG is None, reason="smg (dev extra) is not installed"),
              pytest.mark.slow]  # two server processes, the router, and two in-process engines

# the engine of test_smg_router.py: one of the two modules compiles it, the other loads it
FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--chunk-size", "32", "--page-size", "16",
         "--max-model-len", "256"]
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=64, chunk_size=32, page_size=16, max_model_len=256)
SECRET = b"smg-test-cluster-secret-0123"


class Local:
    """An in-process server: the unified reference, or the decode of the prefill-kill test."""

    def __init__(self, ckpt, tok, role):
        from k3serve.checkpoints import load_pretrained
        from k3serve.server.api.engine_thread import EngineThread
        from k3serve.server.api.grpc_service import GrpcServer, Servicer
        from k3serve.server.engine.engine import Engine
        from k3serve.server.pd.decode import DecodeSide

        self.loop = EngineThread(Engine(load_pretrained(ckpt), detokenizer=tok.detokenizer, **ENGINE))
        self.servicer = Servicer(model_dir=ckpt)
        self.server = GrpcServer(self.servicer, host="127.0.0.1", port=0)
        self.side = self.servicer.pd_decode = DecodeSide(self.loop.engine, transfer_s=10, secret=SECRET) \
            if role == "decode" else None
        self.server.set_ready(self.loop)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)

    def close(self):
        self.channel.close()
        self.server.shutdown(grace_s=5)
        if self.side is not None:
            self.side.stop()


class Proc:
    """``k3serve serve --role ROLE`` in its own process."""

    def __init__(self, ckpt, role, env, boot=None, port=None):
        self.port, self.boot = port or free_port(), boot
        extra = ["--bootstrap-port", str(boot), "--pd-wait", "5", "--pd-transfer-timeout", "5"] if boot else []
        self.proc = subprocess.Popen([sys.executable, "-m", "k3serve.server.cli", "serve", "--model", str(ckpt),
                                      "--port", str(self.port), "--metrics-port", "-1", "--role", role, *FLAGS,
                                      *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)

    def wait_healthy(self, timeout=300):
        wait_scheduler_healthy(self.stub, [self.proc], lambda i: self.proc.stdout.read(), timeout)

    def load(self):
        return self.stub.GetLoads(pb.GetLoadsRequest(), timeout=10).loads[0]

    def idle(self) -> bool:
        """Nothing running or waiting, no page held by a request, no P/D queue."""
        return pd_idle(self.stub)

    def close(self):
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, cache_home):
    from k3serve.server.text.tokenizer import load_tokenizer

    ckpt = tiny_text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    tok = load_tokenizer(ckpt)
    # the server processes share this session's compilation cache: the unified engine's warm-up
    # compiles what their warm-ups load
    # ... and one cluster secret: every bootstrap call below is authenticated
    env = dict(os.environ, K3SERVE_CACHE=cache_home, K3SERVE_CLUSTER_SECRET=SECRET.decode())
    made, router, log = [], None, open(tmp_path_factory.mktemp("smg") / "smg.log", "w+")
    try:
        uni = Local(ckpt, tok, "unified")
        made.append(uni)
        # the router first, as a deployment that starts everything at once (issue #32): it
        # registers both servers while they load, and must route to them once they serve
        pre_port, boot, dec_port, http, prom = (free_port() for _ in range(5))
        router = subprocess.Popen([SMG, "launch", "--pd-disaggregation", "--prefill", f"grpc://127.0.0.1:{pre_port}",
                                   str(boot), "--decode", f"grpc://127.0.0.1:{dec_port}", "--model-path", str(ckpt),
                                   "--host", "127.0.0.1", "--port", str(http), "--prometheus-host", "127.0.0.1",
                                   "--prometheus-port", str(prom), "--worker-startup-check-interval", "1",
                                   *ROUTER_HEALTH],
                                  stdout=log, stderr=subprocess.STDOUT)
        pre, dec = Proc(ckpt, "prefill", env, boot=boot, port=pre_port), Proc(ckpt, "decode", env, port=dec_port)
        made += [pre, dec]
        local_dec = Local(ckpt, tok, "decode")
        made.append(local_dec)
        pre.wait_healthy()
        dec.wait_healthy()
        base = f"http://127.0.0.1:{http}"
        model = wait_for_router(base, router, log)
        assert model == ckpt.name, log_tail(log)  # not "unknown": both were registered by name
        yield {"base": base, "tok": tok, "model": model, "uni": uni, "pre": pre, "dec": dec,
               "local_dec": local_dec, "log": log}
    finally:
        stop_process(router)
        for s in made:
            s.close()
        log.close()


def _gen(stub, ids, max_new, rid=None, room=None, boot=None, **sp):
    req = pb.GenerateRequest(request_id=rid or f"u-{time.monotonic_ns()}", tokenized=pb.TokenizedInput(input_ids=ids),
                             stream=False, sampling_params=pb.SamplingParams(max_new_tokens=max_new, **sp))
    if room is not None:
        req.disaggregated_params.CopyFrom(pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=boot,
                                                                 bootstrap_room=room))
    return [r.complete for r in stub.Generate(req, timeout=120)][-1]


def _unified(stack, ids, max_new, **sp):
    return list(_gen(stack["uni"].stub, ids, max_new, **sp).output_ids)


def _until(cond, timeout, what=""):
    t = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t, f"timed out: {what}"
        time.sleep(0.1)


def _both_idle(stack):
    for s in (stack["pre"], stack["dec"]):
        _until(s.idle, 30, "a server still holds requests")


def test_completions_through_smg_pd_equal_unified(stack):
    tok = stack["tok"]
    # over 32 tokens: the prompt crosses page boundaries (pages of 16)
    prompt = "import os\ndef main():\n    path = os.path.join(os.getcwd(), 'data')\n    for name in os.listdir(path):"
    ids = tok.encode(prompt)
    assert len(ids) > 32
    want = _unified(stack, ids, 12)
    want_text = tok.decode(want, skip_special_tokens=True)
    body = {"model": stack["model"], "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = _post(stack["base"] + "/v1/completions", body)
    assert r["choices"][0]["text"] == want_text, log_tail(stack["log"])
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == len(want)
    ev = _post(stack["base"] + "/v1/completions", {**body, "stream": True}, stream=True)
    assert "".join(e["choices"][0].get("text", "") for e in ev if e.get("choices")) == want_text
    # a second turn over the first: the prefill's prefix cache serves the shared part; with
    # min_tokens and a stop string, which smg sends to the prefill leg too (issue #32)
    prompt2 = prompt + want_text + "\n        print(name)"
    stop = ["<|no such text|>"]
    want2 = _unified(stack, tok.encode(prompt2), 8, min_new_tokens=3, stop=stop)
    r2 = _post(stack["base"] + "/v1/completions", {**body, "prompt": prompt2, "max_tokens": 8, "min_tokens": 3,
                                                   "stop": stop})
    assert r2["choices"][0]["text"] == tok.decode(want2, skip_special_tokens=True)
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # it went the P/D way: the prefill handed over, the decode computed no prompt token
    pre, dec = stack["pre"].load().disaggregation, stack["dec"].load().disaggregation
    assert pre.mode == "prefill" and dec.mode == "decode" and dec.kv_transfer_speed_gb_s > 0
    _both_idle(stack)


def test_chat_through_smg_pd_equal_unified(stack):
    from k3serve.server.text.chat import encode_chat

    tok = stack["tok"]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    ids = encode_chat(tok, messages, thinking=False)
    want = _unified(stack, ids, 10)
    want_text = tok.decode(want, skip_special_tokens=True)
    body = {"model": stack["model"], "messages": messages, "max_tokens": 10, "temperature": 0}
    r = _post(stack["base"] + "/v1/chat/completions", body)
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == len(want)
    assert (r["choices"][0]["message"]["content"] or "") == want_text
    ev = _post(stack["base"] + "/v1/chat/completions", {**body, "stream": True}, stream=True)
    assert "".join((e["choices"][0].get("delta", {}).get("content") or "") for e in ev if e.get("choices")) == want_text
    _both_idle(stack)


def test_sixteen_concurrent_with_a_third_cancelled(stack):
    tok = stack["tok"]
    prompts = [f"def f{i}(x):\n    return x * {i} +" for i in range(16)]
    want = {i: tok.decode(_unified(stack, tok.encode(p), 10), skip_special_tokens=True) for i, p in enumerate(prompts)}
    got, errors = {}, []

    def client(i):
        body = {"model": stack["model"], "prompt": prompts[i], "max_tokens": 10, "temperature": 0, "stream": True}
        req = urllib.request.Request(stack["base"] + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=180) as r:
                text = ""
                for line in r:
                    line = line.decode().strip()
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    if i % 3 == 0:
                        return  # hang up mid-stream
                    ev = json.loads(line[5:])
                    text += "".join(c.get("text", "") for c in ev.get("choices", []))
                got[i] = text
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    ts = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(240)
    assert not errors, errors
    assert {i: got[i] for i in got} == {i: want[i] for i in got}, log_tail(stack["log"])
    assert len(got) == 16 - len(range(0, 16, 3))
    _both_idle(stack)


def test_replayer_through_smg(stack):
    """``replay(..., router_url=...)`` (``k3serve bench pd --via smg``) sends each trace row to
    smg's ``/generate`` with its token ids; smg dispatches both legs. Every request completes
    with its output length, token times are recorded, and both servers end idle."""
    from k3serve.server.client.replay import replay

    trace = [{"timestamp": 0, "input_length": 20, "output_length": 4, "hash_ids": [1, 2]},
             {"timestamp": 10, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]},
             {"timestamp": 20, "input_length": 36, "output_length": 5, "hash_ids": [4, 5, 6]}]
    res = replay(f"127.0.0.1:{stack['dec'].port}", trace, block_size=16, concurrency=2, progress=False,
                 router_url=stack["base"], vocab_size=4096, avoid_ids=[0, 1, 2, 3])
    assert res["ok"] == 3 and res["failed"] == 0, res["errors"]
    assert res["completion_tokens"] == 12 and res["output_length_mismatches"] == 0
    assert res["prompt_tokens"] == 96 and res["ttft_ms"]["n"] == 3 and res["tpot_ms"]["n"] == 3
    _both_idle(stack)


IDS = list(range(5, 45))  # 40 tokens: three pages of 16


def test_decode_killed_after_registering(stack):
    """The decode process dies after it reserved and registered its room: the prefill leg
    ends (its token, or an error), the room and any staged arrays go within the staging
    deadline (5 s here), and the prefill serves on."""
    pre, dec = stack["pre"], stack["dec"]
    box = {}

    def leg(name, stub):
        try:
            box[name] = _gen(stub, IDS, 6, rid="k-dec", room=43, boot=pre.boot)
        except grpc.RpcError as e:
            box[name] = e

    td = threading.Thread(target=leg, args=("d", dec.stub))
    td.start()
    _until(lambda: pre.load().disaggregation.prefill_inflight_queue_reqs == 1, 60, "the decode never registered")
    tp = threading.Thread(target=leg, args=("p", pre.stub))
    tp.start()
    dec.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    tp.join(60)
    td.join(60)
    _until(pre.idle, 20, "the prefill kept the room or the request")
    assert time.monotonic() - killed < 20
    assert list(_gen(pre.stub, IDS, 6).output_ids) == _unified(stack, IDS, 6)  # unified on the prefill


def test_prefill_killed_while_its_decode_waits(stack):
    """The prefill process dies while a decode waits for its handoff: that request fails
    UNAVAILABLE within seconds, the decode holds nothing afterwards, and it serves on."""
    pre, dec = stack["pre"], stack["local_dec"]
    box = {}

    def leg():
        try:
            box["d"] = _gen(dec.stub, IDS, 6, rid="k-pre", room=44, boot=pre.boot)
        except grpc.RpcError as e:
            box["d"] = e

    t = threading.Thread(target=leg)
    t.start()
    _until(lambda: pre.load().disaggregation.prefill_inflight_queue_reqs == 1, 60, "the decode never registered")
    pre.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    t.join(60)
    err = box["d"]
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert time.monotonic() - killed < 15
    _until(lambda: dec.loop.stats()["active_requests"] == 0, 10)
    dec.loop.call(assert_all_free, timeout=30)
    assert list(_gen(dec.stub, IDS, 6).output_ids) == _unified(stack, IDS, 6)  # and serves on
