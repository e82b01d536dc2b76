"""P/D through the router nobody here wrote: PyPI ``smg`` in ``--pd-disaggregation`` mode in
front of a k3serve prefill server and a k3serve decode server (issue #16). smg sends each
request to both at once with the same bootstrap room; its output must be token-identical to a
unified k3serve asked directly, for completions and chat, streaming and not, and 16
concurrent requests with some cancelled must leave no page or slot held on either side."""
from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from _util import assert_all_free, free_port, tiny_text_checkpoint, tool_path

SMG = tool_path("smg")
pytestmark = [pytest.mark.skipif(SMG is None, reason="smg (dev extra) is not installed"),
              pytest.mark.slow]  # three k3serve servers in this process and the smg router in its own


def _server(ckpt, tok, role, **pd):
    from k3serve.model import load_pretrained
    from k3serve.server.api.engine_thread import EngineThread
    from k3serve.server.api.grpc_service import GrpcServer, Servicer
    from k3serve.server.engine.engine import Engine
    from k3serve.server.pd.decode import DecodeSide
    from k3serve.server.pd.prefill import PrefillSide

    eng = Engine(load_pretrained(ckpt), max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, page_size=16,
                 max_model_len=256, detokenizer=tok.detokenizer)
    loop = EngineThread(eng)
    servicer = Servicer(model_dir=ckpt, served_model_name="k3-tiny-text")
    server = GrpcServer(servicer, host="127.0.0.1", port=0)
    side = None
    if role == "prefill":
        side = servicer.pd_prefill = PrefillSide(eng, host="127.0.0.1", bootstrap_port=pd["bootstrap_port"])
    elif role == "decode":
        side = servicer.pd_decode = DecodeSide(eng)
    server.set_ready(loop)
    return {"server": server, "loop": loop, "side": side, "port": server.port}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from k3serve.server.text.tokenizer import load_tokenizer

    ckpt = tiny_text_checkpoint(tmp_path_factory.mktemp("ckpt"))
    tok = load_tokenizer(ckpt)
    boot = free_port()
    servers = {"unified": _server(ckpt, tok, "unified"), "prefill": _server(ckpt, tok, "prefill", bootstrap_port=boot),
               "decode": _server(ckpt, tok, "decode")}
    http, prom = free_port(), free_port()
    log = open(tmp_path_factory.mktemp("smg") / "smg.log", "w+")
    router = subprocess.Popen([SMG, "launch", "--pd-disaggregation",
                               "--prefill", f"grpc://127.0.0.1:{servers['prefill']['port']}", str(boot),
                               "--decode", f"grpc://127.0.0.1:{servers['decode']['port']}",
                               "--model-path", str(ckpt), "--host", "127.0.0.1", "--port", str(http),
                               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)],
                              stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    channel = grpc.insecure_channel(f"127.0.0.1:{servers['unified']['port']}")
    try:
        t = time.monotonic() + 120
        while True:
            assert router.poll() is None, _tail(log)
            try:
                models = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=2).read())
                if models.get("data"):
                    break
            except OSError:
                pass
            assert time.monotonic() < t, _tail(log)
            time.sleep(0.3)
        yield {"base": base, "tok": tok, "stub": pb_grpc.SglangSchedulerStub(channel), "model": models["data"][0]["id"],
               "servers": servers, "log": log}
    finally:
        channel.close()
        router.terminate()
        try:
            router.wait(20)
        except subprocess.TimeoutExpired:
            router.kill()
        for s in servers.values():
            s["server"].shutdown(grace_s=5)
            if s["side"] is not None:
                s["side"].stop()
        log.close()


def _tail(log):
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


def _post(url, body, stream=False, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if not stream:
            return json.loads(r.read())
        events = []
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
        return events


def _unified(stack, ids, max_new):
    req = pb.GenerateRequest(request_id=f"u-{time.monotonic_ns()}", tokenized=pb.TokenizedInput(input_ids=ids),
                             stream=False, sampling_params=pb.SamplingParams(max_new_tokens=max_new))
    done = [r.complete for r in stack["stub"].Generate(req, timeout=120)][-1]
    return list(done.output_ids)


def _all_free(stack):
    for s in stack["servers"].values():
        t = time.monotonic() + 30
        while s["loop"].stats()["active_requests"] and time.monotonic() < t:
            time.sleep(0.1)
        s["loop"].call(assert_all_free, timeout=30)


def test_completions_through_smg_pd_equal_unified(stack):
    tok = stack["tok"]
    # 60+ tokens: the prompt crosses page boundaries (pages of 16)
    prompt = "import os\ndef main():\n    path = os.path.join(os.getcwd(), 'data')\n    for name in os.listdir(path):"
    ids = tok.encode(prompt)
    assert len(ids) > 32
    want = _unified(stack, ids, 12)
    want_text = tok.decode(want, skip_special_tokens=True)
    body = {"model": stack["model"], "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = _post(stack["base"] + "/v1/completions", body)
    assert r["choices"][0]["text"] == want_text, _tail(stack["log"])
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == len(want)
    ev = _post(stack["base"] + "/v1/completions", {**body, "stream": True}, stream=True)
    assert "".join(e["choices"][0].get("text", "") for e in ev if e.get("choices")) == want_text
    # a second turn over the first: the prefill's prefix cache serves the shared part
    prompt2 = prompt + want_text + "\n        print(name)"
    ids2 = tok.encode(prompt2)
    want2 = _unified(stack, ids2, 8)
    r2 = _post(stack["base"] + "/v1/completions", {**body, "prompt": prompt2, "max_tokens": 8})
    assert r2["choices"][0]["text"] == tok.decode(want2, skip_special_tokens=True)
    assert stack["servers"]["prefill"]["loop"].stats()["prefix_hit_tokens"] > 0
    # it went the P/D way: every request handed over, none computed by the decode
    pre, dec = stack["servers"]["prefill"]["side"], stack["servers"]["decode"]["side"]
    assert pre.rooms.handoffs == dec.handoffs == 3 and dec.bytes_received > 0
    assert stack["servers"]["decode"]["loop"].stats()["prompt_tokens_computed"] == 0
    _all_free(stack)


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
    _all_free(stack)


def test_sixteen_concurrent_with_a_third_cancelled(stack):
    """16 streaming completions at once through smg; every third client hangs up after its
    first event. The others equal the unified server's; nothing stays held on either side."""
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
    for i, text in got.items():
        assert text == want[i], (i, _tail(stack["log"]))
    assert len(got) == 16 - len(range(0, 16, 3))
    _all_free(stack)
    assert len(stack["servers"]["prefill"]["side"].rooms) == 0
